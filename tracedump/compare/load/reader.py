"""Zero-copy access to the tensors of pass files, as numpy arrays over a memory map.

The comparator computes with numpy on cache-sized chunks (see :mod:`..measure.metrics`), so it wants numpy
views of the file's bytes, not torch tensors: numpy has no bf16 or fp8, and torch refuses to hand
those to numpy. Here a safetensors file is mapped once and each tensor is a read-only numpy view of
its bytes (the page cache, read once, never copied into anonymous memory); bf16 and fp8 arrays hold
the raw bits (``uint16``/``uint8``) with the real dtype name beside them (:class:`Stored`), and
:func:`widen` makes them numbers (:mod:`..measure.metrics` chunk by chunk). Each dtype's storage comes from
the one dtype table, :mod:`tracedump.store.dtypes`. The header (names, shapes, offsets) is the loader's
(:func:`tracedump.store.loader.read_header`): this module only maps the data it describes.
"""

from __future__ import annotations

import functools
import math
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ...errors import DumpReadError
from ...store.dtypes import BITS_STORED, BY_NAME, NUMPY_STORAGE, TORCH_WIDENED
from ...store.format import dtype_name
from ...store.loader import SafetensorsHeader

if TYPE_CHECKING:  # `tracedump show` maps files with this module and never imports torch
    import torch

# dtype name -> numpy storage dtype (bit patterns for the float types numpy does not have)
_STORAGE: dict[str, np.dtype[Any]] = {name: np.dtype(storage) for name, storage in NUMPY_STORAGE.items()}


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


class GatheredRows(Stored):
    """Rows gathered along the first dim from several places (``--align tokens``: one sequence's
    rows out of every step that computed them), kept as the parts they were read as.

    Why: joining the parts copies every byte once more; the comparison reads each part where it
    lies instead (:func:`tracedump.compare.measure.metrics.compare_by_row`), and the joined ``array`` is
    made only when something else asks for it (docs/performance.md: the comparator).
    Every part has the same trailing shape and storage dtype."""

    def __init__(self, parts: Sequence[np.ndarray], dtype: str) -> None:
        if not parts:
            raise ValueError("no rows to gather")
        object.__setattr__(self, "parts", tuple(parts))
        object.__setattr__(self, "dtype", dtype)

    @functools.cached_property
    def array(self) -> np.ndarray:  # type: ignore[override]
        parts: tuple[np.ndarray, ...] = self.parts  # type: ignore[attr-defined]
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    @property
    def shape(self) -> tuple[int, ...]:
        parts: tuple[np.ndarray, ...] = self.parts  # type: ignore[attr-defined]
        return (sum(part.shape[0] for part in parts), *parts[0].shape[1:])

    def unjoined(self) -> tuple[np.ndarray, ...] | None:
        """The parts, while the joined array has not been made (then that one is read instead)."""
        return None if "array" in vars(self) else self.parts  # type: ignore[attr-defined]


def stored_from_torch(tensor: torch.Tensor) -> Stored:
    """Wrap a torch tensor (``.pt`` inputs, unshard results) without going through Python lists."""
    import torch

    tensor = tensor.detach().cpu().contiguous()
    dtype = dtype_name(tensor.dtype)
    if dtype in BITS_STORED:
        bits = torch.int16 if tensor.element_size() == 2 else torch.int8
        return Stored(tensor.view(bits).numpy().view(_STORAGE[dtype]), dtype)
    if tensor.dtype == torch.complex64:
        return Stored(torch.view_as_real(tensor).numpy(), dtype)
    return Stored(tensor.numpy(), dtype)


def widen(
    values: np.ndarray, dtype: str, work: type | None = None, out: np.ndarray | None = None
) -> np.ndarray:
    """The numbers stored ``values`` of ``dtype`` hold, as floats of ``work``; the one widening of
    the comparator (metrics' chunks, token rows, routers, unshard sums, ``tracedump show``).

    bf16 bits are shifted into fp32 (exactly); the fp8s go through torch, imported here, so a diff
    without fp8 never loads it; every other dtype is converted by numpy (float4's bytes stay byte
    values: compared bitwise). ``work`` None: float32, float64 kept. ``out``, a ``work`` buffer as
    long as ``values``, is written into instead of a new array; values already in ``work`` come
    back as they are (a view, never a copy)."""
    if work is None:
        work = np.float64 if values.dtype == np.float64 else np.float32
    target = np.dtype(work)
    if dtype == "bfloat16" and out is not None and target == np.float32:
        np.left_shift(values, 16, out=out.view(np.uint32), dtype=np.uint32)
        return out
    if dtype == "bfloat16":
        values = (values.astype(np.uint32) << 16).view(np.float32)
    elif dtype in TORCH_WIDENED:
        values = _widened_by_torch(values, dtype)
    if values.dtype == target:
        return values
    if out is None:
        return values.astype(target)
    np.copyto(out, values, casting="unsafe")
    return out


