"""The pipeline spec: YAML (or the Python builder) -> a validated plan of stage jobs.

    name: tiny
    store: artifacts                 # artifact store (relative to the working directory)
    imports: [my_project.stages]     # modules that register extra stage kinds (optional)
    defaults:
      retries: 1                     # per-stage fields every stage inherits
      retry_delay_seconds: 10        # first retry delay; later ones grow by retry_backoff
      launcher: local
      config:                        # per task kind: config merged under each stage's config
        pretrain: {seed: 0}
    stages:
      tokenize:
        task: tokenize
        config: {...}
      pretrain:
        task: pretrain
        inputs: {dataset: tokenize}  # input name -> upstream stage
        config: {model: tiny, steps: 40}
        retries: 2

Everything is checked before anything runs, and every problem is reported at once, each
naming the file, the stage and the key: unknown task kinds, inputs naming missing stages
or feeding the wrong artifact kind, cycles, and bad stage configs.
"""

from __future__ import annotations

import copy
import difflib
import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, field_validator

from engine.config import ConfigError, Strict, apply_overrides, format_validation_error, load_yaml
from tasks.artifacts import ArtifactStore, artifact_id
from tasks.launch import LauncherSpec
from tasks.registry import get_stage_kind, input_refs
from tasks.runner import StageJob

TOP_LEVEL_KEYS = ("name", "store", "imports", "defaults", "stages")


class StageSpec(Strict):
    """One stage as written in the pipeline."""

    task: str
    """The stage kind (tokenize, pretrain, ...)."""
    inputs: dict[str, str] = {}
    """Input name -> the upstream stage whose artifact feeds it."""
    config: dict[str, Any] = {}
    retries: int | None = Field(None, ge=0)
    retry_delay_seconds: float | None = Field(None, ge=0)
    retry_backoff: float | None = Field(None, ge=1)
    launcher: str | dict[str, Any] | None = None
    """local (default) | local-multi | command, or {kind: ..., processes: N, template: ...}."""


class Defaults(Strict):
    retries: int = Field(0, ge=0)
    retry_delay_seconds: float = Field(10.0, ge=0)
    retry_backoff: float = Field(2.0, ge=1)
    """Each retry waits this factor longer than the previous one."""
    launcher: str | dict[str, Any] = "local"
    config: dict[str, dict[str, Any]] = {}
    """Task kind -> config values every stage of that kind starts from."""


class PipelineSpec(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    store: str = "artifacts"
    imports: list[str] = []
    defaults: Defaults = Defaults()
    stages: dict[str, StageSpec]

    @field_validator("stages")
    @classmethod
    def _check_stage_names(cls, stages: dict) -> dict:
        if not stages:
            raise ValueError("a pipeline needs at least one stage")
        for name in stages:
            if not name or "/" in name or name.startswith(".") or name in TOP_LEVEL_KEYS:
                raise ValueError(f"'{name}' cannot be a stage name")
        return stages


@dataclass
class PlannedStage:
    job: StageJob
    retries: int
    retry_delays: list[float]
    depends_on: list[str]


@dataclass
class Plan:
    """A validated pipeline: stages in a runnable (topological) order, ids resolved."""

    spec: PipelineSpec
    source: str
    store: ArtifactStore
    stages: dict[str, PlannedStage]

    @property
    def name(self) -> str:
        return self.spec.name

    def status(self) -> dict[str, dict[str, str]]:
        """Each stage: complete | running | partial | failed | pending, with id and path."""
        return {
            name: {
                "task": p.job.task,
                "artifact_id": p.job.artifact_id,
                "state": self.store.state(name, p.job.artifact_id),
                "path": str(self.store.artifact_dir(name, p.job.artifact_id)),
            }
            for name, p in self.stages.items()
        }


# --------------------------------------------------------------------------- loading


def load_spec_tree(path: str | Path, overrides: list[str] | None = None) -> dict:
    """The pipeline YAML as a dict, with `key=value` overrides applied.

    `stage.key=value` (first part a stage name) sets `stages.stage.config.key`; any other
    key is taken from the top (`store=/data/artifacts`, `stages.x.retries=3`).
    """
    tree = load_yaml(path)
    return apply_pipeline_overrides(tree, overrides or [], str(path))


def apply_pipeline_overrides(tree: dict, overrides: list[str], source: str) -> dict:
    stages = tree.get("stages") if isinstance(tree.get("stages"), dict) else {}
    rewritten = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"override '{item}' is not of the form key=value")
        head = key.split(".", 1)[0]
        if head in stages and "." in key:
            key = f"stages.{head}.config.{key.split('.', 1)[1]}"
        elif head not in TOP_LEVEL_KEYS:
            valid = list(TOP_LEVEL_KEYS) + list(stages)
            match = difflib.get_close_matches(head, valid, n=1)
            hint = f"; did you mean '{match[0]}'?" if match else f"; stages are: {', '.join(stages)}"
            raise ConfigError(f"override '{item}': '{head}' is neither a stage nor a pipeline key{hint}")
        rewritten.append(f"{key}={value}")
    return apply_overrides(tree, rewritten, source=f"{source} (override)")


