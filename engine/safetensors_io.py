"""Safetensors files read and written one tensor at a time, bfloat16 included.

The format (https://github.com/huggingface/safetensors): an 8-byte little-endian header
length, a JSON header {name: {dtype, shape, data_offsets}, "__metadata__": {...}}, then the
raw little-endian bytes. The `safetensors` package's numpy API has no bfloat16, so this
small reader memory-maps the file and views each tensor with ml_dtypes' bfloat16: a tensor
costs nothing until it is copied, and a whole checkpoint never has to fit in memory twice.
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path
from typing import Iterator

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
NAMES = {dtype: name for name, dtype in DTYPES.items()}


class SafetensorsFile:
    """A memory-mapped .safetensors file: `names()`, `shape(name)`, `dtype(name)`, `get(name)`."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            self.header = json.loads(f.read(header_len))
            self._data_start = 8 + header_len
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if f.seek(0, 2) > 0 else None
        self.metadata = self.header.pop("__metadata__", {}) or {}

    def names(self) -> list[str]:
        return list(self.header)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def dtype(self, name: str) -> np.dtype:
        code = self.header[name]["dtype"]
        if code not in DTYPES:
            raise ValueError(f"{self.path}: tensor '{name}' has unsupported dtype {code}")
        return DTYPES[code]

    def get(self, name: str) -> np.ndarray:
        """A read-only view into the mapped file (copy it to keep it past close())."""
        begin, end = self.header[name]["data_offsets"]
        count = int(np.prod(self.shape(name), dtype=np.int64))
        array = np.frombuffer(self._map, self.dtype(name), count, self._data_start + begin) if count else (
            np.zeros(0, self.dtype(name)))
        assert array.nbytes == end - begin, f"{self.path}: tensor '{name}' has inconsistent offsets"
        return array.reshape(self.shape(name))

    def close(self) -> None:
        """Unmap now if no view is alive; otherwise when the last view is garbage-collected."""
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                pass

    def __enter__(self) -> "SafetensorsFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_safetensors(path: str | Path, tensors: Iterator[tuple[str, np.ndarray]] | list, metadata: dict | None = None,
                      shapes: dict[str, tuple[tuple[int, ...], np.dtype]] | None = None) -> int:
    """Write (name, array) pairs in order; returns bytes of tensor data written.

    `shapes` (name -> (shape, dtype), in write order) lets the header be written first and
    the arrays be produced lazily by the iterator, so only one is in memory at a time.
    """
    if shapes is None:
        tensors = list(tensors)
        shapes = {name: (array.shape, array.dtype) for name, array in tensors}
    header: dict = {"__metadata__": {k: str(v) for k, v in (metadata or {}).items()}}
    offset = 0
    for name, (shape, dtype) in shapes.items():
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        header[name] = {"dtype": NAMES[np.dtype(dtype)], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, array in tensors:
            shape, dtype = shapes[name]
            assert array.shape == tuple(shape) and array.dtype == dtype, f"{name}: {array.shape} {array.dtype}"
            f.write(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)  # little-endian hosts
    return offset
