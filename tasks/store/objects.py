"""Artifact stores on object storage (s3://, gs://) through fsspec, with a local staging copy.

Design (docs/pipelines.md, "Object storage"). A stage's engine writes its checkpoint at the
artifact's URL itself, every process its own shards (engine/train/bucket_paths.py), and a
consumer's engine restores the step it reads from there. Every artifact also has a local
staging directory, `<cache>/<stage>/<id>/` (the same layout as a local store), for its small
files, and the runner (through tasks/store/bucket.py) moves those between it and the bucket:

- before a stage runs, of each input only the files it consumes are downloaded into the
  cache, hashed as they stream in (`fetch`; a complete artifact's files are kept there,
  content-addressed by id, vouched for by their stamps), its checkpoint objects checked by
  one LIST against the versions its manifest recorded (`versions`); of a partial artifact of
  the stage itself its small files, the engine resuming from the steps at the URL;
- while it runs, as each checkpoint step commits at the URL (its digests.json appears) the
  small files that changed follow (`StepMirror`), so even a run killed outright resumes on
  another machine from the newest whole step (`complete_steps`);
- when the stage ends, the manifest's `files` take each step's digests as the engine recorded
  them (`checkpoint_files`), the small files are uploaded (and objects the manifest does not
  list deleted: unfinished saves), then the manifest with every object's version, last (a
  single PUT is atomic on S3 and GCS: readers see the old manifest or the new one);
- a stage that fails or is interrupted uploads what it has (its partial payload) with a
  `failed` manifest, so another machine resumes from there.

With staged checkpoints (TRAINFLOW_STAGED_CHECKPOINTS=1, or a scheme the engine cannot write)
the checkpoint lives in the staging directory too: the mirror uploads each step as Orbax
commits it, its digests last, a resume downloads the newest step uploaded whole, and a
consumer downloads the step it reads.

Locks are lease objects `<artifact>/.lease` (tasks/store/leases.py). Credentials and endpoints come from the
environment (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, STORAGE_EMULATOR_HOST, ...; the libraries'
own config files), never from a pipeline file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import fsspec

from engine.contract import CHECKPOINT_DIR, MANIFEST
from tasks.store.consume import STAMPS, read_stamps, stamp_holds, write_stamps
from tasks.store.leases import LEASE, Lease
from tasks.store.names import stage_folder
from tasks.store.records import STEP_DIGESTS, flock_held

# gcsfs logs each request it gives up on with its traceback; with no handler configured,
# Python would print those to stderr beside the one line the command answers.
logging.getLogger("gcsfs").addHandler(logging.NullHandler())

DEFAULT_CACHE_BYTES = 20 << 30
MIRROR_SECONDS = float(os.environ.get("TRAINFLOW_MIRROR_SECONDS", "2"))
FETCH_BLOCK = 8 << 20  # bytes per ranged GET when a consumer streams an input in
FETCH_THREADS = 8


class StoreAccessError(RuntimeError):
    """The bucket behind a store URL cannot be used (missing, no credentials, no permission)."""


class StoreWriteError(RuntimeError):
    """The bucket refused (or lost) a write while a stage committed: retried like a crash."""


def _filesystem(url: str):
    protocol = url.split("://", 1)[0]
    try:
        return fsspec.filesystem(protocol, **_options(protocol))
    except (ImportError, ValueError) as e:
        extra = {"s3": "s3", "gs": "gcs", "gcs": "gcs"}.get(protocol, protocol)
        raise StoreAccessError(
            f"artifact store {url}: the {protocol}:// file system is not installed "
            f"(pip install 'trainflow[{extra}]'): {e}"
        ) from None
    except Exception as e:  # google.auth's DefaultCredentialsError (gs:// with no credentials)
        if "Credentials" not in type(e).__name__:
            raise
        raise StoreAccessError(f"artifact store {url}: no credentials found for {protocol}:// ({GCS_LOGIN})") from None


GCS_LOGIN = "set GOOGLE_APPLICATION_CREDENTIALS or run `gcloud auth application-default login`"


def _options(protocol: str) -> dict:
    if protocol == "s3":
        # botocore reads AWS_ENDPOINT_URL itself; passing it also covers older releases.
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        return {"client_kwargs": {"endpoint_url": endpoint}} if endpoint else {}
    if protocol in ("gs", "gcs") and not os.environ.get("STORAGE_EMULATOR_HOST"):
        # Application default credentials or none: gcsfs's own default would go on
        # anonymously when there are none, and retry each refused request for most of a minute.
        return {"token": "google_default"}
    return {}


def url_cache(url: str) -> Path:
    """The local cache directory that belongs to a URL (a store's staging copies, a source's download)."""
    base = Path(os.environ.get("TRAINFLOW_CACHE") or Path.home() / ".cache" / "trainflow").expanduser()
    return (base / hashlib.sha256(url.encode()).hexdigest()[:16]).absolute()


class RemoteBackend:
    """The bucket side of an ArtifactStore whose root is a URL."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.protocol, rest = self.url.split("://", 1)
        self.base = rest.strip("/")
        self.bucket = self.base.split("/", 1)[0]
        self.fs = _filesystem(self.url)
        self.cache = url_cache(self.url)
        self.cache_bytes = int(os.environ.get("TRAINFLOW_CACHE_BYTES", DEFAULT_CACHE_BYTES))
        self.check()

    # ------------------------------------------------------------------ access

    def check(self) -> None:
        """One sentence naming the URL when the bucket cannot be used; before any compute."""
        try:
            self.fs.ls(self.bucket, refresh=True)
        except FileNotFoundError:
            raise StoreAccessError(
                f"artifact store {self.url}: bucket '{self.bucket}' does not exist (or the endpoint does not serve it)"
            ) from None
        except PermissionError:
            raise StoreAccessError(
                f"artifact store {self.url}: permission denied listing bucket "
                f"'{self.bucket}' with the credentials in this environment"
            ) from None
        except Exception as e:  # botocore's NoCredentialsError, connection errors, ...
            name = type(e).__name__
            if "Credential" in name or "credential" in str(e):
                how = "set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or a profile" if self.protocol == "s3" else GCS_LOGIN
                raise StoreAccessError(
                    f"artifact store {self.url}: no credentials found for {self.protocol}:// ({how})"
                ) from None
            raise StoreAccessError(f"artifact store {self.url}: cannot reach the bucket: {name}: {e}") from None

    def key(self, stage: str, artifact_id: str, rel: str = "") -> str:
        path = f"{self.base}/{stage_folder(stage)}/{artifact_id}"
        return f"{path}/{rel}" if rel else path

    def url_of(self, stage: str, artifact_id: str) -> str:
        return f"{self.protocol}://{self.key(stage, artifact_id)}"

    # ------------------------------------------------------------------ manifests and listing

    def read_json(self, key: str) -> dict | None:
        try:  # one GET (an open file would check the ETag and fail when a lease is renewed)
            return json.loads(self.fs.cat_file(key))
        except (FileNotFoundError, ValueError):
            return None

    def read_manifest(self, stage: str, artifact_id: str) -> dict | None:
        self.fs.invalidate_cache(self.key(stage, artifact_id))
        return self.read_json(self.key(stage, artifact_id, MANIFEST))

    def write_manifest(self, stage: str, artifact_id: str, manifest: dict) -> None:
        self.fs.pipe_file(
            self.key(stage, artifact_id, MANIFEST), (json.dumps(manifest, indent=2, default=str) + "\n").encode()
        )

    def exists(self, stage: str, artifact_id: str) -> bool:
        return bool(self.payload(stage, artifact_id)) or self.read_manifest(stage, artifact_id) is not None

    def payload(self, stage: str, artifact_id: str) -> dict[str, int]:
        """relative path -> size of every payload object of an artifact (no manifest, no lease)."""
        return {rel: size for rel, (size, _) in self.listing(stage, artifact_id).items()}

    def listing(self, stage: str, artifact_id: str) -> dict[str, tuple[int, str]]:
        """relative path -> (size, version) of every payload object of an artifact, one LIST.
        The version is the object's ETag (S3) or generation (GCS): it changes when it is rewritten."""
        prefix = self.key(stage, artifact_id)
        self.fs.invalidate_cache()  # all of it: s3fs keeps subdirectories' listings (ETags) apart
        try:
            found = self.fs.find(prefix, detail=True)
        except FileNotFoundError:
            return {}
        out = {}
        for key, info in found.items():
            rel = key[len(prefix) + 1 :]
            if rel and rel not in (MANIFEST, LEASE) and info.get("type", "file") == "file":
                out[rel] = (int(info.get("size") or 0), object_version(info))
        return out

    def versions(self, stage: str, artifact_id: str) -> dict[str, str]:
        """relative path -> version of every payload object (what a manifest records at commit)."""
        return {rel: version for rel, (_, version) in self.listing(stage, artifact_id).items()}

    def checkpoint_files(self, stage: str, artifact_id: str) -> dict[str, dict[str, Any]]:
        """The manifest's `files` entries of a checkpoint the engine wrote at the URL: for
        each step whose digests.json is there with every file it lists (`complete_steps`),
        those files as it records them (the engine hashed them as it committed the step),
        and the step's files it does not cover (Orbax's commit file and metadata, the
        digests themselves) and the files beside the steps, streamed through sha256.
        Objects of an unfinished step are not listed: the commit deletes them."""
        payload = self.payload(stage, artifact_id)
        steps = complete_steps(self, stage, artifact_id, payload)
        out: dict[str, dict[str, Any]] = {}
        for step in steps:
            prefix = f"{CHECKPOINT_DIR}/{step}/"
            recorded = self.read_json(self.key(stage, artifact_id, prefix + STEP_DIGESTS)) or {}
            for name, entry in recorded.get("files", {}).items():
                out[prefix + name] = {"size": int(entry["size"]), "sha256": entry["sha256"]}
        kept = tuple(f"{CHECKPOINT_DIR}/{step}/" for step in steps)
        for rel, size in sorted(payload.items()):
            parts = rel.split("/")
            if parts[0] != CHECKPOINT_DIR or rel in out:
                continue
            if len(parts) > 2 and parts[1].isdigit() and not rel.startswith(kept):
                continue  # an unfinished step
            out[rel] = {"size": size, "sha256": self.sha256(self.key(stage, artifact_id, rel))}
        return out

    def artifacts(self) -> list[tuple[str, str]]:
        """(stage, id) of every artifact directory under the store prefix."""
        self.fs.invalidate_cache(self.base)
        out = []
        try:
            stages = [p for p in self.fs.ls(self.base, detail=True) if p["type"] == "directory"]
        except FileNotFoundError:
            return []
        for stage in sorted(stages, key=lambda p: p["name"]):
            for art in sorted(self.fs.ls(stage["name"], detail=True), key=lambda p: p["name"]):
                if art["type"] == "directory":
                    out.append((stage["name"].rsplit("/", 1)[-1], art["name"].rsplit("/", 1)[-1]))
        return out

    # ------------------------------------------------------------------ digests, streamed

    def sha256(self, key: str, chunk: int = 8 << 20) -> str:
        h = hashlib.sha256()
        with self.fs.open(key, "rb", block_size=chunk) as f:
            while block := f.read(chunk):
                h.update(block)
        return h.hexdigest()

    def compare(self, stage: str, artifact_id: str, recorded: dict[str, dict[str, Any]]) -> list[str]:
        present = self.payload(stage, artifact_id)
        problems = []
        for rel, entry in sorted(recorded.items()):
            if rel not in present:
                problems.append(f"{rel}: missing")
            elif present[rel] != entry["size"]:
                problems.append(f"{rel}: size {present[rel]} != recorded {entry['size']}")
            elif self.sha256(self.key(stage, artifact_id, rel)) != entry["sha256"]:
                problems.append(f"{rel}: sha256 differs from the recorded digest")
        for rel in sorted(set(present) - set(recorded)):
            problems.append(f"{rel}: not part of the artifact (added after it was finished)")
        return problems

    # ------------------------------------------------------------------ moving bytes

    def upload(
        self,
        local: Path,
        stage: str,
        artifact_id: str,
        skip: tuple[str, ...] = (),
        delete_extra: bool = False,
        keep: set[str] | frozenset[str] = frozenset(),
    ) -> int:
        """Upload every payload file of a local staging directory whose remote copy differs in
        size (checkpoint steps are immutable once committed), each step's digests last; with
        `delete_extra`, delete the payload objects that are neither there locally nor in
        `keep` (steps Orbax has since removed, unfinished uploads or saves), so the bucket
        holds what the manifest lists. Returns the number of files uploaded."""
        remote = self.payload(stage, artifact_id)
        present, todo = set(), []
        for path in sorted(p for p in local.rglob("*") if p.is_file()):
            rel = path.relative_to(local).as_posix()
            if rel in (MANIFEST, LEASE, ".lock", MANIFEST + ".tmp") or rel.startswith(STAMPS) or rel in skip:
                continue
            present.add(rel)
            if remote.get(rel) != path.stat().st_size or rel.endswith((".jsonl", ".json", ".md")):
                todo.append(rel)
        # Concurrently (fsspec's batched put), the steps' digests after everything else.
        for batch in (
            [r for r in todo if r.rsplit("/", 1)[-1] != STEP_DIGESTS],
            [r for r in todo if r.rsplit("/", 1)[-1] == STEP_DIGESTS],
        ):
            if batch:
                self.fs.put([str(local / rel) for rel in batch], [self.key(stage, artifact_id, rel) for rel in batch])
        if delete_extra:
            extra = [self.key(stage, artifact_id, rel) for rel in sorted(set(remote) - present - set(skip) - set(keep))]
            if extra:
                self.fs.rm(extra)
        return len(todo)

    def download(
        self,
        stage: str,
        artifact_id: str,
        local: Path,
        with_manifest: bool = True,
        partial: bool = False,
        log: Callable[[str], None] | None = None,
        checkpoints: bool = True,
    ) -> int:
        """Fetch the artifact's payload objects missing (or of another size) locally. With
        `partial` (resuming someone's unfinished artifact), of its checkpoint steps only the
        newest one uploaded whole (`complete_steps`): that is the one the engine resumes from;
        without `checkpoints`, none (the engine resumes at the URL)."""
        local.mkdir(parents=True, exist_ok=True)
        payload = self.payload(stage, artifact_id)
        if partial:
            steps = complete_steps(self, stage, artifact_id, payload)
            if not checkpoints:
                payload = {rel: size for rel, size in payload.items() if not rel.startswith(CHECKPOINT_DIR + "/")}
            keep = f"{CHECKPOINT_DIR}/{steps[-1]}/" if steps and checkpoints else None
            # Files of checkpoint/ itself are kept; of its subdirectories only the chosen step.
            payload = {
                rel: size
                for rel, size in payload.items()
                if not rel.startswith(CHECKPOINT_DIR + "/")
                or rel.count("/") < 2
                or (keep is not None and rel.startswith(keep))
            }
            if steps and log:
                log(
                    f"resuming from checkpoint step {steps[-1]} of the partial artifact at "
                    f"{self.url_of(stage, artifact_id)}"
                )
        missing = [
            rel
            for rel, size in sorted(payload.items())
            if not ((local / rel).is_file() and (local / rel).stat().st_size == size)
        ]
        parts = [local / (rel + ".part") for rel in missing]  # renamed into place once all arrived
        for part in parts:
            part.parent.mkdir(parents=True, exist_ok=True)
        if missing:  # concurrently: fsspec's batched get
            self.fs.get([self.key(stage, artifact_id, rel) for rel in missing], [str(part) for part in parts])
        for rel, part in zip(missing, parts):
            os.replace(part, local / rel)
        count = len(missing)
        if with_manifest:
            manifest = self.read_manifest(stage, artifact_id)
            if manifest is not None:
                (local / MANIFEST).write_text(json.dumps(manifest, indent=2, default=str) + "\n")
        return count

    def fetch(
        self,
        stage: str,
        artifact_id: str,
        local: Path,
        recorded: dict[str, dict[str, Any]],
        wanted: dict[str, dict[str, Any]],
        verify: bool = True,
        versions: dict[str, str] | None = None,
        in_place: set[str] | frozenset[str] | tuple = (),
    ) -> list[str]:
        """Bring the `wanted` files of a complete artifact into its cache directory `local`,
        each hashed as it streams in (its bytes are read once), skipping cached files whose
        stamp holds (tasks/store/consume.py). One LIST checks that every `recorded` object is
        there at its size and nothing else is, and that each `in_place` object (read at the
        URL by the consumer) still has the version the manifest recorded in `versions`; one
        whose version differs is streamed through sha256 (nothing written). Returns the
        problems ([] = all well)."""
        listing = self.listing(stage, artifact_id)
        payload = {rel: size for rel, (size, _) in listing.items()}
        problems = [
            f"{rel}: missing" if rel not in payload else f"{rel}: size {payload[rel]} != recorded {entry['size']}"
            for rel, entry in sorted(recorded.items())
            if payload.get(rel) != entry["size"]
        ]
        problems += [
            f"{rel}: not part of the artifact (added after it was finished)"
            for rel in sorted(set(payload) - set(recorded))
        ]
        if problems:
            return problems
        if versions is not None:
            changed = [rel for rel in sorted(in_place) if listing[rel][1] != versions.get(rel) or not versions.get(rel)]
            with ThreadPoolExecutor(FETCH_THREADS) as pool:
                digests = list(pool.map(lambda rel: self.sha256(self.key(stage, artifact_id, rel)), changed))
            problems = [
                f"{rel}: sha256 differs from the recorded digest"
                for rel, digest in zip(changed, digests)
                if digest != recorded[rel]["sha256"]
            ]
            if problems:
                return problems
        local.mkdir(parents=True, exist_ok=True)
        stamps = read_stamps(local)
        todo = [rel for rel, entry in sorted(wanted.items()) if not stamp_holds(local / rel, entry, stamps.get(rel))]

        def one(rel: str) -> str | None:
            target, digest = local / rel, hashlib.sha256()
            part = target.with_name(target.name + ".part")
            part.parent.mkdir(parents=True, exist_ok=True)
            with (
                self.fs.open(self.key(stage, artifact_id, rel), "rb", block_size=FETCH_BLOCK) as src,
                open(part, "wb") as dst,
            ):
                while block := src.read(FETCH_BLOCK):
                    digest.update(block)
                    dst.write(block)
            if verify and digest.hexdigest() != wanted[rel]["sha256"]:
                part.unlink(missing_ok=True)
                return f"{rel}: sha256 differs from the recorded digest"
            os.replace(part, target)
            return None

        with ThreadPoolExecutor(FETCH_THREADS) as pool:
            results = list(pool.map(one, todo))
        problems = [problem for problem in results if problem]
        write_stamps(local, {rel: wanted[rel]["sha256"] for rel, problem in zip(todo, results) if not problem})
        return problems

    def mirror(
        self,
        stage: str,
        artifact_id: str,
        local: Path,
        log: Callable[[str], None] | None = None,
        keep_going: Callable[[], bool] = lambda: True,
        direct: bool = False,
    ) -> StepMirror:
        return StepMirror(self, stage, artifact_id, local, log=log, keep_going=keep_going, direct=direct)

    def evict(self, keep: set[Path]) -> None:
        """Keep the cache under its bound: delete the least recently used complete copies."""
        entries = []
        total = 0
        for manifest in self.cache.glob(f"*/*/{MANIFEST}"):
            directory = manifest.parent
            size = sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())
            total += size
            entries.append((manifest.stat().st_atime, directory, size))
        for _, directory, size in sorted(entries, key=lambda e: e[0]):
            if total <= self.cache_bytes:
                break
            if directory in keep or (directory / ".lock").exists() and flock_held(directory / ".lock"):
                continue
            shutil.rmtree(directory, ignore_errors=True)
            total -= size

    # ------------------------------------------------------------------ leases

    def lease(self, stage: str, artifact_id: str, run_id: str | None = None) -> Lease:
        return Lease(self, self.key(stage, artifact_id, LEASE), run_id)


