"""Launchers: how a stage runs the engine in child process(es), and what their ending means.

    local        one child process (the default)
    local-multi  N processes on this machine joined by jax.distributed (engine/parallel/distributed.py
                 reads TRAINFLOW_COORDINATOR / TRAINFLOW_NUM_PROCESSES / TRAINFLOW_PROCESS_ID)
    ray          N workers gang-scheduled on a Ray cluster (a placement group), each running
                 one rank (tasks/launch/ray_launcher.py, loaded only for this kind: Ray is an extra)
    slurm        one `srun` job step of N tasks; each task joins as one rank through JAX's own
                 Slurm detection (TRAINFLOW_CLUSTER=slurm)
    command      a template around the one engine command: "nice -n 10 {command}"

The ranks of one stage are a gang (tasks/launch/gang.py): when one fails, the others get SIGTERM
and, if they are still there GANG_GRACE_SECONDS later, SIGKILL (a rank blocked in a
collective on the dead one ignores SIGTERM, which JAX's coordination service owns in a
multi-process run); the error names the rank that failed first, how, and its last line. A
rank that exits 143 was stopped at the step all ranks agreed on: the others are left to save
and exit too.

`run_child` streams the children's output line by line (`[rank N] ` before each line of a
gang), tails a metrics.jsonl for progress, forwards SIGTERM (the engine checkpoints and
exits 143), and maps exit codes to exceptions. Children die with their parent (Linux
PR_SET_PDEATHSIG) even if the parent is SIGKILLed: they get SIGTERM and save a checkpoint
first. Meanwhile they still hold the artifact's lock, whose descriptor every child inherits
(`holding_locks`), so a new run waits for an orphan to exit before it writes the same artifact.

Failures are classified for retries: StageFailed (a crash, a lost node) may pass on a
retry; StageConfigError (bad config or data), DiskFull and Diverged (a non-finite loss,
which a deterministic resume reaches again) would only repeat, and name what is at fault.
"""

from __future__ import annotations

import errno
import importlib.util
import os
import re
import shlex
import shutil
import signal
import socket
from collections.abc import Callable
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path

from engine.contract import EXIT_CONFIG_ERROR, EXIT_PREEMPTED
from tasks.launch import gang
from tasks.launch.gang import ChildResult, GangOutput, LocalRank, MetricsTail, Rank, SrunRank

# Re-exported: callers import the launcher's spec and failures from here.
from tasks.launch.spec import (  # noqa: F401
    DiskFull,
    Diverged,
    Interrupted,
    LauncherSpec,
    PermanentFailure,
    StageConfigError,
    StageFailed,
)

DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# How a disk-full error reads in a child's output: an OSError's text, or a C++ status
# (array_record: "write() failed: No space left on device; writing <path>").
_DISK_FULL_TEXT = re.compile("|".join(re.escape(os.strerror(code)) for code in DISK_FULL_ERRNOS), re.IGNORECASE)
_DIVERGED_TEXT = re.compile(r"^error: non-finite loss")


# Device layouts ({processes, devices, mesh}) that the engines started in this context reported
# in their result line; tasks/runner.py records them in the manifest.
_layouts: ContextVar[list[dict] | None] = ContextVar("reported_layouts", default=None)


