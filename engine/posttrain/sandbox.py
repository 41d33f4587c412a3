"""A sandbox for model-written Python: `run_python(code, SandboxLimits)` runs the code in a
child process that sees nothing of the host, under limits on its whole process tree, and
reports how it failed in one sentence; it never raises for anything the code does.

The tool-calling environments (engine/posttrain/environments.py) run a model's code here.
Two isolations, chosen by `SandboxLimits.isolation`:

    bubblewrap  (the default) an existing isolation tool, bubblewrap (engine/posttrain/
                bubblewrap.py): its own mount, PID, network, IPC and UTS namespaces, a
                read-only view of the interpreter and the whitelisted modules only, a
                private tmpfs as working directory and /tmp, no capabilities, no_new_privs,
                a seccomp filter (engine/posttrain/seccomp.py), the code as an unprivileged
                user of its own. A missing or refused bwrap is a SandboxUnavailable error
                naming the package, never a silent fallback.
    namespaces  the weaker mode, only when a config asks for it: network and PID namespaces
                where the kernel allows them (an in-interpreter audit hook where it does
                not), the code as `nobody`, but the host's file system stays readable (as
                root the code keeps CAP_DAC_READ_SEARCH, because the interpreter may live
                where nobody cannot read). `SandboxResult.isolation` says what a run had.

Limits, set by the bootstrap before any of the code runs and inherited by every process it
starts (rlimits; the machines' cgroups are v1 or not delegated, so there is no cgroup-wide
accounting): CPU seconds and address space per process, processes and threads (RLIMIT_NPROC),
file size, open files, no core dumps. The parent kills the whole run at the wall-time limit
and as soon as stdout or stderr passes `max_output_bytes` (the process group; in bubblewrap
the PID namespace dies with bwrap).

The bootstraps run first in a fresh `python -I` (one thread, no user code yet), so nothing
is done between fork and exec in the parent, which holds JAX's threads.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Literal

from pydantic import Field, field_validator

from engine.config import Strict
from engine.posttrain import bubblewrap
from engine.posttrain.bubblewrap import SandboxUnavailable as SandboxUnavailable  # re-exported
from engine.posttrain.seccomp import seccomp_program

NOBODY = 65534
STATE_FILE = ".sandbox.json"  # the namespaces bootstrap writes the isolation it got here

# How a tool call can fail, the names of its `env/tool_failures/<kind>` metric.
FAILURE_KINDS = (
    "wall_time",  # ran (or slept, or hung) past wall_seconds: killed
    "cpu_time",  # a process used cpu_seconds of CPU: killed by the kernel
    "memory",  # an allocation past memory_mb failed
    "processes",  # a fork or thread past max_processes failed
    "file_size",  # a write past file_size_mb (or scratch_mb) failed
    "output",  # printed past max_output_bytes: killed
    "network",  # tried the network, which the sandbox does not have
    "crash",  # the interpreter died of a signal (SIGSEGV, SIGABRT ...)
    "error",  # the code raised or exited with a non-zero status
    "sandbox",  # the sandbox itself could not start the code
)


class SandboxLimits(Strict):
    """What one run of sandboxed code may use, and how it is isolated."""

    isolation: Literal["bubblewrap", "namespaces"] = "bubblewrap"
    """bubblewrap: the code sees nothing of the host (bwrap must be installed: Debian's
    `bubblewrap`). namespaces: the weaker mode, no network but the host's files readable;
    only when asked for, and recorded in the rollout metrics (env/tool_sandbox_weaker)."""
    modules: list[str] = Field(default_factory=list)
    """Top-level modules installed here that the code may import besides the standard library
    (bubblewrap; e.g. [numpy]); each is bound read-only, with its `<name>.libs` beside it."""
    cpu_seconds: float = Field(2.0, gt=0)
    """CPU time of each process (RLIMIT_CPU, whole seconds, rounded up): past it the kernel kills it."""
    wall_seconds: float = Field(5.0, gt=0)
    """Wall-clock time: past it the whole run is killed (a sleeping or blocked child too)."""
    memory_mb: int = Field(1024, gt=0)
    """Address space of each process (RLIMIT_AS): an allocation past it raises MemoryError."""
    max_processes: int = Field(16, gt=0)
    """Processes and threads (RLIMIT_NPROC): a fork past it fails (a fork bomb stops there)."""
    file_size_mb: int = Field(64, gt=0)
    """Largest file the code may write (RLIMIT_FSIZE)."""
    scratch_mb: int = Field(256, gt=0)
    """bubblewrap: the size of the working directory and of /tmp, each a fresh tmpfs (memory)."""
    max_open_files: int = Field(256, ge=16)
    """Open file descriptors per process (RLIMIT_NOFILE)."""
    max_output_chars: int = Field(4000, gt=0)
    """stdout and stderr are each cut to this many characters in the result."""
    max_output_bytes: int = Field(1 << 20, gt=0)
    """Past this many bytes on stdout or stderr the run is killed (an output-limit error)."""

    @field_validator("modules")
    @classmethod
    def _top_level(cls, modules: list[str]) -> list[str]:
        bad = [m for m in modules if not m.isidentifier()]
        if bad:
            raise ValueError(f"modules are top-level module names (e.g. numpy), not {bad}")
        return modules

    def rlimits(self) -> list[tuple[str, int]]:
        cpu = int(-(-self.cpu_seconds // 1))
        return [
            ("RLIMIT_CPU", cpu),
            ("RLIMIT_AS", self.memory_mb << 20),
            ("RLIMIT_NPROC", self.max_processes),
            ("RLIMIT_FSIZE", self.file_size_mb << 20),
            ("RLIMIT_NOFILE", self.max_open_files),
            ("RLIMIT_CORE", 0),
        ]


# The weaker mode (isolation: namespaces). Runs as `python -I -c NAMESPACES_BOOTSTRAP LIMITS_JSON SCRIPT`
# in the sandbox's temporary directory.
NAMESPACES_BOOTSTRAP = r"""
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
                    ("RLIMIT_NOFILE", limits["max_open_files"]), ("RLIMIT_CORE", 0)):
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
    """Killed by the sandbox (wall time, output) or the kernel (CPU time)."""
    seconds: float = 0.0
    isolation: list[str] = field(default_factory=list)
    """How the code was isolated: [bubblewrap, seccomp]; or netns (+ pidns), or audit-hook."""
    failure: str | None = None
    """The kind of failure, one of FAILURE_KINDS (None if the code exited 0)."""

    @property
    def ok(self) -> bool:
        return self.error is None

    def observation(self) -> str:
        """The text a model sees: its stdout, then the error (and the stderr tail) if it failed."""
        if self.ok:
            return self.stdout if self.stdout.strip() else "(no output)"
        tail = self.stderr.strip().splitlines()[-3:]
        return "\n".join(filter(None, [self.stdout.rstrip(), f"error: {self.error}", *tail]))


