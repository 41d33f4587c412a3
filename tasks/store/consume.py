"""What a stage reads of an input artifact, and how much checking that costs.

A stage that consumes a checkpoint artifact restores the parameters (or the adapter) of one
step, the newest: `engine.train.checkpoint.load_params` and every consumer after it read
`checkpoint/<newest>/params` and `meta`, never the optimizer state, the data-iterator
state or the other kept steps. `consumed_files` is that subset of a manifest's `files`;
everything outside `checkpoint/` (token shards, the tokenizer, metrics) is consumed whole.

Verification is proportional to what is read. Each consumed file is checked either by
sha256 against the manifest -- on a bucket as it is downloaded, so its bytes are read
once -- or by its **stamp**: `.verified.json` in the artifact directory holds, for every
file whose sha256 this machine last found equal to the manifest's, that digest and the
file's (size, mtime, ctime, inode). A file whose stat still equals its stamp has not been
written, replaced, touched back or copied since (ctime cannot be set from user space), so
the cheap check trusts it; any other file is re-hashed and its stamp renewed. The stamps
are written when a stage commits (its digests were just computed) and when an input is
verified. What they do not see is a change below the file system (a flipped bit on the
disk): `trainflow verify` re-hashes every file of an artifact on demand.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from engine.contract import CHECKPOINT_DIR

STAMPS = ".verified.json"
UNCONSUMED_ITEMS = frozenset({"opt_state", "data"})
"""Items of a checkpoint step (engine.train.checkpoint.ITEMS) that no consumer reads."""


def step_of(rel: str) -> int | None:
    """The checkpoint step a payload path belongs to (`checkpoint/40/params/...` -> 40), else None."""
    parts = rel.split("/")
    if len(parts) >= 3 and parts[0] == CHECKPOINT_DIR and parts[1].isdigit():
        return int(parts[1])
    return None


def consumed_files(files: dict[str, Any]) -> dict[str, Any]:
    """The part of a manifest's `files` that a consuming stage reads: of the checkpoint steps
    only the newest, and of it everything but its optimizer and data state."""
    steps = [step for step in map(step_of, files) if step is not None]
    newest = max(steps, default=None)
    out = {}
    for rel, entry in files.items():
        step = step_of(rel)
        if step is None or (step == newest and rel.split("/")[2] not in UNCONSUMED_ITEMS):
            out[rel] = entry
    return out


def sha256_file(path: Path, chunk: int = 8 << 20) -> str:
    """The sha256 of a file's bytes (hex): the one file hasher of the store and the pipeline."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def stat_stamp(path: Path) -> list[int]:
    stat = path.stat()
    return [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino]


def read_stamps(directory: Path) -> dict[str, dict]:
    try:
        stamps = json.loads((Path(directory) / STAMPS).read_text())
    except (OSError, ValueError):
        return {}
    return stamps if isinstance(stamps, dict) else {}


def write_stamps(directory: Path, verified: dict[str, str]) -> None:
    """Record (rel -> sha256 just found equal to the manifest's) with each file's stat, on top
    of the stamps already there. Best effort: a read-only store simply keeps re-hashing."""
    directory = Path(directory)
    stamps = read_stamps(directory)
    for rel, sha in verified.items():
        try:
            stamps[rel] = {"sha256": sha, "stat": stat_stamp(directory / rel)}
        except OSError:
            stamps.pop(rel, None)
    tmp = directory / (STAMPS + f".{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(stamps, separators=(",", ":")))
        os.replace(tmp, directory / STAMPS)
    except OSError:
        tmp.unlink(missing_ok=True)


def stamp_holds(path: Path, entry: dict, stamp: dict | None) -> bool:
    """Whether `path` is the file whose sha256 was found to be `entry['sha256']`, unchanged since."""
    if not stamp or stamp.get("sha256") != entry.get("sha256"):
        return False
    try:
        return stat_stamp(path) == stamp.get("stat")
    except OSError:
        return False


def size_problems(recorded: dict[str, dict], present: dict[str, Path], extras: bool = True) -> list[str]:
    """Every recorded file present at its size (and, with `extras`, nothing else there): a
    stat each, no bytes read."""
    problems = []
    for rel, entry in sorted(recorded.items()):
        path = present.get(rel)
        if path is None:
            problems.append(f"{rel}: missing")
        elif path.stat().st_size != entry["size"]:
            problems.append(f"{rel}: size {path.stat().st_size} != recorded {entry['size']}")
    for rel in sorted(set(present) - set(recorded)) if extras else ():
        problems.append(f"{rel}: not part of the artifact (added after it was finished)")
    return problems


def check_consumed(directory: Path, recorded: dict[str, dict], present: dict[str, Path]) -> list[str]:
    """Problems with a local artifact copy as a consumer sees it ([] = fit to read).

    Every recorded file must be present at its size and nothing else may be there (a stat
    each: no bytes read); the consumed files must hold their recorded bytes, by stamp or by
    sha256 (stamps are renewed for the files hashed)."""
    problems = size_problems(recorded, present)
    if problems:
        return problems
    stamps, hashed = read_stamps(directory), {}
    for rel, entry in sorted(consumed_files(recorded).items()):
        if stamp_holds(present[rel], entry, stamps.get(rel)):
            continue
        if sha256_file(present[rel]) != entry["sha256"]:
            problems.append(f"{rel}: sha256 differs from the recorded digest")
        else:
            hashed[rel] = entry["sha256"]
    if hashed:
        write_stamps(directory, hashed)
    return problems
