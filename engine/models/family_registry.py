"""The registry of model families: name -> the family object, filled as each family module
(engine/models/families/) is imported.

A leaf below both sides: engine/models/config.py validates `ModelConfig.family` against it,
and the families, which map config.json to ModelConfig fields and so import ModelConfig,
register here. engine/models/__init__.py imports the families package, so they are
registered before any ModelConfig is validated. families/base.py re-exports
these names with `Family` as their type.
"""

from __future__ import annotations

import difflib
from typing import Any

from engine.config import ConfigError

_FAMILIES: dict[str, Any] = {}
"""name -> an instance of its families/base.py Family subclass, in registration order."""


def register_family(cls: type[Any]) -> type[Any]:
    """Class decorator: make `cls` the family `cls.name` (and its model_type)."""
    assert cls.name not in _FAMILIES, f"family '{cls.name}' is registered twice"
    assert all(f.model_type != cls.model_type for f in _FAMILIES.values()), f"model_type '{cls.model_type}' twice"
    _FAMILIES[cls.name] = cls()
    return cls


def family_names() -> list[str]:
    """Registered family names, in registration order."""
    return list(_FAMILIES)


def get_family(name: str) -> Any:
    """The registered family `name`; a ConfigError (a ValueError) naming the closest one."""
    family = _FAMILIES.get(name)
    if family is None:
        match = difflib.get_close_matches(str(name), list(_FAMILIES), n=1)
        hint = f"did you mean '{match[0]}'?" if match else f"valid families: {', '.join(_FAMILIES)}"
        raise ConfigError(f"unknown family '{name}'; {hint}")
    return family


def family_of_model_type(model_type: str | None) -> Any:
    """The family whose config.json `model_type` this is, if any."""
    return next((f for f in _FAMILIES.values() if f.model_type == model_type), None)
