"""The artifact store: content-addressed stage outputs with manifests, digests and locks.

Layout (docs/design.md, "Artifacts and lineage"):

    <store>/<stage-name>/<artifact-id>/
        artifact.json    manifest; its final `complete` version is written last, atomically
        .lock            advisory lock held by the one process writing this artifact
        ...payload...

An artifact id is a fingerprint of the task kind, its format version, the resolved stage
config (minus fields that cannot change the result) and the ids of the input artifacts, so
the same work always lands in the same directory: a `complete` manifest there means the
work is done, a directory without one holds a partial result to resume from.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib.metadata import version
from pathlib import Path
from typing import Any

from engine.contract import CHECKPOINT_DIR, DATA_DIR, MANIFEST
from tasks.store.consume import STAMPS, sha256_file, write_stamps
from tasks.store.processes import holder_is_gone, this_process

LOCK = ".lock"
STEP_DIGESTS = "digests.json"
"""engine.train.checkpoint.DIGESTS_FILE (named here too: that module loads JAX): Orbax's
finalize writes it into a step just before committing the step, so a local step directory
that holds it is committed; on the bucket it is uploaded last (or, written at the URL by the
engine, before Orbax's commit file), so a step there with it is whole."""
ID_LENGTH = 16  # hex digits of sha256 kept in an id: 64 bits, plenty for one store

# Artifact statuses. Only `complete` artifacts are consumed or skipped over.
RUNNING, COMPLETE, FAILED = "running", "complete", "failed"


class ArtifactError(RuntimeError):
    """An artifact is missing, incomplete or its files no longer match their digests."""


class InputError(ArtifactError):
    """What a user named cannot be used as given: a store that is a file, is missing or cannot
    be reached, an artifact path or id that is not there. `trainflow` exits 2 with its sentence."""


# --------------------------------------------------------------------------- ids


def flock_held(path: Path) -> bool:
    """Whether some process holds an flock on `path` (False when the file is missing)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def artifact_id(task: str, version: int, config: dict, input_ids: dict[str, str]) -> str:
    """The fingerprint of one piece of work; see the module docstring."""
    payload = {"task": task, "version": version, "config": config, "inputs": input_ids}
    return hashlib.sha256(canonical_json(payload).encode()).hexdigest()[:ID_LENGTH]


def drop_fields(tree: dict, dotted: tuple[str, ...] | list[str]) -> dict:
    """A copy of `tree` without the `a.b.c` fields listed (missing ones are ignored)."""
    out = json.loads(json.dumps(tree, default=str))
    for path in dotted:
        node = out
        parts = path.split(".")
        for part in parts[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
            if node is None:
                break
        if isinstance(node, dict):
            node.pop(parts[-1], None)
    return out


# --------------------------------------------------------------------------- digests


def payload_files(directory: Path) -> Iterator[Path]:
    """Every payload file under an artifact directory (not the manifest or the lock)."""
    for root, dirs, files in os.walk(directory):
        dirs.sort()
        for name in sorted(files):
            path = Path(root) / name
            rel = path.relative_to(directory)
            if len(rel.parts) == 1 and (rel.name in (MANIFEST, LOCK, MANIFEST + ".tmp") or rel.name.startswith(STAMPS)):
                continue
            yield path


def digest_files(directory: Path, stamp: bool = False) -> dict[str, dict[str, Any]]:
    """relative path -> {size, sha256} for the payload of an artifact; with `stamp`, also
    recorded as verified (tasks/store/consume.py), so consumers need not hash them again."""
    files: dict[str, dict[str, Any]] = {
        path.relative_to(directory).as_posix(): {"size": path.stat().st_size, "sha256": sha256_file(path)}
        for path in payload_files(directory)
    }
    if stamp:
        write_stamps(directory, {rel: entry["sha256"] for rel, entry in files.items()})
    return files


def compare_files(directory: Path, recorded: dict[str, dict[str, Any]]) -> list[str]:
    """Problems found re-hashing `directory` against its recorded digests ([] = intact)."""
    problems = []
    present = {p.relative_to(directory).as_posix(): p for p in payload_files(directory)}
    for rel, entry in sorted(recorded.items()):
        path = present.get(rel)
        if path is None:
            problems.append(f"{rel}: missing")
        elif path.stat().st_size != entry["size"]:
            problems.append(f"{rel}: size {path.stat().st_size} != recorded {entry['size']}")
        elif sha256_file(path) != entry["sha256"]:
            problems.append(f"{rel}: sha256 differs from the recorded digest")
    for rel in sorted(set(present) - set(recorded)):
        problems.append(f"{rel}: not part of the artifact (added after it was finished)")
    return problems


# --------------------------------------------------------------------------- manifests


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def write_json_atomic(path: Path, value: dict) -> None:
    """Write to a temporary file, fsync, rename: readers see the old or the new file, whole."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w") as f:
            json.dump(value, f, indent=2, default=str)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    try:  # make the rename itself durable
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def read_manifest(directory: Path) -> dict | None:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


_CODE_VERSION: dict | None = None


