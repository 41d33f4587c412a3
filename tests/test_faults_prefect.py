"""Faults around Prefect: its API dies, hangs or was never there; Ctrl-C; SIGKILL of trainflow.

Prefect observes a pipeline and never holds it up (flows/reporter.py), and the local server
trainflow starts when no PREFECT_API_URL is set lives in its own session and dies with its
parent (flows/server.py). Real `trainflow run` processes, real Prefect servers, toy stages
(tests/pipeline_toys.py) that run in seconds: the engine is not the point here.
"""

import http.server
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import yaml
from prefect.artifacts import update_progress_artifact

from flows.reporter import Reporter
from flows.server import start_server
from tests.conftest import REPO

pytestmark = pytest.mark.slow

LOCAL_SERVER = re.compile(r"local server at (\S+) \(pid (\d+)\)")


@pytest.fixture(scope="module")
def prefect_home(tmp_path_factory) -> Path:
    """One PREFECT_HOME (its SQLite database) for the servers these tests start, so that only
    the first start pays for creating the database."""
    return tmp_path_factory.mktemp("prefect-home")


def write_pipeline(tmp_path: Path, name: str, stages: dict) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(
        yaml.safe_dump(
            {"name": name, "store": str(tmp_path / "store"), "imports": ["tests.pipeline_toys"], "stages": stages}
        )
    )
    return path


def env_with(**values: str | None) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for name, value in values.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def start_trainflow(path: Path, env: dict, **popen) -> subprocess.Popen:
    """`trainflow run` in the background, its output in files (a full pipe would block it)."""
    out, err = path.with_suffix(".out"), path.with_suffix(".err")
    with open(out, "w") as stdout, open(err, "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "flows.cli", "run", str(path)],
            cwd=REPO,
            env=env,
            stdout=stdout,
            stderr=stderr,
            **popen,
        )
    proc.outputs = (out, err)
    return proc


def wait_for(condition, proc: subprocess.Popen, what: str, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if proc.poll() is not None:
            raise AssertionError(
                f"trainflow exited ({proc.returncode}) before {what}:\n"
                + "\n".join(p.read_text()[-3000:] for p in proc.outputs)
            )
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def statuses(stdout: str) -> dict[str, str]:
    """stage -> status from the table `trainflow run` prints."""
    lines = stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("stage "))
    rows = []
    for line in lines[header + 1 :]:
        if not line.strip():  # reports and lineage follow the table
            break
        rows.append(line.split())
    return {row[0]: row[2] for row in rows}


def not_prefect_info(stderr: str) -> list[str]:
    """stderr without Prefect's INFO log lines: what a user would read as trouble."""
    return [line for line in stderr.splitlines() if line.strip() and "| INFO    |" not in line]


def process_gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")  # a zombie waits only for its reaper


def port_closed(url: str) -> bool:
    host, port = re.match(r"http://([^:/]+):(\d+)", url).groups()
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
    except OSError:
        return True
    return False


# --------------------------------------------------------------------------- the API goes away


# Prefect's events worker lagging behind, as on a loaded machine (where CI once saw it): the
# events it takes up after the API died need API reads to be tagged, and each was an error line.
LAGGING_EVENTS_WORKER = """
import sys
if "flows.cli" in sys.orig_argv:
    import asyncio
    from prefect.events.worker import EventsWorker
    handle = EventsWorker._handle
    async def lagging(self, event):
        await asyncio.sleep(1.5)
        return await handle(self, event)
    EventsWorker._handle = lagging
"""


