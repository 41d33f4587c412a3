"""A sandbox for model-written Python: a child process with CPU-time, wall-time, memory and
process limits, no network, its own temporary directory, killed on timeout.

The tool-calling environments (engine/posttrain/environments.py) run a model's code here.
The layers, each enforced by the kernel where it can be:

    limits     setrlimit in the child: RLIMIT_CPU (SIGXCPU, then SIGKILL), RLIMIT_AS (an
               allocation past it is a MemoryError), RLIMIT_NPROC (fork/thread creation fails
               past it), RLIMIT_FSIZE (files it writes), no core dumps.
    network    a new network namespace (unshare(CLONE_NEWNET); unprivileged users get it
               inside a new user namespace): no interface but a loopback that is down, so
               any connect, to 127.0.0.1 or elsewhere, and any DNS lookup fail. Where the
               kernel refuses namespaces, an audit hook (sys.addaudithook) refuses to create
               sockets or resolve names instead: that one lives inside the interpreter, so
               code that reaches C (ctypes) could get past it; `SandboxResult.isolation` says
               which of the two a run had.
    processes  a new PID namespace where the kernel allows it: the child's processes die
               with it, even one that left its process group. Otherwise the process group is
               killed. As root the code runs as `nobody` (root is exempt from RLIMIT_NPROC).
    files      the working directory is a fresh temporary directory, removed afterwards;
               the rest of the file system is read with the permissions of the user it
               runs as (no chroot).
    time       the parent waits `wall_seconds`, then kills the whole group (SIGKILL).

The bootstrap below runs first in a fresh `python -I` (one thread, no user code yet), so
nothing is done between fork and exec in the parent, which holds JAX's threads.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from pydantic import Field

from engine.config import Strict

NOBODY = 65534
STATE_FILE = ".sandbox.json"  # the bootstrap writes the isolation it got here


class SandboxLimits(Strict):
    """What one run of sandboxed code may use."""

    cpu_seconds: float = Field(2.0, gt=0)
    """CPU time of the code (RLIMIT_CPU, whole seconds, rounded up): past it the kernel kills it."""
    wall_seconds: float = Field(5.0, gt=0)
    """Wall-clock time: past it the process group is killed (a sleeping or blocked child too)."""
    memory_mb: int = Field(1024, gt=0)
    """Address space (RLIMIT_AS): an allocation past it raises MemoryError in the child."""
    max_processes: int = Field(16, gt=0)
    """Processes and threads (RLIMIT_NPROC): a fork past it fails (a fork bomb stops there)."""
    file_size_mb: int = Field(64, gt=0)
    """Largest file the code may write (RLIMIT_FSIZE)."""
    max_output_chars: int = Field(4000, gt=0)
    """stdout and stderr are each cut to this many characters (the rest is read and dropped)."""


# Runs as `python -I -c BOOTSTRAP LIMITS_JSON SCRIPT` in the sandbox's temporary directory.
BOOTSTRAP = r"""
import ctypes, json, os, resource, sys
limits = json.loads(sys.argv[1])
NEWUSER, NEWNET, NEWPID = 0x10000000, 0x40000000, 0x20000000
libc = ctypes.CDLL(None, use_errno=True)
root = os.geteuid() == 0
uid, gid = os.getuid(), os.getgid()
isolation = []
for flags, names in ([NEWNET | NEWPID, ["netns", "pidns"]], [NEWNET, ["netns"]]):
    if not root:
        flags |= NEWUSER
    if libc.unshare(flags) == 0:
        isolation = names
        if not root:  # map our own ids, the one mapping an unprivileged user may write
            for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)
        break
if root:
    os.chown(".", 65534, 65534)
with open(".sandbox.json", "w") as f:
    json.dump({"isolation": isolation or ["audit-hook"]}, f)

def wait_for(pid):
    status = os.waitpid(pid, 0)[1]
    return 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)

if "pidns" in isolation:
    # The next child is PID 1 of the namespace: it only reaps; its child runs the code. When
    # PID 1 exits the kernel kills whatever is left in the namespace.
    reaper = os.fork()
    if reaper:
        os._exit(wait_for(reaper))
    worker = os.fork()
    if worker:
        while True:
            try:
                pid, status = os.wait()
            except ChildProcessError:
                os._exit(0)
            if pid == worker:
                os._exit(128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))
if root:
    # Root ignores RLIMIT_NPROC and may write anywhere: become nobody, keeping one capability,
    # CAP_DAC_READ_SEARCH (read any file), since the interpreter may live where nobody cannot
    # read (/root/.pyenv). No new privileges after this (prctl NO_NEW_PRIVS).
    libc.prctl(8, 1, 0, 0, 0)  # PR_SET_KEEPCAPS: keep the permitted set across setuid
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)
    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
    class Sets(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]
    sets = (Sets * 2)()
    sets[0].effective = sets[0].permitted = 1 << 2  # CAP_DAC_READ_SEARCH
    if libc.capset(ctypes.byref(Header(0x20080522, 0)), sets) != 0:  # _LINUX_CAPABILITY_VERSION_3
        raise OSError(ctypes.get_errno(), "capset failed")
    libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
