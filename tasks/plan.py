"""`trainflow plan PIPELINE.yaml --target NAME`: the preflight of every training stage.

A stage is planned when its kind names a planner hook (tasks/registry.py: StageKind.planner):
the hook builds the stage's step as the stage's engine does (the trainer's view of its config,
its objective and batch) and says what the step does not count; the step is compiled for the
target (engine/train/plan.py). Any other kind trains nothing and is left out. A fine-tuning
stage without a `model` trains the model of its input checkpoint: that of the upstream
training stage (also when it reads one of its steps, `pretrain@2000`), or of the upstream
artifact when it is already in the store.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

from engine.config import ConfigError
from engine.models.config import ComputeConfig, ModelConfig
from engine.train.bucket_paths import is_url
from engine.train.checkpoint import stored_configs
from engine.train.plan import Plan, plan_step, report
from engine.train.targets import get_target
from tasks.registry import planner_of, training_kinds

_STEP_INPUT = re.compile(r"@\d+$")  # an input `stage@STEP` (flows/sweep.py), as a job names it


class InputModels(Mapping[str, tuple[ModelConfig, ComputeConfig]]):
    """A stage's inputs -> the model each holds (engine/train/plan.py: InputModels), looked up
    only when a hook asks: planned upstream, or read from the store."""

    def __init__(self, plan, name: str, models: dict[str, tuple[ModelConfig, ComputeConfig]]):
        self.plan, self.name, self.models = plan, name, models
        self.inputs = plan.stages[name].job.inputs

    def __getitem__(self, input_name: str) -> tuple[ModelConfig, ComputeConfig]:
        if input_name not in self.inputs:
            raise KeyError(input_name)
        return _input_model(self.plan, self.name, self.models, input_name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.inputs)

    def __len__(self) -> int:
        return len(self.inputs)


def plan_pipeline(plan, target_name: str) -> tuple[list[Plan], list[str]]:
    """(a Plan of every training stage of a loaded pipeline (flows.spec.load_plan) for the
    target, notes on what the plans leave out)."""
    target = get_target(target_name)
    models: dict[str, tuple[ModelConfig, ComputeConfig]] = {}
    plans: list[Plan] = []
    notes: list[str] = []
    for name, planned in plan.stages.items():
        job = planned.job
        hook = planner_of(job.kind)
        if hook is None:
            continue
        spec = hook(job.config, InputModels(plan, name, models))
        models[name] = (spec.config.model, spec.config.compute)
        plans.append(
            plan_step(
                spec.config,
                target,
                stage=name,
                objective=spec.objective,
                batch=spec.batch,
                updates_per_batch=spec.updates_per_batch,
                make_trainer=spec.make_trainer,
                from_scratch=spec.from_scratch,
            )
        )
        notes += [f"note: stage {name} ({job.kind.task}): {text}" for text in spec.uncounted(plans[-1])]
    return plans, notes


def print_pipeline_plan(plan, target_name: str, print_fn: Callable[[str], None] = print) -> dict:
    """`trainflow plan`: print each training stage's plan; raises engine.train.plan.DoesNotFit
    when a stage does not fit the target."""
    plans, notes = plan_pipeline(plan, target_name)
    if not plans:
        print_fn(f"pipeline {plan.name} has no training stage ({', '.join(training_kinds())}): nothing to plan")
        return {}
    try:
        return report(plans, print_fn)
    finally:
        for note in notes:
            print_fn(note)


def _input_model(plan, name: str, models: dict, input_name: str = "checkpoint") -> tuple[ModelConfig, ComputeConfig]:
    """The model (and compute settings) of stage `name`'s input checkpoint (or other model input)."""
    upstream, artifact_id = plan.stages[name].job.inputs[input_name]
    # `pretrain@2000` reads a step of pretrain (its snapshot artifact `pretrain@2000/<id>`):
    # the model is pretrain's, planned above or stored in either artifact.
    stage = _STEP_INPUT.sub("", upstream)
    if stage in models:
        return models[stage]
    for stored in dict.fromkeys((upstream, stage)):
        path = plan.store.checkpoint_location(stored, artifact_id)  # a directory, or the bucket's URL
        if plan.store.state(stored, artifact_id) == "complete" and (is_url(path) or Path(path).is_dir()):
            return stored_configs(path)
    raise ConfigError(
        f"{plan.source}: stages.{name}: its model is the checkpoint of stage '{upstream}', which "
        f"is not in the store yet; run that stage first, or set stages.{name}.config.model"
    )
