"""CUDA guards: graph capture, sync debug mode, device-to-host copies.

Everything here runs on a CPU-only host without touching CUDA: ``torch.cuda`` functions are looked
up at call time (so tests can fake them) and every probe tolerates a build without CUDA.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch

from .buffers import HostBufferPool
from .runtime import warn_once

SyncEscape = Callable[[], AbstractContextManager[Any]]


# The probe as torch ships it, and whether this torch was built without CUDA: there it always
# raises (a dummy binding), so the answer is known without the exception (a few µs per capture).
_SHIPPED_PROBE = torch.cuda.is_current_stream_capturing
_NO_CUDA_BUILD = not torch.backends.cuda.is_built()
# Below this many bytes a capture is a ``clone()`` (one op; the allocator hands back memory it
# freed a moment ago), above it a copy into a recycled buffer (a fresh large allocation page-faults
# on every page). Measured on the bench machine: clone 1.6 µs and pool 3-5 µs at 8 KiB, the same
# at 256 KiB, clone 1.7x slower at 4 MiB (docs/performance.md).
POOLED_FROM_BYTES = 512 << 10


def stream_is_capturing() -> bool:
    """True while the current CUDA stream records a graph: a copy now would break the capture.

    ``torch.cuda.is_current_stream_capturing`` never creates a CUDA context; on a CPU-only build it
    raises, which means "no" (answered without calling it, unless something replaced it).
    """
    probe = torch.cuda.is_current_stream_capturing
    if _NO_CUDA_BUILD and probe is _SHIPPED_PROBE:
        return False
    try:
        return bool(probe())
    except (RuntimeError, AssertionError, AttributeError):
        return False


def _sync_debug_mode() -> int:
    try:
        return int(torch.cuda.get_sync_debug_mode())
    except (RuntimeError, AssertionError, AttributeError):  # no CUDA in this build or on this host
        return 0


@contextlib.contextmanager
def allow_sync() -> Iterator[None]:
    """Lift ``torch.cuda`` sync debug mode for the block and restore it, even if the block raises.

    Engines run with ``set_sync_debug_mode("error")`` to catch accidental syncs; tracedump's own
    copies are deliberate, so they are let through here and nowhere else.
    """
    previous = _sync_debug_mode()
    if previous:
        torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        if previous:
            torch.cuda.set_sync_debug_mode(previous)


def resolve_cuda_graph(requested: bool, dumper: Any) -> bool:
    """Whether the engine may use CUDA graphs: not while dumping, since a replay fires no hook;
    yes with ``COMPILED=1``, whose taps captured into a graph run at each replay
    (:mod:`tracedump.dump.replays`)."""
    if _compiled(dumper):
        return requested
    return _refused_while_dumping(
        requested,
        dumper,
        "cuda_graph",
        "tracedump: CUDA graphs disabled because dumping is on (forward hooks never fire during graph "
        "replay). Unset the dump dir to get them back, or set TRACEDUMP_DUMP_COMPILED=1 and compile "
        "the model: its taps are replayed with the graph.",
    )


def resolve_compile(requested: bool, dumper: Any) -> bool:
    """Whether the engine may ``torch.compile``: not while dumping, since a compiled graph runs no
    capture hook; yes with ``COMPILED=1``, whose taps are operations of the graph."""
    if _compiled(dumper):
        return requested
    return _refused_while_dumping(
        requested,
        dumper,
        "compile",
        "tracedump: torch.compile disabled because dumping is on (hooks added to a compiled module are "
        "ignored, and a copy inside a hook breaks the graph).",
    )


def _compiled(dumper: Any) -> bool:
    return bool(getattr(getattr(dumper, "settings", None), "compiled", False))


def _refused_while_dumping(requested: bool, dumper: Any, key: str, message: str) -> bool:
    if requested and dumper is not None:
        warn_once(key, message)
        return False
    return requested


def copy_to_host(
    tensor: torch.Tensor, sync_escape: SyncEscape | None, pool: HostBufferPool | None = None
) -> tuple[torch.Tensor, Any]:
    """A contiguous host copy of ``tensor`` and, for device tensors, the event that marks it done.

    CPU tensors get a plain synchronous copy. Device tensors are copied with ``non_blocking=True``
    into pinned memory on the *current* stream: later kernels on that stream, which may overwrite the
    buffer in place, are ordered after the copy. The writer thread waits on the event, the forward
    does not. ``pool`` supplies recycled buffers (see :mod:`tracedump.dump.buffers`).
    """
    if tensor.is_cpu:  # the hot path: as few torch calls as the copy allows
        source = tensor.detach() if tensor.requires_grad else tensor
        if pool is None or source.nbytes < POOLED_FROM_BYTES:
            return source.clone(memory_format=torch.contiguous_format), None
        return pool.empty_like(source, False).copy_(source), None
    source = tensor.detach()
    # Only CUDA copies are made asynchronous (pinned buffer + an event the writer waits on); other
    # accelerators get a synchronous copy, since no event here would tell the writer it landed.
    is_cuda = source.device.type == "cuda"
    escape = sync_escape() if sync_escape is not None else contextlib.nullcontext()
    with allow_sync(), escape:
        host = _host_buffer(source, is_cuda, pool)
        host.copy_(source, non_blocking=is_cuda)
        event = _record_event(source.device) if is_cuda else None
    return host, event


def _host_buffer(source: torch.Tensor, pinned: bool, pool: HostBufferPool | None) -> torch.Tensor:
    if pool is not None:
        return pool.empty_like(source, pinned)
    return torch.empty(source.shape, dtype=source.dtype, device="cpu", pin_memory=pinned)


def _record_event(device: torch.device) -> Any:
    """An event on the stream the copy was queued on: the source device's current stream, which
    need not be the current device's (layers spread over GPUs)."""
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def wait_for(event: Any) -> None:
    """Block the calling (writer) thread until a device copy has landed."""
    if event is not None:
        event.synchronize()
