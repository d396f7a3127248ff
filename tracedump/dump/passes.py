"""The pass state machine: which pass is open, who opened it, and when it closes.

Why a module of its own: a *pass* is the unit every other part of the dump side counts in (one pass
file per pass, ``STEPS`` selects passes, ``tracedump diff`` pairs passes by index), and deciding its
boundaries is subtle: an engine's ``step()``, else each outermost root forward, else an *implicit*
pass for parts a method of the root model runs without its forward (``generate()`` running the
encoder, ``vae.decode()``), found by walking the stack (:class:`AnchorSearch`). Under live control
(:mod:`tracedump.dump.control`) a step boundary also arms or disarms the recorder. The hot path that
fills the open pass is :mod:`tracedump.dump.recorder`, which builds on :class:`PassMachine`.

Nothing here raises into the host's forward: a failure is reported to the log and counted.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import weakref
from collections.abc import Callable, Container, Iterator, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Protocol

import torch
from torch import nn

from ..store.reduce import StatsValues
from . import suspend
from .control import Controller
from .hooks import BatchLayout
from .runtime import COMPILED_WARNING
from .sinks import Sink
from .torch_compat import frame_on_stack, outermost_frame_of
from .writer import PassJob, StatsFields, StatsJob


class RunLog(Protocol):
    """Where the recorder reports what happened around the captures."""

    @property
    def manifest(self) -> dict[str, Any]: ...
    def update(self, **fields: Any) -> None: ...
    def report(self, where: str, error: BaseException) -> None: ...
    def cut_short(self, index: int, error: BaseException) -> None: ...


class _Everything:
    def __contains__(self, index: object) -> bool:
        return True


@dataclass(kw_only=True)
class KeepPolicy:
    """What to keep: the part of the settings the recorder reads (mode, gates, STEPS, passes)."""

    mode: str = "full"
    inputs: bool = False
    stats: Sequence[str] = ()
    tokens: int | None = None
    token_dim: int = 0
    max_rows: int | None = None
    steps: Container[int] = field(default_factory=_Everything)
    implicit_passes: bool = True  # captures outside a pass, made by a method of the root, get one
    keep_outside: bool = False  # captures outside every pass are kept as loose records (capture())

    @classmethod
    def from_settings(cls, settings: Any) -> KeepPolicy:
        fields = ("mode", "inputs", "stats", "tokens", "token_dim", "max_rows")
        return cls(steps=settings.step_selection, **{name: getattr(settings, name) for name in fields})


@dataclass(slots=True, kw_only=True)
class Pass:
    """What one open pass has gathered so far."""

    index: int
    selected: bool
    entries: list[tuple[str, torch.Tensor, Any]] = field(default_factory=list)
    seqs: list[int] = field(default_factory=list)  # each entry's place in the pass's capture order
    order: int = 0
    # stats mode: (the record's fields: capture_stats_record's arguments, the numeric stat names,
    # their values: floats, a float64 tensor or a raw sweep (reduce.stats_numbers), the copy's event)
    stats: list[tuple[StatsFields, Sequence[str], StatsValues, Any]] = field(default_factory=list)
    calls: dict[str, int] = field(default_factory=dict)  # module name -> its calls so far
    nbytes: int = 0
    parts: int = 0
    gated: int = 0
    kept: int = 0
    truncated: bool = False  # the forward (or step) that owned it ended by an exception
    owner: int | None = None  # the thread whose root forward opened it (None: a step())
    batch: str | None = None  # set_batch(): what each token row of this step belongs to
    implicit: bool = False  # opened by a capture outside every pass, for the next root forward
    anchor: Any = None  # an implicit pass's anchor: the root model's method frame
    # What the pass may hold before the memory cap has anything to say (Sink.room), for the
    # recorder's plain path: read at its first plain capture and again after each make_room. Only
    # this pass's recorder submits to its sink (and resets this when it does), and the writer only
    # ever makes more room, so a value read earlier errs on the safe side. None: not read yet.
    room: int | None = None
    # Guards the counters (calls, order) and what must change together (an entry and its seq; the
    # entries handed to a job): an engine's worker threads may capture into one step()'s pass, and
    # two threads that read a module's call count before either wrote it back would both take the
    # same call number, one capture then overwriting the other in the pass file.
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, key: str, tensor: torch.Tensor, event: Any) -> None:
        with self.lock:
            self.entries.append((key, tensor, event))
            self.seqs.append(self.order)
            self.order += 1
        self.nbytes += tensor.numel() * tensor.element_size()  # not .nbytes: capture() keeps sparse ones
        self.kept += 1

    def next_seq(self) -> int:
        """Captures of every kind (whole tensors, stats, records) share one order, so a stats-mode
        pass, which stores records whole and the rest in stats.jsonl, can be merged back in order."""
        with self.lock:
            self.order += 1
            return self.order - 1

    def take_job(self, part: int | None, mode: str) -> PassJob:
        """The entries gathered so far as one file's job; the pass starts gathering afresh."""
        with self.lock:
            seqs = self.seqs if mode == "stats" else None
            entries, self.entries, self.seqs, nbytes, self.nbytes = self.entries, [], [], self.nbytes, 0
        return PassJob(
            index=self.index,
            part=part,
            mode=mode,
            entries=entries,
            nbytes=nbytes,
            seqs=seqs,
            truncated=self.truncated,
            batch=self.batch,
        )

    def next_call(self, key: str) -> int:
        """This call's number for ``key`` (0 for its first in the pass), under :attr:`lock`."""
        with self.lock:
            call = self.calls.get(key, 0)
            self.calls[key] = call + 1
        return call

    @property
    def is_warmup(self) -> bool:
        """Every capture was refused by a gate: a warm-up step, which takes no pass index."""
        return self.gated > 0 and self.kept == 0


