"""The Python sandbox. The escape battery runs as root (these machines run trainflow as root)
and as an ordinary user: each attempt to read, write, connect, signal or widen its
namespaces is contained, with nothing of the host in what comes back. Then each limit stops
what it is for with an error that says which limit it was, a failure is the tool call's
error message (never the run's end), and the weaker mode runs only when asked for."""

from __future__ import annotations

import errno
import json
import os
import platform
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import pytest

from engine.config import ConfigError
from engine.posttrain import bubblewrap, sandbox
from engine.posttrain.environments import EnvironmentConfig, ToolEnvironment, load_environment
from engine.posttrain.process_tree import kill_tree, process_tree, scan_tree
from engine.posttrain.sandbox import FAILURE_KINDS, SandboxLimits, SandboxUnavailable, run_python

REPO = Path(__file__).resolve().parents[1]
LIMITS = SandboxLimits(cpu_seconds=1, wall_seconds=20, memory_mb=512, max_processes=8)
ORDINARY_UID = 12345  # no passwd entry needed: setpriv switches to any uid

# No skip when bwrap is missing on Linux: the tests then fail with the sandbox's own sentence
# ("install the `bubblewrap` package"), as a run would; .ci/run installs it.
pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the sandbox is Linux's namespaces and seccomp")


def run(code: str, limits: SandboxLimits = LIMITS):
    result = run_python(code, limits)
    assert result.isolation, "the sandbox said how it isolated the code"
    return result


# A child, a double-forked daemon and a child in a session of its own: each an interpreter that
# sleeps with `{marker}` on its command line, once it has said so in an `up-<pid>` file. The code
# waits for the three and prints "up 3" (format with marker=...).
LEAVE_BEHIND = (
    "import os, sys, time\n"
    "def sleeper():\n"
    '    code = \'import os, time; open(f"up-{{os.getpid()}}", "w").close(); time.sleep(60)\'\n'
    "    os.execv(sys.executable, [sys.executable, '-c', code, {marker!r}])\n"
    "if os.fork() == 0:\n    sleeper()\n"
    "if os.fork() == 0:\n    if os.fork() == 0:\n        os.setsid()\n        sleeper()\n    os._exit(0)\n"
    "if os.fork() == 0:\n    os.setsid()\n    sleeper()\n"
    "while len([name for name in os.listdir('.') if name.startswith('up-')]) < 3:\n    time.sleep(0.01)\n"
    "print('up', 3, flush=True)\n"
)


