"""A safetensors file's header, read once and typed: names, shapes, dtypes, where each tensor's bytes
lie, the file's ``__metadata__`` and tracedump's capture order.

The header is the first thing read of a pass file, and a pass file may come from anywhere (another
tool, a damaged disk, a hand). Every entry is validated by one typed model (:class:`HeaderEntry`:
``dtype`` a string, ``shape`` non-negative integers, ``data_offsets`` two integers that lie inside
the file), so a bad one is a :class:`~tracedump.errors.DumpReadError` naming the file and the field,
never an ``OverflowError`` later. The header is at most :data:`MAX_HEADER` bytes and
:data:`~tracedump.store.jsonio.MAX_DEPTH` levels deep. Tracedump's own metadata is advice: a
capture order (``tracedump.order``) that is not a list of the file's names, each once, is passed
over for the file's own (sorted) order, as for a file tracedump did not write.
"""

from __future__ import annotations

import math
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from pydantic import ConfigDict, Field, TypeAdapter, with_config
from typing_extensions import TypedDict  # pydantic needs it, not typing's, before Python 3.12

from ..errors import DumpReadError
from .dtypes import CODES_ON_DISK_ORDER, ELEMENT_BITS, ELEMENT_BYTES
from .format import FORMAT_KEY, ORDER_KEY, SEQ_KEY, check_format
from .jsonio import LimitError, loads, validated

MAX_HEADER = 1 << 28  # bytes; a real header is names and offsets, far below this
MAX_OFFSET = 2**63 - 1  # a byte offset a file could hold
_MAX_DIM = 2**63 - 1


@dataclass(frozen=True)
class TensorInfo:
    """Shape and dtype of a stored tensor, known without reading its data."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor's bytes lie in its file (absolute offsets), and what they hold."""

    info: TensorInfo
    begin: int
    end: int


@dataclass(frozen=True, kw_only=True)
class SafetensorsHeader:
    """One safetensors file's header: tensors in capture order, metadata, capture sequence numbers."""

    path: Path
    tensors: dict[str, StoredTensor]
    metadata: dict[str, str]
    seq: dict[str, int] | None  # from SEQ_KEY; None when the file does not carry them

    @property
    def names(self) -> list[str]:
        return list(self.tensors)


Offset = Annotated[int, Field(ge=0, le=MAX_OFFSET)]


@with_config(ConfigDict(strict=True, extra="forbid"))
class HeaderEntry(TypedDict):
    """One tensor of a safetensors header, as the format defines it (a TypedDict: a header holds
    thousands, validated without building an object each)."""

    dtype: str
    shape: list[Annotated[int, Field(ge=0, le=_MAX_DIM)]]
    data_offsets: Annotated[list[Offset], Field(min_length=2, max_length=2)]  # [begin, end)


_ENTRIES = TypeAdapter(dict[str, HeaderEntry])
_METADATA = TypeAdapter(dict[str, str], config=ConfigDict(strict=True))


def open_regular(path: Path) -> Any:
    """Open ``path`` for reading only if it is a regular file: a FIFO or device under a pass file's
    name would block every reader forever (``stat`` does not open it, so it cannot block)."""
    if not stat.S_ISREG(os.stat(path).st_mode):
        raise DumpReadError(f"{path}: not a regular file")
    return path.open("rb")


def unreadable(path: Path, reason: str) -> DumpReadError:
    return DumpReadError(f"{path}: not a readable safetensors file ({reason})")


def read_header(path: Path) -> SafetensorsHeader:
    """Parse a safetensors header: an 8-byte little-endian length, then JSON ``{name: {dtype, shape,
    data_offsets}}``. Every tensor is checked to lie inside the file, so a truncated file fails here,
    with its name, rather than later inside a reader."""
    try:
        with open_regular(path) as handle:
            size = os.fstat(handle.fileno()).st_size
            prefix = handle.read(8)
            length = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else -1
            text = handle.read(length) if 0 <= length <= min(size - 8, MAX_HEADER) else None
    except OSError as e:
        raise DumpReadError(f"{path}: cannot read ({e.strerror or e})") from e
    if length < 0:
        raise unreadable(path, f"{size} bytes, shorter than a header")
    if text is None:
        raise unreadable(path, f"header length {length} does not fit the file's {size} bytes")
    try:
        header = loads(text, depth=None)  # HeaderEntry and __metadata__'s str values bound it
    except (ValueError, LimitError) as e:  # JSONDecodeError, UnicodeDecodeError, nested 100k deep
        raise unreadable(path, f"header is not JSON: {type(e).__name__}: {e}") from e
    return parse_header(path, header, 8 + length, size)