def parse_spec(tree: dict, source: str) -> PipelineSpec:
    try:
        return PipelineSpec.model_validate(tree)
    except ValidationError as e:
        errors = e.errors()
    # A stage's own keys are checked against StageSpec, so that an unknown one gets the
    # closest valid key: the error's path runs through the stage's name, which no schema has.
    stages = tree.get("stages") if isinstance(tree.get("stages"), dict) else {}

    def in_a_stage(loc: tuple) -> bool:
        return len(loc) > 2 and loc[0] == "stages" and isinstance(stages.get(loc[1]), dict)

    bad_stages = sorted({str(err["loc"][1]) for err in errors if in_a_stage(err["loc"])})
    messages = []
    if not all(in_a_stage(err["loc"]) for err in errors):  # the rest, with those stages stood in for
        stand_in = {
            **tree,
            "stages": {name: {"task": "-"} if name in bad_stages else stage for name, stage in stages.items()}
            or tree.get("stages"),
        }
        try:
            PipelineSpec.model_validate(stand_in)
        except ValidationError as e:
            messages.append(format_validation_error(e, PipelineSpec, source))
    for name in bad_stages:
        try:
            StageSpec.model_validate(stages[name])
        except ValidationError as e:
            messages.append(format_validation_error(e, StageSpec, f"{source}: stages.{name}"))
    raise ConfigError("\n".join(messages))


