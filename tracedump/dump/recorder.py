"""The recorder: the hot path that fills the open pass, and everything that decides whether and
under which key a tensor is kept.

A selected module's forward hook calls :meth:`Recorder.on_module_tensors`, which runs the gates
(profiling, rows, tokens, STEPS, CUDA-graph capture, control), names the tensor (:func:`leaf_path`,
the one naming rule of a capture's key), reduces it (full / last_row / stats), asks the sink for a
copy, and keeps host memory under the cap. Which pass is open, and when it closes, is the pass
state machine's (:class:`~tracedump.dump.passes.PassMachine`, which the recorder builds on); where
the copies go is the sink's (:mod:`tracedump.dump.sinks`); what happened around the run goes to a
:class:`~tracedump.dump.passes.RunLog` (the run dir's manifest, or nothing for ``capture()``).

Nothing here raises into the host's forward: a failure is reported to the log and counted.
"""

from __future__ import annotations

import collections
from threading import get_ident
from typing import Any

import torch

from ..store.format import INPUT_MARK, RECORDS_FILE, key_text
from ..store.reduce import SweepPlan, last_row, stats_values, sweep, sweep_plan
from . import gates
from .cuda import stream_is_capturing
from .hooks import flat_leaves, flatten_inputs, output_leaves
from .passes import KeepPolicy, Pass, PassMachine, RunLog
from .suspend import SUSPENSION
from .torch_compat import frame_on_stack
from .writer import RESERVED_NAMES, PassJob

__all__ = ["KeepPolicy", "Recorder", "RunLog", "check_tag", "leaf_path"]


def leaf_path(suffix: str, is_input: bool) -> str:
    """The path in a capture's key of leaf ``suffix`` of a module's output (``[0]``) or input
    (``@in[0]``: the key says ``@in`` itself, so the path is ``[0]``)."""
    return suffix.removeprefix(INPUT_MARK) if is_input else suffix


