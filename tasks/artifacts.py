"""The artifact store: content-addressed stage outputs with manifests, digests and locks.

Layout (DESIGN.md, "Artifacts and lineage"):

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
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib.metadata import version
from pathlib import Path
from typing import Any

from engine.contract import MANIFEST
from tasks.objectstore import RemoteBackend, StoreAccessError, flock_held, is_url

LOCK = ".lock"
ID_LENGTH = 16  # hex digits of sha256 kept in an id: 64 bits, plenty for one store

# Artifact statuses. Only `complete` artifacts are consumed or skipped over.
RUNNING, COMPLETE, FAILED = "running", "complete", "failed"


class ArtifactError(RuntimeError):
    """An artifact is missing, incomplete or its files no longer match their digests."""


# --------------------------------------------------------------------------- ids


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


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def payload_files(directory: Path) -> Iterator[Path]:
    """Every payload file under an artifact directory (not the manifest or the lock)."""
    for root, dirs, files in os.walk(directory):
        dirs.sort()
        for name in sorted(files):
            path = Path(root) / name
            rel = path.relative_to(directory)
            if len(rel.parts) == 1 and rel.name in (MANIFEST, LOCK, MANIFEST + ".tmp"):
                continue
            yield path


def digest_files(directory: Path) -> dict[str, dict[str, Any]]:
    """relative path -> {size, sha256} for the payload of an artifact."""
    return {
        path.relative_to(directory).as_posix(): {"size": path.stat().st_size, "sha256": sha256_file(path)}
        for path in payload_files(directory)
    }


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
        root = Path(__file__).resolve().parent.parent
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
    descriptor to the stage's engine children (tasks/launch.py, `holding_locks`), and the
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
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": now_iso()}).encode())
        self._fd = fd
        return True

    def holder(self) -> str | None:
        try:
            info = json.loads(self.path.read_text() or "{}")
            who = f"pid {info['pid']} on {info['host']} since {info['since']}"
        except (OSError, ValueError, KeyError):
            return None
        if info["host"] == socket.gethostname() and not _alive(int(info["pid"])):
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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


# --------------------------------------------------------------------------- the store


@dataclass(frozen=True)
class ArtifactRef:
    """A complete artifact a stage consumes: where it is and what its manifest says."""

    stage: str
    id: str
    path: Path
    manifest: dict

    @property
    def kind(self) -> str:
        return self.manifest["kind"]


class ArtifactStore:
    """A directory of artifacts: a local path, or an s3:// / gs:// URL (tasks/objectstore.py).

    On a URL, `root` is the local staging directory (cache) of that bucket prefix: stages run
    against `artifact_dir` there, and `remote` moves the bytes to and from the bucket.
    """

    def __init__(self, root: str | Path):
        root = str(root)
        self.remote = None
        if is_url(root):
            try:
                self.remote = RemoteBackend(root)
            except StoreAccessError as e:
                raise ArtifactError(str(e)) from None
            self.root = self.remote.cache
            self.url = self.remote.url
        else:
            self.root = Path(root.removeprefix("file://")).expanduser().absolute()
            self.url = str(self.root)

    def location(self, stage: str, artifact_id: str) -> str:
        """Where an artifact lives, for humans: its URL on a bucket, else its directory."""
        if self.remote is not None:
            return self.remote.url_of(stage, artifact_id)
        return str(self.artifact_dir(stage, artifact_id))

    def artifact_dir(self, stage: str, artifact_id: str) -> Path:
        return self.root / stage / artifact_id

    def state(self, stage: str, artifact_id: str) -> str:
        """complete | running (a live process holds its lock) | partial | failed | pending."""
        directory = self.artifact_dir(stage, artifact_id)
        if self.remote is not None:
            manifest = self.remote.read_manifest(stage, artifact_id)
            if manifest and manifest.get("status") == COMPLETE:
                return COMPLETE
            if self.remote.lease(stage, artifact_id).is_held():
                return RUNNING
            if manifest and manifest.get("status") == FAILED:
                return FAILED
            return "partial" if manifest or self.remote.payload(stage, artifact_id) else "pending"
        if not directory.is_dir():
            return "pending"
        manifest = read_manifest(directory)
        if manifest and manifest.get("status") == COMPLETE:
            return COMPLETE
        if ArtifactLock(directory).is_held():
            return RUNNING
        if manifest and manifest.get("status") == FAILED:
            return FAILED
        return "partial"

    def manifest(self, stage: str, artifact_id: str) -> dict | None:
        if self.remote is not None:
            return self.remote.read_manifest(stage, artifact_id)
        return read_manifest(self.artifact_dir(stage, artifact_id))

    def is_complete(self, stage: str, artifact_id: str) -> bool:
        manifest = self.manifest(stage, artifact_id)
        return bool(manifest and manifest.get("status") == COMPLETE and manifest.get("id") == artifact_id)

    def iter_artifacts(self) -> Iterator[tuple[Path, dict | None]]:
        """(directory, manifest or None) for every artifact directory in the store.

        On a bucket the directory is the local staging copy, which receives the manifest."""
        if self.remote is not None:
            for stage, artifact_id in self.remote.artifacts():
                manifest = self.remote.read_manifest(stage, artifact_id)
                directory = self.artifact_dir(stage, artifact_id)
                if manifest is not None:
                    directory.mkdir(parents=True, exist_ok=True)
                    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2, default=str) + "\n")
                yield directory, manifest
            return
        if not self.root.is_dir():
            return
        for stage_dir in sorted(p for p in self.root.iterdir() if p.is_dir()):
            for directory in sorted(p for p in stage_dir.iterdir() if p.is_dir()):
                yield directory, read_manifest(directory)

    def find(self, artifact_id: str) -> Path:
        """The directory of an artifact given its id (or a unique prefix of it)."""
        matches = [d for d, _ in self.iter_artifacts() if d.name.startswith(artifact_id)]
        if not matches:
            raise ArtifactError(f"no artifact with id '{artifact_id}' in store {self.url}")
        if len({d.name for d in matches}) > 1:
            names = ", ".join(f"{d.parent.name}/{d.name}" for d in matches)
            raise ArtifactError(f"id prefix '{artifact_id}' is ambiguous in store {self.root}: {names}")
        return matches[0]

    def open_input(self, stage: str, artifact_id: str, verify: bool = True) -> ArtifactRef:
        """A complete artifact, its files re-checked against their digests; else ArtifactError."""
        directory = self.artifact_dir(stage, artifact_id)
        if self.remote is not None:
            return self._open_remote_input(stage, artifact_id, verify)
        manifest = read_manifest(directory)
        if manifest is None or manifest.get("status") != COMPLETE:
            raise ArtifactError(f"artifact {stage}/{artifact_id} is not complete ({directory})")
        if manifest.get("id") != artifact_id:
            raise ArtifactError(f"{directory / MANIFEST}: records id {manifest.get('id')!r}, expected {artifact_id!r}")
        if verify:
            problems = compare_files(directory, manifest.get("files", {}))
            if problems:
                shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
                raise ArtifactError(
                    f"artifact {stage}/{artifact_id} changed since it was finished: {shown}. "
                    f"Run `trainflow verify {directory}`; delete the directory to rebuild it"
                )
        return ArtifactRef(stage, artifact_id, directory, manifest)

    def _open_remote_input(self, stage: str, artifact_id: str, verify: bool) -> ArtifactRef:
        """Download a complete artifact into the cache (kept there: same id, same bytes) and
        re-hash the local copy against the manifest; one fresh download if they differ."""
        where = self.remote.url_of(stage, artifact_id)
        manifest = self.remote.read_manifest(stage, artifact_id)
        if manifest is None or manifest.get("status") != COMPLETE:
            raise ArtifactError(f"artifact {stage}/{artifact_id} is not complete ({where})")
        if manifest.get("id") != artifact_id:
            raise ArtifactError(f"{where}/{MANIFEST}: records id {manifest.get('id')!r}, expected {artifact_id!r}")
        directory = self.artifact_dir(stage, artifact_id)
        lock = ArtifactLock(directory)  # one process fills a cache entry at a time
        lock.acquire()
        try:
            self.remote.download(stage, artifact_id, directory)
            problems = compare_files(directory, manifest.get("files", {})) if verify else []
            if problems:
                shutil.rmtree(directory, ignore_errors=True)
                directory.mkdir(parents=True, exist_ok=True)
                self.remote.download(stage, artifact_id, directory)
                problems = compare_files(directory, manifest.get("files", {}))
            if problems:
                shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
                raise ArtifactError(
                    f"artifact {stage}/{artifact_id} changed since it was finished: {shown}. "
                    f"Run `trainflow verify {where}`; delete it to rebuild it"
                )
        finally:
            lock.release()
        os.utime(directory / MANIFEST)  # most recently used, for the cache's eviction
        self.remote.evict(keep={directory})
        return ArtifactRef(stage, artifact_id, directory, manifest)

    def verify(self, directory: Path) -> list[str]:
        """verify_artifact, streaming the bucket's objects when the store is on one."""
        if self.remote is not None and Path(directory).parent.parent == self.root:
            stage, artifact_id = Path(directory).parent.name, Path(directory).name
            manifest = self.remote.read_manifest(stage, artifact_id)
            where = self.remote.url_of(stage, artifact_id)
            if manifest is None:
                return [f"{where}: no readable {MANIFEST}"]
            if manifest.get("status") != COMPLETE:
                return [f"{where}: status is {manifest.get('status')!r}, not complete"]
            return self.remote.compare(stage, artifact_id, manifest.get("files", {}))
        return verify_artifact(directory)


def split_artifact_url(url: str) -> tuple[str, str, str] | None:
    """`s3://b/prefix/stage/id[/artifact.json]` -> (store URL, stage, id); None if not a URL."""
    if not is_url(url):
        return None
    parts = url.rstrip("/").removesuffix("/" + MANIFEST).rsplit("/", 2)
    if len(parts) != 3 or "://" not in parts[0] or parts[0].endswith(":/"):
        return None
    return parts[0], parts[1], parts[2]


def resolve_artifact(path_or_id: str, store: str | Path | None) -> Path:
    """An artifact directory from a path (to the directory or its artifact.json), an artifact
    URL on a bucket, or an id; a bucket's artifacts resolve to their local staging copy."""
    split = split_artifact_url(path_or_id)
    if split is not None:
        remote_store = ArtifactStore(split[0])
        return remote_store.find(split[2])
    candidate = Path(path_or_id).expanduser()
    if candidate.name == MANIFEST:
        candidate = candidate.parent
    if candidate.is_dir():
        return candidate.absolute()
    if store is None:
        raise ArtifactError(f"'{path_or_id}' is not an artifact directory; pass --store to look it up by id")
    return ArtifactStore(store).find(path_or_id)


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
