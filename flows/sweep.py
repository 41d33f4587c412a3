"""Sweeps: a stage's `matrix:` expanded into one ordinary stage per point, and the
references between stages (fan-out, fan-in, a point, a checkpoint step, a selection).

    sft:
      task: sft
      inputs: {checkpoint: pretrain}
      matrix: {optimizer.learning_rate: [1e-5, 3e-5], lora.rank: [8, 16]}
      max_parallel: 2                       # at most two points run at once
    evaluate:                               # one stage over all points (fan-in)
      task: evaluate
      inputs: {dataset: tokenize, models: "sft[*]"}
    grpo:                                   # one stage per point (fan-out)
      task: grpo
      inputs: {checkpoint: sft}

A point is named `<stage>[<label>=<value>,...]` (`sft[lr=1e-05,rank=8]`): a label is the
key's last component, shortened by ABBREVIATIONS, or the whole dotted key where two keys
of one matrix would share a label. Each point is a stage of its own with its own
content-addressed artifact: a grown grid keeps the names and ids of the points it had, so
only the new ones run. A reference to a stage is, in an input:

    sft              the stage; fans the consumer out when `sft` is a sweep (one per point)
    sft[*]           every point of the sweep (fan-in: one input per point, `<input>[<label>]`)
    sft[lr=1e-05,rank=8]   one point (labels in any order)
    pretrain@2000    checkpoint step 2000 of the stage, committed, whether or not it has finished
    {select: {from: "sft[*]", by: metrics.eval_loss, best: min}}   the best point, once all are done

Expansion is pure (no store, no Prefect): flows/spec.py validates and fingerprints the
points it returns as it does any stage.
"""

from __future__ import annotations

import copy
import difflib
import itertools
import json
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from engine.config import ConfigError

ABBREVIATIONS = {
    "learning_rate": "lr",
    "weight_decay": "wd",
    "batch_size": "bs",
    "warmup_steps": "warmup",
    "num_layers": "layers",
    "num_heads": "heads",
    "temperature": "temp",
    "num_generations": "gens",
}
"""A matrix key's last component -> its label in point names (others keep their name)."""

INPUT_PREFIX = "inputs."
"""A matrix key starting with this sets an input (`inputs.dataset: [tok_a, tok_b]`)."""

_REF = re.compile(r"^(?P<stage>[^\[\]@]+)(?:\[(?P<point>[^\]]*)\])?(?:@(?P<step>\d+))?$")
_LABEL_TEXT = re.compile(r"[^A-Za-z0-9_.+-]")
_NUMBER = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


@dataclass(frozen=True)
class Ref:
    """An input fed by one concrete stage, or by one committed checkpoint step of it."""

    stage: str
    step: int | None = None


@dataclass(frozen=True)
class Selection:
    """An input fed by the best of `candidates` (concrete stages) by one metric."""

    candidates: tuple[str, ...]
    metric: str
    best: str  # min | max
    written: str
    """The `from` as written, for messages."""


@dataclass
class Point:
    """One concrete stage after expansion (a plain stage is a point without params)."""

    name: str
    base: str
    params: dict[str, Any]
    """label -> value, in label order (the upstream sweep's first, then the stage's own)."""
    config: dict
    """The stage's config as written, with this point's matrix values set."""
    inputs: dict[str, Ref | Selection]
    fan_in: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Input as written -> the points it gathers (`models: sft[*]`), for the sweep summary."""
    gate_stages: dict[str, str] = field(default_factory=dict)
    """Stage name as a gate writes it -> the concrete stage it means for this point."""

    @property
    def label(self) -> str:
        return ",".join(f"{k}={label_value(v)}" for k, v in self.params.items())


def label_value(value: Any) -> str:
    """A matrix value as it appears in a point's name: `1e-05`, `8`, `true`, `tok_a`."""
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, float):
        text = repr(value)
    elif isinstance(value, (int, str)):
        text = str(value)
    else:
        text = json.dumps(value, separators=(",", ":"), sort_keys=True)
    return _LABEL_TEXT.sub("_", text)


