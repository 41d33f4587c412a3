"""Safetensors files read and written one tensor at a time, bfloat16 included.

Reading is the `safetensors` package: `safe_open(..., framework="numpy", backend="pread")`
checks the header and returns bfloat16 tensors as ml_dtypes arrays (numpy knows the name
'bfloat16' once ml_dtypes is imported, as it is here). The pread backend
copies each tensor into a fresh array instead of mapping the file, so nothing read stays
resident in the process: converting a checkpoint holds the result and the tensors in
flight, not the source file too.

Writing is by hand. The package's writers take every tensor of a file at once
(`safetensors.numpy.save_file` a dict of arrays, `serialize_file` a dict of pointers that
must all stay valid during the call), so a shard would be in memory twice over: the model
plus its HF-layout (transposed) copy. The format is small enough to write directly
(https://github.com/huggingface/safetensors: an 8-byte little-endian header length, a JSON
header {name: {dtype, shape, data_offsets}, "__metadata__": {...}}, then the raw
little-endian bytes), so `write_safetensors` writes the header first and then each array as
an iterator produces it: one HF-layout copy at a time. Tests read what it writes back with
the package and with transformers.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

from engine.config import ConfigError

DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
NAMES = {dtype: name for name, dtype in DTYPES.items()}


class SafetensorsFile:
    """An open .safetensors file: `names()`, `shape(name)`, `dtype(name)`, `get(name)`.
    A file that is not valid safetensors (a bad header, offsets past its end) is a
    ConfigError naming it."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self._file = safe_open(self.path, framework="numpy", backend="pread")
        except (SafetensorError, OSError) as e:
            raise ConfigError(f"{self.path}: not a readable safetensors file ({e})") from None
        self.metadata = self._file.metadata() or {}
        self._names = list(self._file.offset_keys())  # file order: reading them in it is sequential
        self._slices = {name: self._file.get_slice(name) for name in self._names}  # header only

    def names(self) -> list[str]:
        return list(self._names)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slices[name].get_shape())

    def dtype(self, name: str) -> np.dtype:
        code = self._slices[name].get_dtype()
        if code not in DTYPES:
            raise ConfigError(f"{self.path}: tensor '{name}' has unsupported dtype {code}")
        return DTYPES[code]

    def get(self, name: str) -> np.ndarray:
        """The tensor, read from disk into a new (read-only) array."""
        return self._file.get_tensor(name)

    def close(self) -> None:
        self._slices.clear()
        self._file.__exit__(None, None, None)

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_safetensors(
    path: str | Path,
    tensors: Iterator[tuple[str, np.ndarray]] | list,
    metadata: dict | None = None,
    shapes: dict[str, tuple[tuple[int, ...], np.dtype]] | None = None,
) -> int:
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
        header[name] = {
            "dtype": NAMES[np.dtype(dtype)],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
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
