"""Early cutoff (tasks/cutoff.py): a stage whose consumed bytes equal those of a finished
artifact of the stage is not run again; its artifact links that one's payload in under its
own id, and the cutoff goes on down the DAG. Ids stay what they were."""

import os
from pathlib import Path

import pytest

import tests.pipeline_toys  # noqa: F401
from engine.config import load_yaml
from flows.inspection import format_lineage, lineage, list_rows, status_rows
from flows.retention import apply, collect
from flows.spec import Pipeline
from tasks.cutoff import recorded_key
from tasks.runner import RAN, REUSED, SKIPPED, execute_stage
from tasks.store.records import read_manifest, verify_artifact, write_json_atomic
from tests.conftest import REPO
from tests.test_object_store import _forget_s3_clients, boto3, bucket, s3_endpoint  # noqa: F401  (moto S3 fixtures)

PIPELINES = ("quickstart", "posttrain")


def chain(store: Path, trace: Path, files: dict[str, str], label: str = "", whole: bool = False):
    """src (a corpus) -> read (the length of src's a.txt; with `whole`, src's size) -> total (+3)."""
    p = Pipeline("cutoff", store=store)
    p.stage("src", task="toy-files", config={"files": files, "label": label, "trace": str(trace)})
    if whole:
        p.stage("read", task="toy-read", inputs={"whole": "src"}, config={"trace": str(trace)})
    else:
        p.stage(
            "read",
            task="toy-read",
            inputs={"corpus": "src"},
            config={"path": "{input:corpus}/a.txt", "trace": str(trace)},
        )
    p.stage("total", task="toy-sum", inputs={"a": "read"}, config={"value": 3, "trace": str(trace)})
    return p.plan()


def run_all(plan) -> dict[str, str]:
    return {name: execute_stage(p.job, plan.store).status for name, p in plan.stages.items()}


def ids(plan) -> dict[str, str]:
    return {name: p.job.artifact_id for name, p in plan.stages.items()}


def ran(trace: Path) -> list[str]:
    return trace.read_text().split()


def test_a_change_that_leaves_the_consumed_bytes_equal_reruns_nothing_downstream(tmp_path):
    store, trace = tmp_path / "store", tmp_path / "trace"
    first = chain(store, trace, {"a.txt": "one", "b.txt": "two"})
    assert run_all(first) == {"src": RAN, "read": RAN, "total": RAN}

    # b.txt changes: src must run (to know its bytes); read consumes only a.txt, total only read.
    second = chain(store, trace, {"a.txt": "one", "b.txt": "zwei"})
    assert run_all(second) == {"src": RAN, "read": REUSED, "total": REUSED}
    assert ran(trace) == ["src", "read", "total", "src"]
    assert all(ids(second)[s] != ids(first)[s] for s in ids(first))  # ids as before: config and input ids

    read_dir = second.store.artifact_dir("read", ids(second)["read"])
    manifest = read_manifest(read_dir)
    assert manifest["status"] == "complete" and manifest["id"] == ids(second)["read"]
    assert [(p["stage"], p["id"]) for p in manifest["parents"]] == [("src", ids(second)["src"])]  # what feeds it now
    reused = manifest["reused"]  # ... and what its bytes were made from
    assert (reused["stage"], reused["id"]) == ("read", ids(first)["read"])
    assert [(p["stage"], p["id"]) for p in reused["parents"]] == [("src", ids(first)["src"])]
    assert manifest["metrics"] == {"value": 3} and verify_artifact(read_dir) == []
    old_dir = first.store.artifact_dir("read", ids(first)["read"])
    assert os.stat(read_dir / "value.json").st_ino == os.stat(old_dir / "value.json").st_ino  # linked, not copied

    total = read_manifest(second.store.artifact_dir("total", ids(second)["total"]))
    assert total["reused"]["id"] == ids(first)["total"] and total["metrics"] == {"value": 6}

    rows = {row["stage"]: row for row in status_rows(second)}
    assert [rows[s]["state"] for s in ("src", "read", "total")] == [
        "complete",
        "complete (reused)",
        "complete (reused)",
    ]
    assert rows["read"]["reused_from"] == f"read/{ids(first)['read']}"
    listed = {(row["stage"], row["id"]): row["status"] for row in list_rows(second.store)}
    assert listed[("read", ids(second)["read"])] == "complete (reused)"
    assert listed[("read", ids(first)["read"])] == "complete"
    shown = format_lineage(lineage(second.store.artifact_dir("total", ids(second)["total"])), width=120)
    assert f"total/{ids(second)['total']}  checkpoint  complete (reused)" in shown
    assert f"reused: the bytes of read/{ids(first)['read']}, made" in shown
    assert f"from corpus=src/{ids(first)['src']} (consumed the same bytes as below)" in shown

    assert run_all(chain(store, trace, {"a.txt": "one", "b.txt": "zwei"})) == dict.fromkeys(ids(first), SKIPPED)
    assert run_all(chain(store, trace, {"a.txt": "one", "b.txt": "two"})) == dict.fromkeys(ids(first), SKIPPED)
    assert len(ran(trace)) == 4


