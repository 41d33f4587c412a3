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

A stage may also have `matrix:` (one stage per combination), `max_parallel:`, `when:` (a
gate) and inputs that fan out or in, name a point, a checkpoint step or a selection; the
sweep is expanded by flows/sweep.py and gates are checked by flows/gates.py, and the plan
holds the concrete stages (`sft[lr=1e-05,rank=8]`). Everything is checked before anything
runs, and every problem is reported at once, each naming the file, the stage and the key:
unknown task kinds, inputs naming missing stages or feeding the wrong artifact kind,
cycles, bad matrices and gates, and bad stage configs.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationError, field_validator

from engine.config import ConfigError, Strict, apply_overrides, format_validation_error, load_yaml
from flows.gates import SKIPPED_CONDITION, Gate, read_condition, select_best
from flows.sweep import Ref, Selection, base_dependencies, expand
from tasks.launch.run import LauncherSpec
from tasks.registry import StageKind, get_stage_kind, input_refs
from tasks.runner import StageJob
from tasks.store.base import ArtifactStore
from tasks.store.names import GLOB_CHARACTERS
from tasks.store.records import COMPLETE, artifact_id

TOP_LEVEL_KEYS = ("name", "store", "imports", "defaults", "stages")


class SelectSpec(Strict):
    """The best point of a sweep by one number (flows/gates.py)."""

    model_config = ConfigDict(populate_by_name=True)
    from_: str = Field(alias="from")
    """The candidates: `sft[*]` (every point of a sweep)."""
    by: str
    """`metrics.NAME`, `metrics["a/b"]` or `config.a.b`."""
    best: Literal["min", "max"]


class SelectInput(Strict):
    select: SelectSpec


class StageSpec(Strict):
    """One stage as written in the pipeline."""

    task: str
    """The stage kind (tokenize, pretrain, ...)."""
    inputs: dict[str, str | SelectInput] = {}
    """Input name -> the upstream stage whose artifact feeds it: `stage`, `sweep[*]`,
    `sweep[label=value,...]`, `stage@STEP`, or {select: {from, by, best}} (flows/sweep.py)."""
    config: dict[str, Any] = {}
    matrix: dict[str, Any] | None = None
    """Dotted config key (or `inputs.NAME`) -> values: one stage per combination."""
    max_parallel: int | None = Field(None, ge=1)
    """At most this many points of this sweep run at once."""
    when: str | None = None
    """A gate over upstream metrics and configs; false skips the stage (flows/gates.py)."""
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
            if any(c in name for c in GLOB_CHARACTERS):
                raise ValueError(
                    f"stage name '{name}' may not contain any of {' '.join(GLOB_CHARACTERS)} "
                    "(a stage's folder in the store is named after it, and libraries glob in it)"
                )
        return stages


@dataclass
class PlannedStage:
    job: StageJob
    """The job; while `resolved` is False (a selection not made yet) its id is unknown ("")."""
    retries: int
    retry_delays: list[float]
    depends_on: list[str]
    """Stages that must finish first: inputs, selection candidates, the stages a gate reads."""
    base: str = ""
    """The stage as written: a sweep point's sweep (`sft` for `sft[lr=1e-05]`)."""
    params: dict[str, Any] = field(default_factory=dict)
    """A sweep point's label -> value."""
    refs: dict[str, Ref | Selection] = field(default_factory=dict)
    follows: list[str] = field(default_factory=list)
    """Stages whose checkpoint steps feed this one (`pretrain@2000`): it runs beside them."""
    gate: Gate | None = None
    gate_stages: dict[str, str] = field(default_factory=dict)
    fan_in: dict[str, tuple[str, ...]] = field(default_factory=dict)
    max_parallel: int | None = None
    resolved: bool = True
    decisions: dict[str, Any] = field(default_factory=dict)
    """The selections made for it ({input: record}), recorded in its manifest."""


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
        """Each stage: complete | running | partial | failed | pending | skipped (condition) |
        pending (selection), with id and path."""
        out = {}
        gated: set[str] = set()  # stages a gate may have skipped: gated, or reading one that is
        for name, p in self.stages.items():
            if p.gate is not None or any(u in gated for u in (*p.depends_on, *p.follows)):
                gated.add(name)
        for name, p in self.stages.items():
            if not p.resolved and self.resolve(name) is None:
                out[name] = {"task": p.job.task, "artifact_id": "-", "state": "pending (selection)", "path": "-"}
                continue
            state = self.store.state(name, p.job.artifact_id)
            if state != COMPLETE and name in gated and read_condition(self.store, name, p.job.artifact_id):
                state = SKIPPED_CONDITION
            out[name] = {
                "task": p.job.task,
                "artifact_id": p.job.artifact_id,
                "state": state,
                "path": str(self.store.artifact_dir(name, p.job.artifact_id)),
            }
        return out

    def manifest_of(self, stage: str) -> dict | None:
        """The complete manifest of a planned stage's artifact (None: not complete, not resolved)."""
        planned = self.stages[stage]
        if not planned.resolved and self.resolve(stage) is None:
            return None
        manifest = self.store.manifest(stage, planned.job.artifact_id)
        return manifest if manifest and manifest.get("status") == COMPLETE else None

    def resolve(self, stage: str) -> StageJob | None:
        """The stage's job with every input's id known, making its selections from the store
        once all their candidates are complete (None until then). Selections are made once."""
        planned = self.stages[stage]
        if planned.resolved:
            return planned.job
        inputs, ids, decisions = {}, {}, {}
        for name, ref in planned.refs.items():
            if isinstance(ref, Selection):
                if any(self.manifest_of(c) is None for c in ref.candidates):
                    return None
                where = f"{self.source}: stages.{planned.base}.inputs.{name}.select.by"
                chosen, record = select_best(ref.candidates, ref.metric, ref.best, self.manifest_of, where)
                upstream = self.stages[chosen].job
                inputs[name], ids[name] = (chosen, upstream.artifact_id), upstream.artifact_id
                decisions[name] = {**record, "chosen_id": upstream.artifact_id}
                continue
            resolved = self.resolve(ref.stage)
            if resolved is None:
                return None
            inputs[name], ids[name] = _input_entry(ref, resolved.artifact_id)
        job = planned.job
        planned.job = dataclasses.replace(
            job,
            inputs=inputs,
            artifact_id=artifact_id(job.task, job.kind.version, job.kind.fingerprint(job.config), ids),
        )
        planned.decisions = {"select": decisions} if decisions else {}
        planned.resolved = True
        return planned.job


