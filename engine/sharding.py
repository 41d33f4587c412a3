"""The device mesh and the one table that maps logical axis names to mesh axes.

Parameters carry logical names (`embed`, `mlp`, `heads`, ...) in their metadata; activations
are constrained with `constrain(x, ("act_batch", "act_seq", "act_embed"))`. Changing the
parallelism of a run means changing the mesh sizes, never the model code.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from engine.config import ConfigError, MeshConfig

MESH_AXES = ("data", "fsdp", "tensor")

# logical name -> mesh axis (or tuple of axes, or None = replicated).
LOGICAL_RULES: dict[str, str | tuple[str, ...] | None] = {
    # parameters
    "vocab": "tensor",
    "embed": "fsdp",
    "mlp": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "norm": None,
    "layers": None,
    # activations
    "act_batch": ("data", "fsdp"),
    "act_seq": None,
    "act_embed": None,
    "act_heads": "tensor",
    "act_kv_heads": "tensor",
    "act_mlp": "tensor",
    "act_vocab": "tensor",
}


def make_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Build the (data, fsdp, tensor) mesh; -1 takes the devices the others leave."""
    devices = list(devices if devices is not None else jax.devices())
    n = len(devices)
    sizes = [cfg.data, cfg.fsdp, cfg.tensor]
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if n % known:
            raise ConfigError(
                f"mesh: data={cfg.data} fsdp={cfg.fsdp} tensor={cfg.tensor} does not divide "
                f"{n} devices (the fixed axes multiply to {known})"
            )
        sizes[sizes.index(-1)] = n // known
    if math.prod(sizes) != n:
        raise ConfigError(
            f"mesh: data={sizes[0]} fsdp={sizes[1]} tensor={sizes[2]} needs {math.prod(sizes)} "
            f"devices but {n} are available; set one axis to -1 to take the rest"
        )
    try:  # a topology-aware layout on TPU/GPU; plain order on CPU
        device_array = jax.experimental.mesh_utils.create_device_mesh(sizes, devices)
    except Exception:
        device_array = np.asarray(devices).reshape(sizes)
    return Mesh(device_array, MESH_AXES)


def logical_to_spec(names: Sequence[str | None] | None, rules=LOGICAL_RULES) -> P:
    if names is None:
        return P()
    axes = []
    for name in names:
        if name is None:
            axes.append(None)
        elif name not in rules:
            raise KeyError(f"logical axis '{name}' has no sharding rule")
        else:
            axes.append(rules[name])
    return P(*axes)


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

_current: list[Mesh] = []


@contextlib.contextmanager
def use_mesh(mesh: Mesh | None) -> Iterator[None]:
    """Within this context, `constrain` pins activations to `mesh`."""
    _current.append(mesh)
    try:
        yield
    finally:
        _current.pop()


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Constrain an activation's sharding by logical names (a no-op without a mesh)."""
    mesh = _current[-1] if _current else None
    if mesh is None or mesh.size == 1:
        return x
    spec = logical_to_spec(names)
    # An activation dimension that does not divide its axis stays replicated on it.
    spec = P(*(a if x.shape[i] % mesh_axis_size(mesh, a) == 0 else None for i, a in enumerate(spec)))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Batches are global arrays sharded over (data, fsdp) on their leading dimension."""
    return NamedSharding(mesh, P(("data", "fsdp"), *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())
