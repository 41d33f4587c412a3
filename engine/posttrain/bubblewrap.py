"""The sandbox's isolation by bubblewrap (`bwrap`, Debian's `bubblewrap` package, the tool
Flatpak and several code agents run untrusted code with): the command line that runs one
tool call, and the check that it can run here.

What the code sees (everything else of the host is absent, not merely unreadable):

    /opt/python     the interpreter: its binary, its standard library (read-only; the
                    prefix's own site-packages hidden under an empty directory), libpython
                    when it is shared, and /opt/python/site with the modules the config
                    whitelists (`modules`), each bound read-only from where this Python finds it
    /usr/lib, /lib, /lib64, /etc/ld.so.cache
                    the system's shared libraries, read-only (the standard library's C
                    extensions link against them); no /etc/passwd, no /etc/shadow, no /usr/bin
    /sandbox        the working directory: a fresh tmpfs of `scratch_mb`, gone afterwards
    /tmp, /dev/shm  fresh tmpfs of `scratch_mb` each (multiprocessing's semaphores live in /dev/shm)
    /proc, /dev     the PID namespace's own /proc; bwrap's minimal /dev (null, zero, urandom ...)

Namespaces: mount, PID (the bootstrap is its init, --as-pid-1, and forks the code), network (only its own
loopback), IPC, UTS and cgroup, and a user namespace when trainflow runs as an ordinary user
(further ones disabled). The root of the view is remounted read-only. Capabilities: none.
no_new_privs and the seccomp filter of engine/posttrain/seccomp.py, loaded by bwrap just
before the code's interpreter starts. The environment is cleared (--clearenv).

The end of a run: the bootstrap, PID 1 of the namespace, only reaps; its child runs the code.
PID 1 exits when the code does, or when it reads EOF on the call's `alive` pipe, whose write
end trainflow holds until the call is over (or until it dies): the kernel then kills every
process left in the namespace. bwrap's --die-with-parent alone does not do it as root (bwrap
keeps no CAP_KILL, and the run's uid is not bwrap's: its parent-death signal is refused).

Who the code runs as: an unprivileged uid of its own, so that RLIMIT_NPROC counts that run's
processes only (concurrent runs, one of them a fork bomb, do not starve each other). As an
ordinary user bwrap maps `nobody` (65534) to that user in a new user namespace, where the
count is the namespace's. As root it cannot: in a user namespace the code would still be the
host's uid 0, which the kernel exempts from RLIMIT_NPROC (a fork bomb would not stop), so
bwrap runs privileged, without a user namespace, keeping only CAP_SETUID, CAP_SETGID and
CAP_SETPCAP for the bootstrap, which empties every capability set (bounding included) and
becomes a host uid from RUN_UIDS (no account has it; it owns nothing outside the run's
tmpfs) before it sets the limits and runs the code.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import os
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from engine.config import ConfigError

NOBODY = 65534
# Host uids for runs started as root: one per run in flight (this process's pid picks a block
# of 256, a counter the uid in it), below 2**31 and far above any account's.
RUN_UIDS = range(0x7FFE0000, 0x7FFF0000)
_run_counter = itertools.count()
PREFIX = "/opt/python"  # where the interpreter appears inside
SITE = f"{PREFIX}/site"  # the whitelisted modules
SCRATCH = "/sandbox"
SYSTEM_LIBRARIES = ("/usr/lib", "/usr/lib64", "/lib", "/lib64")
BWRAP = "bwrap"  # the program, looked up on PATH, then in /usr/bin and /bin
INSTALL_HINT = "install the `bubblewrap` package (Debian/Ubuntu: apt-get install bubblewrap)"

# Runs as `python -I -c BOOTSTRAP CONFIG_JSON` in /sandbox, before any of the code: PID 1 of the namespace.
BOOTSTRAP = r"""
import ctypes, json, os, resource, select, signal, sys
config = json.loads(sys.argv[1])
uid = config["uid"]
libc = ctypes.CDLL(None, use_errno=True)
if uid is not None:
    # Privileged bwrap (trainflow runs as root): empty every capability set, then become the
    # run's own unprivileged uid, whose processes RLIMIT_NPROC counts.
    for cap in range(64):
        libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP (EINVAL past the last capability)
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)  # clears the permitted and effective sets
    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
    if libc.capset(ctypes.byref(Header(0x20080522, 0)), ctypes.byref((ctypes.c_uint32 * 6)())) != 0:
        raise OSError(ctypes.get_errno(), "capset failed")  # the inheritable set, now empty too