def _input_entry(ref: Ref, upstream_id: str) -> tuple[tuple[str, str], str]:
    """(StageJob input entry, the id the consumer's fingerprint covers) for one Ref: a
    checkpoint step is read from its snapshot artifact `<stage>@<step>/<id>` (flows/steps.py)."""
    if ref.step is None:
        return (ref.stage, upstream_id), upstream_id
    return (f"{ref.stage}@{ref.step}", upstream_id), f"{upstream_id}@{ref.step}"


# --------------------------------------------------------------------------- loading


def load_spec_tree(path: str | Path, overrides: list[str] | None = None) -> dict:
    """The pipeline YAML as a dict, with `key=value` overrides applied.

    `stage.key=value` (first part a stage name) sets `stages.stage.config.key`; any other
    key is taken from the top (`store=/data/artifacts`, `stages.x.retries=3`).
    """
    tree = load_yaml(path)
    return apply_pipeline_overrides(tree, overrides or [], str(path))


def apply_pipeline_overrides(tree: dict, overrides: list[str], source: str) -> dict:
    stages: dict = tree["stages"] if isinstance(tree.get("stages"), dict) else {}
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
    stages: dict = tree["stages"] if isinstance(tree.get("stages"), dict) else {}

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


def _topological_order(deps: dict[str, list[str]], source: str) -> list[str]:
    """Stage names, each after the stages it reads; a cycle is an error that spells it out."""
    order: list[str] = []
    state: dict[str, str] = {}  # visiting | done

    def visit(name: str, path: list[str]) -> None:
        if state.get(name) == "done":
            return
        if state.get(name) == "visiting":
            cycle = path[path.index(name) :] + [name]
            raise ConfigError(f"{source}: stages form a cycle: {' -> '.join(cycle)}")
        state[name] = "visiting"
        for upstream in deps[name]:
            visit(upstream, path + [name])
        state[name] = "done"
        order.append(name)

    for name in deps:
        visit(name, [])
    return order


def _produced(kind) -> tuple[str, ...]:
    return (kind.output, *kind.possible_outputs)


def _check_step(where: str, ref: Ref, upstream, upstream_kind) -> str | None:
    """Why `stage@STEP` cannot feed an input (None: it can); `upstream` is that stage's config."""
    assert ref.step is not None  # a step input
    if not set(_produced(upstream_kind)) & {"checkpoint", "adapter"}:
        return (
            f"{where}: '{ref.stage}@{ref.step}': stage '{ref.stage}' ({upstream_kind.task}) writes no checkpoint steps"
        )
    steps = getattr(upstream, "steps", None)
    every = getattr(getattr(upstream, "checkpoint", None), "every_steps", None)
    if ref.step <= 0 or (steps is not None and ref.step > steps):
        return (
            f"{where}: '{ref.stage}@{ref.step}': stage '{ref.stage}' trains for {steps} steps; "
            f"pick a step in 1..{steps}"
        )
    if every and ref.step % every and ref.step != steps:
        return (
            f"{where}: '{ref.stage}@{ref.step}': stage '{ref.stage}' saves every {every} steps "
            f"(checkpoint.every_steps) and at step {steps}; step {ref.step} is never committed"
        )
    return None


