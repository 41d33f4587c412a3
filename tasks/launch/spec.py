"""What every launcher shares: how a stage asks for its processes (LauncherSpec, a stage's
`launcher:`) and how a launch can fail (StageFailed and the permanent failures).

A leaf: tasks/launch/run.py (the local, local-multi, slurm and command launchers) and
tasks/launch/ray_launcher.py (loaded for `kind: ray` only) both import it, and neither imports the
other back; tasks.launch.run re-exports every name for the code that imports them from there.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from engine.config import ConfigError, Strict


class StageFailed(RuntimeError):
    """The child failed in a way a retry may fix (a crash, a lost node)."""


class StageConfigError(ConfigError):
    """The child rejected its config or input (exit 2): retrying cannot help."""


class Interrupted(RuntimeError):
    """The run was asked to stop (SIGTERM/SIGINT); the child checkpointed and exited."""


class PermanentFailure(RuntimeError):
    """A failure that a retry would only repeat; the message names the file or path at fault."""


class DiskFull(PermanentFailure):
    """No space left (ENOSPC) or over quota (EDQUOT) writing a path."""


class Diverged(PermanentFailure):
    """A non-finite loss. Resuming is bitwise deterministic, so a retry from the last
    checkpoint reaches the same step with the same loss."""


class LauncherSpec(Strict):
    """How a training stage starts its engine process(es)."""

    kind: Literal["local", "local-multi", "ray", "slurm", "command"] = "local"
    processes: int = Field(1, gt=0)
    """local-multi, ray, slurm: number of engine processes, each one rank of one JAX job."""
    template: str | None = None
    """command: the command line with `{command}` where the engine command goes."""
    env: dict[str, str] = {}
    """Extra environment variables for the child processes."""
    address: str | None = None
    """ray: the cluster to join: `auto` (the one `ray start` made this machine part of),
    `ray://HOST:10001` (Ray Client) or HOST:PORT (its GCS); unset: RAY_ADDRESS if set, else a
    Ray started on this machine for the run."""
    resources: dict[str, float] = {"CPU": 1}
    """ray: what each process reserves in the placement group: {CPU: 1}, {GPU: 1}, {CPU: 8, GPU: 1}."""
    spread: bool = False
    """ray: one process per node (placement strategy STRICT_SPREAD) instead of as few nodes as
    possible (PACK)."""
    nodes: int | None = Field(None, gt=0)
    """slurm: nodes of the job step (default: `processes`, one rank per node)."""
    srun_args: list[str] = []
    """slurm: more srun options, e.g. [--partition=gpu, --gpus-per-task=1, --time=2:00:00]."""
    devices_per_process: int | Literal["auto"] | None = "auto"
    """local-multi: accelerators each rank owns (rank r gets local devices r*k .. r*k+k-1, set
    through JAX_LOCAL_DEVICE_IDS, which jax.distributed reads). `auto`: the host's GPUs split
    evenly over the ranks, nothing on a host without GPUs (CPU ranks share the host)."""

    _KIND_FIELDS: ClassVar[dict[str, tuple[str, ...]]] = {
        "command": ("template",),
        "ray": ("address", "resources", "spread"),
        "slurm": ("nodes", "srun_args"),
        "local-multi": ("devices_per_process",),
    }

    @model_validator(mode="after")
    def _check(self) -> LauncherSpec:
        for kind, names in self._KIND_FIELDS.items():
            for name in names:
                if self.kind != kind and name in self.model_fields_set:
                    raise ValueError(f"key '{name}' applies to launcher kind '{kind}', not '{self.kind}'")
        if self.kind == "command" and (not self.template or "{command}" not in self.template):
            raise ValueError("launcher kind 'command' needs a template containing '{command}'")
        if self.kind == "local-multi" and self.processes < 2:
            raise ValueError("launcher kind 'local-multi' needs processes >= 2")
        if isinstance(self.devices_per_process, int) and self.devices_per_process < 1:
            raise ValueError("launcher kind 'local-multi': devices_per_process must be >= 1 (or auto)")
        if self.kind in ("local", "command") and self.processes != 1:
            raise ValueError(
                f"launcher kind '{self.kind}' runs one process; for {self.processes} use "
                "'local-multi', 'ray' or 'slurm'"
            )
        if self.kind == "ray" and not all(amount > 0 for amount in self.resources.values()):
            raise ValueError("launcher kind 'ray': resources must be positive amounts, e.g. {CPU: 1}")
        if self.kind == "slurm" and self.nodes is not None and self.nodes > self.processes:
            raise ValueError(f"launcher kind 'slurm': nodes ({self.nodes}) cannot exceed processes ({self.processes})")
        return self

    @classmethod
    def parse(cls, value: str | dict | LauncherSpec | None) -> LauncherSpec:
        if value is None:
            return cls()
        if isinstance(value, LauncherSpec):
            return value
        return cls.model_validate({"kind": value} if isinstance(value, str) else value)

    def provenance(self) -> dict[str, Any]:
        """What the manifest records of the launch: the kind, the process count and the kind's
        own settings (not `env`, which may hold secrets: only its names)."""
        record: dict[str, Any] = {"kind": self.kind, "processes": self.processes}
        for name in self._KIND_FIELDS.get(self.kind, ()):
            value = getattr(self, name)
            if value not in (None, [], {}, "auto"):
                record[name] = value
        if self.env:
            record["env"] = sorted(self.env)
        return record
