"""The trainer's side of the bucket weight sync: a version of the policy's Hugging Face tensors
written at a URL, only the shards whose tensors changed (format and reader:
engine/interop/bucket_weights.py).

A trainer of N processes (jax.distributed): the shards are planned from the tensors' names,
shapes and dtypes alone, so every process plans the same ones, and shard k is built, hashed and
uploaded by process k mod N only. A parameter sharded across processes is gathered first
(engine/parallel/mesh.py, to_host: every process gets the whole array over the trainer's own
interconnect); the upload, the part that crosses to the bucket, is split N ways. The
processes then exchange their shards' tensor digests (one process_allgather, which every
process enters only after its uploads: the barrier), and process 0 writes the small files and
the manifest, last.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils

from engine.data.urls import filesystem
from engine.interop.bucket_weights import (
    FORMAT,
    KEEP_VERSIONS,
    MANIFEST,
    OBJECTS,
    put_atomic,
    read_manifest,
    shard_key,
    sync_url,
    tensor_digest,
)
from engine.interop.hf.export import _plan_shards, hf_config_files, hf_tensors
from engine.interop.hf.mapping import model_config_to_hf
from engine.interop.hf.safetensors_io import DTYPES, NAMES, write_safetensors
from engine.models.config import ComputeConfig, ModelConfig
from engine.parallel.mesh import to_host

SHARD_BYTES = 64 << 20
"""A shard's bound: small enough that a LoRA or partly frozen model rewrites little, large
enough that a bucket's per-object cost does not dominate."""


# A shard is written here before its upload: memory (/dev/shm) where there is one.
SCRATCH = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


