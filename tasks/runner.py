"""Run one stage against the store: skip if done, lock, verify inputs, run, write the manifest.

This is the whole skip / resume / lock protocol, free of Prefect so it can be tested and
benchmarked alone; flows/pipeline.py wraps `execute_stage` in a Prefect task.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks.artifacts import (
    COMPLETE, FAILED, MANIFEST, RUNNING, ArtifactError, ArtifactLock, ArtifactStore, code_version,
    digest_files, now_iso, read_manifest, write_json_atomic,
)
from tasks.launch import LauncherSpec
from tasks.registry import StageContext, StageHooks, StageKind, substitute_inputs

SKIPPED, RAN, RESUMED = "skipped", "ran", "resumed"


@dataclass
class StageJob:
    """One planned stage: everything needed to run it or to know it is done."""

    stage: str
    kind: StageKind
    config: Any
    """The validated config (a pydantic model)."""
    config_as_written: dict
    """The config as the pipeline spelled it (defaults merged), for humans and lineage."""
    inputs: dict[str, tuple[str, str]]
    """input name -> (upstream stage, upstream artifact id)."""
    artifact_id: str
    launcher: LauncherSpec = field(default_factory=LauncherSpec)
    pipeline: str = ""

    @property
    def task(self) -> str:
        return self.kind.task


@dataclass
class StageResult:
    stage: str
    task: str
    artifact_id: str
    path: Path
    status: str
    """skipped | ran | resumed"""
    metrics: dict[str, Any]
    seconds: float
    """Wall time of execute_stage."""
    work_seconds: float = 0.0
    """Wall time inside StageKind.run (0 when skipped)."""

    def to_dict(self) -> dict:
        return {"stage": self.stage, "task": self.task, "artifact_id": self.artifact_id, "path": str(self.path),
                "status": self.status, "metrics": self.metrics, "seconds": round(self.seconds, 3),
                "work_seconds": round(self.work_seconds, 3)}


def _has_partial_payload(directory: Path) -> bool:
    return directory.is_dir() and any(p.name not in (MANIFEST, ".lock") for p in directory.iterdir())


def execute_stage(job: StageJob, store: ArtifactStore, hooks: StageHooks | None = None,
                  run_info: dict[str, Any] | None = None) -> StageResult:
    """Make sure the artifact `job.artifact_id` exists in `store`, doing only missing work."""
    hooks = hooks or StageHooks()
    start = time.perf_counter()
    out_dir = store.artifact_dir(job.stage, job.artifact_id)

    def done(status: str, manifest: dict, work_seconds: float = 0.0) -> StageResult:
        return StageResult(job.stage, job.task, job.artifact_id, out_dir, status, manifest.get("metrics") or {},
                           time.perf_counter() - start, work_seconds)

    if store.is_complete(job.stage, job.artifact_id):
        hooks.log(f"skipped: {job.stage} is complete at {out_dir}")
        return done(SKIPPED, read_manifest(out_dir) or {})

    lock = ArtifactLock(out_dir)
    lock.acquire(on_wait=hooks.log)
    try:
        if store.is_complete(job.stage, job.artifact_id):  # another run finished it while we waited
            hooks.log(f"skipped: {job.stage} was completed by another run at {out_dir}")
            return done(SKIPPED, read_manifest(out_dir) or {})
        inputs = {}
        for name, (stage, artifact_id) in job.inputs.items():
            try:
                inputs[name] = store.open_input(stage, artifact_id)
            except ArtifactError as e:
                raise ArtifactError(f"stage '{job.stage}': input '{name}': {e}") from None
        resumed = _has_partial_payload(out_dir)
        previous = read_manifest(out_dir) or {}
        manifest = {
            "id": job.artifact_id,
            "kind": job.kind.output,
            "stage": job.stage,
            "task": job.task,
            "format_version": job.kind.version,
            "pipeline": job.pipeline,
            "status": RUNNING,
            "parents": [
                {"input": name, "stage": ref.stage, "id": ref.id, "kind": ref.kind,
                 "path": ref.path.relative_to(store.root).as_posix()}
                for name, ref in inputs.items()
            ],
            "config": job.config.model_dump(mode="json"),
            "config_as_written": job.config_as_written,
            "metrics": {},
            "files": {},
            "code": code_version(),
            "created_at": previous.get("created_at") or now_iso(),
            "finished_at": None,
            "attempts": int(previous.get("attempts", 0)) + 1,
            "prefect": run_info or {},
        }
        write_json_atomic(out_dir / MANIFEST, manifest)
        hooks.log(f"{'resuming' if resumed else 'running'} {job.stage} ({job.task}) -> {out_dir}")
        config = substitute_inputs(job.config, inputs, job.stage)
        ctx = StageContext(job.stage, config, inputs, out_dir, job.launcher, resumed, hooks)
        work_start = time.perf_counter()
        try:
            metrics = job.kind.run(ctx) or {}
        except BaseException as e:
            manifest.update(status=FAILED, error=f"{type(e).__name__}: {e}",
                            error_traceback=traceback.format_exc(limit=20), finished_at=now_iso())
            write_json_atomic(out_dir / MANIFEST, manifest)
            raise
        work_seconds = time.perf_counter() - work_start
        manifest.update(status=COMPLETE, metrics=metrics, files=digest_files(out_dir), finished_at=now_iso())
        write_json_atomic(out_dir / MANIFEST, manifest)  # last: from here on the artifact exists
        hooks.progress(1.0)
        return done(RESUMED if resumed else RAN, manifest, work_seconds)
    finally:
        lock.release()
