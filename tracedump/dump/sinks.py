"""Where the recorder's copies go: files on disk (``attach()``) or memory (``capture()``).

The recorder decides *whether* and *under which key* a tensor is kept; a sink decides *how it is
copied* and *where it ends up*. Tests inject failures by handing the recorder a sink of their own,
and a :class:`FileSink` a run dir (and a core count) of their own.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..util.cpus import usable_cpus
from . import cuda
from .cuda import SyncEscape, allow_sync, copy_to_host
from .writer import Job, PassJob, storable

if TYPE_CHECKING:
    from collections.abc import Mapping

    from .rundir import RunDir


class Sink(Protocol):
    """What the recorder needs of a destination."""

    @property
    def failure(self) -> str | None:
        """Why nothing more can be kept (a write error), or None."""

    def accepts(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` can be kept; one that cannot is skipped and counted."""

    def copy(self, tensor: torch.Tensor, *, pooled: bool = True) -> tuple[torch.Tensor, Any]:
        """A private copy of ``tensor`` (engines reuse buffers), and an event marking it done."""

    def submit(self, job: Job) -> None:
        """A closed pass (or part of one, or the records kept outside every pass)."""

    def make_room(self, held: int) -> bool:
        """Back-pressure with ``held`` bytes gathered in the open pass: True means spill them now."""

    def room(self) -> int:
        """How many bytes the open pass may hold before :meth:`make_room` has anything to do."""

    def pass_closed(self, skipped: Mapping[str, int]) -> None:
        """A pass was submitted (a worker process writes it before its forward returns)."""

    def host_busy(self, busy: bool) -> None:
        """A pass opened (True: its forward runs now) or closed (False)."""


class FileSink:
    """Copies into recycled (pinned) host buffers; a writer thread writes the pass files.

    ``rundir`` is anything with a ``writer`` and a ``failure`` (a :class:`RunDir` in production).
    ``cores``: the CPUs this process may run on, by default read once here (an engine sets its
    affinity before it attaches). ``off_cpu`` becomes True at the first capture from an
    accelerator: from then on its forwards are taken to leave the CPU free (see :meth:`host_busy`).
    """

    def __init__(
        self,
        rundir: RunDir,
        sync_escape: SyncEscape | None,
        max_pending_bytes: int,
        *,
        cores: int | None = None,
    ) -> None:
        self._rundir = rundir
        self._sync_escape = sync_escape
        self._cap = max_pending_bytes
        self.cores = usable_cpus() if cores is None else cores
        self.off_cpu = False

    @property
    def failure(self) -> str | None:
        return self._rundir.failure

    # One unwritable tensor (``complex128``, quantized) would make the whole file unwritable. The
    # function itself, not a method calling it: one frame less per capture (the hot path).
    accepts = staticmethod(storable)

    def copy(self, tensor: torch.Tensor, *, pooled: bool = True) -> tuple[torch.Tensor, Any]:
        if tensor.is_cpu and tensor.nbytes < cuda.POOLED_FROM_BYTES and not tensor.requires_grad:
            # Most captures of a decode step: a small CPU tensor is one clone, without
            # copy_to_host's frame (its first case, read from the same threshold); each frame
            # costs ~10x inside a forward.
            return tensor.clone(memory_format=torch.contiguous_format), None
        if not tensor.is_cpu:
            self.off_cpu = True
        pool = self._rundir.writer.buffers if pooled else None
        return copy_to_host(tensor, self._sync_escape, pool)

    def submit(self, job: Job) -> None:
        self._rundir.writer.submit(job)

    def make_room(self, held: int) -> bool:
        """Hold host memory under the cap: wait for the writer; spill a pass too big for the cap.

        Free pooled buffers count too; over the cap they are released first, since waiting for the
        writer cannot shrink them."""
        if held <= self.room():
            return False
        writer = self._rundir.writer
        writer.buffers.clear()
        writer.wait_below(self._cap - held)
        return held > self._cap or held + writer.pending_bytes > self._cap

    def room(self) -> int:
        """The cap less what the writer holds (queued passes, free pooled buffers). Only the
        recorder's own thread adds to either (by submitting); the writer turns queued bytes into
        at most as many free ones, so the answer stays on the safe side until the next submit."""
        writer = self._rundir.writer
        return self._cap - writer.pending_bytes - writer.buffers.free_bytes

    def pass_closed(self, skipped: Mapping[str, int]) -> None:
        if _in_worker_process():
            self._rundir.flush_for_termination(skipped)

    def host_busy(self, busy: bool) -> None:
        """The writer holds back while a forward that takes every core runs (Writer.host_busy):
        one on the CPU (no capture from an accelerator, CUDA not in use) with an intra-op thread
        for every CPU this process may run on. Where torch leaves CPUs free (its default is one
        thread per physical core, so on SMT machines the siblings are free), the writer runs on
        one of them without taking a core from torch's threads, and writes beside the forward."""
        # The cheapest test first: it runs at every root forward, dumped or not
        if busy and (self.off_cpu or torch.get_num_threads() < self.cores or torch.cuda.is_initialized()):
            return
        self._rundir.writer.host_busy(busy)


class MemorySink:
    """Keeps every copy in memory, on ``device`` (default: where it was produced)."""

    failure = None

    def __init__(self, device: torch.device | None) -> None:
        self.device = device
        self.passes: dict[int, dict[str, torch.Tensor]] = {}
        self.loose: dict[str, torch.Tensor] = {}
        self.recent: list[torch.Tensor] = []  # copies since the caller last took them (capture's view)

    def accepts(self, tensor: torch.Tensor) -> bool:
        return True

    def copy(self, tensor: torch.Tensor, *, pooled: bool = True) -> tuple[torch.Tensor, Any]:
        # Outside inference mode: an inference tensor cannot be saved for backward (distillation).
        # A copy to another device syncs: deliberate, so let through a sync debug mode (as FileSink).
        with torch.inference_mode(False), allow_sync():
            source = tensor.detach()
            copied = source.clone() if self.device is None else source.to(self.device, copy=True)
        self.recent.append(copied)
        return copied, None

    def submit(self, job: Job) -> None:
        if not isinstance(job, PassJob):
            return
        kept = {key: tensor for key, tensor, _ in job.entries}
        if job.file_name is not None:
            self.loose.update(kept)
        else:
            self.passes.setdefault(job.index, {}).update(kept)

    def make_room(self, held: int) -> bool:
        return False

    def room(self) -> int:
        return sys.maxsize  # memory holds what it is given: no cap

    def pass_closed(self, skipped: Mapping[str, int]) -> None:
        pass

    def host_busy(self, busy: bool) -> None:
        pass

    def take_recent(self) -> list[torch.Tensor]:
        recent, self.recent = self.recent, []
        return recent


def _in_worker_process() -> bool:
    """A multiprocessing child (Pool worker, Process): it may be terminated without any exit hook.
    Only looked at when multiprocessing is already imported; importing it here would cost the host.

    Asked at every pass's close, dumped or not: a "yes" is kept (a process stays a child for
    life), a "no" is asked again while it is cheap to (until multiprocessing is imported), and a
    fork starts the child afresh (:data:`_WORKER`)."""
    if _WORKER:
        return _WORKER[0]
    mp = sys.modules.get("multiprocessing")
    if mp is None:
        return False
    _WORKER.append(mp.parent_process() is not None)
    return _WORKER[0]


_WORKER: list[bool] = []  # the answer, once multiprocessing was imported; emptied in a forked child
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_WORKER.clear)
