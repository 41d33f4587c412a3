"""Retention: `trainflow gc` deletes what no kept pipeline reaches, and old checkpoint steps.

    trainflow gc --keep configs/pipelines/quickstart.yaml --keep sweep.yaml --dry-run
    trainflow gc --store s3://bucket/artifacts --keep p.yaml --keep-steps 1

Kept: every artifact a kept pipeline's plan names (each stage's id as planned now, every
candidate of a selection, the snapshot of each checkpoint step it reads), everything in
their lineage (manifests' `parents`, transitively), and every artifact being written (its
lock or lease is held) with its lineage, whatever pipeline it belongs to. The rest is
deleted; without `--keep`, no artifact is. `--keep-steps N` deletes, in every complete
artifact that is kept, the checkpoint steps older than its newest N, and drops their files
from its manifest (so `trainflow verify` still holds).

An artifact is deleted only under its own lock (and, on a bucket, its lease), taken without
waiting: one a run holds is left alone and listed as in use. Its manifest goes first, so a
half-deleted artifact reads as partial, never as complete.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

from engine.config import ConfigError
from engine.contract import CHECKPOINT_DIR
from flows.gates import clear_condition
from flows.inspection import human
from flows.spec import Plan
from flows.sweep import Ref, Selection
from tasks.store.base import ArtifactStore
from tasks.store.local import committed_steps
from tasks.store.names import folder_stage
from tasks.store.records import COMPLETE, InputError


@dataclass
class Entry:
    stage: str
    artifact_id: str
    directory: Path
    manifest: dict | None
    state: str
    size: int

    @property
    def name(self) -> str:
        return f"{self.stage}/{self.artifact_id}"


@dataclass
class Collection:
    """What a gc would do: artifacts to delete, steps to prune, what it leaves and why."""

    delete: list[Entry] = field(default_factory=list)
    prune: list[tuple[Entry, list[int], int]] = field(default_factory=list)
    """(artifact, its steps to delete, their bytes)."""
    in_use: list[Entry] = field(default_factory=list)
    kept: int = 0

    @property
    def freed(self) -> int:
        return sum(e.size for e in self.delete) + sum(size for _, _, size in self.prune)


def _size(store: ArtifactStore, entry: Entry) -> int:
    files = (entry.manifest or {}).get("files") or {}
    if files:
        return sum(int(f.get("size", 0)) for f in files.values())
    return store.stored_bytes(entry.stage, entry.artifact_id)


def planned_roots(plan: Plan) -> set[tuple[str, str]]:
    """(stage, id) of every artifact a plan names as it stands."""
    roots = set()
    for name, planned in plan.stages.items():
        if planned.resolved or plan.resolve(name) is not None:
            roots.add((name, planned.job.artifact_id))
        for ref in planned.refs.values():
            if isinstance(ref, Ref) and ref.step is not None and plan.stages[ref.stage].resolved:
                roots.add((f"{ref.stage}@{ref.step}", plan.stages[ref.stage].job.artifact_id))
            elif isinstance(ref, Selection):
                roots.update((c, plan.stages[c].job.artifact_id) for c in ref.candidates if plan.stages[c].resolved)
    return roots


def collect(store: ArtifactStore, plans: list[Plan], keep_steps: int | None) -> Collection:
    """What `gc` would delete in `store`, keeping what `plans` reach (see the module docstring)."""
    try:
        store.require()
    except InputError:
        raise ConfigError(f"gc: store {store.url} does not exist (nothing to list)") from None
    try:
        listing = list(store.iter_artifacts())
    except OSError as e:
        raise ConfigError(f"gc: cannot list store {store.url}: {type(e).__name__}: {e}") from None
    entries = {}
    for directory, manifest in listing:
        stage, artifact_id = folder_stage(directory.parent.name), directory.name
        entries[(stage, artifact_id)] = Entry(
            stage, artifact_id, directory, manifest, store.state(stage, artifact_id), 0
        )
    named = set().union(*(planned_roots(plan) for plan in plans)) if plans else set()
    running = {key for key, e in entries.items() if e.state == "running"}
    roots = named | running
    reachable: set[tuple[str, str]] = set()
    todo = list(roots)
    while todo:  # lineage: parents of what is kept are kept
        key = todo.pop()
        if key in reachable:
            continue
        reachable.add(key)
        entry = entries.get(key)
        for parent in ((entry.manifest or {}).get("parents") or []) if entry else []:
            todo.append((parent["stage"], parent["id"]))
    out = Collection()
    for key, entry in entries.items():
        if key in running and key not in named:
            out.in_use.append(entry)  # kept, with its lineage: a run is writing it
            continue
        if key in reachable or not plans:
            out.kept += 1
            if keep_steps is not None and entry.state == COMPLETE:
                steps = _steps(store, entry)
                old = steps[:-keep_steps] if keep_steps > 0 else steps
                if old:
                    files = (entry.manifest or {}).get("files") or {}
                    size = sum(
                        int(f.get("size", 0))
                        for rel, f in files.items()
                        if rel.split("/")[:2] in ([CHECKPOINT_DIR, str(s)] for s in old)
                    )
                    out.prune.append((entry, old, size))
            continue
        entry.size = _size(store, entry)
        out.delete.append(entry)
    return out


def _steps(store: ArtifactStore, entry: Entry) -> list[int]:
    """The committed checkpoint steps of an artifact, ascending (from its manifest's files)."""
    files = (entry.manifest or {}).get("files") or {}
    steps = {
        int(parts[1])
        for parts in (rel.split("/") for rel in files)
        if len(parts) > 2 and parts[0] == CHECKPOINT_DIR and parts[1].isdigit()
    }
    if not steps:  # a manifest without files: the steps its local directory holds
        steps = set(committed_steps(entry.directory))
    return sorted(steps)


def apply(store: ArtifactStore, collection: Collection, log=print) -> tuple[int, list[Entry]]:
    """Delete what `collect` found; returns (bytes freed, entries left because a run took them)."""
    freed, busy = 0, []
    for entry in collection.delete:
        held = store.try_claim(entry.stage, entry.artifact_id)
        # Under the claim no run writes it; a manifest that changed since `collect` read it
        # means one did meanwhile. (`store.state` would read our own claim as a run's.)
        if held is not None and store.manifest(entry.stage, entry.artifact_id) != entry.manifest:
            held.release()
            held = None
        if held is None:
            busy.append(entry)
            continue
        try:
            store.delete(entry.stage, entry.artifact_id, held)
            clear_condition(store, entry.stage, entry.artifact_id)
        finally:
            held.release()
        shutil.rmtree(entry.directory, ignore_errors=True)
        try:
            entry.directory.parent.rmdir()  # the stage's directory, once empty
        except OSError:
            pass
        freed += entry.size
        log(f"deleted {entry.name} ({human(entry.size)})")
    for entry, steps, size in collection.prune:
        held = store.try_claim(entry.stage, entry.artifact_id)
        if held is None:
            busy.append(entry)
            continue
        try:
            manifest = store.manifest(entry.stage, entry.artifact_id) or {}
            gone = {str(s) for s in steps}
            files = manifest.get("files") or {}
            manifest["files"] = {rel: f for rel, f in files.items() if not _in_steps(rel, gone)}
            manifest["pruned_steps"] = sorted({*manifest.get("pruned_steps", []), *steps})
            store.write_manifest(entry.stage, entry.artifact_id, manifest)  # the smaller file list first
            store.drop_steps(entry.stage, entry.artifact_id, steps, held)
        finally:
            held.release()
        freed += size
        log(f"pruned {entry.name}: checkpoint steps {', '.join(map(str, steps))} ({human(size)})")
    return freed, busy


def _in_steps(rel: str, steps: set[str]) -> bool:
    parts = rel.split("/")
    return len(parts) > 2 and parts[0] == CHECKPOINT_DIR and parts[1] in steps
