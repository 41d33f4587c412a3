"""Runs of more than one process: joining them, and agreeing on when to stop.

A launcher (tasks/launch/run.py) starts N processes that each join with
`maybe_initialize_distributed()` before JAX starts its backend, told how by either

    TRAINFLOW_COORDINATOR (host:port of rank 0), TRAINFLOW_NUM_PROCESSES, TRAINFLOW_PROCESS_ID
        set explicitly (the local-multi and ray launchers), or
    TRAINFLOW_CLUSTER=slurm
        inside one `srun` job step: JAX's own Slurm detection reads SLURM_PROCID, SLURM_NTASKS
        and the step's first node (the coordinator; port from the job id, or
        JAX_COORDINATOR_PORT).
    TRAINFLOW_CLUSTER=auto
        whatever jax.distributed.initialize() detects by itself: every worker of a Cloud TPU
        VM slice running the same command, Open MPI, a Kubernetes JobSet, ...
"""

from __future__ import annotations

import os

import jax
from jax.experimental import multihost_utils

from engine.config import ConfigError


def maybe_initialize_distributed() -> None:
    """Join a multi-process run when a launcher set TRAINFLOW_COORDINATOR or TRAINFLOW_CLUSTER."""
    explicit = "TRAINFLOW_COORDINATOR" in os.environ
    cluster = os.environ.get("TRAINFLOW_CLUSTER")
    if not explicit and cluster is None:
        return
    # Must precede backend start-up; only the CPU client reads it.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if explicit:
        coordinator = os.environ["TRAINFLOW_COORDINATOR"]
        jax.distributed.initialize(
            coordinator_address=coordinator,
            num_processes=int(os.environ["TRAINFLOW_NUM_PROCESSES"]),
            process_id=int(os.environ["TRAINFLOW_PROCESS_ID"]),
            # Rank 0 serves on the address it was given, not on every interface ([::]).
            coordinator_bind_address=os.environ.get("JAX_COORDINATOR_BIND_ADDRESS", coordinator),
        )
    elif cluster == "slurm":
        if "SLURM_PROCID" not in os.environ:
            raise ConfigError(
                "TRAINFLOW_CLUSTER=slurm, but this process is not a Slurm task (no SLURM_PROCID); start it with srun"
            )
        # JAX_COORDINATOR_PORT and JAX_COORDINATOR_BIND_ADDRESS, when set, are JAX's own overrides.
        jax.distributed.initialize(cluster_detection_method="slurm")
    elif cluster == "auto":
        # Whatever JAX detects: a Cloud TPU VM slice (every worker runs the same command),
        # Slurm, Open MPI, Kubernetes (JobSet / Indexed Job), ...
        jax.distributed.initialize()
    else:
        raise ConfigError(f"TRAINFLOW_CLUSTER={cluster!r} is not a cluster this engine joins; valid: slurm, auto")


def preemption_agreed(step: int, local_flag: bool) -> bool:
    """Whether the run stops (saving a checkpoint) after `step`.

    One process: the local SIGTERM flag. Several: JAX's preemption sync point, so that every
    rank stops at the same step whenever each one got its SIGTERM (the coordination service
    catches SIGTERM on any rank and agrees on the step after the latest one reached).
    """
    if jax.process_count() == 1:
        return local_flag
    return multihost_utils.reached_preemption_sync_point(step)
