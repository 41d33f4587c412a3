"""Token shards on disk: the format the tokenize stage writes and training reads.

Shard format (`trainflow.tokens/1`), written by the tokenize stage:

    <dataset>/meta.json                    format, dtype, vocab_size, special ids, per-split stats
    <dataset>/<split>/shard-00000.array_record   one record per document: little-endian
                                                 int32 token ids, special tokens included

ArrayRecord gives random access, so Grain (engine/data/pipeline.py) can shuffle globally
with a seed and a checkpoint of the iterator is a few integers. This module does not import
Grain or JAX: writers and pipeline validation stay light.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
from array_record.python.array_record_module import ArrayRecordWriter

from engine.config import ConfigError

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
        shards, tokens = [], 0
        for start in range(0, max(len(docs), 1), docs_per_shard):
            rel = f"{split}/shard-{len(shards):05d}.array_record"
            with ShardWriter(dataset_dir / rel) as w:
                for doc in docs[start : start + docs_per_shard]:
                    w.write(doc)
            shards.append(rel)
            tokens += w.tokens
        meta_splits[split] = {"shards": shards, "documents": len(docs), "tokens": tokens}
    meta = {"vocab_size": vocab_size, "splits": meta_splits, **extra}
    write_meta(dataset_dir, meta)
    return meta


# --------------------------------------------------------------------------- reading


def read_meta(dataset_dir: str | Path) -> dict:
    path = Path(dataset_dir) / "meta.json"
    if not path.is_file():
        raise ConfigError(f"data.path: no token dataset at {dataset_dir} (missing meta.json)")
    meta = json.loads(path.read_text())
    if meta.get("format") != FORMAT:
        raise ConfigError(f"{path}: format {meta.get('format')!r} is not {FORMAT!r}")
    return meta


def shard_paths(dataset_dir: str | Path, split: str) -> list[str]:
    meta = read_meta(dataset_dir)
    if split not in meta["splits"]:
        raise ConfigError(f"data.path: dataset {dataset_dir} has no split '{split}' (has: {', '.join(meta['splits'])})")
    paths = [str(Path(dataset_dir) / rel) for rel in meta["splits"][split]["shards"]]
    for p in paths:
        if not Path(p).is_file():
            raise ConfigError(f"data.path: shard listed in meta.json is missing: {p}")
    return paths
