"""The artifact store on s3:// against a real S3 protocol server (moto) on 127.0.0.1.

One moto server per test session; every test uses its own bucket. The tiny pipeline runs
end to end with `--store s3://...` through `trainflow` subprocesses that read the endpoint
and credentials from the environment, as a user's would.
"""

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax.numpy as jnp
import pytest
import s3fs
import yaml
from etils.epath import backend as epath_backend

from engine.train.checkpoint import Checkpointer, verify_step
from tests.conftest import REPO, child_xla_flags
from tests.deps import need

moto_server = need("moto.server")
boto3 = need("boto3")
need("s3fs")

STEPS = 20
EXIT_ABORT = "FATAL: exception not rethrown"


def _forget_s3_clients() -> None:
    s3fs.S3FileSystem.clear_instance_cache()
    epath_backend._FileSystemSpecBackend._get_filesystem.cache_clear()
    boto3.DEFAULT_SESSION = None


@pytest.fixture(scope="module")
def s3_endpoint(tmp_path_factory):
    """A moto S3 server on a free loopback port, and the environment that points at it (for this
    module only: the variables are restored after it, so no other test sees them)."""
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "TRAINFLOW_CACHE": str(tmp_path_factory.mktemp("s3-cache")),
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    # fsspec keeps one S3 file system per set of arguments, etils' epath one per protocol and
    # boto3 its default session: each made under an earlier module's server keeps its endpoint.
    _forget_s3_clients()
    try:
        yield env
    finally:
        server.stop()
        _forget_s3_clients()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


_count = iter(range(10_000))


@pytest.fixture
def bucket(s3_endpoint) -> str:
    name = f"trainflow-test-{next(_count)}-{os.getpid()}"
    boto3.client("s3", endpoint_url=s3_endpoint["AWS_ENDPOINT_URL"]).create_bucket(Bucket=name)
    return name


