"""Screenshots of what a pipeline shows in the Prefect UI, for the docs (docs/img/*.png).

    python docs/screenshots.py [--store DIR] [--out docs/img]

Starts a Prefect server with its UI on a free loopback port (SQLite in a temporary
PREFECT_HOME), runs the tiny pipeline (60 pretraining steps) plus an evaluate stage
against it with `trainflow run`, then takes headless Chromium screenshots of:

    prefect-flow-run.png      the flow run page: the stages' graph, the run's tags, its log
    prefect-summary.png       the evaluate stage's summary artifact: metrics, lineage and
                              the report's plots (inlined as data: URIs), the task run's tags
    prefect-asset-event.png   the evaluate artifact's materialisation event: the asset, the
                              upstream assets it was made from, the task run that made it

Needs `chromium` on PATH (Debian: apt-get install chromium). A few minutes on a laptop CPU;
with `--store` pointing at an earlier run's store, the finished stages are skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
WINDOW = "1500,1100"
TALL = "1500,2700"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(url: str, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"{url} did not answer within {timeout:.0f} s")


def api(base: str, path: str, body: dict) -> list | dict:
    request = urllib.request.Request(
        f"{base}/api{path}", data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)


def pipeline(store: str) -> dict:
    """The tiny pipeline, shortened, with an evaluate stage whose report has plots."""
    spec = yaml.safe_load((REPO / "configs" / "pipelines" / "tiny.yaml").read_text())
    spec["name"], spec["store"] = "tiny-eval", store
    spec["stages"]["pretrain"]["config"].update(steps=60, eval_every=30, checkpoint={"every_steps": 20})
    spec["stages"]["evaluate"] = {
        "task": "evaluate",
        "inputs": {"dataset": "tokenize", "pretrain": "pretrain"},
        "config": {"loss_batches": 2},
    }
    return spec


def screenshot(chromium: str, url: str, out: Path, window: str = WINDOW) -> None:
    """The page after its scripts ran (virtual time lets the UI fetch and render)."""
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run(
            [
                chromium,
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--hide-scrollbars",
                "--run-all-compositor-stages-before-draw",
                f"--user-data-dir={profile}",
                f"--window-size={window}",
                "--virtual-time-budget=20000",
                f"--screenshot={out}",
                url,
            ],
            check=True,
            capture_output=True,
            timeout=180,
        )
    print(f"{out}  <- {url}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", help="artifact store (default: a temporary directory)")
    parser.add_argument("--out", default=str(REPO / "docs" / "img"))
    args = parser.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if not chromium:
        print("error: chromium is not on PATH (Debian: apt-get install chromium)", file=sys.stderr)
        return 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="trainflow-screenshots-"))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        "PREFECT_HOME": str(work / "prefect"),
        "PREFECT_API_URL": f"{base}/api",
        "PREFECT_UI_API_URL": f"{base}/api",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }
    server = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_for(f"{base}/api/health")
        spec_path = work / "tiny-eval.yaml"
        spec_path.write_text(yaml.safe_dump(pipeline(args.store or str(work / "store")), sort_keys=False))
        subprocess.run([sys.executable, "-m", "flows.cli", "run", str(spec_path)], env=env, cwd=REPO, check=True)

        (flow_run,) = api(base, "/flow_runs/filter", {"sort": "START_TIME_DESC", "limit": 1})
        artifacts = api(base, "/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [flow_run["id"]]}}})
        summary = next(a for a in artifacts if a["key"] == "tiny-eval-evaluate")
        evaluate = next(
            t
            for t in api(base, "/task_runs/filter", {"flow_runs": {"id": {"any_": [flow_run["id"]]}}})
            if t["name"] == "evaluate"
        )
        deadline = time.monotonic() + 60  # the server persists events in batches
        while (
            not (
                events := api(
                    base,
                    "/events/filter",
                    {
                        "limit": 50,
                        "filter": {
                            "event": {"prefix": ["prefect.asset.materialization"]},
                            "related": {"id": [f"prefect.task-run.{evaluate['id']}"]},
                        },
                    },
                )["events"]
            )
            and time.monotonic() < deadline
        ):
            time.sleep(2)
        screenshot(chromium, f"{base}/runs/flow-run/{flow_run['id']}", out / "prefect-flow-run.png")
        screenshot(chromium, f"{base}/artifacts/artifact/{summary['id']}", out / "prefect-summary.png", TALL)
        if events:
            screenshot(
                chromium,
                f"{base}/events/event/{events[0]['occurred'][:10]}/{events[0]['id']}",
                out / "prefect-asset-event.png",
            )
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
