"""Files on disk: the background writer thread, the pass files, the manifest (all written through
:mod:`tracedump.store.fsio`).

The forward hands finished passes to a bounded queue; one thread serialises them, so disk time
overlaps the next step. Host memory held by captures not yet on disk is capped
(``MAX_PENDING_BYTES``): a step that would exceed the cap waits, and nothing is dropped. The first
write error (disk full, permissions) stops dumping, is reported once, and the manifest records it.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..store.dtypes import CODES_ON_DISK_ORDER
from ..store.format import (
    MANIFEST,
    ORDER_KEY,
    STATS_FILE,
    STATS_PARTIAL,
    Manifest,
    capture_stats_record,
    pass_file_name,
    pass_metadata,
    with_numbers,
)
from ..store.fsio import (
    SpaceReserve,
    atomic_path,
    json_text,
    move_into_place,
    open_for_append,
    write_text_atomic,
)
from ..store.reduce import StatsValues, stats_numbers
from ..store.stformat import write_file as save_file  # safetensors' bytes, written from the buffers
from .buffers import HostBufferPool
from .cuda import POOLED_FROM_BYTES, wait_for
from .torch_compat import safetensors_writable_dtypes

_MANIFEST_INTERVAL_S = 1.0
_MANIFEST_SHARE = 100  # a manifest write waits at least this many times its own duration
MANIFEST_RESERVE = ".manifest.reserve"  # the disk space kept for the manifest (store.fsio.SpaceReserve)
_RESERVE_MARGIN = 16 << 10  # what the manifest may grow by at close: skipped counts, errors, end time


def reserve_for(manifest_bytes: int) -> int:
    """The space kept for a manifest of ``manifest_bytes``: room for its next version written
    beside it (twice its size, at least 16 KiB more), so the last version lands on a full disk."""
    return max(2 * manifest_bytes, manifest_bytes + _RESERVE_MARGIN)


# Tensor names a safetensors file cannot hold: its header keeps the metadata under this key.
RESERVED_NAMES = frozenset({"__metadata__"})
# The dtypes a pass file holds (what safetensors writes and reads back); any other dtype is skipped
# and counted as ``unsupported_tensor``, since one such tensor would make the whole file unwritable.
_OUR_DTYPES = frozenset(getattr(torch, name) for name in CODES_ON_DISK_ORDER.values() if hasattr(torch, name))
# An older safetensors writes fewer of them: it lists what it can write in a private table.
_WRITABLE = safetensors_writable_dtypes() or _OUR_DTYPES
STORABLE_DTYPES = _OUR_DTYPES & _WRITABLE


def storable(tensor: torch.Tensor) -> bool:
    """Whether a pass file can hold ``tensor``: one that cannot (``complex128``, sparse, meta,
    quantized, nested: a nested tensor's layout says strided, but it has no sizes) would make the
    whole file unwritable, so it is skipped and counted instead."""
    return (  # a quantized tensor's dtype (qint8, ...) is never one of ours: the dtype test covers it
        tensor.dtype in STORABLE_DTYPES
        and tensor.layout == torch.strided
        and not tensor.is_nested
        and not tensor.is_meta
    )


def save_tensors_atomic(
    path: Path,
    tensors: dict[str, torch.Tensor],
    metadata: dict[str, str],
    *,
    pause: Callable[[], None] | None = None,
) -> int:
    """Save as safetensors (no pickle) with the capture order in the metadata; returns bytes written.

    The tensors' memory goes to the kernel as it is (:mod:`tracedump.store.stformat`): one copy per byte,
    into the page cache, and none of a tensor turned into ``bytes`` first. ``pause`` runs between
    the file's chunks."""
    with atomic_path(path) as tmp:
        order = json.dumps(list(tensors))
        save_file(tensors, str(tmp), metadata={**metadata, ORDER_KEY: order}, pause=pause)
        return tmp.stat().st_size  # the rename still happens, on leaving the block


@dataclass(frozen=True, kw_only=True)
class PassJob:
    """One pass file (or one part of a pass too large for the memory cap). Built by keyword: nine
    fields, several of the same type, that a positional call would silently swap."""

    index: int
    part: int | None
    mode: str
    entries: list[tuple[str, torch.Tensor, Any]]
    nbytes: int  # what the job holds against the memory cap (not always its entries' size)
    file_name: str | None = None  # a file other than the pass's own (records.safetensors)
    seqs: list[int] | None = None  # stats mode: where each entry stands in the pass's capture order
    truncated: bool = False  # the forward that made the pass was cut short (Recorder.close_pass)
    batch: str | None = None  # Dumper.set_batch(): each token row's sequence, position, token id

    def run(self, writer: Writer) -> None:
        for _, _, event in self.entries:
            wait_for(event)
        name = self.file_name or pass_file_name(self.index, self.part)
        metadata = pass_metadata(
            self.index, self.mode, part=self.part, seqs=self.seqs, truncated=self.truncated, batch=self.batch
        )
        tensors = {k: t for k, t, _ in self.entries}
        size = save_tensors_atomic(writer.run_dir / name, tensors, metadata, pause=writer.wait_for_idle_host)
        writer.note_file(self.index, size, is_pass=self.file_name is None)
        writer.recycle([t for _, t, _ in self.entries], self.nbytes)


# A stats capture's record as capture_stats_record's arguments (module, path, is_input, call, pass,
# seq, extras): the record is made here, in the writer thread, not in the host's forward.
StatsFields = tuple[str, str, bool, int, int, int, dict[str, object]]


@dataclass
class StatsJob:
    """Statistics of one pass: scalars only, appended to ``stats.jsonl`` as one JSON line per tensor.

    Each capture arrives as its record's fields, the names of its numeric statistics and their
    values (:data:`~tracedump.store.reduce.StatsValues`: Python floats, the C sweep's raw sums, or a
    float64 tensor still on its way to the host), and the event of that copy."""

    index: int
    records: list[tuple[StatsFields, Sequence[str], StatsValues, Any]]
    nbytes: int = 0

    def run(self, writer: Writer) -> None:
        lines = []
        for fields, names, values, event in self.records:
            wait_for(event)
            record = with_numbers(capture_stats_record(*fields), names, stats_numbers(values))
            lines.append(json.dumps(record, allow_nan=False))
        writer.append_stats(lines)
        writer.note_file(self.index, 0, is_pass=True)


Job = PassJob | StatsJob


@dataclass(kw_only=True)
class WriterTotals:
    """What the writer wrote and dropped, for the manifest and the summary line. Mutable (the writer
    counts into it), so not frozen; keyword-only like every record of more than three fields."""

    passes: set[int] = field(default_factory=set)
    bytes: int = 0
    files: int = 0
    dropped_jobs: int = 0
    dropped_captures: int = 0
    dropped_bytes: int = 0


WRITER_NICE = 19  # the lowest CPU priority: the writer runs in the host's idle time
# How long a queued pass may wait for the host to pause while forwards that take every core run
# (see Writer.host_busy). After that the writer writes beside the forwards, as before, until it has
# caught up with the queue: a host that never pauses (back-to-back steps, one long forward) still
# has its passes written, and does not fill the memory cap with them.
MAX_HOLD_BACK_S = 1.0


def _yield_cpu_to_host() -> None:
    """Give the calling (writer) thread the lowest CPU priority, on Linux, where a thread's nice
    value is its own.

    Why: torch keeps every core busy during a forward, and its intra-op threads meet at a barrier
    after each parallel op, so a writer thread that takes a core from one of them stalls them all
    (at the host's priority, back-to-back steps of the bench model ran far slower while the
    writer worked beside them: docs/performance.md); at nice 19 it mostly waits for idle
    time (between steps, or while the host waits on the memory cap or a flush, when it runs at
    full speed), and
    :meth:`Writer.host_busy` makes it wait outright while such a forward runs. Nothing is dropped:
    the memory cap still bounds what waits.
    Unprivileged, so it cannot fail for lack of rights; any error leaves the priority as it was."""
    if not sys.platform.startswith("linux") or not hasattr(os, "setpriority"):
        return
    with contextlib.suppress(OSError, AttributeError):
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(WRITER_NICE, os.getpriority(os.PRIO_PROCESS, tid)))


