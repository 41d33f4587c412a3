"""The one table that maps logical axis names to mesh axes, and activation constraints.

Parameters carry logical names (`embed`, `mlp`, `heads`, ...) in their metadata; activations
are constrained with `constrain(x, ("act_batch", "act_seq", "act_embed"))`. Changing the
parallelism of a run means changing the mesh sizes (engine/parallel/mesh.py), never the
model code. This module is the ops layer's: models and kernels read it, it reads no model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from engine.config import ConfigError

MESH_AXES = ("data", "expert", "fsdp", "context", "tensor")
PIPELINE_AXIS = "pipeline"
"""Pipeline stages over the layer stack (engine/ops/pipeline.py): a mesh has it before
MESH_AXES only when it has more than one stage, so every other mesh is as it was."""
BATCH_AXES = ("data", "expert", "fsdp")
"""Batches are split over these: outside the MoE layers the expert axis is more data parallelism."""
TOKEN_AXES = BATCH_AXES + ("context",)
"""A batch's tokens, its (b, t) flattened, are split over these: rows over the batch axes, each
row's positions over `context` (context parallelism: attention gathers the keys and values)."""

# logical name -> mesh axis (or tuple of axes, or None = replicated).
LOGICAL_RULES: dict[str, str | tuple[str, ...] | None] = {
    # parameters
    "vocab": "tensor",
    "embed": ("fsdp", "context"),  # context shards hold a slice of the parameters too, as fsdp's do
    # A low-rank projection's input width that is not d_model (DeepSeek-V4's query latent, its
    # grouped output's per-group width): split as embed, or those weights sit whole on every device.
    "latent": ("fsdp", "context"),
    "mlp": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "norm": None,
    "layers": PIPELINE_AXIS,  # a stack's stages: consecutive layers (none without the axis)
    "expert": "expert",
    # activations
    "act_batch": (PIPELINE_AXIS, *BATCH_AXES),  # outside the stages, rows are split over them too
    "act_batch_moe": ("data", "fsdp"),  # an MoE dispatch buffer's rows: the expert axis is on its experts
    "act_expert": "expert",
    "act_seq": "context",
    "act_embed": None,
    "act_heads": "tensor",
    "act_kv_heads": "tensor",
    "act_mlp": "tensor",
    "act_vocab": "tensor",
    "act_stage": PIPELINE_AXIS,
}


def _on_mesh(axis, mesh: Mesh | None):
    """`axis` without the mesh axes `mesh` lacks (a mesh built by hand may have fewer). A
    `context` axis of one device counts as lacking: without context parallelism every spec is
    what it was before the mesh had that axis."""
    if mesh is None or axis is None:
        return axis

    def present(a: str) -> bool:
        return a in mesh.axis_names and (a != "context" or mesh.shape[a] > 1)

    if isinstance(axis, str):
        return axis if present(axis) else None
    kept = tuple(a for a in axis if present(a))
    if len(kept) == 1 and "context" in axis:  # ("fsdp", "context") on a mesh without context parallelism
        return kept[0]
    return kept or None


def logical_to_spec(names: Sequence[str | None] | None, rules=LOGICAL_RULES, mesh: Mesh | None = None) -> P:
    """The PartitionSpec of logical `names`; with `mesh`, only the mesh axes it has."""
    if names is None:
        return P()
    axes: list[Any] = []  # per dimension: a mesh axis, a tuple of them, or None
    for name in names:
        if name is None:
            axes.append(None)
        elif name not in rules:
            raise KeyError(f"logical axis '{name}' has no sharding rule")
        elif _within_stages and name.startswith("act_") and name != "act_stage":
            axes.append(_on_mesh(_without_pipeline(rules[name]), mesh))
        else:
            axes.append(_on_mesh(rules[name], mesh))
    return P(*axes)


_within_stages: list[bool] = []


