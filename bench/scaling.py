"""Multi-process scaling: tokens/s and step time for 1, 2 and 4 engine processes at one
global batch, each run a real `python -m engine.train` launched as `local` or `local-multi`
(jax.distributed on 127.0.0.1, gloo collectives), on the same synthetic-free data.

    python -m bench.scaling [--processes 1 2 4] [--steps 30] [--model tiny] [--batch 16] [--seq 128]

The devices per process are `--devices / processes` (default 4 simulated CPU devices in
all), so every run has the same mesh size and global batch; what changes is how many
processes share it and how much of each step is cross-process collectives. On one host the
processes also share its cores: the figures measure the cost of the multi-process machinery
(gloo all-reduces, the coordination service), not a cluster's speed-up.

Step time and tokens/s are the medians over the logged steps after the first `--warmup` (compile excluded).
Writes bench/results/scaling.json.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

from bench import machine
from engine.data.shards import write_dataset
from tasks.launch.run import LauncherSpec, run_child

REPO = Path(__file__).resolve().parent.parent
LOAD_AT_START = list(os.getloadavg())


def dataset(out: Path) -> Path:
    """Standard-library sources as byte tokens (vocabulary 257), as tests/test_multihost.py."""
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:200]
    docs = [np.concatenate([np.frombuffer(Path(p).read_bytes(), np.uint8).astype(np.int32), [256]]) for p in files]
    write_dataset(out, {"train": docs[:-8], "validation": docs[-8:]}, vocab_size=257, eos_id=256)
    return out


def run(processes: int, args: argparse.Namespace, data: Path, work: Path) -> dict:
    out = work / f"p{processes}"
    out.mkdir()
    devices = args.devices // processes
    cfg = {
        "model": {"preset": args.model, "vocab_size": 260, "max_seq_len": args.seq},
        "mesh": {"data": args.devices},
        "steps": args.steps,
        "log_every": 1,
        "seed": 0,
        "data": {"path": str(data), "seq_len": args.seq, "batch_size": args.batch, "eval_batches": 1},
        "checkpoint": {"directory": str(out / "checkpoint"), "every_steps": 10_000, "async_save": False},
        "metrics_dir": str(out),
        "progress": False,
    }
    (out / "train.yaml").write_text(yaml.safe_dump(cfg))
    env = {"XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu"}
    spec = LauncherSpec(kind="local-multi", processes=processes, env=env) if processes > 1 else LauncherSpec(env=env)
    start = time.perf_counter()
    run_child([sys.executable, "-m", "engine.train", str(out / "train.yaml")], launcher=spec, log=lambda _: None)
    wall = time.perf_counter() - start
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r and "tokens_per_second" in r]
    rates = [r["tokens_per_second"] for r in train[args.warmup :] if r["tokens_per_second"] == r["tokens_per_second"]]
    rate = statistics.median(rates)
    tokens = args.batch * args.seq
    return {
        "processes": processes,
        "devices_per_process": devices,
        "wall_seconds": round(wall, 2),
        "step_seconds_median": round(tokens / rate, 4),
        "step_seconds_spread": [round(tokens / max(rates), 4), round(tokens / min(rates), 4)],
        "tokens_per_second": round(rate, 1),
        "final_loss": train[-1]["loss"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--devices", type=int, default=4, help="simulated CPU devices in all, split over processes")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args()
    bad = [p for p in args.processes if args.devices % p]
    if bad:
        parser.error(f"--devices {args.devices} does not split over {bad} processes")
    with tempfile.TemporaryDirectory(prefix="trainflow-scaling-") as tmp:
        work = Path(tmp)
        data = dataset(work / "data")
        runs = [run(p, args, data, work) for p in args.processes]
    losses = {r["final_loss"] for r in runs}
    result = {
        "bench": "scaling",
        "config": vars(args),
        "runs": runs,
        "same_final_loss": len(losses) == 1 or max(losses) - min(losses) <= 1e-5 * max(abs(x) for x in losses),
        "machine": {**machine(load_average_at_end=list(os.getloadavg())), "load_average_at_start": LOAD_AT_START},
        "load_average_before": LOAD_AT_START,
    }
    under_load = max(LOAD_AT_START[0], os.getloadavg()[0]) > 1.5 * (os.cpu_count() or 1) / 2
    result["under_load"] = under_load
    print(f"{'processes':>9} {'devices/proc':>12} {'step s (median)':>16} {'tokens/s':>10} {'final loss':>11}")
    for r in runs:
        print(
            f"{r['processes']:>9} {r['devices_per_process']:>12} {r['step_seconds_median']:>16.4f} "
            f"{r['tokens_per_second']:>10.0f} {r['final_loss']:>11.5f}"
        )
    if under_load:
        print("under load (load average above 1.5 on 2 cores): not comparable")
    results = REPO / "bench" / "results"
    results.mkdir(exist_ok=True)
    (results / "scaling.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
