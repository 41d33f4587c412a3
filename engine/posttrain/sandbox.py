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
                not), the code as `nobody`, the host's file system readable (as root the
                code keeps CAP_DAC_READ_SEARCH, because the interpreter may live where nobody
                cannot read) but not writable: a mount namespace remounts it read-only and
                puts a private tmpfs on /tmp, /var/tmp and /dev/shm, the working directory
                (`read-only-fs`; without it the code writes wherever its uid may, the host's
                /tmp included). `SandboxResult.isolation` says what a run had.

Limits, set by the bootstrap before any of the code runs and inherited by every process it
starts (rlimits): CPU seconds and address space per process, processes and threads
(RLIMIT_NPROC), file size, open files, no core dumps. The parent watches the whole tree
(engine/posttrain/process_tree.py): it kills it at the wall-time limit, as soon as stdout or
stderr passes `max_output_bytes`, and when the tree's memory, sampled every SAMPLE_SECONDS,
passes `memory_mb` (these machines' cgroups are v1 with the memory controller held by the
host, so no kernel limit covers a tree). Nothing a call started outlives it: the tree is
stopped and killed whole (a setsid() or a double fork does not leave it), and if trainflow
itself dies mid-call the sandbox goes with it (bwrap's PID 1 reads EOF on the call's pipe; the
namespaces bootstrap has the parent-death signal).

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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Literal

from pydantic import Field, field_validator

from engine.config import Strict
from engine.posttrain import bubblewrap
from engine.posttrain.bubblewrap import SandboxUnavailable as SandboxUnavailable  # re-exported
from engine.posttrain.process_tree import bootstrap_source, kill_tree, tree_memory_bytes
from engine.posttrain.seccomp import seccomp_program

NOBODY = 65534
SAMPLE_SECONDS = 0.1  # how often the run's tree is weighed against memory_mb

