"""Recycled host buffers for captures.

A fresh host buffer per capture costs a page fault per 4 KiB page on first touch: a clone into new
memory runs several times slower than a copy into memory already mapped (docs/performance.md).
Passes of one engine repeat the same tensor sizes, so the writer hands each buffer back once its
pass is on disk and the next pass copies into it. Free buffers count against the pending-bytes cap
together with the passes not yet written and the open pass: when a capture would exceed the cap
the pool is emptied first (:meth:`tracedump.dump.sinks.FileSink.make_room`), so pooling keeps the
bound of cap + one tensor.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import torch


class HostBufferPool:
    """Free host storages keyed by (bytes, pinned), bounded by a byte budget shared with the writer.

    ``reused`` and ``allocated`` count the buffers :meth:`empty_like` handed out from the pool and
    freshly: whether recycling works is read there (tests, benchmarks), not inferred from timing.
    """

    def __init__(self, smallest: int = 0) -> None:
        self.smallest = smallest  # storages below this many bytes are not kept (never asked for)
        self._free: dict[tuple[int, bool], list[torch.UntypedStorage]] = {}
        self._free_bytes = 0
        self._lock = threading.Lock()
        self.reused = 0
        self.allocated = 0

    @property
    def free_bytes(self) -> int:
        return self._free_bytes

    def empty_like(self, source: torch.Tensor, pinned: bool) -> torch.Tensor:
        """An uninitialised contiguous host tensor with ``source``'s shape and dtype."""
        nbytes = source.numel() * source.element_size()
        storage = self._take(nbytes, pinned)
        if storage is None:
            self.allocated += 1
            return torch.empty(source.shape, dtype=source.dtype, device="cpu", pin_memory=pinned)
        self.reused += 1
        return torch.empty(0, dtype=source.dtype).set_(storage, 0, source.shape)

    def give_back(self, tensors: Iterable[torch.Tensor], room: int) -> None:
        """Keep the storages of written tensors while the free bytes stay within ``room``."""
        with self._lock:
            for tensor in tensors:
                if tensor.nbytes < self.smallest:  # a clone (copy_to_host): not worth keeping
                    continue
                storage = tensor.untyped_storage()
                nbytes = storage.nbytes()
                if nbytes == 0 or self._free_bytes + nbytes > room:
                    continue
                self._free.setdefault((nbytes, storage.is_pinned()), []).append(storage)
                self._free_bytes += nbytes

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._free_bytes = 0

    def _take(self, nbytes: int, pinned: bool) -> torch.UntypedStorage | None:
        with self._lock:
            stack = self._free.get((nbytes, pinned))
            if not stack:
                return None
            self._free_bytes -= nbytes
            return stack.pop()
