"""Pipelines on a real local Prefect server, with cheap stage kinds (tests/pipeline_toys.py).

Each test reads its flow run, task runs, states and artifacts back through Prefect's client.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

import tests.pipeline_toys  # noqa: F401
from flows.pipeline import Pipeline, PipelineFailed, run_plan
from tests.conftest import REPO

pytestmark = pytest.mark.slow


def client():
    from prefect import get_client

    return get_client(sync_client=True)


def flow_run_of(result: dict):
    """The flow run that returned a pipeline result."""
    with client() as c:
        return c.read_flow_run(next(iter(result.values()))["flow_run_id"])


def task_runs_of(flow_run_id) -> dict:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with client() as c:
        runs = c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return {run.name: run for run in runs}


def artifacts_of(flow_run_id) -> list:
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with client() as c:
        return c.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))


def diamond(store: Path, trace: Path, a_value: int = 1) -> Pipeline:
    p = Pipeline("diamond", store=store)
    a = p.stage("a", task="toy-source", config={"value": a_value, "trace": str(trace)})
    b = p.stage("b", task="toy-source", config={"value": 2, "trace": str(trace)})
    ab = p.stage("ab", task="toy-sum", inputs={"a": a, "b": b}, config={"trace": str(trace)})
    p.stage("abb", task="toy-sum", inputs={"a": b, "b": ab}, config={"trace": str(trace)})
    return p


def test_a_pipeline_is_one_flow_run_with_a_task_run_and_artifacts_per_stage(prefect_server, tmp_path):
    result = run_plan(diamond(tmp_path / "store", tmp_path / "trace").plan())
    assert {s: r["status"] for s, r in result.items()} == {"a": "ran", "b": "ran", "ab": "ran", "abb": "ran"}
    assert result["abb"]["metrics"] == {"value": 2 + (1 + 2 + 1) + 1}

    flow_run = flow_run_of(result)
    assert flow_run.state.is_completed()
    task_runs = task_runs_of(flow_run.id)
    assert set(task_runs) == {"a", "b", "ab", "abb"}
    assert all(run.state.is_completed() and run.state.name == "Completed" for run in task_runs.values())

    # One summary and one progress artifact per stage.
    by_key = {a.key: a for a in artifacts_of(flow_run.id)}
    assert set(by_key) == {
        f"diamond-{stage}{suffix}" for stage in ("a", "b", "ab", "abb") for suffix in ("", "-progress")
    }
    for stage in ("a", "b", "ab", "abb"):
        assert by_key[f"diamond-{stage}"].type == "markdown"
        assert by_key[f"diamond-{stage}-progress"].type == "progress"
        assert by_key[f"diamond-{stage}-progress"].data == 100.0
    summary = by_key["diamond-ab"].data
    assert f"| a | a/{result['a']['artifact_id']} | dataset |" in summary and "| value | 4 |" in summary
    assert f"| location | `{result['ab']['path']}` |" in summary and "file://" not in summary


def test_rerun_skips_everything_and_a_config_change_reruns_only_descendants(prefect_server, tmp_path):
    store, trace = tmp_path / "store", tmp_path / "trace"
    first = run_plan(diamond(store, trace).plan())
    again = diamond(store, trace).run()  # the documented Python API (docs/pipelines.md)
    assert {r["status"] for r in again.values()} == {"skipped"}
    assert {s: r["artifact_id"] for s, r in again.items()} == {s: r["artifact_id"] for s, r in first.items()}
    task_runs = task_runs_of(flow_run_of(again).id)
    assert {run.state.name for run in task_runs.values()} == {"Skipped"}
    assert trace.read_text().split().count("a") == 1  # no work the second time

    changed = run_plan(diamond(store, trace, a_value=10).plan())
    assert {s: r["status"] for s, r in changed.items()} == {"a": "ran", "b": "skipped", "ab": "ran", "abb": "ran"}
    assert changed["b"]["artifact_id"] == first["b"]["artifact_id"]
    assert changed["abb"]["metrics"] == {"value": 2 + (10 + 2 + 1) + 1}


def test_independent_stages_run_concurrently(prefect_server, tmp_path):
    # Each stage waits until the other has started: run one at a time, they would time out.
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    p = Pipeline("concurrent", store=tmp_path / "store")
    for name, peer in (("left", "right"), ("right", "left")):
        p.stage(name, task="toy-source", config={"value": len(name), "barrier": str(barrier), "peers": [peer]})
    assert {r["status"] for r in run_plan(p.plan()).values()} == {"ran"}


def test_retries_follow_the_spec_and_failures_stop_only_descendants(prefect_server, tmp_path):
    trace = tmp_path / "trace"
    p = Pipeline("retries", store=tmp_path / "store")
    p.stage(
        "flaky",
        task="toy-source",
        config={"fail_times": 2, "trace": str(trace)},
        retries=2,
        retry_delay_seconds=0.2,
        retry_backoff=2,
    )
    p.stage(
        "broken",
        task="toy-source",
        config={"value": 5, "fail_times": 9, "trace": str(trace)},
        retries=1,
        retry_delay_seconds=0,
    )
    p.stage("after_broken", task="toy-sum", inputs={"a": "broken"})
    p.stage(
        "bad_config", task="toy-child", config={"exit_code": 2, "trace": str(trace)}, retries=3, retry_delay_seconds=0
    )
    with pytest.raises(PipelineFailed) as failure:
        run_plan(p.plan())
    summary = failure.value.summary
    assert summary["flaky"]["status"] == "ran"
    assert summary["broken"]["status"] == "failed"
    assert summary["broken"]["error"] == "stage 'broken': RuntimeError: broken: planned failure 2 of 9"
    assert summary["after_broken"]["status"] == "not run"
    assert summary["bad_config"]["error"] == "stage 'bad_config': steps: must be even (got 3)"

    runs = task_runs_of(flow_run_of({"flaky": summary["flaky"]}).id)
    assert runs["flaky"].run_count == 3 and runs["flaky"].state.is_completed()
    assert runs["broken"].run_count == 2 and runs["broken"].state.is_failed()
    assert runs["bad_config"].run_count == 1  # a config error is not retried
    assert trace.read_text().split().count("bad_config") == 1
    assert "after_broken" not in runs or not runs["after_broken"].state.is_completed()


def test_serve_creates_a_scheduled_deployment_that_runs_the_pipeline(prefect_server, tmp_path):
    path = tmp_path / "served.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "name": "served",
                "store": str(tmp_path / "store"),
                "imports": ["tests.pipeline_toys"],
                "stages": {"only": {"task": "toy-source", "config": {"value": 3}}},
            }
        )
    )
    # The served process looks for scheduled runs every second, not Prefect's default 10.
    env = {**os.environ, "PYTHONPATH": str(REPO), "PREFECT_RUNNER_POLL_FREQUENCY": "1"}
    server = subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "serve", str(path), "--cron", "0 3 * * *"],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        from prefect.deployments import run_deployment

        deadline = time.monotonic() + 120
        deployment = None
        while deployment is None:
            assert server.poll() is None, server.stderr.read()
            assert time.monotonic() < deadline, "no deployment appeared"
            time.sleep(1)
            with client() as c:
                found = [d for d in c.read_deployments() if d.name == "served"]
            deployment = found[0] if found else None
        assert [s.schedule.cron for s in deployment.schedules] == ["0 3 * * *"]
        assert deployment.parameters["pipeline"] == str(path)
        assert deployment.entrypoint == "flows.pipeline.run_pipeline"  # by module, not relative to the cwd

        flow_run = run_deployment("trainflow-pipeline/served", timeout=180, poll_interval=1)
        assert flow_run.state.is_completed(), flow_run.state
        # Named and tagged as `trainflow run` names and tags its runs.
        assert flow_run.name.startswith("served-20") and "pipeline:served" in flow_run.tags
        assert list((tmp_path / "store" / "only").glob("*/artifact.json"))
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()


def test_serve_without_a_persistent_server_says_so_in_one_line(tmp_path):
    path = tmp_path / "served.yaml"
    path.write_text(
        yaml.safe_dump(
            {"name": "served", "imports": ["tests.pipeline_toys"], "stages": {"only": {"task": "toy-source"}}}
        )
    )
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    proc = subprocess.run(
        [sys.executable, "-m", "flows.cli", "serve", str(path), "--cron", "0 3 * * *"],
        cwd=REPO,
        env={**env, "PYTHONPATH": str(REPO), "PREFECT_HOME": str(tmp_path / "home")},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "error: `trainflow serve` needs a persistent Prefect server to schedule runs: start one with `prefect "
        "server start` and set PREFECT_API_URL=http://127.0.0.1:4200/api"
    ]


def test_prefect_yaml_deployments_point_at_the_pipeline_flow(monkeypatch):
    """configs/prefect.yaml (the work-pool path) names a loadable flow and valid parameters."""
    from prefect.flows import load_flow_from_entrypoint

    from flows.spec import load_plan

    spec = yaml.safe_load((REPO / "configs" / "prefect.yaml").read_text())
    monkeypatch.chdir(REPO)
    for deployment in spec["deployments"]:
        flow = load_flow_from_entrypoint(deployment["entrypoint"])
        assert flow.name == "trainflow-pipeline"
        params = {**deployment["parameters"], "store": "/tmp/store"}
        flow.validate_parameters(params)
        assert load_plan(REPO / params["pipeline"], params["overrides"]).stages


def test_sigterm_stops_the_engine_with_a_checkpoint_and_the_rerun_resumes(prefect_server, tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "name": "stoppable",
                "store": str(tmp_path / "store"),
                "imports": ["tests.pipeline_toys"],
                "stages": {
                    "train": {
                        "task": "toy-child",
                        "retries": 2,
                        "retry_delay_seconds": 0,
                        "config": {"steps": 400, "step_seconds": 0.05},
                    }
                },
            }
        )
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = [sys.executable, "-m", "flows.cli", "run", str(path)]
    proc = subprocess.Popen(run, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list((tmp_path / "store").glob("train/*/metrics.jsonl")):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    (out_dir,) = (tmp_path / "store" / "train").iterdir()
    assert (out_dir / "sigterm").exists()  # the child got SIGTERM and "checkpointed"
    manifest = json.loads((out_dir / "artifact.json").read_text())
    assert manifest["status"] == "failed" and manifest["attempts"] == 1  # stopping is not retried
    assert "stopped by SIGTERM" in manifest["error"]

    short = subprocess.run(
        [*run, "train.steps=400", "train.step_seconds=0"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert short.returncode == 0, short.stderr
    rows = [line.split()[:3] for line in short.stdout.splitlines() if line.startswith("train ")]
    assert rows == [["train", "toy-child", "resumed"]]
