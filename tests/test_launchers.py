"""Launchers: the gang a stage's ranks form, and real Ray and Slurm clusters on 127.0.0.1.

A gang is tested with stand-in ranks (small Python scripts: no JAX), so a rank that dies, or
one that hangs in a "collective" ignoring SIGTERM, costs seconds. Then one tiny pipeline
pretrain stage (2 processes x 1 device, 10 steps) runs through `local-multi`, `ray` (a head
and a worker node started here as separate processes, placement STRICT_SPREAD) and `slurm`
(slurmctld and two slurmd, `srun --nodes 2 --ntasks 2`): the same losses and parameters,
the same artifact id, and each manifest records its launcher and the device layout.
Ray and Slurm are skipped, with the reason, where they are not installed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import tests.pipeline_toys  # noqa: F401  (registers toy-child)
from engine.config import ConfigError
from engine.train.checkpoint import load_params
from flows.spec import Pipeline
from tasks.launch import gang
from tasks.launch.gang import GANG_GRACE_SECONDS, terminate_children
from tasks.launch.run import Interrupted, LauncherSpec, StageConfigError, StageFailed, commands, run_child
from tasks.registry import StageHooks
from tasks.runner import execute_stage
from tasks.store.records import read_manifest
from tests.conftest import child_xla_flags
from tests.deps import need

# A stand-in for one rank of an engine: its role is argv[2 + rank].
RANK = r"""
import os, signal, socket, sys, time
rank = int(os.environ.get("TRAINFLOW_PROCESS_ID") or os.environ.get("SLURM_PROCID") or 0)
out, role = sys.argv[1], sys.argv[2 + rank]
def mark(name):
    open(os.path.join(out, f"{name}{rank}"), "w").write(str(os.getpid()))
