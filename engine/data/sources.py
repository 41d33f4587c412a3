"""Corpus readers of the tokenize stage: what files a source names, how they divide into
parts (the unit of parallel work), and the raw documents in each part.

A reader yields `(position, value)`: position locates the record in its file (a byte
offset, a row or record number) and is turned into words only for an error message; value
is the document as `str` or `bytes` (UTF-8 is checked later, in one place), `None` for a
null, or a `BadRecord` saying why the record holds no document.
"""

from __future__ import annotations

import fnmatch
import glob
import gzip
import json
import os
import re
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from array_record.python.array_record_module import ArrayRecordReader
from pydantic import Field, model_validator
from tokenizers import Tokenizer

from engine.config import ConfigError, Strict
from engine.contract import TOKENIZER_DIR
from engine.data.shards import TOKEN_DTYPE, read_meta

Format = Literal["text", "jsonl", "parquet", "tfrecord", "tfds", "tokens"]


class SourceConfig(Strict):
    """One input corpus of the tokenize stage."""

    format: Format
    """text (plain files), jsonl, parquet, tfrecord (tf.train.Example), tfds (a prepared
    TFDS dataset directory) or tokens (a trainflow token dataset directory)."""
    path: str
    """A glob (`**` recurses) for text, jsonl, parquet and tfrecord; a directory for tfds (the
    version directory holding dataset_info.json) and tokens (holding meta.json). `{stdlib}`
    expands to this Python's standard-library directory, `~` and `$VAR` as usual."""
    name: str | None = None
    """Label in the stats (default: `<format>:<path>`)."""
    weight: float = Field(1.0, gt=0)
    """Mixture weight, a sampling rate: each document is written floor(weight) times, plus
    once more with probability frac(weight), decided by a hash of its text (so 0.5 keeps about
    half the documents, 2 writes each twice)."""
    field: str = "text"
    """The text's field (jsonl), column (parquet) or feature (tfrecord, tfds; `a/b` nests)."""
    unit: Literal["file", "line", "block"] = "file"
    """text only: a document is a whole file, a line, or a block between blank lines."""
    split: str | None = None
    """tfds: the split to read (default train). tokens: one split (default: all of them)."""
    exclude: list[str] = []
    """Glob patterns (fnmatch, on the full path) of files to leave out, e.g. `*/test/*`."""
    tokenizer: str | None = None
    """tokens only: the tokenizer that wrote the shards (default: `tokenizer/` beside the
    dataset directory); documents are decoded with it and re-encoded."""

    @model_validator(mode="after")
    def _check(self) -> SourceConfig:
        only = {
            "unit": ("text",),
            "split": ("tfds", "tokens"),
            "tokenizer": ("tokens",),
            "field": ("jsonl", "parquet", "tfrecord", "tfds"),
        }
        for key, formats in only.items():
            if key in self.model_fields_set and self.format not in formats:
                raise ValueError(f"'{key}' applies to format {' or '.join(formats)}, not {self.format}")
        return self

    @property
    def label(self) -> str:
        return self.name or f"{self.format}:{self.path}"


@dataclass(frozen=True)
class Part:
    """A piece of one input file: bytes [start, stop) of a line-based file, row groups
    [start, stop) of a Parquet file, or the whole file (start=0, stop=-1)."""

    source: int
    path: str
    size: int
    mtime_ns: int
    start: int = 0
    stop: int = -1

    def to_json(self) -> dict:
        return dict(self.__dict__)  # the fields in order, as asdict() gives them without its deep copies


@dataclass(frozen=True)
class BadRecord:
    reason: str  # key in the stats' "skipped" table
    message: str


def expand_path(path: str) -> str:
    """`{stdlib}`, `~` and `$VAR` expanded; absolute, so a fingerprint does not depend on the cwd."""
    path = path.replace("{stdlib}", sysconfig.get_paths()["stdlib"])
    return os.path.abspath(os.path.expandvars(os.path.expanduser(path)))


def _is_gzip(path: str) -> bool:
    return path.endswith(".gz")


def _splits_into_ranges(src: SourceConfig, path: str) -> bool:
    return (src.format == "jsonl" or (src.format == "text" and src.unit == "line")) and not _is_gzip(path)


