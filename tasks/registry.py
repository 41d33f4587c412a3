"""Stage kinds: what a `task:` in a pipeline means, and the registry of them.

A stage kind declares what it consumes and produces and how to run it; the pipeline layer
(flows/) handles ids, skipping, locking, manifests and Prefect. To add one:

    class Evaluate(StageKind):
        task = "evaluate"
        output = "eval_report"
        inputs = {"checkpoint": Input("checkpoint")}
        config_schema = EvalConfig            # a pydantic model (engine.config.Strict)
        version = 1                           # bump when the output format changes

        def run(self, ctx: StageContext) -> dict:
            ckpt = ctx.inputs["checkpoint"].path / "checkpoint"
            ...write files under ctx.out_dir, or ctx.launch([...]) a child...
            return {"accuracy": 0.5}          # final metrics, stored in the manifest

    register_stage(Evaluate)

A built-in kind is the module tasks/stages/<task>.py that defines it; it is imported when a
pipeline uses it, so validating a pipeline does not import the engine (or JAX) for kinds it
does not use. A training kind names its planner hook (`planner`), which `trainflow plan` loads.
"""

from __future__ import annotations

import difflib
import importlib
import pkgutil
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel

from engine.config import ConfigError, validate
from engine.contract import ADDED_AT_DEFAULT, CHECKPOINT_DIR, CHECKPOINT_URL_SCHEMES
from engine.models.config import ModelConfig
from engine.models.fingerprint import model_id_fields
from tasks.launch.gang import ChildResult
from tasks.launch.run import LauncherSpec, run_child
from tasks.store.records import ArtifactRef, drop_fields

# A config string may name an input artifact's directory: `path: "{input:corpus}/sft.jsonl"`.
# The stage's artifact id covers the input's id, so such paths are resolved only at run time.
INPUT_REF = re.compile(r"\{input:([A-Za-z_][\w-]*)\}")


def has_input_ref(value: Any) -> bool:
    return isinstance(value, str) and INPUT_REF.search(value) is not None


def input_refs(tree: Any) -> set[str]:
    """Names of the inputs referenced anywhere in a config tree."""
    if isinstance(tree, dict):
        return set().union(*(input_refs(v) for v in tree.values())) if tree else set()
    if isinstance(tree, list):
        return set().union(*(input_refs(v) for v in tree)) if tree else set()
    return set(INPUT_REF.findall(tree)) if isinstance(tree, str) else set()


def substitute_inputs(config: BaseModel, inputs: dict[str, Any], stage: str) -> BaseModel:
    """The config with every `{input:NAME}` replaced by that input artifact's directory."""

    def sub(value):
        if isinstance(value, dict):
            return {k: sub(v) for k, v in value.items()}
        if isinstance(value, list):
            return [sub(v) for v in value]
        if not has_input_ref(value):
            return value

        def path_of(match):
            name = match.group(1)
            if name not in inputs:
                raise ConfigError(
                    f"stage '{stage}': config refers to '{{input:{name}}}' but the stage has no input '{name}'"
                )
            return str(inputs[name].path)

        return INPUT_REF.sub(path_of, value)

    tree = config.model_dump(mode="json", exclude_unset=True)  # defaults stay defaults
    if not input_refs(tree):
        return config
    return type(config).model_validate(sub(tree))


_BUILTIN_PACKAGE = "tasks.stages"
BUILTIN_STAGES: tuple[str, ...] = tuple(
    sorted(m.name for m in pkgutil.iter_modules([str(Path(__file__).parent / "stages")]))
)
"""The built-in kinds: one module tasks/stages/<task>.py each, defining the kind of that `task`."""

_registry: dict[str, type[StageKind]] = {}


MODEL_KINDS = ("checkpoint", "adapter")
"""What a stage that takes a model accepts: a full checkpoint, or a LoRA adapter, whose
checkpoint reads as its base with the adapter folded in (engine.train.checkpoint.load_params)."""


@dataclass(frozen=True)
class Input:
    """One named input of a stage kind: the artifact kind(s) it accepts."""

    kind: str | tuple[str, ...]
    required: bool = True
    doc: str = ""
    through_paths: bool = False
    """The stage reads this input only through `{input:NAME}/...` paths in its config, so
    what it consumes of it is the files those paths name (tasks/cutoff.py)."""

    @property
    def kinds(self) -> tuple[str, ...]:
        return (self.kind,) if isinstance(self.kind, str) else tuple(self.kind)