# How a tool call can fail, the names of its `env/tool_failures/<kind>` metric.
FAILURE_KINDS = (
    "wall_time",  # ran (or slept, or hung) past wall_seconds: killed
    "cpu_time",  # a process used cpu_seconds of CPU: killed by the kernel
    "memory",  # an allocation past memory_mb failed, or the tree's processes together passed it: killed
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
    """Memory of the run: each process's address space (RLIMIT_AS: an allocation past it raises
    MemoryError), and the whole tree's proportional set size, sampled ten times a second: past
    it the run is killed (a memory failure)."""
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


# The weaker mode (isolation: namespaces). Runs as `python -I -c NAMESPACES_BOOTSTRAP LIMITS_JSON SCRIPT
# PARENT_PID STATE_FD` in the sandbox's temporary directory; process_tree's functions come first.
# It writes the isolation it got to STATE_FD as JSON (a pipe: the directory may be read-only by then).
NAMESPACES_BOOTSTRAP = (
    "import ctypes, json, os, resource, select, signal, sys, time\n"
    + bootstrap_source()
    + r"""
limits = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
# Die with trainflow (the parent-death signal, then a look whether it had already gone), and
# be a child subreaper: the code's orphans (a double fork, a setsid) are re-parented here, in
# the tree the parent kills, never to the host's init.
libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[3]):
    os._exit(1)
libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
NEWUSER, NEWNET, NEWPID, NEWNS = 0x10000000, 0x40000000, 0x20000000, 0x00020000
root = os.geteuid() == 0
uid, gid = os.getuid(), os.getgid()
if root:
    os.chown(".", 65534, 65534)
with open(sys.argv[2], "rb") as f:
    script = f.read()
isolation = []
ATTEMPTS = (  # the namespaces to ask for, most first
    [NEWNS | NEWNET | NEWPID, ["mntns", "netns", "pidns"]],
    [NEWNET | NEWPID, ["netns", "pidns"]],
    [NEWNET, ["netns"]],
)
for flags, names in ATTEMPTS:
    if not root:
        flags |= NEWUSER
    if libc.unshare(flags) == 0:
        isolation = names
        if not root:  # map our own ids, the one mapping an unprivileged user may write
            for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)
        break
if "mntns" in isolation:
    # The host's file system read-only (mount_setattr, recursive), and a private tmpfs on each
    # directory everyone may write: the code writes nothing outside them, the host's /tmp included.
    isolation.remove("mntns")
    class MountAttr(ctypes.Structure):
        _fields_ = [("set", ctypes.c_uint64), ("clear", ctypes.c_uint64), ("propagation", ctypes.c_uint64),
                    ("userns_fd", ctypes.c_uint64)]
    MS_REC, MS_PRIVATE, MS_NOSUID, MS_NODEV = 0x4000, 1 << 18, 2, 4
    done = libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) == 0
    readonly = MountAttr(1, 0, 0, 0)  # MOUNT_ATTR_RDONLY; -100 is AT_FDCWD, 0x8000 AT_RECURSIVE, 442 the call
    done = done and libc.syscall(442, -100, b"/", 0x8000, ctypes.byref(readonly), ctypes.sizeof(readonly)) == 0
    size = f"size={limits['scratch_mb']}m,mode=1777".encode()
    for directory in (b"/tmp", b"/var/tmp", b"/dev/shm"):
        done = done and (not os.path.isdir(directory) or libc.mount(b"tmpfs", directory, b"tmpfs",
                                                                    MS_NOSUID | MS_NODEV, size) == 0)
    if done:
        isolation.append("read-only-fs")
with open(int(sys.argv[4]), "w") as f:
    json.dump({"isolation": isolation or ["audit-hook"]}, f)
if "read-only-fs" in isolation:  # the working directory (this one is read-only now): the private /tmp
    os.chdir("/tmp")
    with open(sys.argv[2], "wb") as f:
        f.write(script)
    os.environ.update(HOME="/tmp", TMPDIR="/tmp")

def wait_for(pid):
    # Reap until `pid` exits (orphans are re-parented here meanwhile); its exit code.
    while True:
        try:
            done, status = os.wait()
        except ChildProcessError:
            return 0
        if done == pid:
            return 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)

alive, holding = os.pipe()  # EOF on `alive` once this process is gone
child = os.fork()
if child:
    os.close(alive)
    code = wait_for(child)
    kill_tree(os.getpid(), keep_root=True)  # what the code left running (without a PID namespace it is here)
    while True:  # and reap it: a zombie still counts against its uid's process limit
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                break
        except ChildProcessError:
            break
    os._exit(code)
os.close(holding)

def die_with_bootstrap():
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG (a fork and a uid change each clear it)
    if select.select([alive], [], [], 0)[0]:  # the bootstrap was gone before it was set
        os._exit(1)

if "pidns" in isolation:
    # This child is PID 1 of the namespace: it only reaps; its child runs the code. When PID 1
    # exits the kernel kills whatever is left in the namespace.
    die_with_bootstrap()
    worker = os.fork()
    if worker:
        os._exit(wait_for(worker))
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
if "pidns" not in isolation:
    die_with_bootstrap()  # the code runs in this process, not under a namespace's init
os.close(alive)
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
)


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
    """How the code was isolated: [bubblewrap, seccomp]; or netns (+ pidns, + read-only-fs), or audit-hook."""
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
    stdout: IO[bytes], stderr: IO[bytes], deadline: float, keep: int, most: int, over_memory: Callable[[], bool]
) -> tuple[str, str, str | None]:
    """(stdout, stderr, why it stopped early: wall_time, output, memory or None): read both
    pipes until EOF, the deadline, more than `most` bytes on either, or `over_memory()` (asked
    every SAMPLE_SECONDS), keeping the first `keep` bytes of each (a child that prints forever
    cannot fill the parent's memory)."""
    kept = {stdout.fileno(): bytearray(), stderr.fileno(): bytearray()}
    seen = dict.fromkeys(kept, 0)
    sample = time.monotonic() + SAMPLE_SECONDS

    def texts() -> tuple[str, str]:
        return kept[stdout.fileno()].decode(errors="replace"), kept[stderr.fileno()].decode(errors="replace")

    with selectors.DefaultSelector() as sel:
        for fd in kept:
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map():
            now = time.monotonic()
            if now >= deadline:
                return *texts(), "wall_time"
            if now >= sample:
                if over_memory():
                    return *texts(), "memory"
                sample = now + SAMPLE_SECONDS
            for key, _ in sel.select(timeout=min(deadline, sample) - now):
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


def _diagnose(result: SandboxResult, limits: SandboxLimits, stopped: str | None) -> tuple[str | None, str | None]:
    """(failure kind, one sentence) of a run: the limit it hit, else its exception's last line."""
    code, stderr = result.exit_code, result.stderr
    signalled = {-(code or 0), (code or 0) - 128}
    if stopped == "wall_time":
        return stopped, f"the code ran past the wall-time limit of {limits.wall_seconds:g} s and was killed"
    if stopped == "output":
        return stopped, f"the code printed more than {limits.max_output_bytes} bytes (the output limit) and was killed"
    if stopped == "memory":
        return stopped, (
            f"the code's processes together used more than {limits.memory_mb} MB of memory (the limit) and were killed"
        )
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


def _bubblewrap_argv(code: str, limits: SandboxLimits) -> tuple[list[str], tuple[int, int, int], int]:
    """The bwrap command of one run, the three file descriptors it inherits (the code, the
    seccomp program, the read end of the call's `alive` pipe: the caller closes them once bwrap
    is started) and the pipe's write end, which the caller holds until the call is over."""
    view = bubblewrap.view(tuple(limits.modules))
    as_root = os.geteuid() == 0
    alive, holding = os.pipe()
    fds = (_memfd("trainflow-code", code.encode()), _memfd("trainflow-seccomp", seccomp_program()), alive)
    argv = bubblewrap.command(
        view,
        bwrap=bubblewrap.find_bwrap(),
        as_root=as_root,
        env=_environment(),
        scratch_mb=limits.scratch_mb,
        code_fd=fds[0],
        seccomp_fd=fds[1],
    )
    config = bubblewrap.bootstrap_config(view, as_root, limits.rlimits(), alive)
    return [*argv, json.dumps(config)], fds, holding


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
        argv, fds, holding = _bubblewrap_argv("print('ok')", limits)
        try:
            bubblewrap.probe(argv, fds, _environment())
        finally:
            for fd in (*fds, holding):
                os.close(fd)
        _checked.add(key)


def _supervise(proc: subprocess.Popen, limits: SandboxLimits, start: float) -> tuple[str, str, int, str | None]:
    """Read the run's output under its limits until its process exits; at the wall-time limit,
    the output limit or past `memory_mb` for the whole tree, stop. Either way nothing of the
    run is left when this returns: its whole process tree is killed before the first process
    is reaped (while that pid cannot be reused). (stdout, stderr, exit code, why it was stopped)."""
    assert proc.stdout is not None and proc.stderr is not None
    deadline = start + limits.wall_seconds

    def over_memory() -> bool:
        return tree_memory_bytes(proc.pid) > limits.memory_mb << 20

    try:
        keep = limits.max_output_chars * 4
        stdout, stderr, stopped = _read_bounded(
            proc.stdout, proc.stderr, deadline, keep, limits.max_output_bytes, over_memory
        )
        while stopped is None:  # output closed: wait for the exit, still under the limits
            try:
                proc.wait(timeout=max(min(SAMPLE_SECONDS, deadline - time.monotonic()), 0))
                break
            except subprocess.TimeoutExpired:
                if time.monotonic() >= deadline:
                    stopped = "wall_time"
                elif over_memory():
                    stopped = "memory"
    finally:
        if proc.returncode is None:
            kill_tree(proc.pid)  # the sandbox's process and all under it, however they left its group
        exit_code = proc.wait()
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
        argv, fds, holding = _bubblewrap_argv(code, limits)
        try:
            try:
                proc = _start(argv, env=_environment(), pass_fds=fds)
            finally:
                for fd in fds:
                    os.close(fd)
            stdout, stderr, exit_code, stopped = _supervise(proc, limits, start)
        finally:
            os.close(holding)  # should anything of the run outlive bwrap, its PID 1 now exits
        isolation = ["bubblewrap", "seccomp"]
    else:
        with tempfile.TemporaryDirectory(prefix="trainflow-sandbox-") as tmp:
            Path(tmp, "main.py").write_text(code, encoding="utf-8")
            env = {**_environment(), "HOME": tmp, "TMPDIR": tmp}
            state, state_w = os.pipe()  # the bootstrap writes the isolation it got here
            argv = [sys.executable, "-I", "-c", NAMESPACES_BOOTSTRAP, limits.model_dump_json(), "main.py"]
            try:
                proc = _start([*argv, str(os.getpid()), str(state_w)], env=env, pass_fds=(state_w,), cwd=tmp)
            finally:
                os.close(state_w)
            with open(state, "rb") as said:  # read once the run is over: every writer is gone then
                stdout, stderr, exit_code, stopped = _supervise(proc, limits, start)
                try:
                    isolation = json.loads(said.read())["isolation"]
                except (ValueError, KeyError):  # it died before it could say
                    isolation = []
    cut = limits.max_output_chars
    result = SandboxResult(
        stdout[:cut], stderr[-cut:], exit_code, seconds=time.monotonic() - start, isolation=isolation
    )
    result.failure, result.error = _diagnose(result, limits, stopped)
    result.killed = result.error is not None and "killed" in result.error
    return result