def processes_with(marker: str) -> list[int]:
    """The host's processes with `marker` as one of their arguments."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if marker.encode() in argv:
            found.append(int(pid))
    return found


# --------------------------------------------------------------------------- the escape battery

# Each attempt: (name, code, limits overrides). `{...}` fields are the planted secrets' paths,
# the listener's port and the test's pid; what each must show is in `check` below.
ESCAPES = [
    ("private_file", "print(open({private!r}).read())", {}),
    ("etc_shadow", "print(open('/etc/shadow').read())", {}),
    (
        "root_home",
        "import os\nfor d in ('/root', '/home', os.path.expanduser('~')):\n"
        "    try:\n        print(d, sorted(os.listdir(d)))\n"
        "    except OSError as e:\n        print(d, type(e).__name__)",
        {},
    ),
    ("artifact_store", "import os\nprint(os.listdir({store!r}))\nprint(open({artifact!r}).read())", {}),
    ("prefect_home", "import os\nprint(os.environ.get('PREFECT_HOME'))\nprint(os.listdir({prefect!r}))", {}),
    (
        "environment",
        "import os\nprint(sorted(os.environ.items()))\ntry:\n    print(open('/proc/1/environ', 'rb').read())\n"
        "except OSError as e:\n    print(type(e).__name__)",
        {},
    ),
    (
        "write_outside",
        "import os\nfor path in ({outside!r}, '/x', '/etc/x', '/usr/lib/x', '/opt/python/lib/x', {store!r} + '/x'):\n"
        "    try:\n        open(path, 'w').write('x')\n        print('WROTE', path)\n"
        "    except OSError as e:\n        print('refused', path, type(e).__name__)\n"
        "open('scratch.txt', 'w').write('ok')\nopen('/tmp/t.txt', 'w').write('ok')\nprint('scratch ok')",
        {},
    ),
    ("loopback", "import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('CONNECTED')", {}),
    ("dns", "import socket\nprint(socket.getaddrinfo('example.com', 80))", {}),
    (
        "child_interpreter_socket",
        "import subprocess, sys\ncode = \"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2); "
        "print('CONNECTED')\"\nout = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True)\n"
        "print(out.returncode, out.stdout, out.stderr.strip().splitlines()[-1])\n"
        "out = subprocess.run([sys.executable, '-c', \"import socket; print(socket.gethostbyname('example.com'))\"],"
        " capture_output=True, text=True)\nprint(out.returncode, out.stdout, out.stderr.strip().splitlines()[-1])",
        {},
    ),
    (
        "ctypes_socket",
        "import ctypes, socket, struct\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "fd = libc.socket(socket.AF_INET, socket.SOCK_STREAM, 0)\n"
        "address = struct.pack('=HH4s8x', socket.AF_INET, socket.htons({port}), socket.inet_aton('127.0.0.1'))\n"
        "rc = libc.connect(fd, address, len(address))\nprint('connect', rc, ctypes.get_errno())",
        {},
    ),
    (
        "fork_bomb",
        "import os, sys\nn = 0\nwhile True:\n    n += 1\n    if os.fork() == 0 and n % 2 == 0:\n"
        "        os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(30)', {marker!r}])",
        {},
    ),
    (
        "memory_in_child",
        "import subprocess, sys\nout = subprocess.run([sys.executable, '-c', "
        "'x = bytearray(2 * 10**9); print(\"allocated\")'], capture_output=True, text=True)\n"
        "print(out.returncode, out.stdout, out.stderr.strip().splitlines()[-1])",
        {},
    ),
    ("cpu_spin", "while True:\n    pass", {}),
    ("sleep", LEAVE_BEHIND + "time.sleep(60)", {"wall_seconds": 3.0}),
    ("print_forever", "while True:\n    print('x' * 1000)", {"max_output_bytes": 100_000}),
    (
        "ptrace_and_signal",
        "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "print('ptrace', libc.ptrace(16, {test_pid}, 0, 0), ctypes.get_errno())\n"
        "for pid in ({test_pid}, {parent_pid}):\n    try:\n        os.kill(pid, 9)\n        print('SIGNALLED', pid)\n"
        "    except OSError as e:\n        print('kill', pid, type(e).__name__)",
        {},
    ),
    (
        "mount_unshare_chroot_setuid",
        "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "print('mount', libc.mount(b'none', b'/tmp', b'tmpfs', 0, None))\n"
        "print('unshare-user', libc.unshare(0x10000000))\nprint('unshare-mount', libc.unshare(0x00020000))\n"
        "print('clone-user', libc.syscall(56, 0x10000000 | 17, 0, 0, 0, 0))\n"  # clone(CLONE_NEWUSER | SIGCHLD)
        "print('chroot', libc.chroot(b'/tmp'))\n"
        "for name, call in (('setuid', lambda: os.setuid(0)), ('setgid', lambda: os.setgid(0)), "
        "('chroot-os', lambda: os.chroot('/tmp'))):\n    try:\n        call()\n        print('BECAME', name)\n"
        "    except OSError as e:\n        print(name, type(e).__name__)",
        {},
    ),
    (
        "host_proc",
        "import os\npids = [p for p in os.listdir('/proc') if p.isdigit()]\nprint('pids', len(pids))\n"
        "for path in ('/proc/{test_pid}/cmdline', '/proc/{test_pid}/environ', '/proc/1/cmdline'):\n"
        "    try:\n        print(path, open(path, 'rb').read())\n    except OSError as e:\n"
        "        print(path, type(e).__name__)",
        {},
    ),
    (
        "privileges",
        "print([line for line in open('/proc/self/status').read().splitlines() "
        "if line.startswith(('Cap', 'NoNewPrivs', 'Seccomp:', 'Uid'))])",
        {},
    ),
]
if platform.machine() == "x86_64":  # the x32 ABI: another architecture to the filter, so the process dies
    ESCAPES.append(("x32_abi", "import ctypes\nctypes.CDLL(None).syscall(0x40000000 | 272, 0x10000000)", {}))


def run_battery(places: dict) -> dict[str, dict]:
    """Run every escape attempt in the sandbox (in this process) and return what came back."""
    outcomes = {}
    for name, code, overrides in ESCAPES:
        result = run_python(code.format(**places), LIMITS.model_copy(update=overrides))
        outcomes[name] = {k: getattr(result, k) for k in ("stdout", "stderr", "error", "failure", "exit_code")}
    return outcomes


def check(outcomes: dict[str, dict], places: dict, host_words: list[str]) -> None:
    """What every attempt must show: contained, and nothing of the host in what came back."""
    assert set(outcomes) == {name for name, _, _ in ESCAPES}
    for name, out in outcomes.items():
        text = f"{out['stdout']}\n{out['stderr']}\n{out['error']}"
        assert places["token"] not in text, f"{name}: a planted secret came back: {text}"
        for word in host_words:
            assert word not in text, f"{name}: {word!r} of the host came back: {text}"
    missing = "FileNotFoundError"  # the host's files are not there at all, not merely unreadable
    for name in ("private_file", "etc_shadow", "artifact_store", "prefect_home"):
        assert outcomes[name]["failure"] == "error" and missing in outcomes[name]["stderr"], outcomes[name]
    assert "/root FileNotFoundError" in outcomes["root_home"]["stdout"], outcomes["root_home"]
    assert "/home FileNotFoundError" in outcomes["root_home"]["stdout"], outcomes["root_home"]
    assert "PREFECT_HOME" not in outcomes["environment"]["stdout"] and outcomes["environment"]["failure"] is None
    writes = outcomes["write_outside"]["stdout"]
    assert "WROTE" not in writes and "scratch ok" in writes and writes.count("refused") == 6, writes
    assert not Path(places["outside"]).exists()
    for name in ("loopback", "dns"):
        assert outcomes[name]["failure"] == "network" and "CONNECTED" not in outcomes[name]["stdout"], outcomes[name]
    child = outcomes["child_interpreter_socket"]["stdout"]
    assert "CONNECTED" not in child and "ConnectionRefusedError" in child and "gaierror" in child, child
    # The sandbox's own loopback, where nothing listens (the test's listener is checked too).
    assert outcomes["ctypes_socket"]["stdout"].startswith("connect -1 111"), outcomes["ctypes_socket"]
    assert outcomes["fork_bomb"]["failure"] == "processes", outcomes["fork_bomb"]
    left = subprocess.run(["pgrep", "-f", places["marker"]], capture_output=True, text=True).stdout.split()
    assert left == [], f"processes of the fork bomb outlived the sandbox: {left}"
    child = outcomes["memory_in_child"]["stdout"]
    assert child.startswith("1 ") and "MemoryError" in child and "allocated" not in child, child
    assert outcomes["cpu_spin"]["failure"] == "cpu_time", outcomes["cpu_spin"]
    assert outcomes["sleep"]["failure"] == "wall_time" and outcomes["sleep"]["stdout"] == "up 3\n", outcomes["sleep"]
    left = subprocess.run(["pgrep", "-f", places["marker"]], capture_output=True, text=True).stdout.split()
    assert left == [], f"processes of the timed-out call outlived the sandbox: {left}"
    printed = outcomes["print_forever"]
    assert printed["failure"] == "output" and len(printed["stdout"]) <= LIMITS.max_output_chars, printed["error"]
    traced = outcomes["ptrace_and_signal"]["stdout"]
    assert "ptrace -1 1" in traced and "SIGNALLED" not in traced, traced  # EPERM
    for pid in (places["test_pid"], places["parent_pid"]):
        assert f"kill {pid} ProcessLookupError" in traced, traced
    widened = outcomes["mount_unshare_chroot_setuid"]["stdout"]
    for call in ("mount", "unshare-user", "unshare-mount", "clone-user", "chroot"):
        assert f"{call} -1" in widened, widened
    # setuid(0): EPERM without capabilities, EINVAL where uid 0 is not even mapped (a user namespace)
    assert "BECAME" not in widened and "setuid " in widened and "setgid " in widened, widened
    proc = outcomes["host_proc"]["stdout"]
    assert f"/proc/{places['test_pid']}/cmdline FileNotFoundError" in proc and "pytest" not in proc, proc
    assert int(proc.split()[1]) <= 3, proc  # the sandbox's init, the interpreter: nothing of the host
    status = outcomes["privileges"]["stdout"]
    for line in ("CapEff:\\t0000000000000000", "CapBnd:\\t0000000000000000", "NoNewPrivs:\\t1", "Seccomp:\\t2"):
        assert line in status, status
    uid = int(re.search(r"Uid:\\t(\d+)", status).group(1))  # nobody in a user namespace, else the run's own
    assert uid == bubblewrap.NOBODY or uid in bubblewrap.RUN_UIDS, status
    if "x32_abi" in outcomes:
        assert outcomes["x32_abi"]["failure"] == "crash" and "SIGSYS" in outcomes["x32_abi"]["error"]


@pytest.fixture
def listener():
    """A real server on 127.0.0.1 in the test's network namespace; yields (port, accepted())."""
    server = socket.create_server(("127.0.0.1", 0))
    server.setblocking(False)

    def accepted() -> bool:
        try:
            server.accept()[0].close()
            return True
        except BlockingIOError:
            return False

    socket.create_connection(server.getsockname(), timeout=2).close()  # the host reaches it
    assert accepted()
    yield server.getsockname()[1], accepted
    server.close()


