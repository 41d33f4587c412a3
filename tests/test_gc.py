"""`trainflow gc` and `trainflow diff` (flows/retention.py, flows/diff.py) on a local store, on the
moto S3 store of tests/test_object_store.py and on the GCS emulator of
tests/test_object_store_gcs.py. Stages run through tasks.runner.execute_stage (the store
protocol without Prefect), with the toy kinds of tests/sweep_toys.py."""

import json
import threading
import time
from pathlib import Path

import pytest
import yaml

import tests.sweep_toys  # noqa: F401
from flows.cli import main
from flows.spec import load_plan
from tasks.registry import StageHooks
from tasks.runner import execute_stage
from tests.test_object_store import bucket, s3_endpoint  # noqa: F401  (the moto server and a bucket per test)

try:  # the GCS emulator of tests/test_object_store_gcs.py, where it is installed
    from tests.test_object_store_gcs import BUCKET, gcs  # noqa: F401
except pytest.skip.Exception:
    BUCKET = None


def pipeline(path: Path, store: str, lrs, name="grid") -> Path:
    spec = {
        "name": name,
        "store": store,
        "imports": ["tests.sweep_toys"],
        "stages": {
            "base": {"task": "toy-train", "config": {"steps": 4, "every": 2}},
            "sft": {"task": "toy-train", "inputs": {"checkpoint": "base"}, "matrix": {"optimizer.learning_rate": lrs}},
            "evaluate": {"task": "toy-eval", "inputs": {"models": "sft[*]"}},
        },
    }
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def run_plain(path: Path, store: str) -> dict[str, str]:
    """Every stage of the pipeline, in order, without Prefect: {stage: artifact id}."""
    plan = load_plan(path, [], store)
    for name in plan.stages:
        execute_stage(plan.resolve(name), plan.store)
    return {name: planned.job.artifact_id for name, planned in plan.stages.items()}


@pytest.fixture(params=["local", "s3", "gs"])
def store(request, tmp_path) -> str:
    if request.param == "local":
        return str(tmp_path / "store")
    if request.param == "gs":
        if BUCKET is None:
            pytest.skip("the GCS emulator is not installed")
        request.getfixturevalue("gcs")
        return f"gs://{BUCKET}/gc-{tmp_path.name}"
    return f"s3://{request.getfixturevalue('bucket')}/artifacts"


def listed(store: str) -> set[str]:
    from tasks.store.base import ArtifactStore
    from tasks.store.names import folder_stage

    # A sweep point's folder has its brackets as parentheses (tasks/store/names.py).
    return {
        f"{folder_stage(d.parent.name)}/{d.name}" for d, m in ArtifactStore(store).iter_artifacts() if m is not None
    }