def _widened_by_torch(bits: np.ndarray, dtype: str) -> np.ndarray:
    """An fp8 tensor's bits as float32, widened by torch (numpy has no fp8)."""
    import torch

    real = getattr(torch, dtype, None)
    if real is None:  # a dump from a newer torch: its bytes are no numbers to this one
        raise ValueError(f"torch {torch.__version__} has no {dtype} to widen")
    return torch.from_numpy(np.array(bits, copy=True)).view(real).float().numpy()


def last_row_cut(stored: Stored, dim: int) -> Stored:
    """The last index along ``dim``, kept as a size-1 dim (a view): what ``last_row`` stores."""
    return Stored(stored.array[(slice(None),) * dim + (slice(-1, None),)], stored.dtype)


def _stored_shape(dtype: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of the numpy storage of a tensor of ``shape``: complex64 as (real, imag) float32
    pairs; a sub-byte dtype (float6) as its bytes, along the last dim where each row fills whole
    bytes, else flat."""
    if dtype == "complex64":
        return (*shape, 2)
    bits = BY_NAME[dtype].bits if dtype in BY_NAME else None
    if bits:
        if shape and shape[-1] * bits % 8 == 0:
            return (*shape[:-1], shape[-1] * bits // 8)
        return (math.prod(shape) * bits // 8,)
    return shape


class SafetensorsMap:
    """One safetensors file, described by its header: data mapped on first access, views handed out."""

    def __init__(self, header: SafetensorsHeader) -> None:
        self.header = header
        self._map: mmap.mmap | None = None

    def array(self, name: str) -> Stored:
        """The tensor's values, a read-only view of the mapped file. A tensor the diff cannot read
        (a dtype it does not know, bytes no longer in the file) is a DumpReadError naming the file
        and the tensor (exit 2): damaged input, never a row that reads as "diverged"."""
        stored = self.header.tensors[name]
        dtype, shape = stored.info.dtype, stored.info.shape
        numpy_dtype = _STORAGE.get(dtype)
        if numpy_dtype is None:
            raise DumpReadError(
                f"{self.header.path}: tensor {name!r} has dtype {dtype}, which tracedump cannot read"
            )
        shape = _stored_shape(dtype, shape)
        count = math.prod(shape)
        if count == 0:
            return Stored(np.empty(shape, numpy_dtype), dtype)
        mapped = self._mapped()
        now = min(len(mapped), mapped.size())  # size(): the file's, now (a page past it is a SIGBUS)
        if now < stored.end:  # cut short since its header was read, or since it was mapped
            raise DumpReadError(
                f"{self.header.path}: tensor {name!r} ends at byte {stored.end}, but the file now "
                f"has {now} bytes (truncated while being read)"
            )
        view = np.frombuffer(mapped, numpy_dtype, count, stored.begin)
        return Stored(view.reshape(shape), dtype)

    def _mapped(self) -> mmap.mmap:
        """The file mapped whole, once; a file shorter than its header says is refused here, before
        any page is touched (a page past the end of a mapped file is a SIGBUS, not an error)."""
        if self._map is None:
            path = self.header.path
            try:
                with path.open("rb") as handle:
                    size = os.fstat(handle.fileno()).st_size
                    needed = max((t.end for t in self.header.tensors.values()), default=0)
                    if size < needed:
                        raise DumpReadError(
                            f"{path}: the file has {size} bytes but its header describes {needed} "
                            "(truncated while being read)"
                        )
                    self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
            except (OSError, ValueError) as e:
                if isinstance(e, DumpReadError):
                    raise
                raise DumpReadError(f"{path}: cannot read its tensors ({e})") from e
        return self._map

    def close(self) -> None:
        """Drop the map. Views handed out keep it alive until they are gone (numpy holds a reference)."""
        self._map = None