def engine_descendants(pid: int) -> list[int]:
    """The engine stage processes (`python -m engine....`) below `pid`, from /proc."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
    below, frontier = [], [pid]
    while frontier:
        frontier = [p for p, parent in parents.items() if parent in frontier]
        below += frontier
    found = []
    for p in below:
        with contextlib.suppress(OSError):
            if b"engine." in (Path("/proc") / str(p) / "cmdline").read_bytes():
                found.append(p)
    return found


class Stalled(AssertionError):
    """A `trainflow` run that did not finish in its time (its processes are killed)."""


THREAD = re.compile(r"(Current thread|Thread) 0x[0-9a-f]+ \(most recent call first\):")
IDLE = ("threading.py", "concurrent/futures/thread.py", "queue.py", "selectors.py", "multiprocessing/queues.py")


def busy_threads(text: str) -> str:
    """`text` with the stacks of idle threads (ones whose every frame is a thread pool's, a
    queue's or a lock's wait) left out and counted: a stalled process's dump is mostly
    idle pool threads, and only its last 20,000 characters are shown."""
    out: list[str] = []
    block: list[str] = []
    idle = 0

    def close() -> None:
        nonlocal idle
        frames = [line for line in block[1:] if 'File "' in line]
        if block and frames and all(any(name in line for name in IDLE) for line in frames):
            idle += 1
        else:
            out.extend(block)
        block.clear()

    for line in text.splitlines():
        if THREAD.search(line):
            close()
            block.append(line)
        elif block and 'File "' in line:
            block.append(line)
        else:
            close()
            out.append(line)
    close()
    return "\n".join(out) + (f"\n({idle} idle threads left out)" if idle else "")


def trainflow(*args, check: bool = True, env: dict | None = None, timeout: float = 600):
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    # One CPU device, LLVM -O0 as the test process compiles (tests/conftest.py): the fastest compile.
    full_env["XLA_FLAGS"] = child_xla_flags()
    # CPU only: a TPU runtime plugin installed beside jax (libtpu) aborts the process at exit
    # ("FATAL: exception not rethrown") on machines without a TPU.
    full_env.setdefault("JAX_PLATFORMS", "cpu")
    argv = [sys.executable, "-m", "flows.cli", *map(str, args)]
    with subprocess.Popen(
        argv, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    ) as child:
        try:
            stdout, stderr = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            # Where it waits: the CLI and the engine processes it started print every thread's
            # stack on SIGUSR1 (flows/cli.py, engine/train/cli.py); then the whole process group
            # goes, the engine processes included.
            for pid in [child.pid, *engine_descendants(child.pid)]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGUSR1)
            try:
                stdout, stderr = child.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)
                stdout, stderr = child.communicate()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            raise Stalled(
                f"trainflow {' '.join(map(str, args))} did not finish in {timeout:.0f} s; its output, "
                f"then every busy thread's stack at that moment:\n{stdout[-3000:]}\n{busy_threads(stderr)[-20000:]}"
            ) from None
    proc = subprocess.CompletedProcess(argv, child.returncode, stdout, stderr)
    if (
        proc.returncode == -6
        and proc.stderr.rstrip().endswith(EXIT_ABORT)
        and args[0] == "run"
        and "\nlineage of " in proc.stdout
    ):
        # KNOWN, not this module's: on this machine `trainflow run` (local stores too) aborts
        # in native code at interpreter exit after finishing and printing its report. The
        # store is checked by the tests themselves.
        proc.returncode = 0
    if check and proc.returncode != 0:
        raise AssertionError(
            f"trainflow {' '.join(map(str, args))} exited {proc.returncode}:\n"
            f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return proc


def tiny_pipeline(directory: Path) -> Path:
    """configs/pipelines/tiny.yaml with a smaller corpus (the step count is overridden on the CLI)."""
    tree = yaml.safe_load((REPO / "configs/pipelines/tiny.yaml").read_text())
    tree["stages"]["tokenize"]["config"]["sources"] = [{"format": "text", "path": "{stdlib}/[a-c]*.py"}]
    tree["stages"]["tokenize"]["config"]["validation_fraction"] = 0.1
    tree["stages"]["tokenize"]["config"]["tokenizer"]["vocab_size"] = 300
    tree["stages"]["pretrain"]["config"]["data"] = {"seq_len": 64, "batch_size": 8, "eval_batches": 2}
    tree["stages"]["pretrain"]["config"]["eval_every"] = 10
    tree["stages"]["pretrain"]["config"]["checkpoint"] = {"every_steps": 10, "async_save": False}
    path = directory / "tiny.yaml"
    path.write_text(yaml.safe_dump(tree, sort_keys=False))
    return path


# --------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def finished(prefect_server, s3_endpoint, tmp_path_factory):
    name = f"trainflow-e2e-{os.getpid()}"
    boto3.client("s3", endpoint_url=s3_endpoint["AWS_ENDPOINT_URL"]).create_bucket(Bucket=name)
    store = f"s3://{name}/runs/x"
    pipeline = tiny_pipeline(tmp_path_factory.mktemp("pipeline"))
    proc = trainflow("run", pipeline, "--store", store, f"pretrain.steps={STEPS}")
    return store, pipeline, proc


def pretrain_id(finished) -> str:
    """The pretrain artifact's id, from the lineage line `trainflow run` printed (the tests that
    only need the id start no `trainflow ls` of their own: test_verify_and_lineage_on_s3 checks
    that listing)."""
    store, _, proc = finished
    (artifact,) = re.findall(rf"\(trainflow lineage {re.escape(store)}/pretrain/([0-9a-f]+)\)", proc.stdout)
    return artifact


def test_tiny_pipeline_on_s3_every_stage_complete(finished):
    store, pipeline, _ = finished
    status = json.loads(trainflow("status", pipeline, "--store", store, f"pretrain.steps={STEPS}", "--json").stdout)
    assert status["store"] == store
    assert {row["stage"]: row["state"] for row in status["stages"]} == {"tokenize": "complete", "pretrain": "complete"}
    client = boto3.client("s3")
    bucket, prefix = store.removeprefix("s3://").split("/", 1)
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"]]
    assert any("/checkpoint/" in k for k in keys), keys
    assert not any(k.endswith(".lease") for k in keys), "leases are released"
    listing = trainflow("ls", "--store", store).stdout
    assert "tokenize" in listing and "pretrain" in listing and "complete" in listing


def test_verify_and_lineage_on_s3(finished):
    store, pipeline, _ = finished
    rows = json.loads(trainflow("ls", "--store", store, "--json").stdout)
    pretrain = next(r for r in rows if r["stage"] == "pretrain")
    assert pretrain["id"] == pretrain_id(finished)
    out = trainflow("verify", pretrain["id"], "--store", store).stdout
    assert out.startswith(f"OK {store}/pretrain/{pretrain['id']}")
    out = trainflow("verify", f"{store}/pretrain/{pretrain['id']}").stdout  # the artifact's URL works too
    assert out.startswith("OK ")
    text = trainflow("lineage", pretrain["id"][:6], "--store", store).stdout
    assert "pretrain" in text and "tokenize" in text
    tree = json.loads(trainflow("lineage", pretrain["id"], "--store", store, "--json").stdout)
    assert tree["parents"][0]["stage"] == "tokenize" and tree["parents"][0]["status"] == "complete"
    # Users see where the artifacts live, not the local staging copies.
    assert tree["path"] == f"{store}/pretrain/{pretrain['id']}"
    assert tree["parents"][0]["path"] == f"{store}/tokenize/{tree['parents'][0]['id']}"
    assert f"(trainflow lineage {store}/pretrain/{pretrain['id']})" in finished[2].stdout


def test_rerun_on_s3_skips_everything(finished):
    store, pipeline, _ = finished
    proc = trainflow("run", pipeline, "--store", store, f"pretrain.steps={STEPS}")
    assert proc.stdout.count("skipped") >= 2, proc.stdout[-2000:]
    assert "ran" not in {
        line.split()[2]
        for line in proc.stdout.splitlines()
        if line.split()[:1] in (["tokenize"], ["pretrain"]) and len(line.split()) > 2
    }


def test_generate_from_a_bucket_artifact_on_a_fresh_machine(finished, tmp_path):
    """`generate` downloads the checkpoint (verified) into an empty cache and samples from it."""
    store, _, _ = finished
    artifact = pretrain_id(finished)
    cache = tmp_path / "fresh"
    proc = trainflow(
        "generate",
        artifact,
        "--store",
        store,
        "--prompt",
        "import",
        "--max-new-tokens",
        "3",
        "--temperature",
        "0",
        "--json",
        env={"TRAINFLOW_CACHE": str(cache)},
    )
    sampled = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sampled["prompt"] == "import"
    assert list(cache.glob(f"*/pretrain/{artifact}/checkpoint/{STEPS}/digests.json"))
    # The engine alone, given the artifact's URL: the checkpoint and its tokenizer read there.
    engine = subprocess.run(
        [sys.executable, "-m", "engine.inference.generate", f"{store}/pretrain/{artifact}", "--prompt", "import"]
        + ["--max-new-tokens", "3", "--temperature", "0", "--json"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "XLA_FLAGS": child_xla_flags(), "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert engine.returncode == 0, engine.stderr[-3000:]
    assert json.loads(engine.stdout.strip().splitlines()[-1]) == sampled


def test_tampered_checkpoint_object_fails_verify(finished, tmp_path):
    """Runs last in this module: it damages the store the tests above share."""
    store, _, _ = finished
    artifact = pretrain_id(finished)
    bucket, prefix = store.removeprefix("s3://").split("/", 1)
    client = boto3.client("s3")
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/pretrain/")["Contents"]]
    victim = max(
        (k for k in keys if "/checkpoint/" in k),
        key=lambda k: client.head_object(Bucket=bucket, Key=k)["ContentLength"],
    )
    body = bytearray(client.get_object(Bucket=bucket, Key=victim)["Body"].read())
    body[len(body) // 2] ^= 0xFF
    client.put_object(Bucket=bucket, Key=victim, Body=bytes(body))
    proc = trainflow("verify", artifact, "--store", store, check=False)
    assert proc.returncode == 1
    assert "sha256 differs" in proc.stderr and victim.rsplit("/checkpoint/", 1)[1] in proc.stderr


# --------------------------------------------------------------------------- errors before compute


def test_missing_bucket_is_one_line_before_compute(s3_endpoint, tmp_path):
    pipeline = tiny_pipeline(tmp_path)
    start = time.monotonic()
    proc = trainflow("run", pipeline, "--store", "s3://no-such-bucket-here/x", check=False)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "s3://no-such-bucket-here/x" in lines[0] and "does not exist" in lines[0]
    assert time.monotonic() - start < 60
    for command in (("ls",), ("verify", "abc")):
        proc = trainflow(*command, "--store", "s3://no-such-bucket-here/x", check=False)
        assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr


def test_missing_credentials_is_one_line(s3_endpoint, bucket, tmp_path):
    env = {
        "AWS_ACCESS_KEY_ID": "",
        "AWS_SECRET_ACCESS_KEY": "",
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
        "AWS_CONFIG_FILE": str(tmp_path / "none"),
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    proc = trainflow("ls", "--store", f"s3://{bucket}/x", check=False, env=env)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and f"s3://{bucket}/x" in proc.stderr, proc.stderr
    assert "credentials" in proc.stderr


# --------------------------------------------------------------------------- leases


def test_second_lease_waits_then_expired_lease_is_taken_over(bucket):
    from tasks.store.base import ArtifactStore

    store = ArtifactStore(f"s3://{bucket}/leases")
    first = store.remote.lease("stage", "abc", "run-1")
    second = store.remote.lease("stage", "abc", "run-2")
    first.seconds = 3.0
    assert first.acquire(blocking=False)
    assert store.state("stage", "abc") == "running"
    assert not second.try_acquire(), "the conditional create answers 412 to the second run"
    messages = []
    # The holder keeps renewing: the second run waits, and says who holds it.
    waiter = threading.Thread(
        target=lambda: second.acquire(poll_seconds=0.2, on_wait=messages.append, wait_message_every=0.5)
    )
    waiter.start()
    time.sleep(5)  # longer than the lease: renewals keep it
    assert waiter.is_alive() and messages and "run-1" in messages[0]
    # The holder dies without releasing (no more renewals): the lease expires and is taken over.
    first._stop.set()
    first._thread.join()
    waiter.join(timeout=15)
    assert not waiter.is_alive()
    assert second.holder()["run_id"] == "run-2"
    second.release()
    assert second.holder() is None


def test_lease_is_a_conditional_create(bucket):
    """Two racers on one key: exactly one conditional create wins."""
    from tasks.store.base import ArtifactStore

    store = ArtifactStore(f"s3://{bucket}/race")
    leases = [store.remote.lease("s", "id", f"run-{i}") for i in range(8)]
    results = [None] * len(leases)

    def take(i):
        results[i] = leases[i]._client_put(leases[i]._body(), if_none_match=True)

    threads = [threading.Thread(target=take, args=(i,)) for i in range(len(leases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(results) == 1


def test_a_forked_holder_is_judged_by_its_own_start_time(bucket):
    """A process forked after the lease module was used (a worker of a running stage) records
    its own start time in its lease, not its parent's: while it runs its lease is not judged
    gone, and once it has exited it is."""
    from tasks.store.base import ArtifactStore
    from tasks.store.processes import holder_is_gone, start_time

    lease = ArtifactStore(f"s3://{bucket}/forked-lease").remote.lease("stage", "abc", "run-forked")
    parent = json.loads(lease._body())  # the parent's identity, read before the fork
    ready_r, ready_w = os.pipe()
    stop_r, stop_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its lease's identity, then wait to be told to exit
        os.close(ready_r), os.close(stop_w)
        os.write(ready_w, lease._body())
        os.read(stop_r, 1)
        os._exit(0)
    os.close(ready_w), os.close(stop_r)
    try:
        info = json.loads(os.read(ready_r, 4096))
        assert info["pid"] == pid and info["started"] == start_time(pid) != parent["started"]
        assert not holder_is_gone(info), "a live forked holder keeps its lease"
    finally:
        os.write(stop_w, b"x")
        os.waitpid(pid, 0)
    assert holder_is_gone(info)


def test_a_killed_holders_lease_is_taken_over_at_once_on_its_machine_and_nowhere_else(bucket):
    """A run killed with SIGKILL renews its lease no more; resumed on the same machine, the next
    run need not wait out the lease: the holder's process is gone. A holder that ran on
    another machine is not judged that way: its lease runs out instead."""
    from tasks.store.base import ArtifactStore

    url = f"s3://{bucket}/killed-lease"
    hold = (
        "import sys, time; from tasks.store.base import ArtifactStore; "
        "lease = ArtifactStore(sys.argv[1]).remote.lease('stage', 'abc', 'run-killed'); lease.seconds = 600; "
        "assert lease.acquire(blocking=False); print('held', flush=True); time.sleep(600)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", hold, url],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert proc.stdout.readline().strip() == "held"
        store = ArtifactStore(url)
        second = store.remote.lease("stage", "abc", "run-2")
        assert not second.try_acquire(), "a live holder on this machine keeps its lease"
        assert second.holder()["run_id"] == "run-killed" and second.holder()["pid"] == proc.pid
    finally:
        proc.kill()
        proc.wait()
    assert second.try_acquire(), "the holder is gone: its 600 s lease is taken over at once"
    assert second.holder()["run_id"] == "run-2"
    second.release()

    # The same dead holder, as seen from another machine: not taken over before it expires.
    other = store.remote.lease("stage", "elsewhere", "run-3")
    body = json.loads(second._body())
    body.update(host="another-machine", pid=proc.pid, run_id="run-elsewhere", expires=time.time() + 600)
    other.backend.fs.pipe(other.key, json.dumps(body).encode())
    assert not other.try_acquire()
    assert other.holder()["run_id"] == "run-elsewhere"


# --------------------------------------------------------------------------- consumers


def test_consumer_downloads_into_cache_and_refuses_a_tampered_input(bucket, tmp_path):
    import hashlib

    from tasks.store.base import ArtifactStore
    from tasks.store.records import ArtifactError

    store = ArtifactStore(f"s3://{bucket}/consumers")
    payload = {"data/shard-0.bin": os.urandom(3000), "tokenizer.json": b'{"v": 1}'}
    client = boto3.client("s3")
    for rel, body in payload.items():
        client.put_object(Bucket=bucket, Key=f"consumers/tokenize/abc/{rel}", Body=body)
    manifest = {
        "id": "abc",
        "kind": "dataset",
        "stage": "tokenize",
        "status": "complete",
        "files": {rel: {"size": len(b), "sha256": hashlib.sha256(b).hexdigest()} for rel, b in payload.items()},
    }
    store.remote.write_manifest("tokenize", "abc", manifest)
    assert store.is_complete("tokenize", "abc") and store.state("tokenize", "abc") == "complete"
    ref = store.open_input("tokenize", "abc")
    assert (ref.path / "data/shard-0.bin").read_bytes() == payload["data/shard-0.bin"]
    assert ref.path.is_relative_to(store.root)
    assert store.verify(ref.path) == []
    # The bucket's object changes (same size): verify sees it, and a consumer without a
    # cached copy refuses the input.
    client.put_object(Bucket=bucket, Key="consumers/tokenize/abc/data/shard-0.bin", Body=os.urandom(3000))
    assert "data/shard-0.bin: sha256 differs from the recorded digest" in store.verify(ref.path)
    shutil.rmtree(ref.path)
    with pytest.raises(ArtifactError, match="changed since it was finished"):
        store.open_input("tokenize", "abc")


# --------------------------------------------------------------------------- checkpoint steps as they commit


def test_steps_are_uploaded_as_they_commit_and_a_resume_takes_the_newest_whole_one(bucket, tmp_path):
    from tasks.store.base import ArtifactStore
    from tasks.store.objects import complete_steps

    store = ArtifactStore(f"s3://{bucket}/mirror")
    out = store.artifact_dir("pretrain", "abc")
    out.mkdir(parents=True)
    checkpointer = Checkpointer(out / "checkpoint", keep=2, async_save=False)
    mirror = store.remote.mirror("pretrain", "abc", out)
    sent = []  # object keys in the order their uploads were started
    fs = store.remote.fs
    put, put_file = fs.put, fs.put_file
    fs.put = lambda local, keys, **kw: (sent.extend(keys if isinstance(keys, list) else [keys]), put(local, keys, **kw))
    fs.put_file = lambda local, key, **kw: (sent.append(key), put_file(local, key, **kw))
    uploads = []
    for step in (2, 4, 6):
        checkpointer.save(
            step, {"w_df": jnp.full((8, 4), step, jnp.float32)}, {"count": jnp.zeros((), jnp.int32)}, {"step": step}, {}
        )
        checkpointer.wait()
        with open(out / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": step}) + "\n")
        uploads.append(mirror.sync())
    checkpointer.close()
    assert uploads == [[2], [4], [6]]
    step_keys = [key for key in sent if "/checkpoint/6/" in key]
    assert step_keys[-1].endswith("/checkpoint/6/digests.json") and len(step_keys) > 5  # the digests last
    # Step 2 left the local directory (keep=2), then the bucket, once 6 was there.
    assert complete_steps(store.remote, "pretrain", "abc") == [4, 6]
    assert store.remote.fs.cat_file(f"{bucket}/mirror/pretrain/abc/metrics.jsonl").decode().count("\n") == 3

    # A run killed in the middle of uploading step 6: a file of it is missing on the bucket.
    client = boto3.client("s3")
    victim = next(key for key in step_keys if "/params/" in key)
    client.delete_object(Bucket=bucket, Key=victim.removeprefix(f"{bucket}/"))
    assert complete_steps(store.remote, "pretrain", "abc") == [4]
    logs = []
    elsewhere = tmp_path / "elsewhere"
    store.remote.download("pretrain", "abc", elsewhere, with_manifest=False, partial=True, log=logs.append)
    assert sorted(p.name for p in (elsewhere / "checkpoint").iterdir()) == ["4"]
    assert logs == [f"resuming from checkpoint step 4 of the partial artifact at s3://{bucket}/mirror/pretrain/abc"]
    assert verify_step(elsewhere / "checkpoint", 4) == []
    assert (elsewhere / "metrics.jsonl").is_file()


def test_a_step_left_half_uploaded_by_a_killed_run_is_uploaded_whole_again(bucket, tmp_path):
    """A killed run may leave a step's files on the bucket without its digests, some of them
    the same size as the resumed run's and other bytes (Orbax's metadata holds a timestamp).
    The new run's mirror sends every file of the step, not only those of another size: the
    step then verifies against the digests uploaded last."""
    from tasks.store.base import ArtifactStore
    from tasks.store.objects import complete_steps

    store = ArtifactStore(f"s3://{bucket}/half")
    out = store.artifact_dir("pretrain", "abc")
    out.mkdir(parents=True)
    checkpointer = Checkpointer(out / "checkpoint", keep=2, async_save=False)
    checkpointer.save(
        18, {"w_df": jnp.ones((8, 4), jnp.float32)}, {"count": jnp.zeros((), jnp.int32)}, {"step": 18}, {}
    )
    checkpointer.wait()
    checkpointer.close()
    step_dir = out / "checkpoint" / "18"
    client = boto3.client("s3")
    leftovers = [p for p in step_dir.rglob("*") if p.is_file() and p.name != "digests.json"]
    for path in leftovers:  # the killed run's copy: same sizes, other bytes, no digests
        client.put_object(
            Bucket=bucket,
            Key=f"half/pretrain/abc/checkpoint/18/{path.relative_to(step_dir).as_posix()}",
            Body=bytes(255 - b for b in path.read_bytes()),
        )
    assert complete_steps(store.remote, "pretrain", "abc") == []
    assert store.remote.mirror("pretrain", "abc", out).sync() == [18]
    elsewhere = tmp_path / "elsewhere"
    store.remote.download("pretrain", "abc", elsewhere, with_manifest=False, partial=True, log=lambda _: None)
    assert verify_step(elsewhere / "checkpoint", 18) == []
    for path in leftovers:
        assert (elsewhere / "checkpoint" / "18" / path.relative_to(step_dir)).read_bytes() == path.read_bytes()


# --------------------------------------------------------------------------- the runner on a bucket


def _toy_plan(store: str, trace: Path, **a_config):
    import tests.pipeline_toys  # noqa: F401  (registers the toy stage kinds)
    from flows.spec import Pipeline

    p = Pipeline("toy", store=store)
    p.stage("a", task="toy-source", config={"value": 2, "trace": str(trace), **a_config})
    p.stage("b", task="toy-sum", inputs={"a": "a"}, config={"value": 3, "trace": str(trace)})
    return p.plan()


def test_failed_stage_uploads_its_partial_payload_and_resumes_elsewhere(bucket, tmp_path):
    from tasks.runner import RAN, RESUMED, SKIPPED, execute_stage

    plan = _toy_plan(f"s3://{bucket}/toys", tmp_path / "trace", fail_times=1)
    job = plan.stages["a"].job
    out = plan.store.artifact_dir("a", job.artifact_id)
    out.mkdir(parents=True)
    (out / "shard-00000.partial").write_text("work done before the failure")
    with pytest.raises(RuntimeError, match="planned failure 1 of 1"):
        execute_stage(job, plan.store)
    assert plan.store.state("a", job.artifact_id) == "failed"
    assert plan.store.remote.payload("a", job.artifact_id) == {"shard-00000.partial": 28}
    shutil.rmtree(plan.store.root)  # another machine: nothing staged locally
    assert execute_stage(job, plan.store).status == RESUMED
    manifest = plan.store.manifest("a", job.artifact_id)
    assert manifest["status"] == "complete" and manifest["attempts"] == 2
    assert set(manifest["files"]) == {"shard-00000.partial", "value.json"}
    shutil.rmtree(plan.store.root)
    assert execute_stage(plan.stages["b"].job, plan.store).status == RAN  # its input comes from the bucket
    assert plan.store.manifest("b", plan.stages["b"].job.artifact_id)["metrics"] == {"value": 5}
    assert execute_stage(plan.stages["b"].job, plan.store).status == SKIPPED


def test_two_concurrent_runs_on_a_bucket_do_the_work_once(bucket, tmp_path, monkeypatch):
    """Two 'machines' (separate staging caches, so no shared flock): only the lease orders them."""
    from tasks.runner import RAN, SKIPPED, execute_stage

    trace = tmp_path / "trace"
    plans = []
    for i in range(2):
        monkeypatch.setenv("TRAINFLOW_CACHE", str(tmp_path / f"machine-{i}"))
        plans.append(_toy_plan(f"s3://{bucket}/concurrent", trace, sleep=2.0))
    assert plans[0].store.root != plans[1].store.root
    statuses = []
    threads = [
        threading.Thread(target=lambda p=p: statuses.append(execute_stage(p.stages["a"].job, p.store).status))
        for p in plans
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(statuses) == [RAN, SKIPPED]
    assert trace.read_text().split() == ["a"]


# --------------------------------------------------------------------------- convert from, export to a bucket


def test_convert_from_a_bucket_and_export_to_one(bucket, tmp_path, capsys):
    transformers = need("transformers")
    torch = need("torch")
    import fsspec

    from flows.cli import main

    config = transformers.Qwen3Config(
        vocab_size=37,
        hidden_size=30,
        intermediate_size=26,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=8,
    )
    local = tmp_path / "hf"
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(local)
    (local / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    fs = fsspec.filesystem("s3")
    fs.put(str(local) + "/", f"{bucket}/models/qwen3/", recursive=True)
    store, source, out = f"s3://{bucket}/store", f"s3://{bucket}/models/qwen3", f"s3://{bucket}/exported"

    def last_json() -> dict:
        return json.loads([line for line in capsys.readouterr().out.splitlines() if line.startswith("{")][-1])

    assert main(["convert", source, "--store", store, "--json"]) == 0
    converted = last_json()
    assert converted["status"] == "ran" and converted["path"] == f"{store}/convert/{converted['artifact_id']}"
    assert main(["convert", source + "/", "--store", store, "--json"]) == 0  # the same objects: nothing to do
    assert last_json()["status"] == "skipped"
    manifest = json.loads(fs.cat_file(f"{bucket}/store/convert/{converted['artifact_id']}/artifact.json"))
    assert manifest["config"]["source"] == source and manifest["status"] == "complete"

    assert main(["export", converted["artifact_id"], "--store", store, "--out", out, "--json"]) == 0
    exported = last_json()
    assert exported["path"] == f"{store}/export/{exported['artifact_id']}"
    assert trainflow("verify", exported["path"]).stdout.startswith("OK ")
    fs.get(f"{bucket}/exported/", str(tmp_path / "back") + "/", recursive=True)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").state_dict()
    for name, weight in transformers.AutoModelForCausalLM.from_pretrained(local).state_dict().items():
        torch.testing.assert_close(loaded[name], weight, rtol=0, atol=0, msg=name)
    assert main(["export", converted["artifact_id"], "--store", store, "--out", out]) == 2  # not empty
    assert f"error: {out} is not empty" in capsys.readouterr().err

    # A PEFT adapter onto the base in the bucket: stored beside it, the engine reading the base at
    # its URL (it once opened the base's staging copy as a local store and found no checkpoint).
    peft = need("peft")
    adapter_model = peft.get_peft_model(
        transformers.AutoModelForCausalLM.from_pretrained(local), peft.LoraConfig(r=2, target_modules=["q_proj"])
    )
    with torch.no_grad():
        for name, p in adapter_model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.3)
    adapter_model.save_pretrained(tmp_path / "peft")
    assert main(["convert", str(tmp_path / "peft"), "--base", converted["path"], "--json"]) == 0
    adapter = last_json()
    assert adapter["path"] == f"{store}/convert/{adapter['artifact_id']}" and adapter["metrics"]["rank"] == 2
    assert main(["export", adapter["path"], "--out", str(tmp_path / "peft_back"), "--json"]) == 0
    last_json()
    base_model = transformers.AutoModelForCausalLM.from_pretrained(local)
    reloaded = peft.PeftModel.from_pretrained(base_model, tmp_path / "peft_back")
    lora = {name: weight for name, weight in adapter_model.state_dict().items() if "lora_" in name}
    back = {name: weight for name, weight in reloaded.state_dict().items() if "lora_" in name}
    assert lora.keys() == back.keys() and lora
    for name, weight in lora.items():
        torch.testing.assert_close(back[name], weight, rtol=0, atol=0, msg=name)

    assert main(["convert", f"s3://{bucket}/models/none", "--store", store]) == 2
    assert f"s3://{bucket}/models/none is not a Hugging Face model directory" in capsys.readouterr().err
