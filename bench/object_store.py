"""Checkpoints on an object store: trainflow's save and restore beside a plain s3fs copy.

    python -m bench.object_store [--mb 64] [--repeats 3]

Starts a moto S3 server on 127.0.0.1 (the one the tests use) and measures, in turns
(A B A B ...) in this process:

- save: what a training stage on `store: s3://...` pays per checkpoint step: Orbax writes
  the step into the local staging directory (engine.train.checkpoint.Checkpointer, digests
  included), then tasks.store.objects.StepMirror uploads it (digests last);
- restore: what a run resuming on another machine pays: the newest whole step is found and
  downloaded (RemoteBackend.download, partial=True), then Orbax restores it;
- the peer, on the same bytes: `s3fs.put` of the committed step directory, and `s3fs.get`
  of it into an empty directory.

Throughput is the step's bytes over the wall time, in MB/s (10^6 bytes). The server runs in
this process, on the same CPUs, so the figures are relative: the ratio to the peer is what
carries over. Writes bench/results/object_store.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LOAD_AT_START = list(os.getloadavg())  # before the run: the run itself loads the machine
sys.path.insert(0, str(REPO))

import boto3  # noqa: E402
import fsspec  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import SingleDeviceSharding  # noqa: E402
from moto.server import ThreadedMotoServer  # noqa: E402

from bench import finish, load_line, machine, summary  # noqa: E402
from engine.contract import CHECKPOINT_DIR  # noqa: E402
from engine.train.checkpoint import Checkpointer  # noqa: E402

ARRAY_MB = 8  # the checkpoint is made of arrays of this size (float32)


def start_server() -> dict[str, str]:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    os.environ.update(env)
    return env


def make_params(total_mb: int) -> dict:
    count = max(1, total_mb // ARRAY_MB)
    keys = jax.random.split(jax.random.key(0), count)
    side = ARRAY_MB * (1 << 20) // 4 // 1024
    return {f"w{i}": jax.random.normal(keys[i], (side, 1024), jnp.float32) for i in range(count)}


def step_bytes(step_dir: Path) -> int:
    return sum(p.stat().st_size for p in step_dir.rglob("*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=64, help="checkpoint size in MiB (float32 arrays)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    info = machine(jax=jax.__version__, orbax=version("orbax-checkpoint"), s3fs=version("s3fs"), moto=version("moto"))
    info["load_average_at_start"] = LOAD_AT_START
    start_server()
    work = Path(tempfile.mkdtemp(prefix="trainflow-bench-objectstore-"))
    os.environ["TRAINFLOW_CACHE"] = str(work / "cache")
    from tasks.store.base import ArtifactStore  # after the endpoint is in the environment

    bucket = "bench"
    boto3.client("s3").create_bucket(Bucket=bucket)
    fs = fsspec.filesystem("s3")
    params = make_params(args.mb)
    opt_state = {"count": jnp.zeros((), jnp.int32)}
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=SingleDeviceSharding(jax.devices()[0])), params
    )
    abstract_opt = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=SingleDeviceSharding(jax.devices()[0])), opt_state
    )
    rows = {
        "trainflow save": [],
        "trainflow restore": [],
        "s3fs put": [],
        "s3fs get": [],
        "orbax local save": [],
        "orbax local restore": [],
    }
    size = 0
    for round_ in range(args.repeats):
        print(f"[{round_ + 1}/{args.repeats}]", file=sys.stderr)
        store = ArtifactStore(f"s3://{bucket}/store-{round_}")
        out = store.artifact_dir("bench", "a")
        out.mkdir(parents=True)
        checkpointer = Checkpointer(out / CHECKPOINT_DIR, keep=1, async_save=False)
        mirror = store.remote.mirror("bench", "a", out)
        start = time.perf_counter()
        checkpointer.save(1, params, opt_state, {"bench": True}, {})
        checkpointer.wait()
        local_save = time.perf_counter() - start
        assert mirror.sync() == [1]
        rows["trainflow save"].append(time.perf_counter() - start)
        rows["orbax local save"].append(local_save)
        checkpointer.close()
        step_dir = out / CHECKPOINT_DIR / "1"
        size = step_bytes(step_dir)

        start = time.perf_counter()  # the peer: the same bytes, copied as they are
        fs.put(str(step_dir) + "/", f"{bucket}/peer-{round_}/1/", recursive=True)
        rows["s3fs put"].append(time.perf_counter() - start)

        resumed = work / f"elsewhere-{round_}"  # another machine: an empty staging directory
        start = time.perf_counter()
        store.remote.download("bench", "a", resumed, with_manifest=False, partial=True)
        restorer = Checkpointer(resumed / CHECKPOINT_DIR, keep=1, async_save=False)
        before_restore = time.perf_counter()
        restored, _, _, _ = restorer.restore(1, abstract, abstract_opt)
        jax.block_until_ready(restored)
        rows["trainflow restore"].append(time.perf_counter() - start)
        rows["orbax local restore"].append(time.perf_counter() - before_restore)
        restorer.close()

        start = time.perf_counter()
        fs.get(f"{bucket}/peer-{round_}/1/", str(work / f"peer-{round_}") + "/", recursive=True)
        rows["s3fs get"].append(time.perf_counter() - start)
        shutil.rmtree(out.parent.parent, ignore_errors=True)
        shutil.rmtree(resumed, ignore_errors=True)
        shutil.rmtree(work / f"peer-{round_}", ignore_errors=True)

    results = {
        name: {**summary(seconds), "mb_per_second": size / 1e6 / summary(seconds)["median"]}
        for name, seconds in rows.items()
    }
    ratios = {
        "save / s3fs put": results["trainflow save"]["median"] / results["s3fs put"]["median"],
        "restore / s3fs get": results["trainflow restore"]["median"] / results["s3fs get"]["median"],
    }
    info = finish(info)
    print(f"checkpoint step: {size / 1e6:.1f} MB, {args.repeats} rounds (A B A B), moto S3 on 127.0.0.1")
    print(f"{'':22}{'median s':>10}{'MB/s':>10}{'spread':>9}")
    for name, row in results.items():
        print(f"{name:22}{row['median']:10.3f}{row['mb_per_second']:10.1f}{row['spread']:9.2f}")
    for name, ratio in ratios.items():
        print(f"time ratio {name}: {ratio:.2f}")
    print(load_line(info))
    out_path = REPO / "bench" / "results" / "object_store.json"
    out_path.write_text(
        json.dumps(
            {
                "description": "checkpoint save (Orbax into local staging + StepMirror upload) and restore "
                "(newest whole step downloaded + Orbax restore) against a moto S3 server on 127.0.0.1, "
                "beside s3fs put/get of the same step directory",
                "command": f"python -m bench.object_store --mb {args.mb} --repeats {args.repeats}",
                "step_bytes": size,
                "results": results,
                "time_ratios": ratios,
                "machine": info,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {out_path.relative_to(REPO)}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
