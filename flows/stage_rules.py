"""What the pipeline decides around one stage, as plain functions over the plan and its
store, without Prefect: whether a gate (`when:`) or a skipped upstream stage keeps it from
running, which checkpoint steps it reads (`stage@STEP`, committed first as snapshot
artifacts), and the decisions recorded with its artifact (the gate's values, the
selections, the sweep it read). flows/pipeline.py's Prefect task calls these around
tasks.runner.execute_stage; tests call them directly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from flows.gates import SKIPPED_CONDITION, clear_condition, record_condition, record_decisions
from flows.spec import Plan
from flows.steps import snapshot_step, wait_for_step
from flows.sweep import Ref
from flows.sweep_report import sweep_rows
from tasks.runner import StageJob
from tasks.store.records import ArtifactError


@dataclass
class BeforeStage:
    """What the rules decided before a stage runs."""

    job: StageJob
    """The stage's job, its selections resolved."""
    skip: dict | None = None
    """The condition record when the stage does not run (its gate is false, or a stage it
    reads was skipped); None when it runs."""
    decisions: dict = field(default_factory=dict)
    """Recorded with its artifact once it exists (after_stage): selections, the gate's values."""


def before_stage(
    plan: Plan, stage: str, skipped: set[str], ended: Callable[[str], bool], log: Callable[[str], None]
) -> BeforeStage:
    """Resolve a stage's selections, skip it behind a skipped stage or a false gate, and
    commit the checkpoint steps it reads (waiting for each while its stage runs; `ended(s)`
    says whether stage s has ended). `skipped`: the stages skipped so far in this run."""
    planned = plan.stages[stage]
    job = plan.resolve(stage)  # its selections, now that their candidates are done
    if job is None:
        raise ArtifactError(f"stage '{stage}': its selection's candidates are not all complete")
    blocked = sorted(s for s in (*planned.depends_on, *planned.follows) if s in skipped)
    if blocked:
        record: dict[str, Any] = {
            "expression": planned.gate.text if planned.gate else None,
            "values": {},
            "result": None,
        }
        record["because"] = f"stage(s) {', '.join(blocked)} it reads were {SKIPPED_CONDITION}"
        return BeforeStage(job, skip=record)
    for ref in planned.refs.values():  # checkpoint steps: once committed, as a snapshot artifact
        if isinstance(ref, Ref) and ref.step is not None:
            upstream, upstream_id = ref.stage, plan.stages[ref.stage].job.artifact_id
            wait_for_step(plan.store, upstream, upstream_id, ref.step, partial(ended, upstream), log)
            snapshot_step(plan.store, upstream, upstream_id, ref.step)
    decisions: dict[str, Any] = dict(planned.decisions)
    if planned.gate is not None:
        ok, seen = planned.gate.evaluate(plan.manifest_of, planned.gate_stages)
        seen_record: dict[str, Any] = {"expression": planned.gate.text, "values": seen, "result": ok}
        if not ok:
            return BeforeStage(job, skip=seen_record)
        clear_condition(plan.store, stage, job.artifact_id)
        decisions["when"] = seen_record
    return BeforeStage(job, decisions=decisions)


def skip_stage(plan: Plan, stage: str, job: StageJob, record: dict) -> tuple[dict, str]:
    """Record why a stage did not run beside where its artifact would be; (its outcome, the
    reason in words)."""
    record_condition(plan.store, stage, job.artifact_id, record)
    seen = ", ".join(f"{k} = {v!r}" for k, v in record.get("values", {}).items())
    why = record.get("because") or f"`{record['expression']}` is false ({seen})"
    outcome = {
        "stage": stage,
        "task": job.task,
        "artifact_id": job.artifact_id,
        "path": str(plan.store.artifact_dir(stage, job.artifact_id)),
        "status": SKIPPED_CONDITION,
        "metrics": {},
        "seconds": 0.0,
        "work_seconds": 0.0,
        "condition": record,
    }
    return outcome, why


def after_stage(plan: Plan, stage: str, job: StageJob, decisions: dict) -> dict[str, list[dict]]:
    """Record a finished stage's decisions in its manifest, with the sweep it read (a stage
    that fans in over a sweep's points); returns those sweep rows, input name -> points."""
    rows = sweep_rows(plan, stage) if plan.stages[stage].fan_in else {}
    if rows:
        decisions["sweep"] = rows
    if decisions:
        record_decisions(plan.store, stage, job.artifact_id, decisions)
    return rows
