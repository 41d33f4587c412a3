"""The pipeline's rules around a stage (flows/stage_rules.py) without Prefect: a false gate
skips a stage and records what it saw, a stage reading a skipped one is skipped too, a
selection picks its point and is recorded, a fan-in records the sweep it read, and a
`stage@STEP` input is committed as a snapshot artifact first. The same pipeline runs
through Prefect in tests/test_sweeps.py."""

from __future__ import annotations

import tests.sweep_toys  # noqa: F401  (registers toy-train and toy-eval)
from flows.gates import SKIPPED_CONDITION, read_condition
from flows.spec import Pipeline
from flows.stage_rules import after_stage, before_stage, skip_stage
from tasks.runner import execute_stage
from tasks.store.records import read_manifest


def run_without_prefect(plan) -> dict[str, str]:
    """Every stage in order, as the Prefect task runs it: stage -> status."""
    skipped: set[str] = set()
    statuses = {}
    for stage in plan.stages:
        before = before_stage(plan, stage, skipped, lambda s: True, print)
        if before.skip is not None:
            skipped.add(stage)
            outcome, _ = skip_stage(plan, stage, before.job, before.skip)
            statuses[stage] = outcome["status"]
            continue
        statuses[stage] = execute_stage(before.job, plan.store).status
        after_stage(plan, stage, before.job, before.decisions)
    return statuses


def test_gates_selections_sweeps_and_steps_are_decided_and_recorded_without_prefect(tmp_path):
    p = Pipeline("rules", store=tmp_path / "store")
    p.stage("base", task="toy-train", config={"steps": 2})
    p.stage("early", task="toy-eval", inputs={"model": "base@1"})
    p.stage("sft", task="toy-train", inputs={"checkpoint": "base"}, matrix={"lora.rank": [8, 16]})
    p.stage("evaluate", task="toy-eval", inputs={"models": "sft[*]"})
    best = {"select": {"from": "sft[*]", "by": "metrics.eval_loss", "best": "min"}}
    p.stage("best", task="toy-train", inputs={"checkpoint": best})
    p.stage("yes", task="toy-eval", inputs={"m": "best"}, when="evaluate.metrics['models[rank=16]/step'] == 1")
    p.stage("no", task="toy-train", inputs={"checkpoint": "best"}, when="best.metrics['eval_loss'] < 0.5")
    p.stage("after_no", task="toy-eval", inputs={"m": "no"})
    plan = p.plan()
    assert run_without_prefect(plan) == {
        "base": "ran",
        "early": "ran",
        "sft[rank=8]": "ran",
        "sft[rank=16]": "ran",
        "evaluate": "ran",
        "best": "ran",
        "yes": "ran",
        "no": SKIPPED_CONDITION,
        "after_no": SKIPPED_CONDITION,
    }

    def manifest(stage: str) -> dict:
        return read_manifest(plan.store.artifact_dir(stage, plan.resolve(stage).artifact_id))

    assert manifest("best")["decisions"]["select"]["checkpoint"]["chosen"] == "sft[rank=16]"
    assert manifest("yes")["decisions"]["when"] == {
        "expression": "evaluate.metrics['models[rank=16]/step'] == 1",
        "values": {"evaluate.metrics['models[rank=16]/step']": 1},
        "result": True,
    }
    swept = manifest("evaluate")["decisions"]["sweep"]["models"]
    assert sorted(row["point"] for row in swept) == ["sft[rank=16]", "sft[rank=8]"]
    # What the false gate saw, beside where the artifact would be; and why its reader did not run.
    no = read_condition(plan.store, "no", plan.stages["no"].job.artifact_id)
    assert no["result"] is False and no["values"] == {
        "best.metrics['eval_loss']": manifest("best")["metrics"]["eval_loss"]
    }
    after = read_condition(plan.store, "after_no", plan.stages["after_no"].job.artifact_id)
    assert after["because"] == f"stage(s) no it reads were {SKIPPED_CONDITION}"
    # `base@1`: step 1 of base, committed as its own artifact before `early` read it.
    snapshot = plan.store.artifact_dir("base@1", plan.stages["base"].job.artifact_id)
    assert read_manifest(snapshot)["status"] == "complete"
    assert sorted(p.name for p in (snapshot / "checkpoint").iterdir()) == ["1"]
    assert manifest("early")["parents"][0]["stage"] == "base@1"