def _deep_merge(base: dict, update: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _import_modules(spec: PipelineSpec, source: str) -> None:
    for module in spec.imports:
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ConfigError(f"{source}: imports: cannot import '{module}': {e}") from None


def _topological_order(spec: PipelineSpec, source: str) -> list[str]:
    """Stage names, each after its inputs; a cycle is an error that spells it out."""
    order: list[str] = []
    state: dict[str, str] = {}  # visiting | done

    def visit(name: str, path: list[str]) -> None:
        if state.get(name) == "done":
            return
        if state.get(name) == "visiting":
            cycle = path[path.index(name) :] + [name]
            raise ConfigError(f"{source}: stages form a cycle: {' -> '.join(cycle)}")
        state[name] = "visiting"
        for upstream in spec.stages[name].inputs.values():
            if upstream in spec.stages:
                visit(upstream, path + [name])
        state[name] = "done"
        order.append(name)

    for name in spec.stages:
        visit(name, [])
    return order


def build_plan(spec: PipelineSpec, source: str = "pipeline", store: str | Path | None = None) -> Plan:
    """Validate the whole pipeline and resolve every stage's artifact id."""
    _import_modules(spec, source)
    errors: list[str] = []
    kinds = {}
    for name, stage in spec.stages.items():
        try:
            kinds[name] = get_stage_kind(stage.task)
        except ConfigError as e:
            errors.append(f"{source}: stages.{name}.task: {e}")

    # Input wiring: names, references, kinds.
    for name, stage in spec.stages.items():
        kind = kinds.get(name)
        for input_name, upstream in stage.inputs.items():
            where = f"{source}: stages.{name}.inputs.{input_name}"
            if upstream not in spec.stages:
                match = difflib.get_close_matches(upstream, list(spec.stages), n=1)
                hint = f"; did you mean '{match[0]}'?" if match else f"; stages are: {', '.join(spec.stages)}"
                errors.append(f"{where}: references stage '{upstream}', which is not in the pipeline{hint}")
                continue
            if kind is None:
                continue
            declared = kind.inputs.get(input_name) or kind.other_inputs
            if declared is None:
                valid = ", ".join(kind.inputs) or "none"
                errors.append(f"{where}: task '{kind.task}' has no input '{input_name}' (its inputs: {valid})")
                continue
            upstream_kind = kinds.get(upstream)
            produced = (upstream_kind.output, *upstream_kind.possible_outputs) if upstream_kind else ()
            if upstream_kind is not None and not set(produced) & set(declared.kinds):
                errors.append(
                    f"{where}: stage '{upstream}' ({upstream_kind.task}) produces a {' or '.join(produced)}, "
                    f"but input '{input_name}' of task '{kind.task}' needs a {' or '.join(declared.kinds)}"
                )
        if kind is not None:
            for input_name, declared in kind.inputs.items():
                if declared.required and input_name not in stage.inputs:
                    errors.append(
                        f"{source}: stages.{name}.inputs: task '{kind.task}' needs input '{input_name}' "
                        f"(a {' or '.join(declared.kinds)} artifact)"
                    )

    # Configs and launchers.
    configs, written, launchers = {}, {}, {}
    for name, stage in spec.stages.items():
        kind = kinds.get(name)
        if kind is None:
            continue
        written[name] = _deep_merge(spec.defaults.config.get(stage.task, {}), stage.config)
        for ref in sorted(input_refs(written[name]) - set(stage.inputs)):
            errors.append(
                f"{source}: stages.{name}.config: '{{input:{ref}}}' refers to input '{ref}', "
                f"which the stage does not have (its inputs: {', '.join(stage.inputs) or 'none'})"
            )
        try:
            configs[name] = kind.resolve_config(copy.deepcopy(written[name]), f"{source}: stages.{name}.config")
        except ConfigError as e:
            errors.append(str(e))
        raw_launcher = stage.launcher if stage.launcher is not None else spec.defaults.launcher
        try:
            launchers[name] = LauncherSpec.parse(raw_launcher)
        except ValidationError as e:
            message = format_validation_error(e, LauncherSpec, f"{source}: stages.{name}.launcher")
            errors.append(message.replace("key '<root>': Value error, ", ""))
        if stage.launcher is not None and not kind.launches_child:
            errors.append(
                f"{source}: stages.{name}.launcher: task '{kind.task}' runs in-process; "
                f"launcher applies only to stages that start the engine"
            )
    try:
        order = _topological_order(spec, source)
    except ConfigError as e:
        errors.append(str(e))
    if errors:
        raise ConfigError("\n".join(errors))

    stages: dict[str, PlannedStage] = {}
    for name in order:
        stage, kind = spec.stages[name], kinds[name]
        input_ids = {inp: (up, stages[up].job.artifact_id) for inp, up in stage.inputs.items()}
        job = StageJob(
            stage=name,
            kind=kind,
            config=configs[name],
            config_as_written=written[name],
            inputs=input_ids,
            artifact_id=artifact_id(
                kind.task,
                kind.version,
                kind.fingerprint(configs[name]),
                {inp: aid for inp, (_, aid) in input_ids.items()},
            ),
            launcher=launchers[name],
            pipeline=spec.name,
        )
        retries = stage.retries if stage.retries is not None else spec.defaults.retries
        delay = (
            stage.retry_delay_seconds if stage.retry_delay_seconds is not None else spec.defaults.retry_delay_seconds
        )
        backoff = stage.retry_backoff if stage.retry_backoff is not None else spec.defaults.retry_backoff
        stages[name] = PlannedStage(
            job, retries, [delay * backoff**i for i in range(retries)], sorted(set(stage.inputs.values()))
        )
    return Plan(spec, source, ArtifactStore(store if store is not None else spec.store), stages)


def load_plan(path: str | Path, overrides: list[str] | None = None, store: str | Path | None = None) -> Plan:
    """Read, override, validate and plan a pipeline YAML file."""
    tree = load_spec_tree(path, overrides)
    return build_plan(parse_spec(tree, str(path)), str(path), store)


# --------------------------------------------------------------------------- Python API


class Pipeline:
    """The same pipeline built in code.

        p = Pipeline("tiny", store="artifacts")
        data = p.stage("tokenize", task="tokenize", config={...})
        p.stage("pretrain", task="pretrain", inputs={"dataset": data}, config={...}, retries=2)
        p.status()                # what is done, without Prefect

    flows.pipeline.Pipeline is the same class with `run()` (one Prefect flow run), kept
    there so that building and validating a pipeline imports no Prefect.
    """

    def __init__(
        self,
        name: str,
        store: str | Path = "artifacts",
        *,
        imports: list[str] | None = None,
        defaults: dict | None = None,
    ):
        self.tree: dict[str, Any] = {
            "name": name,
            "store": str(store),
            "imports": list(imports or []),
            "defaults": dict(defaults or {}),
            "stages": {},
        }

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: list[str] | None = None) -> Pipeline:
        p = cls.__new__(cls)
        p.tree = load_spec_tree(path, overrides)
        return p

    def stage(
        self, name: str, *, task: str, inputs: dict[str, str] | None = None, config: dict | None = None, **options: Any
    ) -> str:
        """Add a stage; returns its name, to be used in other stages' `inputs`."""
        if name in self.tree["stages"]:
            raise ConfigError(f"pipeline '{self.tree['name']}': stage '{name}' is defined twice")
        self.tree["stages"][name] = {
            "task": task,
            "inputs": dict(inputs or {}),
            "config": dict(config or {}),
            **options,
        }
        return name

    def plan(self, store: str | Path | None = None) -> Plan:
        source = f"pipeline '{self.tree['name']}'"
        return build_plan(parse_spec(copy.deepcopy(self.tree), source), source, store)

    def status(self, store: str | Path | None = None) -> dict:
        return self.plan(store).status()