# --------------------------------------------------------------------------- directories at a URL
# What `trainflow convert s3://...` reads and `trainflow export --out gs://...` writes: a plain
# folder of files in a bucket (a Hugging Face model directory), outside any artifact store.


def _bucket_path(url: str) -> tuple[Any, str]:
    """The file system of a URL and the path it takes ("bucket/prefix"); one line on failure."""
    fs = _filesystem(url)
    path = url.split("://", 1)[1].strip("/")
    try:
        fs.ls(path.split("/", 1)[0], refresh=True)
    except FileNotFoundError:
        raise StoreAccessError(f"{url}: bucket '{path.split('/', 1)[0]}' does not exist") from None
    except PermissionError:
        raise StoreAccessError(f"{url}: permission denied with the credentials in this environment") from None
    return fs, path


def object_version(info: dict[str, Any]) -> str:
    """An fsspec listing entry's version: the ETag on S3, the generation on GCS."""
    return str(info.get("ETag") or info.get("generation") or info.get("etag") or "")


def list_url(url: str) -> dict[str, dict[str, Any]]:
    """name -> {size, version} of the files directly under a folder URL ({} when there are none).
    `version` is the object's ETag (S3) or generation (GCS): it changes when the bytes do."""
    fs, path = _bucket_path(url)
    fs.invalidate_cache(path)
    try:
        entries = fs.ls(path, detail=True)
    except FileNotFoundError:
        return {}
    return {
        entry["name"].rstrip("/").rsplit("/", 1)[-1]: {
            "size": int(entry.get("size") or 0),
            "version": object_version(entry),
        }
        for entry in entries
        if entry.get("type") == "file"
    }


