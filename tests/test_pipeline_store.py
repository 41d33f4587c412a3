"""The artifact store and the stage runner without Prefect: skip, resume, lock, verify, launch."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import tests.pipeline_toys  # noqa: F401
from flows.spec import Pipeline
from tasks.launch.run import Interrupted, LauncherSpec, StageConfigError, StageFailed, run_child
from tasks.runner import RAN, RESUMED, SKIPPED, execute_stage
from tasks.store.records import ArtifactError, ArtifactLock, read_manifest, verify_artifact
from tests.conftest import REPO


def toy_plan(store: Path, trace: Path, **a_config):
    p = Pipeline("toy", store=store)
    p.stage("a", task="toy-source", config={"value": 2, "trace": str(trace), **a_config})
    p.stage("b", task="toy-sum", inputs={"a": "a"}, config={"value": 3, "trace": str(trace)})
    return p.plan()


def run_all(plan):
    return {name: execute_stage(p.job, plan.store).status for name, p in plan.stages.items()}


def test_runs_then_skips_and_records_a_complete_manifest(tmp_path):
    trace = tmp_path / "trace"
    plan = toy_plan(tmp_path / "store", trace)
    assert run_all(plan) == {"a": RAN, "b": RAN}
    assert run_all(toy_plan(tmp_path / "store", trace)) == {"a": SKIPPED, "b": SKIPPED}
    assert trace.read_text().split() == ["a", "b"]

    b = plan.stages["b"].job
    manifest = read_manifest(plan.store.artifact_dir("b", b.artifact_id))
    assert manifest["status"] == "complete" and manifest["id"] == b.artifact_id
    assert manifest["kind"] == "checkpoint" and manifest["task"] == "toy-sum" and manifest["stage"] == "b"
    assert manifest["parents"] == [
        {
            "input": "a",
            "stage": "a",
            "id": plan.stages["a"].job.artifact_id,
            "kind": "dataset",
            "path": f"a/{plan.stages['a'].job.artifact_id}",
        }
    ]
    assert manifest["metrics"] == {"value": 5}
    assert set(manifest["files"]) == {"value.json"} and len(manifest["files"]["value.json"]["sha256"]) == 64
    assert manifest["code"]["version"] and manifest["created_at"] and manifest["finished_at"]
    assert plan.status()["b"]["state"] == "complete"


def test_partial_artifact_resumes_in_place(tmp_path):
    plan = toy_plan(tmp_path / "store", tmp_path / "trace", fail_times=1)
    job = plan.stages["a"].job
    out = plan.store.artifact_dir("a", job.artifact_id)
    with pytest.raises(RuntimeError, match="planned failure 1 of 1"):
        execute_stage(job, plan.store)
    assert read_manifest(out)["status"] == "failed" and plan.status()["a"]["state"] == "failed"
    (out / "shard-00000.partial").write_text("work done before the failure")
    assert execute_stage(job, plan.store).status == RESUMED
    assert read_manifest(out)["attempts"] == 2


def test_tampered_input_is_refused_and_verify_names_the_file(tmp_path):
    plan = toy_plan(tmp_path / "store", tmp_path / "trace")
    a = plan.stages["a"].job
    execute_stage(a, plan.store)
    a_dir = plan.store.artifact_dir("a", a.artifact_id)
    assert verify_artifact(a_dir) == []
    (a_dir / "value.json").write_text("7")  # same size, different content
    assert verify_artifact(a_dir) == ["value.json: sha256 differs from the recorded digest"]
    with pytest.raises(
        ArtifactError,
        match=r"stage 'b': input 'a': artifact a/\w+ changed since it was finished: "
        r"value.json: sha256 differs",
    ):
        execute_stage(plan.stages["b"].job, plan.store)
    (a_dir / "extra.bin").write_bytes(b"x")
    assert "extra.bin: not part of the artifact (added after it was finished)" in verify_artifact(a_dir)


def test_two_concurrent_runs_do_the_work_once(tmp_path):
    trace = tmp_path / "trace"
    plans = [toy_plan(tmp_path / "store", trace, sleep=1.0) for _ in range(2)]
    statuses = []
    threads = [
        threading.Thread(target=lambda p=p: statuses.append(execute_stage(p.stages["a"].job, p.store).status))
        for p in plans
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(statuses) == [RAN, SKIPPED]
    assert trace.read_text().split() == ["a"]


HOLD_LOCK = """
import sys, time
from tasks.store.records import ArtifactLock
ArtifactLock(sys.argv[1]).acquire()
print("locked", flush=True)
time.sleep(600)
"""


def test_a_dead_process_does_not_hold_the_lock(tmp_path):
    plan = toy_plan(tmp_path / "store", tmp_path / "trace")
    out = plan.store.artifact_dir("a", plan.stages["a"].job.artifact_id)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(out)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    lock = ArtifactLock(out)
    assert plan.status()["a"]["state"] == "running"
    assert not lock.acquire(blocking=False)
    assert f"pid {holder.pid}" in lock.holder()
    holder.kill()
    holder.wait()
    assert plan.status()["a"]["state"] == "partial"  # a directory with no complete manifest
    assert lock.acquire(blocking=False)
    lock.release()
    assert execute_stage(plan.stages["a"].job, plan.store).status == RAN


# --------------------------------------------------------------------------- launching

CHILD = tests.pipeline_toys.CHILD


def test_child_output_and_metrics_are_streamed(tmp_path):
    lines, records = [], []
    result = run_child(
        [sys.executable, "-c", CHILD, str(tmp_path), "3", "0.05", "0"],
        log=lines.append,
        metrics_file=tmp_path / "metrics.jsonl",
        on_metrics=records.append,
        poll_seconds=0.02,
    )
    assert result.returncode == 0 and result.result == {"final_loss": 1 / 3, "steps": 3}
    assert "child started" in lines
    assert [r["step"] for r in records] == [1, 2, 3]


@pytest.mark.parametrize(
    "exit_code, error, message",
    [
        (2, StageConfigError, "stage 'x': steps: must be even"),
        (1, StageFailed, "stage 'x': exited with code 1: error: training diverged"),
    ],
)
def test_child_exit_codes_become_errors(tmp_path, exit_code, error, message):
    with pytest.raises(error, match=message):
        run_child(
            [sys.executable, "-c", CHILD, str(tmp_path), "1", "0", str(exit_code)], log=lambda _: None, what="stage 'x'"
        )


def test_command_template_launcher_wraps_the_command(tmp_path):
    launcher = LauncherSpec.parse(
        {"kind": "command", "template": "env TOY_WRAPPED=yes {command}", "env": {"TOY_EXTRA": "1"}}
    )
    run_child([sys.executable, "-c", CHILD, str(tmp_path), "1", "0", "0"], launcher=launcher, log=lambda _: None)
    child_env = json.loads((tmp_path / "env.json").read_text())
    # What the launcher added (the child also inherits any TRAINFLOW_ variable this process has).
    assert {k: v for k, v in child_env.items() if os.environ.get(k) != v} == {"TOY_WRAPPED": "yes", "TOY_EXTRA": "1"}


def test_local_multi_launcher_starts_ranks_with_a_coordinator(tmp_path):
    launcher = LauncherSpec.parse({"kind": "local-multi", "processes": 2})
    dirs = [tmp_path / "0", tmp_path / "1"]
    for d in dirs:
        d.mkdir()
    # each rank writes into its own directory, chosen by its rank
    script = (
        f"import os,sys; d=os.path.join({str(tmp_path)!r}, os.environ['TRAINFLOW_PROCESS_ID']); "
        f"sys.argv=['c', d, '1', '0', '0']; exec({CHILD!r})"
    )
    run_child([sys.executable, "-c", script], launcher=launcher, log=lambda _: None)
    envs = [json.loads((d / "env.json").read_text()) for d in dirs]
    assert [e["TRAINFLOW_PROCESS_ID"] for e in envs] == ["0", "1"]
    assert envs[0]["TRAINFLOW_NUM_PROCESSES"] == "2"
    assert envs[0]["TRAINFLOW_COORDINATOR"] == envs[1]["TRAINFLOW_COORDINATOR"]


PARENT = """
import sys
from tasks.launch.run import run_child
from tests.pipeline_toys import CHILD
run_child([sys.executable, "-c", CHILD, sys.argv[1], "600", "0.05", "0"], log=print)
"""


def test_sigkilled_parent_takes_its_child_down_with_a_checkpoint(tmp_path):
    """An orphaned engine must not keep writing an artifact a new run will lock."""
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(tmp_path)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert parent.stdout.readline().strip() == "child started"
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 30
    while not (tmp_path / "sigterm").exists():
        assert time.monotonic() < deadline, "the child outlived its SIGKILLed parent"
        time.sleep(0.05)


def test_interrupt_is_not_a_failure_to_retry(tmp_path):
    from tasks.launch import gang

    def stop_soon():
        time.sleep(0.5)
        gang.terminate_children(signal.SIGTERM)

    threading.Thread(target=stop_soon).start()
    try:
        with pytest.raises(Interrupted, match="stopped by SIGTERM"):
            run_child([sys.executable, "-c", CHILD, str(tmp_path), "600", "0.05", "0"], log=lambda _: None)
        assert (tmp_path / "sigterm").exists()
    finally:
        gang._stopping.clear()