# --------------------------------------------------------------------------- planning


def plan_source(index: int, src: SourceConfig, target_bytes: int) -> list[Part]:
    """Every part of a source, checked before anything is written: the files exist and can
    be read, and their first record has the field the config names."""
    key = f"sources[{index}]"
    if src.format == "tfds":
        return _plan_tfds(index, src, key)
    if src.format == "tokens":
        return _plan_tokens(index, src, key)
    pattern = expand_path(src.path)
    if os.path.isdir(pattern):
        raise ConfigError(f"{key}.path: {pattern} is a directory; give a glob such as {pattern}/*")
    files = sorted(f for f in glob.glob(pattern, recursive=True) if os.path.isfile(f))
    files = [f for f in files if not any(fnmatch.fnmatch(f, ex) for ex in src.exclude)]
    if not files:
        raise ConfigError(f"{key}.path: '{src.path}' matches no files")
    parts = []
    for path in files:
        stat = _stat_readable(path, key)
        if src.format == "jsonl":
            _check_first_json(path, src.field, key)
        elif src.format == "tfrecord":
            _check_first_example(path, src.field, key)
        if src.format == "parquet":
            parts += _parquet_parts(index, path, stat, src.field, key, target_bytes)
        elif _splits_into_ranges(src, path) and stat.st_size > target_bytes:
            count = round(stat.st_size / target_bytes)
            bounds = [stat.st_size * i // count for i in range(count + 1)]
            parts += [Part(index, path, hi - lo, stat.st_mtime_ns, lo, hi) for lo, hi in zip(bounds, bounds[1:])]
        else:
            parts.append(Part(index, path, stat.st_size, stat.st_mtime_ns))
    return parts


def _stat_readable(path: str, key: str) -> os.stat_result:
    try:
        with _open(path) as f:
            f.read(1)
        return os.stat(path)
    except (OSError, EOFError) as e:
        reason = e.strerror if isinstance(e, OSError) else None
        raise ConfigError(f"{key}: cannot read {path}: {reason or e}") from None


def group_parts(parts: list[Part], target_bytes: int) -> list[list[Part]]:
    """Consecutive parts of one source, about `target_bytes` a group: one output shard each."""
    groups: list[list[Part]] = []
    size = 0
    for part in parts:
        if groups and groups[-1][0].source == part.source and size + part.size <= target_bytes:
            groups[-1].append(part)
            size += part.size
        else:
            groups.append([part])
            size = part.size
    return groups


def _check_first_json(path: str, field: str, key: str) -> None:
    with _open(path) as f:
        for number, line in enumerate(f, 1):  # noqa: B007 (number names the line in the errors below)
            if line.strip():
                break
        else:
            return  # an empty file holds no records; nothing to check
    try:
        record = json.loads(line.decode("utf-8", "surrogateescape"))
    except ValueError as e:
        raise ConfigError(f"{key}: {path}, line {number} is not JSON ({e}); is this a JSON Lines file?") from None
    if not isinstance(record, dict) or field not in record:
        keys = ", ".join(record) if isinstance(record, dict) else "none: not an object"
        raise ConfigError(f"{key}.field: {path}, line {number} has no field '{field}' (fields: {keys})")


def _parquet_parts(index: int, path: str, stat, column: str, key: str, target_bytes: int) -> list[Part]:
    try:
        meta = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as e:
        raise ConfigError(f"{key}: {path} is not a readable Parquet file: {e}") from None
    schema = meta.schema_arrow
    if column not in schema.names:
        raise ConfigError(f"{key}.field: {path} has no column '{column}' (columns: {', '.join(schema.names)})")
    kind = schema.field(column).type
    textual = (
        pa.types.is_string,
        pa.types.is_large_string,
        pa.types.is_binary,
        pa.types.is_large_binary,
        getattr(pa.types, "is_string_view", lambda _: False),
    )
    if not any(test(kind) for test in textual):
        raise ConfigError(f"{key}.field: column '{column}' of {path} is {kind}, not text")
    groups = meta.metadata.num_row_groups
    rows = max(meta.metadata.num_rows, 1)
    # Row groups batched into parts of about target_bytes of the file.
    parts, start, size = [], 0, 0
    for g in range(groups):
        size += stat.st_size * meta.metadata.row_group(g).num_rows // rows
        if size >= target_bytes or g == groups - 1:
            parts.append(Part(index, path, size, stat.st_mtime_ns, start, g + 1))
            start, size = g + 1, 0
    return parts or [Part(index, path, stat.st_size, stat.st_mtime_ns, 0, 0)]


def _check_first_example(path: str, field: str, key: str) -> None:
    for _, value in _tfrecord_examples(path, field, limit=1):
        if isinstance(value, BadRecord) and value.reason == "missing_field":
            raise ConfigError(f"{key}.field: {path}, record 0: {value.message}")


def _plan_tfds(index: int, src: SourceConfig, key: str) -> list[Part]:
    directory = expand_path(src.path)
    if not os.path.isfile(os.path.join(directory, "dataset_info.json")):
        raise ConfigError(
            f"{key}.path: {directory} is not a prepared TFDS dataset (no dataset_info.json); "
            "give the version directory, e.g. .../my_dataset/1.0.0"
        )
    info = _tfds_builder(directory).info
    split = src.split or "train"
    if split not in info.splits:
        raise ConfigError(f"{key}.split: {directory} has no split '{split}' (splits: {', '.join(info.splits)})")
    flat = _flat_feature_names(info.features)
    if src.field not in flat:
        raise ConfigError(f"{key}.field: {directory} has no feature '{src.field}' (features: {', '.join(flat)})")
    parts = []
    for path in sorted(str(p) for p in info.splits[split].filepaths):
        stat = _stat_readable(path, key)
        parts.append(Part(index, path, stat.st_size, stat.st_mtime_ns))
    if not parts:
        raise ConfigError(f"{key}: split '{split}' of {directory} has no files")
    return parts


def _flat_feature_names(features, prefix: str = "") -> list[str]:
    names = []
    for name, feature in features.items():
        names.append(prefix + name)
        if hasattr(feature, "items"):
            names += _flat_feature_names(feature, f"{prefix}{name}/")
    return names


def tokens_tokenizer_dir(src: SourceConfig) -> Path:
    directory = Path(expand_path(src.path))
    return Path(expand_path(src.tokenizer)) if src.tokenizer else directory.parent / TOKENIZER_DIR


def _plan_tokens(index: int, src: SourceConfig, key: str) -> list[Part]:
    directory = Path(expand_path(src.path))
    try:
        meta = read_meta(directory)
    except ConfigError as e:
        raise ConfigError(f"{key}.path: {e}") from None
    splits = [src.split] if src.split else list(meta["splits"])
    for split in splits:
        if split not in meta["splits"]:
            raise ConfigError(f"{key}.split: {directory} has no split '{split}' (splits: {', '.join(meta['splits'])})")
    tokenizer = tokens_tokenizer_dir(src)
    if not (tokenizer / "tokenizer.json").is_file() and not (tokenizer.suffix == ".json" and tokenizer.is_file()):
        raise ConfigError(f"{key}.tokenizer: no tokenizer.json at {tokenizer} to decode {directory} with")
    parts = []
    for split in splits:
        for rel in meta["splits"][split]["shards"]:
            path = str(directory / rel)
            stat = _stat_readable(path, key)
            parts.append(Part(index, path, stat.st_size, stat.st_mtime_ns))
    if not parts:
        raise ConfigError(f"{key}.path: {directory} holds no shards")
    return parts


# --------------------------------------------------------------------------- reading


def read_part(src: SourceConfig, part: Part) -> Iterator[tuple[int, Any]]:
    """The raw documents of one part, in file order."""
    path = part.path
    try:
        if src.format == "text" and src.unit == "file":
            with _open(path) as f:
                yield 0, f.read()
        elif src.format == "text" and src.unit == "line":
            for pos, line in _lines(path, part.start, part.stop):
                yield pos, _strip_newline(line)
        elif src.format == "text":
            with _open(path) as f:
                data = f.read()
            # A blank line (whitespace only) separates blocks; edge blank lines are no blocks.
            blocks = (b.strip(b"\r\n") for b in re.split(rb"\n(?:[ \t\f\v\r]*\n)+", data))
            yield from enumerate(b for b in blocks if b.strip())
        elif src.format == "jsonl":
            yield from _jsonl(path, part.start, part.stop, src.field)
        elif src.format == "parquet":
            yield from _parquet(path, part.start, part.stop, src.field)
        elif src.format == "tfrecord":
            yield from _tfrecord_examples(path, src.field)
        elif src.format == "tfds":
            yield from _tfds_examples(expand_path(src.path), path, src.field)
        elif src.format == "tokens":
            yield from _token_documents(path, str(tokens_tokenizer_dir(src)))
        else:
            raise AssertionError(src.format)
    except (OSError, EOFError, gzip.BadGzipFile) as e:
        raise ConfigError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None


def describe(src: SourceConfig, part: Part, position: int) -> str:
    """Where a record is, for an error message: `file, line 12`."""
    if src.format == "jsonl" or (src.format == "text" and src.unit == "line"):
        return f"{part.path}, line {_line_number(part.path, position)}"
    unit = {"text": "block", "parquet": "row", "tfds": "example"}.get(src.format, "record")
    if src.format == "text" and src.unit == "file":
        return part.path
    return f"{part.path}, {unit} {position}"


def _open(path: str):
    return gzip.open(path, "rb") if _is_gzip(path) else open(path, "rb")


def _lines(path: str, start: int, stop: int) -> Iterator[tuple[int, bytes]]:
    """Lines that start in bytes [start, stop) (stop -1: to the end), with their offsets."""
    with _open(path) as f:
        pos = 0
        if start > 0:  # the line running through `start` belongs to the previous part
            f.seek(start - 1)
            pos = start - 1 + len(f.readline())
        for line in f:
            if 0 <= stop <= pos:
                break
            yield pos, line
            pos += len(line)


def _strip_newline(line: bytes) -> bytes:
    if line.endswith(b"\n"):
        line = line[:-1]
        if line.endswith(b"\r"):
            line = line[:-1]
    return line


def _line_number(path: str, offset: int) -> int:
    count = 1
    with _open(path) as f:
        while offset > 0:
            chunk = f.read(min(offset, 1 << 20))
            if not chunk:
                break
            count += chunk.count(b"\n")
            offset -= len(chunk)
    return count


def _jsonl(path: str, start: int, stop: int, field: str) -> Iterator[tuple[int, Any]]:
    for pos, line in _lines(path, start, stop):
        # Invalid UTF-8 bytes survive as lone surrogates and are dealt with per config later.
        text = line.decode("utf-8", "surrogateescape")
        if not text.strip():
            yield pos, ""
            continue
        try:
            record = json.loads(text)
        except ValueError as e:
            yield pos, BadRecord("malformed", f"not valid JSON ({e})")
            continue
        if not isinstance(record, dict):
            yield pos, BadRecord("malformed", f"a JSON {type(record).__name__}, not an object")
        elif field not in record:
            yield pos, BadRecord("missing_field", f"no field '{field}'")
        else:
            value = record[field]
            if value is None or isinstance(value, str):
                yield pos, value
            else:
                yield pos, BadRecord("not_text", f"field '{field}' is a {type(value).__name__}, not a string")


def _parquet(path: str, start: int, stop: int, column: str) -> Iterator[tuple[int, Any]]:
    file = pq.ParquetFile(path)
    meta = file.metadata
    stop = meta.num_row_groups if stop < 0 else stop
    row = sum(meta.row_group(g).num_rows for g in range(start))
    if start >= stop:
        return
    # Streamed a batch at a time: a file is never loaded whole.
    for batch in file.iter_batches(
        batch_size=4096, row_groups=list(range(start, stop)), columns=[column], use_threads=False
    ):
        for value in batch.column(0).to_pylist():
            yield row, value
            row += 1


def tensorflow():
    """TensorFlow, imported on first use and kept quiet. It is an optional extra
    (`trainflow[tf]`): one of the two places where the engine imports inside a function."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    try:
        import tensorflow as tf
    except ImportError:
        raise ConfigError("reading TFRecord/TFDS sources needs tensorflow: pip install 'trainflow[tf]'") from None
    return tf


def _tfrecords(path: str) -> Iterator[bytes]:
    tf = tensorflow()
    dataset = tf.data.TFRecordDataset(path, compression_type="GZIP" if _is_gzip(path) else "")
    iterator = dataset.as_numpy_iterator()
    number = 0
    while True:
        try:
            raw = next(iterator)
        except StopIteration:
            return
        except tf.errors.OpError as e:
            raise ConfigError(f"{path}, record {number}: not a readable TFRecord ({e.message})") from None
        yield raw
        number += 1


def _tfrecord_examples(path: str, field: str, limit: int | None = None) -> Iterator[tuple[int, Any]]:
    tf = tensorflow()
    for number, raw in enumerate(_tfrecords(path)):
        if limit is not None and number >= limit:
            return
        try:
            example = tf.train.Example.FromString(raw)
        except Exception as e:  # noqa: BLE001 - protobuf DecodeError
            yield number, BadRecord("malformed", f"not a tf.train.Example ({e})")
            continue
        features = example.features.feature
        if field not in features:
            yield number, BadRecord("missing_field", f"no feature '{field}' (features: {', '.join(sorted(features))})")
            continue
        feature = features[field]
        if feature.WhichOneof("kind") != "bytes_list":
            yield number, BadRecord("not_text", f"feature '{field}' is a {feature.WhichOneof('kind')}, not bytes")
            continue
        values = feature.bytes_list.value
        if not values:
            yield number, ""
        for value in values:  # a multi-valued feature holds several documents
            yield number, value


@lru_cache(maxsize=8)
def _tfds_builder(directory: str):
    tensorflow()
    try:
        import tensorflow_datasets as tfds
    except ImportError:
        raise ConfigError("reading TFDS sources needs tensorflow-datasets: pip install tensorflow-datasets") from None
    try:
        return tfds.builder_from_directory(directory)
    except Exception as e:  # noqa: BLE001 - tfds raises many kinds
        raise ConfigError(f"cannot open the TFDS dataset {directory}: {e}") from None


def _tfds_examples(directory: str, path: str, field: str) -> Iterator[tuple[int, Any]]:
    info = _tfds_builder(directory).info
    if info.file_format.value == "array_record":
        raws = _array_records(path)
    else:
        raws = _tfrecords(path)
    for number, raw in enumerate(raws):
        value = info.features.deserialize_example_np(raw)
        for name in field.split("/"):
            value = value[name]
        if isinstance(value, (bytes, str)):
            yield number, value
        elif hasattr(value, "tolist") and all(isinstance(v, (bytes, str)) for v in value.tolist()):
            for item in value.tolist():  # a sequence of texts: several documents
                yield number, item
        else:
            yield number, BadRecord("not_text", f"feature '{field}' is {type(value).__name__}, not text")


def _array_records(path: str, chunk: int = 1024) -> Iterator[bytes]:
    reader = ArrayRecordReader(path)
    try:
        total = reader.num_records()
        for begin in range(0, total, chunk):
            yield from reader.read(begin, min(total, begin + chunk))
    finally:
        reader.close()


@lru_cache(maxsize=4)
def _decoder(tokenizer_path: str):
    path = Path(tokenizer_path)
    tok = Tokenizer.from_file(str(path / "tokenizer.json" if path.is_dir() else path))
    return tok


@lru_cache(maxsize=8)
def _framing_ids(dataset_dir: str) -> tuple[int | None, int | None]:
    meta = json.loads((Path(dataset_dir) / "meta.json").read_text())
    return meta.get("bos_id") if meta.get("add_bos", True) else None, meta.get("eos_id")


def _token_documents(path: str, tokenizer_path: str) -> Iterator[tuple[int, Any]]:
    bos_id, eos_id = _framing_ids(str(Path(path).parent.parent))
    tok = _decoder(tokenizer_path)
    number = 0
    for raw in _batched(_array_records(path), 256):
        documents = []
        for record in raw:
            ids = np.frombuffer(record, TOKEN_DTYPE)
            if len(ids) and ids[0] == bos_id:
                ids = ids[1:]
            if len(ids) and ids[-1] == eos_id:
                ids = ids[:-1]
            documents.append(ids.tolist())
        for text in tok.decode_batch(documents, skip_special_tokens=False):
            yield number, text
            number += 1


def _batched(items, size: int):
    batch = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch
