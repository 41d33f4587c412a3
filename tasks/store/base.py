"""The artifact store interface. It imports no backend.

`ArtifactStore(root)` gives the implementation its root asks for -- tasks/store/local.py's
for a path, tasks/store/bucket.py's for an s3:// / gs:// URL -- and the runner, lineage,
verify, status and the pipeline's records speak only this interface: where an artifact is
worked on (`artifact_dir`) and shown (`location`), its state and manifest, the `claim` a
writer holds, `prepare` / `running` / `commit` / `keep_partial` around a stage's work,
`open_input` for a consumer (tasks/store/consume.py: it reads what it consumes), `verify`,
records beside the artifacts (a gate's decision), `publish` for an artifact made outside a
stage (a checkpoint step's snapshot), and `try_claim` / `delete` / `drop_steps` /
`stored_bytes` for `trainflow gc`. A new backend implements these methods; it subclasses
nothing else.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from engine.contract import MANIFEST
from tasks.store.names import folder_stage
from tasks.store.records import COMPLETE, ArtifactError, ArtifactLock, ArtifactRef, InputError
from tasks.store.urls import is_url

Log = Callable[[str], None]


class Lease(Protocol):
    """What a claim needs of a backend's lease (tasks/store/leases.py's on a bucket)."""

    @property
    def lost(self) -> bool: ...

    def release(self) -> None: ...


_IMPLEMENTATIONS: list[type[ArtifactStore]] = []  # the backends, in the order they were defined
_REQUIRED: list[str] = []  # the interface's methods that every backend implements
_Method = TypeVar("_Method", bound=Callable[..., Any])


def required(method: _Method) -> _Method:
    """An interface method without a default: every backend implements it (checked when the
    backend's class is defined)."""
    _REQUIRED.append(method.__name__)
    return method


@dataclass
class Claim:
    """The right to write one artifact: the flock on its directory (which the stage's engine
    children inherit through `fd`) and, on a bucket, the lease that orders other machines."""

    lock: ArtifactLock
    lease: Lease | None = None

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
    """A directory of artifacts. Constructed on this class, the implementation for `root`
    (the first implementation defined whose `handles(root)` is true)."""

    root: Path
    """The local directory a stage works in: the store itself, or a backend's staging copy."""
    url: str
    """The store's location as users name it: its directory, or its URL."""

    def __new__(cls, root: str | Path):
        if cls is ArtifactStore:
            cls = next(impl for impl in _IMPLEMENTATIONS if impl.handles(str(root)))
        return super().__new__(cls)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        missing = [name for name in _REQUIRED if getattr(cls, name) is getattr(ArtifactStore, name)]
        if missing:
            raise TypeError(f"store backend {cls.__name__} does not implement {', '.join(missing)}")
        _IMPLEMENTATIONS.append(cls)

    @classmethod
    def handles(cls, root: str) -> bool:
        """Whether this implementation serves a store at `root` (a path or a URL)."""
        return False

    def require(self) -> None:
        """InputError unless the store exists, for a command that only reads it (nothing
        where opening the store checked it)."""

    # ------------------------------------------------------------------ where and what

    @required
    def location(self, stage: str, artifact_id: str) -> str:
        """Where an artifact lives, for humans: its URL on a bucket, else its directory."""
        raise NotImplementedError

    @required
    def artifact_dir(self, stage: str, artifact_id: str) -> Path:
        """The local directory a stage writes the artifact in and a consumer reads it from."""
        raise NotImplementedError

    @required
    def checkpoint_location(self, stage: str, artifact_id: str) -> str:
        """Where the stage's engine writes (and resumes) the artifact's checkpoint: a
        directory, or a URL every process writes to."""
        raise NotImplementedError

    @required
    def committed_steps(self, stage: str, artifact_id: str) -> list[int]:
        """The checkpoint steps the artifact's engine has committed so far (whole: their
        digests are there), ascending, read where it writes them (`checkpoint_location`)."""
        raise NotImplementedError

    @required
    def copy_step(self, stage: str, artifact_id: str, step: int, into_stage: str) -> list[str]:
        """Committed step `step` of the artifact's checkpoint into the same place of artifact
        (`into_stage`, `artifact_id`) (a checkpoint step's snapshot, flows/steps.py), after its
        files are checked against the digests recorded when it was committed: the files that
        differ ([] = copied)."""
        raise NotImplementedError

    @required
    def manifest(self, stage: str, artifact_id: str) -> dict | None:
        """The artifact's manifest as the store holds it (None: none readable)."""
        raise NotImplementedError

    @required
    def state(self, stage: str, artifact_id: str) -> str:
        """complete | running (a live process holds its claim) | partial | failed | pending."""
        raise NotImplementedError

    @required
    def iter_artifacts(self) -> Iterator[tuple[Path, dict | None]]:
        """(local directory, manifest or None) for every artifact in the store."""
        raise NotImplementedError

    @required
    def stage_artifacts(self, stage: str) -> list[str]:
        """The ids of the artifacts of one stage (whatever their state)."""
        raise NotImplementedError

    @required
    def stored_bytes(self, stage: str, artifact_id: str) -> int:
        """The bytes the artifact's files take in the store, as found there (not as its
        manifest records them)."""
        raise NotImplementedError

    def artifact_at(self, directory: Path) -> tuple[str, str] | None:
        """(stage, id) when `directory` is one of this store's artifact directories
        (`artifact_dir`), else None."""
        directory = Path(directory)
        if directory.parent.parent != self.root:
            return None
        return folder_stage(directory.parent.name), directory.name

    def is_complete(self, stage: str, artifact_id: str) -> bool:
        manifest = self.manifest(stage, artifact_id)
        return bool(manifest and manifest.get("status") == COMPLETE and manifest.get("id") == artifact_id)

    def check_sizes(self, stage: str, artifact_id: str) -> None:
        """Before a complete artifact is skipped: ArtifactError (one sentence) where a store can
        see cheaply that its files are not those recorded. Where it cannot, nothing; the
        consumers of an artifact check it anyway (`open_input`)."""

    def find(self, artifact_id: str) -> Path:
        """The directory of an artifact given its id (or a unique prefix of it)."""
        matches = [d for d, _ in self.iter_artifacts() if d.name.startswith(artifact_id)]
        if not matches:
            raise InputError(f"no artifact with id '{artifact_id}' in store {self.url}")
        if len({d.name for d in matches}) > 1:
            names = ", ".join(f"{folder_stage(d.parent.name)}/{d.name}" for d in matches)
            raise InputError(f"id prefix '{artifact_id}' is ambiguous in store {self.url}: {names}")
        return matches[0]

    # ------------------------------------------------------------------ records beside the artifacts

    @required
    def write_record(self, stage: str, name: str, record: dict) -> None:
        """A JSON record in a stage's folder beside its artifacts (`name`, not an artifact:
        e.g. a gate's decision not to make one), written atomically."""
        raise NotImplementedError

    @required
    def read_record(self, stage: str, name: str) -> dict | None:
        """A record `write_record` wrote (None: none, or unreadable)."""
        raise NotImplementedError

    @required
    def remove_record(self, stage: str, name: str) -> None:
        """Delete a record (nothing if there is none)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ writing one artifact

    @required
    def claim(self, stage: str, artifact_id: str, run_id: str | None = None, on_wait: Log | None = None) -> Claim:
        """Wait for, then hold, the right to write the artifact."""
        raise NotImplementedError

    @required
    def try_claim(self, stage: str, artifact_id: str) -> Claim | None:
        """The claim, taken without waiting: None while a run holds it."""
        raise NotImplementedError

    @required
    def prepare(self, stage: str, artifact_id: str, log: Log) -> None:
        """Bring what a resumed stage needs of its partial artifact to `artifact_dir`."""
        raise NotImplementedError

    @required
    def has_partial(self, stage: str, artifact_id: str) -> bool:
        """Whether an earlier attempt left payload (checkpoint steps among it) to resume over."""
        raise NotImplementedError

    @required
    def digest_payload(self, stage: str, artifact_id: str) -> dict[str, dict[str, Any]]:
        """The finished payload's `files` for the manifest: size and sha256 of every file."""
        raise NotImplementedError

    @required
    def write_manifest(self, stage: str, artifact_id: str, manifest: dict) -> None:
        """The manifest, written atomically where the store keeps it (not a commit: see `commit`)."""
        raise NotImplementedError

    def running(self, stage: str, artifact_id: str, claim: Claim, log: Log) -> contextlib.AbstractContextManager:
        """Around the stage's work (a bucket store uploads checkpoint steps as they commit)."""
        return contextlib.nullcontext()

    @required
    def commit(self, stage: str, artifact_id: str, manifest: dict, claim: Claim) -> None:
        """The `complete` manifest, written last and atomically: from here on the artifact exists."""
        raise NotImplementedError

    @required
    def reuse(self, stage: str, source_id: str, artifact_id: str, manifest: dict, claim: Claim) -> list[str]:
        """Commit `manifest` as the artifact `artifact_id` over the payload of the complete
        artifact `source_id` of the same stage (tasks/cutoff.py), once the source's consumed
        files are found intact. Returns the problems that stopped it ([] = committed)."""
        raise NotImplementedError

    @required
    def keep_partial(self, stage: str, artifact_id: str, claim: Claim, log: Log) -> None:
        """After a failure (its `failed` manifest written): keep what is there for a resume."""
        raise NotImplementedError

    @required
    def publish(self, stage: str, artifact_id: str, manifest: dict) -> None:
        """An artifact made whole in its `artifact_dir` outside a stage's run, under its lock
        (a checkpoint step's snapshot, flows/steps.py): its files as they are there, then its
        `complete` manifest, last."""
        raise NotImplementedError

    # ------------------------------------------------------------------ retention (trainflow gc)

    @required
    def delete(self, stage: str, artifact_id: str, claim: Claim) -> None:
        """Under its claim: the artifact's manifest first (a half-deleted artifact reads as
        partial, never as complete), then every other file of it but the claim's own lock
        (and lease), which `claim.release` lets go."""
        raise NotImplementedError

    @required
    def drop_steps(self, stage: str, artifact_id: str, steps: list[int], claim: Claim) -> None:
        """Under its claim, once its manifest no longer lists them: the files of the
        artifact's checkpoint steps `steps`."""
        raise NotImplementedError

    def shown(self, text: str) -> str:
        """A log line of a stage, naming the store's places rather than local working copies."""
        return text

    # ------------------------------------------------------------------ reading

    @required
    def open_input(
        self, stage: str, artifact_id: str, verify: bool = True, local_checkpoint: bool = False
    ) -> ArtifactRef:
        """A complete artifact, checked as far as a consumer reads it (tasks/store/consume.py:
        the newest checkpoint step's params and meta, not its optimizer state or the other
        steps); else ArtifactError. `local_checkpoint`: its consumed step in `path` in any case."""
        raise NotImplementedError

    def complete_manifest(self, stage: str, artifact_id: str) -> dict:
        """The artifact's manifest when it is complete and names this id; else ArtifactError."""
        manifest, where = self.manifest(stage, artifact_id), self.location(stage, artifact_id)
        if manifest is None or manifest.get("status") != COMPLETE:
            raise ArtifactError(f"artifact {stage}/{artifact_id} is not complete ({where})")
        if manifest.get("id") != artifact_id:
            raise ArtifactError(f"{where}/{MANIFEST}: records id {manifest.get('id')!r}, expected {artifact_id!r}")
        return manifest

    @required
    def verify(self, directory: Path) -> list[str]:
        """Every file of a finished artifact re-hashed against its manifest ([] = intact)."""
        raise NotImplementedError


def refuse(stage: str, artifact_id: str, problems: list[str], where) -> None:
    """ArtifactError naming the first problems found with an input, or nothing."""
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise ArtifactError(
            f"artifact {stage}/{artifact_id} changed since it was finished: {shown}. "
            f"Run `trainflow verify {where}`; delete it to rebuild it"
        )


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
    if split is not None:  # the artifact at that stage and id (a step's snapshot shares its stage's id)
        remote_store = ArtifactStore(split[0])
        wanted = (folder_stage(split[1]), split[2])
        for directory, _ in remote_store.iter_artifacts():
            if remote_store.artifact_at(directory) == wanted:
                return directory
        raise InputError(f"no artifact at {path_or_id} (nothing in store {remote_store.url} at that stage and id)")
    candidate = Path(path_or_id).expanduser()
    if candidate.name == MANIFEST:
        candidate = candidate.parent
    if candidate.is_dir():
        # Its real place: `..` and symlinks resolved, so that its store (the directory two up)
        # is the store it is in, never the artifact itself (`ART/checkpoint/..`) or a link's.
        return candidate.resolve()
    if candidate.exists():
        raise InputError(f"{path_or_id} is a file, not an artifact directory")
    if "/" in path_or_id or candidate.name == MANIFEST or not path_or_id.isalnum():  # a path, not an id
        raise InputError(f"no artifact directory at {path_or_id} (nor is it an id: ids are hex, e.g. 3f2a9c1d)")
    if store is None:
        raise InputError(f"'{path_or_id}' is not an artifact directory; pass --store to look it up by id")
    return ArtifactStore(store).find(path_or_id)
