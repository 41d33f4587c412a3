"""Launchers: how a stage runs the engine in child process(es), and the watching of them.

    local        one child process (the default)
    local-multi  N processes on this machine joined by jax.distributed (engine/parallel/distributed.py
                 reads TRAINFLOW_COORDINATOR / TRAINFLOW_NUM_PROCESSES / TRAINFLOW_PROCESS_ID)
    ray          N workers gang-scheduled on a Ray cluster (a placement group), each running
                 one rank (tasks/ray_launcher.py, loaded only for this kind: Ray is an extra)
    slurm        one `srun` job step of N tasks; each task joins as one rank through JAX's own
                 Slurm detection (TRAINFLOW_CLUSTER=slurm)
    command      a template around the one engine command: "nice -n 10 {command}"

The ranks of one stage are a gang: when one fails, the others get SIGTERM and, if they are
still there GANG_GRACE_SECONDS later, SIGKILL (a rank blocked in a collective on the dead
one ignores SIGTERM, which JAX's coordination service owns in a multi-process run); the
error names the rank that failed first, how, and its last line. A rank that exits 143 was
stopped at the step all ranks agreed on: the others are left to save and exit too.

The parent streams the children's output line by line (`[rank N] ` before each line of a
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

import codecs
import errno
import importlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterator, Literal

from pydantic import Field, model_validator

from engine.config import ConfigError, Strict
from engine.contract import EXIT_CONFIG_ERROR, EXIT_PREEMPTED, RESULT_PREFIX



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


DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# How a disk-full error reads in a child's output: an OSError's text, or a C++ status
# (array_record: "write() failed: No space left on device; writing <path>").
_DISK_FULL_TEXT = re.compile("|".join(re.escape(os.strerror(code)) for code in DISK_FULL_ERRNOS), re.IGNORECASE)
_DIVERGED_TEXT = re.compile(r"^error: non-finite loss")


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
        "command": ("template",), "ray": ("address", "resources", "spread"), "slurm": ("nodes", "srun_args"),
        "local-multi": ("devices_per_process",)}

    @model_validator(mode="after")
    def _check(self) -> "LauncherSpec":
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
            raise ValueError(f"launcher kind '{self.kind}' runs one process; for {self.processes} use "
                             "'local-multi', 'ray' or 'slurm'")
        if self.kind == "ray" and not all(amount > 0 for amount in self.resources.values()):
            raise ValueError("launcher kind 'ray': resources must be positive amounts, e.g. {CPU: 1}")
        if self.kind == "slurm" and self.nodes is not None and self.nodes > self.processes:
            raise ValueError(f"launcher kind 'slurm': nodes ({self.nodes}) cannot exceed processes ({self.processes})")
        return self

    @classmethod
    def parse(cls, value: "str | dict | LauncherSpec | None") -> "LauncherSpec":
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


# --------------------------------------------------------------------------- locks held by children

# File descriptors of the artifact locks the current stage holds (tasks/runner.py). Every
# child started in this context inherits them: an flock belongs to the open file
# description, so the lock stays held until the runner *and* every child have closed it.
_held_fds: ContextVar[tuple[int, ...]] = ContextVar("held_lock_fds", default=())


@contextmanager
def holding_locks(*fds: int):
    """Children started inside this block (in this thread or context) keep `fds` open."""
    token = _held_fds.set(_held_fds.get() + fds)
    try:
        yield
    finally:
        _held_fds.reset(token)


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


# --------------------------------------------------------------------------- live children

_children: set[subprocess.Popen] = set()
_children_lock = threading.Lock()
_stopping = threading.Event()


def stopping() -> bool:
    """Whether the run was asked to stop (terminate_children was called)."""
    return _stopping.is_set()


def terminate_children(sig: int = signal.SIGTERM) -> int:
    """Send `sig` to every live child (the CLI's SIGTERM/SIGINT handler); returns how many."""
    _stopping.set()
    with _children_lock:
        children = list(_children)
    for child in children:
        try:
            os.killpg(child.pid, sig)  # each child leads its own process group
        except (ProcessLookupError, PermissionError):
            pass
    return len(children)


# Sets PR_SET_PDEATHSIG (survives exec) then becomes the real command. Runs before any
# import, so it costs a few milliseconds; elsewhere than Linux it just execs.
_GUARD = (
    "import os,sys\n"
    "try:\n"
    " import ctypes,signal;ctypes.CDLL(None,use_errno=True).prctl(1,signal.SIGTERM)\n"
    " if os.getppid()!=int(sys.argv[1]):os._exit(143)\n"
    "except (OSError,AttributeError):pass\n"
    "os.execvp(sys.argv[2],sys.argv[2:])\n"
)


def guarded(argv: list[str]) -> list[str]:
    """`argv`, run so that it gets SIGTERM when the thread that starts it exits (Linux)."""
    if not sys.platform.startswith("linux"):
        return argv
    return [sys.executable, "-c", _GUARD, str(os.getpid()), *argv]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The parent's environment with output unbuffered. Children run `sys.executable -m
    engine...`, which imports the installed package (a wheel, or an editable install of a
    checkout), so no PYTHONPATH is added."""
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def commands(spec: LauncherSpec, argv: list[str], *, gpu_count: int | None = None
             ) -> list[tuple[list[str], dict[str, str]]]:
    """(argv, extra env) of each process the launcher starts for one engine command.

    ray: one per rank, without TRAINFLOW_COORDINATOR, which names rank 0's node and is known
    only once the gang is placed (tasks/ray_launcher.py adds it)."""
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
        srun = ["srun", f"--nodes={spec.nodes or spec.processes}", f"--ntasks={spec.processes}",
                "--kill-on-bad-exit=1", "--label", "--verbose", *spec.srun_args]
        return [([*srun, *argv], {**spec.env, "TRAINFLOW_CLUSTER": "slurm"})]
    ranks = {"TRAINFLOW_NUM_PROCESSES": str(spec.processes)}
    devices: list[dict[str, str]] = [{}] * spec.processes
    if spec.kind == "local-multi":
        ranks["TRAINFLOW_COORDINATOR"] = f"127.0.0.1:{_free_port()}"
        devices = rank_devices(spec, gpu_count)
    return [(argv, {**spec.env, **ranks, **devices[rank], "TRAINFLOW_PROCESS_ID": str(rank)})
            for rank in range(spec.processes)]


def local_gpu_count() -> int:
    """NVIDIA GPUs on this host (their /dev/nvidiaN nodes), limited to CUDA_VISIBLE_DEVICES when
    it is set; no driver call, so the launcher itself never claims a GPU."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()])
    return len([p for p in Path("/dev").glob("nvidia*") if p.name[len("nvidia"):].isdigit()])


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
            raise StageConfigError(f"launcher local-multi: {gpus} GPUs do not split evenly over {spec.processes} "
                                   f"processes; set processes to a divisor of {gpus} or devices_per_process")
        per = gpus // spec.processes
    if gpus and per * spec.processes > gpus:
        raise StageConfigError(f"launcher local-multi: {spec.processes} processes x {per} devices need "
                               f"{per * spec.processes} GPUs; this host has {gpus}")
    return [{"JAX_LOCAL_DEVICE_IDS": ",".join(str(rank * per + i) for i in range(per))}
            for rank in range(spec.processes)]


# --------------------------------------------------------------------------- watching


@dataclass
class ChildResult:
    returncode: int
    stderr_tail: list[str]
    result: dict[str, Any] | None = None
    """The `{"result": {...}}` JSON line an engine entry point prints last, if any."""


@dataclass
class MetricsTail:
    """Follows a metrics.jsonl the engine appends to; reports records not seen before.

    A resumed engine first truncates the file to its checkpoint step, so records are
    keyed by (step, train|eval) against a high-water mark rather than by file offset.
    """

    path: Path
    on_record: Callable[[dict], None]
    _seen: dict[str, int] = field(default_factory=dict)
    _stamp: tuple = ()

    def __post_init__(self) -> None:
        for record in self._read():  # what a previous attempt logged is not news
            self._mark(record)

    def _read(self) -> list[dict]:
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            return []
        stamp = (stat.st_size, stat.st_mtime_ns)
        if stamp == self._stamp:
            return []
        self._stamp = stamp
        records = []
        for line in self.path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a line being written
        return records

    def _mark(self, record: dict) -> bool:
        key = "eval" if any(k.startswith("eval_") for k in record) else "train"
        step = int(record.get("step", 0))
        if step <= self._seen.get(key, -1):
            return False
        self._seen[key] = step
        return True

    def poll(self) -> None:
        for record in self._read():
            if self._mark(record):
                self.on_record(record)


# --------------------------------------------------------------------------- a gang's output

GANG_GRACE_SECONDS = 5.0
"""After one rank of a gang failed, how long the others get to exit on SIGTERM before SIGKILL."""
STOP_GRACE_SECONDS = 60.0
"""How long ranks get to save and exit, before SIGKILL, once one exited 143 (every rank stops
at the step they agreed on) or the parent is unwinding."""


def exit_description(code: int) -> str:
    """'exited with code 3', or 'was killed by SIGKILL' for a (Popen-style) negative code."""
    if code >= 0:
        return f"exited with code {code}"
    try:
        return f"was killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"was killed by signal {-code}"


def split_lines(stream) -> Iterator[str]:
    """A binary stream's lines as they arrive (tqdm's carriage returns count as line ends)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    pending = ""
    for chunk in iter(lambda: stream.read1(65536) if hasattr(stream, "read1") else stream.read(65536), b""):
        pending += decoder.decode(chunk)
        *lines, pending = re.split(r"\r\n|\r|\n", pending)
        yield from lines
    pending += decoder.decode(b"", final=True)
    if pending:
        yield pending


# `srun --label` puts the task's rank before each of its lines ("1: ..."); srun's own report of
# a failed task reads "srun: error: node7: task 1: Killed" or "...: tasks 0-1: Exited with exit code 2",
# and `--verbose` names the job step ("srun: launching StepId=5.0 on host node7, 1 tasks: 1").
_SRUN_LABEL = re.compile(r"^\s*(\d+): ?(.*)$")
_SRUN_TASK_FAILED = re.compile(r"^srun: error: \S+: tasks? (\d+)[-\d,]*: (.+)$")
_SRUN_STEP = re.compile(r"\bStepId=(\d+\.\d+)")
_SIGNAL_TEXTS = {signal.strsignal(sig): sig for sig in signal.Signals if signal.strsignal(sig)}


def _srun_exit_code(text: str) -> int | None:
    """The Popen-style code of srun's "Exited with exit code 2" (2) or "Killed" (-9)."""
    if match := re.match(r"Exited with exit code (\d+)", text):
        return int(match.group(1))
    sig = _SIGNAL_TEXTS.get(text.removesuffix(" (core dumped)"))
    return -sig if sig else None


class GangOutput:
    """Where a gang's output goes: the log (`[rank N] ` before each line when there are several
    ranks), a tail of each rank's lines for the error, and each rank's result line."""

    def __init__(self, log: Callable[[str], None], ranks: int, *, srun_labels: bool = False):
        self.log, self.srun_labels, self.prefixed = log, srun_labels, ranks > 1
        self.tails: list[deque[str]] = [deque(maxlen=20) for _ in range(ranks)]
        self.launcher_tail: deque[str] = deque(maxlen=20)
        """The launcher's own lines (srun's)."""
        self.results: dict[int, dict] = {}
        self.task_failures: list[tuple[int, int]] = []
        """slurm: (rank, Popen-style code) of each failed task, in the order srun reported them."""
        self.srun_step: str | None = None
        """slurm: JOBID.STEPID of the job step, once srun has named it."""
        self._srun_options = False

    def emit(self, rank: int, line: str) -> None:
        line = line.rstrip()
        if self.srun_labels:
            if not (labelled := _SRUN_LABEL.match(line)):
                self._srun_says(line)
                return
            rank, line = int(labelled.group(1)), labelled.group(2).rstrip()
        if not line:
            return
        if line.startswith(RESULT_PREFIX):
            try:
                self.results.setdefault(rank, json.loads(line)["result"])
                return
            except (json.JSONDecodeError, KeyError, TypeError):
                pass
        (self.tails[rank] if rank < len(self.tails) else self.launcher_tail).append(line)
        self.log(f"[rank {rank}] {line}" if self.prefixed else line)

    def _srun_says(self, line: str) -> None:
        """srun's own line: a failed task, the step's id; logged but for --verbose's list of options."""
        failed = _SRUN_TASK_FAILED.match(line)
        if failed and (code := _srun_exit_code(failed.group(2))) is not None:
            self.task_failures.append((int(failed.group(1)), code))
        if self.srun_step is None and (step := _SRUN_STEP.search(line)):
            self.srun_step = step.group(1)
        if line == "srun: defined options":
            self._srun_options = True
        if self._srun_options:
            self._srun_options = line != "srun: end of defined options"
        elif line:
            self.launcher_tail.append(line)
            self.log(line)

    def result(self) -> dict[str, Any] | None:
        """Rank 0's result line (every rank prints the same), else any rank's."""
        return self.results.get(0) or next(iter(self.results.values()), None)


def _pump(stream, output: GangOutput, rank: int) -> None:
    for line in split_lines(stream):
        output.emit(rank, line)


# --------------------------------------------------------------------------- a gang's processes


class Rank:
    """One process of a gang as run_child watches it: a child of this process, or a worker
    elsewhere (tasks/ray_launcher.py). One `srun` stands for all the tasks of its job step."""

    remote: ClassVar[bool] = False
    """Out of terminate_children's reach: run_child forwards a stop to it."""

    def poll(self) -> int | None:
        """The exit code (negative: killed by that signal), None while it runs."""
        raise NotImplementedError

    def signal(self, sig: int) -> None:
        raise NotImplementedError

    def describe(self, code: int) -> str:
        return exit_description(code)

    def finish(self) -> None:
        """Wait (briefly) for the output it has not delivered yet."""

    def close(self) -> None:
        """It has exited or been killed: forget it."""


class LocalRank(Rank):
    """A child process leading its own process group, its output read by two threads."""

    def __init__(self, argv: list[str], output: GangOutput, rank: int, *, cwd: Path | None, env: dict[str, str]):
        self.proc = subprocess.Popen(
            guarded(argv), cwd=cwd, env=child_env(env),
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True,  # terminal signals go to trainflow, which forwards SIGTERM
            pass_fds=_held_fds.get(),  # the artifact's lock: held while this child lives
        )
        if not self.remote:
            with _children_lock:
                _children.add(self.proc)
        self.pumps = [threading.Thread(target=_pump, args=(stream, output, rank), daemon=True)
                      for stream in (self.proc.stdout, self.proc.stderr)]
        for pump in self.pumps:
            pump.start()

    def poll(self) -> int | None:
        return self.proc.poll()

    def signal(self, sig: int) -> None:
        _signal_group(self.proc, sig)

    def finish(self) -> None:
        for pump in self.pumps:
            pump.join(timeout=10)

    def close(self) -> None:
        with _children_lock:
            _children.discard(self.proc)


class SrunRank(LocalRank):
    """`srun`, standing for every task of its job step. srun takes SIGTERM as "kill the step
    now", so a stop is `scancel --signal=TERM` of the step (the tasks save and exit 143), and a
    kill is SIGTERM to srun; terminate_children leaves it to run_child."""

    remote = True

    def __init__(self, argv: list[str], output: GangOutput, *, cwd: Path | None, env: dict[str, str]):
        super().__init__(argv, output, 0, cwd=cwd, env=env)
        self.output, self.env, self.kills = output, child_env(env), 0

    def signal(self, sig: int) -> None:
        step = self.output.srun_step
        if sig == signal.SIGTERM and step is not None:
            stop = subprocess.run(["scancel", "--signal=TERM", step], env=self.env, capture_output=True, timeout=30)
            if stop.returncode == 0:
                return
        if sig == signal.SIGKILL:  # the first: srun kills the step's tasks; then srun itself
            self.kills += 1
            sig = signal.SIGTERM if self.kills == 1 else signal.SIGKILL
        _signal_group(self.proc, sig)


def _ray_launcher():
    """tasks/ray_launcher.py, which imports Ray: an optional extra, loaded for `kind: ray` only."""
    if importlib.util.find_spec("ray") is None:
        raise StageConfigError("launcher kind 'ray' needs Ray on this machine: pip install 'trainflow[ray]'")
    return importlib.import_module("tasks.ray_launcher")


def _start(launcher: LauncherSpec, argv: list[str], output: GangOutput, *, cwd: Path | None,
           env: dict[str, str]) -> tuple[list[Rank], Callable[[], None]]:
    """Start the gang; its ranks and what tears it down once they have exited."""
    plan = commands(launcher, argv)
    if launcher.kind == "ray":
        return _ray_launcher().start(launcher, plan, output, cwd=cwd, env=env)
    if launcher.kind == "slurm":
        if shutil.which("srun") is None:
            raise StageConfigError("launcher kind 'slurm' needs `srun` on PATH: run trainflow on a Slurm login "
                                   "node or inside an allocation (salloc, sbatch)")
        ((srun, extra_env),) = plan
        return [SrunRank(srun, output, cwd=cwd, env={**env, **extra_env})], lambda: None
    ranks: list[Rank] = []
    try:
        for rank, (rank_argv, extra_env) in enumerate(plan):
            ranks.append(LocalRank(rank_argv, output, rank, cwd=cwd, env={**env, **extra_env}))
    except BaseException:
        _stop(ranks, grace=0)
        raise
    return ranks, lambda: None


def _watch(ranks: list[Rank], watcher: MetricsTail | None, poll_seconds: float) -> tuple[list[int | None], int | None]:
    """Wait for every rank; when one fails, stop the others. Returns the exit codes (None: a
    remote rank that could not be reached after SIGKILL) and the index of the rank that
    failed first (None if none did)."""
    codes: list[int | None] = [None] * len(ranks)
    first = deadline = None
    killed = forwarded = False
    next_metrics = 0.0
    while True:
        now = time.monotonic()
        failed = []
        for i, rank in enumerate(ranks):
            if codes[i] is None:
                codes[i] = rank.poll()
                if codes[i] not in (None, 0):
                    failed.append(i)
        if first is None and failed:
            # Ranks seen failing in the same poll: one killed by a signal other than SIGTERM, or
            # one that did not stop at an agreed step, is more likely the cause than the others.
            first = min(failed, key=lambda i: (codes[i] in (EXIT_PREEMPTED, -signal.SIGTERM), (codes[i] or 0) > 0, i))
        running = [rank for rank, code in zip(ranks, codes) if code is None]
        if not running:
            break
        if _stopping.is_set() and not forwarded:  # terminate_children signalled the local ones
            forwarded = True
            for rank in running:
                if rank.remote:
                    rank.signal(signal.SIGTERM)
        if first is not None:
            if deadline is None:
                preempted = codes[first] == EXIT_PREEMPTED  # the others stop at the same step: let them save
                if not preempted:
                    for rank in running:
                        rank.signal(signal.SIGTERM)
                deadline = now + (STOP_GRACE_SECONDS if preempted else GANG_GRACE_SECONDS)
            elif now >= deadline and not killed:
                killed = True
                for rank in running:
                    rank.signal(signal.SIGKILL)
            elif killed and now >= deadline + GANG_GRACE_SECONDS:
                break  # a remote rank that cannot be reached: the teardown removes its worker
        if watcher and now >= next_metrics:
            watcher.poll()
            next_metrics = now + poll_seconds
        time.sleep(0.05)
    return codes, first


def _stop(ranks: list[Rank], grace: float = STOP_GRACE_SECONDS) -> None:
    """SIGTERM to the ranks still running (the parent is unwinding: do not orphan them), then
    SIGKILL to those still there after `grace` seconds."""
    running = [rank for rank in ranks if rank.poll() is None]
    for rank in running:
        rank.signal(signal.SIGTERM if grace else signal.SIGKILL)
    deadline = time.monotonic() + grace
    while running and time.monotonic() < deadline:
        time.sleep(0.05)
        running = [rank for rank in running if rank.poll() is None]
    for rank in running:
        rank.signal(signal.SIGKILL)
    for rank in ranks:
        rank.close()


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
    if _stopping.is_set():
        raise Interrupted(f"{what}: not started, the run is stopping")
    ranks_in_output = launcher.processes if launcher.kind in ("local-multi", "ray", "slurm") else 1
    output = GangOutput(log, ranks_in_output, srun_labels=launcher.kind == "slurm")
    # What is in the metrics file before the children start is an earlier attempt's: read it now,
    # or records a fast child writes before the first poll would count as already seen.
    watcher = MetricsTail(metrics_file, on_metrics) if metrics_file and on_metrics else None
    ranks, teardown = _start(launcher, argv, output, cwd=cwd, env=env or {})
    try:
        codes, first = _watch(ranks, watcher, poll_seconds)
        for rank in ranks:
            rank.finish()
        if watcher:
            watcher.poll()
    finally:
        try:
            _stop(ranks)
        finally:
            teardown()
    if first is None:
        result = output.result()
        if result and isinstance(result.get("layout"), dict) and (layouts := _layouts.get()) is not None:
            layouts.append(result["layout"])
        return ChildResult(0, list(output.tails[0]), result)
    rank, code, how, tail = _cause(ranks, codes, first, output)
    last = _summary_line(tail)
    interrupted = f"{what}: stopped by SIGTERM (exit {code}); re-run to resume. {last}"
    if code in (EXIT_PREEMPTED, -signal.SIGTERM):  # a checkpoint was saved
        raise Interrupted(interrupted)
    # The failing rank's lines first, newest first; then the others' (the full disk may be theirs).
    lines = [*reversed(tail), *(line for other in (*output.tails, output.launcher_tail) for line in reversed(other))]
    disk_full = next((line for line in lines if _DISK_FULL_TEXT.search(line)), None)
    if disk_full is not None:
        raise DiskFull(f"{what}: {disk_full.removeprefix('error: ')} (exit {code}); free space, then re-run")
    if code == EXIT_CONFIG_ERROR:
        raise StageConfigError(f"{what}: {last.removeprefix('error: ')}")
    if _stopping.is_set():
        raise Interrupted(interrupted)
    if _DIVERGED_TEXT.match(last):
        raise Diverged(f"{what}: {last.removeprefix('error: ')}")
    stopped = "; the other ranks were stopped" if rank is not None and len(output.tails) > 1 else ""
    raise StageFailed(f"{what}: {how}: {last}{stopped}")


def _cause(ranks: list[Rank], codes: list[int | None], first: int,
           output: GangOutput) -> tuple[int | None, int, str, deque]:
    """(rank, exit code, how it ended, its output) of what ended a gang; rank None when
    there was one process (or an srun that failed before any task did)."""
    code = codes[first]
    assert code is not None
    if output.srun_labels:  # one srun: the task it reported failing first is the cause
        if output.task_failures:
            rank, code = output.task_failures[0]
            return rank, code, f"rank {rank} {exit_description(code)}", output.tails[rank]
        return None, code, f"srun {exit_description(code)}", output.launcher_tail or output.tails[0]
    if len(ranks) == 1:
        return None, code, ranks[0].describe(code), output.tails[0]
    return first, code, f"rank {first} {ranks[first].describe(code)}", output.tails[first]


_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b")


def _summary_line(tail: deque) -> str:
    """The line that best explains a failure: the engine's one-line `error: ...` message, the
    exception line of a traceback, else the last line. (stdout and stderr are read by two
    threads, so the last line need not be the last one written.)"""
    lines = list(tail)
    for pattern in (re.compile(r"^error: "), _EXCEPTION_LINE):
        for line in reversed(lines):
            if pattern.match(line):
                return line
    return lines[-1] if lines else "(no output)"


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