@dataclass(frozen=True)
class AnchorSearch:
    """How a capture outside every pass finds the method of the root model that made it.

    ``find(model)`` walks the stack (the outermost running frame whose ``self`` is ``model``, or
    None). A program that calls parts itself does so at every step: after ``give_up_after`` such
    captures with no method-made one, the recorder stops walking the stack for each (the old,
    cheap path). A test injects its own ``find`` or limit here (``recorder.anchors``)."""

    find: Callable[[nn.Module | None], FrameType | None] = outermost_frame_of
    give_up_after: int = 1000


class PassMachine:
    """The pass state machine of one model's recorder: opening, adopting and closing passes,
    implicit passes, control arming at step boundaries, and the anomalies said about them."""

    def __init__(
        self,
        model: nn.Module,
        keep: KeepPolicy,
        sink: Sink,
        log: RunLog,
        warn: Callable[[str, str], None],
        *,
        ready: Callable[[], bool] = lambda: True,
        control: Controller | None = None,
        label: str = "",
    ) -> None:
        self.keep = keep
        self.sink = sink
        self.log = log
        self.warn = warn
        self.control = control
        self.label = label or type(model).__name__
        self.anchors = AnchorSearch()  # implicit passes: how an outside capture finds its method
        self._ready = ready  # the owner's check before a pass opens (fork, rank): False = none
        self._root_ref = weakref.ref(model)
        self.mode = keep.mode
        self.inputs = keep.inputs
        self.name_filter: Callable[[str], bool] | None = None  # an armed order's --filter (memoised)
        # control: registers the capture hooks while armed, removes them while idle (HookSet's
        # set_capturing(outputs, inputs)); None: the hooks stay as attach() registered them
        self.hooks_follow: Callable[[bool, bool], None] | None = None
        self.boundaries = 0  # step boundaries seen (control: the pass index is the step number)
        self.step_depth = 0  # open step() blocks (of the thread that holds the step)
        self.idle = control is not None  # control: disarmed, every hook returns at once
        self.closed = False
        self._suspend_depth = 0
        self.reset()

    def reset(self) -> None:
        """What belongs to one run dir: a forked child starts these afresh in its own dir."""
        self.lock = threading.RLock()
        self.skipped: collections.Counter[str] = collections.Counter()
        self.current: Pass | None = None
        self._pending_batch: str | None = None  # set_batch() before its step() opened the pass
        self.next_index = 0
        self.truncated: list[int] = []
        self.anomalies: dict[str, str] = {}  # what went wrong around the dump (manifest "anomalies")
        self._local = threading.local()  # per thread: was its root forward (or step) refused?
        self._step_thread: int | None = None  # the thread whose step() blocks are open
        self._refused_steps = 0  # step() blocks running now that were refused (see step())
        self._explicit_passes = 0  # passes opened by a root forward or step() (see settle_implicit)
        self._implicit_off = not self.keep.implicit_passes
        self._anchorless = 0  # outside captures that no method of the model made
        self._anchored = 0  # ... and those one did

    @property
    def pass_index(self) -> int:
        """Index of the open pass, or of the next one to open."""
        return self.current.index if self.current is not None else self.next_index

    def owns_pass_on_this_thread(self) -> bool:
        current = self.current
        return (
            current is not None
            and current.owner in (None, threading.get_ident())
            and not self.in_refused_step()
        )

    def in_refused_step(self) -> bool:
        """This thread runs a ``step()`` that was refused (another thread's step was open): what it
        captures is counted, never written. One attribute read when no step was refused."""
        return bool(self._refused_steps) and bool(getattr(self._local, "refused", 0))

    # ---------------------------------------------------------------- engine API

    @contextlib.contextmanager
    def step(self, owner: Any = None) -> Iterator[Any]:
        """One engine step = one pass (the block gets ``owner``). Nested ``step()`` blocks belong
        to the outer pass.

        A step belongs to the thread that entered it; a forward on a thread that holds no step of
        its own (an engine's worker) lands in it. A ``step()`` entered on a second thread while
        another thread's step (or root-forward pass) is open would merge two steps into one pass
        (its modules as ``::callN``): it is refused instead (:meth:`_refused_step`), as a
        concurrent root forward is."""
        me = threading.get_ident()
        with self.lock:
            refused = self._refuses_step(me)
            if refused:
                self._refused_steps += 1
                self._local.refused = getattr(self._local, "refused", 0) + 1
            else:
                opened = self._enter_step(me)
        if refused:
            yield from self._refused_step(owner)
            return
        try:
            yield owner
        except BaseException as error:  # Ctrl-C or an error cut the step short: what it captured is partial
            if opened:
                opened = False
                with self.lock:
                    index = self.pass_index
                    self.close_pass(truncated=True)
                self._cut_short(index, error)
            raise
        finally:
            with self.lock:  # the pass closes before another thread can see no step open
                if opened:
                    self.close_pass()
                self.step_depth -= 1
                if not self.step_depth:
                    self._step_thread = None
                self._pending_batch = None  # a set_batch() of this step never outlives it

    def _refuses_step(self, me: int) -> bool:
        """A ``step()`` on thread ``me`` while another thread holds the steps or the open pass."""
        if getattr(self._local, "refused", 0):
            return True  # nested in a refused step
        if self.step_depth and self._step_thread != me:
            return True
        current = self.current
        return current is not None and current.owner not in (None, me)

    def _enter_step(self, me: int) -> bool:
        """Open this thread's step (under the lock); True when it opened the pass."""
        self.settle_implicit()
        opened = self._open_pass() if self.current is None and not self.suspended() else False
        if opened:
            self._explicit_passes += 1
        elif self._adopt_implicit(owner=None):
            opened = True
        self.step_depth += 1  # root forwards inside belong to this step, armed or not
        self._step_thread = me
        return opened

    def _refused_step(self, owner: Any) -> Iterator[Any]:
        """The body of a refused ``step()``: its captures and records are counted as
        ``concurrent_thread`` (:meth:`in_refused_step`), said once, and it opens no pass."""
        self._refuse_concurrent(count=False)
        try:
            yield owner
        finally:
            with self.lock:  # left on another thread (an engine's step may end elsewhere): no underflow
                self._refused_steps = max(self._refused_steps - 1, 0)
                self._local.refused = max(getattr(self._local, "refused", 0) - 1, 0)

    @contextlib.contextmanager
    def profiling(self) -> Iterator[None]:
        """Suspend this recorder: no capture, and no pass index is used (the engine's profile run)."""
        self._suspend_depth += 1
        try:
            yield
        finally:
            self._suspend_depth -= 1

    def set_batch(self, batch: str) -> None:
        if self.in_refused_step():
            return  # a concurrent step's batch is not the open pass's
        if self.current is not None:
            self.current.batch = batch
            self._skip_unrequested(self.current, batch)
        else:
            self._pending_batch = batch

    def lay_out_batch(self, layout: BatchLayout, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """An outermost root forward of an HF model: its batch layout, unless this step's engine
        gave one with ``set_batch`` (or the pass keeps nothing). The layout's own bookkeeping sees
        every such forward, kept or not, so its sequence numbers never depend on STEPS."""
        current = self.current
        wanted = (
            current is not None
            and current.selected
            and current.batch is None
            and not current.implicit
            and current.owner in (None, threading.get_ident())
            and not self.suspended()
            and not self.in_refused_step()
        )
        try:
            batch = layout.observe(args, kwargs, wanted)
            if batch is not None and current is not None and current is self.current:
                self.set_batch(batch)
        except Exception as e:
            self.report("batch layout", e)

    # ---------------------------------------------------------------- passes

    def suspended(self) -> bool:
        return self._suspend_depth > 0 or suspend.globally_suspended()

    def _open_pass(self) -> bool:
        if self.closed or not self._ready():
            return False
        index = self.next_index
        if self.control is not None:
            index = self.boundaries
            self.boundaries += 1
            if not self._arm(index):
                return False
        # After a write error a pass still counts as selected: its captures are counted as lost.
        self.current = Pass(index=index, selected=index in self.keep.steps)
        self.sink.host_busy(True)
        self.current.batch, self._pending_batch = self._pending_batch, None
        if self.current.batch is not None:
            self._skip_unrequested(self.current, self.current.batch)
        return True

    def open_auto_pass(self, nested: bool = False) -> bool:
        """Called by the root pre-hook: a pass per root forward when the engine opened none.

        The pass belongs to the calling thread. A root forward entering from another thread while
        it is open would mix two forwards into one pass: that forward is refused instead (see
        :meth:`_refuse_concurrent`), and its thread starts afresh at its next root forward."""
        # The tests of suspended(), in_refused_step() and settle_implicit() inline: this runs at
        # every root forward, dumped or not, where each Python call costs many times its
        # tight-loop time (docs/compiled.md, Idle)
        if self._suspend_depth or self.step_depth or suspend.globally_suspended():
            return False
        if self._refused_steps and self.in_refused_step():
            return False
        if nested and self.control is not None and self.current is None:
            return False  # an inner root call is no step boundary, armed or idle
        me = threading.get_ident()
        if self.current is not None and self.current.implicit:
            self.settle_implicit()
        with self.lock:
            current = self.current
            if current is not None:
                if current.owner not in (None, me):
                    self._local.concurrent = True
                    self._refuse_concurrent(count=False)
                    return False
                return self._adopt_implicit(owner=me)
            self._local.concurrent = False
            if not self._open_pass():
                return False
            self.current.owner = me  # type: ignore[union-attr]
            self._explicit_passes += 1
            return True

    def close_pass(self, truncated: bool = False) -> None:
        """End the open pass and queue its files. ``truncated``: its forward did not finish (an
        exception, Ctrl-C), so the pass holds only the captures made before that; it is written,
        marked in its file's metadata and in the manifest's ``truncated_passes``."""
        current, self.current = self.current, None
        if current is None:
            return
        self.sink.host_busy(False)
        if current.gated and not current.kept:  # Pass.is_warmup, inline (every root forward)
            return
        self.next_index = current.index + 1
        if self.control is not None:
            self._count_armed(current)
        if truncated and current.selected:
            current.truncated = True
            self.truncated.append(current.index)
            self.log.update(truncated_passes=list(self.truncated))
        try:
            if current.entries:  # a pass whose last capture was spilled has no tail: no empty part file
                part = current.parts + 1 if current.parts else None
                self.sink.submit(current.take_job(part, self.mode))
            if current.stats:
                self.sink.submit(StatsJob(index=current.index, records=current.stats))
            self.sink.pass_closed(self.skipped)
        except Exception as e:
            self.report(f"pass {current.index}", e)

    def _adopt_implicit(self, owner: int | None) -> bool:
        """Make an implicit pass of this thread the pass of the root forward (or step) starting."""
        current = self.current
        if current is None or not current.implicit or current.owner != threading.get_ident():
            return False
        current.implicit, current.owner, current.anchor = False, owner, None
        self._explicit_passes += 1
        return True

    def _open_implicit_pass(self) -> Pass | None:
        """A selected module ran with no pass open, called by a method of the root model (its
        *anchor*: ``generate()`` running the encoder of an encoder-decoder model before the first
        decoder forward, ``vae.decode()`` running the decoder without the VAE's forward).

        The captures go into an *implicit* pass: a root forward (or ``step()``) that starts while
        the anchor still runs adopts it as its own, so the encoder lands in pass 0 before the
        decoder; one that ends with its anchor (no root forward inside) is settled by
        :meth:`settle_implicit`. A call from anywhere else stays ``outside_pass``."""
        if self._implicit_off:
            return None
        anchor = self.anchors.find(self._root_ref())
        if anchor is None:
            # A program that calls parts itself does so at every step: after many such captures
            # and no method-made one, stop walking the stack for each (the old, cheap path).
            self._anchorless += 1
            self._implicit_off = self._anchorless >= self.anchors.give_up_after and not self._anchored
            return None
        self._anchored += 1
        with self.lock:
            if self.current is None and self._open_pass():
                self.current.implicit = True  # type: ignore[union-attr]
                self.current.owner = threading.get_ident()  # type: ignore[union-attr]
                self.current.anchor = anchor  # type: ignore[union-attr]
            return self.current

    def settle_implicit(self, *, at_close: bool = False) -> None:
        """End an implicit pass whose anchor method returned without a root forward inside it.

        With no root-forward pass so far (a VAE only ever ``decode()``-d), each such call is a
        pass of its own. Once root forwards have made passes, parts called after them (an engine's
        ``compute_logits()`` after each forward) would shift every later pass index, so their
        captures are dropped and counted as ``outside_pass``, and this recorder stops copying such
        calls at all: what keeps its passes aligned with a reference."""
        current = self.current
        if current is None or not current.implicit or current.owner != threading.get_ident():
            return
        if not at_close and current.anchor is not None and frame_on_stack(current.anchor):
            return
        if self._explicit_passes and not current.parts:
            self.current = None
            self.sink.host_busy(False)
            self.skipped["outside_pass"] += current.kept
            self._implicit_off = True
            if self.control is not None and current.index == self.boundaries - 1:
                # It was no engine step (an engine's compute_logits() after the forward): give its
                # step number back, or an armed window would lose the step after it.
                self.boundaries -= 1
            return
        self.close_pass()

    # ---------------------------------------------------------------- control

    def _count_armed(self, current: Pass) -> None:
        """A closed pass of an armed window: it counts towards ``--steps`` and fixes the run's mode."""
        assert self.control is not None
        if self.control.needs_batches and current.batch is None:
            self.warn(
                "control_request",
                "tracedump: an order armed with --request needs the engine to call set_batch() each "
                "step; this step said nothing of its sequences and is dumped whole",
            )
        if current.selected:
            self.control.pass_dumped(self.mode)

    def _skip_unrequested(self, current: Pass, batch: str) -> None:
        """An order armed for one request: a step without that sequence is no dumped step (decided
        by the step's latest ``set_batch``)."""
        held = self.control.holds_request(batch) if self.control is not None else None
        if held is not None:
            current.selected = current.index in self.keep.steps and held

    def _arm(self, step: int) -> bool:
        """Control mode, at a step boundary: whether this step is armed, with the order's overrides.

        An order's ``--mode`` becomes the run's mode (a run dir holds passes of one mode: the
        controller refuses another once a pass is written), so it is not reverted at disarm."""
        assert self.control is not None
        armed, changed = self.control.arm_step(step)
        self.idle = armed is None
        if armed is not None and armed.mode and armed.mode != self.mode:
            self.mode = armed.mode
            self.log.update(settings={**self.log.manifest.get("settings", {}), "mode": self.mode})
        self.inputs = bool(armed and armed.inputs) or self.keep.inputs
        self.name_filter = armed.name_filter if armed is not None else None
        if self.hooks_follow is not None:
            self.hooks_follow(armed is not None, self.inputs)
        if changed:
            self.log.update(control=self.control.state())
        return armed is not None

    # ---------------------------------------------------------------- anomalies

    def note_compiled(self) -> None:
        """Once: warn that compiled calls go undumped, and say so in the manifest."""
        if self.closed or "compiled" in self.anomalies:
            return
        self.anomalies["compiled"] = (
            f"torch.compile compiled this model's forward (first at pass {self.pass_index}); compiled "
            "calls run no capture hook, so their passes are missing"
        )
        self.log.update(anomalies=dict(self.anomalies))
        self.warn("compiled", COMPILED_WARNING.format(what=f"the dumped {self.label}"))

    def _refuse_concurrent(self, count: bool = True) -> None:
        """Count a capture of a thread that does not own the open pass; say it once."""
        with self.lock:  # several threads may count at once
            if count:
                self.skipped["concurrent_thread"] += 1
            if "concurrent_threads" in self.anomalies:
                return
            self.anomalies["concurrent_threads"] = (
                "root forwards or step() blocks from several threads overlapped; the captures of a "
                "thread whose forward or step began while another thread's pass was open were "
                "skipped (skipped.concurrent_thread)"
            )
        self.log.update(anomalies=dict(self.anomalies))
        self.warn(
            "concurrent",
            "tracedump: a root forward or step() entered from a second thread while another "
            "thread's pass was open; its captures are skipped, not mixed into that pass. Run the "
            "dumped model (and step()) from one thread at a time, or attach one dumper per model copy.",
        )

    def _cut_short(self, index: int, error: BaseException) -> None:
        """A step raised (the engine's forward failed, Ctrl-C): the manifest says the dump is
        incomplete and keeps the error, so a diff never reads the cut pass as a whole one."""
        try:
            self.log.cut_short(index, error)
        except Exception as e:  # never raise into the host: its own exception is on its way
            self.report(f"step {index}", e)

    def report(self, where: str, error: Exception) -> None:
        self.skipped["errors"] += 1
        self.log.report(where, error)
