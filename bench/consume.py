"""What a stage pays to start downstream of a checkpoint artifact: bytes read and time, beside
a bare Orbax restore of the parameters it consumes.

    python -m bench.consume [--local-gb 0.25,1] [--s3-gb 0.25] [--repeats 3]

An upstream artifact holds 3 kept checkpoint steps, each with float32 params of the given
size, an Adam-sized optimizer state (2x the params) and a data state, written by the
engine's Checkpointer through tasks.runner.execute_stage (so its manifest and stamps are
the real ones). For a local store and for an s3:// store on a moto server on 127.0.0.1,
three ways to get from "the stage starts" to "its parameters are restored" alternate
(A B C A B C ...):

- `consume`: what a stage does now: `store.open_input` (tasks/store/: locally the newest
  step's params and meta checked by stamp or sha256; on S3 one LIST against the object
  versions the manifest recorded, the small files into an empty cache), then Orbax
  restores the params from where `ArtifactRef.checkpoint_dir` says (on S3 the bucket's URL);
- `before`: what trainflow did before the store read what it consumes: every file of the
  artifact (all steps, optimizer and data state) re-hashed (and on S3 downloaded first),
  then the same restore from the copy;
- `bare`: Orbax restores the params straight from the producer's checkpoint (its directory,
  on S3 its URL), no store.

Bytes read from the store are, on a local store, the kernel's count of bytes this process
read (/proc/self/io rchar: the check and the restore together) and, on S3, the bytes
downloaded into the cache plus the bytes TensorStore's s3 driver read (its
/tensorstore/kvstore/s3/bytes_read metric; Orbax's few small metadata files, read through
fsspec, are not counted). The first step's compile is left out (it does not depend on
the store). The local files are in the page cache for all three alike (just written).
Writes bench/results/consume.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
import tensorstore as ts  # noqa: E402

from bench import finish, load_line, machine, summary  # noqa: E402
from engine.config import Strict  # noqa: E402
from engine.contract import CHECKPOINT_DIR  # noqa: E402
from engine.train.bucket_paths import checkpoint_path  # noqa: E402
from engine.train.checkpoint import ITEMS, Checkpointer  # noqa: E402
from tasks.registry import StageContext, StageHooks, StageKind, register_stage  # noqa: E402
from tasks.runner import StageJob, execute_stage  # noqa: E402
from tasks.store.base import ArtifactStore  # noqa: E402
from tasks.store.consume import consumed_files  # noqa: E402
from tasks.store.records import compare_files  # noqa: E402

STEPS = (1, 2, 3)
LEAVES = 8


class BigConfig(Strict):
    gigabytes: float = 0.25


class BigCheckpoint(StageKind):
    """Three kept steps of `gigabytes` of float32 params plus 2x that of optimizer state."""

    task = "bench-big-checkpoint"
    output = "checkpoint"
    config_schema = BigConfig

    def run(self, ctx: StageContext) -> dict:
        n = int(ctx.config.gigabytes * 1e9) // 4 // LEAVES
        rng = np.random.default_rng(0)
        ckpt = Checkpointer(ctx.checkpoint_dir, keep=3, async_save=False)  # on S3: at the bucket's URL
        for step in STEPS:
            params = {f"w{i}": rng.standard_normal(n, dtype=np.float32) for i in range(LEAVES)}
            adam = {"mu": {k: v * 0.5 for k, v in params.items()}, "nu": {k: v * v for k, v in params.items()}}
            ckpt.save(step, params, adam, {"step": step}, {"position": step})
        ckpt.close()
        return {"gigabytes": ctx.config.gigabytes}


register_stage(BigCheckpoint, replace=True)


def rchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar"):
            return int(line.split()[1])
    return 0


def tensorstore_bytes_read() -> int:
    """Bytes TensorStore's S3 driver has read in this process (the arrays Orbax restores)."""
    metrics = ts.experimental_collect_matching_metrics("/tensorstore/kvstore/s3/bytes_read")
    return int(sum(v.get("value", 0) for m in metrics for v in m.get("values", [])))


