"""The artifact store on a local (or shared POSIX) directory: artifacts are worked on in
the store itself, and locked with flock (tasks/store/records.py ArtifactLock).

A store whose path is a file (or lies under one) is refused when it is opened. A missing
directory is created by the first stage that writes into it (`trainflow run`, `convert`,
`export`), parents included; the commands that only read a store refuse it (`require`)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from engine.contract import CHECKPOINT_DIR, MANIFEST
from tasks.store.base import ArtifactStore, Claim, Log, refuse
from tasks.store.consume import STAMPS, check_consumed, consumed_files, sha256_file, size_problems, write_stamps
from tasks.store.names import stage_folder
from tasks.store.records import (
    COMPLETE,
    FAILED,
    LOCK,
    STEP_DIGESTS,
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


class LocalStore(ArtifactStore):
    """Artifacts in a local or shared POSIX directory, locked with flock."""

    @classmethod
    def handles(cls, root: str) -> bool:
        return not is_url(root)

    def __init__(self, root: str | Path):
        # Its real place (`..` and symlinks resolved): the artifact directories it finds and
        # `artifact_at` compare with are resolved paths too (tasks/store/base.py: resolve_artifact).
        self.root = Path(str(root).removeprefix("file://")).expanduser().resolve()
        self.url = str(self.root)
        try:
            self.url.encode("utf-8")
        except UnicodeEncodeError:  # manifests, lineage and Prefect carry the path as UTF-8 text
            shown = os.fsencode(self.root).decode("utf-8", "backslashreplace")
            raise InputError(
                f"artifact store {shown} is not a UTF-8 path (manifests and Prefect record it as text); "
                f"rename the directory, or pass another --store"
            ) from None
        blocking = _nearest_file(self.root)
        if blocking is not None:
            where = "is a file" if blocking == self.root else f"lies under {blocking}, a file"
            raise InputError(f"artifact store {self.root} {where}, not a directory; pass a directory as --store")

    def require(self) -> None:
        """InputError unless the store's directory exists (for a command that only reads it)."""
        if not self.root.is_dir():
            raise InputError(f"no artifact store at {self.root} (the directory does not exist; check --store)")

    def find(self, artifact_id: str) -> Path:
        self.require()
        return super().find(artifact_id)

    # ------------------------------------------------------------------ where and what

    def location(self, stage: str, artifact_id: str) -> str:
        return str(self.artifact_dir(stage, artifact_id))

    def artifact_dir(self, stage: str, artifact_id: str) -> Path:
        return self.root / stage_folder(stage) / artifact_id

    def checkpoint_location(self, stage: str, artifact_id: str) -> str:
        """The artifact directory's checkpoint/."""
        return str(self.artifact_dir(stage, artifact_id) / CHECKPOINT_DIR)

    def committed_steps(self, stage: str, artifact_id: str) -> list[int]:
        return committed_steps(self.artifact_dir(stage, artifact_id))

    def copy_step(self, stage: str, artifact_id: str, step: int, into_stage: str) -> list[str]:
        """Hard links to the step's files (no copy), once they match its digests."""
        step_dir = self.artifact_dir(stage, artifact_id) / CHECKPOINT_DIR / str(step)
        problems = verify_committed_step(step_dir)
        if not problems:
            _link_tree(step_dir, self.artifact_dir(into_stage, artifact_id) / CHECKPOINT_DIR / str(step))
        return problems

    def manifest(self, stage: str, artifact_id: str) -> dict | None:
        return read_manifest(self.artifact_dir(stage, artifact_id))

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

    def stored_bytes(self, stage: str, artifact_id: str) -> int:
        directory = self.artifact_dir(stage, artifact_id)
        return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())

    def stage_artifacts(self, stage: str) -> list[str]:
        """The ids of the artifact directories of one stage (whatever their state)."""
        folder = self.root / stage_folder(stage)
        return sorted(p.name for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else []

    # ------------------------------------------------------------------ records beside the artifacts

    def write_record(self, stage: str, name: str, record: dict) -> None:
        path = self.root / stage_folder(stage) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, record)

    def read_record(self, stage: str, name: str) -> dict | None:
        try:
            return json.loads((self.root / stage_folder(stage) / name).read_text())
        except (OSError, ValueError):
            return None

    def remove_record(self, stage: str, name: str) -> None:
        (self.root / stage_folder(stage) / name).unlink(missing_ok=True)

    # ------------------------------------------------------------------ writing one artifact

    def claim(self, stage: str, artifact_id: str, run_id: str | None = None, on_wait: Log | None = None) -> Claim:
        """Wait for, then hold, the right to write the artifact."""
        lock = ArtifactLock(self.artifact_dir(stage, artifact_id))
        lock.acquire(on_wait=on_wait)
        return Claim(lock)

    def try_claim(self, stage: str, artifact_id: str) -> Claim | None:
        lock = ArtifactLock(self.artifact_dir(stage, artifact_id))
        return Claim(lock) if lock.acquire(blocking=False) else None

    def prepare(self, stage: str, artifact_id: str, log: Log) -> None:
        """Nothing to bring: a partial artifact is where the stage resumes it."""

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
        """Nothing to do: what the stage left stays where a resume finds it."""

    def publish(self, stage: str, artifact_id: str, manifest: dict) -> None:
        """Its files are where they stay: the manifest."""
        self.write_manifest(stage, artifact_id, manifest)

    # ------------------------------------------------------------------ retention (trainflow gc)

    def delete(self, stage: str, artifact_id: str, claim: Claim) -> None:
        directory = self.artifact_dir(stage, artifact_id)
        (directory / MANIFEST).unlink(missing_ok=True)
        if directory.is_dir():
            _clear(directory)

    def drop_steps(self, stage: str, artifact_id: str, steps: list[int], claim: Claim) -> None:
        for step in steps:
            shutil.rmtree(self.artifact_dir(stage, artifact_id) / CHECKPOINT_DIR / str(step), ignore_errors=True)

    # ------------------------------------------------------------------ reading

    def open_input(
        self, stage: str, artifact_id: str, verify: bool = True, local_checkpoint: bool = False
    ) -> ArtifactRef:
        """Of its bytes, the consumer's files are checked (tasks/store/consume.py: the newest
        checkpoint step's params and meta, not its optimizer state or the other steps), by
        their stamps or by sha256; of the rest, that each is there at its size."""
        directory = self.artifact_dir(stage, artifact_id)
        manifest = self.complete_manifest(stage, artifact_id)
        if verify:
            present = {p.relative_to(directory).as_posix(): p for p in payload_files(directory)}
            refuse(stage, artifact_id, check_consumed(directory, manifest.get("files", {}), present), directory)
        return ArtifactRef(stage, artifact_id, directory, manifest)

    def check_sizes(self, stage: str, artifact_id: str) -> None:
        """A complete artifact about to be skipped: each recorded file at its size (a stat each;
        a file added beside them is left to its consumers' and `trainflow verify`'s checks)."""
        directory = self.artifact_dir(stage, artifact_id)
        present = {p.relative_to(directory).as_posix(): p for p in payload_files(directory)}
        problems = size_problems((self.manifest(stage, artifact_id) or {}).get("files", {}), present, extras=False)
        refuse(stage, artifact_id, problems, directory)

    def verify(self, directory: Path) -> list[str]:
        """Every file of a finished artifact re-hashed against its manifest ([] = intact)."""
        return verify_artifact(directory)


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


def _clear(directory: Path) -> None:
    """Everything in an artifact directory but its lock."""
    for entry in directory.iterdir():
        if entry.name != LOCK:
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()


def _nearest_file(path: Path) -> Path | None:
    """The file that `path` is or lies under (nothing could be created there), else None."""
    for candidate in (path, *path.parents):
        try:
            if candidate.exists():
                return None if candidate.is_dir() else candidate
        except OSError:  # not searchable: the stage that writes there will say so
            return None
    return None