def build_plan(spec: PipelineSpec, source: str = "pipeline", store: str | Path | None = None) -> Plan:
    """Validate the whole pipeline, expand its sweeps and resolve every stage's artifact id
    (a stage behind a selection gets its id once the candidates are complete: Plan.resolve)."""
    _import_modules(spec, source)
    errors: list[str] = []
    kinds: dict[str, StageKind] = {}
    for name, stage in spec.stages.items():
        try:
            kinds[name] = get_stage_kind(stage.task)
        except ConfigError as e:
            errors.append(f"{source}: stages.{name}.task: {e}")

    gates: dict[str, Gate] = {}
    for name, stage in spec.stages.items():
        if stage.when is not None:
            try:
                gates[name] = Gate(stage.when, f"{source}: stages.{name}.when")
                errors += gates[name].check_stages(list(spec.stages))
            except ConfigError as e:
                errors.append(str(e))
    gate_names = {name: gate.stage_names & set(spec.stages) for name, gate in gates.items()}
    try:
        order = _topological_order(base_dependencies(spec.stages, gate_names), source)
    except ConfigError as e:
        raise ConfigError("\n".join([*errors, str(e)])) from None
    schemas = {name: kind.config_schema for name, kind in kinds.items()}
    points, expansion_errors = expand(spec.stages, order, schemas, source, gate_names)
    errors += expansion_errors

    errors += _wiring_errors(spec, points, kinds, source)
    configs, written_configs, launchers, config_errors = _configs_and_launchers(spec, points, kinds, source)
    errors += config_errors
    if errors:
        raise ConfigError("\n".join(dict.fromkeys(errors)))
    errors += _step_errors(points, configs, kinds, source)
    if errors:
        raise ConfigError("\n".join(dict.fromkeys(errors)))
    return _planned_stages(spec, source, store, points, kinds, gates, configs, written_configs, launchers)


def _wiring_errors(spec: PipelineSpec, points: dict, kinds: dict[str, StageKind], source: str) -> list[str]:
    """What is wrong with the stages' inputs: an input a kind does not take, a fan-in where
    it takes one artifact, an upstream of another kind, a required input left out."""
    errors: list[str] = []
    for point in points.values():
        kind = kinds.get(point.base)
        if kind is None:
            continue
        stage = spec.stages[point.base]
        for input_name, ref in point.inputs.items():
            written = input_name.split("[", 1)[0]
            where = f"{source}: stages.{point.base}.inputs.{written}"
            declared = kind.inputs.get(input_name) or kind.other_inputs
            if declared is None:
                valid = ", ".join(kind.inputs) or "none"
                if written in point.fan_in:
                    errors.append(
                        f"{where}: fans in {len(point.fan_in[written])} points of '{stage.inputs[written]}', but "
                        f"task '{kind.task}' takes one artifact per input (its inputs: {valid}); "
                        f"select one with {{select: {{from: ..., by: ..., best: ...}}}}"
                    )
                else:
                    errors.append(f"{where}: task '{kind.task}' has no input '{input_name}' (its inputs: {valid})")
                continue
            upstreams = ref.candidates if isinstance(ref, Selection) else (ref.stage,)
            for upstream in upstreams:
                upstream_kind = kinds.get(points[upstream].base)
                if upstream_kind is None:
                    continue
                produced = _produced(upstream_kind)
                if isinstance(ref, Ref) and ref.step is not None:
                    produced = tuple(k for k in produced if k in ("checkpoint", "adapter"))
                if produced and not set(produced) & set(declared.kinds):
                    errors.append(
                        f"{where}: stage '{upstream}' ({upstream_kind.task}) produces a {' or '.join(produced)}, "
                        f"but input '{written}' of task '{kind.task}' needs a {' or '.join(declared.kinds)}"
                    )
                    break
        for input_name, declared in kind.inputs.items():
            if declared.required and input_name not in point.inputs:
                errors.append(
                    f"{source}: stages.{point.base}.inputs: task '{kind.task}' needs input '{input_name}' "
                    f"(a {' or '.join(declared.kinds)} artifact)"
                )
                break
    return errors