def test_a_change_to_the_consumed_bytes_reruns_exactly_the_affected_stages(tmp_path):
    store, trace = tmp_path / "store", tmp_path / "trace"
    run_all(chain(store, trace, {"a.txt": "one", "b.txt": "two"}))
    # a.txt changes at the same length: read runs, and writes the bytes it wrote before.
    assert run_all(chain(store, trace, {"a.txt": "uno", "b.txt": "two"})) == {"src": RAN, "read": RAN, "total": REUSED}
    # ... at another length: everything downstream of it runs.
    assert run_all(chain(store, trace, {"a.txt": "eins", "b.txt": "two"})) == {"src": RAN, "read": RAN, "total": RAN}
    assert ran(trace) == ["src", "read", "total", "src", "read", "src", "read", "total"]


def test_an_input_read_whole_is_keyed_on_all_of_its_bytes(tmp_path):
    store, trace = tmp_path / "store", tmp_path / "trace"
    files = {"a.txt": "one", "b.txt": "two"}
    run_all(chain(store, trace, files, whole=True))
    # A config change that writes the same bytes (label is in src's id, not in its files).
    assert run_all(chain(store, trace, files, label="x", whole=True)) == {"src": RAN, "read": REUSED, "total": REUSED}
    # b.txt is read too, when the input is read whole.
    changed = chain(store, trace, {"a.txt": "one", "b.txt": "six"}, whole=True)
    assert run_all(changed) == {"src": RAN, "read": RAN, "total": REUSED}  # same size: same value


def test_artifacts_made_before_content_keys_are_reused_by_a_key_recomputed_from_their_manifests(tmp_path):
    store, trace = tmp_path / "store", tmp_path / "trace"
    first = chain(store, trace, {"a.txt": "one", "b.txt": "two"})
    run_all(first)
    keys = {}
    for stage, artifact_id in ids(first).items():  # as an older trainflow wrote them
        path = first.store.artifact_dir(stage, artifact_id) / "artifact.json"
        manifest = read_manifest(path.parent)
        keys[stage] = manifest.pop("content_key")
        write_json_atomic(path, manifest)
    read = read_manifest(first.store.artifact_dir("read", ids(first)["read"]))
    kind = first.stages["read"].job.kind
    assert recorded_key(first.store, kind, read) == keys["read"]
    # A config that does not give back the artifact's id cannot vouch for its bytes.
    edited = {**read, "config_as_written": {**read["config_as_written"], "path": "{input:corpus}/b.txt"}}
    assert recorded_key(first.store, kind, edited) is None

    second = chain(store, trace, {"a.txt": "one", "b.txt": "zwei"})
    assert run_all(second) == {"src": RAN, "read": REUSED, "total": REUSED}


def test_gc_keeps_a_reused_artifact_whose_source_it_deletes(tmp_path):
    store, trace = tmp_path / "store", tmp_path / "trace"
    first = chain(store, trace, {"a.txt": "one", "b.txt": "two"})
    run_all(first)
    second = chain(store, trace, {"a.txt": "one", "b.txt": "zwei"})
    assert run_all(second) == {"src": RAN, "read": REUSED, "total": REUSED}
    collection = collect(second.store, [second], None)
    assert {(e.stage, e.artifact_id) for e in collection.delete} == {(s, ids(first)[s]) for s in ids(first)}
    apply(second.store, collection, log=lambda _: None)
    assert not second.store.artifact_dir("read", ids(first)["read"]).exists()
    for stage, artifact_id in ids(second).items():  # the links hold the bytes
        assert verify_artifact(second.store.artifact_dir(stage, artifact_id)) == []
    assert run_all(chain(store, trace, {"a.txt": "one", "b.txt": "zwei"})) == dict.fromkeys(ids(first), SKIPPED)