@contextmanager
def recording_layouts():
    """Yields the list of the layouts reported by the engines started inside this block."""
    layouts: list[dict] = []
    token = _layouts.set(layouts)
    try:
        yield layouts
    finally:
        _layouts.reset(token)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def commands(
    spec: LauncherSpec, argv: list[str], *, gpu_count: int | None = None
) -> list[tuple[list[str], dict[str, str]]]:
    """(argv, extra env) of each process the launcher starts for one engine command.

    ray: one per rank, without TRAINFLOW_COORDINATOR, which names rank 0's node and is known
    only once the gang is placed (tasks/launch/ray_launcher.py adds it)."""
    if spec.kind == "local":
        return [(argv, dict(spec.env))]
    if spec.kind == "command":
        assert spec.template is not None
        line = spec.template.replace("{command}", shlex.join(argv))
        return [(shlex.split(line), dict(spec.env))]
    if spec.kind == "slurm":
        # One job step; --kill-on-bad-exit ends it when a task fails, --label prefixes each line
        # with the task's rank ("1: ..."), which is how run_child tells the ranks apart;
        # --verbose names the step, which run_child stops with scancel.
        srun = [
            "srun",
            f"--nodes={spec.nodes or spec.processes}",
            f"--ntasks={spec.processes}",
            "--kill-on-bad-exit=1",
            "--label",
            "--verbose",
            *spec.srun_args,
        ]
        return [([*srun, *argv], {**spec.env, "TRAINFLOW_CLUSTER": "slurm"})]
    ranks = {"TRAINFLOW_NUM_PROCESSES": str(spec.processes)}
    devices: list[dict[str, str]] = [{}] * spec.processes
    if spec.kind == "local-multi":
        ranks["TRAINFLOW_COORDINATOR"] = f"127.0.0.1:{_free_port()}"
        devices = rank_devices(spec, gpu_count)
    return [
        (argv, {**spec.env, **ranks, **devices[rank], "TRAINFLOW_PROCESS_ID": str(rank)})
        for rank in range(spec.processes)
    ]


