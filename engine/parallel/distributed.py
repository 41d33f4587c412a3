"""Runs of more than one process: joining them, and agreeing on when to stop.

A launcher (tasks/launch.py) starts N processes with TRAINFLOW_COORDINATOR,
TRAINFLOW_NUM_PROCESSES and TRAINFLOW_PROCESS_ID set; each joins with
`maybe_initialize_distributed()` before JAX starts its backend.
"""

from __future__ import annotations

import os

import jax
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


def preemption_agreed(step: int, local_flag: bool) -> bool:
    """Whether the run stops (saving a checkpoint) after `step`.

    One process: the local SIGTERM flag. Several: JAX's preemption sync point, so that every
    rank stops at the same step whenever each one got its SIGTERM (the coordination service
    catches SIGTERM on any rank and agrees on the step after the latest one reached).
    """
    if jax.process_count() == 1:
        return local_flag
    return multihost_utils.reached_preemption_sync_point(step)
