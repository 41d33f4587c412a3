"""The artifact store on object storage (s3://, gs://): a local store of staging directories
plus the bucket, through fsspec (tasks/objectstore.py moves the bytes and holds the leases).

What it changes of the local store's behaviour, and nothing else: where an artifact is
shown and its state read (the bucket), the claim (the staging flock plus the bucket lease),
`prepare` (the newest whole checkpoint step of a partial artifact downloaded), `running`
(each checkpoint step uploaded as it commits), `commit` (the payload, then the manifest,
one PUT, last), `keep_partial` (what a failed stage has, uploaded), `open_input` (only the
consumed files downloaded into the cache, hashed as they arrive) and `verify` (every object
streamed through sha256, nothing written to disk).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from tasks.store.base import ArtifactStore, Claim, Log, refuse, write_manifest_copy
from tasks.store.consume import consumed_files
from tasks.store.objects import RemoteBackend, StoreAccessError, StoreWriteError, is_url
from tasks.store.records import COMPLETE, FAILED, ArtifactError, ArtifactLock, ArtifactRef, read_manifest


class BucketStore(ArtifactStore):
    """Artifacts under a bucket prefix; `root` is that prefix's local staging directory (cache)."""

    @classmethod
    def handles(cls, root: str) -> bool:
        return is_url(root)

    def __init__(self, root: str | Path):
        try:
            self.remote = RemoteBackend(str(root))
        except StoreAccessError as e:
            raise ArtifactError(str(e)) from None
        self.root = self.remote.cache
        self.url = self.remote.url

    def location(self, stage: str, artifact_id: str) -> str:
        return self.remote.url_of(stage, artifact_id)

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

    # ------------------------------------------------------------------ writing one artifact

    def claim(self, stage: str, artifact_id: str, run_id: str | None = None, on_wait: Log | None = None) -> Claim:
        claim = super().claim(stage, artifact_id, run_id, on_wait)  # this machine's runs ...
        try:  # ... and the bucket's lease, for runs on other machines
            claim.lease = self.remote.lease(stage, artifact_id, run_id)
            claim.lease.acquire(on_wait=on_wait)
        except BaseException:
            claim.lock.release()
            raise
        return claim

    def prepare(self, stage: str, artifact_id: str, log: Log) -> None:
        """A partial artifact on the bucket: its newest whole checkpoint step (and the files
        beside the steps) into the staging directory, for the engine to resume from."""
        directory = self.artifact_dir(stage, artifact_id)
        self.remote.download(stage, artifact_id, directory, with_manifest=False, partial=True, log=log)

    def write_manifest(self, stage: str, artifact_id: str, manifest: dict) -> None:
        super().write_manifest(stage, artifact_id, manifest)
        self.remote.write_manifest(stage, artifact_id, manifest)

    def running(self, stage: str, artifact_id: str, claim: Claim, log: Log) -> contextlib.AbstractContextManager:
        # Checkpoint steps are uploaded as they commit: a SIGKILLed run resumes elsewhere.
        return self.remote.mirror(
            stage, artifact_id, self.artifact_dir(stage, artifact_id), log=log, keep_going=lambda: not claim.lost
        )

    def commit(self, stage: str, artifact_id: str, manifest: dict, claim: Claim) -> None:
        """The payload (objects no longer staged deleted: the bucket holds what the manifest
        lists), then the manifest: one atomic PUT, last; then the staging copy's."""
        try:
            self.remote.upload(self.artifact_dir(stage, artifact_id), stage, artifact_id, delete_extra=True)
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
        super().write_manifest(stage, artifact_id, manifest)

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

    def shown(self, text: str) -> str:
        """`<cache>/pretrain/ID/checkpoint` -> `s3://b/p/pretrain/ID/checkpoint`."""
        return text.replace(str(self.root), self.url)

    # ------------------------------------------------------------------ reading

    def open_input(self, stage: str, artifact_id: str, verify: bool = True) -> ArtifactRef:
        """The consumed files of a complete artifact in the cache (kept there: same id, same
        bytes), downloaded and hashed as they arrive unless a stamp vouches for a cached copy;
        one LIST checks the other objects' presence and sizes."""
        manifest = self._complete_manifest(stage, artifact_id)
        directory = self.artifact_dir(stage, artifact_id)
        recorded = manifest.get("files", {})
        lock = ArtifactLock(directory)  # one process fills a cache entry at a time
        lock.acquire()
        try:
            problems = self.remote.fetch(stage, artifact_id, directory, recorded, consumed_files(recorded), verify)
            refuse(stage, artifact_id, problems, self.location(stage, artifact_id))
            write_manifest_copy(directory, manifest)  # most recently used, for the cache's eviction
        finally:
            lock.release()
        self.remote.evict(keep={directory})
        return ArtifactRef(stage, artifact_id, directory, manifest)

    def verify(self, directory: Path) -> list[str]:
        """Every object of the artifact streamed through sha256 (a staging or cache directory
        of this store names it); another directory is verified where it is."""
        if Path(directory).parent.parent != self.root:
            return super().verify(directory)
        stage, artifact_id = Path(directory).parent.name, Path(directory).name
        manifest, where = self.remote.read_manifest(stage, artifact_id), self.location(stage, artifact_id)
        if manifest is None:
            return [f"{where}: no readable artifact.json"]
        if manifest.get("status") != COMPLETE:
            return [f"{where}: status is {manifest.get('status')!r}, not complete"]
        return self.remote.compare(stage, artifact_id, manifest.get("files", {}))