def parse_header(path: Path, header: Any, data_start: int, size: int) -> SafetensorsHeader:
    """The typed header of parsed JSON ``header`` (its data starts at ``data_start`` of ``size`` bytes)."""
    if not isinstance(header, dict):
        raise unreadable(path, "header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise unreadable(path, "__metadata__ is not a JSON object")
    check_format(metadata.get(FORMAT_KEY), path)
    metadata = validated(
        _METADATA.validate_python, metadata, lambda line: unreadable(path, "__metadata__ " + line)
    )
    entries = validated(_ENTRIES.validate_python, header, lambda line: unreadable(path, line))
    tensors: dict[str, StoredTensor] = {}
    for name, entry in entries.items():
        try:
            tensors[name] = _stored_tensor(entry, data_start)
        except ValueError as e:
            raise unreadable(path, f"bad header entry for {name!r}: {e}") from e
        if tensors[name].end > size:
            raise unreadable(path, f"truncated: {name!r} ends at byte {tensors[name].end}, file has {size}")
    order = _capture_order(metadata, tensors)
    return SafetensorsHeader(
        path=path, tensors={n: tensors[n] for n in order}, metadata=metadata, seq=_seq(metadata, order)
    )


def _stored_tensor(entry: HeaderEntry, data_start: int) -> StoredTensor:
    raw = entry["dtype"]
    name = CODES_ON_DISK_ORDER.get(raw, raw.lower())
    width = ELEMENT_BYTES.get(raw, 0)  # 0: a code we do not know (F4: a byte, a pair of values)
    shape = tuple(entry["shape"])
    if raw == "F4":  # as torch shapes it: the last dim in bytes (pairs of values)
        if not shape or shape[-1] % 2:
            raise ValueError(f"an F4 tensor of shape {list(shape)} does not fill whole bytes")
        shape = (*shape[:-1], shape[-1] // 2)
    begin, end = entry["data_offsets"]
    bits = ELEMENT_BITS.get(raw)  # float6: four values in three bytes, the whole tensor in whole bytes
    if bits and math.prod(shape) * bits % 8:
        raise ValueError(f"a {raw} tensor of shape {list(shape)} does not fill whole bytes")
    nbytes = math.prod(shape) * bits // 8 if bits else math.prod(shape) * width
    if not begin <= end or ((width or bits) and end - begin != nbytes):
        raise ValueError(f"data_offsets {[begin, end]} do not hold a {raw} tensor of shape {list(shape)}")
    return StoredTensor(TensorInfo(shape, name), data_start + begin, data_start + end)


def _json_list(metadata: dict[str, str], key: str) -> list[Any] | None:
    try:
        value = loads(metadata[key]) if key in metadata else None
    except ValueError:  # LimitError too
        return None
    return value if isinstance(value, list) else None


def _capture_order(metadata: dict[str, str], tensors: dict[str, StoredTensor]) -> list[str]:
    """The metadata's capture order: each of the file's names once, as strings; the file's own
    order (sorted names) for any other value (``[1]``, a name twice, a file not ours)."""
    order = _json_list(metadata, ORDER_KEY)
    if (
        order is not None
        and len(order) == len(tensors)
        and all(isinstance(name, str) for name in order)
        and set(order) == tensors.keys()
    ):
        return order
    return sorted(tensors)


def _seq(metadata: dict[str, str], order: list[str]) -> dict[str, int] | None:
    seq = _json_list(metadata, SEQ_KEY)
    if seq is None or len(seq) != len(order) or not all(type(s) is int for s in seq):
        return None
    return dict(zip(order, seq, strict=True))
