"""The Python sandbox: each limit stops what it is for, quickly, with an error that says which
limit it was; the network is gone (loopback and outside, DNS); nothing outlives a run."""

import socket
import subprocess
import sys
import time

import pytest

from engine.posttrain.environments import ToolEnvironment
from engine.posttrain.sandbox import SandboxLimits, run_python

LIMITS = SandboxLimits(cpu_seconds=1, wall_seconds=20, memory_mb=512, max_processes=8)


def run(code: str, limits: SandboxLimits = LIMITS):
    result = run_python(code, limits)
    assert result.isolation, "the bootstrap ran and said how it isolated the code"
    return result


def test_ordinary_code_runs_in_its_own_temporary_directory_and_it_is_removed():
    result = run("import os\nopen('out.txt', 'w').write('hi')\nprint(os.getcwd(), sorted(os.listdir('.')))")
    assert result.ok and result.exit_code == 0, result
    cwd = result.stdout.split()[0]
    assert "trainflow-sandbox-" in cwd and "out.txt" in result.stdout
    assert not __import__("os").path.exists(cwd)
    assert run("print(sum(range(10)))").observation() == "45\n"


def test_a_busy_loop_is_stopped_by_the_cpu_limit():
    result = run("while True:\n    pass")
    assert not result.ok and result.killed
    assert "CPU-time limit of 1 s" in result.error, result.error


def test_a_sleeping_child_is_stopped_by_the_wall_limit_with_its_group():
    result = run("import time\ntime.sleep(60)", LIMITS.model_copy(update={"wall_seconds": 1.0}))
    assert result.killed and "wall-time limit of 1 s" in result.error
    assert result.seconds < 10  # not the 60 s the code asked for


def test_a_fork_bomb_stops_at_the_process_limit_and_leaves_nothing_behind():
    marker = f"bomb-{time.time_ns()}"
    # Every process forks for ever; every other child becomes a sleeper named `marker`.
    code = "import os\nn = 0\nwhile True:\n    n += 1\n    if os.fork() == 0 and n % 2 == 0:\n"
    code += f"        os.execv('/bin/sleep', ['{marker}', '30'])"
    result = run(code)
    assert not result.ok
    assert "more than 8 processes or threads" in result.error, result.error
    left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()
    assert left == [], f"processes of the fork bomb outlived the sandbox: {left}"


def test_a_10_gb_allocation_is_a_memory_error():
    result = run("x = bytearray(10 * 10**9)\nprint('allocated')")
    assert not result.ok and "allocated" not in result.stdout
    assert "out of memory: the sandbox allows 512 MB" in result.error


@pytest.fixture
def local_server():
    """A listening socket on 127.0.0.1 in the test's own (real) network namespace."""
    server = socket.create_server(("127.0.0.1", 0))
    yield server.getsockname()[1]
    server.close()


def test_no_network_loopback_external_or_dns(local_server):
    # The parent reaches its own server; the sandbox cannot.
    socket.create_connection(("127.0.0.1", local_server), timeout=2).close()
    for code in (
        f"import socket\nsocket.create_connection(('127.0.0.1', {local_server}), timeout=2)\nprint('connected')",
        "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)\nprint('connected')",
        "import socket\nprint(socket.getaddrinfo('example.com', 80))",
    ):
        result = run(code)
        assert not result.ok and "connected" not in result.stdout, result
        assert result.error == "the code tried to use the network: the sandbox has none", result
        assert result.seconds < 10
        # Which mechanism cut it: the kernel's network namespace where allowed, else the hook.
        assert result.isolation in (["netns", "pidns"], ["netns"], ["audit-hook"]), result.isolation


def test_the_audit_hook_fallback_refuses_sockets(tmp_path):
    """Where namespaces are refused, the bootstrap's audit hook is what stops the network:
    run that branch directly (the same hook, installed in a plain interpreter)."""
    from engine.posttrain import sandbox

    hook = sandbox.BOOTSTRAP.split('if "netns" not in isolation:\n')[1].split("del ctypes")[0]
    code = "import sys, textwrap\n" + "exec(textwrap.dedent('''" + hook + "'''))\n"
    code += "import socket\ntry:\n    socket.socket()\nexcept PermissionError as e:\n    print('refused:', e)\n"
    out = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=30)
    assert "refused: network access is disabled in the sandbox" in out.stdout, out


def test_output_is_cut_and_a_printing_loop_cannot_fill_memory():
    limits = LIMITS.model_copy(update={"wall_seconds": 1.0, "max_output_chars": 100})
    result = run("while True:\n    print('x' * 1000)", limits)
    assert result.killed and len(result.stdout) <= 100


def test_the_python_tool_reports_a_hang_as_an_error_observation():
    env = ToolEnvironment(tools=["python"], sandbox={"wall_seconds": 1.0, "cpu_seconds": 1})
    env.reset({"prompt": "p", "answer": "1"})
    step = env.step('<tool_call>{"name": "python", "arguments": {"code": "while True: pass"}}</tool_call>')
    assert not step.done and step.tool_calls == 1 and step.tool_errors == 1
    assert step.observation.startswith("\n<tool_response>\nerror: the code ran past the wall-time limit of 1 s")
    step = env.step('<tool_call>{"name": "python", "arguments": {"code": "print(6 * 7)"}}</tool_call>')
    assert step.tool_errors == 0 and step.observation == "\n<tool_response>\n42\n</tool_response>\n"
    step = env.step('<tool_call>{"name": "python", "arguments": {"code": "print(1)\\n1/0"}}</tool_call>')
    assert step.tool_errors == 1 and "error: the code exited with status 1: ZeroDivisionError" in step.observation
    assert step.observation.endswith("output before it failed:\n1\n</tool_response>\n")
