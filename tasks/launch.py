"""Launchers: how a stage runs the engine in child process(es), and the watching of them.

    local        one child process (the default)
    local-multi  N processes on this machine joined by jax.distributed (engine/parallel/distributed.py
                 reads TRAINFLOW_COORDINATOR / TRAINFLOW_NUM_PROCESSES / TRAINFLOW_PROCESS_ID)
    command      a template around the command, for clusters: "srun -N 2 {command}"

The parent streams the children's output line by line, tails a metrics.jsonl for
progress, forwards SIGTERM (the engine checkpoints and exits 143), and maps exit codes to
exceptions. Children die with their parent (Linux PR_SET_PDEATHSIG) even if the parent is
SIGKILLed: they get SIGTERM and save a checkpoint first. Meanwhile they still hold the
artifact's lock, whose descriptor every child inherits (`holding_locks`), so a new run
waits for an orphan to exit before it writes the same artifact.

Failures are classified for retries: StageFailed (a crash, a lost node) may pass on a
retry; StageConfigError (bad config or data), DiskFull and Diverged (a non-finite loss,
which a deterministic resume reaches again) would only repeat, and name what is at fault.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shlex
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
from typing import Any, Callable, Literal

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

    kind: Literal["local", "local-multi", "command"] = "local"
    processes: int = Field(1, gt=0)
    """local-multi: number of processes (each sees its own share of the devices)."""
    template: str | None = None
    """command: the command line with `{command}` where the engine command goes."""
    env: dict[str, str] = {}
    """Extra environment variables for the child processes."""

    @model_validator(mode="after")
    def _check(self) -> "LauncherSpec":
        if self.kind == "command" and (not self.template or "{command}" not in self.template):
            raise ValueError("launcher kind 'command' needs a template containing '{command}'")
        if self.kind == "local-multi" and self.processes < 2:
            raise ValueError("launcher kind 'local-multi' needs processes >= 2")
        return self

    @classmethod
    def parse(cls, value: "str | dict | LauncherSpec | None") -> "LauncherSpec":
        if value is None:
            return cls()
        if isinstance(value, LauncherSpec):
            return value
        return cls.model_validate({"kind": value} if isinstance(value, str) else value)


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


def commands(spec: LauncherSpec, argv: list[str]) -> list[tuple[list[str], dict[str, str]]]:
    """(argv, extra env) of each process the launcher starts for one engine command."""
    if spec.kind == "local":
        return [(argv, dict(spec.env))]
    if spec.kind == "command":
        assert spec.template is not None
        line = spec.template.replace("{command}", shlex.join(argv))
        return [(shlex.split(line), dict(spec.env))]
    coordinator = f"127.0.0.1:{_free_port()}"
    return [
        (argv, {**spec.env, "TRAINFLOW_COORDINATOR": coordinator,
                "TRAINFLOW_NUM_PROCESSES": str(spec.processes), "TRAINFLOW_PROCESS_ID": str(rank)})
        for rank in range(spec.processes)
    ]


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


def _pump(stream, log: Callable[[str], None], prefix: str, tail: deque, results: list) -> None:
    """Forward a child's output line by line (tqdm's carriage returns count as line ends)."""
    pending = ""
    for chunk in iter(lambda: stream.read1(65536) if hasattr(stream, "read1") else stream.read(65536), b""):
        pending += chunk.decode(errors="replace")
        *lines, pending = re.split(r"\r\n|\r|\n", pending)
        for line in lines:
            _emit(line, log, prefix, tail, results)
    if pending:
        _emit(pending, log, prefix, tail, results)


def _emit(line: str, log, prefix, tail, results) -> None:
    line = line.rstrip()
    if not line:
        return
    if line.startswith(RESULT_PREFIX):
        try:
            results.append(json.loads(line)["result"])
            return
        except (json.JSONDecodeError, KeyError, TypeError):
            pass
    tail.append(line)
    log(prefix + line)


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
    EDQUOT), StageConfigError (exit 2), Diverged (`error: non-finite loss ...`) or
    StageFailed (anything else non-zero); returns the ChildResult on exit 0.
    """
    launcher = launcher or LauncherSpec()
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    tail: deque[str] = deque(maxlen=20)
    results: list[dict] = []
    if _stopping.is_set():
        raise Interrupted(f"{what}: not started, the run is stopping")
    plan = commands(launcher, argv)
    # What is in the metrics file before the children start is an earlier attempt's: read it now,
    # or records a fast child writes before the first poll would count as already seen.
    watcher = MetricsTail(metrics_file, on_metrics) if metrics_file and on_metrics else None
    try:
        for rank, (child_argv, extra_env) in enumerate(plan):
            proc = subprocess.Popen(
                guarded(child_argv), cwd=cwd, env=child_env({**(env or {}), **extra_env}),
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                start_new_session=True,  # terminal signals go to trainflow, which forwards SIGTERM
                pass_fds=_held_fds.get(),  # the artifact's lock: held while this child lives
            )
            with _children_lock:
                _children.add(proc)
            procs.append(proc)
            prefix = f"[rank {rank}] " if len(plan) > 1 else ""
            for stream in (proc.stdout, proc.stderr):
                pump = threading.Thread(target=_pump, args=(stream, log, prefix, tail, results), daemon=True)
                pump.start()
                pumps.append(pump)
        codes: list[int | None] = [None] * len(procs)
        while any(c is None for c in codes):
            for i, proc in enumerate(procs):
                if codes[i] is None:
                    codes[i] = proc.poll()
            failed = [c for c in codes if c not in (None, 0)]
            if failed and any(c is None for c in codes):  # one rank died: stop the others
                for proc, code in zip(procs, codes):
                    if code is None:
                        _signal_group(proc, signal.SIGTERM)
            if watcher:
                watcher.poll()
            if any(c is None for c in codes):
                time.sleep(poll_seconds if watcher else 0.05)
        for pump in pumps:
            pump.join(timeout=10)
        if watcher:
            watcher.poll()
    finally:
        for proc in procs:
            if proc.poll() is None:  # the parent is unwinding (an exception): do not orphan
                _signal_group(proc, signal.SIGTERM)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    _signal_group(proc, signal.SIGKILL)
            with _children_lock:
                _children.discard(proc)
    code = next((c for c in codes if c != 0), 0)
    last = _summary_line(tail)
    if code == 0:
        return ChildResult(0, list(tail), results[0] if results else None)
    interrupted = f"{what}: stopped by SIGTERM (exit {code}); re-run to resume. {last}"
    if code in (EXIT_PREEMPTED, -signal.SIGTERM):  # a checkpoint was saved
        raise Interrupted(interrupted)
    disk_full = next((line for line in reversed(tail) if _DISK_FULL_TEXT.search(line)), None)
    if disk_full is not None:
        raise DiskFull(f"{what}: {disk_full.removeprefix('error: ')} (exit {code}); free space, then re-run")
    if code == EXIT_CONFIG_ERROR:
        raise StageConfigError(f"{what}: {last.removeprefix('error: ')}")
    if _stopping.is_set():
        raise Interrupted(interrupted)
    if _DIVERGED_TEXT.match(last):
        raise Diverged(f"{what}: {last.removeprefix('error: ')}")
    raise StageFailed(f"{what}: exited with code {code}: {last}")


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
