"""Checkpoint steps as inputs: `inputs: {checkpoint: pretrain@2000}`.

A training stage commits checkpoint steps as it goes (`checkpoint/<step>/`, with the
digests of its files written inside before Orbax's commit rename: engine/train/checkpoint.py).
A consumer of `pretrain@2000` waits until step 2000 is committed — whether pretrain is
still running or long finished — then reads it through a snapshot artifact:

    <store>/pretrain@2000/<pretrain's id>/
        artifact.json          complete; kind as pretrain's; parents: [pretrain/<id>]
        checkpoint/2000/...    hard links to the committed step's files (no copy)
        tokenizer/ ...         copies of pretrain's other files as they were then

so the consumer sees an ordinary complete artifact whose checkpoint holds that one step,
its lineage names the stage and the step, and later retention of pretrain's old steps
(Orbax's `keep`, `trainflow gc --keep-steps`) does not take the snapshot's bytes. The
consumer's id covers `<pretrain's id>@2000`. On a bucket store the snapshot is made from
the local staging copy of a stage running on this machine and uploaded like any artifact.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from engine.contract import CHECKPOINT_DIR, MANIFEST
from tasks.store.base import ArtifactStore
from tasks.store.consume import sha256_file
from tasks.store.names import stage_folder
from tasks.store.records import (
    COMPLETE,
    LOCK,
    ArtifactError,
    ArtifactLock,
    digest_files,
    now_iso,
    read_manifest,
)

STEP_DIGESTS = "digests.json"
_GROWING = ("tensorboard", "metrics.jsonl")  # appended to while a stage runs: not part of a step's view


def committed_steps(directory: Path) -> list[int]:
    """Steps under `<artifact>/checkpoint/` that were committed (their digests are inside), ascending."""
    root = Path(directory) / CHECKPOINT_DIR
    if not root.is_dir():
        return []
    return sorted(int(p.name) for p in root.iterdir() if p.name.isdigit() and (p / STEP_DIGESTS).is_file())


def verify_committed_step(step_dir: Path) -> list[str]:
    """Files of a committed step that differ from the digests recorded at its commit."""
    try:
        recorded = json.loads((step_dir / STEP_DIGESTS).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return [STEP_DIGESTS]
    problems = []
    for rel, want in sorted(recorded.items()):
        path = step_dir / rel
        if not path.is_file() or path.stat().st_size != want["size"] or sha256_file(path) != want["sha256"]:
            problems.append(rel)
    return problems


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
    directory = store.artifact_dir(stage, artifact_id)
    announced = False
    while True:
        if step in committed_steps(directory):
            return
        done = upstream_done() or store.state(stage, artifact_id) == COMPLETE
        if done and step not in committed_steps(directory):
            have = committed_steps(directory)
            raise ArtifactError(
                f"{stage}@{step}: stage '{stage}' has ended without a committed step {step} in "
                f"{directory / CHECKPOINT_DIR} (its steps: {', '.join(map(str, have)) or 'none'}; "
                f"older ones may have been pruned by checkpoint.keep)"
            )
        if not announced:
            log(f"waiting for {stage}@{step}: step {step} of {store.location(stage, artifact_id)} is not committed yet")
            announced = True
        time.sleep(poll_seconds)


def _link_tree(src: Path, dst: Path) -> None:
    """Hard links to every file under src (a copy where the filesystem cannot link)."""
    for root, _, files in os.walk(src):
        target = dst / Path(root).relative_to(src)
        target.mkdir(parents=True, exist_ok=True)
        for name in files:
            try:
                os.link(Path(root) / name, target / name)
            except FileExistsError:
                pass
            except OSError:
                shutil.copy2(Path(root) / name, target / name)


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
        step_dir = src / CHECKPOINT_DIR / str(step)
        problems = verify_committed_step(step_dir)
        if problems:
            raise ArtifactError(
                f"{snap_stage}: step {step} of {store.location(stage, artifact_id)} does not match the digests "
                f"recorded when it was committed: {', '.join(problems[:5])}"
            )
        for entry in dst.iterdir():  # a half-made snapshot of an earlier attempt
            if entry.name != LOCK:
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        _link_tree(step_dir, dst / CHECKPOINT_DIR / str(step))
        for entry in src.iterdir():
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
            "files": digest_files(dst),
            "code": source.get("code"),
            "created_at": now_iso(),
            "finished_at": now_iso(),
        }
        store.publish(snap_stage, artifact_id, manifest)
        return snap_stage, artifact_id
    finally:
        lock.release()