def restore_params(checkpoint: str | Path, gigabytes: float) -> float:
    """Orbax restores the newest step's params as numpy; returns their sum (so nothing is skipped)."""
    n = int(gigabytes * 1e9) // 4 // LEAVES
    item = {f"w{i}": jax.ShapeDtypeStruct((n,), np.float32) for i in range(LEAVES)}
    manager = ocp.CheckpointManager(
        checkpoint_path(checkpoint), item_names=ITEMS, options=ocp.CheckpointManagerOptions(read_only=True)
    )
    restore_args = {k: ocp.RestoreArgs(restore_type=np.ndarray) for k in item}
    restored = manager.restore(
        manager.latest_step(),
        args=ocp.args.Composite(params=ocp.args.PyTreeRestore(item=item, restore_args=restore_args)),
    )
    manager.close()
    return float(sum(float(v[:8].sum()) for v in restored.params.values()))


def measure(kind: str, url: str, producer: str, gigabytes: float, artifact_id: str, cache: Path) -> dict:
    """One timed start of `kind` (consume | before | bare); the cache is emptied first.
    `producer` is where the upstream checkpoint is (its directory, or on S3 its URL)."""
    shutil.rmtree(cache, ignore_errors=True)
    os.environ["TRAINFLOW_CACHE"] = str(cache)
    start, read, streamed = time.perf_counter(), rchar(), tensorstore_bytes_read()
    downloaded = 0
    if kind == "bare":
        restore_params(producer, gigabytes)
    else:
        store = ArtifactStore(url)
        if kind == "consume":
            ref = store.open_input("producer", artifact_id)
            directory, checkpoint = ref.path, ref.checkpoint_dir
        else:  # before: every object downloaded (on S3) and re-hashed, then restored from the copy
            directory = store.artifact_dir("producer", artifact_id)
            if store.remote is not None:
                store.remote.download("producer", artifact_id, directory)
            manifest = store.manifest("producer", artifact_id)
            assert compare_files(directory, manifest["files"]) == []
            checkpoint = str(directory / CHECKPOINT_DIR)
        if store.remote is not None:
            downloaded = sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())
        restore_params(checkpoint, gigabytes)
    return {
        "seconds": time.perf_counter() - start,
        "bytes_read": rchar() - read,
        "bytes_downloaded": downloaded,
        "bytes_streamed": tensorstore_bytes_read() - streamed,
    }


def run_case(where: str, gigabytes: float, repeats: int, work: Path, url: str | None) -> dict:
    root = url or str(work / f"store-{gigabytes}")
    os.environ["TRAINFLOW_CACHE"] = str(work / "producer-cache")
    kind = BigCheckpoint()
    config = BigConfig(gigabytes=gigabytes)
    job = StageJob("producer", kind, config, {}, {}, f"big{int(gigabytes * 1000):013d}")
    print(f"{where} {gigabytes} GB: writing the upstream artifact ...", file=sys.stderr)
    result = execute_stage(job, ArtifactStore(root), hooks=StageHooks(log=lambda line: None))
    producer_dir = result.path
    producer = ArtifactStore(root).checkpoint_location("producer", job.artifact_id)
    manifest = json.loads((producer_dir / "artifact.json").read_text())
    files = manifest["files"]
    params_bytes = sum(e["size"] for rel, e in files.items() if f"/{STEPS[-1]}/params/" in rel)
    consumed_bytes = sum(e["size"] for e in consumed_files(files).values())
    restore_params(producer, gigabytes)  # warm-up: Orbax's and JAX's first-use costs
    runs: dict[str, list[dict]] = {"consume": [], "before": [], "bare": []}
    for round_ in range(repeats):
        for name in runs:
            print(f"  [{round_ + 1}/{repeats}] {name} ...", file=sys.stderr)
            runs[name].append(measure(name, root, producer, gigabytes, job.artifact_id, work / "consumer-cache"))
    out = {
        "store": where,
        "params_gb": gigabytes,
        "artifact_bytes": sum(e["size"] for e in files.values()),
        "params_bytes": params_bytes,
        "consumed_bytes": consumed_bytes,
        "runs": runs,
    }
    for name, values in runs.items():
        out[name] = {
            "seconds": summary([r["seconds"] for r in values]),
            "bytes_read_median": int(np.median([r["bytes_read"] for r in values])),
            "bytes_downloaded_median": int(np.median([r["bytes_downloaded"] for r in values])),
            "bytes_streamed_median": int(np.median([r["bytes_streamed"] for r in values])),
        }
        # What came from the store: on a bucket the bytes downloaded into the cache plus those
        # TensorStore read at the URL; on a local store the bytes the process read.
        m = out[name]
        m["store_bytes"] = m["bytes_downloaded_median"] + m["bytes_streamed_median"] if url else m["bytes_read_median"]
    bare = out["bare"]["seconds"]["median"]
    out["consume_vs_bare"] = out["consume"]["seconds"]["median"] / bare
    out["before_vs_bare"] = out["before"]["seconds"]["median"] / bare
    out["consume_read_vs_params"] = out["consume"]["store_bytes"] / params_bytes
    out["before_read_vs_params"] = out["before"]["store_bytes"] / params_bytes
    shutil.rmtree(producer_dir, ignore_errors=True)
    shutil.rmtree(work / "consumer-cache", ignore_errors=True)
    return out


