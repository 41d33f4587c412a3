"""Benchmarks: each script measures one target beside its peer and writes
bench/results/<name>.json; docs/benchmarks.md reports the figures.

The shared harness lives here. `alternate` runs the engine and its peer in turns
(A B A B ...), each run in a fresh subprocess, so slow drift of a shared machine (other
jobs, thermal state) falls on both sides alike; `summary` gives the median and the spread
of each side; `machine` and `finish` record the CPU model, its SIMD flags and the load
average before and after, and mark a result taken under load as not comparable.
"""

from __future__ import annotations

import collections
import glob
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
# A 1-minute load average above 1.5 on 2 cores (0.75 per core) means another job shared
# the CPUs: the figures are then kept but marked, never quoted as a result.
LOAD_PER_CORE_LIMIT = 0.75


def cpu_description() -> dict:
    """The CPU model, its family and model numbers (a virtual machine's model name may say no
    more than "AMD EPYC": family 25 is Zen 3/4, 26 Zen 5) and which of CPU_FLAGS it has (from
    /proc/cpuinfo; empty elsewhere)."""
    model, flags, numbers = platform.processor() or platform.machine(), set(), {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and model == (platform.processor() or platform.machine()):
                model = value.strip()
            elif key in ("cpu family", "model") and key not in numbers:
                numbers[key] = value.strip()
            elif key == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return {
        "cpu": model,
        "cpu_family": numbers.get("cpu family"),
        "cpu_model_number": numbers.get("model"),
        "cpu_flags": {flag: flag in flags for flag in CPU_FLAGS},
    }


def load_limit() -> float:
    return LOAD_PER_CORE_LIMIT * (os.cpu_count() or 1)


def machine(**extra) -> dict:
    """What a result was measured on: platform, CPU model, flags and count, Python, and the
    load average at the start; `extra` adds versions."""
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        **cpu_description(),
        "cpu_count": os.cpu_count(),
        "load_average_at_start": list(os.getloadavg()),
        **extra,
    }


# The 1-minute load average lags: a benchmark that kept both cores busy leaves it near 2 by
# itself when it ends. The end check waits up to this long for it to fall back under the limit:
# it does when the benchmark was alone, it does not when another job is running.
SETTLE_SECONDS = 120


def finish(info: dict, settle: float = SETTLE_SECONDS) -> dict:
    """`info` (from machine()) with the load average at the end and the verdict: comparable,
    or taken under load (1-minute load above load_limit() at the start, or still above it
    `settle` seconds after the run's own processes have ended)."""
    waited, deadline = time.monotonic(), time.monotonic() + settle
    ended = list(os.getloadavg())
    while os.getloadavg()[0] > load_limit() and time.monotonic() < deadline:
        time.sleep(2.0)
    info = {
        **info,
        "load_average_when_the_run_ended": ended,
        "load_average_at_end": list(os.getloadavg()),
        "settle_seconds": round(time.monotonic() - waited, 1),
        "load_limit": load_limit(),
    }
    worst = max(info["load_average_at_start"][0], info["load_average_at_end"][0])
    info["comparable"] = worst <= info["load_limit"]
    if not info["comparable"]:
        info["note"] = (
            f"under load, not comparable: 1-minute load average {worst:.2f} > {info['load_limit']:.2f} "
            f"on {info['cpu_count']} cores"
        )
    return info


def load_line(info: dict) -> str:
    """One line for the printed table: the CPU, its flags and the load verdict."""
    flags = " ".join(flag for flag, present in info["cpu_flags"].items() if present) or "none of " + " ".join(CPU_FLAGS)
    verdict = info.get("note") or "quiet machine (load {:.2f} -> {:.2f})".format(
        info["load_average_at_start"][0], info["load_average_at_end"][0]
    )
    return f"{info['cpu']} ({info['cpu_count']} CPUs; {flags}); {verdict}"


def run_worker(argv: list[str], env: dict | None = None) -> dict:
    """Run `python -m ...argv` in a fresh process from the repository root; the JSON object it
    printed last on stdout."""
    environment = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    proc = subprocess.run(
        [sys.executable, "-m", *argv], capture_output=True, text=True, env=environment, cwd=REPO, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed with exit code {proc.returncode}:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def alternate(
    workers: dict[str, list[str]], repeats: int, env: dict | None = None, log=lambda msg: print(msg, file=sys.stderr)
) -> dict[str, list[dict]]:
    """Each worker command `repeats` times, in turns (A B A B ...), each run a fresh process;
    the results of each, in order."""
    results: dict[str, list[dict]] = {name: [] for name in workers}
    for round_ in range(repeats):
        for name, argv in workers.items():
            log(f"[{round_ + 1}/{repeats}] {name} ...")
            results[name].append(run_worker(argv, env))
    return results


def summary(values: list[float]) -> dict:
    """Median, min, max and the spread ((max - min) / median) of repeated measurements."""
    median = statistics.median(values)
    return {
        "median": median,
        "min": min(values),
        "max": max(values),
        "n": len(values),
        "spread": (max(values) - min(values)) / median if median else float("nan"),
        "values": values,
    }


def xla_busy(hlo: str, run: Callable[[], object]) -> tuple[dict[str, tuple[str, str]], collections.Counter]:
    """Trace `run()` with the JAX profiler and sum the busy time of XLA:CPU's threads per fused
    op of `hlo` (the compiled program's text). Returns each op's (result shape, JAX op_name)
    and its busy nanoseconds."""
    import jax
    from jax.profiler import ProfileData

    ops = {
        m.group(1): (m.group(2), m.group(3))
        for m in re.finditer(r'^\s*(?:ROOT )?%(\S+) = (\S+) .*?op_name="([^"]*)"', hlo, re.M)
    }
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            jax.block_until_ready(run())
        profile = ProfileData.from_file(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)[0])
    busy: collections.Counter = collections.Counter()
    for plane in profile.planes:
        for line in plane.lines:
            if "XLAEigen" in line.name:
                for ev in line.events:
                    if ev.name in ops:
                        busy[ev.name] += ev.duration_ns
    return ops, busy


def time_torch_steps(model, tokens, warmup: int, steps: int) -> tuple[float, float]:
    """The peer's training step as the engine's: AdamW (lr 1e-4, weight decay 0.1), gradient
    clipping at 1.0, next-token loss on `tokens[:, :-1]`. Returns seconds per step after
    `warmup` untimed steps, and the last loss."""
    import torch

    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    t0 = time.perf_counter()
    for i in range(warmup + steps):
        if i == warmup:
            t0 = time.perf_counter()
        out = model(input_ids=tokens[:, :-1], labels=tokens[:, :-1])
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return (time.perf_counter() - t0) / steps, float(out.loss.detach())