def plant(root: Path, token: str, owner: int | None = None) -> dict:
    """A private 0600 file, an artifact store and a Prefect home under `root`, each holding `token`."""
    artifact = root / "store" / "grpo" / "0123abcd" / "artifact.json"
    artifact.parent.mkdir(parents=True)
    artifact.write_text(json.dumps({"id": "0123abcd", "secret": token}))
    (root / "prefect").mkdir()
    (root / "prefect" / "profiles.toml").write_text(f'api_key = "{token}"\n')
    private = root / "private.txt"
    private.write_text(token)
    private.chmod(0o600)
    if owner is not None:
        for path in [root, *root.rglob("*")]:
            os.chown(path, owner, owner)
    return {
        "token": token,
        "private": str(private),
        "store": str(root / "store"),
        "artifact": str(artifact),
        "prefect": str(root / "prefect"),
        "outside": str(root / "written-from-the-sandbox"),
        "marker": f"bomb-{token[-8:]}",
    }


def host_words() -> list[str]:
    """Names that would show the host's root home, or this test, leaked into the sandbox."""
    home = (
        [name for name in os.listdir("/root") if name.startswith(".") and len(name) > 3]
        if os.access("/root", os.R_OK)
        else []
    )
    return [*home[:10], "PYTEST_CURRENT_TEST"]


