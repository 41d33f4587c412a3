"""The Grain pipeline: token shards (engine/data/shards.py) -> shuffled, packed batches.

Each batch is tokens, targets, positions, segment_ids (int32) and loss_mask (float32), all
(rows, seq_len); packed rows hold several documents kept apart by segment ids.
"""

from __future__ import annotations

from pathlib import Path

import grain
import numpy as np

from engine.config import ConfigError
from engine.data.shards import TOKEN_DTYPE, open_split


def _decode(record: bytes) -> dict[str, np.ndarray]:
    tokens = np.frombuffer(record, dtype=TOKEN_DTYPE)
    return {"inputs": tokens[:-1], "targets": tokens[1:]}


def _pad_row(example: dict[str, np.ndarray], seq_len: int) -> dict[str, np.ndarray]:
    """Unpacked mode: one document per row, truncated or right-padded to seq_len."""
    n = min(len(example["inputs"]), seq_len)
    out = {}
    for key in ("inputs", "targets"):
        row = np.zeros(seq_len, np.int32)
        row[:n] = example[key][:n]
        out[key] = row
    segments = np.zeros(seq_len, np.int32)
    segments[:n] = 1
    out["inputs_segment_ids"] = out["targets_segment_ids"] = segments
    out["inputs_positions"] = out["targets_positions"] = np.where(segments > 0, np.arange(seq_len), 0).astype(np.int32)
    return out


def _to_batch(rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {
        "tokens": rows["inputs"].astype(np.int32),
        "targets": rows["targets"].astype(np.int32),
        "positions": rows["inputs_positions"].astype(np.int32),
        "segment_ids": rows["inputs_segment_ids"].astype(np.int32),
        # A target counts iff it belongs to a real (non-padding) segment.
        "loss_mask": (rows["targets_segment_ids"] != 0).astype(np.float32),
    }


def make_dataset(
    dataset_dir: str | Path,
    split: str,
    *,
    seq_len: int,
    batch_size: int,
    seed: int = 0,
    shuffle: bool = True,
    packing: bool = True,
    repeat: bool = True,
    prefetch: int = 0,
) -> grain.IterDataset:
    """Global batches of `batch_size` rows: every process builds the same stream, so the batch
    at step s is the same for any number of processes, devices and mesh shape; the trainer
    keeps the rows its devices hold (Trainer.global_batch). Packing and batching cost little
    next to a step, and the iterator's state is the same on every process.

    Each batch: tokens, targets, positions, segment_ids (int32) and loss_mask (float32),
    all (rows, seq_len). Shuffling is global over documents and differs per epoch; a long
    document fills consecutive rows, so corpora of long files should be split into pieces
    when tokenized (tokenize's `max_document_tokens`).
    """
    source = open_split(dataset_dir, split)  # local shards, or at a bucket URL (fetched as read)
    ds = grain.MapDataset.source(source)
    if len(ds) == 0:
        raise ConfigError(f"data.path: split '{split}' of {dataset_dir} has no documents")
    if shuffle:
        ds = ds.shuffle(seed=seed)
    if repeat:
        ds = ds.repeat(None)
    ds = ds.map(_decode)
    if packing:
        it = grain.experimental.ConcatThenSplitIterDataset(
            ds.to_iter_dataset(), length_struct={"inputs": seq_len, "targets": seq_len}
        )
    else:
        it = ds.map(lambda ex: _pad_row(ex, seq_len)).to_iter_dataset()
    it = it.batch(batch_size, drop_remainder=repeat).map(_to_batch)
    if prefetch:
        it = grain.experimental.ThreadPrefetchIterDataset(it, prefetch_buffer_size=prefetch)
    return it