def normalise_value(value: Any) -> Any:
    """YAML 1.1 reads `1e-5` as a string; a matrix value that reads as a number is one."""
    if isinstance(value, str) and _NUMBER.match(value.strip()):
        number = float(value)
        return int(number) if number.is_integer() and re.fullmatch(r"[-+]?\d+", value.strip()) else number
    return value


def point_name(base: str, params: dict[str, Any]) -> str:
    return f"{base}[{','.join(f'{k}={label_value(v)}' for k, v in params.items())}]" if params else base


def parse_ref(text: str) -> tuple[str, str | None, int | None]:
    """`sft[lr=1e-05]@200` -> ("sft", "lr=1e-05", 200); ValueError if it is not a reference."""
    match = _REF.match(text.strip())
    if not match:
        raise ValueError(text)
    return match["stage"], match["point"], int(match["step"]) if match["step"] is not None else None


def matrix_labels(matrix: dict[str, list]) -> dict[str, str]:
    """matrix key -> its label: the last component (abbreviated), or the whole key where two
    keys would otherwise share one."""
    short = {key: ABBREVIATIONS.get(key.split(".")[-1], key.split(".")[-1]) for key in matrix}
    counts: dict[str, int] = {}
    for label in short.values():
        counts[label] = counts.get(label, 0) + 1
    return {key: (label if counts[label] == 1 else key) for key, label in short.items()}


# --------------------------------------------------------------------------- schema


def _models_in(annotation: Any) -> tuple[list[type[BaseModel]], bool]:
    """The pydantic models an annotation may hold, and whether it also holds free-form
    mappings (dict / Any), where any key goes."""
    if annotation is Any:
        return [], True
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation], False
    origin = typing.get_origin(annotation)
    if origin in (dict, typing.Mapping) or annotation is dict:
        return [], True
    if origin in (typing.Union, types.UnionType, typing.Annotated):
        models, free = [], False
        for arg in typing.get_args(annotation):
            m, f = _models_in(arg)
            models += m
            free = free or f
        return models, free
    return [], False


def schema_problem(schema: type[BaseModel], dotted: str) -> str | None:
    """Why `a.b.c` is not a field of `schema` (None: it is, or it lies in a free-form mapping)."""
    models: list[type[BaseModel]] = [schema]
    parts = dotted.split(".")
    for depth, part in enumerate(parts):
        fields = {name: f for m in models for name, f in m.model_fields.items()}
        flat = {name for m in models for name in getattr(m, "FLAT_KEYS", ())}  # ModelConfig's flat names
        if part in flat and depth == len(parts) - 1:
            return None
        if part not in fields:
            where = ".".join(parts[:depth])
            match = difflib.get_close_matches(part, list(fields), n=1, cutoff=0.5)
            hint = f"did you mean '{'.'.join([*parts[:depth], match[0]])}'?" if match else ""
            hint = hint or f"valid keys{' of ' + repr(where) if where else ''}: {', '.join(sorted(fields))}"
            return f"'{dotted}' is not a config key of this stage ({hint})"
        if depth == len(parts) - 1:
            return None
        models, free = _models_in(fields[part].annotation)
        if free:
            return None
        if not models:
            return f"'{dotted}': '{'.'.join(parts[: depth + 1])}' is a value, not a section"
    return None


# --------------------------------------------------------------------------- expansion


def _set_dotted(tree: dict, dotted: str, value: Any, where: str) -> None:
    node = tree
    parts = dotted.split(".")
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"{where}: '{dotted}': '{part}' is set to {child!r} in the config, not a section")
        node = child
    node[parts[-1]] = copy.deepcopy(value)


def _stage_refs(stage) -> list[str]:
    """Every stage reference an input of `stage` spells (plain, point, step or selection)."""
    refs = []
    for value in stage.inputs.values():
        refs.append(value.select.from_ if hasattr(value, "select") else value)
    for key, values in (stage.matrix or {}).items():
        if key.startswith(INPUT_PREFIX):
            refs += [str(v) for v in values]
    return refs


def base_dependencies(stages: dict, gate_names: dict[str, set[str]]) -> dict[str, list[str]]:
    """Stage -> the stages (as written) it reads: inputs, matrix inputs, selections, gates."""
    deps = {}
    for name, stage in stages.items():
        found = []
        for ref in _stage_refs(stage):
            try:
                found.append(parse_ref(str(ref))[0])
            except ValueError:
                continue
        found += sorted(gate_names.get(name, ()))
        deps[name] = [d for d in dict.fromkeys(found) if d in stages]
    return deps