mark("pid")
print(f"rank {rank} at step 3", flush=True)
if role == "blocked":  # stuck in a collective on a dead peer; SIGTERM is JAX's (preemption notice)
    signal.signal(signal.SIGTERM, lambda *_: mark("sigterm"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); s.listen(); s.accept()
elif role == "killed":
    time.sleep(0.5); print(f"rank {rank} lost its memory", flush=True); os.kill(os.getpid(), signal.SIGKILL)
elif role.startswith("exit"):
    time.sleep(0.5); print(f"error: rank {rank} gave up", file=sys.stderr, flush=True); sys.exit(int(role[4:]))
elif role == "preempted":  # stopped at the agreed step and saved: exits 143 at once
    sys.exit(143)
elif role == "saving":  # stopped at the same step, still writing its part of the checkpoint
    signal.signal(signal.SIGTERM, lambda *_: mark("sigterm"))
    time.sleep(1.5); mark("saved"); sys.exit(143)
elif role == "training":  # saves and exits 143 on SIGTERM
    signal.signal(signal.SIGTERM, lambda *_: (mark("sigterm"), sys.exit(143)))
    print('{"result": {"rank": %d}}' % rank, flush=True)
    time.sleep(float(os.environ.get("TOY_TRAIN_SECONDS", "600")))
"""


def rank_argv(out: Path, *roles: str) -> list[str]:
    return [sys.executable, "-c", RANK, str(out), *roles]


def alive(pid_file: Path) -> bool:
    try:
        os.kill(int(pid_file.read_text()), 0)
    except ProcessLookupError:
        return False
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loopback_hostname() -> bool:
    """gloo and srun listen on the address this machine's name resolves to."""
    return socket.gethostbyname(socket.gethostname()).startswith("127.")


LOCAL_MULTI = LauncherSpec(kind="local-multi", processes=2)


# --------------------------------------------------------------------------- the gang


@pytest.mark.parametrize(
    "roles, error",
    [
        (
            ("blocked", "killed"),
            "stage 'x': rank 1 was killed by SIGKILL: rank 1 lost its memory; the other ranks were stopped",
        ),
        (
            ("training", "exit3"),
            "stage 'x': rank 1 exited with code 3: error: rank 1 gave up; the other ranks were stopped",
        ),
    ],
)
def test_one_rank_failing_stops_the_others_within_seconds_and_is_named(tmp_path, roles, error):
    lines: list[str] = []
    started = time.monotonic()
    with pytest.raises(StageFailed) as failure:
        run_child(rank_argv(tmp_path, *roles), launcher=LOCAL_MULTI, log=lines.append, what="stage 'x'")
    assert str(failure.value) == error
    # A rank ignoring SIGTERM is SIGKILLed after the grace; without it, it would wait forever.
    assert time.monotonic() - started < GANG_GRACE_SECONDS + 5
    assert not alive(tmp_path / "pid0") and (tmp_path / "sigterm0").exists()
    assert "[rank 0] rank 0 at step 3" in lines and "[rank 1] rank 1 at step 3" in lines


def test_a_lone_child_killed_by_a_signal_says_which(tmp_path):
    with pytest.raises(StageFailed, match=r"^stage 'x': was killed by SIGKILL: rank 0 lost its memory$"):
        run_child(rank_argv(tmp_path, "killed"), log=lambda _: None, what="stage 'x'")


def test_a_rank_stopped_at_the_agreed_step_leaves_the_others_to_save(tmp_path):
    with pytest.raises(Interrupted, match="stopped by SIGTERM"):
        run_child(rank_argv(tmp_path, "preempted", "saving"), launcher=LOCAL_MULTI, log=lambda _: None)
    assert (tmp_path / "saved1").exists() and not (tmp_path / "sigterm1").exists()


# --------------------------------------------------------------------------- configs and commands


def test_launcher_keys_are_checked_against_their_kind():
    cases = [
        (
            {"kind": "local-multi", "processes": 2, "address": "auto"},
            "key 'address' applies to launcher kind 'ray', not 'local-multi'",
        ),
        (
            {"kind": "ray", "processes": 2, "srun_args": ["-p", "gpu"]},
            "key 'srun_args' applies to launcher kind 'slurm', not 'ray'",
        ),
        ({"kind": "local", "processes": 4}, "launcher kind 'local' runs one process; for 4 use"),
        ({"kind": "slurm", "processes": 2, "nodes": 3}, "nodes (3) cannot exceed processes (2)"),
        ({"kind": "ray", "resources": {"GPU": 0}}, "resources must be positive amounts"),
    ]
    for launcher, message in cases:
        p = Pipeline("p")
        p.stage("train", task="toy-child", launcher=launcher)
        with pytest.raises(ConfigError, match=rf"pipeline 'p': stages.train.launcher: .*{re.escape(message)}"):
            p.plan()


def test_local_multi_gives_each_rank_its_own_gpus():
    argv = ["python", "-m", "engine.train", "t.yaml"]

    def device_ids(spec, gpus):
        return [env.get("JAX_LOCAL_DEVICE_IDS") for _, env in commands(spec, argv, gpu_count=gpus)]

    four = LauncherSpec(kind="local-multi", processes=4)
    assert device_ids(four, 8) == ["0,1", "2,3", "4,5", "6,7"]  # auto: the host's GPUs split evenly
    assert device_ids(four, 4) == ["0", "1", "2", "3"]
    assert device_ids(four, 0) == [None] * 4  # CPU ranks share the host
    assert device_ids(LauncherSpec(kind="local-multi", processes=2, devices_per_process=1), 8) == ["0", "1"]
    assert device_ids(LauncherSpec(kind="local-multi", processes=2, devices_per_process=None), 8) == [None] * 2
    with pytest.raises(StageConfigError, match="6 GPUs do not split evenly over 4 processes"):
        commands(four, argv, gpu_count=6)
    with pytest.raises(StageConfigError, match="4 processes x 3 devices need 12 GPUs; this host has 8"):
        commands(LauncherSpec(kind="local-multi", processes=4, devices_per_process=3), argv, gpu_count=8)


def test_jax_distributed_restricts_a_rank_to_the_devices_it_was_given(tmp_path):
    """JAX_LOCAL_DEVICE_IDS is what jax.distributed.initialize reads: each rank of a real
    2-process run sets its CUDA visible devices to its own ids."""
    script = tmp_path / "rank.py"
    script.write_text(
        "import jax\nfrom engine.parallel.distributed import maybe_initialize_distributed\n"
        "maybe_initialize_distributed()\n"
        "print('visible', jax.process_index(), jax.config.values['jax_cuda_visible_devices'], flush=True)\n"
    )
    lines: list[str] = []
    spec = LauncherSpec(kind="local-multi", processes=2, devices_per_process=2, env={"JAX_PLATFORMS": "cpu"})
    run_child([sys.executable, str(script)], launcher=spec, log=lines.append)
    assert sorted(line.split("] ", 1)[1] for line in lines if "visible" in line) == [
        "visible 0 0,1",
        "visible 1 2,3",
    ], lines


def test_slurm_is_one_srun_job_step_whose_tasks_find_each_other_through_jax():
    spec = LauncherSpec(
        kind="slurm", processes=4, nodes=2, srun_args=["--partition=gpu", "--gpus-per-task=1"], env={"TOY": "1"}
    )
    argv = [sys.executable, "-m", "engine.train", "/store/pretrain/abc/train.yaml"]
    assert commands(spec, argv) == [
        (
            [
                "srun",
                "--nodes=2",
                "--ntasks=4",
                "--kill-on-bad-exit=1",
                "--label",
                "--verbose",
                "--partition=gpu",
                "--gpus-per-task=1",
                *argv,
            ],
            {"TOY": "1", "TRAINFLOW_CLUSTER": "slurm"},
        )
    ]
    assert commands(LauncherSpec(kind="slurm", processes=2), argv)[0][0][1:3] == ["--nodes=2", "--ntasks=2"]


# Prints what srun prints when task 1 of 2 is SIGKILLed (srun --label; -K ends the step).
FAKE_SRUN = """#!{python}
import json, os, sys
json.dump({{"argv": sys.argv[1:], "cluster": os.environ.get("TRAINFLOW_CLUSTER")}}, open({record!r}, "w"))
print("0: rank 0 at step 3", flush=True)
print("1: rank 1 at step 3", flush=True)
print("1: rank 1 lost its memory", flush=True)
print("srun: error: n2: task 1: Killed", file=sys.stderr, flush=True)
print("srun: launch/slurm: _step_signal: Terminating StepId=5.0", file=sys.stderr, flush=True)
print("0: slurmstepd-n1: error: *** STEP 5.0 ON n1 CANCELLED AT 2026-11-30T09:14:41 ***", flush=True)
print("srun: error: n1: task 0: Terminated", file=sys.stderr, flush=True)
sys.exit(143)
"""


def test_srun_output_names_the_task_that_failed_first(tmp_path, monkeypatch):
    """srun exits 143 here (its last task was SIGTERMed), but task 1's SIGKILL was the cause."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN.format(python=sys.executable, record=str(tmp_path / "srun.json")))
    (bin_dir / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    lines: list[str] = []
    with pytest.raises(StageFailed) as failure:
        run_child(
            ["python", "-m", "engine.train", "t.yaml"],
            launcher=LauncherSpec(kind="slurm", processes=2),
            log=lines.append,
            what="stage 'x'",
        )
    assert (
        str(failure.value) == "stage 'x': rank 1 was killed by SIGKILL: rank 1 lost its memory; the other ranks "
        "were stopped"
    )
    assert "[rank 1] rank 1 at step 3" in lines and "srun: error: n2: task 1: Killed" in lines
    assert json.loads((tmp_path / "srun.json").read_text()) == {
        "argv": [
            "--nodes=2",
            "--ntasks=2",
            "--kill-on-bad-exit=1",
            "--label",
            "--verbose",
            "python",
            "-m",
            "engine.train",
            "t.yaml",
        ],
        "cluster": "slurm",
    }


def test_the_artifact_id_does_not_depend_on_the_launcher(tmp_path):
    launchers = [
        None,
        "local",
        {"kind": "local-multi", "processes": 4},
        {"kind": "ray", "processes": 8, "address": "ray://head:10001", "resources": {"GPU": 1}, "spread": True},
        {"kind": "slurm", "processes": 16, "nodes": 2, "srun_args": ["--partition=gpu"]},
        {"kind": "command", "template": "nice -n 10 {command}"},
    ]
    ids = set()
    for launcher in launchers:
        p = Pipeline("p", store=tmp_path)
        p.stage("train", task="toy-child", config={"steps": 3}, **({"launcher": launcher} if launcher else {}))
        ids.add(p.plan().stages["train"].job.artifact_id)
    assert len(ids) == 1


def test_the_manifest_records_the_launcher(tmp_path):
    p = Pipeline("p", store=tmp_path)
    p.stage("train", task="toy-child", config={"steps": 2}, launcher={"kind": "local", "env": {"TOY_TOKEN": "x"}})
    plan = p.plan()
    result = execute_stage(plan.stages["train"].job, plan.store, StageHooks(log=lambda _: None))
    manifest = read_manifest(result.path)
    # The toy reports no device layout; env values may be secrets: only their names.
    assert manifest["launcher"] == {"kind": "local", "processes": 1, "env": ["TOY_TOKEN"]}
    assert manifest["layout"] is None


# --------------------------------------------------------------------------- one pretrain stage, three launchers

# LLVM's optimisation level 0, as tests/conftest.py sets for this process: the tiny model
# spends far more time compiling than running, and every launcher's ranks compile with it.
RANK_ENV = {
    "XLA_FLAGS": child_xla_flags(),
    "JAX_PLATFORMS": "cpu",
}
LAYOUT = {"processes": 2, "devices": 2, "mesh": {"data": 2, "expert": 1, "fsdp": 1, "context": 1, "tensor": 1}}


def pretrain_pipeline(store: Path, launcher: dict) -> Pipeline:
    p = Pipeline("launchers", store=store)
    p.stage(
        "tokenize",
        task="tokenize",
        config={
            "sources": [{"format": "text", "path": "{stdlib}/[a-b]*.py"}],
            "tokenizer": {"vocab_size": 300},
            "validation_fraction": 0.1,
            "workers": 1,
        },
    )
    p.stage(
        "pretrain",
        task="pretrain",
        inputs={"dataset": "tokenize"},
        launcher=launcher,
        config={
            "model": {"preset": "tiny", "num_layers": 1, "max_seq_len": 64},
            "steps": 10,
            "log_every": 1,
            "seed": 3,
            "data": {"seq_len": 32, "batch_size": 8, "eval_batches": 0},
            "optimizer": {"learning_rate": 1e-2},
            "checkpoint": {"every_steps": 1000, "async_save": False},
        },
    )
    return p


@pytest.fixture(scope="module")
def dataset_store(tmp_path_factory) -> Path:
    """A store holding the tokenize artifact; each launcher's run copies it (ids survive a copy)."""
    store = tmp_path_factory.mktemp("dataset_store")
    plan = pretrain_pipeline(store, {"kind": "local"}).plan()
    execute_stage(plan.stages["tokenize"].job, plan.store, StageHooks(log=lambda _: None))
    return store


def run_pretrain(dataset_store: Path, store: Path, launcher: dict) -> tuple[Path, dict, list[str]]:
    """(artifact directory, manifest, log) of the pretrain stage run through `launcher`."""
    shutil.copytree(dataset_store, store)
    plan = pretrain_pipeline(store, launcher).plan()
    lines: list[str] = []
    result = execute_stage(plan.stages["pretrain"].job, plan.store, StageHooks(log=lines.append))
    return result.path, read_manifest(result.path), lines


def losses(out: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def assert_same_training(out: Path, reference: Path) -> None:
    np.testing.assert_allclose(losses(out), losses(reference), rtol=0, atol=1e-6)
    params = [jax.tree.leaves(load_params(d / "checkpoint", as_numpy=True)[1]) for d in (out, reference)]
    for ours, theirs in zip(*params, strict=True):
        np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def local_multi_run(dataset_store, tmp_path_factory):
    if not loopback_hostname():
        pytest.skip(
            f"this machine's name ({socket.gethostname()}) does not resolve to 127.0.0.1: gloo would "
            "listen on another address"
        )
    return run_pretrain(
        dataset_store,
        tmp_path_factory.mktemp("local") / "store",
        {"kind": "local-multi", "processes": 2, "env": RANK_ENV},
    )


@pytest.mark.slow
def test_local_multi_pretrain_records_its_launcher_and_layout(local_multi_run):
    out, manifest, lines = local_multi_run
    assert manifest["status"] == "complete" and len(losses(out)) == 10
    assert manifest["launcher"] == {"kind": "local-multi", "processes": 2, "env": sorted(RANK_ENV)}
    assert manifest["layout"] == LAYOUT
    assert "layout" not in manifest["metrics"]
    assert any(line.startswith("[rank 1] ") for line in lines)


# --------------------------------------------------------------------------- Ray

# `ray start` for a node that stays on 127.0.0.1. Ray replaces a loopback --node-ip-address by
# the machine's outward address unless RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, which in turn
# refuses to join a second node to a cluster: this node keeps the address it is given.
RAY_WORKER_NODE = """
import sys
import ray._private.services as services
services.resolve_ip_for_localhost = lambda host: host
from ray.scripts.scripts import main
sys.argv = ["ray", *sys.argv[1:]]
main()
"""


def start_ray_node(root: Path, name: str, argv: list[str], env: dict) -> subprocess.Popen:
    """`ray start ... --block` in its own process group (every Ray process of the node joins it)."""
    log = root / f"{name}.log"
    ports = [
        "--dashboard-agent-listen-port",
        "--dashboard-agent-grpc-port",
        "--metrics-export-port",
        "--runtime-env-agent-port",
        "--node-manager-port",
        "--object-manager-port",
    ]
    proc = subprocess.Popen(
        [
            *argv,
            "--block",
            "--node-ip-address=127.0.0.1",
            "--num-cpus=1",
            "--disable-usage-stats",
            f"--temp-dir={root / name}",
            *(f"{option}={free_port()}" for option in ports),
        ],
        env={**env, "AUTOSCALER_METRIC_PORT": str(free_port())},
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while "Ray runtime started" not in log.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, f"ray {name} did not start:\n{log.read_text()}"
        time.sleep(0.2)
    return proc


def stop_process_group(proc: subprocess.Popen, timeout: float = 5) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        pass
    except ProcessLookupError:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


@pytest.fixture(scope="module")
def ray_cluster():
    """A head and a worker node, 1 CPU each, on 127.0.0.1; yields the GCS address."""
    ray = need("ray")
    if not loopback_hostname():
        pytest.skip(f"this machine's name ({socket.gethostname()}) does not resolve to 127.0.0.1")
    # Short: Ray's socket paths under it must fit a Unix socket name.
    root = Path(tempfile.mkdtemp(prefix="tf-ray-", dir="/tmp"))
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "RAY_ADDRESS")}
    env.update(RAY_USAGE_STATS_ENABLED="0")
    address = f"127.0.0.1:{free_port()}"
    nodes = []
    # The driver (this process) must not rewrite the loopback address either (what
    # RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 sets, read when Ray is imported).
    ray._private.ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        head = [
            str(Path(sys.executable).parent / "ray"),
            "start",
            "--head",
            f"--port={address.split(':')[1]}",
            "--include-dashboard=false",
            f"--ray-client-server-port={free_port()}",
        ]
        nodes.append(start_ray_node(root, "head", head, {**env, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}))
        nodes.append(
            start_ray_node(
                root, "worker", [sys.executable, "-c", RAY_WORKER_NODE, "start", f"--address={address}"], env
            )
        )
        yield address
    finally:
        ray.shutdown()  # before the cluster goes: a driver whose GCS vanished exits after a while
        for node in reversed(nodes):
            stop_process_group(node)
        ray._private.ray_constants.ENABLE_RAY_CLUSTER = True
        shutil.rmtree(root, ignore_errors=True)


def ray_launcher(address: str) -> LauncherSpec:
    return LauncherSpec(kind="ray", processes=2, address=address, spread=True)


def placement_groups() -> set[str]:
    from ray.util import placement_group_table

    return {group["state"] for group in placement_group_table().values()}


def test_ray_gang_one_worker_killed_stops_the_other_and_is_torn_down(ray_cluster, tmp_path):
    handler = signal.getsignal(signal.SIGTERM)
    lines: list[str] = []
    started = time.monotonic()
    with pytest.raises(StageFailed, match=r"^stage 'x': rank 1 was killed by SIGKILL: rank 1 lost its memory; the "):
        run_child(
            rank_argv(tmp_path, "blocked", "killed"),
            launcher=ray_launcher(ray_cluster),
            log=lines.append,
            what="stage 'x'",
        )
    assert time.monotonic() - started < GANG_GRACE_SECONDS + 20
    assert signal.getsignal(signal.SIGTERM) is handler  # ray.init's own handler was undone
    assert not alive(tmp_path / "pid0")  # STRICT_SPREAD: one rank per node, both on this machine
    assert "[rank 0] rank 0 at step 3" in lines
    assert placement_groups() == {"REMOVED"}


def test_ray_gang_cancelled_by_trainflow_gets_sigterm_and_saves(ray_cluster, tmp_path):
    def stop_soon():
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"pid{rank}").exists() for rank in (0, 1)) and time.monotonic() < deadline:
            time.sleep(0.05)
        terminate_children(signal.SIGTERM)  # what trainflow's SIGTERM handler does

    threading.Thread(target=stop_soon, daemon=True).start()
    try:
        with pytest.raises(Interrupted):
            run_child(
                rank_argv(tmp_path, "training", "training"), launcher=ray_launcher(ray_cluster), log=lambda _: None
            )
    finally:
        gang._stopping.clear()
    assert (tmp_path / "sigterm0").exists() and (tmp_path / "sigterm1").exists()
    assert placement_groups() == {"REMOVED"}


