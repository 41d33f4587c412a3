"""The device mesh of a run, the shardings of its batches, and host values <-> global arrays.

`make_mesh` lays the devices out as (data, expert, fsdp, context, tensor); a size of -1 takes the
devices the other axes leave. Batches are global arrays whose rows are split over (data, expert,
fsdp); the model splits each row's positions over `context` itself.

Devices of several TPU slices (their `slice_index`) form a hybrid mesh, as MaxText's
create_device_mesh does: each axis is its `mesh.dcn` factor over slices times the rest within
a slice (jax's create_hybrid_device_mesh), so only the collectives of the axes that span
slices cross the data-center network.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils, multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from engine.config import ConfigError
from engine.ops.partitioning import BATCH_AXES, MESH_AXES, PIPELINE_AXIS
from engine.parallel.config import MeshConfig


def mesh_axes(cfg: MeshConfig) -> tuple[str, ...]:
    """The mesh's axis names: MESH_AXES, after `pipeline` where there are pipeline stages."""
    return ((PIPELINE_AXIS,) if cfg.pipeline > 1 else ()) + MESH_AXES


def axis_sizes(cfg: MeshConfig) -> list[int]:
    """The configured sizes (-1: the rest) in mesh_axes' order."""
    return ([cfg.pipeline] if cfg.pipeline > 1 else []) + cfg.sizes()


def _dcn_sizes(cfg: MeshConfig) -> list[int]:
    return ([cfg.dcn.pipeline] if cfg.pipeline > 1 else []) + cfg.dcn.sizes()


def _describe(sizes: list[int]) -> str:
    """ "data=2 fsdp=4 tensor=1", naming `expert` and `context` only when they are used (and
    `pipeline`, which comes first, when it is)."""
    axes = MESH_AXES if len(sizes) == len(MESH_AXES) else (PIPELINE_AXIS, *MESH_AXES)
    return " ".join(
        f"{axis}={size}" for axis, size in zip(axes, sizes) if axis not in ("expert", "context") or size != 1
    )


def make_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Build the ([pipeline,] data, expert, fsdp, context, tensor) mesh; -1 takes the devices
    the others leave."""
    devices = list(devices if devices is not None else jax.devices())
    n = len(devices)
    sizes = axis_sizes(cfg)
    described = _describe(sizes)
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if n % known:
            raise ConfigError(f"mesh: {described} does not divide {n} devices (the fixed axes multiply to {known})")
        sizes[sizes.index(-1)] = n // known
    if math.prod(sizes) != n:
        described = _describe(sizes)
        raise ConfigError(
            f"mesh: {described} needs {math.prod(sizes)} devices but {n} are available; "
            f"set one axis to -1 to take the rest"
        )
    slices = len({getattr(d, "slice_index", 0) for d in devices})
    if slices > 1:
        return Mesh(_hybrid(cfg, sizes, slices, devices), mesh_axes(cfg))
    if math.prod(_dcn_sizes(cfg)) > 1:
        raise ConfigError(f"mesh.dcn: {_describe(_dcn_sizes(cfg))} spans slices, but the devices are one slice")
    try:  # a topology-aware layout on TPU/GPU; plain order on CPU
        device_array = mesh_utils.create_device_mesh(sizes, devices)
    except Exception:
        device_array = np.asarray(devices).reshape(sizes)
    return Mesh(device_array, mesh_axes(cfg))


def dcn_sizes(cfg: MeshConfig, slices: int) -> list[int]:
    """Each axis's factor over `slices` slices (mesh.dcn; `data` takes them all when unset)."""
    dcn = _dcn_sizes(cfg)
    if math.prod(dcn) == 1:
        dcn[mesh_axes(cfg).index("data")] = slices
    if math.prod(dcn) != slices:
        raise ConfigError(f"mesh.dcn: {_describe(dcn)} spans {math.prod(dcn)} slices but the devices are {slices}")
    return dcn


def _hybrid(cfg: MeshConfig, sizes: list[int], slices: int, devices: Sequence[jax.Device]) -> np.ndarray:
    """The devices of `slices` slices as the (data, ..., tensor) mesh of `sizes`: each axis its
    DCN factor (major: whole slices) times its ICI part (within each slice, topology-aware)."""
    dcn = dcn_sizes(cfg, slices)
    if any(size % factor for size, factor in zip(sizes, dcn)):
        raise ConfigError(
            f"mesh: {_describe(sizes)} cannot span {slices} slices as mesh.dcn {_describe(dcn)}: "
            "each axis must be a multiple of its dcn factor (set mesh.dcn to an axis that is)"
        )
    ici = [size // factor for size, factor in zip(sizes, dcn)]
    return mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, allow_split_physical_axes=True)


def batch_axes(mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes a batch's rows are split over (those of BATCH_AXES the mesh has, after
    `pipeline` where there are stages: each stage holds its share of the micro-batches,
    engine/ops/pipeline.py)."""
    return tuple(a for a in (PIPELINE_AXIS, *BATCH_AXES) if a in mesh.axis_names)


def batch_shards(mesh: Mesh) -> int:
    """How many pieces a batch's rows are split into."""
    return math.prod(mesh.shape[a] for a in batch_axes(mesh))


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Batches are global arrays sharded over ([pipeline,] data, expert, fsdp) on their leading dimension."""
    return NamedSharding(mesh, P(batch_axes(mesh), *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def global_array(value, sharding: NamedSharding) -> jax.Array:
    """A global array from a host value that every process holds in full: each process places
    the slices its devices hold, whatever the mesh and however many processes share it."""
    value = np.asarray(value)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def to_host(x: jax.Array) -> np.ndarray:
    """A global array as a host numpy array, the whole of it on every process."""
    if x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