def expand(
    stages: dict, order: list[str], schemas: dict[str, type[BaseModel]], source: str, gate_names: dict[str, set[str]]
) -> tuple[dict[str, Point], list[str]]:
    """The concrete stages of a pipeline (`stages`: name -> StageSpec, `order`: topological),
    and the problems found, each one sentence naming the file, stage and key."""
    points: dict[str, Point] = {}
    by_base: dict[str, list[Point]] = {}  # base -> its points (one, unnamed, for a plain stage)
    errors: list[str] = []

    def is_sweep(base: str) -> bool:
        return any(p.params for p in by_base.get(base, ()))

    for base in order:
        stage = stages[base]
        where = f"{source}: stages.{base}"
        # The stage's own grid.
        own: list[dict[str, Any]] = [{}]
        own_inputs: list[dict[str, str]] = [{}]
        if stage.matrix is not None:
            if not stage.matrix:
                errors.append(f"{where}.matrix: is empty; give each key a list of values, e.g. {{lora.rank: [8, 16]}}")
                continue
            labels = matrix_labels(stage.matrix)
            bad = False
            for key, values in stage.matrix.items():
                if not isinstance(values, list) or not values:
                    errors.append(f"{where}.matrix.{key}: needs a non-empty list of values (got {values!r})")
                    bad = True
                elif key.startswith(INPUT_PREFIX):
                    input_name = key[len(INPUT_PREFIX) :]
                    for value in values:
                        if not isinstance(value, str) or value not in stages or is_sweep(value):
                            errors.append(
                                f"{where}.matrix.{key}: {value!r} is not a stage of the pipeline "
                                f"(a matrix over an input lists stages that are not sweeps)"
                            )
                            bad = True
                    if input_name in stage.inputs:
                        errors.append(f"{where}.matrix.{key}: input '{input_name}' is also set in `inputs`")
                        bad = True
                elif base in schemas and (problem := schema_problem(schemas[base], key)):
                    errors.append(f"{where}.matrix.{key}: {problem}")
                    bad = True
                elif len({label_value(normalise_value(v)) for v in values}) != len(values):
                    errors.append(f"{where}.matrix.{key}: values repeat (or read alike in a point name): {values!r}")
                    bad = True
            if bad:
                continue
            keys = list(stage.matrix)
            own, own_inputs = [], []
            for combo in itertools.product(*(stage.matrix[k] for k in keys)):
                own.append({labels[k]: normalise_value(v) for k, v in zip(keys, combo)})
                own_inputs.append({k: v for k, v in zip(keys, combo) if k.startswith(INPUT_PREFIX)})
            own_keys = {labels[k]: k for k in keys}
        else:
            own_keys = {}

        # Inputs: which fan the stage out (a plain reference to a sweep).
        fan_out: str | None = None
        parsed: dict[str, tuple[str, str | None, int | None] | None] = {}
        for input_name, value in stage.inputs.items():
            text = value.select.from_ if hasattr(value, "select") else value
            try:
                parsed[input_name] = up, point, _ = parse_ref(str(text))
            except ValueError:
                errors.append(f"{where}.inputs.{input_name}: '{text}' is not a stage reference ({_REF_FORMS})")
                parsed[input_name] = None
                continue
            if up not in stages:
                match = difflib.get_close_matches(up, list(stages), n=1)
                hint = f"; did you mean '{match[0]}'?" if match else f"; stages are: {', '.join(stages)}"
                errors.append(
                    f"{where}.inputs.{input_name}: references stage '{up}', which is not in the pipeline{hint}"
                )
                parsed[input_name] = None
            elif up not in by_base:
                parsed[input_name] = None  # a cycle, reported by the caller
            elif point is None and is_sweep(up) and not hasattr(value, "select"):
                if fan_out not in (None, up):
                    errors.append(
                        f"{where}.inputs.{input_name}: fans out over sweep '{up}' while another input fans out "
                        f"over '{fan_out}'; fan in one of them with '{up}[*]' or pick a point"
                    )
                    continue
                fan_out = up
        refs = {name: ref for name, ref in parsed.items() if ref is not None}
        if len(refs) < len(parsed):
            continue

        upstream_points = by_base[fan_out] if fan_out else [None]
        made: list[Point] = []
        for upstream in upstream_points:
            for own_params, own_input_values in zip(own, own_inputs):
                params = dict(upstream.params) if upstream else {}
                clash = set(params) & set(own_params)
                if clash:
                    errors.append(
                        f"{where}.matrix: label(s) {', '.join(sorted(clash))} are also labels of sweep "
                        f"'{fan_out}' it fans out over; sweep a different key"
                    )
                    break
                params.update(own_params)
                config = copy.deepcopy(stage.config)
                for label, value in own_params.items():
                    key = own_keys[label]
                    if not key.startswith(INPUT_PREFIX):
                        try:
                            _set_dotted(config, key, value, f"{where}.matrix")
                        except ConfigError as e:
                            errors.append(str(e))
                inputs: dict[str, Ref | Selection] = {}
                fan_in: dict[str, tuple[str, ...]] = {}
                for input_name, value in stage.inputs.items():
                    up, point, step = refs[input_name]
                    resolved = _resolve(up, point, by_base, upstream, fan_out, f"{where}.inputs.{input_name}")
                    if isinstance(resolved, str):
                        errors.append(resolved)
                        continue
                    if hasattr(value, "select"):
                        resolved = by_base[up] if point in (None, "*") else resolved
                        metric = value.select.by
                        inputs[input_name] = Selection(
                            tuple(p.name for p in resolved), metric, value.select.best, value.select.from_
                        )
                    elif point == "*":
                        fan_in[input_name] = tuple(p.name for p in resolved)
                        for p in resolved:
                            inputs[f"{input_name}[{p.label}]"] = Ref(p.name, step)
                    else:
                        inputs[input_name] = Ref(resolved[0].name, step)
                for key, value in own_input_values.items():
                    inputs[key[len(INPUT_PREFIX) :]] = Ref(by_base[value][0].name)
                gate_stages = {}
                for gate_name in gate_names.get(base, ()):
                    if gate_name in by_base:
                        choices = by_base[gate_name]
                        if gate_name == fan_out:
                            assert upstream is not None  # a point of the sweep fanned out over
                            gate_stages[gate_name] = upstream.name
                        elif len(choices) == 1 and not choices[0].params:
                            gate_stages[gate_name] = choices[0].name
                        else:
                            errors.append(
                                f"{source}: stages.{base}.when: '{gate_name}' is a sweep of {len(choices)} points; "
                                f"a gate reads one stage (gate a stage that fans out over it, or select a point)"
                            )
                made.append(Point(point_name(base, params), base, params, config, inputs, fan_in, gate_stages))
        names = [p.name for p in made]
        if len(set(names)) != len(names):
            errors.append(f"{where}.matrix: two points have the same name ({names}); their values read alike")
            continue
        by_base[base] = made
        for p in made:
            points[p.name] = p
    return points, errors


_REF_FORMS = "forms: STAGE, STAGE[*], STAGE[label=value,...], STAGE@STEP"


def _resolve(up: str, point: str | None, by_base: dict, upstream, fan_out, where: str) -> list | str:
    """The points a reference means for one consumer point (else an error sentence)."""
    choices = by_base[up]
    if point == "*":
        if not any(p.params for p in choices):
            return f"{where}: '{up}[*]': stage '{up}' is not a sweep (it has no matrix)"
        return choices
    if point is not None:
        try:
            want = dict(item.split("=", 1) for item in point.split(",")) if point else {}
        except ValueError:
            return f"{where}: '{up}[{point}]' is not a point ({_REF_FORMS})"
        for p in choices:
            if {k: label_value(v) for k, v in p.params.items()} == want:
                return [p]
        shown = ", ".join(p.name for p in choices[:6]) + (" ..." if len(choices) > 6 else "")
        return f"{where}: '{up}[{point}]' is not a point of '{up}' (its points: {shown})"
    if up == fan_out:
        return [upstream]
    return choices[:1]
