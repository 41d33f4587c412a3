"""The tokenize stage: a corpus in, token shards and their tokenizer out.

    run_tokenize(cfg, out_dir) writes
        out_dir/tokenizer/   tokenizer.json, tokenizer_config.json, special_tokens_map.json,
                             chat_template.jinja: loads in transformers.PreTrainedTokenizerFast
        out_dir/data/        meta.json + {train,validation}/shard-NNNNN.array_record
                             (the engine.data format: one record per document, int32 ids)

How it runs: every source is checked and cut into parts before anything is written (a bad
glob, field or file fails first); parts are grouped into tasks of about `shard_size_mb`,
and task i writes shard i of each split. Tasks run on worker threads; a task's output
depends only on its input, so the shards are the same for any number of workers. Work is
staged in out_dir/.work/; a task records itself done after its shards are in place, so a
killed run, re-run, redoes only unfinished tasks. At the end the shards move into data/,
meta.json is written last, and .work/ goes away.

A document goes to validation iff a keyed hash of its text falls below
`validation_fraction`: the split does not depend on file order or worker count, and a
document split into pieces keeps all of them on one side.

    python -m engine.data.tokenize CONFIG.yaml OUT_DIR [key=value ...]
"""

from __future__ import annotations

import collections
import concurrent.futures
import errno
import hashlib
import json
import math
import multiprocessing
import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import Field
from tokenizers import Tokenizer

from engine.config import ConfigError, Strict, load_config
from engine.contract import DATA_DIR, MANIFEST, TOKENIZE_NON_SEMANTIC_FIELDS, TOKENIZER_DIR
from engine.data.shards import TOKEN_DTYPE, ShardWriter, record_count, write_meta
from engine.data.sources import BadRecord, Part, SourceConfig, describe, group_parts, plan_source, read_part
from engine.data.tokenizer import TokenizerConfig, build_tokenizer, load_saved, save_tokenizer
from engine.progress import Eta, format_duration

MB = 1 << 20
SPLITS = ("train", "validation")
STAGE_FORMAT = "trainflow.tokenize/1"
HISTOGRAM_BINS = 40  # bin k holds documents of [2^(k-1), 2^k) tokens; bin 0 the empty ones
ENCODE_BATCH_DOCUMENTS = 1024
ENCODE_BATCH_BYTES = 4 * MB
WORKERS_PER_PROCESS = 8  # worker threads of one process; more workers start helper processes
_SURROGATES = re.compile("[\ud800-\udfff]")


class TokenizeConfig(Strict):
    """A tokenize stage: sources -> tokenizer -> token shards with a train/validation split."""

    sources: list[SourceConfig] = Field(min_length=1)
    """The corpora, each with a format, a path and a mixture weight."""
    tokenizer: TokenizerConfig = TokenizerConfig()
    """Train a byte-level BPE (the default) or load one."""
    validation_fraction: float = Field(0.01, ge=0, lt=1)
    """Share of documents held out for validation, chosen by a hash of each document."""
    split_seed: int = 0
    """Keys the hash that chooses the split and the weighted sampling."""
    add_bos: bool = True
    """Start every document with the tokenizer's bos token (every one ends with eos)."""
    max_document_tokens: int | None = Field(None, ge=3)
    """Longest record written, bos and eos included (None: no limit)."""
    long_documents: Literal["split", "truncate"] = "split"
    """A longer document is split into several records (each framed by bos/eos), or cut."""
    invalid_utf8: Literal["replace", "skip"] = "replace"
    """Invalid UTF-8 is replaced with U+FFFD, or the document skipped; counted either way."""
    bad_records: Literal["error", "skip"] = "error"
    """A malformed record (bad JSON, missing field, not text) stops the run with its file and
    record, or is skipped and counted. A field missing from a file's first record is always
    an error, raised before anything is written."""
    shard_size_mb: float = Field(64.0, gt=0)
    """Input per task (and so per output shard); large line-based or Parquet files are cut."""
    workers: int | None = Field(None, ge=1)
    """Tasks encoded at once (None: one per CPU), as threads of the stage's process sharing
    the tokenizer's Rust thread pool; past 8, helper processes join. Does not change the output."""