@pytest.mark.slow
def test_ray_pretrain_equals_local_multi(ray_cluster, dataset_store, local_multi_run, tmp_path):
    reference, reference_manifest, _ = local_multi_run
    out, manifest, lines = run_pretrain(
        dataset_store,
        tmp_path / "store",
        {"kind": "ray", "processes": 2, "address": ray_cluster, "spread": True, "env": RANK_ENV},
    )
    assert out.name == reference.name  # the same artifact id
    assert_same_training(out, reference)
    assert manifest["launcher"] == {
        "kind": "ray",
        "processes": 2,
        "address": ray_cluster,
        "resources": {"CPU": 1},
        "spread": True,
        "env": sorted(RANK_ENV),
    }
    assert manifest["layout"] == LAYOUT
    assert any(line.startswith("[rank 1] ") for line in lines)


# --------------------------------------------------------------------------- Slurm

SLURM_CONF = """\
ClusterName=trainflow
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
CommunicationParameters=NoInAddrAny,NoCtldInAddrAny
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.%n.pid
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/linear
ReturnToService=2
KillWait={kill_wait}
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MailProg=/bin/true
NodeName=n1 NodeAddr=127.0.0.1 NodeHostname=localhost Port={n1_port} CPUs=1 State=UNKNOWN
NodeName=n2 NodeAddr=127.0.0.1 NodeHostname=localhost Port={n2_port} CPUs=1 State=UNKNOWN
PartitionName=debug Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP
"""
SLURM_KILL_WAIT = 2
"""Seconds Slurm waits after SIGTERM before it SIGKILLs the tasks of a failed step (30 by default)."""