cpu = int(-(-limits["cpu_seconds"] // 1))
for name, value in (("RLIMIT_CPU", (cpu, cpu + 1)), ("RLIMIT_AS", limits["memory_mb"] << 20),
                    ("RLIMIT_NPROC", limits["max_processes"]), ("RLIMIT_FSIZE", limits["file_size_mb"] << 20),
                    ("RLIMIT_CORE", 0)):
    resource.setrlimit(getattr(resource, name), value if isinstance(value, tuple) else (value, value))
if "netns" not in isolation:
    BLOCKED = {"socket.__new__", "socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyname_ex",
               "socket.gethostbyaddr", "socket.getnameinfo", "socket.connect", "socket.bind"}
    def no_network(event, args):
        if event in BLOCKED:
            raise PermissionError("network access is disabled in the sandbox")
    sys.addaudithook(no_network)
del ctypes, libc
import runpy
sys.argv = [sys.argv[2]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@dataclass
class SandboxResult:
    """What a run left: its output (cut to max_output_chars), exit code, and why it failed."""

    stdout: str
    stderr: str
    exit_code: int | None
    error: str | None = None
    """None if the code exited 0; otherwise one sentence: the limit it hit or how it failed."""
    killed: bool = False
    """Killed by the sandbox (wall time) or the kernel (CPU time)."""
    seconds: float = 0.0
    isolation: list[str] = field(default_factory=list)
    """How the network was cut and processes were contained: netns (+ pidns), or audit-hook."""

    @property
    def ok(self) -> bool:
        return self.error is None

    def observation(self) -> str:
        """The text a model sees: its stdout, then the error (and the stderr tail) if it failed."""
        if self.ok:
            return self.stdout if self.stdout.strip() else "(no output)"
        tail = self.stderr.strip().splitlines()[-3:]
        return "\n".join(filter(None, [self.stdout.rstrip(), f"error: {self.error}", *tail]))


def _read_bounded(stdout: IO[bytes], stderr: IO[bytes], deadline: float, limit: int) -> tuple[str, str, bool]:
    """(stdout, stderr, timed out): read both pipes until EOF or the deadline, keeping the first
    `limit` bytes of each (a child that prints forever cannot fill the parent's memory)."""
    kept = {stdout.fileno(): bytearray(), stderr.fileno(): bytearray()}

    def texts() -> tuple[str, str]:
        return kept[stdout.fileno()].decode(errors="replace"), kept[stderr.fileno()].decode(errors="replace")

    with selectors.DefaultSelector() as sel:
        for fd in kept:
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                return *texts(), True
            for key, _ in sel.select(timeout=left):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                buffer = kept[key.fd]
                buffer += chunk[: max(limit - len(buffer), 0)]
    return *texts(), False


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _diagnose(result: SandboxResult, limits: SandboxLimits, timed_out: bool) -> str | None:
    """One sentence for a failed run: the limit it hit, else its exception's last line."""
    code, stderr = result.exit_code, result.stderr
    signalled = {-(code or 0), (code or 0) - 128}
    if timed_out:
        return f"the code ran past the wall-time limit of {limits.wall_seconds:g} s and was killed"
    if signal.SIGXCPU in signalled or (signal.SIGKILL in signalled and code != 0):
        return f"the code ran past the CPU-time limit of {limits.cpu_seconds:g} s and was killed"
    if "MemoryError" in stderr:
        return f"the code ran out of memory: the sandbox allows {limits.memory_mb} MB"
    if (
        "BlockingIOError" in stderr
        or "Resource temporarily unavailable" in stderr
        or "can't start new thread" in stderr
    ):
        return f"the code tried to start more than {limits.max_processes} processes or threads"
    network = ("Network is unreachable", "name resolution", "Name or service not known", "network access is disabled")
    if any(marker in stderr for marker in network):
        return "the code tried to use the network: the sandbox has none"
    if code == 0:
        return None
    last = next((line for line in reversed(stderr.strip().splitlines()) if line.strip()), "")
    return f"the code exited with status {code}" + (f": {last.strip()}" if last else "")


def run_python(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run `code` as a script in a fresh sandbox; never raises for anything the code does."""
    limits = limits or SandboxLimits()
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="trainflow-sandbox-") as tmp:
        Path(tmp, "main.py").write_text(code, encoding="utf-8")
        env = {"PATH": "/usr/bin:/bin", "HOME": tmp, "TMPDIR": tmp, "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"}
        env.update({k: "1" for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")})
        proc = subprocess.Popen(
            [sys.executable, "-I", "-c", BOOTSTRAP, limits.model_dump_json(), "main.py"],
            cwd=tmp,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # its own process group, killed as one
        )
        assert proc.stdout is not None and proc.stderr is not None
        try:
            stdout, stderr, timed_out = _read_bounded(
                proc.stdout, proc.stderr, start + limits.wall_seconds, limits.max_output_chars * 4
            )
            if timed_out:
                _kill_group(proc.pid)
            try:
                exit_code = proc.wait(timeout=max(start + limits.wall_seconds - time.monotonic(), 0.5))
            except subprocess.TimeoutExpired:  # output closed but the process lingers
                timed_out = True
                _kill_group(proc.pid)
                exit_code = proc.wait()
        finally:
            _kill_group(proc.pid)  # whatever it left behind in its group
            proc.stdout.close()
            proc.stderr.close()
        try:
            isolation = json.loads(Path(tmp, STATE_FILE).read_text())["isolation"]
        except (OSError, ValueError, KeyError):
            isolation = []
    cut = limits.max_output_chars
    result = SandboxResult(
        stdout[:cut], stderr[-cut:], exit_code, seconds=time.monotonic() - start, isolation=isolation
    )
    result.error = _diagnose(result, limits, timed_out)
    result.killed = result.error is not None and "killed" in result.error
    return result