# Fields that cannot change the output; left out of fingerprints.


# --------------------------------------------------------------------------- documents


def clean(value: Any, invalid_utf8: str) -> tuple[str | None, bytes | None, str | None, bool]:
    """A raw value -> (text, its UTF-8, skip reason or None, whether invalid UTF-8 was replaced)."""
    replaced = False
    if isinstance(value, bytes):
        try:
            text = value.decode("utf-8")
        except UnicodeDecodeError:
            if invalid_utf8 == "skip":
                return None, None, "invalid_utf8", False
            text, replaced = value.decode("utf-8", "replace"), True
        data = value if not replaced else text.encode("utf-8")
    elif isinstance(value, str):
        try:
            data = value.encode("utf-8")
            text = value
        except UnicodeEncodeError:  # lone surrogates: undecodable bytes or JSON "\ud800" escapes
            if invalid_utf8 == "skip":
                return None, None, "invalid_utf8", False
            text, replaced = _SURROGATES.sub("\ufffd", value), True
            data = text.encode("utf-8")
    elif value is None:
        return None, None, "null", False
    else:
        return None, None, value.reason, False
    if not text or text.isspace():
        return None, None, "empty", False
    return text, data, None, replaced


def document_hash(data: bytes, seed: int) -> tuple[float, float]:
    """Two independent uniforms in [0, 1) from the text: (split, weighted sampling)."""
    digest = hashlib.blake2b(data, digest_size=16, key=str(seed).encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2**64, int.from_bytes(digest[8:], "little") / 2**64


def copies_for(weight: float, u: float) -> int:
    whole = math.floor(weight)
    return whole + (u < weight - whole)


def _bad_record_error(src: SourceConfig, part: Part, position: int, bad: BadRecord) -> ConfigError:
    return ConfigError(
        f"{describe(src, part, position)}: {bad.message} (set bad_records: skip to count and skip such records)"
    )


def _refuse_binary(src: SourceConfig, part: Part, position: int, value: Any) -> None:
    """A text source's record with a NUL byte is a binary file (as git and grep judge it):
    refused, where decoding it would make a "complete" dataset of replacement characters."""
    if src.format == "text" and isinstance(value, bytes) and b"\x00" in value:
        raise ConfigError(
            f"{describe(src, part, position)}: binary data (a NUL byte), not text; "
            f"a text source takes text files only (narrow its path, or convert the file to text)"
        )


# --------------------------------------------------------------------------- stats


def empty_stats(num_sources: int) -> dict:
    return {
        "records_read": 0,
        "documents": 0,  # usable documents, each counted once
        "bytes": 0,  # their UTF-8 bytes
        "text_tokens": 0,  # tokens of the encoded documents, once each, no bos/eos
        "skipped": {},
        "invalid_utf8_replaced": 0,
        "weighted_out": 0,  # usable documents a weight < 1 left out
        "long_documents": {"split": 0, "truncated": 0, "tokens_dropped": 0},
        "length_histogram": [0] * HISTOGRAM_BINS,
        "sources": [{"documents": 0, "bytes": 0, "tokens": 0} for _ in range(num_sources)],
        "splits": {s: {"documents": 0, "tokens": 0} for s in SPLITS},
    }


def merge_stats(total: Any, part: Any) -> Any:
    if isinstance(total, dict):
        return {
            k: merge_stats(total[k], part[k]) if k in total and k in part else total.get(k, part.get(k))
            for k in {**total, **part}
        }
    if isinstance(total, list):
        return [merge_stats(a, b) for a, b in zip(total, part)]
    return total + part


def _report(stats: dict, cfg: TokenizeConfig) -> dict:
    """Stats as published: histogram bins labelled, sources named with their token share."""
    out = {k: v for k, v in stats.items() if k not in ("length_histogram", "sources")}
    out["skipped"] = dict(sorted(stats["skipped"].items()))
    counts = stats["length_histogram"]
    last = max((i for i, c in enumerate(counts) if c), default=0)
    out["length_histogram"] = {
        "bin_start_tokens": [0] + [2 ** (k - 1) for k in range(1, last + 1)],
        "documents": counts[: last + 1],
    }
    written = sum(s["tokens"] for s in stats["splits"].values()) or 1
    out["sources"] = [
        {"name": src.label, "weight": src.weight, **s, "token_share": round(s["tokens"] / written, 6)}
        for src, s in zip(cfg.sources, stats["sources"])
    ]
    out["tokens"] = sum(s["tokens"] for s in stats["splits"].values())
    return out


# --------------------------------------------------------------------------- one task


def _load_tokenizer(settings: dict) -> Tokenizer:
    tok = Tokenizer.from_file(settings["tokenizer_json"])
    # Shards hold text: "<|eos|>" written in a document is text, not a document boundary.
    tok.encode_special_tokens = True
    return tok


class _Encoder:
    """Turns the parts of one task into its shards. One per worker thread; the threads of a
    process share its tokenizer (encoding only reads it)."""

    def __init__(self, settings: dict, tok: Tokenizer):
        self.cfg = TokenizeConfig.model_validate(settings["config"])
        self.tok = tok
        self.bos_id = settings["bos_id"] if self.cfg.add_bos else None
        self.eos_id = settings["eos_id"]
        self.staging = Path(settings["staging"])

    def run(self, index: int, parts: list[Part]) -> dict:
        cfg = self.cfg
        self.stats = empty_stats(len(cfg.sources))
        self.writers: dict[str, ShardWriter] = {}
        self.pending: list[tuple[str, int, str, int]] = []
        self.pending_bytes = 0
        self.name = name = f"shard-{index:05d}.array_record"
        try:
            for part in parts:
                src = cfg.sources[part.source]
                for position, value in read_part(src, part):
                    self._add(src, part, position, value)
            self._flush()
        except BaseException:
            for writer in self.writers.values():
                writer.abort()
            raise
        shards = {}
        for split, writer in self.writers.items():
            writer.close()  # -> <name>.<pid>, renamed so concurrent writers never collide
            final = self.staging / split / name
            os.replace(writer.path, final)
            shards[split] = f"{split}/{name}"
        record = {"index": index, "shards": shards, "stats": self.stats}
        _write_json(self.staging.parent / "tasks" / f"task-{index:05d}.json", record)
        return record

    def _add(self, src: SourceConfig, part: Part, position: int, value: Any) -> None:
        stats = self.stats
        stats["records_read"] += 1
        _refuse_binary(src, part, position, value)
        text, data, reason, replaced = clean(value, self.cfg.invalid_utf8)
        if reason is not None:
            if isinstance(value, BadRecord) and self.cfg.bad_records == "error":
                raise _bad_record_error(src, part, position, value)
            stats["skipped"][reason] = stats["skipped"].get(reason, 0) + 1
            return
        assert text is not None and data is not None  # a record clean() keeps has both
        stats["invalid_utf8_replaced"] += replaced
        stats["documents"] += 1
        stats["bytes"] += len(data)
        per_source = stats["sources"][part.source]
        per_source["documents"] += 1
        per_source["bytes"] += len(data)
        u_split, u_weight = document_hash(data, self.cfg.split_seed)
        copies = copies_for(src.weight, u_weight)
        if copies == 0:
            stats["weighted_out"] += 1
            return
        split = "validation" if u_split < self.cfg.validation_fraction else "train"
        self.pending.append((text, copies, split, part.source))
        self.pending_bytes += len(data)
        if len(self.pending) >= ENCODE_BATCH_DOCUMENTS or self.pending_bytes >= ENCODE_BATCH_BYTES:
            self._flush()

    def _flush(self) -> None:
        if not self.pending:
            return
        encodings = self.tok.encode_batch_fast([p[0] for p in self.pending], add_special_tokens=False)
        stats = self.stats
        for (_, copies, split, source), encoding in zip(self.pending, encodings):
            ids = encoding.ids
            stats["text_tokens"] += len(ids)
            stats["length_histogram"][min(len(ids).bit_length(), HISTOGRAM_BINS - 1)] += 1
            records = self._frame(ids)
            writer = self.writers.get(split)
            if writer is None:
                path = self.staging / split / f"{self.name}.{os.getpid()}"
                writer = self.writers[split] = ShardWriter(path)
            tokens = sum(len(r) for r in records)
            for _ in range(copies):
                for record in records:
                    writer.write(record)
            stats["splits"][split]["documents"] += copies * len(records)
            stats["splits"][split]["tokens"] += copies * tokens
            stats["sources"][source]["tokens"] += copies * tokens
        self.pending, self.pending_bytes = [], 0

    def _frame(self, ids: list[int]) -> list[np.ndarray]:
        """bos + ids + eos, split or truncated to max_document_tokens."""
        head = 0 if self.bos_id is None else 1
        limit = self.cfg.max_document_tokens
        body = len(ids) if limit is None else limit - head - 1
        pieces = [ids]
        if len(ids) > body:
            if self.cfg.long_documents == "truncate":
                self.stats["long_documents"]["truncated"] += 1
                self.stats["long_documents"]["tokens_dropped"] += len(ids) - body
                pieces = [ids[:body]]
            else:
                self.stats["long_documents"]["split"] += 1
                pieces = [ids[i : i + body] for i in range(0, len(ids), body)]
        records = []
        for piece in pieces:
            record = np.empty(len(piece) + head + 1, TOKEN_DTYPE)
            if head:  # add_bos: the tokenizer has a bos_id
                assert self.bos_id is not None
                record[0] = self.bos_id
            record[head:-1] = piece
            record[-1] = self.eos_id
            records.append(record)
        return records


class _Tasks:
    """The tasks left to run, shared by the threads of this process."""

    def __init__(self, todo: list, on_done: Callable[[dict], None]):
        self._queue = collections.deque(todo)
        self._on_done = on_done
        self._lock = threading.Lock()

    def take(self, count: int = 1) -> list:
        with self._lock:
            return [self._queue.popleft() for _ in range(min(count, len(self._queue)))]

    def done(self, record: dict) -> None:
        with self._lock:
            self._on_done(record)

    def cancel(self) -> None:
        """After an error: no further task starts; those running finish."""
        with self._lock:
            self._queue.clear()


def _run_threads(tasks: _Tasks, settings: dict, threads: int, tok: Tokenizer) -> None:
    """Run `tasks` on `threads` threads, this one included, until none is left. The first
    error cancels the rest and is raised once the running tasks have finished."""
    errors: list[BaseException] = []

    def work() -> None:
        try:
            encoder = _Encoder(settings, tok)
            while task := tasks.take():
                tasks.done(encoder.run(*_task_args(task[0])))
        except BaseException as e:  # noqa: BLE001 - raised below, in the calling thread
            tasks.cancel()
            errors.append(e)

    others = [threading.Thread(target=work, name=f"tokenize-{i}", daemon=True) for i in range(1, threads)]
    for thread in others:
        thread.start()
    work()
    for thread in others:
        thread.join()
    if errors:
        raise errors[0]


_HELPER: dict = {}  # a helper process's settings and tokenizer


def _init_helper(settings: dict, rayon_threads: int) -> None:
    # Nothing here may fail: a pool replaces a worker whose initializer raises, forever.
    _HELPER["settings"] = settings
    # A process's encoders share one Rust thread pool: cores / processes threads each.
    os.environ["RAYON_NUM_THREADS"] = str(rayon_threads)
    if rayon_threads == 1:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    parent = os.getppid()

    def exit_when_orphaned() -> None:  # a killed stage must not leave workers writing
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=exit_when_orphaned, daemon=True).start()


