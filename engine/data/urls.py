"""The engine's inputs at a bucket URL (s3://, gs://), read by every process itself.

On a bucket store (tasks/store/bucket.py) a stage hands its engine URLs, not the runner's
staging paths: the config, the tokenizer, JSONL data and token shards are read where they
live, so the ranks of a multi-host stage need no shared filesystem. What is small is read
straight into memory (`read_text`, `list_files`); what a library must open as a local file
(a tokenizer folder, an ArrayRecord shard: ArrayRecord has no S3 reader) is copied into this
host's cache the first time it is read, under a name made of its URL and its object version
(S3's ETag, GCS's generation), so a copy is reused across stages and processes of one host
and a rewritten object is fetched again. Copies land under a temporary name, renamed when
whole: a process killed mid-copy leaves nothing that looks complete.

The host cache is `$TRAINFLOW_ENGINE_CACHE`, else `trainflow-inputs` in the temporary
directory. This module does not import JAX.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import fsspec

from engine.config import ConfigError
from engine.contract import CHECKPOINT_URL_SCHEMES

CACHE_ENV = "TRAINFLOW_ENGINE_CACHE"


def is_url(path: str | os.PathLike) -> bool:
    """Whether the engine reads (and writes) `path` at a bucket URL itself (gs://, s3://), rather
    than as a local path. The engine's one test of it (tasks/store/urls.py asks another question:
    whether a store is reached through fsspec, memory:// included)."""
    return str(path).startswith(CHECKPOINT_URL_SCHEMES)


def join(base: str | os.PathLike, *parts: str) -> str:
    """`base/part/...` for a URL or a local path (Path would fold `s3://` into `s3:/`)."""
    if is_url(base):
        return "/".join([str(base).rstrip("/"), *parts])
    return str(Path(base, *parts))


def parent(path: str | os.PathLike) -> str:
    if is_url(path):
        return str(path).rstrip("/").rsplit("/", 1)[0]
    return str(Path(path).parent)


def filesystem(url: str) -> tuple[Any, str]:
    """The fsspec file system of a URL and the path it takes there ("bucket/key")."""
    protocol, _, path = url.partition("://")
    options: dict = {}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if protocol == "s3" and endpoint:  # botocore reads it too; older releases need it passed
        options = {"client_kwargs": {"endpoint_url": endpoint}}
    try:
        return fsspec.filesystem(protocol, **options), path.rstrip("/")
    except (ImportError, ValueError) as e:
        raise ConfigError(f"{url}: the {protocol}:// file system is not installed: {e}") from None


def _info(fs: Any, path: str, url: str) -> dict:
    try:
        return fs.info(path)
    except FileNotFoundError:
        raise ConfigError(f"{url}: no such object") from None
    except PermissionError:
        raise ConfigError(f"{url}: permission denied with the credentials in this environment") from None


def version(entry: dict) -> str:
    """An fsspec entry's object version: the ETag on S3, the generation on GCS, else the size."""
    for key in ("ETag", "etag", "generation", "md5Hash"):
        if entry.get(key):
            return str(entry[key]).strip('"')
    return str(entry.get("size"))


def exists(path: str | os.PathLike) -> bool:
    if not is_url(path):
        return Path(path).exists()
    fs, key = filesystem(str(path))
    return bool(fs.exists(key))


def read_text(path: str | os.PathLike) -> str:
    """A small file's text, local or at a URL."""
    if not is_url(path):
        return Path(path).read_text(encoding="utf-8")
    fs, key = filesystem(str(path))
    _info(fs, key, str(path))
    with fs.open(key, "rb") as f:
        return f.read().decode("utf-8")


def list_files(directory: str, suffix: str = "") -> list[str]:
    """URLs of the files directly in a folder URL whose names end with `suffix`, sorted."""
    fs, key = filesystem(directory)
    try:
        entries = fs.ls(key, detail=True, refresh=True)
    except FileNotFoundError:
        return []
    scheme = directory.split("://", 1)[0]
    return sorted(f"{scheme}://{e['name']}" for e in entries if e.get("type") == "file" and e["name"].endswith(suffix))


def host_cache() -> Path:
    root = os.environ.get(CACHE_ENV) or str(Path(tempfile.gettempdir()) / "trainflow-inputs")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _cache_name(url: str, entry: dict) -> str:
    digest = hashlib.sha256(f"{url}\0{version(entry)}\0{entry.get('size')}".encode()).hexdigest()[:24]
    name = re.sub(r"[^A-Za-z0-9._-]", "_", url.rsplit("/", 1)[-1])[-64:]
    return f"{digest}-{name}"


def _copy(fs: Any, key: str, entry: dict, target: Path) -> Path:
    if target.is_file() and target.stat().st_size == entry.get("size"):
        return target
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        fs.get_file(key, str(tmp))
        size = tmp.stat().st_size
        if entry.get("size") is not None and size != entry["size"]:
            raise ConfigError(f"{fs.protocol}://{key}: read {size} bytes, the object has {entry['size']}")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def local_file(url: str) -> Path:
    """A file at a URL as a local file of this host's cache (fetched the first time)."""
    fs, key = filesystem(url)
    entry = _info(fs, key, url)
    return _copy(fs, key, entry, host_cache() / _cache_name(url, entry))


def local_folder(directory: str | os.PathLike) -> Path:
    """A folder of small files (a tokenizer) as a local directory: itself, or for a URL this
    host's cached copy of its files (one listing decides whether the copy is current)."""
    if not is_url(directory):
        return Path(directory)
    url = str(directory).rstrip("/")
    fs, key = filesystem(url)
    try:
        entries = [e for e in fs.ls(key, detail=True, refresh=True) if e.get("type") == "file"]
    except FileNotFoundError:
        entries = []
    if not entries:
        raise ConfigError(f"{url}: no files in this folder")
    signature = hashlib.sha256(
        "\n".join(
            f"{e['name']}\0{version(e)}\0{e.get('size')}" for e in sorted(entries, key=lambda e: e["name"])
        ).encode()
    ).hexdigest()[:24]
    target = host_cache() / f"{signature}-{re.sub(r'[^A-Za-z0-9._-]', '_', url.rsplit('/', 1)[-1])}"
    if target.is_dir():
        return target
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=host_cache()))
    try:
        for entry in entries:
            _copy(fs, entry["name"], entry, staging / entry["name"].rsplit("/", 1)[-1])
        try:
            os.replace(staging, target)
        except OSError:  # another process finished the same copy first
            if not target.is_dir():
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target


def existing_folder(directory: str | os.PathLike) -> Path | None:
    """`local_folder(directory)` when it is a folder (at a URL: one with files), else None."""
    try:
        path = local_folder(directory)
    except ConfigError:  # no files at the URL
        return None
    return path if path.is_dir() else None