@dataclass
class StageHooks:
    """Where a running stage reports to; flows/ connects these to Prefect."""

    log: Callable[[str], None] = print
    metrics: Callable[[dict], None] = lambda record: None
    progress: Callable[[float], None] = lambda fraction: None


@dataclass
class StageContext:
    """Everything `StageKind.run` gets: its config, inputs and output directory."""

    stage: str
    config: Any
    inputs: dict[str, ArtifactRef]
    out_dir: Path
    launcher: LauncherSpec = field(default_factory=LauncherSpec)
    resumed: bool = False
    """The output directory holds a partial result of an earlier attempt."""
    hooks: StageHooks = field(default_factory=StageHooks)
    checkpoint_dir: str = ""
    """Where the engine writes (and resumes) the output's checkpoint: `out_dir`/checkpoint,
    or on a bucket store its URL, which every process writes its shards to."""

    def __post_init__(self) -> None:
        if not self.checkpoint_dir:
            self.checkpoint_dir = str(Path(self.out_dir) / CHECKPOINT_DIR)

    @property
    def artifact_url(self) -> str | None:
        """The artifact's URL when its engine writes there (a bucket store), else None."""
        return self.checkpoint_dir.rsplit("/", 1)[0] if self.checkpoint_dir.startswith(CHECKPOINT_URL_SCHEMES) else None

    def for_ranks(self, path: str) -> str:
        """A file of an input as every process of the stage reads it: at the input's URL where
        it has one (ranks on other hosts share no disk with this one), else `path`."""
        for ref in self.inputs.values():
            if (moved := ref.for_ranks(path)) != path:
                return moved
        return path

    def log(self, message: str) -> None:
        self.hooks.log(message)

    def launch(
        self,
        argv: list[str],
        *,
        metrics_file: Path | None = None,
        total_steps: int | None = None,
        env: dict[str, str] | None = None,
        on_line: Callable[[str], None] | None = None,
    ) -> ChildResult:
        """Run an engine command (e.g. [sys.executable, "-m", "engine.train", cfg]) through
        the stage's launcher, streaming its output (each line also to `on_line`) and the
        metrics it appends to `metrics_file` into the run log; raises on a non-zero exit
        (see tasks/launch/run.py)."""

        def on_metrics(record: dict) -> None:
            self.hooks.metrics(record)
            if total_steps and "step" in record:
                self.hooks.progress(min(1.0, record["step"] / total_steps))

        def log(line: str) -> None:
            self.hooks.log(line)
            if on_line is not None:
                on_line(line)

        return run_child(
            argv,
            launcher=self.launcher,
            log=log,
            env=env,
            metrics_file=metrics_file,
            on_metrics=on_metrics,
            what=f"stage '{self.stage}'",
        )


class StageKind:
    """Base class of stage kinds. Subclasses set the class attributes and `run`."""

    task: ClassVar[str]
    """The name used as `task:` in a pipeline."""
    output: ClassVar[str]
    """The artifact kind produced: dataset | checkpoint | eval_report | ..."""
    inputs: ClassVar[dict[str, Input]] = {}
    other_inputs: ClassVar[Input | None] = None
    """What any input not named in `inputs` may be (None: no other inputs), e.g. the
    checkpoints an evaluate stage compares, each under a name of the user's choosing."""
    config_schema: ClassVar[type[BaseModel]]
    version: ClassVar[int] = 1
    """Format version, part of the artifact id: bump it when the output layout changes."""
    non_semantic: ClassVar[tuple[str, ...]] = ()
    """Dotted config fields that cannot change the result; left out of the artifact id."""
    launches_child: ClassVar[bool] = False
    """Whether the stage runs the engine through a launcher (so `launcher:` applies)."""
    entry_point: ClassVar[str | None] = None
    """The engine module its child processes run (`python -m ...`); None: it runs in-process."""
    planner: ClassVar[str | None] = None
    """A training kind's planner hook, `module:function` (engine/train/plan.py: `step_spec(cfg,
    models) -> StepSpec`, what `trainflow plan` compiles for a stage of the kind). Named by
    path: it imports JAX, which validating a pipeline does not. None: the kind trains nothing
    and `trainflow plan` leaves it out."""

    console_metrics: ClassVar[tuple[str, ...]] = ("loss", "grad_norm", "learning_rate")
    """The few metrics of its step lines in the run log (flows/summary.py: step_line); an eval
    record shows their `eval_` counterparts. Every metric stays in metrics.jsonl."""

    possible_outputs: ClassVar[tuple[str, ...]] = ()
    """Other artifact kinds the stage may produce, by its config (output_kind)."""

    def output_kind(self, config: BaseModel) -> str:
        """The kind of artifact this stage's config produces (`output` unless the config
        chooses, e.g. a fine-tune with `lora:` writes an adapter)."""
        return self.output

    def resolve_config(self, raw: dict, source: str) -> BaseModel:
        """The validated config; raise ConfigError naming `source` and the key at fault."""
        return validate(self.config_schema, raw, source)

    def fingerprint(self, config: BaseModel) -> dict:
        """The part of the config that identifies the result (less the fields added since
        artifacts were made, where they hold the value that means what came before)."""
        dumped = config.model_dump(mode="json")
        if isinstance(getattr(config, "model", None), ModelConfig):  # its fields added since, at their defaults, out
            dumped["model"] = model_id_fields(dumped["model"], ModelConfig)
        unchanged = tuple(path for path, value in ADDED_AT_DEFAULT.items() if _field(dumped, path) == value)
        return drop_fields(dumped, (*self.non_semantic, *unchanged))

    def run(self, ctx: StageContext) -> dict[str, Any]:
        """Produce the artifact's payload in ctx.out_dir; return final metrics.

        Called again on the same out_dir after a failure: resume from what is there.
        """
        raise NotImplementedError


