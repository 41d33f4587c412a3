"""Artifact stores on object storage (s3://, gs://) through fsspec, with a local staging copy.

Design (docs/pipelines.md, "Object storage"): a stage never writes to the bucket directly.
Every artifact has a local staging directory, `<cache>/<stage>/<id>/` (the same layout as a
local store), and the runner moves bytes between it and the bucket:

- before a stage runs, its inputs are downloaded into the cache (a complete artifact's
  files are kept there, content-addressed by id, and re-hashed against the manifest), and a
  partial artifact of the stage itself is downloaded so the engine resumes from its
  checkpoints;
- when the stage ends, the payload files are uploaded, then the manifest, last (a single
  PUT is atomic on S3 and GCS: readers see the old manifest or the new one);
- a stage that fails or is interrupted uploads what it has (its partial payload) with a
  `failed` manifest, so another machine resumes from there.

Locks are lease objects `<artifact>/.lease` written with a conditional create
(`If-None-Match: *` on S3), renewed by a thread while the stage runs and taken over only
after they expire. Credentials and endpoints come from the environment (AWS_ENDPOINT_URL,
AWS_ACCESS_KEY_ID, ... ; the libraries' own config files), never from a pipeline file.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fsspec

from engine.contract import MANIFEST

LEASE = ".lease"
LEASE_SECONDS = float(os.environ.get("TRAINFLOW_LEASE_SECONDS", "60"))
DEFAULT_CACHE_BYTES = 20 << 30


class StoreAccessError(RuntimeError):
    """The bucket behind a store URL cannot be used (missing, no credentials, no permission)."""


def is_url(root: str) -> bool:
    return "://" in root and not root.startswith("file://")


def _filesystem(url: str):
    protocol = url.split("://", 1)[0]
    try:
        return fsspec.filesystem(protocol, **_options(protocol))
    except (ImportError, ValueError) as e:
        extra = {"s3": "s3", "gs": "gcs", "gcs": "gcs"}.get(protocol, protocol)
        raise StoreAccessError(f"artifact store {url}: the {protocol}:// file system is not installed "
                               f"(pip install 'trainflow[{extra}]'): {e}") from None


def _options(protocol: str) -> dict:
    if protocol == "s3":
        # botocore reads AWS_ENDPOINT_URL itself; passing it also covers older releases.
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        return {"client_kwargs": {"endpoint_url": endpoint}} if endpoint else {}
    return {}


def _cache_root(url: str) -> Path:
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
        self.cache = _cache_root(self.url)
        self.cache_bytes = int(os.environ.get("TRAINFLOW_CACHE_BYTES", DEFAULT_CACHE_BYTES))
        self.check()

    # ------------------------------------------------------------------ access

    def check(self) -> None:
        """One sentence naming the URL when the bucket cannot be used; before any compute."""
        try:
            self.fs.ls(self.bucket, refresh=True)
        except FileNotFoundError:
            raise StoreAccessError(f"artifact store {self.url}: bucket '{self.bucket}' does not exist "
                                   f"(or the endpoint does not serve it)") from None
        except PermissionError:
            raise StoreAccessError(f"artifact store {self.url}: permission denied listing bucket "
                                   f"'{self.bucket}' with the credentials in this environment") from None
        except Exception as e:  # botocore's NoCredentialsError, connection errors, ...
            name = type(e).__name__
            if "Credential" in name or "credential" in str(e):
                raise StoreAccessError(f"artifact store {self.url}: no credentials found for {self.protocol}:// "
                                       f"(set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or a profile)") from None
            raise StoreAccessError(f"artifact store {self.url}: cannot reach the bucket: {name}: {e}") from None

    def key(self, stage: str, artifact_id: str, rel: str = "") -> str:
        path = f"{self.base}/{stage}/{artifact_id}"
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
        self.fs.pipe_file(self.key(stage, artifact_id, MANIFEST),
                          (json.dumps(manifest, indent=2, default=str) + "\n").encode())

    def exists(self, stage: str, artifact_id: str) -> bool:
        return bool(self.payload(stage, artifact_id)) or self.read_manifest(stage, artifact_id) is not None

    def payload(self, stage: str, artifact_id: str) -> dict[str, int]:
        """relative path -> size of every payload object of an artifact (no manifest, no lease)."""
        prefix = self.key(stage, artifact_id)
        self.fs.invalidate_cache()  # all of it: s3fs keeps subdirectories' listings (ETags) apart
        try:
            found = self.fs.find(prefix, detail=True)
        except FileNotFoundError:
            return {}
        out = {}
        for key, info in found.items():
            rel = key[len(prefix) + 1:]
            if rel and rel not in (MANIFEST, LEASE) and info.get("type", "file") == "file":
                out[rel] = int(info.get("size") or 0)
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

    def upload(self, local: Path, stage: str, artifact_id: str, skip: tuple[str, ...] = ()) -> int:
        """Upload every payload file of a local staging directory whose remote copy differs in
        size (checkpoint steps are immutable once committed); returns the number uploaded."""
        remote = self.payload(stage, artifact_id)
        count = 0
        for path in sorted(p for p in local.rglob("*") if p.is_file()):
            rel = path.relative_to(local).as_posix()
            if rel in (MANIFEST, LEASE, ".lock", MANIFEST + ".tmp") or rel in skip:
                continue
            if remote.get(rel) == path.stat().st_size and not rel.endswith((".jsonl", ".json", ".md")):
                continue
            self.fs.put_file(str(path), self.key(stage, artifact_id, rel))
            count += 1
        return count

    def download(self, stage: str, artifact_id: str, local: Path, with_manifest: bool = True) -> int:
        """Fetch the artifact's payload objects missing (or of another size) locally."""
        local.mkdir(parents=True, exist_ok=True)
        count = 0
        for rel, size in sorted(self.payload(stage, artifact_id).items()):
            target = local / rel
            if target.is_file() and target.stat().st_size == size:
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(target.name + ".part")
            self.fs.get_file(self.key(stage, artifact_id, rel), str(tmp))
            os.replace(tmp, target)
            count += 1
        if with_manifest:
            manifest = self.read_manifest(stage, artifact_id)
            if manifest is not None:
                (local / MANIFEST).write_text(json.dumps(manifest, indent=2, default=str) + "\n")
        return count

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


