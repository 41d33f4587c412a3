"""A stage's engine processes as one gang: starting them, streaming their output, watching them.

A launcher (tasks/launch/run.py) turns one engine command into ranks; this module runs them:

- `LocalRank` / `SrunRank` (and tasks/launch/ray_launcher.py's remote ranks) behind one `Rank`
  interface: poll, signal, finish, close. Local children get PR_SET_PDEATHSIG (`guarded`),
  lead their own process group, inherit the artifact's lock descriptors (`holding_locks`) and
  are registered so that `terminate_children` (the CLI's signal handler) reaches them.
- `GangOutput`: every rank's lines, prefixed `[rank N] ` in a gang, the last lines of each
  kept for the error, and the engine's result line.
- `watch`: waits for the ranks; when one fails, the others get SIGTERM and, GANG_GRACE_SECONDS
  later, SIGKILL. A rank that exits 143 stopped at the step all ranks agreed on: the others
  are given STOP_GRACE_SECONDS to save and exit too.
- `cause` / `summary_line`: which rank ended the gang, how, and the line that explains it.
"""

from __future__ import annotations

import codecs
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from engine.contract import EXIT_PREEMPTED, RESULT_PREFIX
from engine.tpu_probe import drop_quiet_tpu_env

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


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The parent's environment with output unbuffered. Children run `sys.executable -m
    engine...`, which imports the installed package (a wheel, or an editable install of a
    checkout), so no PYTHONPATH is added. What this process set to quiet libtpu's TPU probe
    is left out: the child may run on another host and decides for itself."""
    env = dict(os.environ)
    drop_quiet_tpu_env(env)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


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
    elsewhere (tasks/launch/ray_launcher.py). One `srun` stands for all the tasks of its job step."""

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
            guarded(argv),
            cwd=cwd,
            env=child_env(env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # terminal signals go to trainflow, which forwards SIGTERM
            pass_fds=_held_fds.get(),  # the artifact's lock: held while this child lives
        )
        if not self.remote:
            with _children_lock:
                _children.add(self.proc)
        self.pumps = [
            threading.Thread(target=_pump, args=(stream, output, rank), daemon=True)
            for stream in (self.proc.stdout, self.proc.stderr)
        ]
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


def watch(ranks: list[Rank], watcher: MetricsTail | None, poll_seconds: float) -> tuple[list[int | None], int | None]:
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


def stop(ranks: list[Rank], grace: float = STOP_GRACE_SECONDS) -> None:
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


def cause(
    ranks: list[Rank], codes: list[int | None], first: int, output: GangOutput
) -> tuple[int | None, int, str, deque]:
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


def summary_line(tail: deque) -> str:
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
