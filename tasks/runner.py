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

import os
import time
import traceback
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks.artifacts import (
    COMPLETE,
    FAILED,
    MANIFEST,
    RUNNING,
    ArtifactError,
    ArtifactLock,
    ArtifactStore,
    code_version,
    digest_files,
    now_iso,
    read_manifest,
    write_json_atomic,
)
from tasks.gang import holding_locks
from tasks.launch import DISK_FULL_ERRNOS, DiskFull, LauncherSpec, recording_layouts
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


def _has_partial_payload(directory: Path) -> bool:
    return directory.is_dir() and any(p.name not in (MANIFEST, ".lock") for p in directory.iterdir())


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


def execute_stage(
    job: StageJob, store: ArtifactStore, hooks: StageHooks | None = None, run_info: dict[str, Any] | None = None
) -> StageResult:
    """Make sure the artifact `job.artifact_id` exists in `store`, doing only missing work."""
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
    remote = store.remote
    if store.is_complete(job.stage, job.artifact_id):
        hooks.log(f"skipped: {job.stage} is complete at {where}")
        return done(SKIPPED, store.manifest(job.stage, job.artifact_id) or {})

    lock = ArtifactLock(out_dir)  # on a bucket: the local staging directory's lock ...
    lock.acquire(on_wait=hooks.log)
    lease = None
    try:
        if remote is not None:  # ... and the bucket's lease, for runs on other machines
            lease = remote.lease(job.stage, job.artifact_id, (run_info or {}).get("flow_run_id"))
            lease.acquire(on_wait=hooks.log)
        if store.is_complete(job.stage, job.artifact_id):  # another run finished it while we waited
            hooks.log(f"skipped: {job.stage} was completed by another run at {where}")
            return done(SKIPPED, store.manifest(job.stage, job.artifact_id) or {})
        inputs = {}
        for name, (stage, artifact_id) in job.inputs.items():
            try:
                inputs[name] = store.open_input(stage, artifact_id)
            except ArtifactError as e:
                raise ArtifactError(f"stage '{job.stage}': input '{name}': {e}") from None
        if remote is not None:  # a partial artifact on the bucket: resume from its payload
            out_dir.mkdir(parents=True, exist_ok=True)
            remote.download(job.stage, job.artifact_id, out_dir, with_manifest=False, partial=True, log=hooks.log)
        resumed = _has_partial_payload(out_dir)
        previous = store.manifest(job.stage, job.artifact_id) or {}
        manifest = {
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
        write_json_atomic(out_dir / MANIFEST, manifest)
        if remote is not None:
            remote.write_manifest(job.stage, job.artifact_id, manifest)
        hooks.log(f"{'resuming' if resumed else 'running'} {job.stage} ({job.task}) -> {where}")
        config = substitute_inputs(job.config, inputs, job.stage)
        ctx = StageContext(
            job.stage,
            config,
            inputs,
            out_dir,
            job.launcher,
            resumed,
            hooks if remote is None else _showing_urls(hooks, store),
        )
        work_start = time.perf_counter()
        try:
            # On a bucket, checkpoint steps are uploaded as they commit: a SIGKILLed run resumes elsewhere.
            mirror = (
                nullcontext()
                if remote is None
                else remote.mirror(
                    job.stage, job.artifact_id, out_dir, log=hooks.log, keep_going=lambda: not lease.lost
                )
            )
            with holding_locks(lock.fd), recording_layouts() as layouts, mirror:  # the children hold the lock too
                metrics = job.kind.run(ctx) or {}
            work_seconds = time.perf_counter() - work_start
            manifest.update(
                status=COMPLETE,
                metrics=metrics,
                layout=layouts[-1] if layouts else None,
                files=digest_files(out_dir),
                finished_at=now_iso(),
            )
            if remote is not None:  # the payload, then the manifest: one atomic PUT, last
                remote.upload(out_dir, job.stage, job.artifact_id, delete_extra=True)  # the manifest's files only
                if lease.lost:
                    raise ArtifactError(
                        f"stage '{job.stage}': the lease on {where} expired and was taken over "
                        f"by another run; not committing"
                    )
                remote.write_manifest(job.stage, job.artifact_id, manifest)
            write_json_atomic(out_dir / MANIFEST, manifest)  # last: from here on the artifact exists
        except BaseException as e:
            _record_failure(out_dir / MANIFEST, manifest, _classify(e, job.stage, out_dir), hooks)
            if remote is not None and not (lease and lease.lost):
                _upload_partial(remote, job, out_dir, hooks)
            raise
        hooks.progress(1.0)
        return done(RESUMED if resumed else RAN, manifest, work_seconds)
    except OSError as e:
        error = _classify(e, job.stage, out_dir)
        if error is e:
            raise
        raise error from e
    finally:
        if lease is not None:
            lease.release()
        lock.release()


def _showing_urls(hooks: StageHooks, store: ArtifactStore) -> StageHooks:
    """The stage's hooks, its log lines naming the bucket's URLs instead of the local staging
    copies the engine works in (`<cache>/pretrain/ID/checkpoint` -> `s3://b/p/pretrain/ID/checkpoint`)."""
    root, url = str(store.root), store.url
    return StageHooks(
        log=lambda message: hooks.log(message.replace(root, url)), metrics=hooks.metrics, progress=hooks.progress
    )


def _upload_partial(remote, job: StageJob, out_dir: Path, hooks: StageHooks) -> None:
    """A failed or interrupted stage on a bucket: upload what it has (committed checkpoint
    steps included) and the `failed` manifest, so any machine resumes from there."""
    try:
        remote.upload(out_dir, job.stage, job.artifact_id)
        manifest = read_manifest(out_dir)
        if manifest is not None:
            remote.write_manifest(job.stage, job.artifact_id, manifest)
    except Exception as e:  # the original error matters more
        hooks.log(f"could not upload the partial artifact to {remote.url_of(job.stage, job.artifact_id)}: {e}")