class LeaseHeld(RuntimeError):
    pass


class Lease:
    """A lease object created with a conditional create, renewed by a thread while held."""

    def __init__(self, backend: RemoteBackend, key: str, run_id: str | None = None,
                 seconds: float | None = None):
        self.backend = backend
        self.key = key
        self.seconds = float(seconds if seconds is not None else LEASE_SECONDS)
        self.token = uuid.uuid4().hex
        self.run_id = run_id
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost = False

    @property
    def url(self) -> str:
        return f"{self.backend.protocol}://{self.key}"

    def _body(self) -> bytes:
        return json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "run_id": self.run_id,
                           "token": self.token, "expires": time.time() + self.seconds}).encode()

    def _client_put(self, body: bytes, if_none_match: bool) -> bool:
        """PUT the lease; with if_none_match, only if no object exists (False when one does)."""
        if self.backend.protocol != "s3":  # other backends: exclusive create where fsspec has it
            try:
                with self.backend.fs.open(self.key, "xb" if if_none_match else "wb") as f:
                    f.write(body)
                return True
            except FileExistsError:
                return False
        import botocore.exceptions

        bucket, key = self.key.split("/", 1)
        client = _boto_client()
        kwargs = {"IfNoneMatch": "*"} if if_none_match else {}
        try:
            client.put_object(Bucket=bucket, Key=key, Body=body, **kwargs)
            return True
        except botocore.exceptions.ClientError as e:
            code = e.response.get("Error", {}).get("Code")
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412):
                return False
            raise

    def holder(self) -> dict | None:
        self.backend.fs.invalidate_cache(self.key)
        return self.backend.read_json(self.key)

    def try_acquire(self) -> bool:
        if self._client_put(self._body(), if_none_match=True):
            return True
        info = self.holder()
        if info is None:  # released between our PUT and our read
            return self._client_put(self._body(), if_none_match=True)
        if float(info.get("expires", 0)) < time.time():  # expired: take it over
            try:
                self.backend.fs.rm_file(self.key)
            except FileNotFoundError:
                pass
            return self._client_put(self._body(), if_none_match=True)
        return False

    def acquire(self, blocking: bool = True, poll_seconds: float = 2.0,
                on_wait: Callable[[str], None] | None = None, wait_message_every: float = 30.0) -> bool:
        last = -float("inf")
        while not self.try_acquire():
            if not blocking:
                return False
            if on_wait and time.monotonic() - last >= wait_message_every:
                on_wait(f"waiting for {self.url.removesuffix('/' + LEASE)}: leased by {describe(self.holder())}")
                last = time.monotonic()
            time.sleep(poll_seconds)
        self._thread = threading.Thread(target=self._renew, name="lease-renew", daemon=True)
        self._thread.start()
        return True

    def _renew(self) -> None:
        while not self._stop.wait(self.seconds / 3):
            info = self.holder()
            if not info or info.get("token") != self.token:
                self.lost = True  # taken over: our run was presumed dead
                return
            try:
                self._client_put(self._body(), if_none_match=False)
            except Exception:
                pass  # retried at the next tick; the lease lasts 3 ticks

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
            info = self.holder()
            if info and info.get("token") == self.token:
                try:
                    self.backend.fs.rm_file(self.key)
                except FileNotFoundError:
                    pass

    def is_held(self) -> bool:
        info = self.holder()
        return bool(info) and float(info.get("expires", 0)) >= time.time()


def describe(info: dict | None) -> str:
    if not info:
        return "another run"
    left = float(info.get("expires", 0)) - time.time()
    return (f"pid {info.get('pid')} on {info.get('host')} (run {info.get('run_id') or '?'}), "
            f"lease expires in {max(left, 0):.0f}s")


_CLIENT = None


def _boto_client():
    global _CLIENT
    if _CLIENT is None:
        import boto3

        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        _CLIENT = boto3.client("s3", endpoint_url=endpoint)
    return _CLIENT
