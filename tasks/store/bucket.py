"""The artifact store on object storage (s3://, gs://): the bucket through fsspec
(tasks/store/objects.py moves the bytes; tasks/store/leases.py orders the machines), with a
local store of staging directories beside it (`staging`) for the small files.

Checkpoints do not pass through the staging directory: a stage's engine writes them at the
artifact's URL (`checkpoint_location`), every process its own shards, and resumes from
there; a consumer's engine restores the one step it reads from there (`open_input` gives
`ArtifactRef.checkpoint_url`), and reads a dataset's token shards there too
(`ArtifactRef.data_dir`; `read_in_place`). Staged locally are only the small files (the
tokenizer, metrics, the engine's config, which tasks/engine_stage.py also puts at the URL
for ranks on other hosts). TRAINFLOW_STAGED_CHECKPOINTS=1
(or a scheme the engine cannot write, e.g. memory://) stages checkpoints too, as before:
each step uploaded from the staging directory as it commits, a consumer's step downloaded.

What it adds to the staging store's behaviour, and nothing else: where an artifact is
shown and its state read (the bucket), the claim (the staging flock plus the bucket lease),
`prepare` (a partial artifact's small files, or with staged checkpoints its newest whole
step, downloaded), `running` (the small files uploaded as each checkpoint step commits),
`digest_payload` (the staged files hashed; each checkpoint step's files as its digests.json
recorded them when it committed), `commit` (the payload, then the manifest with every
object's version, one PUT, last), `keep_partial` (what a failed stage has, uploaded),
`open_input` (the consumed small files downloaded into the cache, hashed as they arrive;
the consumed checkpoint files checked by one LIST against the versions the manifest
recorded) and `verify` (every object streamed through sha256, nothing written to disk).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from engine.contract import CHECKPOINT_DIR, CHECKPOINT_URL_SCHEMES, DATA_DIR, MANIFEST
from tasks.store.base import ArtifactStore, Claim, Log, refuse
from tasks.store.consume import consumed_files
from tasks.store.local import LocalStore
from tasks.store.names import stage_folder
from tasks.store.objects import RemoteBackend, StoreAccessError, StoreWriteError
from tasks.store.records import (
    COMPLETE,
    FAILED,
    LOCK,
    STEP_DIGESTS,
    ArtifactError,
    ArtifactLock,
    ArtifactRef,
    InputError,
    read_manifest,
)
from tasks.store.urls import is_url

STAGED_ENV = "TRAINFLOW_STAGED_CHECKPOINTS"
ORBAX_COMMIT_FILE = "commit_success.txt"
"""What commits a checkpoint step that Orbax writes at a URL (engine/train/bucket_paths.py)."""


def in_checkpoint(rel: str) -> bool:
    return rel.startswith(CHECKPOINT_DIR + "/")


def read_in_place(rel: str) -> bool:
    """A file the engine's processes read at the URL, not from the consumer's cache: a
    checkpoint's, or a token shard (engine/data/shards.py ShardSource copies each into the
    reading host's cache when it first reads from it)."""
    return in_checkpoint(rel) or (rel.startswith(DATA_DIR + "/") and rel.endswith(".array_record"))


