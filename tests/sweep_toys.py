"""Cheap stage kinds for the sweep, gate, step and retention tests (`imports: [tests.sweep_toys]`).

- `toy-train`: a "checkpoint" whose eval_loss is a known function of (lr, rank, value of its
  input), so a test knows which point a selection must pick. With `steps`, it commits
  `checkpoint/<step>/` every `every` steps as a training stage does (files, then digests,
  then a rename), sleeping `step_seconds` between steps; `hold` (a path) makes it wait at
  the end until that file exists, so a test can act while it is still running.
- `toy-eval`: an "eval_report" over any number of models (inputs named as it likes): for each,
  the step it read and the sum of its weights.

Each run appends its stage name to `trace` (excluded from the id), to count the work done.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from pydantic import Field

from engine.config import Strict
from tasks.registry import Input, StageContext, StageKind, register_stage


class OptimizerToy(Strict):
    learning_rate: float = 1e-3


class LoraToy(Strict):
    rank: int = 4


class TrainToyConfig(Strict):
    optimizer: OptimizerToy = OptimizerToy()
    lora: LoraToy = LoraToy()
    steps: int = Field(1, gt=0)
    every: int = Field(1, gt=0)
    step_seconds: float = 0.0
    hold: str | None = None
    slots: str | None = None
    """A directory: the stage keeps a file there while it works and reports the most files
    it saw at once (`concurrent`), i.e. how many stages of the sweep ran together."""
    trace: str | None = None


def _trace(ctx: StageContext) -> None:
    if ctx.config.trace:
        with open(ctx.config.trace, "a") as f:
            f.write(ctx.stage + "\n")


def _commit_step(out: Path, step: int, weight: float) -> None:
    tmp = out / "checkpoint" / f"{step}.orbax-checkpoint-tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    body = json.dumps({"step": step, "weight": weight}).encode()
    (tmp / "weights.json").write_bytes(body)
    digests = {"weights.json": {"size": len(body), "sha256": hashlib.sha256(body).hexdigest()}}
    (tmp / "digests.json").write_text(json.dumps({"format": "trainflow.digests/1", "step": step, "files": digests}))
    tmp.rename(out / "checkpoint" / str(step))


def _weight(ctx: StageContext) -> float:
    """The input model's weight at its newest step (0 without one)."""
    for ref in ctx.inputs.values():
        steps = sorted(int(p.name) for p in (ref.path / "checkpoint").iterdir() if p.name.isdigit())
        return json.loads((ref.path / "checkpoint" / str(steps[-1]) / "weights.json").read_text())["weight"]
    return 0.0


@register_stage
class ToyTrain(StageKind):
    task = "toy-train"
    output = "checkpoint"
    inputs = {"checkpoint": Input("checkpoint", required=False)}
    config_schema = TrainToyConfig
    non_semantic = ("trace", "step_seconds", "hold", "slots")

    def run(self, ctx: StageContext) -> dict:
        _trace(ctx)
        cfg = ctx.config
        base = _weight(ctx)
        concurrent = 0
        if cfg.slots:
            Path(cfg.slots).mkdir(parents=True, exist_ok=True)
            (Path(cfg.slots) / ctx.stage).touch()
        for step in range(1, cfg.steps + 1):
            time.sleep(cfg.step_seconds)
            concurrent = max(concurrent, len(list(Path(cfg.slots).iterdir())) if cfg.slots else 0)
            if step % cfg.every == 0 or step == cfg.steps:
                _commit_step(ctx.out_dir, step, base + step)
        if cfg.slots:
            (Path(cfg.slots) / ctx.stage).unlink()
        while cfg.hold and not Path(cfg.hold).exists():
            time.sleep(0.05)
        lr, rank = cfg.optimizer.learning_rate, cfg.lora.rank
        # Lowest at lr=3e-4, and lower for a larger rank.
        metrics = {"eval_loss": round(abs(lr - 3e-4) * 1000 + 1.0 / rank, 6), "weight": base + cfg.steps}
        return {**metrics, **({"concurrent": concurrent} if cfg.slots else {})}


class EvalToyConfig(Strict):
    trace: str | None = None


@register_stage
class ToyEval(StageKind):
    task = "toy-eval"
    output = "eval_report"
    other_inputs = Input(("checkpoint", "adapter"))
    config_schema = EvalToyConfig
    non_semantic = ("trace",)

    def run(self, ctx: StageContext) -> dict:
        _trace(ctx)
        metrics = {}
        for name, ref in ctx.inputs.items():
            steps = sorted(int(p.name) for p in (ref.path / "checkpoint").iterdir() if p.name.isdigit())
            weights = json.loads((ref.path / "checkpoint" / str(steps[-1]) / "weights.json").read_text())
            metrics[f"{name}/step"] = steps[-1]
            metrics[f"{name}/weight"] = weights["weight"]
        (ctx.out_dir / "report.json").write_text(json.dumps(metrics))
        return metrics
