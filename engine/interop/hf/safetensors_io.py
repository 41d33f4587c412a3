"""Safetensors files read and written one tensor at a time, bfloat16 included.

The format (https://github.com/huggingface/safetensors): an 8-byte little-endian header
length, a JSON header {name: {dtype, shape, data_offsets}, "__metadata__": {...}}, then the
raw little-endian bytes. The `safetensors` package's numpy API has no bfloat16, so this
small reader reads one tensor at a time (pread into a fresh array, viewed with ml_dtypes'
bfloat16). Unlike a memory map, nothing read stays resident in the process: converting a
checkpoint holds the result and one tensor, not the source file too.
"""

from __future__ import annotations

import json
import os
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
    """An open .safetensors file: `names()`, `shape(name)`, `dtype(name)`, `get(name)`."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_RDONLY)
        (header_len,) = struct.unpack("<Q", os.pread(self._fd, 8, 0))
        self.header = json.loads(os.pread(self._fd, header_len, 8))
        self._data_start = 8 + header_len
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
        """The tensor, read from disk into a new array."""
        begin, end = self.header[name]["data_offsets"]
        array = np.empty(self.shape(name), self.dtype(name))
        if array.nbytes != end - begin:
            raise ValueError(f"{self.path}: tensor '{name}' has {end - begin} bytes for shape {list(array.shape)}")
        buffer, done = array.reshape(-1).view(np.uint8), 0
        while done < array.nbytes:  # pread may return less than asked for
            chunk = os.preadv(self._fd, [buffer[done:]], self._data_start + begin + done)
            if chunk == 0:
                raise ValueError(f"{self.path}: file ends inside tensor '{name}'")
            done += chunk
        return array

    def close(self) -> None:
        os.close(self._fd)

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
