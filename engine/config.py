"""The config machinery: strict pydantic schemas, YAML loading, dotted overrides, presets.

YAML supplies values; the schemas are pydantic models next to the code they configure
(engine/models/config.py, engine/train/config.py, ...). Unknown keys are errors that name the
key and the closest valid one; types and ranges are checked before anything compiles.
Presets and example pipelines ship inside the wheel (the `configs` package), so an
installed trainflow finds them from any directory.
"""

from __future__ import annotations

import difflib
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from engine import flat_keys


class ConfigError(ValueError):
    """A user mistake in a config: the message names the file and key at fault."""


class Strict(BaseModel):
    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, protected_namespaces=(), use_attribute_docstrings=True
    )


# --------------------------------------------------------------------------- loading


def _closest(key: str, valid: list[str]) -> str:
    match = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    return f"; did you mean '{match[0]}'?" if match else f"; valid keys: {', '.join(sorted(valid))}"


def _model_at(schema: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """The pydantic model that owns the field at `loc` (for suggestions)."""
    current: Any = schema
    for part in loc:
        if not (isinstance(current, type) and issubclass(current, BaseModel)):
            return None
        field = current.model_fields.get(str(part))
        if field is None:
            return None
        annotation = field.annotation
        for candidate in getattr(annotation, "__args__", (annotation,)):
            if isinstance(candidate, type) and issubclass(candidate, BaseModel):
                current = candidate
                break
        else:
            current = annotation
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def format_validation_error(err: ValidationError, schema: type[BaseModel], source: str) -> str:
    lines = []
    for e in err.errors():
        loc = tuple(e["loc"])
        key = ".".join(str(p) for p in loc) or "<root>"
        if e["type"] == "extra_forbidden":
            owner = _model_at(schema, loc[:-1])
            valid = [*owner.model_fields, *getattr(owner, "FLAT_KEYS", ())] if owner else []
            lines.append(f"{source}: unknown key '{key}'{_closest(str(loc[-1]), valid)}")
        elif e["type"] == "missing":
            lines.append(f"{source}: missing required key '{key}'")
        else:
            value = e.get("input")
            shown = "" if isinstance(value, dict) else f" (got {value!r})"
            lines.append(f"{source}: key '{key}': {e['msg']}{shown}")
    return "\n".join(lines)


def parse_value(text: str) -> Any:
    """An override value as YAML would read it: `3`, `1e-3`, `true`, `null`, `[1,2]`, `abc`."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_overrides(tree: dict, overrides: list[str] | dict[str, Any], source: str = "override") -> dict:
    """Apply `a.b.c=value` overrides to a nested dict (in place; returns it).

    A number indexes a list: `tasks.0.limit=50` sets the first task's limit, `tasks.2=...`
    may also append right after the last item.
    """
    items = overrides.items() if isinstance(overrides, dict) else []
    if not isinstance(overrides, dict):
        parsed = []
        for item in overrides:
            if "=" not in item:
                raise ConfigError(f"{source}: '{item}' is not of the form key=value")
            key, value = item.split("=", 1)
            parsed.append((key.strip(), parse_value(value)))
        items = parsed
    for key, value in items:
        node: Any = tree
        parts = key.split(".")
        for depth, part in enumerate(parts):
            last = depth == len(parts) - 1
            where = ".".join(parts[:depth]) or "the top level"
            if isinstance(node, list):
                if not part.isdigit():
                    raise ConfigError(f"{source}: '{key}': '{where}' is a list; index it with a number, not '{part}'")
                index = int(part)
                if index > len(node) or (index == len(node) and not last):
                    raise ConfigError(
                        f"{source}: '{key}': '{where}' has {len(node)} item(s); index {index} is out of range"
                    )
                if last:
                    node[index : index + 1] = [value]
                    break
                node = node[index]
            elif isinstance(node, dict):
                if last:
                    node[part] = value
                    break
                child = node.get(part)
                if child is None:
                    child = node[part] = {}
                node = child
            else:
                raise ConfigError(f"{source}: '{key}': '{parts[depth - 1]}' is a value, not a section")
    return tree


def load_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    return parse_yaml(path.read_text(), str(path))


def parse_yaml(text: str, source: str) -> dict:
    """A config file's text as a mapping; `source` names the file in the error."""
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level")
    return data


def shipped(*parts: str):
    """A file or folder of the shipped `configs` package (a Traversable): `shipped("models", "tiny.yaml")`."""
    return resources.files("configs").joinpath(*parts)


def preset_names() -> list[str]:
    return sorted(p.name[:-5] for p in shipped("models").iterdir() if p.name.endswith(".yaml"))


def load_preset(name: str, source: str) -> dict:
    """The model preset `configs/models/<name>.yaml`, or a ConfigError naming the closest one."""
    preset = shipped("models", f"{name}.yaml")
    if not preset.is_file():
        names = preset_names()
        match = difflib.get_close_matches(str(name), names, n=1)
        hint = f"; did you mean '{match[0]}'?" if match else f"; available: {', '.join(names)}"
        raise ConfigError(f"{source}: unknown model preset '{name}'{hint}")
    data = yaml.safe_load(preset.read_text())
    assert isinstance(data, dict), f"preset {name} is not a mapping"
    return data


def resolve_model_preset(tree: dict, source: str) -> dict:
    """`model: llama3-1b` or `model: {preset: llama3-1b, num_layers: 2}` -> a full model dict.

    A preset's `compute:` section (e.g. bfloat16 matmuls, remat) becomes the defaults of the
    run's `compute` section."""
    model = tree.get("model")
    if isinstance(model, str):
        model = {"preset": model}
    if isinstance(model, dict) and "preset" in model:
        model = dict(model)
        base = load_preset(model.pop("preset"), source)
        compute = base.pop("compute", None)
        if compute:  # the preset's recommended compute settings, under the run's own
            tree["compute"] = {**compute, **(tree.get("compute") or {})}
        # The preset in sections, then the run's keys over it: a section given in the run
        # (`model.attention.num_heads=6`) refines the preset's, a flat key (`model.num_heads=6`)
        # is folded in over both as the config is validated (engine/flat_keys.py).
        base = flat_keys.fold(base)
        for key, value in model.items():
            if isinstance(value, dict) and isinstance(base.get(key), dict):
                base[key] = {**base[key], **value}
            else:
                base[key] = value
        tree["model"] = base
    return tree


def validate(schema: type[BaseModel], tree: dict, source: str) -> Any:
    try:
        return schema.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, schema, source)) from None


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | dict | None = None,
    tree: dict | None = None,
    *,
    schema: type[BaseModel],
    source: str | None = None,
) -> Any:
    """Load a run config from YAML (or a dict read from `source`), apply overrides, resolve
    presets, validate."""
    source = source or (str(path) if path else "config")
    data = load_yaml(path) if path else dict(tree or {})
    if isinstance(data.get("model"), str):  # so `model.num_layers=2` can refine a preset
        data["model"] = {"preset": data["model"]}
    if overrides:
        apply_overrides(data, overrides)
    if "model" in schema.model_fields:
        resolve_model_preset(data, source)
    return validate(schema, data, source)


def to_yaml(cfg: BaseModel) -> str:
    """The config as YAML, model and data sections first (the order a reader looks for them)."""
    tree = cfg.model_dump(mode="json")
    first = [key for key in ("model", "tokenizer", "data", "optimizer") if key in tree]
    tree = {**{key: tree[key] for key in first}, **{k: v for k, v in tree.items() if k not in first}}
    return yaml.safe_dump(tree, sort_keys=False)