# This process is PID 1 of the namespace: it only reaps, its child runs the code. It exits when
# the code does, or as soon as trainflow's end of `alive` closes (the call is over, or trainflow
# died): the kernel then kills every process left in the namespace. (bwrap's --die-with-parent
# cannot do that as root: bwrap keeps no CAP_KILL, and the run's uid is not bwrap's.)
alive = config["alive_fd"]
wake_r, wake_w = os.pipe()
os.set_blocking(wake_w, False)
signal.set_wakeup_fd(wake_w)  # SIGCHLD wakes the select below
signal.signal(signal.SIGCHLD, lambda *_: None)
worker = os.fork()
if worker:
    while True:
        if alive in select.select([alive, wake_r], [], [])[0]:  # EOF: nothing is ever written
            os._exit(128 + signal.SIGKILL)
        os.read(wake_r, 512)
        while True:  # reap the worker and the orphans re-parented here (zombies count as processes)
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                os._exit(0)
            if pid == 0:
                break
            if pid == worker:
                os._exit(128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))
signal.set_wakeup_fd(-1)
signal.signal(signal.SIGCHLD, signal.SIG_DFL)
for fd in (alive, wake_r, wake_w):
    os.close(fd)
del ctypes, libc
for name, value in config["rlimits"]:
    value += name == "RLIMIT_NPROC"  # PID 1, the reaper, is one of the uid's processes too
    resource.setrlimit(getattr(resource, name), (value, value))
if config["site"]:
    sys.path.append(config["site"])
import runpy
sys.argv = ["main.py"]
runpy.run_path("main.py", run_name="__main__")
"""


class SandboxUnavailable(ConfigError):
    """The sandbox cannot run here (bwrap missing or refused, a whitelisted module not found)."""


@dataclass(frozen=True)
class View:
    """The host paths the sandbox binds, and where."""

    binds: tuple[tuple[str, str], ...]  # (host path, path inside), read-only
    symlinks: tuple[tuple[str, str], ...]  # (target, path inside)
    masked: str | None  # the prefix's site-packages, inside: hidden under an empty directory
    python: str  # the interpreter, inside
    library_path: str | None  # LD_LIBRARY_PATH inside (libpython bound beside the binary)
    site: bool  # whether modules were whitelisted


def module_paths(name: str) -> list[Path]:
    """Where this Python imports top-level module `name` from (a package directory or one file),
    with its wheel's vendored libraries (`<name>.libs`, as numpy's) beside it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    if spec is None or (spec.origin in (None, "built-in", "frozen") and not spec.submodule_search_locations):
        raise SandboxUnavailable(
            f"sandbox.modules: no module '{name}' in this Python environment ({sys.executable}); "
            "list top-level modules that `import` finds here"
        )
    if spec.submodule_search_locations:
        paths = [Path(p) for p in spec.submodule_search_locations]
    else:
        paths = [Path(str(spec.origin))]
    parent = paths[0].parent
    return paths + [p for p in (parent / f"{name}.libs",) if p.is_dir()]


@functools.cache
def view(modules: tuple[str, ...] = ()) -> View:
    """The read-only view for this interpreter and the whitelisted `modules`."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    binary = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    stdlib = sysconfig.get_path("stdlib")
    binds = [(binary, f"{PREFIX}/bin/{version}"), (stdlib, f"{PREFIX}/lib/{version}")]
    library_path = None
    shared = Path(str(sysconfig.get_config_var("LIBDIR")), str(sysconfig.get_config_var("INSTSONAME")))
    if sysconfig.get_config_var("Py_ENABLE_SHARED") and shared.is_file():
        binds.append((str(shared), f"{PREFIX}/lib/{shared.name}"))
        library_path = f"{PREFIX}/lib"
    symlinks = [(version, f"{PREFIX}/bin/python3"), (version, f"{PREFIX}/bin/python")]
    for path in SYSTEM_LIBRARIES:
        if os.path.islink(path):
            symlinks.append((os.readlink(path), path))
        elif os.path.isdir(path):
            binds.append((path, path))
    if os.path.isfile("/etc/ld.so.cache"):
        binds.append(("/etc/ld.so.cache", "/etc/ld.so.cache"))
    for name in modules:
        binds += [(str(p), f"{SITE}/{p.name}") for p in module_paths(name)]
    masked = f"{PREFIX}/lib/{version}/site-packages" if os.path.isdir(f"{stdlib}/site-packages") else None
    return View(tuple(binds), tuple(symlinks), masked, f"{PREFIX}/bin/{version}", library_path, bool(modules))


def find_bwrap() -> str:
    """bwrap's path; a missing one is a SandboxUnavailable that names the package."""
    found = shutil.which(BWRAP, path=f"{os.environ.get('PATH', '')}:/usr/bin:/bin")
    if found is None:
        raise SandboxUnavailable(
            "the python tool's sandbox runs model code under bubblewrap (`bwrap`), which is not installed: "
            f"{INSTALL_HINT}, or opt into the weaker sandbox with `sandbox: {{isolation: namespaces}}`"
        )
    return found


def _parents(path: str) -> list[str]:
    parts = Path(path).parents
    return [str(p) for p in reversed(parts) if str(p) != "/"]


