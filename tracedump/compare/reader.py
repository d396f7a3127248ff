"""Zero-copy access to the tensors of pass files, as numpy arrays over a memory map.

The comparator computes with numpy on cache-sized chunks (see :mod:`.metrics`), so it wants numpy
views of the file's bytes, not torch tensors: numpy has no bf16 or fp8, and torch refuses to hand
those to numpy. Here a safetensors file is mapped once and each tensor is a read-only numpy view of
its bytes (the page cache, read once, never copied into anonymous memory); bf16 and fp8 arrays hold
the raw bits (``uint16``/``uint8``) with the real dtype name beside them (:class:`Stored`), and
:mod:`.metrics` widens them chunk by chunk. The header (names, shapes, offsets) is the loader's
(:func:`tracedump.store.loader.read_header`): this module only maps the data it describes.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..store.format import dtype_name
from ..store.loader import SafetensorsHeader

if TYPE_CHECKING:  # `tracedump show` maps files with this module and never imports torch
    import torch

# dtype name -> numpy storage dtype (bit patterns for the float types numpy does not have)
_STORAGE: dict[str, Any] = {
    "float64": np.float64,
    "float32": np.float32,
    "float16": np.float16,
    "bfloat16": np.uint16,
    "float8_e4m3fn": np.uint8,
    "float8_e5m2": np.uint8,
    "float8_e4m3fnuz": np.uint8,
    "float8_e5m2fnuz": np.uint8,
    "float8_e8m0fnu": np.uint8,
    "float4_e2m1fn_x2": np.uint8,  # compared bitwise: torch cannot widen it
    "complex64": np.float32,  # as (real, imag) pairs: twice the values, each compared as a float
    "int64": np.int64,
    "int32": np.int32,
    "int16": np.int16,
    "int8": np.int8,
    "uint64": np.uint64,
    "uint32": np.uint32,
    "uint16": np.uint16,
    "uint8": np.uint8,
    "bool": np.bool_,
}
# torch dtypes numpy cannot hold: stored as their bits, in the same-width unsigned ints of _STORAGE.
_BITS_VIEW = frozenset(name for name in _STORAGE if name.startswith(("bfloat", "float8", "float4")))


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
        import torch

        tensor = torch.from_numpy(np.array(self.array, copy=True))
        real = getattr(torch, self.dtype)
        if real.is_complex:
            return torch.view_as_complex(tensor.reshape(*tensor.shape[:-1], -1, 2)).reshape(tensor.shape[:-1])
        return tensor.view(real) if tensor.dtype != real else tensor


def stored_from_torch(tensor: torch.Tensor) -> Stored:
    """Wrap a torch tensor (``.pt`` inputs, unshard results) without going through Python lists."""
    import torch

    tensor = tensor.detach().cpu().contiguous()
    dtype = dtype_name(tensor.dtype)
    if dtype in _BITS_VIEW:
        bits = torch.int16 if tensor.element_size() == 2 else torch.int8
        return Stored(tensor.view(bits).numpy().view(_STORAGE[dtype]), dtype)
    if tensor.dtype == torch.complex64:
        return Stored(torch.view_as_real(tensor).numpy(), dtype)
    return Stored(tensor.numpy(), dtype)


def last_row_cut(stored: Stored, dim: int) -> Stored:
    """The last index along ``dim``, kept as a size-1 dim (a view): what ``last_row`` stores."""
    return Stored(stored.array[(slice(None),) * dim + (slice(-1, None),)], stored.dtype)


class SafetensorsMap:
    """One safetensors file, described by its header: data mapped on first access, views handed out."""

    def __init__(self, header: SafetensorsHeader) -> None:
        self.header = header
        self._map: mmap.mmap | None = None

    def array(self, name: str) -> Stored:
        stored = self.header.tensors[name]
        dtype, shape = stored.info.dtype, stored.info.shape
        numpy_dtype = _STORAGE.get(dtype)
        if numpy_dtype is None:
            raise ValueError(f"{self.header.path}: tensor {name!r} has dtype {dtype}, which diff cannot read")
        if dtype == "complex64":
            shape = (*shape, 2)  # (real, imag) float32 pairs
        count = math.prod(shape)
        if count == 0:
            return Stored(np.empty(shape, numpy_dtype), dtype)
        if self._map is None:
            with self.header.path.open("rb") as handle:
                self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        view = np.frombuffer(self._map, numpy_dtype, count, stored.begin)
        return Stored(view.reshape(shape), dtype)

    def close(self) -> None:
        """Drop the map. Views handed out keep it alive until they are gone (numpy holds a reference)."""
        self._map = None