def _read_bounded(
    stdout: IO[bytes], stderr: IO[bytes], deadline: float, keep: int, most: int
) -> tuple[str, str, str | None]:
    """(stdout, stderr, why it stopped early: wall_time, output or None): read both pipes until
    EOF, the deadline, or more than `most` bytes on either, keeping the first `keep` bytes of each
    (a child that prints forever cannot fill the parent's memory)."""
    kept = {stdout.fileno(): bytearray(), stderr.fileno(): bytearray()}
    seen = dict.fromkeys(kept, 0)

    def texts() -> tuple[str, str]:
        return kept[stdout.fileno()].decode(errors="replace"), kept[stderr.fileno()].decode(errors="replace")

    with selectors.DefaultSelector() as sel:
        for fd in kept:
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                return *texts(), "wall_time"
            for key, _ in sel.select(timeout=left):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                buffer = kept[key.fd]
                buffer += chunk[: max(keep - len(buffer), 0)]
                seen[key.fd] += len(chunk)
                if seen[key.fd] > most:
                    return *texts(), "output"
    return *texts(), None


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _diagnose(result: SandboxResult, limits: SandboxLimits, stopped: str | None) -> tuple[str | None, str | None]:
    """(failure kind, one sentence) of a run: the limit it hit, else its exception's last line."""
    code, stderr = result.exit_code, result.stderr
    signalled = {-(code or 0), (code or 0) - 128}
    if stopped == "wall_time":
        return stopped, f"the code ran past the wall-time limit of {limits.wall_seconds:g} s and was killed"
    if stopped == "output":
        return stopped, f"the code printed more than {limits.max_output_bytes} bytes (the output limit) and was killed"
    if "bubblewrap" in result.isolation and (said := bubblewrap.start_failure(code, stderr)):
        return "sandbox", f"the sandbox could not start the code: {said}"
    if signal.SIGXCPU in signalled or (signal.SIGKILL in signalled and code != 0):
        return "cpu_time", f"the code ran past the CPU-time limit of {limits.cpu_seconds:g} s and was killed"
    if "MemoryError" in stderr or "Cannot allocate memory" in stderr:
        return "memory", f"the code ran out of memory: the sandbox allows {limits.memory_mb} MB"
    if (
        "BlockingIOError" in stderr
        or "Resource temporarily unavailable" in stderr
        or "can't start new thread" in stderr
    ):
        return "processes", f"the code tried to start more than {limits.max_processes} processes or threads"
    if "File too large" in stderr:
        return "file_size", f"the code wrote a file past the limit of {limits.file_size_mb} MB"
    if "No space left on device" in stderr:
        return "file_size", f"the code filled its scratch space of {limits.scratch_mb} MB"
    network = (
        "Network is unreachable",
        "Connection refused",  # bubblewrap's network namespace has its own loopback, where nothing listens
        "name resolution",
        "Name or service not known",
        "network access is disabled",
    )
    if any(marker in stderr for marker in network):
        return "network", "the code tried to use the network: the sandbox has none"
    if code == 0:
        return None, None
    crashed = next((s for s in signalled if s > 0 and s in signal.valid_signals()), None) if code else None
    if crashed is not None and code is not None and (code < 0 or code > 128):
        return "crash", f"the interpreter crashed ({signal.Signals(crashed).name})"
    last = next((line for line in reversed(stderr.strip().splitlines()) if line.strip()), "")
    return "error", f"the code exited with status {code}" + (f": {last.strip()}" if last else "")