class BucketWeightSync:
    """Versions of a model's weights at `url`; `push(params)` writes one and returns its number."""

    def __init__(
        self,
        url: str,
        model_cfg: ModelConfig,
        compute: ComputeConfig,
        hf_meta: dict | None = None,
        *,
        shard_bytes: int = SHARD_BYTES,
    ):
        self.url = sync_url(url)
        self.fs, self.root = filesystem(self.url)
        self.model_cfg, self.compute, self.hf_meta = model_cfg, compute, hf_meta or {}
        self.shard_bytes = shard_bytes
        self.fs.makedirs(f"{self.root}/{OBJECTS}", exist_ok=True)  # a local target's folder; no-op in a bucket
        committed = read_manifest(self.url)  # a restarted trainer continues its versions
        self.version = committed["version"] if committed else 0
        self.history: list[dict] = [committed] if committed else []  # the last KEEP_VERSIONS manifests
        self.last: dict = {}  # stats of the last push

    def stage(self, params) -> dict:
        """Upload this process's changed shards of `params`; the manifest to commit (every
        process returns it). Nothing a reader reads changes until `commit`."""
        start = time.perf_counter()
        # A collective where params span processes; numpy leaves (a host tree) as they are.
        host = jax.tree.map(lambda x: to_host(x) if isinstance(x, jax.Array) else np.asarray(x), params)
        tensors = hf_tensors(host, self.model_cfg, self.compute)
        sizes = [(name, int(np.prod(shape)) * dtype.itemsize) for name, (shape, dtype, _) in tensors.items()]
        shards = _plan_shards(sizes, self.shard_bytes)
        names = list(tensors)
        position = {name: i for i, name in enumerate(names)}
        known = {e["key"] for m in self.history for e in m["files"].values()}
        process, processes = jax.process_index(), jax.process_count()
        digests = np.zeros((len(names), 32), np.uint8)
        uploaded = np.zeros(len(shards), np.int64)  # bytes this process wrote, per shard
        with tempfile.TemporaryDirectory(prefix="trainflow-weight-sync-", dir=SCRATCH) as scratch:
            for k, shard in enumerate(shards):
                if k % processes != process:
                    continue
                arrays = [(name, tensors[name][2]()) for name in shard]
                entries = []
                for name, array in arrays:
                    raw = np.ascontiguousarray(array).reshape(-1).view(np.uint8).data
                    digests[position[name]] = np.frombuffer(bytes.fromhex(tensor_digest(raw)), np.uint8)
                    entries.append(self._entry(name, array.shape, array.dtype, digests[position[name]]))
                key = shard_key(entries)
                if key in known:
                    continue
                local = Path(scratch, key)
                uploaded[k] = write_safetensors(local, arrays, metadata={"format": "pt"})
                self.fs.put_file(str(local), f"{self.root}/{OBJECTS}/{key}")
                local.unlink()
        if processes > 1:  # every process enters after its uploads: a barrier, and the digests
            digests = np.asarray(multihost_utils.process_allgather(digests)).max(axis=0).astype(np.uint8)
            uploaded = np.asarray(multihost_utils.process_allgather(uploaded)).sum(axis=0)
        manifest_tensors, files = {}, {}
        for k, shard in enumerate(shards):
            entries = [self._entry(n, tensors[n][0], tensors[n][1], digests[position[n]]) for n in shard]
            files[shard_filename(k, len(shards))] = {
                "key": shard_key(entries),
                "tensors": shard,
                "writer": k % processes,
            }
            manifest_tensors.update({e.pop("name"): e for e in entries})
        self.last = {
            "shards": len(shards),
            "shards_written": int((uploaded > 0).sum()),
            "bytes_written": int(uploaded.sum()),
            "bytes": sum(size for _, size in sizes),
            "stage_seconds": time.perf_counter() - start,
        }
        return {
            "format": FORMAT,
            "version": self.version + 1,
            "files": files,
            "tensors": manifest_tensors,
            "processes": processes,
        }

    def commit(self, manifest: dict) -> int:
        """The small files' entries (every process: all hold the same manifest), then on
        process 0 their objects, the manifest (the version exists from here on) and the removal
        of the objects no kept version names. Returns the version."""
        hf_config = model_config_to_hf(
            self.model_cfg, self.hf_meta.get("token_ids") or {}, param_dtype=self.compute.param_dtype
        )
        small = hf_config_files(hf_config, self.hf_meta)
        shards = [(name, e) for name, e in manifest["files"].items() if "tensors" in e]
        if len(shards) > 1:
            weight_map = {t: name for name, e in shards for t in e["tensors"]}
            total = sum(_nbytes(manifest["tensors"][t]) for t in weight_map)
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            small["model.safetensors.index.json"] = json.dumps(index, indent=2) + "\n"
        for name, text in small.items():
            data = text.encode()
            key = tensor_digest(data)[:32] + ".json"
            manifest["files"][name] = {"key": key, "sha256": tensor_digest(data)}
            if jax.process_index() == 0 and not self.fs.exists(f"{self.root}/{OBJECTS}/{key}"):
                put_atomic(self.fs, f"{self.root}/{OBJECTS}/{key}", data)
        if jax.process_index() == 0:
            put_atomic(self.fs, f"{self.root}/{MANIFEST}", json.dumps(manifest, indent=1).encode())
            self._collect(manifest)
        self.history = [*self.history, manifest][-KEEP_VERSIONS:]
        self.version = manifest["version"]
        return self.version

    def push(self, params) -> int:
        """A new version of `params` at the URL: stage, then commit; its number."""
        return self.commit(self.stage(params))

    def _collect(self, manifest: dict) -> None:
        """Delete the objects of versions older than the kept ones (that no kept one names)."""
        if len(self.history) < KEEP_VERSIONS:
            return
        dropped = self.history[0]
        kept = {e["key"] for m in (*self.history[1:], manifest) for e in m["files"].values()}
        for entry in dropped["files"].values():
            if entry["key"] not in kept:
                try:
                    self.fs.rm_file(f"{self.root}/{OBJECTS}/{entry['key']}")
                except FileNotFoundError:
                    pass

    @staticmethod
    def _entry(name: str, shape, dtype, digest: np.ndarray) -> dict:
        return {"name": name, "dtype": NAMES[np.dtype(dtype)], "shape": list(shape), "sha256": bytes(digest).hex()}


def shard_filename(k: int, count: int) -> str:
    """Shard k's file name as the exporter names it (transformers' names)."""
    return "model.safetensors" if count == 1 else f"model-{k + 1:05d}-of-{count:05d}.safetensors"


def _nbytes(tensor: dict) -> int:
    return int(np.prod(tensor["shape"], dtype=np.int64)) * DTYPES[tensor["dtype"]].itemsize