@pytest.fixture(scope="module")
def slurm_cluster():
    """slurmctld and two slurmd (nodes n1, n2) on 127.0.0.1; yields SLURM_CONF's path."""
    missing = [tool for tool in ("slurmctld", "slurmd", "srun", "sinfo") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"Slurm is not installed ({', '.join(missing)} missing): apt-get install slurm-wlm")
    if not loopback_hostname():
        pytest.skip(
            f"this machine's name ({socket.gethostname()}) does not resolve to 127.0.0.1: srun would "
            "listen on another address"
        )
    root = Path(tempfile.mkdtemp(prefix="tf-slurm-", dir="/tmp"))
    for directory in ("state", "spool/n1", "spool/n2"):
        (root / directory).mkdir(parents=True)
    conf = root / "slurm.conf"
    conf.write_text(
        SLURM_CONF.format(
            root=root, ctld_port=free_port(), n1_port=free_port(), n2_port=free_port(), kill_wait=SLURM_KILL_WAIT
        )
    )
    env = {**os.environ, "SLURM_CONF": str(conf)}
    daemons = []
    try:
        for argv in (["slurmctld", "-D", "-i"], ["slurmd", "-D", "-N", "n1"], ["slurmd", "-D", "-N", "n2"]):
            log = (root / f"{argv[0]}-{argv[-1]}.log").open("w")
            daemons.append(
                subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            )
        deadline = time.monotonic() + 60
        while True:
            states = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], env=env, capture_output=True, text=True).stdout
            if states.split() == ["idle", "idle"]:
                break
            assert time.monotonic() < deadline and all(d.poll() is None for d in daemons), (
                f"Slurm did not come up ({states!r}): " + "".join(p.read_text() for p in root.glob("*.log"))
            )
            time.sleep(0.2)
        yield conf
    finally:
        for daemon in reversed(daemons):
            stop_process_group(daemon)
        shutil.rmtree(root, ignore_errors=True)


