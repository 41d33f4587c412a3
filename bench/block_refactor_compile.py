"""Compile time and compiled memory of one training step before and after the typed-blocks
refactor (issue 50), for llama3.1-8b and qwen3-30b-a3b on a TPU v5p-8 (4 chips), compiled
by libtpu on this host with `trainflow plan`'s plan_step:

    python -m bench.block_refactor_compile --before DIR [--after DIR] [--rounds 1]

DIR is a checkout of the commit before the refactor (the parent of "models: the decoder as
a layer pattern"), e.g. `git worktree add /tmp/before 3f53410^`. Each compile runs in its
own process with that tree (or this one) first on sys.path, the two trees alternating
(ABAB) per model. Compiled memory is the compiler's, so the machine's load does not change
it; compile time does, and the load average is recorded with each run.

Writes bench/results/block_refactor_compile.json (or --out; --refactor names the change measured).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import statistics
import subprocess
import sys

import jax

from bench import REPO, finish, machine

MODELS = {
    "llama3.1-8b": {"model": "llama3.1-8b", "mesh": {"data": 1, "fsdp": -1}},
    "qwen3-30b-a3b": {
        "model": "qwen3-30b-a3b",
        "mesh": {"data": 1, "fsdp": -1},
        "compute": {"param_dtype": "bfloat16"},
    },
}
SHAPE = {"data": {"seq_len": 4096, "batch_size": 8}, "steps": 10}
TARGET = "v5p-8"

# Runs in a fresh interpreter whose sys.path starts with the tree being measured.
WORKER = """
import dataclasses, json, os, sys, time
tree = json.loads(sys.argv[1])
started = time.perf_counter()
from engine.config import load_config
from engine.train.config import TrainConfig
from engine.train.plan import plan_step
from engine.train.targets import GiB, get_target
imported = time.perf_counter()
cfg = load_config(tree=tree, schema=TrainConfig)
load_before = os.getloadavg()[0]
begun = time.perf_counter()
plan = plan_step(cfg, get_target(sys.argv[2]))
seconds = time.perf_counter() - begun
memory = {k: v / GiB for k, v in dataclasses.asdict(plan.memory).items()}
memory["total"] = plan.memory.total / GiB
import engine
print(json.dumps({"engine": engine.__file__, "plan_seconds": seconds, "import_seconds": imported - started,
                  "how": plan.how,
                  "fits": plan.fits, "mesh": plan.mesh, "per_chip_gib": memory,
                  "load_1min": [load_before, os.getloadavg()[0]]}))
"""


def _run(tree_dir: str, config: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": tree_dir}
    proc = subprocess.run(
        [sys.executable, "-c", WORKER, json.dumps(config), TARGET],
        cwd=tree_dir,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise SystemExit(f"plan in {tree_dir} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _commit(tree_dir: str) -> str:
    return subprocess.run(
        ["git", "-C", tree_dir, "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="a checkout of the commit before the refactor")
    parser.add_argument("--after", default=str(REPO), help="a checkout of the commit after (default: this tree)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--out", default="block_refactor_compile.json", help="results file under bench/results/")
    parser.add_argument("--refactor", default="the typed-blocks refactor (issue 50)", help="what the trees differ by")
    args = parser.parse_args()
    trees = {"before": os.path.abspath(args.before), "after": os.path.abspath(args.after)}
    info = machine(
        description=f"Compile time and compiled memory of one training step before and after {args.refactor}, "
        f"for {', '.join(args.models)} on a TPU {TARGET}, compiled by libtpu on this host with plan_step",
        jax=jax.__version__,
        libtpu=importlib.metadata.version("libtpu"),
        commits={name: _commit(path) for name, path in trees.items()},
        target=TARGET,
        worker=WORKER.strip(),
    )
    results: dict = {}
    out = REPO / "bench" / "results" / args.out
    info["results"] = results
    info["figures"] = (
        "per_chip_gib: the compiler's memory analysis, not load-sensitive; plan_seconds: trace, lower and "
        "compile of one step in a fresh process, load-sensitive (the host was shared: see the load averages)"
    )
    for model in args.models:
        config = {**MODELS[model], **SHAPE}
        runs: dict = {"before": [], "after": []}
        for _ in range(args.rounds):
            for name, path in trees.items():  # ABAB
                row = _run(path, config)
                runs[name].append(row)
                results[model] = {"config": config, "runs": runs}
                out.write_text(json.dumps(info, indent=1) + "\n")  # so far, in case the run is stopped
                print(
                    f"{model:14s} {name:6s} plan {row['plan_seconds']:6.1f} s  total "
                    f"{row['per_chip_gib']['total']:.2f} GiB per chip (temporaries "
                    f"{row['per_chip_gib']['temporaries']:.2f})  load {row['load_1min'][0]:.2f}",
                    flush=True,
                )
        results[model] = {
            "config": config,
            "runs": runs,
            "median_plan_seconds": {k: statistics.median(r["plan_seconds"] for r in v) for k, v in runs.items()},
            "per_chip_gib": {k: v[0]["per_chip_gib"] for k, v in runs.items()},
        }
    out.write_text(json.dumps(finish(info, settle=0), indent=1) + "\n")
    print(f"wrote {out.relative_to(REPO)}")


if __name__ == "__main__":
    main()
