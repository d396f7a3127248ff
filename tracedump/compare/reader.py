"""Zero-copy access to the tensors of pass files, as numpy arrays over a memory map.

The comparator computes with numpy on cache-sized chunks (see :mod:`.metrics`), so it wants numpy
views of the file's bytes, not torch tensors: numpy has no bf16 or fp8, and torch refuses to hand
those to numpy. Here a safetensors file is mapped once and each tensor is a read-only numpy view of
its bytes (the page cache, read once, never copied into anonymous memory); bf16 and fp8 arrays hold
the raw bits (``uint16``/``uint8``) with the real dtype name beside them (:class:`Stored`), and
:mod:`.metrics` widens them chunk by chunk. The format is simple enough to read directly: an 8-byte
little-endian header length, a JSON header ``{name: {dtype, shape, data_offsets}}``, then the data.
"""

from __future__ import annotations

import json
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

# safetensors dtype -> (tracedump dtype name, numpy storage dtype)
_SAFETENSORS: dict[str, tuple[str, Any]] = {
    "F64": ("float64", np.float64),
    "F32": ("float32", np.float32),
    "F16": ("float16", np.float16),
    "BF16": ("bfloat16", np.uint16),
    "F8_E4M3": ("float8_e4m3fn", np.uint8),
    "F8_E5M2": ("float8_e5m2", np.uint8),
    "I64": ("int64", np.int64),
    "I32": ("int32", np.int32),
    "I16": ("int16", np.int16),
    "I8": ("int8", np.int8),
    "U64": ("uint64", np.uint64),
    "U32": ("uint32", np.uint32),
    "U16": ("uint16", np.uint16),
    "U8": ("uint8", np.uint8),
    "BOOL": ("bool", np.bool_),
}
_MAX_HEADER = 1 << 28  # bytes; a real header is names and offsets, far below this
# torch dtypes numpy cannot hold: stored as same-width integer bits.
_BITS_VIEW = {
    torch.bfloat16: (torch.int16, np.uint16),
    torch.float8_e4m3fn: (torch.int8, np.uint8),
    torch.float8_e5m2: (torch.int8, np.uint8),
}


@dataclass(frozen=True)
class Stored:
    """A tensor's values as numpy storage plus its real dtype name (``bfloat16`` for uint16 bits)."""

    array: np.ndarray
    dtype: str

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.array.shape)

    def to_torch(self) -> torch.Tensor:
        """A torch tensor with the real dtype (a copy: torch wants writable memory)."""
        tensor = torch.from_numpy(np.array(self.array, copy=True))
        real = getattr(torch, self.dtype)
        return tensor.view(real) if tensor.dtype != real else tensor


def stored_from_torch(tensor: torch.Tensor) -> Stored:
    """Wrap a torch tensor (``.pt`` inputs, unshard results) without going through Python lists."""
    tensor = tensor.detach().cpu().contiguous()
    dtype = str(tensor.dtype).removeprefix("torch.")
    if tensor.dtype in _BITS_VIEW:
        bits, numpy_dtype = _BITS_VIEW[tensor.dtype]
        return Stored(tensor.view(bits).numpy().view(numpy_dtype), dtype)
    return Stored(tensor.numpy(), dtype)


@dataclass(frozen=True)
class _Entry:
    dtype: str
    numpy_dtype: Any
    shape: tuple[int, ...]
    begin: int
    end: int


class SafetensorsMap:
    """One safetensors file: header parsed at once, data mapped on first access, views handed out."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            if length > min(path.stat().st_size - 8, _MAX_HEADER):
                raise ValueError(f"header length {length} does not fit the file: not a safetensors file")
            header = json.loads(handle.read(length))
        self._data_start = 8 + length
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self._entries: dict[str, _Entry] = {}
        for name, spec in header.items():
            dtype, numpy_dtype = _SAFETENSORS.get(spec["dtype"], (spec["dtype"].lower(), None))
            begin, end = spec["data_offsets"]
            self._entries[name] = _Entry(dtype, numpy_dtype, tuple(spec["shape"]), begin, end)
        self._map: mmap.mmap | None = None

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    @property
    def names(self) -> list[str]:
        return list(self._entries)

    def info(self, name: str) -> tuple[tuple[int, ...], str]:
        entry = self._entries[name]
        return entry.shape, entry.dtype

    def array(self, name: str) -> Stored:
        entry = self._entries[name]
        if entry.numpy_dtype is None:
            raise ValueError(f"{self.path}: tensor {name!r} has dtype {entry.dtype}, which diff cannot read")
        count = int(np.prod(entry.shape, dtype=np.int64))
        if count == 0:
            return Stored(np.empty(entry.shape, entry.numpy_dtype), entry.dtype)
        if self._map is None:
            with open(self.path, "rb") as handle:
                self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        view = np.frombuffer(self._map, entry.numpy_dtype, count, self._data_start + entry.begin)
        return Stored(view.reshape(entry.shape), entry.dtype)

    def close(self) -> None:
        """Drop the map. Views handed out keep it alive until they are gone (numpy holds a reference)."""
        self._map = None