def read_url(url: str) -> bytes:
    fs, path = _bucket_path(url)
    return fs.cat_file(path)


def write_url(url: str, data: bytes) -> None:
    """One object at a URL (a single PUT: whole or absent)."""
    fs, path = _bucket_path(url)
    fs.pipe_file(path, data)


def download_dir(url: str, local: Path) -> list[str]:
    """Copy the files directly under a folder URL into `local` (those missing or of another
    size); their names."""
    fs, path = _bucket_path(url)
    local.mkdir(parents=True, exist_ok=True)
    listing = list_url(url)
    for name, info in sorted(listing.items()):
        target = local / name
        if target.is_file() and target.stat().st_size == info["size"]:
            continue
        tmp = target.with_name(name + ".part")
        fs.get_file(f"{path}/{name}", str(tmp))
        os.replace(tmp, target)
    return sorted(listing)


def upload_dir(local: Path, url: str) -> int:
    """Copy every file under `local` to the folder URL (the index last, after the shards it
    names); the number of files."""
    fs, path = _bucket_path(url)
    files = sorted((p for p in local.rglob("*") if p.is_file()), key=lambda p: (p.name.endswith(".index.json"), p))
    for file in files:
        fs.put_file(str(file), f"{path}/{file.relative_to(local).as_posix()}")
    return len(files)