def slurm_env(conf: Path) -> dict[str, str]:
    """On a real cluster JAX takes the step's first node and a port from the job id; the fake
    nodes' names do not resolve, so the test names the coordinator (JAX's own variables)."""
    coordinator = f"127.0.0.1:{free_port()}"
    return {
        "SLURM_CONF": str(conf),
        "JAX_COORDINATOR_ADDRESS": coordinator,
        "JAX_COORDINATOR_BIND_ADDRESS": coordinator,
    }


def test_srun_task_killed_fails_the_step_naming_the_rank(slurm_cluster, tmp_path):
    started = time.monotonic()
    with pytest.raises(StageFailed, match=r"^stage 'x': rank 1 was killed by SIGKILL: rank 1 lost its memory; the "):
        run_child(
            rank_argv(tmp_path, "blocked", "killed"),
            what="stage 'x'",
            log=lambda _: None,
            launcher=LauncherSpec(kind="slurm", processes=2, env={"SLURM_CONF": str(slurm_cluster)}),
        )
    assert time.monotonic() - started < SLURM_KILL_WAIT + 15  # Slurm's KillWait bounds the blocked rank
    assert not alive(tmp_path / "pid0")


def test_srun_step_cancelled_by_trainflow_gets_sigterm_and_saves(slurm_cluster, tmp_path):
    """SIGTERM to srun (trainflow's stop) reaches every task; each saves and exits 143."""

    def stop_soon():
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"pid{rank}").exists() for rank in (0, 1)) and time.monotonic() < deadline:
            time.sleep(0.05)
        terminate_children(signal.SIGTERM)

    threading.Thread(target=stop_soon, daemon=True).start()
    try:
        with pytest.raises(Interrupted):
            run_child(
                rank_argv(tmp_path, "training", "training"),
                log=lambda _: None,
                launcher=LauncherSpec(kind="slurm", processes=2, env={"SLURM_CONF": str(slurm_cluster)}),
            )
    finally:
        gang._stopping.clear()
    assert (tmp_path / "sigterm0").exists() and (tmp_path / "sigterm1").exists()


@pytest.mark.slow
def test_slurm_pretrain_equals_local_multi(slurm_cluster, dataset_store, local_multi_run, tmp_path):
    reference, _, _ = local_multi_run
    launcher = {"kind": "slurm", "processes": 2, "env": {**RANK_ENV, **slurm_env(slurm_cluster)}}
    out, manifest, lines = run_pretrain(dataset_store, tmp_path / "store", launcher)
    assert out.name == reference.name
    assert_same_training(out, reference)
    assert manifest["launcher"]["kind"] == "slurm" and manifest["layout"] == LAYOUT
    assert any(line.startswith("[rank 1] ") for line in lines)
