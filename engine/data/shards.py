"""Token shards on disk: the format the tokenize stage writes and training reads.

Shard format (`trainflow.tokens/1`), written by the tokenize stage:

    <dataset>/meta.json                    format, dtype, vocab_size, special ids, per-split
                                           stats, shards and their record counts
    <dataset>/<split>/shard-00000.array_record   one record per document: little-endian
                                                 int32 token ids, special tokens included

ArrayRecord gives random access, so Grain (engine/data/pipeline.py) can shuffle globally
with a seed and a checkpoint of the iterator is a few integers. A dataset at a bucket URL is
read in place: meta.json by every process, each shard copied into the host's cache when a
record of it is first read (`ShardSource`; engine/data/urls.py). This module does not import
Grain or JAX: writers and pipeline validation stay light.
"""

from __future__ import annotations

import bisect
import itertools
import json
import os
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
from array_record.python.array_record_module import ArrayRecordReader, ArrayRecordWriter

from engine.config import ConfigError
from engine.data import urls

FORMAT = "trainflow.tokens/1"
TOKEN_DTYPE = np.dtype("<i4")


# --------------------------------------------------------------------------- writing


class ShardWriter:
    """Writes one shard atomically: records go to `<path>.tmp`, renamed on close."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = self.path.with_name(self.path.name + ".tmp")
        self._writer = ArrayRecordWriter(str(self._tmp), "group_size:1")
        self.documents = 0
        self.tokens = 0

    def write(self, token_ids: Iterable[int] | np.ndarray) -> None:
        arr = np.asarray(token_ids, dtype=TOKEN_DTYPE)
        assert arr.ndim == 1
        self._writer.write(arr.tobytes())
        self.documents += 1
        self.tokens += int(arr.size)

    def close(self) -> None:
        self._writer.close()
        os.replace(self._tmp, self.path)

    def abort(self) -> None:
        self._writer.close()
        self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, *_) -> None:
        self.abort() if exc_type else self.close()


def write_meta(dataset_dir: str | Path, meta: dict[str, Any]) -> None:
    """meta.json, written atomically. `meta` needs vocab_size and splits.{name}.shards."""
    meta = {"format": FORMAT, "dtype": "int32", **meta}
    path = Path(dataset_dir) / "meta.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(meta, indent=2))
    os.replace(tmp, path)


def write_dataset(
    dataset_dir: str | Path, splits: dict[str, list[np.ndarray]], vocab_size: int, docs_per_shard: int = 10_000, **extra
) -> dict:
    """A small convenience writer (tests, synthetic data): documents per split -> shards."""
    dataset_dir = Path(dataset_dir)
    meta_splits = {}
    for split, docs in splits.items():
        shards: list[str] = []
        counts: list[int] = []
        tokens = 0
        for start in range(0, max(len(docs), 1), docs_per_shard):
            rel = f"{split}/shard-{len(shards):05d}.array_record"
            with ShardWriter(dataset_dir / rel) as w:
                for doc in docs[start : start + docs_per_shard]:
                    w.write(doc)
            shards.append(rel)
            counts.append(w.documents)
            tokens += w.tokens
        meta_splits[split] = {"shards": shards, "shard_documents": counts, "documents": len(docs), "tokens": tokens}
    meta = {"vocab_size": vocab_size, "splits": meta_splits, **extra}
    write_meta(dataset_dir, meta)
    return meta


# --------------------------------------------------------------------------- reading


def read_meta(dataset_dir: str | Path) -> dict:
    """meta.json of a dataset folder, local or at a bucket URL (engine/data/urls.py)."""
    path = urls.join(dataset_dir, "meta.json")
    if not urls.exists(path):
        raise ConfigError(f"data.path: no token dataset at {dataset_dir} (missing meta.json)")
    meta = json.loads(urls.read_text(path))
    if meta.get("format") != FORMAT:
        raise ConfigError(f"{path}: format {meta.get('format')!r} is not {FORMAT!r}")
    return meta


def _split(dataset_dir: str | Path, split: str) -> dict:
    meta = read_meta(dataset_dir)
    if split not in meta["splits"]:
        raise ConfigError(f"data.path: dataset {dataset_dir} has no split '{split}' (has: {', '.join(meta['splits'])})")
    return meta["splits"][split]


def shard_paths(dataset_dir: str | Path, split: str) -> list[str]:
    """The split's shards: local paths, or URLs (each checked to be there by one listing)."""
    entry = _split(dataset_dir, split)
    paths = [urls.join(dataset_dir, rel) for rel in entry["shards"]]
    if urls.is_url(dataset_dir):
        present = {url for folder in {urls.parent(p) for p in paths} for url in urls.list_files(folder)}
    else:
        present = {p for p in paths if Path(p).is_file()}
    for p in paths:
        if p not in present:
            raise ConfigError(f"data.path: shard listed in meta.json is missing: {p}")
    return paths


def record_count(path: str | Path) -> int:
    reader = ArrayRecordReader(str(path))
    try:
        return int(reader.num_records())
    finally:
        reader.close()


class ShardSource:
    """A split's records by global index, over shards that may lie at a bucket URL: a random-
    access data source for Grain (`len`, `[i]`, `__getitems__`). A shard at a URL is copied
    into this host's cache the first time one of its records is read, so a stage starts
    after reading meta.json, not the dataset; with the shards' record counts in meta.json
    (`shard_documents`, written by the tokenize stage) no shard is opened to count it."""

    def __init__(self, paths: list[str], counts: list[int] | None = None):
        self._open(paths, counts)

    def _open(self, paths: list[str], counts: list[int] | None) -> None:
        self.paths = list(paths)
        if counts is None or len(counts) != len(self.paths):
            counts = [record_count(self._local(i)) for i in range(len(self.paths))]
        self.counts = [int(c) for c in counts]
        self.starts = list(itertools.accumulate(self.counts, initial=0))
        self._readers: dict[int, ArrayRecordReader] = {}
        self._lock = threading.Lock()

    def _local(self, shard: int) -> str:
        path = self.paths[shard]
        return str(urls.local_file(path)) if urls.is_url(path) else path

    def _reader(self, shard: int) -> ArrayRecordReader:
        reader = self._readers.get(shard)
        if reader is None:
            with self._lock:
                reader = self._readers.get(shard)
                if reader is None:
                    reader = ArrayRecordReader(self._local(shard), "readahead_buffer_size:0")
                    self._readers[shard] = reader
        return reader

    def __len__(self) -> int:
        return self.starts[-1]

    def _locate(self, index: int) -> tuple[int, int]:
        index = int(index)
        if not 0 <= index < len(self):
            raise IndexError(f"record {index} of {len(self)}")
        shard = bisect.bisect_right(self.starts, index) - 1
        return shard, index - self.starts[shard]

    def __getitem__(self, index: int) -> bytes:
        shard, position = self._locate(index)
        return self._reader(shard).read([position])[0]

    def __getitems__(self, indices) -> list[bytes]:
        return [self[i] for i in indices]

    def __getstate__(self) -> dict:
        return {"paths": self.paths, "counts": self.counts}

    def __setstate__(self, state: dict) -> None:
        self._open(state["paths"], state["counts"])

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()


def open_split(dataset_dir: str | Path, split: str) -> ShardSource:
    """The records of one split of a token dataset, local or at a bucket URL."""
    entry = _split(dataset_dir, split)
    return ShardSource(shard_paths(dataset_dir, split), entry.get("shard_documents"))
