"""Runs of more than one process: joining them, and moving arrays between host and mesh.

A launcher (tasks/launch.py) starts N processes with TRAINFLOW_COORDINATOR,
TRAINFLOW_NUM_PROCESSES and TRAINFLOW_PROCESS_ID set; each joins with
`maybe_initialize_distributed()` before JAX starts its backend.
"""

from __future__ import annotations

import os

import jax
import numpy as np
from jax.experimental import multihost_utils


def maybe_initialize_distributed() -> None:
    """Join a multi-process run when the launcher set TRAINFLOW_COORDINATOR etc."""
    if "TRAINFLOW_COORDINATOR" not in os.environ:
        return
    # Must precede backend start-up; only the CPU client reads it.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=os.environ["TRAINFLOW_COORDINATOR"],
        num_processes=int(os.environ["TRAINFLOW_NUM_PROCESSES"]),
        process_id=int(os.environ["TRAINFLOW_PROCESS_ID"]),
    )


def gather_to_host(x) -> np.ndarray:
    """A global array as a host numpy array on every process."""
    if jax.process_count() == 1:
        return np.asarray(jax.device_get(x))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def process_rows(rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """This process's contiguous share of rows every process holds in full (e.g. a rollout)."""
    return {k: np.array_split(v, jax.process_count())[jax.process_index()] for k, v in rows.items()}