@pytest.mark.skipif(os.geteuid() != 0, reason="the battery as root needs root")
def test_the_escape_battery_is_contained_as_root(tmp_path, listener, monkeypatch):
    port, accepted = listener
    token = f"TFSECRET{secrets.token_hex(8)}"
    places = {**plant(tmp_path, token), "port": port, "test_pid": os.getpid(), "parent_pid": os.getppid()}
    monkeypatch.setenv("PREFECT_HOME", places["prefect"])
    monkeypatch.setenv("TRAINFLOW_TEST_SECRET", token)
    check(run_battery(places), places, host_words())
    assert not accepted(), "a sandboxed connection reached the listener"


DRIVER = """
import json, sys
sys.path[:0] = json.loads(sys.argv[1])
import test_sandbox
print(json.dumps(test_sandbox.run_battery(json.loads(sys.argv[2]))))
"""


def ordinary_python() -> str | None:
    """An interpreter an ordinary user can run that matches this one's version, for the venv's
    packages: this one if its files are world-readable, else the system's (/usr/bin)."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    candidates = ((os.path.realpath(sys._base_executable), sys.base_prefix), (f"/usr/bin/{version}", "/usr"))
    for candidate, prefix in candidates:
        code = f"import sys; sys.exit(sys.prefix != {prefix!r})"  # it found its own standard library
        user = ["setpriv", f"--reuid={ORDINARY_UID}", f"--regid={ORDINARY_UID}", "--clear-groups"]
        if os.path.exists(candidate) and subprocess.run([*user, candidate, "-I", "-c", code]).returncode == 0:
            return candidate
    return None


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="switching to a user needs root")
def test_the_escape_battery_is_contained_as_an_ordinary_user(listener):
    """The same battery from a trainflow run by uid 12345 (bwrap then makes a user namespace):
    its own private file and store, readable by it on the host, are absent in the sandbox."""
    python = ordinary_python()
    if python is None:
        pytest.skip(f"no Python {sys.version_info[:2]} that uid {ORDINARY_UID} may run (this one is under /root)")
    port, accepted = listener
    token = f"TFSECRET{secrets.token_hex(8)}"
    home = Path(tempfile.mkdtemp(prefix="trainflow-user-"))
    try:
        places = {**plant(home, token, owner=ORDINARY_UID), "port": port}
        places.update(test_pid=os.getpid(), parent_pid=os.getppid())
        paths = [str(REPO / "tests"), str(REPO), sysconfig.get_path("purelib"), sysconfig.get_path("platlib")]
        env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "PREFECT_HOME": places["prefect"], "SECRET": token}
        out = subprocess.run(
            ["setpriv", f"--reuid={ORDINARY_UID}", f"--regid={ORDINARY_UID}", "--clear-groups", "--inh-caps=-all"]
            + [python, "-c", DRIVER, json.dumps(paths), json.dumps(places)],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        assert Path(places["private"]).stat().st_uid == ORDINARY_UID  # the user could read it on the host
        check(json.loads(out.stdout.strip().splitlines()[-1]), places, host_words())
        assert not accepted(), "a sandboxed connection reached the listener"
    finally:
        shutil.rmtree(home, ignore_errors=True)


# --------------------------------------------------------------------------- limits and results


def test_ordinary_code_runs_in_a_private_scratch_directory():
    result = run("import os\nopen('out.txt', 'w').write('hi')\nprint(os.getcwd(), sorted(os.listdir('.')))")
    assert result.ok and result.exit_code == 0 and result.failure is None, result
    assert result.stdout == "/sandbox ['main.py', 'out.txt']\n" and result.isolation == ["bubblewrap", "seccomp"]
    assert run("print(sum(range(10)))").observation() == "45\n"
    assert run("import os\nprint(os.listdir('.'))").stdout == "['main.py']\n"  # a fresh one each run
    pool = "import multiprocessing as mp\nwith mp.Pool(2) as pool:\n    print(pool.map(abs, [-1, -2]))"
    assert run(pool).stdout == "[1, 2]\n"  # child processes, semaphores in /dev/shm


def test_a_busy_loop_is_stopped_by_the_cpu_limit():
    result = run("while True:\n    pass")
    assert not result.ok and result.killed and result.failure == "cpu_time"
    assert "CPU-time limit of 1 s" in result.error, result.error


# The weaker mode's bootstrap where the kernel gives no PID namespace (nor a mount namespace):
# only its last attempt, a network namespace, is left.
NO_PID_NAMESPACE = (
    '    [NEWNS | NEWNET | NEWPID, ["mntns", "netns", "pidns"]],\n    [NEWNET | NEWPID, ["netns", "pidns"]],\n'
)


@pytest.mark.parametrize("isolation", ["bubblewrap", "namespaces", "namespaces-without-pidns"])
def test_nothing_a_call_started_outlives_it(isolation, monkeypatch):
    """A child, a double-forked daemon and a setsid() child, all sleeping: none is left on the
    host after the call, whether the code exits at once or sleeps past the wall-time limit.
    (Before, a timed-out call as root left bwrap's PID namespace running: the group kill missed
    the setsid()ed init and bwrap, without CAP_KILL, could not signal the run's uid.)"""
    if isolation == "namespaces-without-pidns":  # the bootstrap, a child subreaper, ends the tree itself
        assert NO_PID_NAMESPACE in sandbox.NAMESPACES_BOOTSTRAP
        monkeypatch.setattr(sandbox, "NAMESPACES_BOOTSTRAP", sandbox.NAMESPACES_BOOTSTRAP.replace(NO_PID_NAMESPACE, ""))
    limits = LIMITS.model_copy(update={"isolation": isolation.split("-")[0], "wall_seconds": 3.0})
    marker = f"left-{secrets.token_hex(6)}"
    for then, failure in (("", None), ("time.sleep(60)", "wall_time")):
        result = run(LEAVE_BEHIND.format(marker=marker) + then, limits)
        assert result.failure == failure and result.stdout == "up 3\n", result
        assert processes_with(marker) == [], f"{isolation}: processes of the call outlived it ({then or 'exit'})"
    if isolation == "namespaces-without-pidns":
        assert result.isolation == ["netns"], result.isolation


def test_nothing_outlives_a_trainflow_killed_mid_call():
    """The process that runs the sandbox is SIGKILLed mid-call (an OOM kill, a preemption): both
    modes' processes go with it (bwrap's PID 1 reads EOF on the call's pipe; the namespaces
    bootstrap gets the parent-death signal), within the 30 s this waits."""
    marker = f"orphan-{secrets.token_hex(6)}"
    code = LEAVE_BEHIND.format(marker=marker) + "time.sleep(60)"
    driver = (
        f"import sys, threading\nsys.path.insert(0, {str(REPO)!r})\n"
        "from engine.posttrain.sandbox import SandboxLimits, run_python\n"
        "for isolation in ('bubblewrap', 'namespaces'):\n"
        "    limits = SandboxLimits(isolation=isolation, wall_seconds=60)\n"
        "    threading.Thread(target=run_python, args=(sys.argv[1], limits)).start()"
    )
    trainflow = subprocess.Popen([sys.executable, "-c", driver, code])
    try:
        deadline = time.monotonic() + 60
        while len(processes_with(marker)) < 6 and time.monotonic() < deadline and trainflow.poll() is None:
            time.sleep(0.1)
        assert len(processes_with(marker)) == 6, "both calls started their three sleepers"
    finally:
        trainflow.kill()
        trainflow.wait()
    deadline = time.monotonic() + 30
    while processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = processes_with(marker)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert left == [], f"{len(left)} processes of the calls outlived the process that ran them"


@pytest.mark.parametrize("pidfds", [True, False], ids=["pidfds", "pids"])
def test_a_tree_is_found_and_killed_whole_from_outside(pidfds, monkeypatch):
    """Outside any sandbox: the tree under a process whose children setsid() is the same read
    from the kernel's lists of children (where it keeps them) and from every process's parent,
    and kill_tree leaves none of it running, through pidfds or (a kernel before 5.3) pids."""
    if not pidfds:

        def no_pidfds(pid: int) -> int:
            raise OSError(errno.ENOSYS, "pidfd_open")

        monkeypatch.setattr(os, "pidfd_open", no_pidfds)
    code = "import os, time\nfor _ in range(2):\n    if os.fork() == 0:\n        os.setsid()\n"
    code += "        time.sleep(60)\ntime.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 30
        while len(scan_tree(proc.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        tree = scan_tree(proc.pid)
        assert len(tree) == 3 and sorted(process_tree(proc.pid)) == sorted(tree), (tree, process_tree(proc.pid))
        assert kill_tree(proc.pid) == 3
    finally:
        proc.kill()
    assert proc.wait() == -signal.SIGKILL

    def running(pid: int) -> bool:  # a zombie waits for its parent (here the host's init) to reap it
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
        except OSError:
            return False

    assert not [pid for pid in tree if running(pid)]


@pytest.mark.parametrize("isolation", ["bubblewrap", "namespaces"])
def test_a_tree_past_the_memory_limit_is_killed_as_one(isolation):
    """Three children of 60 MB each, every one within the 128 MB a process may map, together
    past the run's 128 MB: the run is killed, its error the sentence the policy reads."""
    child = "x = b'x' * (60 << 20)\nimport time\ntime.sleep(60)"
    code = (
        f"import subprocess, sys, time\nfor _ in range(3):\n    subprocess.Popen([sys.executable, '-c', {child!r}])\n"
    )
    # processes well above the three: the process limit counts the uid's other processes too (a
    # parallel test run's), and this test is about memory
    limits = LIMITS.model_copy(update={"isolation": isolation, "memory_mb": 128, "max_processes": 64})
    result = run(code + "time.sleep(60)", limits)
    said = "the code's processes together used more than 128 MB of memory (the limit) and were killed"
    assert result.failure == "memory" and result.killed and result.error == said, result
    assert f"error: {said}" in result.observation()


def test_a_10_gb_allocation_is_a_memory_error():
    result = run("x = bytearray(10 * 10**9)\nprint('allocated')")
    assert not result.ok and "allocated" not in result.stdout and result.failure == "memory"
    assert "out of memory: the sandbox allows 512 MB" in result.error


def test_a_file_past_the_size_limit_and_a_full_scratch_are_refused():
    result = run("open('big', 'wb').write(b'x' * (3 << 20))", LIMITS.model_copy(update={"file_size_mb": 2}))
    assert result.failure == "file_size" and "limit of 2 MB" in result.error, result
    code = "for i in range(5):\n    open(f'/tmp/{i}', 'wb').write(b'x' * (1 << 20))"
    result = run(code, LIMITS.model_copy(update={"scratch_mb": 3}))
    assert result.failure == "file_size" and "scratch space of 3 MB" in result.error, result


def test_output_is_cut_and_a_printing_loop_is_killed_at_the_output_limit():
    result = run("print('x' * 500)", LIMITS.model_copy(update={"max_output_chars": 100}))
    assert result.ok and result.stdout == "x" * 100  # cut, not an error
    limits = LIMITS.model_copy(update={"max_output_chars": 100, "max_output_bytes": 5000})
    result = run("import sys\nwhile True:\n    sys.stderr.write('y' * 1000)", limits)
    assert result.killed and result.failure == "output" and len(result.stderr) <= 100
    assert result.error == "the code printed more than 5000 bytes (the output limit) and was killed"


def test_a_crash_of_the_interpreter_is_reported_as_one():
    result = run("import ctypes\nctypes.string_at(0)")
    assert result.failure == "crash" and result.error == "the interpreter crashed (SIGSEGV)", result


def test_whitelisted_modules_are_importable_and_nothing_else_is():
    result = run("import yaml")
    assert result.failure == "error" and "ModuleNotFoundError: No module named 'yaml'" in result.error
    result = run("import yaml\nprint(yaml.safe_dump({'a': 1}))", LIMITS.model_copy(update={"modules": ["yaml"]}))
    assert result.ok and result.stdout == "a: 1\n\n", result
    numpy = LIMITS.model_copy(update={"modules": ["numpy"], "memory_mb": 1024})
    result = run("import numpy as np\nprint(int(np.arange(10).sum()))", numpy)  # with its numpy.libs
    assert result.ok and result.stdout == "45\n", result
    with pytest.raises(SandboxUnavailable, match="sandbox.modules: no module 'no_such_module_xyz'"):
        run_python("pass", LIMITS.model_copy(update={"modules": ["no_such_module_xyz"]}))
    with pytest.raises(ValueError, match="top-level module names"):
        SandboxLimits(modules=["os.path"])


def test_a_missing_bwrap_is_a_clear_error_and_never_a_weaker_mode(monkeypatch):
    monkeypatch.setattr(bubblewrap, "BWRAP", "bwrap-not-installed-xyz")
    with pytest.raises(SandboxUnavailable, match="install the `bubblewrap` package") as raised:
        run_python("print(1)")
    assert "isolation: namespaces" in str(raised.value)
    monkeypatch.setattr("engine.posttrain.sandbox._checked", set())  # the environment checks it too
    cfg = EnvironmentConfig(factory="tools", kwargs={"tools": ["python"]})
    with pytest.raises(ConfigError, match="not installed: install the `bubblewrap` package"):
        load_environment(cfg)
    load_environment(EnvironmentConfig(factory="tools", kwargs={"tools": ["calculator"]}))  # no sandbox, no bwrap


def test_the_weaker_mode_runs_only_when_asked_for_and_says_so():
    weaker = LIMITS.model_copy(update={"isolation": "namespaces"})
    result = run("print(6 * 7)", weaker)
    assert result.ok and result.stdout == "42\n"
    weaker_ones = (["netns", "pidns", "read-only-fs"], ["netns", "pidns"], ["netns"], ["audit-hook"])
    assert result.isolation in weaker_ones, result.isolation
    result = run("import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)", weaker)
    assert result.failure == "network" and result.error == "the code tried to use the network: the sandbox has none"
    env = ToolEnvironment(tools=["python"], sandbox={"isolation": "namespaces"})
    assert env.sandbox_isolation == "namespaces" and ToolEnvironment(tools=["python"]).sandbox_isolation == "bubblewrap"
    with pytest.raises(ConfigError, match="environment.kwargs.sandbox.isolation: Input should be 'bubblewrap' or"):
        ToolEnvironment(tools=["python"], sandbox={"isolation": "none"})


def test_the_weaker_mode_writes_nothing_on_the_host(tmp_path):
    """In the namespaces mode the host's file system is read-only and /tmp, /var/tmp and
    /dev/shm are private tmpfs: what the code writes there is gone with the run (before, it
    wrote to the host's /tmp, and anywhere its uid could)."""
    shared = tmp_path / "world-writable"
    shared.mkdir()
    shared.chmod(0o1777)  # even nobody could write here
    name = f"trainflow-test-{secrets.token_hex(6)}"
    targets = [f"/tmp/{name}", f"/var/tmp/{name}", f"/dev/shm/{name}", str(shared / name), name]
    code = f"import os\nfor path in {targets!r}:\n    try:\n        open(path, 'w').write('x')\n"
    code += "        print('wrote', path, open(path).read())\n    except OSError as e:\n"
    code += "        print('refused', path, type(e).__name__)"
    result = run(code, LIMITS.model_copy(update={"isolation": "namespaces"}))
    assert result.isolation == ["netns", "pidns", "read-only-fs"], result.isolation
    for path in targets[:3] + targets[4:]:  # its own /tmp, /var/tmp, /dev/shm and working directory
        assert f"wrote {path} x" in result.stdout, result.stdout
    assert f"refused {targets[3]}" in result.stdout, result.stdout
    assert not [path for path in targets[:4] if os.path.exists(path)], "the code wrote on the host"


def test_the_audit_hook_fallback_refuses_sockets():
    """Where namespaces are refused, the weaker mode's audit hook is what stops the network:
    run that branch directly (the same hook, installed in a plain interpreter)."""
    hook = sandbox.NAMESPACES_BOOTSTRAP.split('if "netns" not in isolation:\n')[1].split("del ctypes")[0]
    code = "import sys, textwrap\n" + "exec(textwrap.dedent('''" + hook + "'''))\n"
    code += "import socket\ntry:\n    socket.socket()\nexcept PermissionError as e:\n    print('refused:', e)\n"
    out = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=30)
    assert "refused: network access is disabled in the sandbox" in out.stdout, out


def test_a_failing_tool_call_is_the_models_observation_and_its_kind_is_counted():
    env = ToolEnvironment(tools=["python"], sandbox={"wall_seconds": 2.0, "cpu_seconds": 1})
    env.reset({"prompt": "p", "answer": "1"})
    call = '<tool_call>{"name": "python", "arguments": {"code": "%s"}}</tool_call>'
    step = env.step(call % "import time\\ntime.sleep(30)")
    assert not step.done and step.tool_calls == 1 and step.tool_errors == 1
    assert step.tool_failures == {"wall_time": 1}
    assert step.observation.startswith("\n<tool_response>\nerror: the code ran past the wall-time limit of 2 s")
    step = env.step(call % "print(6 * 7)")
    assert step.tool_errors == 0 and step.tool_failures == {}
    assert step.observation == "\n<tool_response>\n42\n</tool_response>\n"
    step = env.step(call % "print(1)\\n1/0" + call % "import ctypes\\nctypes.string_at(0)")
    assert step.tool_errors == 2 and step.tool_failures == {"error": 1, "crash": 1}
    assert "error: the code exited with status 1: ZeroDivisionError" in step.observation
    assert "output before it failed:\n1\n" in step.observation and "crashed (SIGSEGV)" in step.observation
    assert set(step.tool_failures) <= set(FAILURE_KINDS)


def test_concurrent_runs_do_not_share_their_scratch_or_tmp():
    from concurrent.futures import ThreadPoolExecutor

    code = "import os, time\nopen('/tmp/mine', 'w').write(str({i}))\ntime.sleep(0.5)\n"
    code += "print(open('/tmp/mine').read(), sorted(os.listdir('/tmp')), sorted(os.listdir('.')))"
    start = time.monotonic()
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda i: run(code.format(i=i)), range(3)))
    assert [r.stdout for r in results] == [f"{i} ['mine'] ['main.py']\n" for i in range(3)], results
    assert time.monotonic() - start < 60


