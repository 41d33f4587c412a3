"""Whether a TPU is attached to this host, and a quiet TPU probe where none is.

With libtpu installed (the `tpu` and `test` extras) JAX tries the TPU backend in every process,
and `trainflow plan` loads libtpu to compile for a slice's topology. On a host that is not a TPU
VM, libtpu asks the VM's metadata for the slice's host bounds and worker hostnames, finds none,
and prints its guesses: "Failed to find host bounds for accelerator type: WARNING: could not
determine TPU accelerator type ..." and "E0000 ... INVALID_ARGUMENT: Error: unexpected worker
hostname ...", a few lines per process. Where no TPU is attached, the engine answers those two
questions as a single host would (`QUIET_TPU_ENV`) before JAX starts: the probe then fails as
quietly as it fails anyway (JAX takes the CPU, as before) and a topology compiles to the same
program (the tiny model's optimized HLO for v5e-1, v5e-16 and v5p-8 is identical either way).

Left alone: a host with a TPU (or what may be one: an accelerator device node, a VFIO group, a
PCI device of Google's), a process whose environment already describes a slice (`SLICE_ENV`),
and errors that matter: `JAX_PLATFORMS=tpu` on a host without one still fails, loudly.

`engine/__init__.py` calls `quiet_tpu_probe()`, so every process that imports the engine
(the CLI, each engine child) decides for its own host before it imports jax; a child is
started without what its parent set (`drop_quiet_tpu_env`), so it decides again where it runs.
No jax import here.
"""

from __future__ import annotations

import glob
import os
from collections.abc import MutableMapping
from pathlib import Path

QUIET_TPU_ENV = {"TPU_HOST_BOUNDS": "1,1,1", "TPU_WORKER_HOSTNAMES": "localhost"}
"""libtpu's two metadata questions, answered as for one host."""
SLICE_ENV = (*QUIET_TPU_ENV, "TPU_ACCELERATOR_TYPE", "TPU_WORKER_ID", "TPU_CHIPS_PER_HOST_BOUNDS")
"""Variables by which a user describes a slice to libtpu: where any is set, nothing is changed."""
GOOGLE_PCI_VENDOR = "0x1ae0"
MARK = "TRAINFLOW_QUIET_TPU_ENV"
"""Names the variables this process set, so that children can be started without them."""


def tpu_attached() -> bool:
    """Whether this host has (or may have) a TPU: accelerator device nodes (/dev/accel*: v2-v4,
    v5p), VFIO groups (/dev/vfio/N: v5e, v6e) or any PCI device of Google's (JAX's own probe,
    jax._src.hardware_utils, counts known TPU device ids of that vendor; any is more cautious)."""
    if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"):
        return True
    for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
        try:
            if Path(vendor).read_text().strip() == GOOGLE_PCI_VENDOR:
                return True
        except OSError:
            continue
    return False


def quiet_tpu_probe(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Set QUIET_TPU_ENV in `environ` where no TPU is attached and no SLICE_ENV variable is
    set; returns what it set (and records the names under MARK)."""
    if any(name in environ for name in SLICE_ENV) or tpu_attached():
        return {}
    environ.update(QUIET_TPU_ENV)
    environ[MARK] = ",".join(QUIET_TPU_ENV)
    return dict(QUIET_TPU_ENV)


def drop_quiet_tpu_env(environ: MutableMapping[str, str]) -> None:
    """Remove from `environ` (a child's, copied from this process) what quiet_tpu_probe set here:
    the child may run on another host (srun, a Ray worker) and decides for itself."""
    for name in environ.pop(MARK, "").split(","):
        if name:
            environ.pop(name, None)
