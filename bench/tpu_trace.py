"""A jax.profiler trace of a few training steps, summarised: where the chip's time went.

`traced(step, state, rest, steps, log_dir)` runs `step` under jax.profiler.trace; `summary(log_dir)`
reads the trace the profiler wrote (plugins/profile/*/*.trace.json.gz, Chrome trace JSON:
no TensorBoard or xprof needed) and keeps what a report needs, not the trace itself (tens
of MB): the device's busy time per step, its time by kind of operation (matmul fusions,
other fusions, Pallas kernels, copies) and the costliest operations by name with their
share. bench/tpu_v5e.py --trace puts it in a run's row.

    python -m bench.tpu_trace DIR     # summarise a trace written before
"""

from __future__ import annotations

import collections
import gzip
import json
import re
import sys
from pathlib import Path


def traced(step, state: tuple, rest: tuple, steps: int, log_dir: str):
    """`state = step(*state, *rest)[:len(state)]`, `steps` times under the profiler (a
    training step: state = (params, opt_state), rest = (batch,)); the last outputs."""
    import jax

    with jax.profiler.trace(log_dir):
        for _ in range(steps):
            out = step(*state, *rest)
            state = out[: len(state)]
        jax.block_until_ready(out)
    return out


def _kind(name: str) -> str:
    lowered = name.lower()
    if "convolution" in lowered or re.search(r"\bdot\b|dot\.", lowered):
        return "matmul fusion"
    if "custom" in lowered or "splash" in lowered or "pallas" in lowered or "gmm" in lowered:
        return "kernel (custom call)"
    if lowered.startswith(("copy", "slice", "dynamic-update-slice", "dynamic-slice", "transpose")):
        return "copy / slice"
    if "fusion" in lowered:
        return "other fusion"
    return "other"


def summary(log_dir: str, steps: int, top: int = 30) -> dict:
    """The device-side summary of the trace in `log_dir` (see the module docstring)."""
    paths = sorted(Path(log_dir).rglob("plugins/profile/*/*.trace.json.gz"))  # MaxText's sit deeper
    if not paths:
        return {"error": f"no *.trace.json.gz under {log_dir}/plugins/profile"}
    with gzip.open(paths[-1], "rb") as f:
        trace = json.load(f)
    events = trace.get("traceEvents", [])
    processes = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {
        (e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"
    }
    device = [pid for pid, name in processes.items() if re.search(r"/device:(TPU|GPU):0\b", name)]
    if not device:
        return {"error": "no device process in the trace", "processes": sorted(set(processes.values()))[:20]}
    ops = [
        e
        for e in events
        if e.get("ph") == "X" and e["pid"] in device and threads.get((e["pid"], e.get("tid")), "") == "XLA Ops"
    ]
    if not ops:  # thread names differ: every device event, the modules' too, is counted
        ops = [e for e in events if e.get("ph") == "X" and e["pid"] in device and "train_step" not in e["name"]]
    modules = [
        e
        for e in events
        if e.get("ph") == "X" and e["pid"] in device and threads.get((e["pid"], e.get("tid")), "") == "XLA Modules"
    ]
    by_name: dict[str, float] = collections.Counter()
    by_kind: dict[str, float] = collections.Counter()
    detail: dict[str, dict] = {}
    for e in ops:
        by_name[e["name"]] += e.get("dur", 0.0)
        by_kind[_kind(e["name"])] += e.get("dur", 0.0)
        detail.setdefault(e["name"], {k: str(v)[:160] for k, v in (e.get("args") or {}).items()})
    busy_us = sum(by_name.values())
    train = [e.get("dur", 0.0) for e in modules if "train_step" in e.get("name", "")]
    return {
        "steps": steps,
        "device_busy_seconds_per_step": busy_us / 1e6 / steps,
        "train_step_module_seconds": [d / 1e6 for d in train],
        "by_kind_seconds_per_step": {k: v / 1e6 / steps for k, v in by_kind.most_common()},
        "top_ops": [
            {"name": n, "seconds_per_step": us / 1e6 / steps, "share": us / busy_us, "args": detail[n]}
            for n, us in by_name.most_common(top)
        ],
        "threads": sorted({threads.get((e["pid"], e.get("tid")), "") for e in events if e.get("pid") in device}),
    }


if __name__ == "__main__":
    print(json.dumps(summary(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1), indent=1))