def _configs_and_launchers(
    spec: PipelineSpec, points: dict, kinds: dict[str, StageKind], source: str
) -> tuple[dict[str, Any], dict[str, dict], dict[str, LauncherSpec], list[str]]:
    """Each point's resolved config, its config as written and its launcher (once per point:
    a sweep's points differ in their config), and what is wrong with them."""
    errors: list[str] = []
    configs: dict[str, Any] = {}
    written_configs: dict[str, dict] = {}
    launchers: dict[str, LauncherSpec] = {}
    for name, point in points.items():
        kind = kinds.get(point.base)
        if kind is None:
            continue
        stage = spec.stages[point.base]
        where = f"{source}: stages.{name}"
        written_configs[name] = _deep_merge(spec.defaults.config.get(stage.task, {}), point.config)
        for missing in sorted(input_refs(written_configs[name]) - set(point.inputs)):
            errors.append(
                f"{where}.config: '{{input:{missing}}}' refers to input '{missing}', "
                f"which the stage does not have (its inputs: {', '.join(point.inputs) or 'none'})"
            )
        try:
            configs[name] = kind.resolve_config(copy.deepcopy(written_configs[name]), f"{where}.config")
        except ConfigError as e:
            errors.append(str(e))
        raw_launcher = stage.launcher if stage.launcher is not None else spec.defaults.launcher
        try:
            launchers[name] = LauncherSpec.parse(raw_launcher)
        except ValidationError as e:
            message = format_validation_error(e, LauncherSpec, f"{where}.launcher")
            errors.append(message.replace("key '<root>': Value error, ", ""))
        if (
            stage.launcher is not None
            and not kind.launches_child
            and name == next(n for n, q in points.items() if q.base == point.base)
        ):  # once per stage as written, not once per point
            errors.append(
                f"{where}.launcher: task '{kind.task}' runs in-process; "
                f"launcher applies only to stages that start the engine"
            )
    return configs, written_configs, launchers, errors


def _step_errors(points: dict, configs: dict[str, Any], kinds: dict[str, StageKind], source: str) -> list[str]:
    """Checkpoint-step inputs (`stage@STEP`) that name a step their upstream never commits."""
    errors: list[str] = []
    for point in points.values():  # checkpoint steps: only steps the upstream commits
        for input_name, ref in point.inputs.items():
            if isinstance(ref, Ref) and ref.step is not None:
                where = f"{source}: stages.{point.base}.inputs.{input_name.split('[', 1)[0]}"
                problem = _check_step(where, ref, configs[ref.stage], kinds[points[ref.stage].base])
                if problem:
                    errors.append(problem)
    return errors


def _planned_stages(
    spec: PipelineSpec,
    source: str,
    store: str | Path | None,
    points: dict,
    kinds: dict[str, StageKind],
    gates: dict[str, Gate],
    configs: dict[str, Any],
    written_configs: dict[str, dict],
    launchers: dict[str, LauncherSpec],
) -> Plan:
    """The plan of validated points: each stage's job, retries, dependencies and gate, its id
    resolved (or left for Plan.resolve behind a selection)."""
    plan = Plan(spec, source, ArtifactStore(store if store is not None else spec.store), {})
    for name, point in points.items():
        stage, kind = spec.stages[point.base], kinds[point.base]
        depends: list[str] = []
        follows: list[str] = []
        for ref in point.inputs.values():
            if isinstance(ref, Selection):
                depends += ref.candidates
            elif ref.step is None:
                depends.append(ref.stage)
            else:
                follows.append(ref.stage)
        depends += point.gate_stages.values()
        retries = stage.retries if stage.retries is not None else spec.defaults.retries
        delay = (
            stage.retry_delay_seconds if stage.retry_delay_seconds is not None else spec.defaults.retry_delay_seconds
        )
        backoff = stage.retry_backoff if stage.retry_backoff is not None else spec.defaults.retry_backoff
        job = StageJob(
            stage=name,
            kind=kind,
            config=configs[name],
            config_as_written=written_configs[name],
            inputs={},
            artifact_id="",
            launcher=launchers[name],
            pipeline=spec.name,
        )
        plan.stages[name] = PlannedStage(
            job,
            retries,
            [delay * backoff**i for i in range(retries)],
            sorted(set(depends)),
            base=point.base,
            params=point.params,
            refs=point.inputs,
            follows=sorted(set(follows) - set(depends)),
            gate=gates.get(point.base),
            gate_stages=point.gate_stages,
            fan_in=point.fan_in,
            max_parallel=stage.max_parallel,
            resolved=False,
        )
        if plan.resolve(name) is None:  # a selection waits on candidates not yet complete:
            # its first candidate stands in among the inputs (the id stays unknown, ""), so
            # what reads a stage's inputs before it runs (`trainflow plan`'s model) still can.
            plan.stages[name].job.inputs = {
                input_name: (ref.candidates[0], plan.stages[ref.candidates[0]].job.artifact_id)
                if isinstance(ref, Selection)
                else _input_entry(ref, plan.stages[ref.stage].job.artifact_id)[0]
                for input_name, ref in point.inputs.items()
            }
        gate = plan.stages[name].gate
        if gate is not None and all(plan.manifest_of(s) is not None for s in point.gate_stages.values()):
            gate.evaluate(plan.manifest_of, point.gate_stages)  # an unknown metric: an error now (exit 2)
    return plan


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
