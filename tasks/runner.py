"""Run one stage against the store: skip if done, lock, verify inputs, run, write the manifest.

This is the whole skip / resume / lock protocol, free of Prefect so it can be tested and
benchmarked alone; flows/pipeline.py wraps `execute_stage` in a Prefect task (and does not
retry the failures a retry would only repeat: tasks.launch.PermanentFailure among them).

The stage's engine children hold the artifact's lock with the runner (they inherit its
descriptor), so an orphaned engine finishes its checkpoint before another run may write.
A stage that ends in an error leaves a `failed` manifest naming it; if even that cannot be
written (a full disk), the manifest still says `running` but nobody holds the lock, and
`ArtifactStore.state` reports the artifact as partial.
"""

from __future__ import annotations

import errno
import os
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.contract import MANIFEST
from tasks.cutoff import REUSED_WHY, content_key, find_equivalent, reused_record
from tasks.launch.gang import holding_locks
from tasks.launch.run import DISK_FULL_ERRNOS, DiskFull, LauncherSpec, recording_layouts
from tasks.registry import StageContext, StageHooks, StageKind, substitute_inputs
from tasks.store.base import ArtifactStore
from tasks.store.records import COMPLETE, FAILED, RUNNING, ArtifactError, code_version, now_iso, write_json_atomic

SKIPPED, RAN, RESUMED, REUSED = "skipped", "ran", "resumed", "reused"
"""A stage's outcome; `reused`: early cutoff linked in an equal artifact (tasks/cutoff.py)."""


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
    """skipped | ran | resumed | reused"""
    metrics: dict[str, Any]
    seconds: float
    """Wall time of execute_stage."""
    work_seconds: float = 0.0
    """Wall time inside StageKind.run (0 when skipped)."""

    def to_dict(self) -> dict:
        return {
            "stage": self.stage,
            "task": self.task,
            "artifact_id": self.artifact_id,
            "path": str(self.path),
            "status": self.status,
            "metrics": self.metrics,
            "seconds": round(self.seconds, 3),
            "work_seconds": round(self.work_seconds, 3),
        }


NOT_WRITABLE_ERRNOS = (errno.EROFS, errno.EACCES, errno.EPERM)
"""Claiming an artifact (its first write) on a read-only file system, or without permission."""


def _classify(error: BaseException, stage: str, out_dir: Path) -> BaseException:
    """`error`, or a DiskFull naming the path when it is an ENOSPC/EDQUOT OSError (which a
    plain OSError often does not: a failed write() carries no filename)."""
    if isinstance(error, OSError) and error.errno in DISK_FULL_ERRNOS:
        where = error.filename or out_dir
        return DiskFull(f"stage '{stage}': {os.strerror(error.errno)} writing {where}; free space, then re-run")
    return error


def _record_failure(path: Path, manifest: dict, error: BaseException, hooks: StageHooks) -> None:
    """The manifest turned `failed` with the error, if the disk still takes it."""
    manifest.update(
        status=FAILED,
        error=f"{type(error).__name__}: {error}",
        error_traceback=traceback.format_exc(limit=20),
        finished_at=now_iso(),
    )
    try:
        write_json_atomic(path, manifest)
    except OSError as e:  # e.g. the disk is full: the released lock still marks it partial
        hooks.log(f"could not record the failure in {path}: {e}")


def _manifest(
    job: StageJob, store: ArtifactStore, inputs: dict, key: str, previous: dict, run_info: dict[str, Any] | None
) -> dict:
    """The stage's manifest as it starts (`running`, no files yet)."""
    return {
        "id": job.artifact_id,
        "kind": job.kind.output_kind(job.config),
        "stage": job.stage,
        "task": job.task,
        "format_version": job.kind.version,
        "pipeline": job.pipeline,
        "status": RUNNING,
        "parents": [
            {
                "input": name,
                "stage": ref.stage,
                "id": ref.id,
                "kind": ref.kind,
                "path": ref.path.relative_to(store.root).as_posix(),
            }
            for name, ref in inputs.items()
        ],
        "content_key": key,  # looked up for early cutoff (tasks/cutoff.py), not part of the id
        "config": job.config.model_dump(mode="json"),
        "config_as_written": job.config_as_written,
        # How it was computed, not what: neither is part of the id (results do not depend on them).
        "launcher": job.launcher.provenance() if job.kind.launches_child else None,
        "layout": None,
        "metrics": {},
        "files": {},
        "code": code_version(),
        "created_at": previous.get("created_at") or now_iso(),
        "finished_at": None,
        "attempts": int(previous.get("attempts", 0)) + 1,
        "prefect": run_info or {},
    }


def _reuse(job: StageJob, store: ArtifactStore, key: str, manifest: dict, claim: Any, hooks: StageHooks) -> dict | None:
    """Early cutoff: the committed manifest when a complete artifact of the stage holds what
    it would write (the same content key), its payload now this artifact's; else None."""
    source = find_equivalent(store, job.kind, job.stage, key, job.artifact_id)
    if source is None:
        return None
    origin = source.get("reused") or reused_record(source)  # where the bytes were made
    manifest.update(
        status=COMPLETE,
        metrics=source.get("metrics") or {},
        files=source["files"],
        launcher=source.get("launcher"),
        layout=source.get("layout"),
        code=source.get("code"),
        reused={**origin, "linked_from": f"{job.stage}/{source['id']}"},
        finished_at=now_iso(),
    )
    store.artifact_dir(job.stage, job.artifact_id).mkdir(parents=True, exist_ok=True)
    problems = store.reuse(job.stage, source["id"], job.artifact_id, manifest, claim)
    if problems:
        hooks.log(f"not reusing {store.location(job.stage, source['id'])}: {problems[0]}; running the stage")
        return None
    hooks.log(
        f"{REUSED_WHY}: {job.stage} holds the bytes of {origin['stage']}/{origin['id']} "
        f"-> {store.location(job.stage, job.artifact_id)}"
    )
    hooks.progress(1.0)
    return manifest


