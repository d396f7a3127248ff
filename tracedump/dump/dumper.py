"""``attach()`` and the :class:`Dumper`: hooks on the selected modules, one pass file per engine step.

Off (no dump dir): ``attach()`` returns ``None`` after one env lookup; nothing is registered, no
thread starts, no file or directory is created. On: forward hooks copy each selected module's
output, a background thread writes ``<dir>/rank<R>_pid<P>/pass<NNNNN>.safetensors``.

Example::

    dumper = tracedump.attach(model)            # TRACEDUMP_DUMP_DIR=/tmp/dump turns it on
    for batch in batches:
        with dumper.step() if dumper else contextlib.nullcontext():
            model(batch)

The Dumper only wires the parts (see docs/architecture.md): a :class:`~tracedump.dump.rundir.RunDir`
owns the directory and manifest, a :class:`~tracedump.dump.recorder.Recorder` the hot path on the
pass state machine (:mod:`tracedump.dump.passes`), a :class:`~tracedump.dump.sinks.FileSink` the
copies and the writer, a :class:`~tracedump.dump.grafter.Grafter` the grafted inputs (``GRAFT_FROM``).
A failure at run time is reported once and never raised into the model's forward.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config.settings import DumpConfig, DumpSettings, check_combination, load_settings
from ..config.switch import DEFAULT_ENV_PREFIX, is_enabled
from ..errors import ConfigError
from ..store.correspondence import Correspondence, Load, write_correspondence
from ..store.format import RECORDS_FILE
from ..store.sequences import batch_metadata
from .control import Controller
from .cuda import SyncEscape
from .graft_feed import InputFeed
from .grafter import Grafter, refuse_unsafe
from .hf_layout import batch_layout_for
from .hooks import CallSites, HookSet
from .ops import OpTaps, PausingTarget
from .passes import KeepPolicy
from .recorder import Recorder, check_tag
from .replays import unwatch, watch
from .rundir import RunDir, model_fields, rank_and_world
from .runtime import Warner, runtime, warn_once
from .selection import every_name, kept_names, select_modules, shared_names
from .shadow import Shadow
from .sinks import FileSink
from .taps import TapHooks, TapTarget
from .taps import refresh as refresh_taps
from .torch_compat import compiled_original
from .weights import module_parameters


def attach(
    model: nn.Module,
    config: DumpConfig | dict[str, Any] | None = None,
    *,
    env_prefix: str = DEFAULT_ENV_PREFIX,
    sync_escape: SyncEscape | None = None,
) -> Dumper | None:
    """Attach a dumper to ``model`` if dumping is on, else return ``None`` having done nothing.

    Settings are read once: env (``<env_prefix>DUMP_*``) > ``config`` > defaults. A bad value raises
    :class:`~tracedump.ConfigError` here, naming the env var and the value, rather than after an
    hour-long run.
    """
    if not is_enabled(config, env_prefix):
        return None
    settings = load_settings(config, env_prefix)
    if not settings.enabled:
        return None
    if settings.graft_from is not None:  # grafting refuses a compiled model rather than unwrap it
        refuse_unsafe(model)
    if settings.compiled:  # the compiled wrapper traces the original's hooks: taps go there
        model = original_module(model)
    return Dumper(_unwrap_compiled(model), settings, env_prefix=env_prefix, sync_escape=sync_escape)


# This process's id, kept up to date by a fork handler: a pass opening asks whether it runs in a
# forked child, at every root forward, and ``os.getpid()`` is a system call.
_PID = [os.getpid()]
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: _PID.__setitem__(0, os.getpid()))


def active_dumper() -> Dumper | None:
    """The dumper module-level ``record()`` goes to: the one whose pass this thread runs, else the
    one attached last."""
    from .runtime import existing

    found = existing()
    return found.record_target() if found is not None else None  # type: ignore[return-value]


def original_module(module: nn.Module) -> nn.Module:
    """The module a ``torch.compile`` wrapper (``OptimizedModule``) runs; any other module itself."""
    original = compiled_original(module)
    return original if original is not None else module


def _unwrap_compiled(model: nn.Module) -> nn.Module:
    original = original_module(model)
    if original is not model:
        warn_once(
            f"compiled_{id(model)}",
            "tracedump: attach() got a torch.compile'd module; hooks go on the original module, "
            "which the compiled graph does not run. Call the original module (or use "
            "tracedump.resolve_compile() to skip compiling while dumping) to get captures.",
        )
    return original


class Dumper:
    """An attached dumper. Create it with :func:`attach`; end it with :meth:`close` (also at exit)."""

    def __init__(
        self,
        model: nn.Module,
        settings: DumpSettings,
        *,
        env_prefix: str = DEFAULT_ENV_PREFIX,
        sync_escape: SyncEscape | None = None,
        root_label: str | None = None,
    ) -> None:
        self.settings = settings
        self.env_prefix = env_prefix
        check_combination(settings)  # settings each valid alone that cannot go together
        # Which root this dumper follows; `tracedump run` pairs runs of several roots by it.
        self.root_label = root_label or type(model).__name__
        callables = settings.resolve_callables()  # FILTER_FN, SYNC_ESCAPE: imported here, once per settings
        if sync_escape is None:
            sync_escape = callables.sync_escape
        self.warn = Warner()  # this dumper's one-time warnings: another dumper's never silence them
        self._closed = False
        # All or nothing: everything that can fail runs before the first hook is registered, and a
        # failure removes the run dir it made, so a bad setting leaves the model as it was.
        names = every_name(model)
        self.modules = select_modules(model, settings, env_prefix, names)
        self.graft = self._grafter(model, settings) if settings.graft_from is not None else None
        if self.graft is not None:
            self.modules = self.graft.with_targets(self.modules)
            if self.graft.shadow is not None:
                self.graft.shadow.captured = {id(m): n for n, m in self.modules}
        self.shared = shared_names(names, self.modules)  # modules with several names (vLLM's rotary)
        fields = model_fields(model, self.root_label, self.modules, self.shared)
        self.model_class = str(fields["model_class"])  # one spelling, the manifest's
        self.rundir = RunDir(settings, env_prefix, fields, self.warn)
        if self.graft is not None:
            self.rundir.update(graft=self.graft.summary())
        self._correspondence = self._record_parameters(model)
        control = None
        if settings.control:
            control = Controller(dump_dir=Path(settings.dir), run_dir=self.rundir.path, warn=self.warn)  # type: ignore[arg-type]
            self.rundir.update(control=control.state())
        self.sink = FileSink(self.rundir, sync_escape, settings.max_pending_bytes)
        self.recorder = Recorder(
            model,
            KeepPolicy.from_settings(settings),
            self.sink,
            self.rundir,
            self.warn,
            ready=self._ready_for_pass,
            control=control,
            label=self.root_label,
        )
        inputs = (
            self.modules if settings.inputs or control is not None else []
        )  # control: --inputs may arm them
        keep = kept_names(settings, self.shared, self.modules)
        sites = CallSites(model, names, self.shared, keep) if self.shared else None
        layout = batch_layout_for(model)  # HF: each root forward's batch layout from its inputs
        self.ops = self._op_taps(model, names)
        target: Any = self.recorder if self.ops is None else PausingTarget(self.recorder, self.ops)
        try:
            self.hooks = HookSet(
                model, target, self.modules, inputs, sites=sites, layout=layout, capturing=control is None
            )
        except BaseException:
            if self.ops is not None:
                self.ops.remove()
            raise
        if control is not None:  # disarmed: no capture hook at all until an order arms a step
            self.recorder.hooks_follow = self._follow if settings.compiled else self.hooks.set_capturing
        self.taps = None
        try:
            self.taps = self._tap_hooks(model, target, inputs, sites) if settings.compiled else None
            if self.graft is not None:
                self.graft.register()
            self.rundir.close_at_exit(self.close)
            runtime().add(self)
        except BaseException:
            self._detach()  # attach() failed: nothing of it stays, the replay watch included
            raise

    # ---------------------------------------------------------------- what it is

    @property
    def run_dir(self) -> Path:
        return self.rundir.path

    @property
    def rank(self) -> int:
        return self.rundir.rank

    @property
    def world_size(self) -> int:
        return self.rundir.world_size

    @property
    def skipped(self) -> Any:
        """Captures not kept, by reason (gates, budget, failures): the manifest's ``skipped``."""
        return self.recorder.skipped

    @property
    def pass_index(self) -> int:
        """Index of the open pass, or of the next one to open."""
        return self.recorder.pass_index

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run (everything captured is flushed and the manifest final)."""
        return self._closed

    @property
    def failure(self) -> str | None:
        """Why dumping stopped (a write error), or None."""
        return self.rundir.failure

    # ---------------------------------------------------------------- the correspondence

    def _record_parameters(self, model: nn.Module) -> Correspondence | None:
        """Every parameter's name, module, shape and fingerprint into ``correspondence.json``, so
        that a run loading one checkpoint under other names pairs with this one
        (docs/engines.md). A failure is reported, never raised: it costs only the pairing."""
        try:
            record = Correspondence(parameters=module_parameters(model))
            write_correspondence(self.rundir.path, record)
            return record
        except Exception as e:
            self.rundir.report("correspondence", e)
            return None

    def record_weight_sources(
        self,
        sources: dict[str, dict[str, Any]],
        loads: list[Load],
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        failures: Sequence[str] = (),
    ) -> None:
        """What an engine's weight load filled each parameter from (the checkpoint tensors it read
        and each load's slices), added to ``correspondence.json``: the vLLM plugin calls it after
        ``attach()``. Never raises."""
        try:
            base = self._correspondence or Correspondence(parameters={})
            record = replace(
                base,
                sources=sources,
                loads=list(loads),
                tp_rank=tp_rank,
                tp_size=tp_size,
                failures=list(failures),
            )
            write_correspondence(self.rundir.path, record)
            self._correspondence = record
            if self.graft is not None:  # grafted: each module takes its counterpart's inputs
                self.graft.use_correspondence(record)
                self.rundir.update(graft=self.graft.summary())
        except Exception as e:
            self.rundir.report("correspondence", e)

    @property
    def grafted(self) -> bool:
        """Whether this run feeds its modules a reference's inputs (``GRAFT_FROM``): an engine
        integration describes its modules' inputs (:meth:`set_graft_feeds`) only then."""
        return self.graft is not None

    def set_graft_feeds(self, feeds: Mapping[str, InputFeed]) -> None:
        """With ``GRAFT_FROM``: how some grafted modules take the reference's inputs when their
        signature is not the reference module's (an engine's decoder layer, a fused add + norm),
        or why they cannot (:mod:`tracedump.dump.graft_feed`); by module name as the manifest
        spells it. Nothing without a graft. Call it after ``attach()``, before the first step."""
        if self.graft is None:
            return
        self.graft.use_feeds(feeds)
        self.rundir.update(graft=self.graft.summary())

    # ---------------------------------------------------------------- for integrations

    def note_integration(self, name: str, version: str | None = None, **details: str) -> None:
        """Say in the manifest's ``integration`` which engine integration attached this dumper
        (``{"name": "vllm", "version": ..., "runner": ...}``): the comparator reads it to choose
        ``--align tokens`` against a reference. Written like every manifest change (atomically)."""
        self.rundir.update(integration={"name": name, "version": version, **details})

    def count_skipped(self, reason: str, count: int = 1) -> None:
        """Count work not dumped on purpose under ``reason`` (the engine's profile run), so the
        manifest's ``skipped`` says it: nothing is left out silently."""
        self.recorder.skipped[reason] += count

    def report_error(self, where: str, error: Exception) -> None:
        """A failure of the code around the model (an integration's bookkeeping), kept in the
        manifest's ``errors`` and warned about once; never raises into the host."""
        self.recorder.report(where, error)

    # ---------------------------------------------------------------- engine API

    def step(self) -> contextlib.AbstractContextManager[Dumper]:
        """One engine step = one pass. Nested ``step()`` blocks belong to the outer pass."""
        return self.recorder.step(self)

    def profiling(self) -> contextlib.AbstractContextManager[None]:
        """Suspend this dumper: no capture, and no pass index is used (the engine's profile run)."""
        return self.recorder.profiling()

    def set_rows(self, rows: int | None) -> None:
        """Report the batch rows of the coming work (for ``MAX_ROWS``); None lifts the row gate."""
        self.recorder.rows = rows

    def set_batch(
        self,
        seq_ids: Sequence[int | str | None] | Sequence[Sequence[int | str | None]] | torch.Tensor,
        positions: Sequence[int] | Sequence[Sequence[int]] | torch.Tensor | None = None,
        input_ids: Sequence[int] | Sequence[Sequence[int]] | torch.Tensor | None = None,
    ) -> None:
        """Say which sequence and position each token row of this step holds, so ``tracedump diff
        --align tokens`` can line a batching engine's steps up with a batch-1 reference.

        One entry per token row (the rows along ``TOKEN_DIM``): ``seq_ids`` the request of each row,
        ``positions`` its position in that request (default: each request's rows continue where its
        previous step ended), ``input_ids`` its token id (lets ``diff`` match requests by their
        tokens when the two sides name them differently). Call it inside ``step()`` or just before;
        it is stored in the pass file's metadata (``tracedump.batch``). Pass host lists or CPU
        tensors: a CUDA tensor costs a device sync here. A call with rows that disagree raises
        ``ValueError``: it is a bug in the engine's bookkeeping, caught where it is made.

        A padded batch (``[batch, seq, hidden]`` tensors) is a grid: nested lists or 2-D tensors of
        ``[batch, seq]``; a seq id ``None`` marks a padding row, which is never compared. An HF
        transformers model gets this from each forward's own inputs without any call
        (:mod:`tracedump.dump.hf_layout`)."""
        self.recorder.set_batch(batch_metadata(seq_ids, positions, input_ids))

    def record(self, tag: str, tensor: torch.Tensor, once: bool = False) -> None:
        """Store a tensor that is not a module output under ``tag``, whole and in its own dtype.

        ``once=True`` keeps only the first write (e.g. the prefill logits). Inside a pass it goes to
        that pass's file; outside every pass, to ``records.safetensors`` at close. A tag the file
        format reserves (``__metadata__``) raises ``ValueError`` here: it is a bug in the calling
        code, and storing it would make the whole pass file unreadable.
        """
        check_tag(tag)
        with self._ops_paused():
            self.recorder.record(tag, tensor, once=once)

    def record_step(self, tag: str, tensor: torch.Tensor) -> None:
        """Store ``tag_<n>``, n counting this tag's calls from 0 (e.g. a margin per decode step)."""
        check_tag(tag)
        with self._ops_paused():
            self.recorder.record(tag, tensor, numbered=True)

    def _ops_paused(self) -> contextlib.AbstractContextManager[None]:
        """A record() made inside a module ``OPS`` matched is not one of its ops."""
        return self.ops.paused() if self.ops is not None else contextlib.nullcontext()

    def flush(self) -> None:
        """Wait until every pass closed so far is on disk (the open pass is not cut short)."""
        self.rundir.writer.flush()

    def close(self) -> None:
        """Flush everything captured, remove every hook this dumper added; safe to call twice."""
        with self.recorder.lock:
            if self._closed:
                return
            self._closed = self.recorder.closed = True
        self._detach()
        if os.getpid() != self.rundir.pid:  # a forked child that never dumped owns nothing here
            return
        records = self.recorder.finish(interrupted=bool(self.hooks.root.opened))
        if self.taps is not None:
            self.rundir.update(compiled=self.taps.target.summary())
        if self.graft is not None:
            self.rundir.update(graft=self.graft.summary())
        interrupt: BaseException | None = None
        try:
            self.rundir.writer.close()
        except BaseException as e:  # Ctrl-C while the queued passes were written: say what was lost
            interrupt = e
            self.rundir.abandon_writes(e)
        if self.recorder.control is not None:
            self.recorder.control.close()
            self.rundir.update(control=self.recorder.control.state())
        self.rundir.finish(self.recorder.skipped, records_file=RECORDS_FILE if records else None)
        if interrupt is not None:
            raise interrupt  # an interrupt stays one: never turned into a clean return (or exit)

    def __enter__(self) -> Dumper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("failed" if self.failure else "open")
        return (
            f"Dumper({self.run_dir}, modules={len(self.modules)}, mode={self.settings.mode}, "
            f"next_pass={self.recorder.next_index}, {state})"
        )

    # ---------------------------------------------------------------- runtime protocol

    def owns_pass_on_this_thread(self) -> bool:
        return self.recorder.owns_pass_on_this_thread()

    def quiesce_for_fork(self) -> None:
        if self.rundir.pid == os.getpid():  # a writer inherited over an earlier fork has no thread here
            self.rundir.writer.flush()

    def note_compiled(self) -> None:
        if self.settings.compiled:
            return  # COMPILED: the graph holds taps; nothing is missing to warn about
        self.recorder.note_compiled()

    # ---------------------------------------------------------------- internals

    def _detach(self) -> None:
        """Remove every hook this dumper added and drop it from the module-level ``record()`` target."""
        runtime().remove(self)
        self.rundir.forget_exit()
        self.hooks.remove()
        if self.ops is not None:
            self.ops.remove()
        if self.taps is not None:
            self.taps.remove()
            self.taps.target.unregister()
            unwatch(self.taps.target)
        if self.graft is not None:
            self.graft.remove()

    def _follow(self, outputs: bool, inputs: bool) -> None:
        """``CONTROL`` with ``COMPILED``: armed or disarmed, the eager hooks follow and the compiled
        graph's taps switch with them (:data:`~tracedump.dump.taps.LIVE`)."""
        self.hooks.set_capturing(outputs, inputs)
        refresh_taps()

    def _wanted(self) -> bool:
        """Whether the compiled graph should hold the module taps now: while suspended (an
        engine's profile run is where it compiles, and an engine that drops guards, as vLLM does,
        runs that graph for good), else for an armed, selected step, open or next."""
        recorder = self.recorder
        if recorder.closed:
            return False
        if recorder.suspended():
            return True
        if recorder.idle:
            return False
        current = recorder.current
        return current.selected if current is not None else recorder.next_index in recorder.keep.steps

    def _capturing(self) -> bool:
        """Whether the open pass takes captures (armed, selected, not suspended)."""
        current = self.recorder.current
        return current is not None and current.selected and not self.recorder.idle

    def _tap_hooks(self, model: nn.Module, target: Any, inputs: Any, sites: CallSites | None) -> TapHooks:
        """``COMPILED``: the hooks that put a ``tracedump::tap`` op into every graph Dynamo traces
        through the selected modules (:mod:`tracedump.dump.taps`); at run time the op hands the
        compiled program's tensors to ``target`` (the recorder) and opens and closes the passes
        through the root's pass hooks, as an eager forward does. CUDA graphs captured while this
        dumper is open run their taps at each replay (:mod:`tracedump.dump.replays`); the manifest's
        ``compiled`` counts the taps and the bytes those graphs hold."""
        root = self.hooks.root

        def open_pass(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if root.layout is not None:
                root.before_with_kwargs(model, args, kwargs)
            else:
                root.before(model, args)

        tap_target = TapTarget(
            capture=lambda name, value, is_input: target.on_module_tensors(name, value, is_input=is_input),
            open_pass=open_pass,
            close_pass=lambda: root.after(model, (), ()),
            report=self.recorder.report,
            warn=self.warn,
            changed=lambda: self.rundir.note(compiled=tap_target.summary()),
            wanted=self._wanted,
            capturing=self._capturing,
        ).register()
        try:
            hooks = TapHooks(model, tap_target, self.modules, inputs, sites, eager=self.hooks.handles)
        except BaseException:
            tap_target.unregister()
            self.hooks.remove()
            raise
        self.rundir.update(compiled=tap_target.summary())
        watch(tap_target)
        return hooks

    def _op_taps(self, model: nn.Module, names: dict[str, nn.Module]) -> Any:
        """``OPS``: the op taps on the matching modules (:mod:`tracedump.dump.ops`), or None."""
        if self.settings.ops is None:
            return None
        taps = OpTaps(self.recorder, names.items(), self.settings.ops)
        if not taps.names:
            self.warn("ops_none", f"tracedump: {self.settings.describe('ops')} matches no module")
        return taps

    def _grafter(self, model: nn.Module, settings: DumpSettings) -> Grafter:
        """GRAFT_FROM: the grafter, checked (reference, level, map, target dir) before any hook."""
        grafter = Grafter(
            model,
            settings.graft_from,  # type: ignore[arg-type]
            level=settings.graft_level,
            maps=settings.graft_map or (),
            captured=self.modules,
            rank=rank_and_world()[0],
            root=self.root_label,
            pass_index=self._graft_pass,
            warn=self.warn,
            where=settings.describe("graft_from"),
            shadow=self._shadow(settings),
        )
        return grafter

    def _shadow(self, settings: DumpSettings) -> Shadow | None:
        """GRAFT_SHADOW (on by default): each grafted call run again in float32 (:mod:`.shadow`),
        its tensors recorded beside the real ones. Late-bound: the recorder does not exist yet."""
        if not settings.graft_shadow:
            return None
        return Shadow(
            record=lambda tag, tensor: self.record(tag, tensor),
            quiet=lambda: self._ops_paused(),
            captured={},
            inputs=settings.inputs,
        )

    def _graft_pass(self) -> int | None:
        """The pass a grafted call belongs to: this thread's open pass, if it is kept."""
        current = self.recorder.current
        if current is None or not current.selected or not self.recorder.owns_pass_on_this_thread():
            return None
        return current.index

    def _ready_for_pass(self) -> bool:
        """Before a pass opens: a forked child takes its own run dir; a provisional rank settles."""
        if _PID[0] != self.rundir.pid and not self._rebind_after_fork():
            return False
        if self.rundir.rank_provisional:
            self.rundir.settle_rank()
        return True

    def _rebind_after_fork(self) -> bool:
        """A forked child inherits the hooks but not the writer thread: give it its own run dir.

        Runs inside a forward hook, so a failure (the dump dir gone, say) is reported, and the child
        stops dumping, rather than raised."""
        self.recorder.reset()
        try:
            self.rundir.rebind_after_fork()
        except ConfigError as e:
            self._closed = self.recorder.closed = True
            self._detach()  # this child dumps nothing: leave its model exactly as if never attached
            self.warn("fork_dir", f"tracedump: a forked child's run dir: {e}; this child dumps nothing")
            return False
        control = self.recorder.control
        if control is not None:
            self.recorder.control = control.forked(self.rundir.path)
            self.rundir.update(control=self.recorder.control.state())
        return True
