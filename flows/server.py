"""The Prefect API a run reports to: the configured one, checked, or a local one started for it.

Without PREFECT_API_URL, Prefect would start its own temporary server as a plain child of
`trainflow`: in the terminal's process group, so Ctrl-C reached it too and the run then
spent minutes retrying a dead API, and without a tie to its parent, so a SIGKILLed
`trainflow` left it running. trainflow starts the same server itself instead (uvicorn
serving Prefect's API app on a free loopback port, SQLite under PREFECT_HOME), in a session
of its own and with PR_SET_PDEATHSIG (tasks/launch/run.py's guard), and points PREFECT_API_URL
at it for the run. A configured PREFECT_API_URL that does not answer is one line, not a
traceback.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from prefect.context import refresh_global_settings_context
from prefect.settings import PREFECT_API_URL, get_current_settings

from tasks.launch.gang import guarded

# What Prefect sets for its own temporary server: the API only, without the UI and with
# the services an ephemeral server runs.
_SERVER_ENV = {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}


class ApiUnreachable(RuntimeError):
    """The Prefect API does not answer; the message is the one line a user sees."""


def api_answers(api_url: str, timeout: float = 2.0) -> bool:
    """Whether `<api_url>/health` answers 200 within `timeout` seconds."""
    try:
        with urllib.request.urlopen(f"{api_url.rstrip('/')}/health", timeout=timeout) as response:
            return response.status == 200
    except (OSError, ValueError):  # refused, timed out, a bad URL; HTTPError is an OSError
        return False


def check_api(api_url: str, timeout: float = 5.0) -> None:
    """Raise ApiUnreachable, one line saying how to fix it, unless the API answers."""
    if not api_answers(api_url, timeout):
        raise ApiUnreachable(
            f"the Prefect API at {api_url} (PREFECT_API_URL) is unreachable; start it with `prefect server "
            f"start`, or unset PREFECT_API_URL to let trainflow start a local server for the run"
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LocalServer:
    """A Prefect API server that trainflow started, and stops."""

    process: subprocess.Popen
    port: int

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self, timeout: float = 5.0) -> None:
        if self.process.poll() is None:
            _signal_group(self.process, signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _signal_group(self.process, signal.SIGKILL)
                self.process.wait()

    def kill(self) -> None:
        """Stop it at once, as a crash would (tests use this)."""
        _signal_group(self.process, signal.SIGKILL)
        self.process.wait()


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def start_server(
    env: dict[str, str] | None = None, timeout: float = 120.0, settings_env: dict[str, str] | None = None
) -> LocalServer:
    """Start a Prefect API server on a free loopback port and wait until it answers.

    It runs in a new session (the terminal's Ctrl-C goes to trainflow alone, which stops
    the stages and then the server) and dies with the thread that started it, even when
    `trainflow` is SIGKILLed: call this from the main thread. `env` adds to os.environ
    (e.g. another PREFECT_HOME); `settings_env` is Prefect's settings as variables, for
    settings that come from a Prefect profile rather than the environment.
    """
    deadline = time.monotonic() + timeout
    while True:
        port = _free_port()
        argv = [
            sys.executable,
            "-m",
            "uvicorn",
            "--factory",
            "prefect.server.api.server:create_app",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "error",
            "--lifespan",
            "on",
            "--timeout-graceful-shutdown",
            "3",
        ]
        with tempfile.TemporaryFile() as errors:  # uvicorn logs errors only; read if it fails to start
            process = subprocess.Popen(
                guarded(argv),
                env={**os.environ, **(settings_env or {}), **(env or {}), **_SERVER_ENV},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=errors,
                start_new_session=True,
            )
            server = LocalServer(process, port)
            while process.poll() is None and time.monotonic() < deadline:
                if api_answers(server.api_url, timeout=1.0):
                    return server
                time.sleep(0.1)
            errors.seek(0)
            error = errors.read().decode(errors="replace").strip()
        if process.poll() is None:  # still starting at the deadline
            server.stop()
            raise ApiUnreachable(
                f"the local Prefect server did not answer within {timeout:.0f} s; start one with "
                f"`prefect server start` and set PREFECT_API_URL=http://127.0.0.1:4200/api"
            )
        if "address already in use" not in error.lower():  # another process took the port: try another
            last = error.splitlines()[-1] if error else f"exit code {process.returncode}"
            raise ApiUnreachable(f"the local Prefect server did not start: {last}")


@contextmanager
def prefect_api(say: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)) -> Iterator[str]:
    """The API URL a run reports to, for the length of the block: PREFECT_API_URL (from the
    environment or the Prefect profile) if it answers, else a local server started here and
    stopped after the block. Raises ApiUnreachable (its message is for the user)."""
    configured = PREFECT_API_URL.value()
    if configured:
        check_api(configured)
        yield configured
        return
    server = start_server(settings_env=get_current_settings().to_environment_variables(exclude_unset=True))
    # Two lines: each fits a log view's width (160 characters) whatever the port and pid.
    say(f"trainflow: Prefect API: a local server at {server.api_url} (pid {server.pid}), for this run only")
    say("trainflow: `prefect server start` and PREFECT_API_URL keep one running, with its UI")
    # For this process (threads without a settings context too) and its children; an empty
    # UI URL, as the server has no UI to link to.
    run_env = {"PREFECT_API_URL": server.api_url, "PREFECT_UI_URL": ""}
    previous = {name: os.environ.get(name) for name in run_env}
    os.environ.update(run_env)
    refresh_global_settings_context()
    try:
        yield server.api_url
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        refresh_global_settings_context()
        server.stop()
