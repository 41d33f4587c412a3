"""Checkpoint steps as inputs: `inputs: {checkpoint: pretrain@2000}`.

A training stage commits checkpoint steps as it goes (`checkpoint/<step>/`, with the
digests of its files written inside before Orbax's commit rename: engine/train/checkpoint.py).
A consumer of `pretrain@2000` waits until step 2000 is committed — whether pretrain is
still running or long finished — then reads it through a snapshot artifact:

    <store>/pretrain@2000/<pretrain's id>/
        artifact.json          complete; kind as pretrain's; parents: [pretrain/<id>]
        checkpoint/2000/...    hard links to the committed step's files (no copy; on a
                               bucket store whose engines write at the URL, copies made
                               in the bucket, server-side)
        tokenizer/ ...         copies of pretrain's other files as they were then

so the consumer sees an ordinary complete artifact whose checkpoint holds that one step,
its lineage names the stage and the step, and later retention of pretrain's old steps
(Orbax's `keep`, `trainflow gc --keep-steps`) does not take the snapshot's bytes. The
consumer's id covers `<pretrain's id>@2000`. The store says which steps are committed and
copies one (`committed_steps`, `copy_step`): on a bucket store the steps are read where the
engine writes them (at the URL, or in the staging copy), and the snapshot's other files come
from the staging copy of a stage running on this machine, uploaded like any artifact's.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable

from engine.contract import CHECKPOINT_DIR, MANIFEST
from tasks.store.base import ArtifactStore
from tasks.store.names import stage_folder
from tasks.store.records import COMPLETE, LOCK, ArtifactError, ArtifactLock, now_iso, read_manifest

_GROWING = ("tensorboard", "metrics.jsonl")  # appended to while a stage runs: not part of a step's view


def wait_for_step(
    store: ArtifactStore,
    stage: str,
    artifact_id: str,
    step: int,
    upstream_done: Callable[[], bool],
    log: Callable[[str], None],
    poll_seconds: float = 0.5,
) -> None:
    """Block until `stage`'s step `step` is committed; ArtifactError if the stage ends without it."""
    announced = False
    while True:
        if step in store.committed_steps(stage, artifact_id):
            return
        done = upstream_done() or store.state(stage, artifact_id) == COMPLETE
        if done and step not in (have := store.committed_steps(stage, artifact_id)):
            raise ArtifactError(
                f"{stage}@{step}: stage '{stage}' has ended without a committed step {step} in "
                f"{store.shown(store.checkpoint_location(stage, artifact_id))} "
                f"(its steps: {', '.join(map(str, have)) or 'none'}; "
                f"older ones may have been pruned by checkpoint.keep)"
            )
        if not announced:
            log(f"waiting for {stage}@{step}: step {step} of {store.location(stage, artifact_id)} is not committed yet")
            announced = True
        time.sleep(poll_seconds)


def snapshot_step(store: ArtifactStore, stage: str, artifact_id: str, step: int) -> tuple[str, str]:
    """The snapshot artifact of a committed step (made once; see the module docstring);
    returns its (stage, id) as a consumer's input names it."""
    snap_stage = f"{stage}@{step}"
    if store.is_complete(snap_stage, artifact_id):
        return snap_stage, artifact_id
    src = store.artifact_dir(stage, artifact_id)
    dst = store.artifact_dir(snap_stage, artifact_id)
    lock = ArtifactLock(dst)
    lock.acquire()
    try:
        if store.is_complete(snap_stage, artifact_id):
            return snap_stage, artifact_id
        for entry in dst.iterdir():  # a half-made snapshot of an earlier attempt
            if entry.name != LOCK:
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        problems = store.copy_step(stage, artifact_id, step, snap_stage)
        if problems:
            raise ArtifactError(
                f"{snap_stage}: step {step} of {store.location(stage, artifact_id)} does not match the digests "
                f"recorded when it was committed: {', '.join(problems[:5])}"
            )
        for entry in src.iterdir() if src.is_dir() else ():
            if entry.name in (CHECKPOINT_DIR, MANIFEST, LOCK, MANIFEST + ".tmp", *_GROWING):
                continue
            if entry.is_dir():
                shutil.copytree(entry, dst / entry.name)
            else:
                shutil.copy2(entry, dst / entry.name)
        source = read_manifest(src) or {}
        manifest = {
            "id": artifact_id,
            "kind": source.get("kind", "checkpoint"),
            "stage": snap_stage,
            "task": source.get("task"),
            "format_version": source.get("format_version"),
            "pipeline": source.get("pipeline"),
            "status": COMPLETE,
            "step": step,
            "parents": [
                {
                    "input": "step",
                    "stage": stage,
                    "id": artifact_id,
                    "kind": source.get("kind", "checkpoint"),
                    "path": f"{stage_folder(stage)}/{artifact_id}",
                }
            ],
            "config": source.get("config"),
            "config_as_written": source.get("config_as_written"),
            "metrics": {"step": step},
            "files": store.digest_payload(snap_stage, artifact_id),
            "code": source.get("code"),
            "created_at": now_iso(),
            "finished_at": now_iso(),
        }
        store.publish(snap_stage, artifact_id, manifest)
        return snap_stage, artifact_id
    finally:
        lock.release()