def list_url_dirs(url: str) -> list[str]:
    """Names of the folders directly under a folder URL ([] when there are none)."""
    fs, path = _bucket_path(url)
    fs.invalidate_cache(path)
    try:
        entries = fs.ls(path, detail=True)
    except FileNotFoundError:
        return []
    return sorted(e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e.get("type") == "directory")


def remove_url_tree(url: str) -> None:
    """Delete every object under a folder URL."""
    fs, path = _bucket_path(url)
    fs.rm(path, recursive=True)


def remove_url_files(url: str, names: list[str]) -> None:
    fs, path = _bucket_path(url)
    if names:
        fs.rm([f"{path}/{name}" for name in names])


def complete_steps(
    backend: RemoteBackend, stage: str, artifact_id: str, payload: dict[str, int] | None = None
) -> list[int]:
    """The checkpoint steps of an artifact on the bucket that were uploaded whole: their
    digests are there and so is every file they list, at its recorded size. Ascending."""
    payload = backend.payload(stage, artifact_id) if payload is None else payload
    steps = []
    for rel in payload:
        parts = rel.split("/")
        if len(parts) == 3 and parts[0] == CHECKPOINT_DIR and parts[1].isdigit() and parts[2] == STEP_DIGESTS:
            prefix = f"{CHECKPOINT_DIR}/{parts[1]}/"
            recorded = backend.read_json(backend.key(stage, artifact_id, rel)) or {}
            files = recorded.get("files") if isinstance(recorded.get("files"), dict) else None
            if files is not None and all(
                payload.get(prefix + name) == entry.get("size") for name, entry in files.items()
            ):
                steps.append(int(parts[1]))
    return sorted(steps)


