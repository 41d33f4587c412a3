"""Issue 51's Granite 4 and Nemotron 3 presets, and issue 62's DeepSeek-V4-Flash, compiled for a
TPU topology through libtpu on this host, as `trainflow plan` compiles a training step
(plan_step): float32 parameters and Adam moments, bf16 compute, remat full (the presets'
compute sections), 4,096-token rows (8 on a v5p-8, 32 on larger slices, or --rows),
`mesh: {data: 1, fsdp: -1, tensor: 2}` so the Mamba2 layers run with their heads over the
tensor axis (engine/models/mamba2.py), or with --expert an `expert` axis beside fsdp (expert
parallelism: engine/models/moe_ep.py). Per chip: compiled memory (parameters, moments,
temporaries, total), whether it fits, XLA's FLOPs, the bytes each chip moves
over ICI a step (plan.network_bytes) and the plan's wall seconds (load-dependent,
recorded with the load; the memory is not), with the commit and the jax and libtpu versions.

    python -m bench.hybrid_presets_plan granite-4.0-h-micro v5p-8 [--out bench/results/hybrid_presets_plan.json]
    python -m bench.hybrid_presets_plan deepseek-v4-flash v5p-256 --tensor 1 --expert 16 --rows 128

Each (model, target, mesh) row replaces its earlier one.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import subprocess
import time
from pathlib import Path

import jax

from bench import REPO, finish, machine
from engine.config import load_config
from engine.train.config import TrainConfig
from engine.train.plan import plan_step
from engine.train.targets import GiB, get_target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("target")
    parser.add_argument("--tensor", type=int, default=2)
    parser.add_argument("--expert", type=int, default=1, help="an expert mesh axis of this many devices")
    parser.add_argument("--rows", type=int, help="rows of 4,096 tokens a step (default: 8 on a v5p-8, else 32)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "hybrid_presets_plan.json")
    args = parser.parse_args()
    info = machine(jax=jax.__version__, libtpu=_version("libtpu"))
    mesh = {"data": 1, "fsdp": -1, "tensor": args.tensor, **({"expert": args.expert} if args.expert > 1 else {})}
    data = {"seq_len": 4096, "batch_size": args.rows or (8 if args.target == "v5p-8" else 32)}
    cfg = load_config(tree={"model": args.model, "mesh": mesh, "data": data, "steps": 10}, schema=TrainConfig)
    started = time.perf_counter()
    plan = plan_step(cfg, get_target(args.target))
    memory = plan.memory
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
    row = {
        "model": args.model,
        "target": args.target,
        "mesh": mesh,
        "data": data,
        "commit": commit.stdout.strip() or None,
        "how": plan.how,
        "fits": plan.fits,
        "per_chip_gib": {
            key: round(getattr(memory, key) / GiB, 2)
            for key in ("parameters", "optimizer_state", "temporaries", "generated_code", "total")
        },
        "hardware_flops": plan.hardware_flops,
        "network_gb_per_chip": {k: round(v / 1e9, 2) for k, v in (plan.network or {}).items()},
        "plan_seconds": round(time.perf_counter() - started),
        "machine": finish(info, settle=0),
    }
    print(json.dumps(row, indent=1), flush=True)
    kept = json.loads(args.out.read_text())["rows"] if args.out.exists() else []
    key = (row["model"], row["target"], json.dumps(mesh, sort_keys=True))
    kept = [r for r in kept if (r["model"], r["target"], json.dumps(r["mesh"], sort_keys=True)) != key]
    args.out.write_text(json.dumps({"rows": [*kept, row]}, indent=1) + "\n")


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
