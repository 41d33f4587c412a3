"""The policy's weights staged in a bucket for a rollout server on another host: the format,
the reader, and the loader that runs beside the server.

    python -m engine.interop.bucket_weights URL --server http://127.0.0.1:8000 --dir /dev/shm/policy

The trainer's side (engine/interop/weight_sync.py, with JAX) writes the Hugging Face tensors
of the policy at `URL` (s3://, gs:// or file://, through fsspec as every bucket path of the
engine: engine/data/urls.py):

    URL/manifest.json                 the committed version, written last (one PUT: atomic)
    URL/objects/<key>.safetensors     a shard: tensors in the export's order, at most
                                      `shard_bytes` each; key = hash of its tensors' digests
    URL/objects/<sha256>.json         config.json, generation_config.json, the shard index

Objects are content-addressed and never rewritten: a shard whose tensors did not change
(frozen layers, a LoRA run's base) keeps its key and is not uploaded again; the manifest
names, per local file name, the object it is and, per tensor, its sha256. A reader reads the
manifest once and then only immutable objects, so it never mixes two versions; what a killed
writer uploaded before its manifest is never named by one. The writer keeps the objects of
the last KEEP_VERSIONS versions, so a reader that is one version behind still finds its own.

The reader (`pull`) keeps a local directory the server can load as it is (the model's
file names, an index beside the shards): it fetches only the files whose object changed,
checks every tensor's digest before the file takes its name, and removes files the version
no longer has. The loader (`load`, and this module's command) then has the server reload
that directory with the endpoint the local path uses (POST /collective_rpc reload_weights,
then /reset_prefix_cache; vLLM's development API) and records the version with vLLM 0.32's
/update_weight_version, which the trainer polls (GET /weight_info) before it samples. vLLM
0.32's own weight-transfer engines (nccl, ipc, sparse nccl) need CUDA on both sides; this
path needs only a bucket both hosts reach.

No JAX here: the loader runs on the server's host with trainflow's base dependencies.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import struct
import sys
import threading
import time
from pathlib import Path
from typing import Any

from engine.config import ConfigError
from engine.data.urls import filesystem
from engine.interop.completions import CompletionsClient, RolloutServerError

FORMAT = "trainflow.bucket-weights/1"
MANIFEST = "manifest.json"
OBJECTS = "objects"
KEEP_VERSIONS = 2
LOCAL_STATE = ".bucket-weights.json"  # in the reader's directory: file name -> object key held
POLL_SECONDS = 0.2


def sync_url(url: str | os.PathLike) -> str:
    """A sync target as a URL (a local path as file://)."""
    text = str(url)
    return text.rstrip("/") if "://" in text else Path(text).absolute().as_uri()


def tensor_digest(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def shard_key(tensors: list[dict]) -> str:
    """A shard's object key: the hash of its tensors' names, dtypes, shapes and digests (the
    same tensors give the same key, whoever writes them and whenever)."""
    text = json.dumps([[t["name"], t["dtype"], t["shape"], t["sha256"]] for t in tensors], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32] + ".safetensors"


def read_manifest(url: str) -> dict | None:
    """The committed manifest at `url`, or None before the first commit."""
    fs, root = filesystem(sync_url(url))
    try:
        raw = fs.cat_file(f"{root}/{MANIFEST}")
    except FileNotFoundError:
        return None
    manifest = json.loads(raw)
    if manifest.get("format") != FORMAT:
        raise ConfigError(f"{url}/{MANIFEST}: format {manifest.get('format')!r}, this reader reads {FORMAT}")
    return manifest


def version_label(manifest: dict) -> str:
    """The name the server records a version under: its number and a digest of its manifest,
    so a server left with the same number by another run (another URL) does not pass for it."""
    digest = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()
    return f"{manifest['version']}-{digest[:12]}"


def put_atomic(fs: Any, key: str, data: bytes) -> None:
    """`data` at `key`, seen whole or not at all: one PUT on an object store, a rename locally."""
    if "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)):
        Path(key).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(f"{key}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, key)
    else:
        fs.pipe_file(key, data)


def check_shard(path: Path, expected: list[dict]) -> None:
    """The safetensors file at `path` holds exactly `expected` (names, dtypes, shapes, digests
    in order); else ConfigError. One read of the file."""
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
        header.pop("__metadata__", None)
        names = sorted(header, key=lambda n: header[n]["data_offsets"][0])
        if names != [t["name"] for t in expected]:
            raise ConfigError(f"{path.name}: holds tensors {names[:3]}..., the manifest names others")
        for t in expected:
            entry = header[t["name"]]
            start, end = entry["data_offsets"]
            f.seek(8 + length + start)
            data = f.read(end - start)
            if entry["dtype"] != t["dtype"] or entry["shape"] != t["shape"] or tensor_digest(data) != t["sha256"]:
                raise ConfigError(f"{path.name}: tensor {t['name']} is not the one the manifest names")


def pull(url: str, directory: str | os.PathLike, manifest: dict | None = None) -> dict:
    """The committed version at `url` as a loadable model directory at `directory`; fetches
    only files whose object differs from the one held. {version, fetched, fetched_bytes, files}."""
    url, directory = sync_url(url), Path(directory)
    manifest = manifest or read_manifest(url)
    if manifest is None:
        raise ConfigError(f"{url}: no weights committed yet ({MANIFEST} is missing)")
    fs, root = filesystem(url)
    directory.mkdir(parents=True, exist_ok=True)
    state_path = directory / LOCAL_STATE
    held = json.loads(state_path.read_text()) if state_path.is_file() else {}
    fetched, fetched_bytes = [], 0
    for name, entry in manifest["files"].items():
        target = directory / name
        if held.get(name) == entry["key"] and target.is_file():
            continue
        tmp = directory / f".{name}.{os.getpid()}.tmp"
        try:
            fs.get_file(f"{root}/{OBJECTS}/{entry['key']}", str(tmp))
            if "tensors" in entry:
                check_shard(tmp, [manifest["tensors"][n] | {"name": n} for n in entry["tensors"]])
            elif tensor_digest(tmp.read_bytes()) != entry["sha256"]:
                raise ConfigError(f"{url}/{OBJECTS}/{entry['key']}: not the {name} the manifest names")
            fetched_bytes += tmp.stat().st_size
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
        held[name] = entry["key"]
        fetched.append(name)
    for name in sorted(set(held) - set(manifest["files"])):  # a file this version does not have
        (directory / name).unlink(missing_ok=True)
        del held[name]
    state_path.write_text(json.dumps(held, indent=1, sort_keys=True))
    return {
        "version": manifest["version"],
        "fetched": fetched,
        "fetched_bytes": fetched_bytes,
        "files": len(manifest["files"]),
    }


def load(url: str, directory: str | os.PathLike, client: CompletionsClient, manifest: dict | None = None) -> dict:
    """Pull the committed version into `directory` and have the server at `client` reload it
    in place (the local path's endpoints), then record its version_label there; pull's summary."""
    manifest = manifest or read_manifest(url)
    pulled = pull(url, directory, manifest)  # none committed: ConfigError
    assert manifest is not None
    client.request("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(directory)}})
    client.request("/reset_prefix_cache", {})
    client.request("/update_weight_version", {"new_version": version_label(manifest)})
    return pulled


def served_version(client: CompletionsClient) -> str | None:
    """The weight version the server last recorded (vLLM 0.32's GET /weight_info)."""
    return (client.request("/weight_info") or {}).get("weight_version")


def wait_for_version(client: CompletionsClient, manifest: dict, timeout_seconds: float) -> float:
    """Wait until the server has loaded the version of `manifest` (its loader recorded its
    version_label); seconds waited."""
    start, version = time.monotonic(), manifest["version"]
    while served_version(client) != version_label(manifest):
        if time.monotonic() - start > timeout_seconds:
            raise RolloutServerError(
                f"the rollout server at {client.url} did not load weight version {version} within "
                f"{timeout_seconds:.0f} s; is `python -m engine.interop.bucket_weights` running beside it?"
            )
        time.sleep(POLL_SECONDS)
    return time.monotonic() - start


def follow(
    url: str,
    directory: str | os.PathLike,
    client: CompletionsClient,
    *,
    once: bool = False,
    log=print,
    stop: threading.Event | None = None,
):
    """The loader's loop: each newly committed version at `url` loaded into the server, until
    `stop` is set (a loader in a thread)."""
    loaded = None
    while stop is None or not stop.is_set():
        manifest = read_manifest(url)
        if manifest is not None and manifest["version"] != loaded:
            start = time.perf_counter()
            try:
                pulled = load(url, directory, client, manifest)
            except FileNotFoundError:  # the writer moved two versions on while we read: read again
                continue
            loaded = manifest["version"]
            log(
                f"bucket_weights: version {loaded}: {len(pulled['fetched'])} of {pulled['files']} files "
                f"({pulled['fetched_bytes'] / 2**20:.1f} MiB) fetched, loaded in {time.perf_counter() - start:.2f} s"
            )
            if once:
                return pulled
        time.sleep(POLL_SECONDS)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.interop.bucket_weights", description=__doc__.split("\n")[0])
    parser.add_argument("url", help="where the trainer stages the weights (rollout.weights_url)")
    parser.add_argument("--server", default="http://127.0.0.1:8000", help="the vLLM server's base URL")
    parser.add_argument("--dir", required=True, help="the local directory the server reloads from")
    parser.add_argument("--once", action="store_true", help="load the committed version and exit")
    args = parser.parse_args(argv)
    try:
        follow(args.url, args.dir, CompletionsClient(args.server), once=args.once)
    except (ConfigError, RolloutServerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