def _environment() -> dict[str, str]:
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"}
    env.update({k: "1" for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")})
    return env


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _bubblewrap_argv(code: str, limits: SandboxLimits) -> tuple[list[str], tuple[int, int]]:
    """The bwrap command of one run and the two file descriptors it reads (the caller closes them)."""
    view = bubblewrap.view(tuple(limits.modules))
    as_root = os.geteuid() == 0
    fds = (_memfd("trainflow-code", code.encode()), _memfd("trainflow-seccomp", seccomp_program()))
    argv = bubblewrap.command(
        view,
        bwrap=bubblewrap.find_bwrap(),
        as_root=as_root,
        env=_environment(),
        scratch_mb=limits.scratch_mb,
        code_fd=fds[0],
        seccomp_fd=fds[1],
    )
    return [*argv, json.dumps(bubblewrap.bootstrap_config(view, as_root, limits.rlimits()))], fds


_checked: set[tuple[str, ...]] = set()
_check_lock = threading.Lock()


def check_sandbox(limits: SandboxLimits) -> None:
    """Raise SandboxUnavailable (one sentence, naming the package) unless `limits.isolation` can
    run here: bwrap installed and able to build the sandbox, libseccomp, the whitelisted
    modules. The first check per configuration runs a tiny script in the sandbox; later ones
    are free. The namespaces mode needs nothing."""
    if limits.isolation != "bubblewrap":
        return
    key = tuple(limits.modules)
    with _check_lock:
        if key in _checked:
            return
        argv, fds = _bubblewrap_argv("print('ok')", limits)
        try:
            bubblewrap.probe(argv, fds, _environment())
        finally:
            for fd in fds:
                os.close(fd)
        _checked.add(key)


def _supervise(proc: subprocess.Popen, limits: SandboxLimits, start: float) -> tuple[str, str, int, str | None]:
    """Read the run's output under its limits; kill its process group at the wall-time limit or
    the output limit. (stdout, stderr, exit code, why it was stopped or None)."""
    assert proc.stdout is not None and proc.stderr is not None
    try:
        stdout, stderr, stopped = _read_bounded(
            proc.stdout, proc.stderr, start + limits.wall_seconds, limits.max_output_chars * 4, limits.max_output_bytes
        )
        if stopped:
            _kill_group(proc.pid)
        try:
            exit_code = proc.wait(timeout=max(start + limits.wall_seconds - time.monotonic(), 0.5))
        except subprocess.TimeoutExpired:  # output closed but the process lingers
            stopped = "wall_time"
            _kill_group(proc.pid)
            exit_code = proc.wait()
    finally:
        _kill_group(proc.pid)  # whatever it left behind in its group
        proc.stdout.close()
        proc.stderr.close()
    return stdout, stderr, exit_code, stopped


def _start(argv: list[str], env: dict[str, str], pass_fds: tuple[int, ...] = (), cwd: str | None = None):
    """The run's process: its own session and process group (killed as one), stdin closed."""
    return subprocess.Popen(
        argv,
        cwd=cwd,
        env=env,
        pass_fds=pass_fds,
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def run_python(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run `code` as a script in a fresh sandbox; never raises for anything the code does (a
    sandbox that cannot run here is SandboxUnavailable)."""
    limits = limits or SandboxLimits()
    start = time.monotonic()
    if limits.isolation == "bubblewrap":
        check_sandbox(limits)
        argv, fds = _bubblewrap_argv(code, limits)
        try:
            proc = _start(argv, env=_environment(), pass_fds=fds)
        finally:
            for fd in fds:
                os.close(fd)
        stdout, stderr, exit_code, stopped = _supervise(proc, limits, start)
        isolation = ["bubblewrap", "seccomp"]
    else:
        with tempfile.TemporaryDirectory(prefix="trainflow-sandbox-") as tmp:
            Path(tmp, "main.py").write_text(code, encoding="utf-8")
            env = {**_environment(), "HOME": tmp, "TMPDIR": tmp}
            argv = [sys.executable, "-I", "-c", NAMESPACES_BOOTSTRAP, limits.model_dump_json(), "main.py"]
            proc = _start(argv, env=env, cwd=tmp)
            stdout, stderr, exit_code, stopped = _supervise(proc, limits, start)
            try:
                isolation = json.loads(Path(tmp, STATE_FILE).read_text())["isolation"]
            except (OSError, ValueError, KeyError):
                isolation = []
    cut = limits.max_output_chars
    result = SandboxResult(
        stdout[:cut], stderr[-cut:], exit_code, seconds=time.monotonic() - start, isolation=isolation
    )
    result.failure, result.error = _diagnose(result, limits, stopped)
    result.killed = result.error is not None and "killed" in result.error
    return result