def _helper_batch(batch: list) -> list[dict]:
    """In a helper process: run a batch of tasks, one thread each; their records."""
    if "tok" not in _HELPER:
        _HELPER["tok"] = _load_tokenizer(_HELPER["settings"])
    records: list[dict] = []
    _run_threads(_Tasks(batch, records.append), _HELPER["settings"], len(batch), _HELPER["tok"])
    return records


def _feed_helpers(tasks: _Tasks, settings: dict, helpers: int, threads: int, rayon_threads: int) -> None:
    """Hand batches of `threads` tasks to `helpers` spawned processes until none is left
    (spawn, not fork: this process may run JAX or tokenizers threads). A pool that fails
    loudly: a helper that dies (or cannot start) raises BrokenProcessPool here, where
    multiprocessing.Pool would silently start another."""
    try:
        with concurrent.futures.ProcessPoolExecutor(
            helpers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_init_helper,
            initargs=(settings, rayon_threads),
        ) as pool:
            running: set = set()
            while True:
                # A batch per helper: one queued beside it would keep its tasks from idle threads.
                while len(running) < helpers and (batch := tasks.take(threads)):
                    running.add(pool.submit(_helper_batch, batch))
                if not running:
                    return
                finished, running = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
                for future in finished:
                    for record in future.result():  # re-raises a helper's error here
                        tasks.done(record)
    except BaseException:
        tasks.cancel()
        raise