class _Abandoned(Exception):
    """Raised in the writer thread between two chunks of a file when the flush was abandoned."""


class Writer:
    """Background writer with a byte-bounded queue. Start it only when dumping is on."""

    def __init__(
        self,
        run_dir: Path,
        max_pending_bytes: int,
        manifest: Manifest,
        on_error: Callable[[str], None],
        reserve: SpaceReserve | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.reserve = reserve  # the space the manifest's writes fall back on once the disk is full
        self.max_pending_bytes = max_pending_bytes
        self.manifest = manifest
        self.totals = WriterTotals()
        self.failure: str | None = None
        self.manifest_error: str | None = None  # why the last manifest write that failed did
        self._on_error = on_error
        self._queue: collections.deque[tuple[Job, float]] = collections.deque()  # with when queued
        self._pending = 0
        self._busy = False
        self._host_busy = False  # a pass is open and its forward takes every core
        self._job_queued_at = 0.0  # when the job being written was queued
        self._behind = False  # a job waited MAX_HOLD_BACK_S: no holding back until the queue is empty
        self._host_waits = 0  # host threads waiting on the writer (cap, flush): it must not hold back
        # What the writer thread waits for now: "work" (an empty queue), "host" (an idle host, see
        # host_busy), None (it runs). The host wakes it only for what it waits for: a thread woken
        # for nothing still costs the host a context switch and a GIL hand-off on its cores, once
        # per step (docs/performance.md has what the per-step work measured).
        self._writer_waits: str | None = None
        self._cond = threading.Condition()
        self._closing = False
        self._abandoned = False
        self._last_manifest = 0.0
        self._manifest_every = _MANIFEST_INTERVAL_S
        # The manifest is changed by the host thread (RunDir.update, from hooks) and the writer
        # thread (note_file): each change, its snapshot and its rename happen under this lock, so
        # the encoder never sees the dict change and the last state is the one left on disk.
        self._manifest_lock = threading.Lock()
        self._stats_handle: Any = None
        self.buffers = HostBufferPool(smallest=POOLED_FROM_BYTES)
        self._thread = threading.Thread(target=self._loop, name="tracedump-writer", daemon=True)
        self._thread.start()

    @property
    def pending_bytes(self) -> int:
        return self._pending

    @property
    def host_is_busy(self) -> bool:
        """What the host last said through :meth:`host_busy`: a forward that takes every core runs."""
        return self._host_busy

    @property
    def host_waiting(self) -> bool:
        """Whether a host thread waits on the writer now (the cap, a flush): it never holds back then."""
        return self._host_waits > 0

    def submit(self, job: Job) -> None:
        """Queue a job; waits while the cap would be exceeded (a lone oversized job still goes)."""
        with self._cond:
            self._wait_as_host(
                lambda: (
                    self.failure is not None
                    or self._pending == 0
                    or self._pending + job.nbytes <= self.max_pending_bytes
                )
            )
            if self.failure is not None:
                self._drop(job)
                return
            self._queue.append((job, time.monotonic()))
            self._pending += job.nbytes
            if self._writer_waits == "work":  # busy, or holding back: it takes the job in turn
                self._cond.notify_all()

    def wait_below(self, limit: int) -> None:
        """Back-pressure inside a pass: wait until queued bytes are at most ``limit`` (or none)."""
        with self._cond:
            self._wait_as_host(lambda: self.failure is not None or self._pending <= max(limit, 0))

    def flush(self) -> None:
        with self._cond:
            self._wait_as_host(lambda: not self._queue and not self._busy)

    def host_busy(self, busy: bool) -> None:
        """A pass opened (True) whose forward takes every core, or the open pass closed (False).

        Why the writer holds back then: torch's intra-op threads meet at a barrier after each
        parallel op, and a writer that takes a core from one of them stalls them all; at nice 19
        it still got that core often enough to slow back-to-back steps of the bench model
        markedly (docs/performance.md). Written between forwards instead,
        the same bytes cost what they cost on their own. The host never waits for this: a pass
        waits in the queue, and the writer goes on at once when the host waits on it (the cap, a
        flush, exit), and once a pass has waited :data:`MAX_HOLD_BACK_S` since it was queued it
        writes beside the forwards until the queue is empty (at nice 19 it gets little CPU then;
        holding back again for each of the passes behind, it fell further behind with every one)."""
        if busy:
            self._host_busy = True
        elif self._host_busy:
            with self._cond:
                self._host_busy = False
                if self._writer_waits == "host":
                    self._cond.notify_all()

    def wait_for_idle_host(self) -> None:
        """Called by the writer thread before each chunk of a pass file (see :meth:`host_busy`)."""
        if self._abandoned:
            raise _Abandoned("the flush was abandoned")  # the file's temp is removed on the way out
        if not self._host_busy or self._behind:
            return
        with self._cond:
            while self._host_busy and not self._host_waits and not self._closing:
                left = self._job_queued_at + MAX_HOLD_BACK_S - time.monotonic()
                if left <= 0:
                    self._behind = True
                    return
                self._sleep_until_woken("host", left)

    def _sleep_until_woken(self, waits_for: str, timeout: float | None = None) -> None:
        """The writer thread waits on the condition (its lock held), saying what for while it
        does (``_writer_waits``): the host wakes it only for that."""
        self._writer_waits = waits_for
        try:
            self._cond.wait(timeout)
        finally:
            self._writer_waits = None

    def _wait_as_host(self, done: Callable[[], bool]) -> None:
        """Wait (the lock held) until ``done()``; while a host thread waits, the writer does not
        hold back for an open pass."""
        if done():
            return
        self._host_waits += 1
        self._cond.notify_all()
        try:
            while not done():
                self._cond.wait()
        finally:
            self._host_waits -= 1

    def close(self) -> None:
        """Write everything queued, stop the thread, seal ``stats.jsonl``, write the manifest."""
        self.flush()
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join()
        self._seal_stats()

    def abandon(self, reason: str, wait_s: float = 5.0) -> None:
        """Stop now (an interrupt during the flush at close): every queued job is dropped and
        counted, the file being written stops at its next chunk and its temp file is removed."""
        with self._cond:
            if self.failure is None:
                self.failure = reason
            self._abandoned = self._closing = True
            while self._queue:
                dropped, _ = self._queue.popleft()
                self._pending -= dropped.nbytes
                self._drop(dropped)
            self._cond.notify_all()
        self._thread.join(wait_s)
        if not self._thread.is_alive():
            self._seal_stats()

    def recycle(self, tensors: list[torch.Tensor], nbytes: int) -> None:
        """Hand a written pass's buffers to the pool, keeping free + queued bytes within the cap."""
        self.buffers.give_back(tensors, room=self.max_pending_bytes - (self._pending - nbytes))

    def note_file(self, index: int, size: int, *, is_pass: bool) -> None:
        with self._manifest_lock:
            if is_pass:
                self.totals.passes.add(index)
            self.totals.bytes += size
            self.totals.files += 1
        if time.monotonic() - self._last_manifest > self._manifest_every:
            self.write_manifest()

    def note_manifest(self, **updates: Any) -> None:
        """Apply ``updates`` now, write the manifest only when it is due (at most about once a
        second): for a field that may change thousands of times in a row (a CUDA graph captured per
        batch size). The next write carries them (the next due one, or the one at close)."""
        with self._manifest_lock:
            self.manifest.update(updates)
        if time.monotonic() - self._last_manifest > self._manifest_every:
            self.write_manifest()

    def append_stats(self, lines: list[str]) -> None:
        """Stats grow all run long, so they go to ``stats.jsonl.partial``, renamed at close."""
        if self._stats_handle is None:
            path = self.run_dir / STATS_PARTIAL
            self._stats_handle = open_for_append(path)  # held open all run: one append per pass
        self._stats_handle.write("".join(line + "\n" for line in lines))
        self._stats_handle.flush()
        self.totals.bytes += sum(len(line) + 1 for line in lines)

    def write_manifest(self, **updates: Any) -> bool:
        """Apply ``updates`` and write the manifest; safe from any thread (see ``_manifest_lock``).
        True when this version is on disk. On a full disk the write falls back on the space
        reserved for it (:attr:`reserve`), so the version that says why the dump stopped lands."""
        with self._manifest_lock:
            self.manifest.update(updates)
            self.manifest["passes"] = {
                "count": len(self.totals.passes),
                "bytes": self.totals.bytes,
                "files": self.totals.files,
                "indices": sorted(self.totals.passes),
            }
            started = time.monotonic()
            landed = self._write_manifest_file()
            self._last_manifest = now = time.monotonic()
            # The manifest lists every pass, so it grows with the run: written at most once a
            # second, and never more than 1% of the writer's time (the GIL it holds is the host's).
            self._manifest_every = max(_MANIFEST_INTERVAL_S, _MANIFEST_SHARE * (now - started))
            return landed

    def _write_manifest_file(self) -> bool:
        """One atomic write of the manifest (its lock held), then the reserve kept at its size."""
        text = json_text(self.manifest)
        path = self.run_dir / MANIFEST
        reserve = self.reserve
        try:
            if reserve is None:
                write_text_atomic(path, text)
            else:
                reserve.spend(lambda: write_text_atomic(path, text), keep=reserve_for(len(text)))
        except OSError as e:  # the failure that filled the disk is reported by the caller
            self.manifest_error = f"{type(e).__name__}: {e}"
            self.manifest.setdefault("manifest_error", str(e))
            return False
        if reserve is not None:
            with contextlib.suppress(OSError):  # the manifest grew: keep room for its next version
                reserve.hold(reserve_for(len(text)))
        return True

    def drop_reserve(self) -> None:
        """The last manifest is written (or the run dir removed): give the reserved space back."""
        if self.reserve is not None:
            self.reserve.remove()

    def _seal_stats(self) -> None:
        if self._stats_handle is None:
            return
        handle, self._stats_handle = self._stats_handle, None
        try:
            # After a failed append the lines are still buffered: closing retries them and, on a
            # full disk, fails again. close() must not raise into the host, so report it instead.
            handle.close()
            move_into_place(self.run_dir / STATS_PARTIAL, self.run_dir / STATS_FILE)
        except OSError as e:
            if self.failure is None:
                self.failure = f"writing {self.run_dir / STATS_PARTIAL} failed: {type(e).__name__}: {e}"
                self._on_error(self.failure)

    def _drop(self, job: Job) -> None:
        """Count an abandoned job by what it held: every capture and every byte, not one file
        (a pass job's ``nbytes`` is only what it holds against the memory cap)."""
        self.totals.dropped_jobs += 1
        if isinstance(job, PassJob):
            self.totals.dropped_captures += len(job.entries)
            self.totals.dropped_bytes += sum(t.numel() * t.element_size() for _, t, _ in job.entries)
        else:
            self.totals.dropped_captures += len(job.records)

    def _loop(self) -> None:
        _yield_cpu_to_host()
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._sleep_until_woken("work")
                if not self._queue:
                    return
                job, self._job_queued_at = self._queue.popleft()
                self._busy = True
            try:
                if self.failure is None:
                    job.run(self)
                else:
                    self._drop(job)
            except _Abandoned:
                self._drop(job)
            except Exception as e:  # never let the writer die silently: report, stop, keep the host alive
                self._fail(job, e)
            finally:
                nbytes = job.nbytes
                del job  # free the pass's host buffers before a step waiting on the cap is let in
                with self._cond:
                    self._busy = False
                    self._pending -= nbytes
                    self._behind = self._behind and bool(self._queue)
                    self._cond.notify_all()

    def _fail(self, job: Job, error: Exception) -> None:
        name = pass_file_name(job.index, job.part) if isinstance(job, PassJob) else STATS_PARTIAL
        target = self.run_dir / name
        self.failure = f"writing {target} failed: {type(error).__name__}: {error}"
        self._drop(job)
        with self._cond:
            while self._queue:
                dropped, _ = self._queue.popleft()
                self._pending -= dropped.nbytes
                self._drop(dropped)
            self._cond.notify_all()
        self._on_error(self.failure)
