"""What isolating a tool call costs: engine/posttrain/sandbox.py's `run_python` under bubblewrap
(the default) beside its weaker namespaces mode (the sandbox before bubblewrap) and beside a
bare `python -I -c pass` child (no sandbox at all).

    python -m bench.sandbox [--rounds 7] [--calls 20]

Each round runs `--calls` sandboxed calls of a script that does nothing (`pass`), on each side
in turns (A B C A B C ...), one call at a time, so the time is the sandbox's own: bwrap's
namespaces and mounts, the seccomp program, the interpreter's start. Per side: calls per
second (starts/s) and milliseconds per call, median and spread over the rounds; the ratios
to the namespaces mode and the overhead over a bare interpreter.

Writes bench/results/sandbox.json with the machine (CPU model, flags, load before and after).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench import finish, load_line, machine, summary
from engine.posttrain import bubblewrap
from engine.posttrain.sandbox import SandboxLimits, run_python

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "results" / "sandbox.json"
LIMITS = SandboxLimits(cpu_seconds=5, wall_seconds=30)


def bare() -> None:
    subprocess.run([sys.executable, "-I", "-c", "pass"], stdin=subprocess.DEVNULL, check=True)


def sandboxed(isolation: str):
    limits = LIMITS.model_copy(update={"isolation": isolation})

    def call() -> None:
        result = run_python("pass", limits)
        assert result.ok, result

    return call


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args(argv)
    version = subprocess.run([bubblewrap.find_bwrap(), "--version"], capture_output=True, text=True).stdout.strip()
    info = machine(bwrap=version)
    info["as_root"] = os.geteuid() == 0
    sides = {"bare_python": bare, "namespaces": sandboxed("namespaces"), "bubblewrap": sandboxed("bubblewrap")}
    for call in sides.values():  # warm: the first bubblewrap call also checks bwrap (once per process)
        call()
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    for round_ in range(args.rounds):
        for name, call in sides.items():
            start = time.perf_counter()
            for _ in range(args.calls):
                call()
            seconds[name].append((time.perf_counter() - start) / args.calls)
        print(
            f"round {round_ + 1}/{args.rounds}: " + ", ".join(f"{n} {s[-1] * 1e3:.0f} ms" for n, s in seconds.items())
        )
    info = finish(info)
    per_call = {name: summary([s * 1e3 for s in values]) for name, values in seconds.items()}
    starts = {name: summary([1 / s for s in values]) for name, values in seconds.items()}
    base, weak, bwrap = (
        per_call["bare_python"]["median"],
        per_call["namespaces"]["median"],
        per_call["bubblewrap"]["median"],
    )
    result = {
        "description": f"run_python('pass') one call at a time, {args.calls} calls per side per round, "
        f"{args.rounds} rounds alternating bare python / namespaces / bubblewrap",
        "machine": info,
        "ms_per_call": per_call,
        "starts_per_second": starts,
        "bubblewrap_over_namespaces": bwrap / weak,
        "overhead_ms_over_bare_python": {"namespaces": weak - base, "bubblewrap": bwrap - base},
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{load_line(info)}")
    print(f"{'side':<14}{'ms/call':>10}{'spread':>9}{'starts/s':>10}{'overhead ms':>13}")
    for name in sides:
        ms = per_call[name]
        rate = starts[name]["median"]
        print(f"{name:<14}{ms['median']:>10.1f}{ms['spread']:>9.2f}{rate:>10.1f}{ms['median'] - base:>13.1f}")
    print(f"bubblewrap / namespaces: {bwrap / weak:.2f}x per call  -> {OUT.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