class Recorder(PassMachine):
    """The hot path, for one model: captures and records go into the pass the machine keeps open."""

    rows: int | None = None  # the batch rows of the coming work (set_rows, for MAX_ROWS); None: no gate

    def reset(self) -> None:
        """What belongs to one run dir: a forked child starts these afresh in its own dir."""
        super().reset()
        self._once_tags: set[str] = set()
        self._step_counts: collections.Counter[str] = collections.Counter()
        self.loose: list[tuple[str, torch.Tensor, Any]] = []
        # No gate can refuse a capture (decided once, from the settings): the plain path applies.
        self._gateless = self.keep.tokens is None and self.keep.max_rows is None
        # Stats the C sweep makes whole (the default's): the plain path of a stats dump keeps its
        # raw sums. Made whatever the mode: a control order may switch the run to stats later.
        self._sweep_plan = sweep_plan(self.keep.stats)

    def record(self, tag: str, tensor: torch.Tensor, *, once: bool = False, numbered: bool = False) -> None:
        try:
            self._record(tag, tensor, once=once, numbered=numbered)
        except Exception as e:
            self.report(f"record({tag!r})", e)

    def finish(self, *, interrupted: bool) -> bool:
        """At close: end any open pass and hand over the loose records. True when some were kept.
        ``interrupted``: a root forward still on record never returned (Ctrl-C, then exit)."""
        self.settle_implicit(at_close=True)
        if self.current is not None:
            self.close_pass(truncated=interrupted)
        if not self.loose:
            return False
        job = PassJob(
            index=-1, part=None, mode="records", entries=self.loose, nbytes=0, file_name=RECORDS_FILE
        )
        self.sink.submit(job)
        return True

    # ---------------------------------------------------------------- hot path

    def on_module_tensors(self, name: str, value: Any, *, is_input: bool) -> None:
        current = self.current
        if (
            current is not None
            and self._gateless
            and current.selected
            and not current.implicit
            and not is_input
            and not self.idle
            and self.name_filter is None
            and not self._suspend_depth
            and not SUSPENSION.get()
            and not self._refused_steps
            and (current.owner is None or current.owner == get_ident())
        ):
            # The plain case, decided in one test: a kept pass of this thread's, no gate, no
            # filter, no suspension. What the general path below would decide, without its steps.
            try:
                if isinstance(value, torch.Tensor):
                    leaves = [("", value)]
                elif type(value) is tuple and (flat := flat_leaves(value)) is not None:
                    leaves = flat  # a fused norm's (out, residual), a parallel linear's (out, bias)
                else:
                    leaves, deep = _leaves(value, False)
                    self._count_too_deep(deep)
                if not leaves:
                    return
                stats = self.mode == "stats"
                plan = self._sweep_plan if stats else None
                if (
                    (stats and plan is None)  # a statistic the C sweep does not make
                    or self.sink.failure is not None
                    or stream_is_capturing()
                ):
                    self._capture_module(current, name, leaves, is_input=False)
                    return
                # The call counted once for all of this output's tensors, under the pass's lock
                # (Pass.next_call inline): worker threads may capture into one step()'s pass.
                lock, calls = current.lock, current.calls
                lock.acquire()
                call = calls.get(name, 0)
                calls[name] = call + 1
                lock.release()
                if plan is not None:
                    self._sweep_leaves(current, name, call, leaves, plan)
                else:
                    token_dim = self.keep.token_dim if self.mode == "last_row" else None
                    self._copy_leaves(current, name, call, leaves, token_dim)
            except Exception as e:
                self.report(name, e)
            return
        self._on_module_tensors(name, value, is_input=is_input)

    def _on_module_tensors(self, name: str, value: Any, *, is_input: bool) -> None:
        """Every case: the gates, implicit passes, other threads, suspension, control's filter."""
        if self.idle or (is_input and not self.inputs):
            return
        if self.name_filter is not None and not self.name_filter(name):
            return
        if self._refused_steps and self.in_refused_step():
            self._refuse_concurrent()
            return
        current, suspended = self.current, self.suspended()
        if current is None:
            if getattr(self._local, "concurrent", False):  # its forward was refused (see above)
                self.skipped["concurrent_thread"] += 1
                return
            if suspended:
                return
            current = self._open_implicit_pass()
            if current is None:
                self._outside_pass(name, value, is_input)
                return
        elif current.implicit and current.owner == get_ident() and not frame_on_stack(current.anchor):
            # the anchor call returned: settle that pass (it is this thread's), then start afresh
            self.settle_implicit()
            self.on_module_tensors(name, value, is_input=is_input)
            return
        if current.owner is not None and current.owner != get_ident():
            self._refuse_concurrent()
            return
        if suspended:
            current.gated += 1  # profiling inside an open step: that step, too, takes no index
            return
        try:
            leaves = self._gated_leaves(current, value, is_input)
            if not leaves:
                return
            if current.selected:
                self._capture_module(current, name, leaves, is_input)
            else:
                current.kept += 1  # would have been kept: a real step, which takes its pass index
        except Exception as e:
            self.report(name, e)

    def _outside_pass(self, name: str, value: Any, is_input: bool) -> None:
        if not self.keep.keep_outside:
            self.skipped["outside_pass"] += 1
            return
        try:
            leaves, deep = _leaves(value, is_input)
            self._count_too_deep(deep)
            for suffix, tensor in leaves:
                host, event = self.sink.copy(tensor, pooled=False)
                self.loose.append((key_text(name, leaf_path(suffix, is_input), is_input), host, event))
        except Exception as e:
            self.report(name, e)

    def _gated_leaves(self, current: Pass, value: Any, is_input: bool) -> list[tuple[str, torch.Tensor]]:
        """The tensor leaves of a capture that the warm-up gates let through; none if refused.

        The gates also run in passes that STEPS does not keep, copying nothing: a warm-up step must
        take no pass index even when that index is unselected, or every later pass number shifts.
        """
        keep = self.keep
        if not gates.row_gate_allows(self.rows, keep.max_rows):
            return self._refuse(current, "row_gate")
        leaves, deep = _leaves(value, is_input)
        if leaves and not gates.token_gate_allows(leaves[0][1], keep.tokens, keep.token_dim):
            return self._refuse(current, "token_gate")
        if current.selected:
            self._count_too_deep(deep)
        return leaves

    def _count_too_deep(self, deep: int) -> None:
        """Tensors nested deeper than the walk goes (:data:`~tracedump.dump.hooks.MAX_DEPTH`)."""
        if deep:
            self.skipped["too_deep"] += deep

    def _refuse(self, current: Pass, gate: str) -> list[tuple[str, torch.Tensor]]:
        current.gated += 1
        if current.selected:
            self.skipped[gate] += 1
        return []

    def _capture_module(
        self, current: Pass, name: str, leaves: list[tuple[str, torch.Tensor]], is_input: bool
    ) -> None:
        if self.sink.failure is not None:
            self._count_after_failure([tensor for _, tensor in leaves])
            return
        if stream_is_capturing():
            self.skipped["graph_capture"] += 1
            self.warn(
                "graph_capture",
                "tracedump: a hook fired during CUDA graph capture; its copy was "
                "skipped (replays fire no hooks). Disable CUDA graphs while dumping "
                "(tracedump.resolve_cuda_graph()), or compile the model and set "
                "TRACEDUMP_DUMP_COMPILED=1: its taps are captured with the graph and dumped at "
                "each replay (docs/compiled.md).",
            )
            return
        call = current.next_call(name + INPUT_MARK if is_input else name)
        for suffix, tensor in leaves:
            if not self.sink.accepts(tensor):
                self.skipped["unsupported_tensor"] += 1
                continue
            if self.mode == "stats":
                self._keep_stats(current, name, suffix, call, tensor, is_input)
                continue
            kept = last_row(tensor, self.keep.token_dim) if self.mode == "last_row" else tensor
            host, event = self.sink.copy(kept)
            current.add(key_text(name, leaf_path(suffix, is_input), is_input, call), host, event)
            self._make_room(current)

    def _copy_leaves(
        self,
        current: Pass,
        name: str,
        call: int,
        leaves: list[tuple[str, torch.Tensor]],
        token_dim: int | None,
    ) -> None:
        """:meth:`_capture_module` for a module's output in full mode (``last_row``: each tensor cut
        to its last row along ``token_dim`` first), in as few calls as it allows. ``call``: this
        output's call number, counted by :meth:`on_module_tensors`.

        Inside a forward each Python frame and torch call of a capture costs ~10x its tight-loop
        time (the forward evicts the interpreter's working set; docs/performance.md), so
        per tensor this path makes two calls (the sink's check and copy; a third for last_row's
        cut) and adds the entry in place: no mode test or leaf path, the call counted once, and
        the memory cap consulted only when the pass outgrows the room it had (:attr:`Pass.room`).
        The entry goes to the pass's entries as they are after the copy: a worker thread
        capturing into the same ``step()`` may have spilled them into a part file meanwhile. No
        capture order is kept for it (only a stats pass writes one). The same decisions, keys and
        accounting as :meth:`_capture_module`; the rare cases (a failed sink, a CUDA graph
        capturing) take that path (:meth:`on_module_tensors` sends them)."""
        sink = self.sink
        accepts, copy = sink.accepts, sink.copy
        for suffix, tensor in leaves:
            if not accepts(tensor):
                self.skipped["unsupported_tensor"] += 1
                continue
            host, event = copy(tensor if token_dim is None else last_row(tensor, token_dim))
            entry = (name + suffix if not call else key_text(name, suffix, False, call), host, event)
            current.entries.append(entry)  # the list read and appended to with no call between
            current.nbytes += host.numel() * host.element_size()
            current.kept += 1
            room = current.room
            if room is None:
                room = current.room = sink.room()
            if current.nbytes > room:
                self._make_room(current)

    def _sweep_leaves(
        self, current: Pass, name: str, call: int, leaves: list[tuple[str, torch.Tensor]], plan: SweepPlan
    ) -> None:
        """:meth:`_capture_module` for a module's output in stats mode when the C sweep makes every
        statistic asked for (:func:`~tracedump.store.reduce.sweep_plan`). In the forward, only what
        needs the live tensor: the sweep, the call counted once, the capture's order; its record
        and the sums' rounding are made by the writer thread (``StatsJob``), since in the forward
        each Python step costs ~10x its tight-loop time (docs/performance.md, unit costs).
        A tensor the sweep cannot take (another dtype or device, a NaN or Inf) goes to
        :meth:`_keep_stats`. The same records, in the same order, as :meth:`_capture_module`, which
        takes the rare cases, as for :meth:`_copy_leaves`. ``call``: as there."""
        sink = self.sink
        for suffix, tensor in leaves:
            if not sink.accepts(tensor):
                self.skipped["unsupported_tensor"] += 1
                continue
            swept = sweep(tensor, plan.recipe)
            if swept is None:  # torch's reductions, without a second sweep of a NaN or an Inf
                self._keep_stats(current, name, suffix, call, tensor, False, use_sweep=False)
                continue
            extras: dict[str, object] = {"shape": list(tensor.shape)} if plan.shape else {}
            if plan.dtype is not None:
                extras["dtype"] = plan.dtype
            lock = current.lock  # Pass.next_seq inline: one call fewer per capture in the forward
            lock.acquire()
            seq = current.order
            current.order = seq + 1
            lock.release()
            current.stats.append(
                ((name, suffix, False, call, current.index, seq, extras), plan.numeric, swept, None)
            )
            current.kept += 1

    def _keep_stats(
        self,
        current: Pass,
        name: str,
        suffix: str,
        call: int,
        tensor: torch.Tensor,
        is_input: bool,
        *,
        use_sweep: bool = True,
    ) -> None:
        """One capture's statistics, computed now. ``use_sweep``: False when the C sweep already
        refused this tensor (:meth:`_sweep_leaves`): torch's reductions, not a second sweep."""
        numeric, values, extras = stats_values(tensor, self.keep.stats, use_sweep=use_sweep)
        if isinstance(values, list) or values.is_cpu:  # made here, no buffer of the host's: no copy
            host, event = values, None
        else:
            host, event = self.sink.copy(values, pooled=False)
        fields = (
            name,
            leaf_path(suffix, is_input),
            is_input,
            call,
            current.index,
            current.next_seq(),
            extras,
        )
        current.stats.append((fields, numeric, host, event))
        current.kept += 1

    def _make_room(self, current: Pass) -> None:
        if self.sink.make_room(current.nbytes):
            current.parts += 1
            self.sink.submit(current.take_job(current.parts, self.mode))
        current.room = None  # the writer and the pool hold other amounts now: read afresh (_copy_leaves)

    def _record(self, tag: str, tensor: torch.Tensor, *, once: bool, numbered: bool) -> None:
        if self.idle or self.closed or self.suspended() or (once and tag in self._once_tags):
            return
        if self.in_refused_step():
            self._refuse_concurrent()
            return
        if not gates.row_gate_allows(self.rows, self.keep.max_rows):
            self.skipped["row_gate"] += 1  # a warm-up call uses no record_step number either
            return
        if numbered:
            count = self._step_counts[tag]
            self._step_counts[tag] = count + 1
            tag = f"{tag}_{count}"
        if not isinstance(tensor, torch.Tensor):
            tensor = torch.as_tensor(tensor)
        if not self.sink.accepts(tensor):
            self.skipped["unsupported_tensor"] += 1
            return
        current = self.current
        if current is not None and not current.selected:
            current.kept += 1  # a real step's record: the pass keeps its index (see _gated_leaves)
            if once:  # the first real write happened, STEPS just did not keep it
                self._once_tags.add(tag)
            return
        if self.sink.failure is not None:
            self._count_after_failure([tensor])
            return
        host, event = self.sink.copy(tensor)
        if current is None:
            self.loose.append((tag, host, event))
        else:
            current.add(key_text(tag, call=current.next_call(tag)), host, event)
            self._make_room(current)
        if once:
            self._once_tags.add(tag)

    def _count_after_failure(self, tensors: list[torch.Tensor]) -> None:
        """Captures refused because dumping stopped: each one, and its bytes, counts as lost."""
        self.skipped["after_failure"] += len(tensors)
        self.skipped["after_failure_bytes"] += sum(t.numel() * t.element_size() for t in tensors)


def _leaves(value: Any, is_input: bool) -> tuple[list[tuple[str, torch.Tensor]], int]:
    """A capture's tensor leaves, and how many more were nested too deep to be kept."""
    deep = [0]
    leaves = flatten_inputs(*value, deep=deep) if is_input else output_leaves(value, deep)
    return leaves, deep[0]


def check_tag(tag: str) -> None:
    """Refuse a record tag no pass file can hold, at the call that names it."""
    if not isinstance(tag, str) or not tag:
        raise ValueError(f"tracedump.record(): the tag must be a non-empty str, not {tag!r}")
    if tag in RESERVED_NAMES:
        raise ValueError(
            f"tracedump.record(): the tag {tag!r} is reserved by the safetensors format "
            "(it holds the file's metadata); choose another name"
        )
