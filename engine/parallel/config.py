"""The device mesh of a run, as configured (engine/parallel/mesh.py builds it)."""

from __future__ import annotations

from pydantic import Field, model_validator

from engine.config import Strict


def unsplittable(length: int, context: int, what: str) -> str | None:
    """Why a sequence of `length` positions (`what` names the keys that set it) cannot split
    over a context axis of `context` devices; None if it can."""
    if context > 1 and length % context:
        return (
            f"{what} ({length}) must be divisible by the mesh's context axis ({context} devices): "
            f"context parallelism splits each sequence's positions over it"
        )
    return None


class DcnConfig(Strict):
    """How many slices each mesh axis spans (MaxText's dcn_*_parallelism): the axis's size is
    this factor (over the data-center network between slices) times its size within a slice
    (over ICI). The factors multiply to the number of slices; with every factor 1 on several
    slices, `data` spans them (whole replicas per slice: one gradient all-reduce over DCN per
    step). Tensor parallelism never crosses slices."""

    data: int = Field(1, ge=1)
    expert: int = Field(1, ge=1)
    fsdp: int = Field(1, ge=1)
    context: int = Field(1, ge=1)
    pipeline: int = Field(1, ge=1)
    """Pipeline stages over slices: only each micro-batch's activations at a stage boundary
    cross the data-center network (engine/ops/pipeline.py)."""

    def sizes(self) -> list[int]:
        """In the mesh's axis order (the tensor axis: 1; `pipeline` is not among them)."""
        return [self.data, self.expert, self.fsdp, self.context, 1]


class MeshConfig(Strict):
    """Device mesh sizes; -1 takes the remaining devices (at most one axis)."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    expert: int = 1
    """Expert parallelism: a mixture of experts' experts are split over this axis (and its
    tokens sent to them); elsewhere it splits the batch like `data`."""
    context: int = 1
    """Context parallelism: each sequence's positions are split over this axis; attention
    gathers the keys and values, and the parameters are split over it as over fsdp."""
    dcn: DcnConfig = Field(default_factory=DcnConfig)
    """On a multi-slice job: the part of each axis laid over slices (engine/parallel/mesh.py)."""
    pipeline: int = Field(1, ge=1)
    """Pipeline parallelism: the layer stack is split into this many stages of consecutive
    layers, one per slot of the axis, run over micro-batches (engine/ops/pipeline.py,
    ComputeConfig.pipeline_microbatches). 1: no `pipeline` axis in the mesh."""

    def sizes(self) -> list[int]:
        """In the mesh's axis order (engine/ops/partitioning.py: MESH_AXES)."""
        return [self.data, self.expert, self.fsdp, self.context, self.tensor]

    @model_validator(mode="after")
    def _check(self) -> MeshConfig:
        sizes = self.sizes()
        if any(s == 0 or s < -1 for s in sizes):
            raise ValueError("mesh sizes must be positive or -1")
        if sizes.count(-1) > 1:
            raise ValueError("at most one mesh axis may be -1")
        if self.dcn.pipeline > 1 and self.pipeline % self.dcn.pipeline:
            raise ValueError(f"dcn.pipeline ({self.dcn.pipeline}) must divide pipeline ({self.pipeline})")
        return self
