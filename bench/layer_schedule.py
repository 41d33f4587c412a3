"""The layer schedule's compile: nemotron-h-8b's training step compiled for a v5p-8 (4 chips)
through libtpu on this host, as `trainflow plan` compiles it (plan_step), before and after the
layer scan took several repeating units (engine/models/transformer.py: layer_segments).

Same config as docs/engine.md's Nemotron-H paragraph: float32 parameters and Adam moments,
bf16 compute, remat full, `mesh: {data: 1, fsdp: -1}`, 8 rows of 4,096 tokens. Per chip the
compiled memory (parameters, moments, temporaries, total), the plan's FLOPs, how many layer
bodies the schedule compiles, and the wall seconds of the whole plan (trace, lower, compile):
the wall time depends on the machine's load (recorded, `uptime` before and after), the CPU
seconds the process used (all its threads) much less; the memory not at all.

    python -m bench.layer_schedule --label after [--out bench/results/layer_schedule.json]

Run from a checkout of the commit before the change (`git archive`) with --label before and
--out pointing here to record the other side. Each label's row replaces its earlier one.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import resource
import subprocess
import time
from pathlib import Path

import jax

from bench import REPO, finish, machine
from engine.config import load_config
from engine.models.config import ModelConfig
from engine.train.config import TrainConfig
from engine.train.plan import plan_step
from engine.train.targets import GiB, get_target


def schedule_description(cfg: ModelConfig) -> dict:
    """How the layer stack is scanned: the schedule's segments and the layer bodies compiled."""
    from engine.models import transformer

    layers = cfg.layer_pattern()
    if hasattr(transformer, "layer_segments"):
        segments = transformer.layer_segments(layers)
        return {"segments": transformer.describe_segments(segments), "bodies": transformer.segments_cost(segments)}
    start, period, steps = transformer.layer_schedule(layers)  # the one-unit schedule
    end = start + period * steps
    runs = lambda part: sum(1 for i, layer in enumerate(part) if i == 0 or part[i - 1] != layer)
    unit = runs(layers[start : start + period]) if steps else 0
    return {
        "segments": f"{start} layers, a unit of {period} x {steps}, {len(layers) - end} layers",
        "bodies": runs(layers[:start]) + unit + (runs(layers[end:]) if steps else 0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--label", required=True)
    parser.add_argument("--model", default="nemotron-h-8b")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "layer_schedule.json")
    args = parser.parse_args()
    info = machine(jax=jax.__version__, libtpu=importlib.metadata.version("libtpu"))
    uptime_before = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    tree = {
        "model": args.model,
        "mesh": {"data": 1, "fsdp": -1},
        "data": {"seq_len": 4096, "batch_size": 8},
        "steps": 10,
    }
    cfg = load_config(tree=tree, schema=TrainConfig)
    started, cpu = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    plan = plan_step(cfg, get_target("v5p-8"))
    seconds, used = time.perf_counter() - started, resource.getrusage(resource.RUSAGE_SELF)
    m = plan.memory
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
    row = {
        "label": args.label,
        "commit": commit.stdout.strip() or None,
        "model": args.model,
        "target": "v5p-8",
        "config": tree,
        "schedule": schedule_description(cfg.model),
        "how": plan.how,
        "per_chip_gib": {
            "parameters": m.parameters / GiB,
            "optimizer_state": m.optimizer_state / GiB,
            "temporaries": m.temporaries / GiB,
            "generated_code": m.generated_code / GiB,
            "total": m.total / GiB,
        },
        "hardware_flops": plan.hardware_flops,
        "flops_source": plan.flops_source,
        "plan_seconds": seconds,
        "plan_cpu_seconds": used.ru_utime + used.ru_stime - cpu.ru_utime - cpu.ru_stime,
        "uptime_before": uptime_before,
        "uptime_after": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
        "machine": finish(info, settle=0),
    }
    print(json.dumps(row, indent=1), flush=True)
    kept = json.loads(args.out.read_text())["rows"] if args.out.exists() else []
    rows = [r for r in kept if r["label"] != args.label] + [row]
    out = {
        "what": __doc__.split("\n\n")[0],
        "command": "python -m bench.layer_schedule --label LABEL",
        "rows": rows,
    }
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
