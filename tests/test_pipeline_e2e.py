"""tokenize -> pretrain end to end: `trainflow run` processes on a real local Prefect server.

One reference run (uninterrupted) is shared by the tests below; another store is SIGKILLed
mid-pretraining and resumed, and must end with bitwise the same parameters.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests.conftest import REPO, child_xla_flags

pytestmark = pytest.mark.slow

STEPS = 60

PIPELINE = {
    "name": "e2e",
    "stages": {
        "tokenize": {
            "task": "tokenize",
            "config": {
                "sources": [{"format": "text", "path": "{stdlib}/[a-c]*.py"}],
                "tokenizer": {"vocab_size": 300},
                "validation_fraction": 0.1,
                "max_document_tokens": 2048,
                "workers": 1,
            },
        },
        "pretrain": {
            "task": "pretrain",
            "inputs": {"dataset": "tokenize"},
            "config": {
                "model": "tiny",
                "steps": STEPS,
                "log_every": 10,
                "data": {"seq_len": 64, "batch_size": 8, "eval_batches": 2},
                "checkpoint": {"every_steps": 10, "async_save": False},
            },
        },
    },
}


def trainflow_env() -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    # One CPU device, LLVM -O0 as the test process compiles (tests/conftest.py): the fastest compile.
    env["XLA_FLAGS"] = child_xla_flags()
    return env


def trainflow(*args, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "flows.cli", *map(str, args)],
        cwd=REPO,
        env=trainflow_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"trainflow {' '.join(map(str, args))} exited {proc.returncode}:\n"
            f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return proc


def summary_of(stdout: str) -> dict[str, str]:
    """stage -> status from the stage table `trainflow run` prints (reports and lineage follow it)."""
    lines = stdout.strip().splitlines()
    header = max(i for i, line in enumerate(lines) if line.startswith("stage "))
    rows = []
    for line in lines[header + 1 :]:
        if not line.strip():
            break
        rows.append(line)
    return {line.split()[0]: line.split()[2] for line in rows}


def artifact_dir(store: Path, stage: str) -> Path:
    (directory,) = (store / stage).iterdir()
    return directory


@pytest.fixture(scope="module")
def pipeline_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("pipeline") / "e2e.yaml"
    path.write_text(yaml.safe_dump(PIPELINE, sort_keys=False))
    return path


def start_run(pipeline_file: Path, store: Path) -> subprocess.Popen:
    """`trainflow run` in the background, its output in files (a full pipe would block it)."""
    proc_outputs = (store.parent / f"{store.name}.out", store.parent / f"{store.name}.err")
    with open(proc_outputs[0], "w") as out, open(proc_outputs[1], "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "flows.cli", "run", str(pipeline_file), "--store", str(store)],
            cwd=REPO,
            env=trainflow_env(),
            stdout=out,
            stderr=err,
        )
    proc.outputs = proc_outputs
    return proc


@pytest.fixture(scope="module")
def runs(prefect_server, pipeline_file, tmp_path_factory) -> dict:
    """Two stores, started together: `reference` runs uninterrupted; `killed` has its whole
    `trainflow run` process tree SIGKILLed once pretraining has written a checkpoint."""
    reference, killed = tmp_path_factory.mktemp("reference-store"), tmp_path_factory.mktemp("killed-store")
    reference_proc = start_run(pipeline_file, reference)
    victim = start_run(pipeline_file, killed)
    deadline = time.monotonic() + 600
    try:
        while not _checkpoint_steps(killed):
            assert victim.poll() is None, f"trainflow exited ({victim.returncode}) before pretraining checkpointed"
            assert time.monotonic() < deadline, "no pretraining checkpoint appeared"
            time.sleep(0.02)
        processes = _kill_tree(victim.pid)
    finally:
        if victim.poll() is None:
            victim.kill()
        victim.wait()
        reference_proc.wait(timeout=600)
    out, err = (path.read_text() for path in reference_proc.outputs)
    assert reference_proc.returncode == 0, f"{out[-3000:]}\n{err[-3000:]}"
    return {
        "reference": (reference, subprocess.CompletedProcess([], 0, out, err)),
        "killed": killed,
        "killed_processes": processes,
    }


@pytest.fixture(scope="module")
def reference(runs) -> tuple[Path, subprocess.CompletedProcess]:
    return runs["reference"]


def test_run_is_visible_through_prefect(reference):
    from prefect import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        FlowRunFilter,
        FlowRunFilterId,
        LogFilter,
        LogFilterFlowRunId,
    )

    store, proc = reference
    assert summary_of(proc.stdout) == {"tokenize": "ran", "pretrain": "ran"}
    manifest = json.loads((artifact_dir(store, "pretrain") / "artifact.json").read_text())
    flow_run_id = manifest["prefect"]["flow_run_id"]
    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_run(flow_run_id)
        task_runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
        logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
    assert flow_run.state.is_completed() and flow_run.parameters["pipeline"]["name"] == "e2e"
    assert {r.name: r.state.type.value for r in task_runs} == {"tokenize": "COMPLETED", "pretrain": "COMPLETED"}
    assert str(next(r.id for r in task_runs if r.name == "pretrain")) == manifest["prefect"]["task_run_id"]
    keys = {a.key: a for a in artifacts}  # one summary per stage, and its progress
    assert set(keys) == {"e2e-tokenize", "e2e-pretrain", "e2e-tokenize-progress", "e2e-pretrain-progress"}
    assert keys["e2e-pretrain-progress"].data == 100.0
    summary = keys["e2e-pretrain"].data
    assert "| final_loss |" in summary and "| eval_loss |" in summary
    messages = [log.message for log in logs]
    assert "compiling the train step ..." in messages
    assert any(m.startswith("compiled the train step in ") for m in messages)
    assert any(m.startswith(f"step {STEPS}/{STEPS} (100%): loss=") for m in messages), "metrics not in the log"
    assert any(m.startswith(f"step {STEPS}/{STEPS} (100%): eval_loss=") for m in messages)
    assert [log.message for log in logs if log.level >= 30] == []  # a quiet run: no WARNING or worse


def test_checkpoint_artifact_layout_and_lineage(reference):
    store, _ = reference
    out = artifact_dir(store, "pretrain")
    tokenize_dir = artifact_dir(store, "tokenize")
    assert (out / "tokenizer" / "tokenizer.json").read_bytes() == (
        tokenize_dir / "tokenizer" / "tokenizer.json"
    ).read_bytes()
    assert yaml.safe_load((out / "train.yaml").read_text())["data"]["path"] == str(tokenize_dir / "data")
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == STEPS

    tree = json.loads(trainflow("lineage", out, "--json").stdout)
    assert (tree["stage"], tree["kind"], tree["status"]) == ("pretrain", "checkpoint", "complete")
    assert tree["metrics"]["steps"] == STEPS and tree["code"]["version"]
    assert tree["prefect"]["flow_run_id"] and tree["config"]["model"]["d_model"] == 64
    (parent,) = tree["parents"]
    assert (parent["input"], parent["stage"], parent["kind"]) == ("dataset", "tokenize", "dataset")
    assert parent["config"]["tokenizer"]["vocab_size"] == 300 and parent["metrics"]["tokens"] > 0

    text = trainflow("lineage", tree["id"][:6], "--store", store).stdout
    assert text.splitlines()[0].startswith(f"pretrain/{tree['id']}  checkpoint  complete")
    assert f"└─ dataset: tokenize/{parent['id']}  dataset  complete" in text
    assert "config: model=tiny steps=60" in text

    listing = trainflow("ls", "--store", store).stdout
    assert f"tokenize  {parent['id']}  dataset" in listing and f"pretrain  {tree['id']}  checkpoint" in listing


def test_finished_pipeline_reruns_as_all_skipped(reference, pipeline_file):
    store, _ = reference
    status = json.loads(trainflow("status", pipeline_file, "--store", store, "--json").stdout)
    assert [s["state"] for s in status["stages"]] == ["complete", "complete"]
    proc = trainflow("run", pipeline_file, "--store", store)
    assert summary_of(proc.stdout) == {"tokenize": "skipped", "pretrain": "skipped"}
    assert "engine.train" not in proc.stdout + proc.stderr and "running pretrain" not in proc.stdout + proc.stderr


def _process_tree(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(stat.parent.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children.get(pid, [])
    return tree


def _kill_tree(root: int) -> int:
    """SIGSTOP then SIGKILL every process under `root`: nobody gets to clean up."""
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        pids = _process_tree(root)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    return len(pids)


def _checkpoint_steps(store: Path) -> list[int]:
    """Finished checkpoints (Orbax renames <step>.orbax-checkpoint-tmp to <step> when done)."""
    return [int(p.name) for p in store.glob("pretrain/*/checkpoint/*") if p.name.isdigit()]


def _params(checkpoint_dir: Path):
    import jax

    from engine.train.checkpoint import load_params

    _, params, step = load_params(checkpoint_dir)
    return step, {
        jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(params)
    }


def test_sigkill_during_pretraining_then_rerun_resumes_to_identical_params(runs, pipeline_file):
    store = runs["killed"]
    assert runs["killed_processes"] >= 2  # trainflow and the engine child at least
    pretrain_dir = artifact_dir(store, "pretrain")
    assert json.loads((pretrain_dir / "artifact.json").read_text())["status"] == "running"
    assert max(_checkpoint_steps(store)) < STEPS

    status = json.loads(trainflow("status", pipeline_file, "--store", store, "--json").stdout)
    assert [s["state"] for s in status["stages"]] == ["complete", "partial"]

    rerun = trainflow("run", pipeline_file, "--store", store)
    assert summary_of(rerun.stdout) == {"tokenize": "skipped", "pretrain": "resumed"}
    assert "resumed from checkpoint step" in rerun.stdout + rerun.stderr

    ref_store, _ = runs["reference"]
    ref_step, ref_params = _params(artifact_dir(ref_store, "pretrain") / "checkpoint")
    step, params = _params(pretrain_dir / "checkpoint")
    assert step == ref_step == STEPS
    assert params.keys() == ref_params.keys()
    for name, value in ref_params.items():
        assert value.dtype == params[name].dtype and np.array_equal(value, params[name]), name


def test_tampered_dataset_fails_verify_and_is_refused_downstream(reference, pipeline_file):
    store, _ = reference
    dataset = artifact_dir(store, "tokenize")
    assert trainflow("verify", dataset).returncode == 0
    shard = next((dataset / "data" / "train").glob("shard-*.array_record"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))

    verify = trainflow("verify", dataset, check=False)
    assert verify.returncode == 1
    assert f"data/train/{shard.name}: sha256 differs from the recorded digest" in verify.stderr

    # A changed pretrain config must consume the dataset again: it re-checks and refuses.
    run = trainflow("run", pipeline_file, "--store", store, "pretrain.steps=61", check=False)
    assert run.returncode == 1
    assert summary_of(run.stdout)["pretrain"] == "failed"
    assert (
        f"error: stage 'pretrain': input 'dataset': artifact tokenize/{dataset.name} changed since it was "
        f"finished: data/train/{shard.name}: sha256 differs"
    ) in run.stderr
