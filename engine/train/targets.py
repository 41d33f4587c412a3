"""The machines a run can be planned for (`trainflow plan --target NAME`): TPU slices, GPU
hosts, and `local` (the devices of this process).

Per chip: memory, dense bf16 peak FLOP/s and memory bandwidth, from the vendors' spec sheets
(Cloud TPU system architecture pages; NVIDIA A100/H100/H200 SXM data sheets). A TPU slice
also names its topology as libtpu spells it (`v5e:4x4`), so its step compiles ahead of time
on any host with libtpu installed (`jax.experimental.topologies`). A slice's name counts
chips, except v4 and v5p, whose names count TensorCores (two per chip): v5p-128 is 64 chips.

Several slices joined by the data-center network (DCN) are the slice's name and `x` the
count: `v5p-256x2` is two v5p-256 slices (256 chips), compiled for as libtpu's multi-slice
topology; the mesh's `dcn` factors say which axes span the slices (engine/parallel/mesh.py).
"""

from __future__ import annotations

import dataclasses

from engine.config import ConfigError

GiB = 1024**3
GB = 1000**3


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator: what bounds a step on it."""

    kind: str
    memory_bytes: float
    peak_flops: float
    """Dense bf16 FLOP/s (no sparsity)."""
    memory_bandwidth: float
    """Bytes/s between the chip's HBM and its cores."""


@dataclasses.dataclass(frozen=True)
class Target:
    """A machine to plan for: `chips` of one kind, compiled for through `topology` (TPU) or
    estimated (GPU without one here)."""

    name: str
    platform: str
    """tpu | gpu | local."""
    chip: Chip | None
    """None for `local`: the devices here say what they are."""
    chips: int
    topology: str | None = None
    """libtpu's topology name (TPU slices only; of one slice)."""
    slices: int = 1
    """TPU slices joined over DCN (`chips` counts all of them)."""


TPU_V4 = Chip("TPU v4", 32 * GiB, 275e12, 1228 * GB)
TPU_V5E = Chip("TPU v5e", 16 * GiB, 197e12, 819 * GB)
TPU_V5P = Chip("TPU v5p", 95 * GiB, 459e12, 2765 * GB)
TPU_V6E = Chip("TPU v6e", 32 * GiB, 918e12, 1640 * GB)
A100 = Chip("NVIDIA A100 80GB SXM", 80 * GiB, 312e12, 2039 * GB)
H100 = Chip("NVIDIA H100 SXM", 80 * GiB, 989e12, 3350 * GB)
H200 = Chip("NVIDIA H200 SXM", 141 * GB, 989e12, 4800 * GB)

_TPU_SLICES = {  # name -> (chip, topology)
    "v4-8": (TPU_V4, "v4:2x2x1"),
    "v4-32": (TPU_V4, "v4:2x2x4"),
    "v5e-1": (TPU_V5E, "v5e:1x1"),
    "v5e-4": (TPU_V5E, "v5e:2x2"),
    "v5e-8": (TPU_V5E, "v5e:2x4"),
    "v5e-16": (TPU_V5E, "v5e:4x4"),
    "v5e-32": (TPU_V5E, "v5e:4x8"),
    "v5e-64": (TPU_V5E, "v5e:8x8"),
    "v5e-256": (TPU_V5E, "v5e:16x16"),
    "v5p-8": (TPU_V5P, "v5p:2x2x1"),
    "v5p-16": (TPU_V5P, "v5p:2x2x2"),
    "v5p-64": (TPU_V5P, "v5p:2x4x4"),
    "v5p-128": (TPU_V5P, "v5p:4x4x4"),
    "v5p-256": (TPU_V5P, "v5p:4x4x8"),
    "v5p-512": (TPU_V5P, "v5p:4x8x8"),
    "v6e-1": (TPU_V6E, "v6e:1x1"),
    "v6e-4": (TPU_V6E, "v6e:2x2"),
    "v6e-8": (TPU_V6E, "v6e:2x4"),
    "v6e-16": (TPU_V6E, "v6e:4x4"),
    "v6e-256": (TPU_V6E, "v6e:16x16"),
}
_GPU_HOSTS = {"a100x8": (A100, 8), "h100x8": (H100, 8), "h200x8": (H200, 8), "h100x1": (H100, 1), "h200x1": (H200, 1)}


def _chips(topology: str) -> int:
    count = 1
    for size in topology.split(":")[1].split("x"):
        count *= int(size)
    return count


TARGETS: dict[str, Target] = {
    "local": Target("local", "local", None, 0),
    **{name: Target(name, "tpu", chip, _chips(topology), topology) for name, (chip, topology) in _TPU_SLICES.items()},
    **{name: Target(name, "gpu", chip, count) for name, (chip, count) in _GPU_HOSTS.items()},
}


def get_target(name: str) -> Target:
    """The target called `name` (a TPU slice's name + `xN`: N such slices); an unknown name is
    one sentence listing the valid ones."""
    base, _, count = name.rpartition("x")
    if name not in TARGETS and count.isdigit() and int(count) > 1 and TARGETS.get(base, TARGETS["local"]).topology:
        one = TARGETS[base]
        return dataclasses.replace(one, name=name, chips=one.chips * int(count), slices=int(count))
    if name not in TARGETS:
        raise ConfigError(
            f"--target: unknown target '{name}'; valid targets: {', '.join(TARGETS)}, "
            "or a TPU slice's name x N slices (v5p-256x2)"
        )
    return TARGETS[name]
