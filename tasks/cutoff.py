"""Early cutoff: a stage whose consumed bytes are those of a finished artifact is not run again.

An artifact id covers its inputs' ids (tasks/store/records.py), so a stage re-run upstream
-- its config changed -- gives every descendant a new id, even where the re-run wrote the
same bytes. Before a stage with a new id runs, the runner computes its **content key**: a
hash of the task kind, its format version, the config as the id covers it and, for each
input, the digests of the files the stage consumes of it (as the input's manifest recorded
them). A complete artifact of the same stage with the same key holds what this stage would
write (the id's own promise: same work, same result), so its payload is linked in under the
new id and the stage is `reused` instead of run; its consumers then find their inputs'
bytes unchanged too, and the cutoff goes down the DAG. Ids do not change: the key is looked
up, never part of an id.

What a stage consumes of an input: of one declared `through_paths` (a corpus that configs
name as `{input:corpus}/sft.jsonl`), the files those paths name, prefix-matched so that a
directory or a glob covers what it may read (a bare `{input:corpus}` covers everything);
of any other, what a consumer reads (tasks/store/consume.py: the newest checkpoint step's
parameters, and every file outside checkpoint/). A reused artifact's manifest records both
lineages: `parents` are the inputs it stands for now, `reused` names the artifact whose bytes
it holds and the parents that one was made from. An artifact made before manifests recorded
the key gets it recomputed from its manifest and its parents' (`recorded_key`), where its id
can be recomputed too.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Iterator
from typing import Any

from tasks.registry import INPUT_REF, StageKind
from tasks.store.base import ArtifactStore
from tasks.store.consume import consumed_files
from tasks.store.names import stage_folder
from tasks.store.records import COMPLETE, ID_LENGTH, ArtifactRef, artifact_id, canonical_json

REUSED_WHY = "reused (same inputs by content)"
_GLOB = ("*", "?", "[")


def path_prefixes(tree: Any, name: str) -> Iterator[str]:
    """Paths inside input `name` that a config names, as `rel` of `{input:name}/rel` ("" = all of it)."""
    if isinstance(tree, dict):
        for value in tree.values():
            yield from path_prefixes(value, name)
    elif isinstance(tree, list):
        for value in tree:
            yield from path_prefixes(value, name)
    elif isinstance(tree, str):
        for match in INPUT_REF.finditer(tree):
            if match.group(1) != name:
                continue
            rel = tree[match.end() :].split("{input:", 1)[0].lstrip("/")
            for char in _GLOB:  # a glob reads what starts with its literal head
                rel = rel.split(char, 1)[0]
            rel = rel.removeprefix("./")
            yield "" if ".." in rel.split("/") else rel


def consumed_view(ref: ArtifactRef, prefixes: list[str] | None) -> dict[str, str]:
    """relative path -> sha256 of what a stage consumes of an input: with `prefixes` (an input
    read through paths), the recorded files under them; else consume.consumed_files."""
    files = ref.manifest.get("files") or {}
    if prefixes is None:
        chosen = consumed_files(files)
    else:
        chosen = {rel: entry for rel, entry in files.items() if any(rel.startswith(p) for p in prefixes)}
    return {rel: entry["sha256"] for rel, entry in sorted(chosen.items())}


def content_key(kind: StageKind, config: Any, inputs: dict[str, ArtifactRef]) -> str:
    """The stage's key by the bytes it consumes (see the module docstring)."""
    tree = config.model_dump(mode="json")
    consumed = {}
    for name, ref in inputs.items():
        declared = kind.inputs.get(name) or kind.other_inputs
        prefixes = list(path_prefixes(tree, name)) if declared is not None and declared.through_paths else None
        view = consumed_view(ref, prefixes)
        consumed[name] = hashlib.sha256(canonical_json(view).encode()).hexdigest()
    payload = {"task": kind.task, "version": kind.version, "config": kind.fingerprint(config), "consumed": consumed}
    return hashlib.sha256(canonical_json(payload).encode()).hexdigest()[:ID_LENGTH]


def find_equivalent(store: ArtifactStore, kind: StageKind, stage: str, key: str, artifact_id: str) -> dict | None:
    """The manifest of a complete artifact of `stage` (not `artifact_id`) whose content key is
    `key`, the most recently finished if several; else None."""
    found = []
    for other in store.stage_artifacts(stage):
        if other == artifact_id:
            continue
        manifest = store.manifest(stage, other)
        if not (manifest and manifest.get("status") == COMPLETE and manifest.get("id") == other):
            continue
        recorded = manifest.get("content_key") or recorded_key(store, kind, manifest)
        if recorded == key and manifest.get("files"):
            found.append(manifest)
    return max(found, key=lambda m: str(m.get("finished_at") or ""), default=None)


def recorded_key(store: ArtifactStore, kind: StageKind, manifest: dict) -> str | None:
    """The content key of an artifact made before manifests recorded one, from its manifest and
    its parents'; None unless its id, recomputed from the same config, is its own (so the
    config was read back as it was fingerprinted) and every parent is complete."""
    if manifest.get("task") != kind.task or manifest.get("format_version") != kind.version:
        return None
    try:
        # As the pipeline resolved it (a dump of the resolved config does not always validate again).
        config = kind.resolve_config(copy.deepcopy(manifest["config_as_written"]), f"{manifest['stage']} (manifest)")
        refs, input_ids = {}, {}
        for parent in manifest.get("parents") or []:
            upstream = store.manifest(parent["stage"], parent["id"])
            if not upstream or upstream.get("status") != COMPLETE:
                return None
            path = store.artifact_dir(parent["stage"], parent["id"])
            refs[parent["input"]] = ArtifactRef(parent["stage"], parent["id"], path, upstream)
            step = parent["stage"].rpartition("@")[2] if "@" in parent["stage"] else None  # a checkpoint step
            input_ids[parent["input"]] = f"{parent['id']}@{step}" if step else parent["id"]
        if artifact_id(kind.task, kind.version, kind.fingerprint(config), input_ids) != manifest["id"]:
            return None
        return content_key(kind, config, refs)
    except Exception:  # a manifest this code cannot read back: not reused, never an error
        return None


def reused_record(source: dict) -> dict:
    """The manifest's `reused` entry: the artifact whose bytes these are, and its own parents."""
    return {
        "stage": source["stage"],
        "id": source["id"],
        "path": f"{stage_folder(source['stage'])}/{source['id']}",
        "parents": source.get("parents") or [],
        "created_at": source.get("created_at"),
        "finished_at": source.get("finished_at"),
        "prefect": source.get("prefect") or {},
    }