def execute_stage(
    job: StageJob, store: ArtifactStore, hooks: StageHooks | None = None, run_info: dict[str, Any] | None = None
) -> StageResult:
    """Make sure the artifact `job.artifact_id` exists in `store`, doing only missing work.

    The same protocol on every store (tasks/store/): the store's implementation decides what
    claiming, preparing, running alongside, committing and keeping a partial result take."""
    hooks = hooks or StageHooks()
    start = time.perf_counter()
    out_dir = store.artifact_dir(job.stage, job.artifact_id)

    def done(status: str, manifest: dict, work_seconds: float = 0.0) -> StageResult:
        return StageResult(
            job.stage,
            job.task,
            job.artifact_id,
            out_dir,
            status,
            manifest.get("metrics") or {},
            time.perf_counter() - start,
            work_seconds,
        )

    where = store.location(job.stage, job.artifact_id)
    if store.is_complete(job.stage, job.artifact_id):
        store.check_sizes(job.stage, job.artifact_id)  # a truncated copy is refused, never skipped
        hooks.log(f"skipped: {job.stage} is complete at {where}")
        return done(SKIPPED, store.manifest(job.stage, job.artifact_id) or {})

    try:  # the stage's first write to the store
        claim = store.claim(job.stage, job.artifact_id, (run_info or {}).get("flow_run_id"), on_wait=hooks.log)
    except OSError as e:
        if e.errno in NOT_WRITABLE_ERRNOS:  # a retry would meet it again
            raise ArtifactError(
                f"stage '{job.stage}': cannot write {e.filename or out_dir} ({os.strerror(e.errno)}); the artifact "
                f"store must be writable: pass another --store, or make it writable"
            ) from e
        error = _classify(e, job.stage, out_dir)
        if error is e:
            raise
        raise error from e
    try:
        if store.is_complete(job.stage, job.artifact_id):  # another run finished it while we waited
            hooks.log(f"skipped: {job.stage} was completed by another run at {where}")
            return done(SKIPPED, store.manifest(job.stage, job.artifact_id) or {})
        inputs = {}
        for name, (stage, artifact_id) in job.inputs.items():
            try:
                inputs[name] = store.open_input(stage, artifact_id)
            except ArtifactError as e:
                raise ArtifactError(f"stage '{job.stage}': input '{name}': {e}") from None
        previous = store.manifest(job.stage, job.artifact_id) or {}
        key = content_key(job.kind, job.config, inputs)
        reused = _reuse(job, store, key, _manifest(job, store, inputs, key, previous, run_info), claim, hooks)
        if reused is not None:
            return done(REUSED, reused)
        store.prepare(job.stage, job.artifact_id, log=hooks.log)  # a partial artifact's payload, to resume from
        resumed = store.has_partial(job.stage, job.artifact_id)
        manifest = _manifest(job, store, inputs, key, previous, run_info)
        out_dir.mkdir(parents=True, exist_ok=True)
        store.write_manifest(job.stage, job.artifact_id, manifest)
        hooks.log(f"{'resuming' if resumed else 'running'} {job.stage} ({job.task}) -> {where}")
        config = substitute_inputs(job.config, inputs, job.stage)
        shown = StageHooks(
            log=lambda line: hooks.log(store.shown(line)), metrics=hooks.metrics, progress=hooks.progress
        )
        ctx = StageContext(
            job.stage,
            config,
            inputs,
            out_dir,
            job.launcher,
            resumed,
            shown,
            checkpoint_dir=store.checkpoint_location(job.stage, job.artifact_id),
        )
        work_start = time.perf_counter()
        try:
            running = store.running(job.stage, job.artifact_id, claim, log=hooks.log)
            with holding_locks(claim.fd), recording_layouts() as layouts, running:  # the children hold the lock too
                metrics = job.kind.run(ctx) or {}
            work_seconds = time.perf_counter() - work_start
            manifest.update(
                status=COMPLETE,
                metrics=metrics,
                layout=layouts[-1] if layouts else None,
                files=store.digest_payload(job.stage, job.artifact_id),
                finished_at=now_iso(),
            )
            store.commit(job.stage, job.artifact_id, manifest, claim)  # last: from here on the artifact exists
        except BaseException as e:
            _record_failure(out_dir / MANIFEST, manifest, _classify(e, job.stage, out_dir), hooks)
            store.keep_partial(job.stage, job.artifact_id, claim, log=hooks.log)
            raise
        hooks.progress(1.0)
        return done(RESUMED if resumed else RAN, manifest, work_seconds)
    except OSError as e:
        error = _classify(e, job.stage, out_dir)
        if error is e:
            raise
        raise error from e
    finally:
        claim.release()
