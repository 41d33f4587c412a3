"""Cheap stage kinds for pipeline tests, registered through the public Python API.

Pipelines load them with `imports: [tests.pipeline_toys]`, so `trainflow` processes
started by tests can use them too. Each run appends its stage name to `trace` (a file,
excluded from the artifact id) so tests can count the work actually done.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from pydantic import Field

from engine.config import Strict
from tasks.registry import Input, StageContext, StageKind, register_stage


class ValueConfig(Strict):
    value: int = 1
    sleep: float = Field(0.0, ge=0)
    fail_times: int = Field(0, ge=0)
    """Fail this many attempts (counted in `trace`) before succeeding."""
    barrier: str | None = None
    """A directory: write <stage> there, then wait until every name in `peers` is there too."""
    peers: list[str] = []
    trace: str | None = None


def _trace(ctx: StageContext) -> int:
    """Record this attempt; returns how many attempts of this stage came before it."""
    if not ctx.config.trace:
        return 0
    path = Path(ctx.config.trace)
    before = path.read_text().split() if path.is_file() else []
    with open(path, "a") as f:
        f.write(ctx.stage + "\n")
    return before.count(ctx.stage)


def _barrier(ctx: StageContext, timeout: float = 60.0) -> None:
    directory = Path(ctx.config.barrier)
    (directory / ctx.stage).touch()
    deadline = time.monotonic() + timeout
    while not all((directory / peer).exists() for peer in ctx.config.peers):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{ctx.stage}: peers {ctx.config.peers} never arrived; stages ran one at a time")
        time.sleep(0.05)


def _run_value(ctx: StageContext, value: int) -> dict:
    previous = _trace(ctx)
    if previous < ctx.config.fail_times:
        raise RuntimeError(f"{ctx.stage}: planned failure {previous + 1} of {ctx.config.fail_times}")
    if ctx.config.barrier:
        _barrier(ctx)
    time.sleep(ctx.config.sleep)
    (ctx.out_dir / "value.json").write_text(json.dumps(value))
    return {"value": value}


@register_stage
class ToySource(StageKind):
    """A dataset holding one number."""

    task = "toy-source"
    output = "dataset"
    config_schema = ValueConfig
    non_semantic = ("trace", "sleep", "barrier", "peers", "fail_times")

    def run(self, ctx: StageContext) -> dict:
        return _run_value(ctx, ctx.config.value)


@register_stage
class ToySum(StageKind):
    """A 'checkpoint' holding its inputs' numbers plus its own value."""

    task = "toy-sum"
    output = "checkpoint"
    inputs = {"a": Input("dataset"), "b": Input(("dataset", "checkpoint"), required=False)}
    config_schema = ValueConfig
    non_semantic = ToySource.non_semantic

    def run(self, ctx: StageContext) -> dict:
        total = ctx.config.value + sum(json.loads((r.path / "value.json").read_text()) for r in ctx.inputs.values())
        return _run_value(ctx, total)


# A stand-in for an engine entry point: logs, appends metrics.jsonl, checkpoints on SIGTERM.
CHILD = r"""
import json, os, signal, sys, time
out, steps, step_seconds, exit_code = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
with open(os.path.join(out, "env.json"), "w") as f:
    json.dump({k: v for k, v in os.environ.items() if k.startswith(("TOY_", "TRAINFLOW_"))}, f)
print("child started", flush=True)
with open(os.path.join(out, "metrics.jsonl"), "a") as metrics:
    for step in range(1, steps + 1):
        time.sleep(step_seconds)
        metrics.write(json.dumps({"step": step, "loss": 1.0 / step}) + "\n"); metrics.flush()
        if stop:
            open(os.path.join(out, "sigterm"), "w").write(str(step))
            print(f"SIGTERM: saved at step {step}", file=sys.stderr, flush=True)
            sys.exit(143)
if exit_code == 2:
    print("error: steps: must be even (got %d)" % steps, file=sys.stderr)
    sys.exit(2)
if exit_code:
    print("error: training diverged", file=sys.stderr)
    sys.exit(exit_code)
print(json.dumps({"result": {"final_loss": 1.0 / steps, "steps": steps}}), flush=True)
"""


class ChildConfig(Strict):
    steps: int = 3
    step_seconds: float = 0.0
    exit_code: int = 0
    trace: str | None = None


@register_stage
class ToyChild(StageKind):
    """Runs CHILD through the stage's launcher, as training stages run the engine."""

    task = "toy-child"
    output = "checkpoint"
    config_schema = ChildConfig
    non_semantic = ("trace", "step_seconds")
    launches_child = True

    def run(self, ctx: StageContext) -> dict:
        _trace(ctx)
        argv = [
            sys.executable,
            "-c",
            CHILD,
            str(ctx.out_dir),
            str(ctx.config.steps),
            str(ctx.config.step_seconds),
            str(ctx.config.exit_code),
        ]
        result = ctx.launch(argv, metrics_file=ctx.out_dir / "metrics.jsonl", total_steps=ctx.config.steps)
        return result.result or {}


class FilesConfig(Strict):
    files: dict[str, str] = {}
    """File name -> text, written into the artifact."""
    label: str = ""
    """In the id, not in the output: a config change that leaves the bytes as they were."""
    trace: str | None = None


@register_stage
class ToyFiles(StageKind):
    """A corpus of the files its config spells out."""

    task = "toy-files"
    output = "corpus"
    config_schema = FilesConfig
    non_semantic = ("trace",)

    def run(self, ctx: StageContext) -> dict:
        _trace(ctx)
        for name, text in ctx.config.files.items():
            (ctx.out_dir / name).write_text(text)
        return {"files": len(ctx.config.files)}


class ReadConfig(Strict):
    path: str | None = None
    """`{input:corpus}/NAME`: the file whose length becomes the value."""
    trace: str | None = None


@register_stage
class ToyRead(StageKind):
    """A dataset holding the length of one file of a corpus it reads through a path, or the
    total size of a corpus it reads whole."""

    task = "toy-read"
    output = "dataset"
    inputs = {
        "corpus": Input("corpus", required=False, through_paths=True),
        "whole": Input("corpus", required=False),
    }
    config_schema = ReadConfig
    non_semantic = ("trace",)

    def run(self, ctx: StageContext) -> dict:
        _trace(ctx)
        value = len(Path(ctx.config.path).read_text()) if ctx.config.path else 0
        if "whole" in ctx.inputs:
            value += sum(p.stat().st_size for p in ctx.inputs["whole"].path.glob("*.txt"))
        (ctx.out_dir / "value.json").write_text(json.dumps(value))
        return {"value": value}