def test_a_fork_bomb_does_not_starve_a_concurrent_run():
    """Each run's processes are counted on their own (its user namespace, or as root a uid
    of its own): a run that holds its whole process limit leaves a concurrent one its own."""
    from concurrent.futures import ThreadPoolExecutor

    bomb = "import os, time\nheld = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
    bomb += "            time.sleep(30)\n            os._exit(0)\n        held += 1\nexcept OSError:\n"
    bomb += "    print('held', held)\n    time.sleep(8)"
    forks = "import os\nfor _ in range(4):\n    pid = os.fork()\n    if pid == 0:\n        os._exit(0)\n"
    forks += "    os.waitpid(pid, 0)\nprint('forked 4')"
    with ThreadPoolExecutor(2) as pool:
        holding = pool.submit(run, bomb)
        time.sleep(3)  # the bomb holds its limit by now
        other = pool.submit(run, forks).result()
        held = holding.result()
    assert held.stdout.startswith("held ") and int(held.stdout.split()[1]) >= LIMITS.max_processes - 2, held
    assert other.ok and other.stdout == "forked 4\n", other


def test_the_seccomp_filter_refuses_what_escapes_namespaces_with_eperm():
    """Each call the filter lists fails with EPERM whatever its arguments (the kernel would
    say EINVAL, EFAULT or ENOSYS to these zeros), clone3 with ENOSYS (so libc uses clone)."""
    from engine.posttrain.seccomp import DENIED, _library

    lib = _library()
    numbers = {name: lib.seccomp_syscall_resolve_name(name.encode()) for name in DENIED}
    numbers = {name: nr for name, nr in numbers.items() if nr >= 0}
    numbers["clone3"] = lib.seccomp_syscall_resolve_name(b"clone3")
    code = f"import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nfor name, nr in {sorted(numbers.items())!r}:\n"
    code += "    rc = libc.syscall(nr, 0, 0, 0, 0, 0, 0)\n    print(name, rc, ctypes.get_errno())"
    result = run(code)
    assert result.ok, result
    seen = {line.split()[0]: line.split()[1:] for line in result.stdout.splitlines()}
    assert seen.pop("clone3") == ["-1", "38"]  # ENOSYS
    assert len(seen) >= 30 and all(out == ["-1", "1"] for out in seen.values()), seen