def test_a_reused_source_that_changed_since_it_was_finished_is_not_reused(tmp_path):
    store, trace = tmp_path / "store", tmp_path / "trace"
    first = chain(store, trace, {"a.txt": "one", "b.txt": "two"})
    run_all(first)
    (first.store.artifact_dir("read", ids(first)["read"]) / "value.json").write_text("7")  # same size
    second = chain(store, trace, {"a.txt": "one", "b.txt": "zwei"})
    assert run_all(second) == {"src": RAN, "read": RAN, "total": REUSED}
    assert "reused" not in read_manifest(second.store.artifact_dir("read", ids(second)["read"]))


@pytest.mark.slow
def test_the_flow_reports_a_reused_stage(prefect_server, tmp_path):
    from flows.pipeline import run_plan

    store, trace = tmp_path / "store", tmp_path / "trace"
    run_plan(chain(store, trace, {"a.txt": "one", "b.txt": "two"}))
    result = run_plan(chain(store, trace, {"a.txt": "one", "b.txt": "zwei"}))
    assert {s: r["status"] for s, r in result.items()} == {"src": "ran", "read": "reused", "total": "reused"}
    assert result["total"]["metrics"] == {"value": 6}


def test_posttrain_reuses_the_quickstarts_tokenized_dataset(tmp_path):
    """posttrain.yaml's problems differ from the quickstart's by preference_pairs alone (prefs.jsonl
    is added), and tokenize reads pretrain.txt: the dataset is reused, not tokenized again.
    Problem counts are scaled down; the stages are the shipped ones."""
    stages = {name: load_yaml(REPO / "configs" / "pipelines" / f"{name}.yaml")["stages"] for name in PIPELINES}
    quick, post = (stages[name]["problems"]["config"] for name in PIPELINES)
    assert {k: v for k, v in post.items() if k != "preference_pairs"} == quick
    assert stages["quickstart"]["tokenize"] == stages["posttrain"]["tokenize"]
    small = {"pretrain_problems": 400, "sft_problems": 20, "rl_problems": 60, "eval_problems": 20}

    def plan(name: str):
        p = Pipeline(name, store=tmp_path / "store")
        p.stage("problems", task="arithmetic", config={**stages[name]["problems"]["config"], **small})
        tokenize = stages[name]["tokenize"]
        p.stage("tokenize", task="tokenize", inputs=tokenize["inputs"], config=tokenize["config"])
        return p.plan()

    quickstart, posttrain = plan("quickstart"), plan("posttrain")
    assert run_all(quickstart) == {"problems": RAN, "tokenize": RAN}
    assert run_all(posttrain) == {"problems": RAN, "tokenize": REUSED}
    dataset = read_manifest(posttrain.store.artifact_dir("tokenize", ids(posttrain)["tokenize"]))
    assert dataset["reused"]["id"] == ids(quickstart)["tokenize"] != ids(posttrain)["tokenize"]
    assert "prefs.jsonl" in read_manifest(posttrain.store.artifact_dir("problems", ids(posttrain)["problems"]))["files"]


def test_on_a_bucket_the_reused_payload_is_copied_inside_the_bucket(bucket, tmp_path):
    store, trace = f"s3://{bucket}/store", tmp_path / "trace"
    first = chain(store, trace, {"a.txt": "one", "b.txt": "two"})
    run_all(first)
    second = chain(store, trace, {"a.txt": "one", "b.txt": "zwei"})
    assert run_all(second) == {"src": RAN, "read": REUSED, "total": REUSED}
    assert ran(trace) == ["src", "read", "total", "src"]
    remote = second.store.remote
    for stage in ("read", "total"):
        manifest = remote.read_manifest(stage, ids(second)[stage])
        assert manifest["reused"]["id"] == ids(first)[stage]
        assert set(manifest["versions"]) == set(manifest["files"]) == {"value.json"}
        assert second.store.verify(second.store.artifact_dir(stage, ids(second)[stage])) == []
    rows = {row["stage"]: row["state"] for row in status_rows(second)}
    assert rows == {"src": "complete", "read": "complete (reused)", "total": "complete (reused)"}