def code_version() -> dict:
    """The trainflow version and, when run from a git checkout, the commit (and dirtiness)."""
    global _CODE_VERSION
    if _CODE_VERSION is None:
        root = Path(__file__).resolve().parents[2]
        package_version: str | None
        try:
            package_version = version("trainflow")
        except Exception:
            package_version = _pyproject_version(root / "pyproject.toml")
        info: dict[str, Any] = {"version": package_version, "git_commit": None, "git_dirty": None}
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
            if commit.returncode == 0:
                info["git_commit"] = commit.stdout.strip()
                dirty = subprocess.run(
                    ["git", "status", "--porcelain", "--untracked-files=no", "--", "engine", "tasks", "flows"],
                    cwd=root,
                    capture_output=True,
                    text=True,
                    timeout=10,
                )
                info["git_dirty"] = bool(dirty.stdout.strip()) if dirty.returncode == 0 else None
        except (OSError, subprocess.SubprocessError):
            pass
        _CODE_VERSION = info
    return dict(_CODE_VERSION)


def _pyproject_version(path: Path) -> str | None:
    try:
        for line in path.read_text().splitlines():
            if line.startswith("version"):
                return line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    return None


# --------------------------------------------------------------------------- locks


class ArtifactLock:
    """An exclusive `flock` on `<artifact>/.lock`.

    An flock belongs to the open file description, not the process: the runner passes its
    descriptor to the stage's engine children (tasks/launch/run.py, `holding_locks`), and the
    kernel drops the lock only when the last of them exits, however it exits (SIGKILL
    included). So a dead run never blocks the next one, and a new run never shares the
    artifact with an orphaned engine still saving into it. The file records which run took
    the lock, for messages. Advisory locks need a local (or lock-aware) filesystem shared
    by all runs.
    """

    def __init__(self, directory: Path):
        self.path = Path(directory) / LOCK
        self._fd: int | None = None

    @property
    def fd(self) -> int:
        """The locked descriptor (for children that must hold the lock too)."""
        assert self._fd is not None, "the lock is not held"
        return self._fd

    def acquire(
        self,
        blocking: bool = True,
        poll_seconds: float = 1.0,
        on_wait: Callable[[str], None] | None = None,
        wait_message_every: float = 30.0,
    ) -> bool:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        last_message = -float("inf")
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not blocking:
                    os.close(fd)
                    return False
                if on_wait and time.monotonic() - last_message >= wait_message_every:
                    on_wait(f"waiting for {self.path.parent}: being written by {self.holder() or 'another process'}")
                    last_message = time.monotonic()
                time.sleep(poll_seconds)
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({**this_process(), "since": now_iso()}).encode())
        self._fd = fd
        return True

    def holder(self) -> str | None:
        try:
            info = json.loads(self.path.read_text() or "{}")
            who = f"pid {info['pid']} on {info['host']} since {info['since']}"
        except (OSError, ValueError, KeyError):
            return None
        if holder_is_gone(info):
            who += " (that run has exited; a process it started, e.g. its engine saving a checkpoint, holds the lock)"
        return who

    def is_held(self) -> bool:
        """Whether some process (this one included, through another handle) holds the lock."""
        return flock_held(self.path)

    def release(self) -> None:
        # Close without LOCK_UN: unlocking would also release it for a child that still
        # holds the same description; closing leaves the lock to the last holder.
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> ArtifactLock:
        self.acquire()
        return self

    def __exit__(self, *_) -> None:
        self.release()


# --------------------------------------------------------------------------- the store


@dataclass(frozen=True)
class ArtifactRef:
    """A complete artifact a stage consumes: where it is and what its manifest says."""

    stage: str
    id: str
    path: Path
    """The local directory of its small files (tokenizer, metrics, manifest)."""
    manifest: dict
    checkpoint_url: str | None = None
    """Its checkpoint's URL where the engine reads it in the bucket (tasks/store/bucket.py)."""
    url: str | None = None
    """Its URL where the engine's processes read it in place (a bucket store whose stages read
    and write at the URL: its checkpoint and token shards are not in `path`); else None."""

    @property
    def kind(self) -> str:
        return self.manifest["kind"]

    @property
    def checkpoint_dir(self) -> str:
        """Where the engine reads its checkpoint: the bucket URL, or `path`/checkpoint."""
        return self.checkpoint_url or str(self.path / CHECKPOINT_DIR)

    @property
    def data_dir(self) -> str:
        """Where the engine reads its token shards (a dataset): the bucket URL, or `path`/data."""
        return f"{self.url}/{DATA_DIR}" if self.url else str(self.path / DATA_DIR)

    def for_ranks(self, local: str) -> str:
        """A path under `path` as every process of a stage reads it: at the URL when there is one."""
        inside = self.url is not None and (local == str(self.path) or local.startswith(str(self.path) + "/"))
        return self.url + local[len(str(self.path)) :] if inside and self.url else local


def verify_artifact(directory: Path) -> list[str]:
    """Problems with a finished artifact ([] = its manifest is complete and every file matches)."""
    manifest = read_manifest(directory)
    if manifest is None:
        return [f"{directory}: no readable {MANIFEST}"]
    if manifest.get("status") != COMPLETE:
        return [f"{directory}: status is {manifest.get('status')!r}, not complete"]
    return compare_files(directory, manifest.get("files", {}))


def parent_dir(store_root: Path, parent: dict) -> Path:
    """Where a manifest's parent entry lives (paths are stored relative to the store root)."""
    path = Path(parent["path"])
    return path if path.is_absolute() else store_root / path
