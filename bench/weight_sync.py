"""Weight sync to a rollout server: the local path beside the bucket path, at two model sizes.

    python -m bench.weight_sync [--repeats 3]

What one push of the policy costs before the server's reload (the reload, vLLM reading a local
directory, is the same on both paths and is not timed):

- local: engine/posttrain/vllm_rollout.py's path: the Hugging Face safetensors written from
  memory into a directory on /dev/shm that the server reads (write_hf_model);
- staged (every tensor changed, a full fine-tune's update): engine/interop/weight_sync.py
  writes the changed shards (here 1/16 of the model each, the share a 64 MiB shard is of a
  1 GB model) to an s3:// bucket and commits the
  manifest, then the server host's reader (engine/interop/bucket_weights.py, pull) fetches
  and checks them into its directory: the two hosts' work one after the other;
- staged, one tensor changed (a frozen model but its final norm, as LoRA's base or a partly
  frozen run): only that shard moves;
- both staged cases also to a file:// folder: the sync's own cost (digests, shard files,
  the reader's checks) without an S3 server.

The bucket is moto's S3 server in this process, on the same CPUs: no network, so staged
figures are CPU and copy costs, a floor for a real bucket. Runs in turns (A B C A B C ...).
Writes bench/results/weight_sync.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import boto3  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
from moto.server import ThreadedMotoServer  # noqa: E402

from bench import finish, load_line, machine, summary  # noqa: E402
from engine.interop.bucket_weights import pull  # noqa: E402
from engine.interop.hf.export import write_hf_model  # noqa: E402
from engine.interop.weight_sync import SHARD_BYTES, BucketWeightSync  # noqa: E402
from engine.models.config import ComputeConfig, ModelConfig  # noqa: E402
from engine.models.params import abstract_model_params  # noqa: E402

SIZES = {
    "tiny": ModelConfig(
        vocab_size=1024, d_model=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32, mlp_dim=384
    ),
    "small": ModelConfig(
        vocab_size=8192, d_model=512, num_layers=8, num_heads=8, num_kv_heads=4, head_dim=64, mlp_dim=1536
    ),
}


SHARDS_PER_MODEL = 16


def start_s3() -> str:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update(
        {
            "AWS_ENDPOINT_URL": f"http://{host}:{port}",
            "AWS_ACCESS_KEY_ID": "bench",
            "AWS_SECRET_ACCESS_KEY": "bench",
            "AWS_DEFAULT_REGION": "us-east-1",
        }
    )
    boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"]).create_bucket(Bucket="bench")
    return "s3://bench"


def measure(name: str, cfg: ModelConfig, bucket: str, repeats: int, scratch: Path) -> dict:
    compute = ComputeConfig()
    rng = np.random.default_rng(0)
    params = jax.tree.map(
        lambda s: rng.standard_normal(s.shape).astype(s.dtype), abstract_model_params(cfg, compute, None)
    )
    nbytes = sum(x.nbytes for x in jax.tree.leaves(params))
    # A model of SHARDS_PER_MODEL shards, as a 1-16 GB model has at the default 64 MiB bound.
    shard_bytes = nbytes // SHARDS_PER_MODEL
    # The same sync to moto's S3 and to a file:// folder (the sync's own cost, no S3 server).
    targets = {"s3": f"{bucket}/{name}", "file": (scratch / "bucket" / name).as_uri()}
    syncs = {t: BucketWeightSync(url, cfg, compute, shard_bytes=shard_bytes) for t, url in targets.items()}
    for target, sync in syncs.items():
        sync.push(params)  # version 1: what the server holds before the measured pushes
        pull(targets[target], scratch / f"{name}-{target}-server")
    local_dir = Path(
        tempfile.mkdtemp(prefix="bench-weight-sync-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
    )
    cases = [f"{t}_{change}" for change in ("all_changed", "one_changed") for t in targets]
    seconds: dict[str, list[float]] = {"local": [], **{c: [] for c in cases}}
    writer: dict[str, list[float]] = {c: [] for c in cases}
    moved: dict[str, int] = {}
    try:
        for round_ in range(repeats):
            params = jax.tree.map(lambda x: x + np.float32(1e-3), params)  # every tensor changes
            start = time.perf_counter()
            write_hf_model(params, cfg, compute, local_dir)
            seconds["local"].append(time.perf_counter() - start)
            for case in cases:
                target = case.split("_", 1)[0]
                if case == "s3_one_changed":
                    params["final_norm"]["scale"] = params["final_norm"]["scale"] + np.float32(1e-3)
                start = time.perf_counter()
                syncs[target].push(params)
                pushed = time.perf_counter()
                fetched = pull(targets[target], scratch / f"{name}-{target}-server")
                seconds[case].append(time.perf_counter() - start)
                writer[case].append(pushed - start)
                moved[case] = syncs[target].last["bytes_written"] + fetched["fetched_bytes"]
            print(
                f"[{round_ + 1}/{repeats}] {name}: " + ", ".join(f"{k} {v[-1]:.3f} s" for k, v in seconds.items()),
                file=sys.stderr,
            )
    finally:
        shutil.rmtree(local_dir, ignore_errors=True)
    return {
        "model": cfg.model_dump(include={"vocab_size", "d_model", "num_layers", "mlp_dim"}),
        "bytes": nbytes,
        "shard_bytes": shard_bytes,
        "shards": syncs["s3"].last["shards"],
        "seconds": {k: summary(v) for k, v in seconds.items()},
        "writer_seconds": {k: summary(v) for k, v in writer.items()},
        "bytes_moved": moved,
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's server logs every request
    info = machine(jax=jax.__version__)
    bucket = start_s3()
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        for name, cfg in SIZES.items():
            results[name] = measure(name, cfg, bucket, args.repeats, Path(scratch))
    info = finish(info)
    columns = ["local", "s3_all_changed", "s3_one_changed", "file_all_changed", "file_one_changed"]
    print(f"\nmedian seconds per sync\n{'model':<8} {'MB':>7} " + " ".join(f"{c:>16}" for c in columns))
    for name, r in results.items():
        print(f"{name:<8} {r['bytes'] / 1e6:>7.1f} " + " ".join(f"{r['seconds'][c]['median']:>16.3f}" for c in columns))
    print(load_line(info))
    out = REPO / "bench/results/weight_sync.json"
    out.write_text(
        json.dumps(
            {
                "description": __doc__.split("\n")[0],
                "command": "python -m bench.weight_sync " + " ".join(sys.argv[1:]),
                "default_shard_bytes": SHARD_BYTES,
                "results": results,
                "machine": info,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {out.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