def s3_server() -> tuple[object, str]:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update(
        AWS_ENDPOINT_URL=f"http://{host}:{port}",
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
    )
    import boto3

    boto3.client("s3").create_bucket(Bucket="trainflow-bench")
    return server, "s3://trainflow-bench/consume"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--local-gb", default="0.25,1", help="params sizes (GB) on a local store")
    parser.add_argument("--s3-gb", default="0.25", help="params sizes (GB) on moto S3 (held in its memory)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    info = machine(orbax=ocp.__version__ if hasattr(ocp, "__version__") else None)
    work = Path(tempfile.mkdtemp(prefix="trainflow-bench-consume-"))
    cases = []
    try:
        for gb in [float(x) for x in args.local_gb.split(",") if x]:
            cases.append(run_case("local", gb, args.repeats, work, None))
            print(json.dumps({k: v for k, v in cases[-1].items() if k != "runs"}), file=sys.stderr)
        s3_sizes = [float(x) for x in args.s3_gb.split(",") if x]
        if s3_sizes:
            server, url = s3_server()
            try:
                for gb in s3_sizes:
                    cases.append(run_case("s3 (moto)", gb, args.repeats, work, f"{url}-{gb}"))
                    print(json.dumps({k: v for k, v in cases[-1].items() if k != "runs"}), file=sys.stderr)
            finally:
                server.stop()
    except BaseException as e:  # keep what was measured
        print(f"stopped after {len(cases)} case(s): {type(e).__name__}: {e}", file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    info = finish(info)
    print(f"\n{load_line(info)}")
    print(
        f"{'store':<10} {'params':>7} {'artifact':>9} | {'consume s':>9} {'read/params':>11} | "
        f"{'before s':>8} {'read/params':>11} | {'bare s':>7} | {'consume/bare':>12} {'before/bare':>11}"
    )
    for c in cases:
        print(
            f"{c['store']:<10} {c['params_bytes'] / 1e9:>6.2f}G {c['artifact_bytes'] / 1e9:>8.2f}G | "
            f"{c['consume']['seconds']['median']:>9.2f} {c['consume_read_vs_params']:>11.2f} | "
            f"{c['before']['seconds']['median']:>8.2f} {c['before_read_vs_params']:>11.2f} | "
            f"{c['bare']['seconds']['median']:>7.2f} | {c['consume_vs_bare']:>12.2f} {c['before_vs_bare']:>11.2f}"
        )
    out = REPO / "bench" / "results" / "consume.json"
    out.write_text(
        json.dumps(
            {
                "description": "stage start -> params restored downstream of a 3-step checkpoint artifact: "
                "open_input + Orbax restore (consume), full re-hash/download + restore (before), bare Orbax restore",
                "machine": info,
                "cases": cases,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