def local_gpu_count() -> int:
    """NVIDIA GPUs on this host (their /dev/nvidiaN nodes), limited to CUDA_VISIBLE_DEVICES when
    it is set; no driver call, so the launcher itself never claims a GPU."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()])
    return len([p for p in Path("/dev").glob("nvidia*") if p.name[len("nvidia") :].isdigit()])


def rank_devices(spec: LauncherSpec, gpu_count: int | None = None) -> list[dict[str, str]]:
    """The environment that gives each local-multi rank its own accelerators: rank r owns
    local devices r*k .. r*k+k-1 (JAX_LOCAL_DEVICE_IDS, read by jax.distributed.initialize,
    which then sets the CUDA/ROCm visible devices of that process)."""
    per = spec.devices_per_process
    if per is None:
        return [{} for _ in range(spec.processes)]
    gpus = local_gpu_count() if gpu_count is None else gpu_count
    if per == "auto":
        if gpus == 0:
            return [{} for _ in range(spec.processes)]
        if gpus % spec.processes:
            raise StageConfigError(
                f"launcher local-multi: {gpus} GPUs do not split evenly over {spec.processes} "
                f"processes; set processes to a divisor of {gpus} or devices_per_process"
            )
        per = gpus // spec.processes
    if gpus and per * spec.processes > gpus:
        raise StageConfigError(
            f"launcher local-multi: {spec.processes} processes x {per} devices need "
            f"{per * spec.processes} GPUs; this host has {gpus}"
        )
    return [
        {"JAX_LOCAL_DEVICE_IDS": ",".join(str(rank * per + i) for i in range(per))} for rank in range(spec.processes)
    ]


def _ray_launcher():
    """tasks/launch/ray_launcher.py, which imports Ray: an optional extra, loaded for `kind: ray` only."""
    if importlib.util.find_spec("ray") is None:
        raise StageConfigError("launcher kind 'ray' needs Ray on this machine: pip install 'trainflow[ray]'")
    import tasks.launch.ray_launcher as ray_launcher  # here, not at the top: Ray is an optional extra

    return ray_launcher


def _start(
    launcher: LauncherSpec, argv: list[str], output: GangOutput, *, cwd: Path | None, env: dict[str, str]
) -> tuple[list[Rank], Callable[[], None]]:
    """Start the gang; its ranks and what tears it down once they have exited."""
    plan = commands(launcher, argv)
    if launcher.kind == "ray":
        return _ray_launcher().start(launcher, plan, output, cwd=cwd, env=env)
    if launcher.kind == "slurm":
        if shutil.which("srun") is None:
            raise StageConfigError(
                "launcher kind 'slurm' needs `srun` on PATH: run trainflow on a Slurm login "
                "node or inside an allocation (salloc, sbatch)"
            )
        ((srun, extra_env),) = plan
        return [SrunRank(srun, output, cwd=cwd, env={**env, **extra_env})], lambda: None
    ranks: list[Rank] = []
    try:
        for rank, (rank_argv, extra_env) in enumerate(plan):
            ranks.append(LocalRank(rank_argv, output, rank, cwd=cwd, env={**env, **extra_env}))
    except BaseException:
        gang.stop(ranks, grace=0)
        raise
    return ranks, lambda: None


# --------------------------------------------------------------------------- running a command


def run_child(
    argv: list[str],
    *,
    launcher: LauncherSpec | None = None,
    log: Callable[[str], None] = print,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    metrics_file: Path | None = None,
    on_metrics: Callable[[dict], None] | None = None,
    poll_seconds: float = 1.0,
    what: str = "child",
) -> ChildResult:
    """Run an engine command through `launcher`, stream its output, wait for it.

    Raises Interrupted (exit 143 or asked to stop), DiskFull (the output says ENOSPC or
    EDQUOT), StageConfigError (exit 2, or a launcher that cannot start here), Diverged
    (`error: non-finite loss ...`) or StageFailed (anything else non-zero; for a gang, naming
    the rank that failed first); returns the ChildResult on exit 0.
    """
    launcher = launcher or LauncherSpec()
    if gang.stopping():
        raise Interrupted(f"{what}: not started, the run is stopping")
    ranks_in_output = launcher.processes if launcher.kind in ("local-multi", "ray", "slurm") else 1
    output = GangOutput(log, ranks_in_output, srun_labels=launcher.kind == "slurm")
    # What is in the metrics file before the children start is an earlier attempt's: read it now,
    # or records a fast child writes before the first poll would count as already seen.
    watcher = MetricsTail(metrics_file, on_metrics) if metrics_file and on_metrics else None
    ranks, teardown = _start(launcher, argv, output, cwd=cwd, env=env or {})
    try:
        codes, first = gang.watch(ranks, watcher, poll_seconds)
        for started in ranks:
            started.finish()
        if watcher:
            watcher.poll()
    finally:
        try:
            gang.stop(ranks)
        finally:
            teardown()
    if first is None:
        result = output.result()
        if result and isinstance(result.get("layout"), dict) and (layouts := _layouts.get()) is not None:
            layouts.append(result["layout"])
        return ChildResult(0, list(output.tails[0]), result)
    rank, code, how, tail = gang.cause(ranks, codes, first, output)
    last = gang.summary_line(tail)
    # The engine stops on SIGTERM however the run was asked to stop (trainflow forwards Ctrl-C
    # as SIGTERM; a preemption sends it directly) and exits 143 once its checkpoint is saved.
    interrupted = f"{what}: stopped by SIGTERM after saving a checkpoint (exit {code}); re-run to resume. {last}"
    if code in (EXIT_PREEMPTED, -signal.SIGTERM):  # a checkpoint was saved
        raise Interrupted(interrupted)
    # The failing rank's lines first, newest first; then the others' (the full disk may be theirs).
    lines = [*reversed(tail), *(line for other in (*output.tails, output.launcher_tail) for line in reversed(other))]
    disk_full = next((line for line in lines if _DISK_FULL_TEXT.search(line)), None)
    if disk_full is not None:
        raise DiskFull(f"{what}: {disk_full.removeprefix('error: ')} (exit {code}); free space, then re-run")
    if code == EXIT_CONFIG_ERROR:
        raise StageConfigError(f"{what}: {last.removeprefix('error: ')}")
    if gang.stopping():
        raise Interrupted(interrupted)
    if _DIVERGED_TEXT.match(last):
        raise Diverged(f"{what}: {last.removeprefix('error: ')}")
    stopped = "; the other ranks were stopped" if rank is not None and len(output.tails) > 1 else ""
    raise StageFailed(f"{what}: {how}: {last}{stopped}")
