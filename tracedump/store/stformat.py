"""The safetensors format, written directly: an 8-byte length, a JSON header, the raw buffers.

Why not ``safetensors.torch.save_file``: a pass is already a set of contiguous host buffers, and the
only copy a write needs is the kernel's, into the page cache. Here the header is built in Python
and the tensors' own memory is handed to ``os.writev`` (no ``bytes`` made of any tensor), so a
captured byte is copied once at capture and once by the kernel. The bytes on disk are the ones
``save_file`` writes for the same tensors and metadata (tests/test_stformat.py checks it): tensors
sorted by dtype (safetensors' order, widest first) then name, offsets packed, the JSON compact and
padded with spaces to a multiple of 8. Only the order of the ``__metadata__`` keys can differ:
safetensors writes them from a hash map, in an order that changes from process to process; here
they keep their insertion order.

Importing this module does not import torch (``tracedump ls``/``show`` read headers without it).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import json
import os
import struct
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from .dtypes import CODES_ON_DISK_ORDER, DTYPES

if TYPE_CHECKING:
    import torch

_CODE_OF = {name: code for code, name in CODES_ON_DISK_ORDER.items()}
# safetensors lays tensors out by dtype (its ``Dtype`` enum, descending), then by name; checked
# against ``save_file`` (tests/test_stformat.py)
_RANK = {d.code: d.disk_rank for d in DTYPES if d.code is not None}
_IOV_MAX = 1024  # buffers per writev call (Linux's limit)
_MAX_WRITE = 1 << 30  # bytes per writev call, below the kernel's 2 GiB cap on a single write
PAUSABLE_CHUNK = 8 << 20  # bytes per writev call when the caller may pause between calls (~1 ms)
# ``fallocate(2)``'s signature, ``(fd, mode, offset, length) -> 0 or -1 with errno set``: libc's, or
# a stand-in given to :func:`write_file` (a test's refusing or full file system)
Fallocate = Callable[[int, int, int, int], int]


@functools.cache
def dtype_code(dtype: torch.dtype) -> str:
    """The safetensors code of a torch dtype (KeyError for one the format cannot hold); cached,
    since the writer asks it for every tensor of every pass."""
    return _CODE_OF[str(dtype).removeprefix("torch.")]


def layout(
    tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None
) -> tuple[bytes, list[str]]:
    """The file's first bytes (length + padded JSON header) and the names in on-disk order."""
    specs = {name: (dtype_code(t.dtype), list(t.shape), t.nbytes) for name, t in tensors.items()}
    order = sorted(specs, key=lambda name: (_RANK[specs[name][0]], name))
    header: dict[str, Any] = {} if metadata is None else {"__metadata__": dict(metadata)}
    offset = 0
    for name in order:
        code, shape, nbytes = specs[name]
        if code == "F4":
            shape = [*shape[:-1], shape[-1] * 2] if shape else [2]
        header[name] = {"dtype": code, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, order


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """A byte view of a contiguous CPU tensor's own memory (no copy), made from its address.

    Why not ``tensor.view(torch.uint8).numpy()``: that is four torch calls per tensor (5 µs on the
    bench machine, against 0.6 µs here), each of which lets go of the GIL and takes it back, so the
    writer thread, building a pass of small tensors, kept snatching the GIL from the host's forward
    (docs/performance.md). The caller keeps ``tensor`` alive while the view is used."""
    return memoryview((ctypes.c_char * tensor.nbytes).from_address(tensor.data_ptr())).cast("B")


def write_file(
    tensors: Mapping[str, torch.Tensor],
    path: str | os.PathLike[str],
    metadata: Mapping[str, str] | None = None,
    *,
    pause: Callable[[], None] | None = None,
    preallocate: bool | Fallocate = True,
) -> int:
    """Write ``tensors`` as a safetensors file at ``path`` (``save_file``'s arguments); returns its size.

    Tensors must be on the CPU; a non-contiguous one is made contiguous first (``save_file`` would
    refuse it). The buffers go to ``os.writev`` straight from the tensors' memory. ``pause`` is
    called before each ``writev`` of at most :data:`PAUSABLE_CHUNK` bytes: the writer thread waits
    there while the host computes (see :meth:`tracedump.dump.writer.Writer.wait_for_idle_host`).
    ``preallocate`` reserves the file's blocks first (:func:`_preallocate`): True, with libc's
    ``fallocate(2)`` where there is one (the default); False, never; or a function with its
    signature, as a file system that refuses it or is full would answer (the tests' seam). The
    bytes written are the same either way.
    """
    if sys.byteorder != "little":  # the format is little-endian: let safetensors swap the bytes
        from safetensors.torch import save_file

        save_file(
            {n: t.contiguous() for n, t in tensors.items()}, str(path), metadata=metadata and dict(metadata)
        )
        return os.stat(path).st_size
    dense = {name: t if t.is_contiguous() else t.contiguous() for name, t in tensors.items()}
    head, order = layout(dense, metadata)
    buffers = [memoryview(head), *(_bytes_of(dense[n]) for n in order if dense[n].numel())]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        _preallocate(fd, sum(b.nbytes for b in buffers), _allocator(preallocate))
        return _writev_all(fd, buffers, pause)
    finally:
        os.close(fd)


@functools.cache
def _fallocate() -> Fallocate | None:
    """Linux's ``fallocate(2)`` from libc, or None where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).fallocate
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    function.restype = ctypes.c_int
    return function


def _allocator(preallocate: bool | Fallocate) -> Fallocate | None:
    """What reserves the blocks: libc's ``fallocate`` for True (None where there is none), nothing
    for False, else the stand-in given."""
    if preallocate is True:
        return _fallocate()
    return None if preallocate is False else preallocate


def _preallocate(fd: int, nbytes: int, fallocate: Fallocate | None) -> None:
    """Reserve the file's blocks in one call before writing it: ext4 then skips the per-page block
    reservation of delayed allocation, and a pass reaches the page cache faster (docs/performance.md
    has the measurement). Not ``os.posix_fallocate``: where the file system cannot preallocate,
    glibc emulates it by writing zeros, a second write of every byte. A file system that cannot
    (tmpfs on old kernels, NFS, ...) is simply written without it; a full disk fails here, early."""
    if fallocate is None or nbytes == 0:
        return
    if fallocate(fd, 0, 0, nbytes) != 0:
        code = ctypes.get_errno()
        if code == errno.ENOSPC:
            raise OSError(code, os.strerror(code))


def _writev_all(fd: int, buffers: list[memoryview], pause: Callable[[], None] | None = None) -> int:
    """``writev`` until every buffer is written, resuming after short writes."""
    total = 0
    pending = [b for b in buffers if b.nbytes]
    limit = _MAX_WRITE if pause is None else PAUSABLE_CHUNK
    while pending:
        batch, size = [], 0
        for buffer in pending[:_IOV_MAX]:
            if size + buffer.nbytes > limit and batch:
                break
            batch.append(buffer[: limit - size] if size + buffer.nbytes > limit else buffer)
            size += batch[-1].nbytes
        if pause is not None:
            pause()
        written = os.writev(fd, batch)
        if written <= 0:
            raise OSError(f"writev wrote {written} bytes")
        total += written
        while written:
            head = pending[0]
            if written >= head.nbytes:
                written -= head.nbytes
                pending.pop(0)
            else:
                pending[0] = head[written:]
                written = 0
    return total