def command(
    v: View, *, bwrap: str, as_root: bool, env: dict[str, str], scratch_mb: int, code_fd: int, seccomp_fd: int
) -> list[str]:
    """The bwrap command line: namespaces, the view, then the bootstrap (its config JSON is
    appended by the caller). `code_fd` holds the code (copied to /sandbox/main.py),
    `seccomp_fd` the BPF program; both are read by bwrap before the code starts."""
    # --as-pid-1: the bootstrap is the PID namespace's init (no bwrap reaper, whose /proc/1/cmdline
    # would show the host paths of the view); when it exits, the kernel kills what is left.
    argv = [bwrap, "--die-with-parent", "--new-session", "--as-pid-1", "--clearenv", "--hostname", "sandbox"]
    argv += ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
    if as_root:  # privileged, no user namespace: the bootstrap drops these three, takes its uid
        argv += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_SETPCAP"]
    else:
        argv += ["--unshare-user", "--disable-userns", "--uid", str(NOBODY), "--gid", str(NOBODY)]
    # Directories bwrap creates on the way to a mount point are 0700 and root's when it runs
    # privileged: create them 0755 first.
    destinations = [dest for _, dest in v.binds] + [dest for _, dest in v.symlinks]
    for directory in dict.fromkeys(p for dest in destinations for p in _parents(dest)):
        argv += ["--perms", "0755", "--dir", directory]
    for source, dest in v.binds:
        argv += ["--ro-bind", source, dest]
    for target, dest in v.symlinks:
        argv += ["--symlink", target, dest]
    if v.masked:  # the prefix's own site-packages (pip, whatever was installed there): hidden
        argv += ["--perms", "0555", "--tmpfs", v.masked, "--remount-ro", v.masked]
    size = str(scratch_mb << 20)
    argv += ["--proc", "/proc", "--dev", "/dev"]
    argv += ["--perms", "1777", "--size", size, "--tmpfs", "/tmp"]
    argv += ["--perms", "1777", "--size", size, "--tmpfs", "/dev/shm"]  # multiprocessing's semaphores
    argv += ["--perms", "0777", "--size", size, "--tmpfs", SCRATCH, "--perms", "0644", "--file", str(code_fd)]
    argv += [f"{SCRATCH}/main.py", "--chdir", SCRATCH]
    argv += ["--remount-ro", "/"]  # the root tmpfs bwrap built the view in (its mounts keep their own modes)
    inside = {**env, "HOME": SCRATCH, "TMPDIR": "/tmp", "PATH": f"{PREFIX}/bin"}
    if v.library_path:
        inside["LD_LIBRARY_PATH"] = v.library_path
    for key, value in inside.items():
        argv += ["--setenv", key, value]
    argv += ["--seccomp", str(seccomp_fd), "--", v.python, "-I", "-c", BOOTSTRAP]
    return argv


def run_uid() -> int:
    """A host uid for the next run started as root (see RUN_UIDS)."""
    block = (os.getpid() % (len(RUN_UIDS) // 256)) * 256
    return RUN_UIDS[block + next(_run_counter) % 256]


def bootstrap_config(v: View, as_root: bool, rlimits: list[tuple[str, int]], alive_fd: int) -> dict:
    """The bootstrap's argument: the uid to become (as root), the limits, the modules' directory,
    and `alive_fd`, the read end of a pipe whose write end trainflow holds for the call: at its
    EOF the sandbox ends."""
    uid = run_uid() if as_root else None
    return {"uid": uid, "rlimits": rlimits, "site": SITE if v.site else None, "alive_fd": alive_fd}


def start_failure(exit_code: int | None, stderr: str) -> str | None:
    """bwrap's own error (it could not build the sandbox), else None: bwrap exits 1 with
    `bwrap: ...` on stderr before the code ran."""
    first = stderr.lstrip().splitlines()[0] if stderr.strip() else ""
    return first if exit_code == 1 and first.startswith("bwrap: ") else None


def probe(argv: list[str], pass_fds: tuple[int, ...], env: dict[str, str]) -> None:
    """Run `argv` (the sandbox around a script that prints "ok"); a failure is SandboxUnavailable
    with bwrap's own words (user namespaces refused, a container without mount rights ...)."""
    try:
        out = subprocess.run(argv, pass_fds=pass_fds, env=env, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        raise SandboxUnavailable("the python tool's sandbox (bwrap) did not start within 60 s") from None
    if out.returncode != 0 or out.stdout.strip() != "ok":
        said = (out.stderr.strip().splitlines() or ["(nothing)"])[-1]
        raise SandboxUnavailable(
            f"the python tool's sandbox (bwrap) cannot run here: it exited with status {out.returncode} and said "
            f"{said!r}; bwrap needs unprivileged user namespaces (or root), or opt into the weaker sandbox with "
            "`sandbox: {isolation: namespaces}`"
        )