def _field(tree: dict, dotted: str) -> Any:
    """The value at `a.b.c` in `tree` (None where it is missing)."""
    value: Any = tree
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def register_stage(cls: type[StageKind], *, replace: bool = False) -> type[StageKind]:
    """Make `cls.task` usable in pipelines (also usable as a class decorator)."""
    for attr in ("task", "output", "config_schema"):
        if not hasattr(cls, attr):
            raise TypeError(f"stage kind {cls.__name__} must set `{attr}`")
    current = _registry.get(cls.task) or (_builtin_kind(cls.task) if cls.task in BUILTIN_STAGES else None)
    if current is not None and current is not cls and not replace:
        where = f"{current.__module__}:{current.__qualname__}"
        raise ValueError(f"stage kind '{cls.task}' is already registered ({where}); pass replace=True")
    _registry[cls.task] = cls
    return cls


def unregister_stage(task: str) -> None:
    """Forget a registered kind (a built-in one reads as built in again)."""
    _registry.pop(task, None)


def stage_kind_names() -> list[str]:
    return sorted({*BUILTIN_STAGES, *_registry})


def _builtin_kind(task: str) -> type[StageKind]:
    """The class that tasks/stages/<task>.py defines for `task`."""
    module = importlib.import_module(f"{_BUILTIN_PACKAGE}.{task}")
    (kind,) = (
        value
        for value in vars(module).values()
        if isinstance(value, type)
        and issubclass(value, StageKind)
        and value.__module__ == module.__name__
        and getattr(value, "task", None) == task
    )
    return kind


def get_stage_kind(task: str) -> StageKind:
    """An instance of the stage kind registered as `task` (importing a built-in on first use)."""
    if task not in _registry and task in BUILTIN_STAGES:
        _registry[task] = _builtin_kind(task)
    entry = _registry.get(task)
    if entry is None:
        match = difflib.get_close_matches(task, stage_kind_names(), n=1)
        hint = f"did you mean '{match[0]}'?" if match else f"known kinds: {', '.join(stage_kind_names())}"
        raise ConfigError(f"unknown task kind '{task}'; {hint}")
    return entry()


def entry_points() -> dict[str, str]:
    """Each kind that runs the engine -> the module its children run (imports every kind)."""
    return {task: kind.entry_point for task in stage_kind_names() if (kind := get_stage_kind(task)).entry_point}


def planner_of(kind: StageKind) -> Callable[..., Any] | None:
    """A kind's planner hook (`planner`), imported; None for a kind that trains nothing."""
    if kind.planner is None:
        return None
    module, _, name = kind.planner.partition(":")
    return getattr(importlib.import_module(module), name)


def training_kinds() -> list[str]:
    """The kinds `trainflow plan` plans: those with a planner hook (imports every kind)."""
    return [task for task in stage_kind_names() if get_stage_kind(task).planner is not None]