def _stamp(path: Path) -> tuple[int, int]:
    """(size, mtime in ns) of a local file: what says it has not changed since it was sent."""
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns


class StepMirror:
    """Uploads a running stage's checkpoint steps to the bucket as Orbax commits them, so a
    run killed outright (SIGKILL, a lost machine) resumes elsewhere from its newest step.
    With `direct` (the engine writes its steps at the URL) it watches the steps there and
    uploads only the other files that changed, as each step commits.

    A thread polls `<local>/checkpoint/` every MIRROR_SECONDS. A step directory holding
    STEP_DIGESTS is committed and immutable: its files are uploaded, the digests last. With
    each new step, the other files that changed since (metrics.jsonl, TensorBoard events)
    follow, and steps that Orbax has removed locally (`checkpoint.keep`) are deleted on the
    bucket, older ones only: a newer step is always there first. Use as a context manager
    around the stage's work; `keep_going()` False (the lease was lost) stops the uploads.
    """

    def __init__(
        self,
        backend: RemoteBackend,
        stage: str,
        artifact_id: str,
        local: Path,
        log: Callable[[str], None] | None = None,
        keep_going: Callable[[], bool] = lambda: True,
        interval: float | None = None,
        direct: bool = False,
    ):
        self.backend, self.stage, self.artifact_id = backend, stage, artifact_id
        self.direct = direct
        """The engine writes the steps at the URL itself: watch them there, upload only the rest."""
        self.local = Path(local)
        self.log = log or (lambda _: None)
        self.keep_going = keep_going
        self.interval = MIRROR_SECONDS if interval is None else float(interval)
        self.uploaded: set[int] = set()
        self._sent: dict[str, tuple[int, int]] = {}
        self._step_files: dict[str, tuple[int, int]] = {}  # checkpoint files this mirror uploaded: (size, mtime)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False

    @property
    def url(self) -> str:
        return self.backend.url_of(self.stage, self.artifact_id)

    def __enter__(self) -> StepMirror:
        self._thread = threading.Thread(target=self._run, name="checkpoint-mirror", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *_) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.sync()
                self._failing = False
            except Exception as e:  # the bucket is unreachable for a moment: retried next tick
                if not self._failing:
                    self.log(f"could not upload checkpoint steps to {self.url} (retrying): {type(e).__name__}: {e}")
                self._failing = True

    def committed_steps(self) -> list[int]:
        directory = self.local / CHECKPOINT_DIR
        if not directory.is_dir():
            return []
        return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit() and (p / STEP_DIGESTS).is_file())

    def remote_steps(self) -> list[int]:
        """The steps the engine committed at the URL that this mirror has not seen yet (a step
        there is whole once its digests are): one LIST of the step folders, one HEAD of each
        new one's digests. Its cost does not grow with the checkpoint's objects."""
        prefix = self.backend.key(self.stage, self.artifact_id, CHECKPOINT_DIR)
        self.backend.fs.invalidate_cache(prefix)
        try:
            entries = self.backend.fs.ls(prefix, detail=True)
        except FileNotFoundError:
            return []
        names = (entry["name"].rstrip("/").rsplit("/", 1)[-1] for entry in entries if entry["type"] == "directory")
        candidates = sorted(int(name) for name in names if name.isdigit() and int(name) not in self.uploaded)
        committed = []
        for step in candidates:
            self.backend.fs.invalidate_cache(f"{prefix}/{step}")
            if self.backend.fs.exists(f"{prefix}/{step}/{STEP_DIGESTS}"):
                committed.append(step)
        return committed

    def sync(self) -> list[int]:
        """Upload the committed steps not on the bucket yet; returns them."""
        if not self.keep_going():
            return []
        committed = self.committed_steps()  # staged: a stage that writes its checkpoint locally
        new = [step for step in committed if step not in self.uploaded and self._upload_step(step)]
        if new:
            self.log(f"checkpoint step {new[-1]} uploaded to {self.url}")
        if self.direct:  # the engine's steps at the URL
            new = sorted({*new, *(step for step in self.remote_steps() if step not in self.uploaded)})
        if new:
            self.uploaded.update(new)
            self._upload_changed_files()
            if not self.direct:  # at the URL, Orbax deletes the steps it no longer keeps itself
                self._prune(set(committed))
        return new

    def _upload_step(self, step: int) -> bool:
        """Whether the step is now on the bucket whole (False: Orbax removed it meanwhile)."""
        rel_dir = f"{CHECKPOINT_DIR}/{step}"
        step_dir = self.local / rel_dir
        if not (step_dir / STEP_DIGESTS).is_file():
            return False
        prefix = self.backend.key(self.stage, self.artifact_id, rel_dir)
        try:
            remote = {
                key[len(prefix) + 1 :]: int(info.get("size") or 0)
                for key, info in self.backend.fs.find(prefix, detail=True).items()
            }
        except FileNotFoundError:
            remote = {}
        try:
            if STEP_DIGESTS in remote:  # committed there already (its digests go last): whole
                return True
            # A file already there counts only if this mirror sent it: a run killed while
            # uploading the step leaves files of the same size and other bytes (Orbax's
            # metadata carries a timestamp), which the digests uploaded after them would not match.
            files = [
                p
                for p in step_dir.rglob("*")
                if p.is_file()
                and (
                    remote.get(rel := p.relative_to(step_dir).as_posix()) != p.stat().st_size
                    or self._step_files.get(f"{rel_dir}/{rel}") != _stamp(p)
                )
            ]
            # The step's files concurrently (fsspec's batched put), then its digests, alone and last.
            first = [p for p in files if p.relative_to(step_dir).as_posix() != STEP_DIGESTS]
            if first:
                self.backend.fs.put(
                    [str(p) for p in first], [f"{prefix}/{p.relative_to(step_dir).as_posix()}" for p in first]
                )
                self._step_files.update({f"{rel_dir}/{p.relative_to(step_dir).as_posix()}": _stamp(p) for p in first})
            if len(first) < len(files):
                self.backend.fs.put_file(str(step_dir / STEP_DIGESTS), f"{prefix}/{STEP_DIGESTS}")
        except FileNotFoundError:  # removed meanwhile (`keep`): a newer step exists; never counted
            return False
        return True

    def _upload_changed_files(self) -> None:
        """The payload files outside checkpoint steps that changed since they were last sent."""
        for path in sorted(p for p in self.local.rglob("*") if p.is_file()):
            rel = path.relative_to(self.local).as_posix()
            parts = rel.split("/")
            if (
                (parts[0] == CHECKPOINT_DIR and len(parts) > 2)
                or rel in (MANIFEST, LEASE, ".lock")
                or rel.startswith(STAMPS)
                or rel.endswith((".tmp", ".part"))
            ):
                continue
            try:
                stat = path.stat()
                state = (stat.st_size, stat.st_mtime_ns)
                if self._sent.get(rel) != state:
                    self.backend.fs.put_file(str(path), self.backend.key(self.stage, self.artifact_id, rel))
                    self._sent[rel] = state
            except FileNotFoundError:
                pass

    def _prune(self, committed: set[int]) -> None:
        newest = max(self.uploaded)
        prefix = self.backend.key(self.stage, self.artifact_id, CHECKPOINT_DIR)
        self.backend.fs.invalidate_cache(prefix)
        try:
            entries = self.backend.fs.ls(prefix, detail=True)
        except FileNotFoundError:
            return
        for entry in entries:
            name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
            if entry["type"] == "directory" and name.isdigit() and int(name) < newest and int(name) not in committed:
                self.backend.fs.rm(entry["name"], recursive=True)
