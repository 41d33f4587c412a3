"""The device mesh of a run, as configured (engine/parallel/mesh.py builds it)."""

from __future__ import annotations

from pydantic import model_validator

from engine.config import Strict


class MeshConfig(Strict):
    """Device mesh sizes; -1 takes the remaining devices (at most one axis)."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1

    @model_validator(mode="after")
    def _check(self) -> "MeshConfig":
        sizes = [self.data, self.fsdp, self.tensor]
        if any(s == 0 or s < -1 for s in sizes):
            raise ValueError("mesh sizes must be positive or -1")
        if sizes.count(-1) > 1:
            raise ValueError("at most one mesh axis may be -1")
        return self