def test_a_prefect_server_killed_mid_stage_costs_one_warning_not_the_run(prefect_home, tmp_path):
    path = write_pipeline(
        tmp_path,
        "observed",
        {
            "train": {"task": "toy-child", "config": {"steps": 60, "step_seconds": 0.05}},
            "src": {"task": "toy-source", "config": {"value": 3, "sleep": 1.5}},
            "after": {"task": "toy-sum", "inputs": {"a": "src"}},  # starts once the API is gone
        },
    )
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(LAGGING_EVENTS_WORKER)
    server = start_server(env={"PREFECT_HOME": str(prefect_home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"})
    try:
        proc = start_trainflow(
            path, env_with(PREFECT_API_URL=server.api_url, PYTHONPATH=f"{tmp_path / 'site'}{os.pathsep}{REPO}")
        )
        wait_for(lambda: list((tmp_path / "store").glob("train/*/metrics.jsonl")), proc, "train started")
        server.kill()
        killed_at = time.monotonic()
        proc.wait(timeout=120)
        seconds_after_kill = time.monotonic() - killed_at
    finally:
        server.kill()
    out, err = (p.read_text() for p in proc.outputs)
    assert proc.returncode == 0, err[-3000:]
    assert statuses(out) == {"train": "ran", "src": "ran", "after": "ran"}
    # The stages ran at full speed (3 s of steps), not at the pace of API retries.
    train_seconds = float(next(line.split()[4] for line in out.splitlines() if line.startswith("train ")))
    assert train_seconds < 15 and seconds_after_kill < 30, (train_seconds, seconds_after_kill)
    trouble = not_prefect_info(err)
    assert len(trouble) == 1, err[-3000:]  # one line, and no traceback
    assert trouble[0].startswith(f"trainflow: warning: the Prefect API at {server.api_url} is not answering")
    for stage in ("train", "src", "after"):
        (manifest,) = (tmp_path / "store" / stage).glob("*/artifact.json")
        assert json.loads(manifest.read_text())["status"] == "complete"


def test_a_hanging_api_never_holds_up_a_stage():
    """An API that accepts connections and never answers: handing records over stays instant,
    the queue stays bounded (the rest is dropped), and one warning names the URL."""
    with socket.socket() as hole:
        hole.bind(("127.0.0.1", 0))
        hole.listen(64)  # the kernel completes connections; nobody ever reads them
        url = f"http://127.0.0.1:{hole.getsockname()[1]}/api"
        warnings: list[str] = []
        reporter = Reporter(url, max_pending=100, timeout=0.5, warn=warnings.append)
        started = time.perf_counter()
        for step in range(5000):
            reporter.call(update_progress_artifact, uuid.uuid4(), step / 50)
            reporter.log({"message": f"step {step}", "level": 20})
        handing_over = time.perf_counter() - started
        deadline = time.monotonic() + 10
        while not warnings and time.monotonic() < deadline:
            time.sleep(0.05)
        reporter.close(timeout=0)
    assert handing_over < 2.0, f"10000 records took {handing_over:.2f} s to hand over"
    assert reporter.dropped >= 10000 - 100 - 200  # at most a full queue and one batch got through
    (warning,) = warnings
    assert warning.startswith(f"trainflow: warning: the Prefect API at {url} is not answering (ReadTimeout")


def test_the_reporter_sends_over_one_kept_connection_and_opens_a_new_one_after_a_failure():
    """The reporter keeps one client for its posts: a client per record (an SSL context, a new
    connection) and Prefect's settings validated per record were most of a runner's CPU while
    its stages trained. A request the API fails drops that client; once a probe finds the API
    answering again, the next post opens a new one."""
    connections: list[list[str]] = []  # each connection's requests, in order
    statuses = iter([200] * 8 + [500] + [200] * 8)

    class Api(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: one connection carries many requests

        def setup(self):
            super().setup()
            self.requests: list[str] = []
            connections.append(self.requests)

        def do_POST(self):
            (record,) = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            self.requests.append(f"POST {self.path} {record['message']}")
            self.answer(next(statuses), b"[]")

        def do_GET(self):
            path = self.path.split("?")[0]
            self.requests.append(f"GET {path}")
            if path == "/api/csrf-token":  # as a Prefect server answers by default; a client asks once
                self.answer(422, b'{"detail": "CSRF protection is disabled."}')
            else:
                self.answer(200, b"true")

        def answer(self, status: int, body: bytes):
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Api)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/api"
    warnings: list[str] = []
    reporter = Reporter(url, timeout=5.0, probe_every=0.0, warn=warnings.append)
    try:
        for step in range(17):  # one record at a time: one request each
            reporter.log({"message": f"step {step}", "level": 20})
            assert reporter.flush(10)
    finally:
        reporter.close()
        server.shutdown()
        server.server_close()
    assert connections == [
        ["GET /api/csrf-token", *(f"POST /api/logs/ step {step}" for step in range(9))],  # the 9th got a 500
        ["GET /api/health"],  # the probe before the next record
        ["GET /api/csrf-token", *(f"POST /api/logs/ step {step}" for step in range(9, 17))],
    ]
    assert len(warnings) == 2, warnings
    down = f"trainflow: warning: the Prefect API at {url} is not answering (PrefectHTTPStatusError: Server error"
    assert warnings[0].startswith(down), warnings
    assert warnings[1] == f"trainflow: the Prefect API at {url} answers again; reporting resumed"


def test_an_unreachable_prefect_api_url_is_one_line(tmp_path):
    path = write_pipeline(tmp_path, "nowhere", {"only": {"task": "toy-source"}})
    url = "http://127.0.0.1:9/api"  # the discard port: nothing listens there
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "flows.cli", "run", str(path)],
        cwd=REPO,
        env=env_with(PREFECT_API_URL=url),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    (line,) = proc.stderr.strip().splitlines()
    assert line == (
        f"error: the Prefect API at {url} (PREFECT_API_URL) is unreachable; start it with "
        f"`prefect server start`, or unset PREFECT_API_URL to let trainflow start a local server "
        f"for the run"
    )
    assert not (tmp_path / "store").exists()  # nothing ran
    assert time.monotonic() - started < 30


# --------------------------------------------------------------------------- signals


def test_ctrl_c_to_the_process_group_stops_every_stage_with_143_and_the_rerun_resumes(
    prefect_server, prefect_home, tmp_path
):
    stages = {
        name: {
            "task": "toy-child",
            "retries": 2,
            "retry_delay_seconds": 0,
            "config": {"steps": steps, "step_seconds": 0.05},
        }
        # Long enough (200 s) that neither ends before both have started, however loaded the machine:
        # the SIGINT stops them long before that.
        for name, steps in (("a", 4000), ("b", 4002))
    }
    path = write_pipeline(tmp_path, "interrupted", stages)
    # No PREFECT_API_URL: trainflow starts its local server, which must not get the Ctrl-C.
    proc = start_trainflow(
        path, env_with(PREFECT_API_URL=None, PREFECT_HOME=str(prefect_home)), start_new_session=True
    )  # its own group, as a terminal's foreground job
    wait_for(lambda: len(list((tmp_path / "store").glob("*/*/metrics.jsonl"))) == 2, proc, "both stages started")
    server_url, server_pid = LOCAL_SERVER.search(proc.outputs[1].read_text()).groups()
    started = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does: the whole foreground process group
    proc.wait(timeout=60)
    seconds = time.monotonic() - started
    out, err = (p.read_text() for p in proc.outputs)
    assert proc.returncode == 143, err[-3000:]
    assert seconds < 30
    assert statuses(out) == {"a": "failed", "b": "failed"}
    assert "trainflow: SIGINT: asked 2 engine process(es) to checkpoint and exit" in err
    assert "Traceback" not in err and "Connection refused" not in err and "ConnectError" not in err
    own = [line for line in err.splitlines() if line.startswith("trainflow:")]  # Prefect's log lines aside
    assert LOCAL_SERVER.search(own[0]) and max(map(len, own)) <= 160, own  # a log view's width
    for stage in ("a", "b"):
        (out_dir,) = (tmp_path / "store" / stage).iterdir()
        assert (out_dir / "sigterm").exists()  # the engine got SIGTERM and checkpointed
        manifest = json.loads((out_dir / "artifact.json").read_text())
        assert manifest["status"] == "failed" and manifest["attempts"] == 1  # a stop is not retried
    assert process_gone(int(server_pid)) and port_closed(server_url)  # stopped with the run

    rerun = subprocess.run(
        [sys.executable, "-m", "flows.cli", "run", str(path), "a.step_seconds=0", "b.step_seconds=0"],
        cwd=REPO,
        env=env_with(PREFECT_API_URL=prefect_server),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert statuses(rerun.stdout) == {"a": "resumed", "b": "resumed"}


def test_sigkill_of_trainflow_takes_its_local_prefect_server_down(prefect_home, tmp_path):
    path = write_pipeline(
        tmp_path, "killed", {"train": {"task": "toy-child", "config": {"steps": 400, "step_seconds": 0.05}}}
    )
    proc = start_trainflow(path, env_with(PREFECT_API_URL=None, PREFECT_HOME=str(prefect_home)))
    wait_for(lambda: list((tmp_path / "store").glob("train/*/metrics.jsonl")), proc, "train started")
    server_url, server_pid = LOCAL_SERVER.search(proc.outputs[1].read_text()).groups()
    assert not process_gone(int(server_pid)) and not port_closed(server_url)
    proc.kill()  # trainflow alone: nobody gets to clean up
    proc.wait()
    deadline = time.monotonic() + 10
    while not (process_gone(int(server_pid)) and port_closed(server_url)):
        assert time.monotonic() < deadline, f"the Prefect server (pid {server_pid}) outlived trainflow"
        time.sleep(0.1)
