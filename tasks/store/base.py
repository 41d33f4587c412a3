"""The artifact store interface, and its implementation on a local (or shared POSIX) directory.

`ArtifactStore(root)` gives the implementation its root asks for -- this one for a path,
tasks/store/bucket.py's for an s3:// / gs:// URL -- and the runner, lineage, verify and
status speak only this interface: where an artifact is worked on (`artifact_dir`) and
shown (`location`), its state and manifest, the `claim` a writer holds, `prepare` /
`running` / `commit` / `keep_partial` around a stage's work, `open_input` for a consumer
(tasks/store/consume.py: it reads what it consumes) and `verify`. A bucket store is a local
store of its staging directory plus the bucket, so it overrides only what moves bytes.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.contract import CHECKPOINT_DIR, MANIFEST
from tasks.store.consume import STAMPS, check_consumed, consumed_files, write_stamps
from tasks.store.names import folder_stage, stage_folder
from tasks.store.records import (
    COMPLETE,
    FAILED,
    LOCK,
    ArtifactError,
    ArtifactLock,
    ArtifactRef,
    InputError,
    digest_files,
    payload_files,
    read_manifest,
    verify_artifact,
    write_json_atomic,
)
from tasks.store.urls import is_url

Log = Callable[[str], None]
_IMPLEMENTATIONS: list[type] = []  # ArtifactStore's subclasses, in the order they were defined


@dataclass
class Claim:
    """The right to write one artifact: the flock on its directory (which the stage's engine
    children inherit through `fd`) and, on a bucket, the lease that orders other machines."""

    lock: ArtifactLock
    lease: Any = None

    @property
    def fd(self) -> int:
        return self.lock.fd

    @property
    def lost(self) -> bool:
        """The lease expired and another run took it over: this run must not commit."""
        return bool(self.lease is not None and self.lease.lost)

    def release(self) -> None:
        if self.lease is not None:
            self.lease.release()
        self.lock.release()


class ArtifactStore:
    """A directory of artifacts. Constructed on this class, the implementation for `root`."""

    remote = None
    """The bucket backend (tasks/store/objects.py RemoteBackend) of a bucket store; None here."""

    def __new__(cls, root: str | Path):
        if cls is ArtifactStore:
            cls = next(impl for impl in _IMPLEMENTATIONS if impl.handles(str(root)))
        return super().__new__(cls)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        _IMPLEMENTATIONS.append(cls)

    @classmethod
    def handles(cls, root: str) -> bool:
        """Whether this implementation serves a store at `root` (a path or a URL)."""
        return False

    def __init__(self, root: str | Path):
        self.root = Path(str(root).removeprefix("file://")).expanduser().absolute()
        self.url = str(self.root)

    # ------------------------------------------------------------------ where and what

    def location(self, stage: str, artifact_id: str) -> str:
        """Where an artifact lives, for humans: its URL on a bucket, else its directory."""
        return str(self.artifact_dir(stage, artifact_id))

    def artifact_dir(self, stage: str, artifact_id: str) -> Path:
        """The local directory a stage writes the artifact in and a consumer reads it from."""
        return self.root / stage_folder(stage) / artifact_id

    def checkpoint_location(self, stage: str, artifact_id: str) -> str:
        """Where the stage's engine writes (and resumes) the artifact's checkpoint: here its
        directory's checkpoint/; on a bucket the URL itself, written by every process."""
        return str(self.artifact_dir(stage, artifact_id) / CHECKPOINT_DIR)

    def manifest(self, stage: str, artifact_id: str) -> dict | None:
        return read_manifest(self.artifact_dir(stage, artifact_id))

    def is_complete(self, stage: str, artifact_id: str) -> bool:
        manifest = self.manifest(stage, artifact_id)
        return bool(manifest and manifest.get("status") == COMPLETE and manifest.get("id") == artifact_id)

    def state(self, stage: str, artifact_id: str) -> str:
        """complete | running (a live process holds its lock) | partial | failed | pending."""
        directory = self.artifact_dir(stage, artifact_id)
        if not directory.is_dir():
            return "pending"
        manifest = read_manifest(directory)
        if manifest and manifest.get("status") == COMPLETE:
            return COMPLETE
        if ArtifactLock(directory).is_held():
            return "running"
        if manifest and manifest.get("status") == FAILED:
            return FAILED
        return "partial"

    def iter_artifacts(self) -> Iterator[tuple[Path, dict | None]]:
        """(directory, manifest or None) for every artifact directory in the store."""
        if not self.root.is_dir():
            return
        for stage_dir in sorted(p for p in self.root.iterdir() if p.is_dir()):
            for directory in sorted(p for p in stage_dir.iterdir() if p.is_dir()):
                yield directory, read_manifest(directory)

    def stage_artifacts(self, stage: str) -> list[str]:
        """The ids of the artifact directories of one stage (whatever their state)."""
        folder = self.root / stage_folder(stage)
        return sorted(p.name for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else []

    def find(self, artifact_id: str) -> Path:
        """The directory of an artifact given its id (or a unique prefix of it)."""
        matches = [d for d, _ in self.iter_artifacts() if d.name.startswith(artifact_id)]
        if not matches:
            raise InputError(f"no artifact with id '{artifact_id}' in store {self.url}")
        if len({d.name for d in matches}) > 1:
            names = ", ".join(f"{folder_stage(d.parent.name)}/{d.name}" for d in matches)
            raise InputError(f"id prefix '{artifact_id}' is ambiguous in store {self.url}: {names}")
        return matches[0]

    # ------------------------------------------------------------------ writing one artifact

    def claim(self, stage: str, artifact_id: str, run_id: str | None = None, on_wait: Log | None = None) -> Claim:
        """Wait for, then hold, the right to write the artifact."""
        lock = ArtifactLock(self.artifact_dir(stage, artifact_id))
        lock.acquire(on_wait=on_wait)
        return Claim(lock)

    def prepare(self, stage: str, artifact_id: str, log: Log) -> None:
        """Bring what a resumed stage needs of its partial artifact to `artifact_dir` (here: it is there)."""

    def has_partial(self, stage: str, artifact_id: str) -> bool:
        """Whether an earlier attempt left payload (checkpoint steps among it) to resume over."""
        directory = self.artifact_dir(stage, artifact_id)
        return directory.is_dir() and any(
            p.name not in (MANIFEST, ".lock") and not p.name.startswith(STAMPS) for p in directory.iterdir()
        )

    def digest_payload(self, stage: str, artifact_id: str) -> dict[str, dict[str, Any]]:
        """The finished payload's `files` for the manifest: size and sha256 of every file
        (stamped as verified, tasks/store/consume.py)."""
        return digest_files(self.artifact_dir(stage, artifact_id), stamp=True)

    def write_manifest(self, stage: str, artifact_id: str, manifest: dict) -> None:
        write_json_atomic(self.artifact_dir(stage, artifact_id) / MANIFEST, manifest)

    def running(self, stage: str, artifact_id: str, claim: Claim, log: Log) -> contextlib.AbstractContextManager:
        """Around the stage's work (a bucket store uploads checkpoint steps as they commit)."""
        return contextlib.nullcontext()

    def commit(self, stage: str, artifact_id: str, manifest: dict, claim: Claim) -> None:
        """The `complete` manifest, written last and atomically: from here on the artifact exists."""
        self.write_manifest(stage, artifact_id, manifest)

    def reuse(self, stage: str, source_id: str, artifact_id: str, manifest: dict, claim: Claim) -> list[str]:
        """Commit `manifest` as the artifact `artifact_id` over the payload of the complete
        artifact `source_id` of the same stage (tasks/cutoff.py): hard links to its files (a
        copy where the file system cannot link), once its consumed files are found intact as a
        consumer would check them. Returns the problems that stopped it ([] = committed)."""
        src, dst = self.artifact_dir(stage, source_id), self.artifact_dir(stage, artifact_id)
        if not src.is_dir():
            return [f"{src}: deleted"]
        files = manifest["files"]
        with ArtifactLock(src):  # gc leaves it alone meanwhile
            if not self.is_complete(stage, source_id):
                return [f"{src}: no longer complete"]
            present = {p.relative_to(src).as_posix(): p for p in payload_files(src)}
            problems = check_consumed(src, files, present)
            if problems:
                return problems
            _clear(dst)  # what an earlier attempt left
            for rel in files:
                (dst / rel).parent.mkdir(parents=True, exist_ok=True)
                try:
                    os.link(src / rel, dst / rel)
                except OSError:
                    shutil.copy2(src / rel, dst / rel)
            # Linking changed the files' ctime: the bytes just checked get fresh stamps, in both.
            checked = {rel: entry["sha256"] for rel, entry in consumed_files(files).items()}
            write_stamps(dst, checked)
            write_stamps(src, checked)
        self.commit(stage, artifact_id, manifest, claim)
        return []

    def keep_partial(self, stage: str, artifact_id: str, claim: Claim, log: Log) -> None:
        """After a failure (its `failed` manifest written): keep what is there for a resume."""

    def shown(self, text: str) -> str:
        """A log line of a stage, naming the store's places rather than local working copies."""
        return text

    # ------------------------------------------------------------------ reading

    def open_input(
        self, stage: str, artifact_id: str, verify: bool = True, local_checkpoint: bool = False
    ) -> ArtifactRef:
        """A complete artifact, checked as far as a consumer reads it; else ArtifactError.

        Of its bytes, the consumer's files are checked (tasks/store/consume.py: the newest
        checkpoint step's params and meta, not its optimizer state or the other steps), by
        their stamps or by sha256; of the rest, that each is there at its size."""
        directory = self.artifact_dir(stage, artifact_id)
        manifest = self._complete_manifest(stage, artifact_id)
        if verify:
            present = {p.relative_to(directory).as_posix(): p for p in payload_files(directory)}
            refuse(stage, artifact_id, check_consumed(directory, manifest.get("files", {}), present), directory)
        return ArtifactRef(stage, artifact_id, directory, manifest)

    def _complete_manifest(self, stage: str, artifact_id: str) -> dict:
        manifest, where = self.manifest(stage, artifact_id), self.location(stage, artifact_id)
        if manifest is None or manifest.get("status") != COMPLETE:
            raise ArtifactError(f"artifact {stage}/{artifact_id} is not complete ({where})")
        if manifest.get("id") != artifact_id:
            raise ArtifactError(f"{where}/{MANIFEST}: records id {manifest.get('id')!r}, expected {artifact_id!r}")
        return manifest

    def verify(self, directory: Path) -> list[str]:
        """Every file of a finished artifact re-hashed against its manifest ([] = intact)."""
        return verify_artifact(directory)


def _clear(directory: Path) -> None:
    """Everything in an artifact directory but its lock."""
    for entry in directory.iterdir():
        if entry.name != LOCK:
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()


def refuse(stage: str, artifact_id: str, problems: list[str], where) -> None:
    """ArtifactError naming the first problems found with an input, or nothing."""
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise ArtifactError(
            f"artifact {stage}/{artifact_id} changed since it was finished: {shown}. "
            f"Run `trainflow verify {where}`; delete it to rebuild it"
        )


def write_manifest_copy(directory: Path, manifest: dict) -> None:
    """A bucket's manifest in a local directory (staging or cache), for the local readers."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2, default=str) + "\n")
    os.utime(directory / MANIFEST)


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
    if candidate.exists():
        raise InputError(f"{path_or_id} is a file, not an artifact directory")
    if "/" in path_or_id or candidate.name == MANIFEST or not path_or_id.isalnum():  # a path, not an id
        raise InputError(f"no artifact directory at {path_or_id} (nor is it an id: ids are hex, e.g. 3f2a9c1d)")
    if store is None:
        raise InputError(f"'{path_or_id}' is not an artifact directory; pass --store to look it up by id")
    return ArtifactStore(store).find(path_or_id)