def test_gc_deletes_exactly_what_no_kept_pipeline_reaches_and_spares_a_running_artifact(store, tmp_path, capsys):
    old = run_plain(pipeline(tmp_path / "old.yaml", store, [1e-4, 3e-4, 1e-3]), store)
    kept_path = pipeline(tmp_path / "grid.yaml", store, [1e-4, 3e-4])
    kept = run_plain(kept_path, store)
    unreferenced = {"sft[lr=0.001]/" + old["sft[lr=0.001]"], "evaluate/" + old["evaluate"]}
    assert unreferenced.isdisjoint({f"{s}/{i}" for s, i in kept.items()})

    # Another pipeline is writing an artifact (its lock and, on a bucket, its lease held) on
    # top of a finished one that no kept pipeline names: gc must leave both alone.
    hold = tmp_path / "hold"
    other = tmp_path / "other.yaml"
    other.write_text(
        yaml.safe_dump(
            {
                "name": "other",
                "store": store,
                "imports": ["tests.sweep_toys"],
                "stages": {
                    "seed": {"task": "toy-train", "config": {"steps": 3}},
                    "long": {"task": "toy-train", "inputs": {"checkpoint": "seed"}, "config": {"hold": str(hold)}},
                },
            }
        )
    )
    plan = load_plan(other, [], store)
    execute_stage(plan.resolve("seed"), plan.store)
    quiet = StageHooks(log=lambda line: None)  # its log lines (a bucket's step uploads) stay out of gc's output
    writer = threading.Thread(target=execute_stage, args=(plan.resolve("long"), plan.store, quiet))
    writer.start()
    try:
        deadline = time.monotonic() + 60
        long_id = plan.stages["long"].job.artifact_id
        while plan.store.state("long", long_id) != "running" or plan.store.manifest("long", long_id) is None:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        before = listed(store)
        assert main(["gc", "--store", store, "--keep", str(kept_path), "--dry-run"]) == 0
        out = capsys.readouterr().out
        would = {line.split()[2] for line in out.splitlines() if line.startswith("would delete")}
        assert would == unreferenced, out
        assert f"in use  long/{plan.stages['long'].job.artifact_id}" in out
        assert listed(store) == before  # a dry run deletes nothing

        assert main(["gc", "--store", store, "--keep", str(kept_path)]) == 0
        out = capsys.readouterr().out
        assert "gc: freed " in out and "2 artifact(s) deleted" in out, out
        assert listed(store) == before - unreferenced
        assert f"seed/{plan.stages['seed'].job.artifact_id}" in listed(store)  # the running one's input
    finally:
        hold.touch()
        writer.join(timeout=60)
    assert plan.store.is_complete("long", plan.stages["long"].job.artifact_id)  # it lost nothing
    assert main(["status", str(kept_path), "--store", store, "--json"]) == 0
    states = {row["stage"]: row["state"] for row in json.loads(capsys.readouterr().out)["stages"]}
    assert set(states.values()) == {"complete"}

    # Old checkpoint steps: base committed steps 2 and 4; the newest one stays, and verify holds.
    assert main(["gc", "--store", store, "--keep", str(kept_path), "--keep-steps", "1"]) == 0
    assert f"prune  base/{kept['base']}  steps 2" in capsys.readouterr().out
    manifest = plan.store.manifest("base", kept["base"])
    assert sorted({rel.split("/")[1] for rel in manifest["files"] if rel.startswith("checkpoint/")}) == ["4"]
    assert main(["verify", kept["base"], "--store", store]) == 0
    capsys.readouterr()

    # diff: two points of the grid differ in their learning rate and loss, not in their base.
    assert main(["diff", kept["sft[lr=0.0001]"], kept["sft[lr=0.0003]"], "--store", store, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["config"] == [{"key": "optimizer.learning_rate", "a": 1e-4, "b": 3e-4}]
    loss = next(row for row in result["metrics"] if row["metric"] == "eval_loss")
    assert loss["b - a"] == pytest.approx(-0.2)
    assert result["lineage"] == [] and result["same_ancestors"] == ["base"]


def test_gc_on_a_store_it_cannot_list_is_one_sentence_and_exit_2(s3_endpoint, tmp_path, capsys):  # noqa: F811
    missing = tmp_path / "nowhere"
    assert main(["gc", "--store", str(missing), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: gc: store {missing} does not exist (nothing to list)"
    assert main(["gc", "--store", "s3://no-such-bucket/artifacts"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: gc: artifact store s3://no-such-bucket/artifacts: bucket 'no-such-bucket'")
    assert len(err.splitlines()) == 1


def test_a_gate_or_selection_naming_a_metric_the_finished_stages_lack_is_exit_2(tmp_path, capsys):
    store = str(tmp_path / "store")
    path = pipeline(tmp_path / "grid.yaml", store, [1e-4, 3e-4])
    run_plain(path, store)
    spec = yaml.safe_load(path.read_text())
    spec["stages"]["gated"] = {"task": "toy-eval", "inputs": {"m": "base"}, "when": "base.metrics['eval_los'] < 1"}
    path.write_text(yaml.safe_dump(spec))
    assert main(["status", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"error: {path}: stages.gated.when: 'base.metrics['eval_los']': base.metrics has no metric 'eval_los' "
        f"(did you mean 'eval_loss'?)"
    )
    del spec["stages"]["gated"]
    spec["stages"]["best"] = {
        "task": "toy-train",
        "inputs": {"checkpoint": {"select": {"from": "sft[*]", "by": "metrics.accuracy", "best": "max"}}},
    }
    path.write_text(yaml.safe_dump(spec))
    assert main(["status", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(
        f"error: {path}: stages.best.inputs.checkpoint.select.by: 'metrics.accuracy': "
        f"sft[lr=0.0001].metrics has no metric 'accuracy'"
    ), err
    assert len(err.splitlines()) == 1


HOLDER = """
import sys
from tasks.store.base import ArtifactStore
claim = ArtifactStore(sys.argv[1]).claim(sys.argv[2], sys.argv[3])
print("held", flush=True)
sys.stdin.read()  # until the test closes it
claim.release()
"""


def failed_artifact(directory: Path, store: str, value: int, name: str) -> str:
    """A pipeline of one toy stage that fails every attempt, run once: the id of its failed artifact."""
    path = directory / f"{name}.yaml"
    trace = directory / f"{name}.trace"
    spec = {
        "name": name,
        "store": store,
        "imports": ["tests.pipeline_toys"],
        "stages": {"a": {"task": "toy-source", "config": {"value": value, "fail_times": 99, "trace": str(trace)}}},
    }
    path.write_text(yaml.safe_dump(spec))
    plan = load_plan(path, [], store)
    with pytest.raises(RuntimeError, match="planned failure"):
        execute_stage(plan.resolve("a"), plan.store, StageHooks(log=lambda line: None))
    assert plan.store.state("a", plan.stages["a"].job.artifact_id) == "failed"
    return plan.stages["a"].job.artifact_id


def test_gc_deletes_failed_artifacts_no_kept_pipeline_reaches_and_spares_resumable_and_held_ones(
    store, tmp_path, capsys
):
    import subprocess
    import sys

    from flows.retention import apply, collect
    from tasks.store.base import ArtifactStore

    orphan = failed_artifact(tmp_path, store, 1, "old")  # no kept pipeline reaches it
    resumable = failed_artifact(tmp_path, store, 2, "kept")  # the kept pipeline resumes from it
    held = failed_artifact(tmp_path, store, 3, "other")  # a live process holds it (below)
    kept_path = tmp_path / "kept.yaml"
    capsys.readouterr()

    # A run that claims `held` after gc listed it: apply() must find its lock (and lease) and leave it.
    found = collect(ArtifactStore(store), [load_plan(kept_path, [], store)], None)
    assert {e.name for e in found.delete} == {f"a/{orphan}", f"a/{held}"}
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, store, "a", held], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline() == "held\n"
        freed, busy = apply(ArtifactStore(store), found, log=lambda line: None)
        assert [e.name for e in busy] == [f"a/{held}"]
        # Gone whole: on a bucket its lease went with it (not left to expire, read as a run's).
        assert ArtifactStore(store).state("a", orphan) == "pending"
        assert listed(store) == {f"a/{resumable}", f"a/{held}"}

        # The same through the command, the holder still alive: the held one is listed in use.
        orphan = failed_artifact(tmp_path, store, 4, "old")
        capsys.readouterr()
        assert main(["gc", "--store", store, "--keep", str(kept_path)]) == 0
        out = capsys.readouterr().out
        assert f"delete  a/{orphan}  dataset  failed" in out, out
        assert "took it meanwhile" not in out and "1 artifact(s) deleted" in out, out
        assert listed(store) == {f"a/{resumable}", f"a/{held}"}
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    # Released: the next gc deletes it, and the kept pipeline's failed artifact still stays.
    assert main(["gc", "--store", store, "--keep", str(kept_path)]) == 0
    assert f"delete  a/{held}" in capsys.readouterr().out
    assert listed(store) == {f"a/{resumable}"}