@contextlib.contextmanager
def within_stages() -> Iterator[None]:
    """Within pipeline stages (engine/ops/pipeline.py) an activation's rows are one micro-batch
    of a stage, which `act_stage` puts on the pipeline axis: the other activation names leave it
    out (outside, `act_batch` splits rows over it as over the batch axes, as MaxText's
    activation_embed_and_logits_batch does, so the embedding and the head are not repeated by
    every stage)."""
    _within_stages.append(True)
    try:
        yield
    finally:
        _within_stages.pop()


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _StageMark:
    """Whether a custom_vjp's forward ran within pipeline stages (a residual without arrays)."""

    inside: bool


def stage_aware(fwd, bwd):
    """A custom_vjp's (fwd, bwd) whose backward constrains activations: the backward is traced
    after within_stages has closed (when autodiff transposes the step), yet runs under the
    stages' vmap, whose spmd_axis_name holds the pipeline axis; it constrains as its forward
    did, within the stages if the forward was. (bwd takes the nondiff arguments first.)"""

    def marked_fwd(*args):
        out, residuals = fwd(*args)
        return out, (residuals, _StageMark(bool(_within_stages)))

    def marked_bwd(*args):
        *nondiff, (residuals, mark), cotangent = args
        with within_stages() if mark.inside else contextlib.nullcontext():
            return bwd(*nondiff, residuals, cotangent)

    return marked_fwd, marked_bwd


def _without_pipeline(axis):
    if isinstance(axis, tuple):
        return tuple(a for a in axis if a != PIPELINE_AXIS) or None
    return None if axis == PIPELINE_AXIS else axis


def mesh_axis_size(mesh: Mesh, axis) -> int:
    if axis is None:
        return 1
    if isinstance(axis, str):
        return mesh.shape[axis]
    return math.prod(mesh.shape[a] for a in axis)


def check_divisible(name: str, shape: Sequence[int], spec: P, mesh: Mesh) -> None:
    for dim, axis in zip(shape, spec):
        size = mesh_axis_size(mesh, axis)
        if dim % size:
            raise ConfigError(
                f"mesh: parameter '{name}' has a dimension of {dim} that cannot be split over "
                f"mesh axis {axis!r} of size {size}; change the mesh or the model size"
            )


# --------------------------------------------------------------------------- activations

_current: list[Mesh | None] = []


@contextlib.contextmanager
def use_mesh(mesh: Mesh | None) -> Iterator[None]:
    """Within this context, `constrain` pins activations to `mesh`."""
    _current.append(mesh)
    try:
        yield
    finally:
        _current.pop()


def current_mesh() -> Mesh | None:
    """The mesh of the innermost `use_mesh` (None outside one)."""
    return _current[-1] if _current else None


def current_platform() -> str:
    """The platform being traced for: that of the current mesh's devices (so an ahead-of-time
    compile for a TPU topology on a CPU host says "tpu"), else JAX's default backend."""
    mesh = current_mesh()
    return mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()


def activation_spec(shape: Sequence[int], names: Sequence[str | None], mesh: Mesh) -> P:
    """The spec of an activation with logical `names` on `mesh`; a dimension that does not
    divide its mesh axis stays replicated on it."""
    spec = logical_to_spec(names, mesh=mesh)
    return P(*(a if shape[i] % mesh_axis_size(mesh, a) == 0 else None for i, a in enumerate(spec)))


def kernel_axes(mesh: Mesh, batch: int, heads: int, kv_heads: int):
    """(batch axes, head axes) over which an attention kernel XLA cannot partition (a Pallas
    or FFI call, run in a shard_map) splits its rows and heads: batch as `act_batch` says,
    kv heads as `act_kv_heads` says with their query heads, each None where it does not
    divide the axes."""
    batch_axes = activation_spec((batch,), ("act_batch",), mesh)[0]
    head_axes = activation_spec((kv_heads,), ("act_kv_heads",), mesh)[0]
    if heads % mesh_axis_size(mesh, head_axes):
        head_axes = None
    return batch_axes, head_axes


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Constrain an activation's sharding by logical names (a no-op without a mesh)."""
    mesh = current_mesh()
    if mesh is None or mesh.size == 1:
        return x
    spec = activation_spec(x.shape, names, mesh)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