# --------------------------------------------------------------------------- the stage


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def _tokenizer_digest(path: str | None) -> str | None:
    """A loaded tokenizer's files (not a model directory's weights beside them)."""
    if not path:
        return None
    root = Path(os.path.expanduser(path))
    names = ("tokenizer", "special_tokens_map", "chat_template", "added_tokens", "vocab", "merges")
    files = sorted(p for p in root.iterdir() if p.is_file() and p.name.startswith(names)) if root.is_dir() else [root]
    digest = hashlib.sha256()
    for file in files:
        if file.exists():
            digest.update(file.name.encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()


def fingerprint(cfg: TokenizeConfig, parts: list[Part]) -> str:
    """What the output depends on: the config (less TOKENIZE_NON_SEMANTIC_FIELDS), every input
    file's size and mtime, and a loaded tokenizer's bytes.

    A path inside an artifact of a store (below a directory holding artifact.json) enters as
    `{artifact:STAGE/ID}/relative`, and its file without an mtime: the artifact's id covers
    its bytes, so copying, moving or syncing the store changes no fingerprint."""
    in_store = _StorePaths()
    payload = {
        "format": STAGE_FORMAT,
        "config": in_store.tree(cfg.model_dump(mode="json", exclude=set(TOKENIZE_NON_SEMANTIC_FIELDS))),
        "inputs": [in_store.part(p) for p in parts],
        "tokenizer": _tokenizer_digest(cfg.tokenizer.path),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


class _StorePaths:
    """Rewrites absolute paths inside artifact directories as `{artifact:STAGE/ID}/relative`."""

    def __init__(self):
        self._is_artifact: dict[Path, bool] = {}
        self._artifact_of: dict[str, Path | None] = {}  # a folder -> the artifact holding it

    def relocatable(self, path: str) -> str | None:
        if not os.path.isabs(path):
            return None
        folder = os.path.dirname(path)
        if folder not in self._artifact_of:  # once per folder: a corpus is thousands of files
            self._artifact_of[folder] = self._artifact(Path(path))
        directory = self._artifact_of[folder]
        if directory is None:
            return None
        relative = Path(path).relative_to(directory).as_posix()
        return f"{{artifact:{directory.parent.name}/{directory.name}}}/{relative}"

    def _artifact(self, path: Path) -> Path | None:
        for directory in path.parents:
            if directory not in self._is_artifact:
                self._is_artifact[directory] = (directory / MANIFEST).is_file()
            if self._is_artifact[directory]:
                return directory
        return None

    def tree(self, value: Any) -> Any:
        if isinstance(value, dict):
            return {k: self.tree(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.tree(v) for v in value]
        return (self.relocatable(value) or value) if isinstance(value, str) else value

    def part(self, part: Part) -> dict:
        record = part.to_json()
        relocated = self.relocatable(part.path)
        if relocated is not None:
            record.update(path=relocated)
            record.pop("mtime_ns")
        return record


def _training_texts(cfg: TokenizeConfig, parts: list[Part], seen: dict):
    """Documents to learn the merges from: train-split documents, up to train_max_mb in all,
    shared among the sources in proportion to weight x size. Counts into `seen`."""
    budget = cfg.tokenizer.train_max_mb * MB
    sizes = [sum(p.size for p in parts if p.source == i) for i in range(len(cfg.sources))]
    weighted = sum(src.weight * size for src, size in zip(cfg.sources, sizes)) or 1
    for index, src in enumerate(cfg.sources):
        share, used = budget * src.weight * sizes[index] / weighted, 0
        for part in (p for p in parts if p.source == index):
            for position, value in read_part(src, part):
                _refuse_binary(src, part, position, value)
                text, data, reason, _ = clean(value, cfg.invalid_utf8)
                if reason is not None:
                    if isinstance(value, BadRecord) and cfg.bad_records == "error":
                        raise _bad_record_error(src, part, position, value)
                    seen[reason] = seen.get(reason, 0) + 1
                    continue
                assert text is not None and data is not None  # a record clean() keeps has both
                seen["documents"] = seen.get("documents", 0) + 1
                if document_hash(data, cfg.split_seed)[0] < cfg.validation_fraction:
                    continue
                yield text
                used += len(data)
                if used >= share:
                    break
            if used >= share:
                break


def _no_documents_error(counts: dict, parts: list[Part]) -> ConfigError:
    reasons = ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()) if k != "documents") or "no records"
    paths = list(dict.fromkeys(p.path for p in parts))
    read = ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
    return ConfigError(f"the corpus ({read}) has no usable documents (skipped {reasons}); nothing was written")


def _prepare_tokenizer(cfg: TokenizeConfig, parts: list[Part], out: Path, work: Path, log: Callable):
    staged, final = work / TOKENIZER_DIR, out / TOKENIZER_DIR
    if (staged / "tokenizer.json").is_file():
        return load_saved(staged), staged
    if (final / "tokenizer.json").is_file():  # resuming a run killed while finishing
        return load_saved(final), final
    if cfg.tokenizer.path:
        log(f"tokenize: loading tokenizer {cfg.tokenizer.path}")
        bundle = build_tokenizer(cfg.tokenizer, None, add_bos=cfg.add_bos)
    else:
        log(f"tokenize: training a byte-level BPE tokenizer (vocab {cfg.tokenizer.vocab_size})")
        seen: dict = {}
        bundle = build_tokenizer(cfg.tokenizer, _training_texts(cfg, parts, seen), add_bos=cfg.add_bos)
        if not seen.get("documents"):
            raise _no_documents_error(seen, parts)
    if bundle.bos_id is None and cfg.add_bos:
        log("tokenize: the tokenizer has no bos token; documents start without one")
    save_tokenizer(bundle, staged)
    return bundle, staged


def run_tokenize(cfg: TokenizeConfig, out_dir: str | Path, *, log: Callable[[str], Any] = print) -> dict:
    """Tokenize `cfg.sources` into out_dir/data (shards + meta.json) and out_dir/tokenizer.

    Returns the stats (JSON-serialisable). Re-running after a kill finishes the missing
    shards; re-running a finished out_dir returns its stats without work.
    """
    started = time.perf_counter()
    out = Path(out_dir)
    data_dir, work = out / DATA_DIR, out / ".work"
    target = max(int(cfg.shard_size_mb * MB), 1)
    parts = [p for i, src in enumerate(cfg.sources) for p in plan_source(i, src, target)]
    tasks = group_parts(parts, target)
    key = fingerprint(cfg, parts)

    if (data_dir / "meta.json").is_file():
        meta = json.loads((data_dir / "meta.json").read_text())
        if meta.get("fingerprint") != key:
            raise ConfigError(
                f"{out} already holds a dataset made from another config or input; choose another out_dir"
            )
        log(f"tokenize: {out} is complete")
        shutil.rmtree(work, ignore_errors=True)
        return {**meta["stats"], "resumed_shards": len(tasks), "seconds": 0.0}
    state = work / "state.json"
    if state.is_file():
        if json.loads(state.read_text()).get("fingerprint") != key:
            raise ConfigError(
                f"{out} holds an unfinished run of another config or of input files "
                f"that have changed since; delete {work} or choose another out_dir"
            )
    elif data_dir.exists() or (out / TOKENIZER_DIR).exists():
        raise ConfigError(f"{out} already has a data/ or tokenizer/ this stage did not write; choose another out_dir")
    else:
        _write_json(state, {"fingerprint": key, "tasks": len(tasks)})

    bundle, tokenizer_dir = _prepare_tokenizer(cfg, parts, out, work, log)
    for split in SPLITS:
        (work / DATA_DIR / split).mkdir(parents=True, exist_ok=True)
    done_dir = work / "tasks"
    done = {i for i in range(len(tasks)) if (done_dir / f"task-{i:05d}.json").is_file()}
    todo = [(i, [p.to_json() for p in tasks[i]]) for i in range(len(tasks)) if i not in done]
    workers = min(cfg.workers or os.cpu_count() or 1, max(len(todo), 1))
    log(
        f"tokenize: {len(parts)} input parts -> {len(tasks)} shards"
        + (f" ({len(done)} already done)" if done else "")
        + f", {workers} worker(s)"
    )

    settings = {
        "config": cfg.model_dump(mode="json", exclude_unset=True),
        "tokenizer_json": str(tokenizer_dir / "tokenizer.json"),
        "bos_id": bundle.bos_id,
        "eos_id": bundle.eos_id,
        "staging": str(work / DATA_DIR),
    }
    _run_tasks(todo, settings, workers, len(tasks), len(done), log)

    records = [json.loads((done_dir / f"task-{i:05d}.json").read_text()) for i in range(len(tasks))]
    stats = empty_stats(len(cfg.sources))
    for record in records:
        stats = merge_stats(stats, record["stats"])
    if stats["documents"] == 0:
        raise _no_documents_error({**stats["skipped"], "documents": 0}, parts)

    # Finish: shards into data/, the tokenizer beside it, meta.json last.
    meta_splits = {}
    for split in SPLITS:
        shards = [r["shards"][split] for r in records if split in r["shards"]]
        for rel in shards:
            staged, final = work / DATA_DIR / rel, data_dir / rel
            if staged.is_file():
                final.parent.mkdir(parents=True, exist_ok=True)
                os.replace(staged, final)
            assert final.is_file(), final
        counts = [record_count(data_dir / rel) for rel in shards]  # footers only: no record read
        meta_splits[split] = {"shards": shards, "shard_documents": counts, **stats["splits"][split]}
    if tokenizer_dir != out / TOKENIZER_DIR:
        shutil.rmtree(out / TOKENIZER_DIR, ignore_errors=True)
        os.replace(tokenizer_dir, out / TOKENIZER_DIR)
    report = _report(stats, cfg)
    write_meta(
        data_dir,
        {
            "vocab_size": bundle.vocab_size,
            "bos_id": bundle.bos_id,
            "eos_id": bundle.eos_id,
            "add_bos": cfg.add_bos and bundle.bos_id is not None,  # records start with bos_id
            "pad_id": bundle.pad_id,
            "splits": meta_splits,
            "tokenizer": f"../{TOKENIZER_DIR}",
            "fingerprint": key,
            "stats": report,
        },
    )
    shutil.rmtree(work, ignore_errors=True)
    seconds = time.perf_counter() - started
    if not meta_splits["validation"]["documents"] and cfg.validation_fraction > 0:
        log(
            "tokenize: warning: no document fell in the validation split; pretraining on this dataset "
            "needs data.eval_batches=0 (or re-tokenize with a larger validation_fraction)"
        )
    log(f"tokenize: {counts_line(report)} in {seconds:.1f}s")
    log(f"tokenize: written to {out}")  # a line of its own: a store's path can be long
    return {**report, "resumed_shards": len(done), "seconds": round(seconds, 3)}


def counts_line(stats: dict) -> str:
    """Documents read and records written, with what makes them differ: a document longer
    than max_document_tokens becomes several records, and a source's weight repeats or
    leaves out documents."""
    records = sum(s["documents"] for s in stats["splits"].values())  # a split counts records
    why = [
        f"{n} {what}"
        for n, what in (
            (stats["long_documents"]["split"], "long documents split"),
            (stats["long_documents"]["truncated"], "truncated"),
            (stats["weighted_out"], "left out by weight"),
        )
        if n
    ]
    if any(src.get("weight", 1) > 1 for src in stats.get("sources", [])):
        why.append("weights > 1 repeat documents")
    return (
        f"{stats['documents']:,} documents ({stats['bytes'] / MB:.1f} MB) -> {records:,} records"
        + (f" ({', '.join(why)})" if why else "")
        + f", {stats['tokens']:,} tokens"
    )


def splits_line(stats: dict) -> str:
    """Records and tokens per split, and the input records skipped, by reason."""
    splits = "; ".join(f"{k} {v['documents']:,} records, {v['tokens']:,} tokens" for k, v in stats["splits"].items())
    skipped = ", ".join(f"{k} {v:,}" for k, v in sorted(stats["skipped"].items()))
    return splits + (f"; skipped: {skipped}" if skipped else "")


def _run_tasks(todo: list, settings: dict, workers: int, total: int, done: int, log: Callable) -> None:
    """Run the tasks, `workers` at a time, each on a thread of this process.

    Threads, not processes: the encoder runs in Rust outside the GIL on the tokenizer's
    thread pool, which the threads share, so a long document in one task is encoded beside
    the short ones of another and every core stays busy; the Python around the encoding
    (reading, hashing, framing, writing: under a tenth of its CPU) overlaps with it; and a
    thread costs no process start-up (about half a CPU-second of imports) and no copies.
    One process's Python would hold the GIL too long beyond WORKERS_PER_PROCESS workers:
    past that, helper processes take batches of as many tasks."""
    if not todo:
        return
    progress = _Progress(total, done, log)
    tasks = _Tasks(todo, progress.update)
    processes = math.ceil(workers / WORKERS_PER_PROCESS)
    threads = math.ceil(workers / processes)  # in each helper; this process runs the rest
    here = workers - (processes - 1) * threads
    tok = _load_tokenizer(settings)
    if processes == 1:
        _run_threads(tasks, settings, here, tok)
        return
    errors: list[BaseException] = []

    def feed() -> None:
        try:
            _feed_helpers(tasks, settings, processes - 1, threads, max(1, (os.cpu_count() or 1) // processes))
        except BaseException as e:  # noqa: BLE001 - raised below, after this thread's own tasks
            errors.append(e)

    feeder = threading.Thread(target=feed, name="tokenize-helpers", daemon=True)
    feeder.start()
    try:
        _run_threads(tasks, settings, here, tok)
    finally:
        feeder.join()
    if errors:
        raise errors[0]


def _task_args(task: tuple[int, list[dict]]) -> tuple[int, list[Part]]:
    index, parts = task
    return index, [Part(**p) for p in parts]


class _Progress:
    def __init__(self, total: int, done: int, log: Callable):
        self.total, self.done, self.log = total, done, log
        self.started = self.last = time.perf_counter()
        self.bytes = self.tokens = 0
        self.eta = Eta(total)
        self.eta.update(done)  # paced from the start: nothing compiles first

    def update(self, record: dict) -> None:
        self.done += 1
        self.bytes += record["stats"]["bytes"]
        self.tokens += record["stats"]["text_tokens"]
        now = time.perf_counter()
        if now - self.last >= 2 or self.done == self.total:
            self.last = now
            rate = self.bytes / MB / max(now - self.started, 1e-9)
            left = self.eta.update(self.done)
            eta = f", ETA {format_duration(left)}" if left is not None else ""
            self.log(f"tokenize: {self.done}/{self.total} shards, {self.tokens} tokens, {rate:.1f} MB/s{eta}")


# --------------------------------------------------------------------------- CLI

USAGE = "usage: python -m engine.data.tokenize CONFIG.yaml OUT_DIR [key=value ...]"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] in (["-h"], ["--help"]):
        print(USAGE)
        return 0
    if len(args) < 2:
        print(USAGE, file=sys.stderr)
        return 2
    try:
        cfg = load_config(args[0], args[2:], schema=TokenizeConfig)
        stats = run_tokenize(cfg, args[1])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        # A failed write() names no file: then say where the output was going.
        print(f"error: {os.strerror(e.errno)} writing {e.filename or Path(args[1]).absolute()}", file=sys.stderr)
        return 1
    print(f"tokenize: {splits_line(stats)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