class BucketStore(ArtifactStore):
    """Artifacts under a bucket prefix; `root` is that prefix's local staging directory (cache)."""

    remote: RemoteBackend

    @classmethod
    def handles(cls, root: str) -> bool:
        return is_url(root)

    def __init__(self, root: str | Path):
        try:
            self.remote = RemoteBackend(str(root))
        except StoreAccessError as e:
            raise InputError(str(e)) from None
        self.staging = LocalStore(self.remote.cache)
        """The artifacts' staging copies (their small files), a local store of its own."""
        self.root = self.staging.root
        self.url = self.remote.url
        self.direct = self.url.startswith(CHECKPOINT_URL_SCHEMES) and os.environ.get(STAGED_ENV, "") in ("", "0")
        """Whether stages write and read checkpoints at the URL (else through the staging directory)."""

    def checkpoint_location(self, stage: str, artifact_id: str) -> str:
        if self.direct:
            return f"{self.location(stage, artifact_id)}/{CHECKPOINT_DIR}"
        return self.staging.checkpoint_location(stage, artifact_id)

    def location(self, stage: str, artifact_id: str) -> str:
        return self.remote.url_of(stage, artifact_id)

    def artifact_dir(self, stage: str, artifact_id: str) -> Path:
        """The artifact's staging directory."""
        return self.staging.artifact_dir(stage, artifact_id)

    def committed_steps(self, stage: str, artifact_id: str) -> list[int]:
        """Those in the staging copy (a stage that writes its checkpoint there) and, where
        engines write at the URL, those whose digests and Orbax's commit file are there (the
        engine writes the digests just before the commit file): one LIST of the step folders
        and two HEADs a step, whatever the checkpoint's size (a consumer polls this)."""
        staged = self.staging.committed_steps(stage, artifact_id)
        if not self.direct:
            return staged
        fs, prefix = self.remote.fs, self.remote.key(stage, artifact_id, CHECKPOINT_DIR)
        fs.invalidate_cache(prefix)
        try:
            names = [
                e["name"].rstrip("/").rsplit("/", 1)[-1] for e in fs.ls(prefix, detail=True) if e["type"] == "directory"
            ]
        except FileNotFoundError:
            names = []
        at_url = []
        for step in sorted(int(name) for name in names if name.isdigit()):
            fs.invalidate_cache(f"{prefix}/{step}")
            if all(fs.exists(f"{prefix}/{step}/{name}") for name in (STEP_DIGESTS, ORBAX_COMMIT_FILE)):
                at_url.append(step)
        return sorted({*staged, *at_url})

    def copy_step(self, stage: str, artifact_id: str, step: int, into_stage: str) -> list[str]:
        """A step in the staging copy as the local store copies it (`publish` uploads it); at
        the URL, its objects streamed through sha256 against its digests, then copied in the
        bucket (server-side)."""
        if not self.direct or step in self.staging.committed_steps(stage, artifact_id):
            return self.staging.copy_step(stage, artifact_id, step, into_stage)
        folder = f"{CHECKPOINT_DIR}/{step}/"
        digests = self.remote.read_json(self.remote.key(stage, artifact_id, folder + STEP_DIGESTS)) or {}
        recorded = digests.get("files")
        if not isinstance(recorded, dict):
            return [STEP_DIGESTS]
        present = {rel: size for rel, size in self.remote.payload(stage, artifact_id).items() if rel.startswith(folder)}
        problems = [
            name
            for name, want in sorted(recorded.items())
            if present.get(folder + name) != want.get("size")
            or self.remote.sha256(self.remote.key(stage, artifact_id, folder + name)) != want.get("sha256")
        ]
        if not problems:
            rels = sorted(present)
            self.remote.fs.copy(
                [self.remote.key(stage, artifact_id, rel) for rel in rels],
                [self.remote.key(into_stage, artifact_id, rel) for rel in rels],
            )
        return problems

    def manifest(self, stage: str, artifact_id: str) -> dict | None:
        return self.remote.read_manifest(stage, artifact_id)

    def state(self, stage: str, artifact_id: str) -> str:
        manifest = self.remote.read_manifest(stage, artifact_id)
        if manifest and manifest.get("status") == COMPLETE:
            return COMPLETE
        if self.remote.lease(stage, artifact_id).is_held():
            return "running"
        if manifest and manifest.get("status") == FAILED:
            return FAILED
        return "partial" if manifest or self.remote.payload(stage, artifact_id) else "pending"

    def iter_artifacts(self) -> Iterator[tuple[Path, dict | None]]:
        """The bucket's artifacts; each directory is the local staging copy, which receives the manifest."""
        for stage, artifact_id in self.remote.artifacts():
            manifest = self.remote.read_manifest(stage, artifact_id)
            directory = self.artifact_dir(stage, artifact_id)
            if manifest is not None:
                write_manifest_copy(directory, manifest)
            yield directory, manifest

    def stored_bytes(self, stage: str, artifact_id: str) -> int:
        """The bucket's payload objects (one LIST; the staging copy holds no more)."""
        return sum(self.remote.payload(stage, artifact_id).values())

    def stage_artifacts(self, stage: str) -> list[str]:
        prefix = f"{self.remote.base}/{stage_folder(stage)}"
        self.remote.fs.invalidate_cache(prefix)
        try:
            entries = self.remote.fs.ls(prefix, detail=True)
        except FileNotFoundError:
            return []
        return sorted(e["name"].rsplit("/", 1)[-1] for e in entries if e["type"] == "directory")

    # ------------------------------------------------------------------ records beside the artifacts

    def write_record(self, stage: str, name: str, record: dict) -> None:
        self.staging.write_record(stage, name, record)
        self.remote.fs.pipe_file(self._record_key(stage, name), json.dumps(record, indent=2).encode())

    def read_record(self, stage: str, name: str) -> dict | None:
        return self.remote.read_json(self._record_key(stage, name))

    def remove_record(self, stage: str, name: str) -> None:
        self.staging.remove_record(stage, name)
        self._remove_keys([self._record_key(stage, name)])

    def _remove_keys(self, keys: list[str]) -> None:
        """Delete objects one key at a time: `fs.rm` would read a `[...]` in a key as a glob."""
        for key in keys:
            try:
                self.remote.fs.rm_file(key)
            except FileNotFoundError:
                pass

    def _record_key(self, stage: str, name: str) -> str:
        return f"{self.remote.base}/{stage_folder(stage)}/{name}"

    # ------------------------------------------------------------------ writing one artifact

    def claim(self, stage: str, artifact_id: str, run_id: str | None = None, on_wait: Log | None = None) -> Claim:
        claim = self.staging.claim(stage, artifact_id, run_id, on_wait)  # this machine's runs ...
        try:  # ... and the bucket's lease, for runs on other machines
            claim.lease = self.remote.lease(stage, artifact_id, run_id)
            claim.lease.acquire(on_wait=on_wait)
        except BaseException:
            claim.lock.release()
            raise
        return claim

    def try_claim(self, stage: str, artifact_id: str) -> Claim | None:
        claim = self.staging.try_claim(stage, artifact_id)
        if claim is None:
            return None
        lease = self.remote.lease(stage, artifact_id)
        try:  # renewed while held, and deleted by `release` (a lease merely created would stay until it expired)
            taken = lease.acquire(blocking=False)
        except BaseException:
            claim.release()
            raise
        if not taken:
            claim.release()
            return None
        claim.lease = lease
        return claim

    def prepare(self, stage: str, artifact_id: str, log: Log) -> None:
        """A partial artifact on the bucket: the files beside its checkpoint into the staging
        directory (the engine resumes from the checkpoint at the URL), or with staged
        checkpoints also its newest whole step."""
        directory = self.artifact_dir(stage, artifact_id)
        self.remote.download(
            stage, artifact_id, directory, with_manifest=False, partial=True, log=log, checkpoints=not self.direct
        )

    def has_partial(self, stage: str, artifact_id: str) -> bool:
        return self.staging.has_partial(stage, artifact_id) or bool(self.remote.payload(stage, artifact_id))

    def digest_payload(self, stage: str, artifact_id: str) -> dict[str, dict[str, Any]]:
        """The staged files' digests and, at the URL, every file of each committed checkpoint
        step as its digests.json recorded it when the step committed (the engine hashed what
        it wrote), the step's own small files streamed through sha256."""
        files = self.staging.digest_payload(stage, artifact_id)
        if self.direct:
            files.update(self.remote.checkpoint_files(stage, artifact_id))
        return files

    def write_manifest(self, stage: str, artifact_id: str, manifest: dict) -> None:
        self.artifact_dir(stage, artifact_id).mkdir(parents=True, exist_ok=True)  # made on another machine
        self.staging.write_manifest(stage, artifact_id, manifest)
        self.remote.write_manifest(stage, artifact_id, manifest)

    def running(self, stage: str, artifact_id: str, claim: Claim, log: Log) -> contextlib.AbstractContextManager:
        # As each checkpoint step commits (staged: uploaded), the small files follow: a
        # SIGKILLed run resumes elsewhere.
        return self.remote.mirror(
            stage,
            artifact_id,
            self.artifact_dir(stage, artifact_id),
            log=log,
            keep_going=lambda: not claim.lost,
            direct=self.direct,
        )

    def commit(self, stage: str, artifact_id: str, manifest: dict, claim: Claim) -> None:
        """The payload (objects the manifest does not list deleted: the bucket holds what it
        lists), then the manifest with each object's version: one atomic PUT, last; then the
        staging copy's."""
        try:
            self.remote.upload(
                self.artifact_dir(stage, artifact_id),
                stage,
                artifact_id,
                delete_extra=True,
                keep=set(manifest.get("files", {})),
            )
            manifest["versions"] = self.remote.versions(stage, artifact_id)
        except OSError as e:  # refused (permissions, expired credentials), unreachable, full
            raise StoreWriteError(
                f"stage '{stage}': could not upload the artifact to {self.location(stage, artifact_id)}: "
                f"{type(e).__name__}: {e}; not committed (its checkpoint steps already there are kept for a resume)"
            ) from e
        if claim.lost:
            raise ArtifactError(
                f"stage '{stage}': the lease on {self.location(stage, artifact_id)} expired and was taken over "
                f"by another run; not committing"
            )
        self.remote.write_manifest(stage, artifact_id, manifest)
        self.staging.write_manifest(stage, artifact_id, manifest)

    def reuse(self, stage: str, source_id: str, artifact_id: str, manifest: dict, claim: Claim) -> list[str]:
        """As the local store's, with copies made in the bucket (server-side): the source's
        objects checked by one LIST (presence, size, and the consumed ones' versions, any
        other version streamed through sha256), the copies' versions recorded."""
        files, remote = manifest["files"], self.remote
        recorded = (remote.read_manifest(stage, source_id) or {}).get("versions") or {}
        listing = remote.listing(stage, source_id)
        problems = [f"{rel}: not part of the artifact" for rel in sorted(set(listing) - set(files))]
        consumed = consumed_files(files)
        for rel, entry in sorted(files.items()):
            if rel not in listing:
                problems.append(f"{rel}: missing")
            elif listing[rel][0] != entry["size"]:
                problems.append(f"{rel}: size {listing[rel][0]} != recorded {entry['size']}")
            elif rel in consumed and recorded.get(rel) != listing[rel][1]:
                if remote.sha256(remote.key(stage, source_id, rel)) != entry["sha256"]:
                    problems.append(f"{rel}: sha256 differs from the recorded digest")
        if problems:
            return problems
        staging = self.artifact_dir(stage, artifact_id)
        for entry in staging.iterdir():  # what an earlier attempt left here
            if entry.name != LOCK:
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        left = remote.payload(stage, artifact_id)  # ... and in the bucket
        if left:
            remote.fs.rm([remote.key(stage, artifact_id, rel) for rel in left])
        rels = sorted(files)
        targets = [remote.key(stage, artifact_id, r) for r in rels]
        remote.fs.copy([remote.key(stage, source_id, r) for r in rels], targets)  # in the bucket
        manifest["versions"] = remote.versions(stage, artifact_id)
        if claim.lost:
            raise ArtifactError(
                f"stage '{stage}': the lease on {self.location(stage, artifact_id)} expired and was taken over "
                f"by another run; not committing"
            )
        remote.write_manifest(stage, artifact_id, manifest)
        self.staging.write_manifest(stage, artifact_id, manifest)
        return []

    def keep_partial(self, stage: str, artifact_id: str, claim: Claim, log: Log) -> None:
        """What the failed or interrupted stage has (committed checkpoint steps included) and its
        `failed` manifest, uploaded, so any machine resumes from there."""
        if claim.lost:
            return
        directory = self.artifact_dir(stage, artifact_id)
        try:
            self.remote.upload(directory, stage, artifact_id)
            manifest = read_manifest(directory)
            if manifest is not None:
                self.remote.write_manifest(stage, artifact_id, manifest)
        except Exception as e:  # the original error matters more
            log(f"could not upload the partial artifact to {self.location(stage, artifact_id)}: {e}")

    def publish(self, stage: str, artifact_id: str, manifest: dict) -> None:
        self.remote.upload(self.artifact_dir(stage, artifact_id), stage, artifact_id)
        manifest["versions"] = self.remote.versions(stage, artifact_id)  # consumers read its checkpoint at the URL
        self.remote.write_manifest(stage, artifact_id, manifest)
        self.staging.write_manifest(stage, artifact_id, manifest)

    # ------------------------------------------------------------------ retention (trainflow gc)

    def delete(self, stage: str, artifact_id: str, claim: Claim) -> None:
        """The bucket's manifest, then its other objects but the lease; then the staging copy's."""
        self._remove_keys([self.remote.key(stage, artifact_id, MANIFEST)])
        self._remove_keys([self.remote.key(stage, artifact_id, rel) for rel in self.remote.payload(stage, artifact_id)])
        self.staging.delete(stage, artifact_id, claim)

    def drop_steps(self, stage: str, artifact_id: str, steps: list[int], claim: Claim) -> None:
        folders = tuple(f"{CHECKPOINT_DIR}/{step}/" for step in steps)
        payload = self.remote.payload(stage, artifact_id)
        self._remove_keys([self.remote.key(stage, artifact_id, rel) for rel in payload if rel.startswith(folders)])
        self.staging.drop_steps(stage, artifact_id, steps, claim)

    def shown(self, text: str) -> str:
        """`<cache>/pretrain/ID/checkpoint` -> `s3://b/p/pretrain/ID/checkpoint`."""
        return text.replace(str(self.root), self.url)

    # ------------------------------------------------------------------ reading

    def open_input(
        self, stage: str, artifact_id: str, verify: bool = True, local_checkpoint: bool = False
    ) -> ArtifactRef:
        """A complete artifact as a consumer reads it. Its consumed small files come into the
        cache (kept there: same id, same bytes), hashed as they arrive unless a stamp vouches
        for a cached copy. Its checkpoint is read at the URL when the manifest recorded the
        objects' versions: one LIST finds each consumed checkpoint object at the version and
        size it had when its sha256 was recorded (one whose version differs is streamed
        through sha256); otherwise the consumed step is downloaded and hashed too. The same
        LIST checks every other object's presence and size. `local_checkpoint`: the consumed
        step into the cache in any case (`trainflow generate` reads a local copy)."""
        manifest = self.complete_manifest(stage, artifact_id)
        directory = self.artifact_dir(stage, artifact_id)
        recorded = manifest.get("files", {})
        wanted = consumed_files(recorded)
        at_url = self.direct and bool(manifest.get("versions")) and not local_checkpoint
        if at_url:  # the checkpoint and the token shards are read at the URL by the engine's processes
            wanted = {rel: entry for rel, entry in wanted.items() if not read_in_place(rel)}
        lock = ArtifactLock(directory)  # one process fills a cache entry at a time
        lock.acquire()
        try:
            problems = self.remote.fetch(
                stage,
                artifact_id,
                directory,
                recorded,
                wanted,
                verify,
                versions=manifest.get("versions") if at_url and verify else None,
                in_place={rel for rel in consumed_files(recorded) if read_in_place(rel)} if at_url else (),
            )
            refuse(stage, artifact_id, problems, self.location(stage, artifact_id))
            write_manifest_copy(directory, manifest)  # most recently used, for the cache's eviction
        finally:
            lock.release()
        self.remote.evict(keep={directory})
        url = self.location(stage, artifact_id) if at_url else None
        checkpoint_url = f"{url}/{CHECKPOINT_DIR}" if url else None
        return ArtifactRef(stage, artifact_id, directory, manifest, checkpoint_url=checkpoint_url, url=url)

    def verify(self, directory: Path) -> list[str]:
        """Every object of the artifact streamed through sha256 (a staging or cache directory
        of this store names it); another directory is verified where it is."""
        at = self.artifact_at(directory)
        if at is None:
            return self.staging.verify(directory)
        stage, artifact_id = at
        manifest, where = self.remote.read_manifest(stage, artifact_id), self.location(stage, artifact_id)
        if manifest is None:
            return [f"{where}: no readable artifact.json"]
        if manifest.get("status") != COMPLETE:
            return [f"{where}: status is {manifest.get('status')!r}, not complete"]
        return self.remote.compare(stage, artifact_id, manifest.get("files", {}))


def write_manifest_copy(directory: Path, manifest: dict) -> None:
    """A bucket's manifest in a local directory (staging or cache), for the local readers."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2, default=str) + "\n")
    os.utime(directory / MANIFEST)
