"""``attach()`` and the :class:`Dumper`: hooks on the selected modules, one pass file per engine step.

Off (no dump dir): ``attach()`` returns ``None`` after one env lookup; nothing is registered, no
thread starts, no file or directory is created. On: forward hooks copy each selected module's
output, a background thread writes ``<dir>/rank<R>_pid<P>/pass<NNNNN>.safetensors``.

Example::

    dumper = tracedump.attach(model)            # TRACEDUMP_DUMP_DIR=/tmp/dump turns it on
    for batch in batches:
        with dumper.step() if dumper else contextlib.nullcontext():
            model(batch)

A failure at run time is reported once and never raised into the model's forward.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import datetime as dt
import itertools
import json
import os
import platform
import re
import shutil
import socket
import sys
import tempfile
import threading
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from . import gates
from ._version import __version__
from .control import Controller
from .cuda import SyncEscape, copy_to_host, stream_is_capturing, warn_once
from .hooks import InputHook, OutputHook, RootPassHooks, flatten_inputs, flatten_tensors
from .reduce import compute_stats, last_row
from .selection import select_modules
from .settings import (
    DEFAULT_ENV_PREFIX,
    ConfigError,
    DumpConfig,
    DumpSettings,
    is_enabled,
    load_settings,
)
from .units import human_bytes
from .writer import (
    MANIFEST,
    RECORDS_FILE,
    RESERVED_NAMES,
    STORABLE_DTYPES,
    PassJob,
    StatsJob,
    Writer,
    write_json_atomic,
)

_active: list[Dumper] = []
_serials = itertools.count()
_fork_guard_installed = False


def _quiesce_writers_before_fork() -> None:
    """A fork copies only the forking thread: a writer thread caught mid-import or mid-write would
    leave the child a half-imported module or a held lock. Let every writer go idle first."""
    for dumper in list(_active):
        if dumper._pid == os.getpid():  # a writer inherited over an earlier fork has no thread here
            with contextlib.suppress(Exception):
                dumper._writer.flush()


def _install_fork_guard() -> None:
    global _fork_guard_installed
    if not _fork_guard_installed and hasattr(os, "register_at_fork"):
        os.register_at_fork(before=_quiesce_writers_before_fork)
        _fork_guard_installed = True


# Skips the settings asked for: reported in the summary, not warned about.
_INTENDED_SKIPS = frozenset({"token_gate", "row_gate", "outside_pass"})
_MAX_ERRORS_KEPT = 20  # distinct error messages kept for the manifest's "errors"


def note_compiled() -> None:
    """Dynamo is compiling a forward with tracedump's hooks in it (see ``hooks.traced_by_dynamo``):
    every open dumper warns once and marks its manifest; with none yet (``tracedump run`` before
    its first root), one warning says what will happen."""
    if not _active:
        warn_once("compiled_without_dumper", _COMPILED_WARNING.format(what="a module forward"))
    for dumper in list(_active):
        dumper._note_compiled()


_COMPILED_WARNING = (
    "tracedump: torch.compile is compiling {what}; a compiled graph runs no hooks, so its calls "
    "are not dumped and their passes will be missing. Skip compiling while dumping: "
    "tracedump.resolve_compile(), TORCHDYNAMO_DISABLE=1, or `tracedump run --no-compile`."
)


def active_dumper() -> Dumper | None:
    """The most recently attached open dumper (the target of module-level ``record()``)."""
    return _active[-1] if _active else None


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
    return Dumper(_unwrap_compiled(model), settings, env_prefix=env_prefix, sync_escape=sync_escape)


def original_module(module: nn.Module) -> nn.Module:
    """The module a ``torch.compile`` wrapper (``OptimizedModule``) runs; any other module itself."""
    original = getattr(module, "_orig_mod", None)
    if isinstance(original, nn.Module) and type(module).__name__ == "OptimizedModule":
        return original
    return module


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


def _rank_and_world() -> tuple[int, int, bool]:
    """Rank and world size from RANK/WORLD_SIZE, else torch.distributed, else (0, 1).

    The third value says the rank is only a guess (no env var, no process group yet): an engine may
    attach before ``init_process_group``, so the dumper settles it at its first pass.
    """
    rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    dist = torch.distributed
    initialised = dist.is_available() and dist.is_initialized()
    provisional = rank is None and not initialised
    if rank is None:
        rank = str(dist.get_rank()) if initialised else "0"
    if world is None:
        world = str(dist.get_world_size()) if initialised else "1"
    return int(rank), int(world), provisional


class _Pass:
    """What one open pass has gathered so far."""

    __slots__ = (
        "anchor",
        "batch",
        "calls",
        "entries",
        "gated",
        "implicit",
        "index",
        "kept",
        "nbytes",
        "order",
        "owner",
        "parts",
        "selected",
        "seqs",
        "stats",
        "truncated",
    )

    def __init__(self, index: int, selected: bool) -> None:
        self.index = index
        self.selected = selected
        self.entries: list[tuple[str, torch.Tensor, Any]] = []
        self.seqs: list[int] = []  # each entry's place in the pass's capture order
        self.order = 0
        self.stats: list[tuple[dict[str, Any], list[str], torch.Tensor, Any]] = []
        self.calls: collections.Counter[str] = collections.Counter()
        self.nbytes = 0
        self.parts = 0
        self.gated = 0
        self.kept = 0
        self.truncated = False  # the forward (or step) that owned it ended by an exception
        self.owner: int | None = None  # the thread whose root forward opened it (None: a step())
        self.batch: str | None = None  # set_batch(): what each token row of this step belongs to
        self.implicit = False  # opened by a capture outside every pass, for the next root forward
        self.anchor: Any = None  # an implicit pass's anchor: the root model's method frame

    def add(self, key: str, tensor: torch.Tensor, event: Any) -> None:
        self.entries.append((key, tensor, event))
        self.seqs.append(self.next_seq())
        self.nbytes += tensor.numel() * tensor.element_size()
        self.kept += 1

    def next_seq(self) -> int:
        """Captures of every kind (whole tensors, stats, records) share one order, so a stats-mode
        pass, which stores records whole and the rest in stats.jsonl, can be merged back in order."""
        self.order += 1
        return self.order - 1

    def take_job(self, part: int | None, mode: str) -> PassJob:
        """The entries gathered so far as one file's job; the pass starts gathering afresh."""
        job = PassJob(
            self.index,
            part,
            mode,
            self.entries,
            self.nbytes,
            seqs=self.seqs if mode == "stats" else None,
            truncated=self.truncated,
            batch=self.batch,
        )
        self.entries, self.seqs, self.nbytes = [], [], 0
        return job

    def next_call(self, key: str) -> int:
        call = self.calls[key]
        self.calls[key] = call + 1
        return call

    @property
    def is_warmup(self) -> bool:
        """Every capture was refused by a gate: a warm-up step, which takes no pass index."""
        return self.gated > 0 and self.kept == 0


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
        self.model_class = f"{type(model).__module__}.{type(model).__qualname__}"
        # Which root this dumper follows; `tracedump run` pairs runs of several roots by it.
        self.root_label = root_label or type(model).__name__
        callables = settings.resolve_callables()  # FILTER_FN, SYNC_ESCAPE: imported here, once per settings
        self._sync_escape = sync_escape if sync_escape is not None else callables.sync_escape
        self._steps = settings.step_selection
        self._mode = settings.mode
        self._full = settings.mode != "stats"
        self._inputs = settings.inputs
        self._name_filter: re.Pattern[str] | None = None  # an armed order's --filter
        self._boundaries = 0  # step boundaries seen (control: the pass index is the step number)
        self._step_depth = 0  # open step() blocks
        self._control: Controller | None = None
        self._idle = False  # control: disarmed, every hook returns at once
        self._suspend_depth = 0
        self._rows: int | None = None
        self._reset_run_state()
        self._serial = next(_serials)  # keys this dumper's one-time warnings (ids get reused)
        self._closed = False
        self.rank, self.world_size, self._rank_provisional = _rank_and_world()
        self._pid = os.getpid()
        # All or nothing: everything that can fail runs before the first hook is registered, and a
        # failure removes the run dir it made, so a bad setting leaves the model as it was.
        self.modules = select_modules(model, settings, env_prefix)
        self._precision = run_precision(model)
        self.run_dir = self._make_run_dir()
        try:
            self._writer = self._start_writer()
        except Exception as e:
            self._remove_run_dir()
            where = settings.describe("dir")
            raise ConfigError(
                f"tracedump: bad setting\n  {where}: cannot write the manifest: {type(e).__name__}: {e}"
            ) from e
        if settings.control:
            self._control = Controller(Path(settings.dir), self.run_dir, self._warn_once)  # type: ignore[arg-type]
            self._idle = True
            self._writer.write_manifest(control=self._control.state())
        self._handles = self._register(model)
        self._flush_at_exit()
        _install_fork_guard()
        _active.append(self)

    # ---------------------------------------------------------------- set-up

    def _claim_run_dir(self, base: Path) -> Path:
        """Create ``rank<R>_pid<P>``, or ``-2``, ``-3``... if taken. The mkdir is the claim: a second
        dumper in this process, or a process with the same pid on a shared disk (containers),
        never writes into a dir another one made."""
        serial = 1
        while True:
            run_dir = base / (f"rank{self.rank}_pid{self._pid}" + (f"-{serial}" if serial > 1 else ""))
            try:
                run_dir.mkdir(mode=0o700)
            except FileExistsError:
                serial += 1
                continue
            os.chmod(run_dir, 0o700)
            return run_dir

    def _make_run_dir(self) -> Path:
        base = Path(self.settings.dir).expanduser()  # type: ignore[arg-type]
        self._made_base = not base.exists()
        try:
            if not base.exists():
                with contextlib.suppress(FileExistsError):  # another rank may create it meanwhile
                    base.mkdir(parents=True, mode=0o700)
                    os.chmod(base, 0o700)
            run_dir = self._claim_run_dir(base)
            with tempfile.TemporaryFile(dir=run_dir):
                pass
        except OSError as e:
            where = self.settings.describe("dir")
            raise ConfigError(
                f"tracedump: bad setting\n  {where}: cannot create or write the dump "
                f"directory: {type(e).__name__}: {e}"
            ) from e
        return run_dir

    def _register(self, model: nn.Module) -> list[Any]:
        # The pass opens before any capture hook of this call runs (a root that is itself a selected
        # leaf has its input hook on the same module) and closes after the last one.
        root = self._root_hooks = RootPassHooks(self)
        handles = [model.register_forward_pre_hook(root.before, prepend=True)]
        self._last_hooks: list[tuple[dict[int, Any], int]] = []
        self._root_ref = weakref.ref(model)
        self._hooks_epoch = -1
        for name, module in self.modules:
            if self.settings.inputs or self._control is not None:  # control: --inputs may arm them
                handle = module.register_forward_pre_hook(InputHook(self, name), with_kwargs=True)
                handles.append(handle)
                self._last_hooks.append((module._forward_pre_hooks, handle.id))
            handle = module.register_forward_hook(OutputHook(self, name))
            handles.append(handle)
            self._last_hooks.append((module._forward_hooks, handle.id))
        closer = model.register_forward_hook(root.after, always_call=True)
        handles.append(closer)
        self._last_hooks.append((model._forward_hooks, closer.id))  # the pass closes after all of them
        return handles

    def keep_hooks_last(self) -> None:
        """Move each capture hook behind any hook the host added after ``attach()``.

        A host hook that replaces a module's input (pre-hook) or output (forward hook) changes what
        the caller continues with; torch runs hooks in registration order, so a capture hook
        registered earlier would record the value before the replacement. Called at the start of
        every outermost root forward, before any selected module's hooks are read for that call:
        a check per selected module (is ours last?), a move only when a host hook was added.
        """
        epoch = RemovableHandle.next_id  # torch numbers every hook it registers, anywhere
        if epoch == self._hooks_epoch:
            return  # no hook was added since the last check: ours are still last
        for hooks, hook_id in self._last_hooks:
            if hook_id in hooks and next(reversed(hooks)) != hook_id:
                hooks.move_to_end(hook_id)  # type: ignore[attr-defined]
        self._hooks_epoch = epoch

    def _start_writer(self) -> Writer:
        manifest = {
            "format": 1,
            "tracedump_version": __version__,
            "torch_version": torch.__version__,
            "python_version": platform.python_version(),
            "settings": self.settings.summary(),
            "env_prefix": self.env_prefix,
            "model_class": self.model_class,
            "root": self.root_label,
            "modules": [name for name, _ in self.modules],
            "precision": self._precision,
            "pid": self._pid,
            "rank": self.rank,
            "world_size": self.world_size,
            "hostname": socket.gethostname(),
            "argv": list(sys.argv),
            "start_time": dt.datetime.now(dt.timezone.utc).isoformat(),
            "complete": False,
            "incomplete_reason": None,
            "skipped": {},
            "truncated_passes": [],
            "errors": [],
            "anomalies": {},
        }
        writer = Writer(self.run_dir, self.settings.max_pending_bytes, manifest, self._on_write_error)
        try:
            write_json_atomic(self.run_dir / MANIFEST, manifest)  # raises, unlike write_manifest()
        except BaseException:
            writer.close()
            raise
        writer.write_manifest()
        return writer

    def _remove_run_dir(self) -> None:
        """Undo :meth:`_make_run_dir` after a failed attach: an empty run dir would be listed (and
        picked by ``open_dump().run()``) ahead of the real one."""
        shutil.rmtree(self.run_dir, ignore_errors=True)
        if self._made_base:
            with contextlib.suppress(OSError):
                self.run_dir.parent.rmdir()  # only if still empty: another rank may be using it

    def _on_write_error(self, failure: str) -> None:
        self._failure = failure
        self._note_error(failure)
        warn_once(
            f"write_error_{self._serial}",
            f"tracedump: {failure}. Dumping stopped; the model "
            f"continues. {self.run_dir / MANIFEST} is marked incomplete.",
        )
        self._writer.write_manifest(complete=False, incomplete_reason=failure, errors=list(self._errors))

    def _settle_rank(self) -> None:
        """Attached before ``init_process_group`` with no RANK env var: take the group's rank now,
        before the first pass, so that every rank does not write a ``rank0`` dir."""
        self._rank_provisional = False
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            return
        rank, world = dist.get_rank(), dist.get_world_size()
        if rank != self.rank:
            previous, self.rank = self.rank, rank
            try:
                moved = self._claim_run_dir(self.run_dir.parent)
                os.rename(self.run_dir, moved)  # replaces the empty dir just claimed
            except OSError as e:
                self.rank = previous
                self._report_run_error("moving the run dir to its rank", e)
                return
            self.run_dir = self._writer.run_dir = moved
        self.world_size = world
        self._writer.write_manifest(rank=self.rank, world_size=world)

    def _flush_at_exit(self) -> None:
        """Close at interpreter exit. Forked multiprocessing workers leave through ``os._exit``,
        which skips atexit but runs multiprocessing's finalizers, so register there too."""
        atexit.register(self.close)
        mp_util = sys.modules.get("multiprocessing.util")
        if mp_util is not None:
            mp_util.Finalize(self, self.close, exitpriority=10)

    def _reset_run_state(self) -> None:
        """What belongs to one run dir: a forked child starts these afresh in its own dir."""
        self._lock = threading.RLock()
        self.skipped: collections.Counter[str] = collections.Counter()
        self._pass: _Pass | None = None
        self._pending_batch: str | None = None  # set_batch() before its step() opened the pass
        self._next_index = 0
        self._once_tags: set[str] = set()
        self._step_counts: collections.Counter[str] = collections.Counter()
        self._loose: list[tuple[str, torch.Tensor, Any]] = []
        self._failure: str | None = None
        self._truncated: list[int] = []
        self._errors: dict[str, None] = {}  # each distinct error once, in order of first sight
        self._anomalies: dict[str, str] = {}  # what went wrong around the dump (manifest "anomalies")
        self._local = threading.local()  # per thread: was its current root forward refused?
        self._explicit_passes = 0  # passes opened by a root forward or step() (see _settle_implicit)
        self._implicit_off = False
        self._anchorless = 0  # outside captures that no method of the model made
        self._anchored = 0  # ... and those one did

    def _rebind_after_fork(self) -> bool:
        """A forked child inherits the hooks but not the writer thread: give it its own run dir.

        Runs inside a forward hook, so a failure (the dump dir gone, say) is reported, and the child
        stops dumping, rather than raised."""
        self._pid = os.getpid()
        self._reset_run_state()
        try:
            self.run_dir = self._make_run_dir()
        except ConfigError as e:
            self._closed = True
            self._detach()  # this child dumps nothing: leave its model exactly as if never attached
            self._report_run_error("a forked child's run dir", e)
            return False
        self._writer = self._start_writer()
        if self._control is not None:
            self._control = self._control.forked(self.run_dir)
            self._writer.write_manifest(control=self._control.state())
        self._flush_at_exit()
        return True

    # ---------------------------------------------------------------- public API

    @property
    def pass_index(self) -> int:
        """Index of the open pass, or of the next one to open."""
        return self._pass.index if self._pass is not None else self._next_index

    @property
    def failure(self) -> str | None:
        """Why dumping stopped (a write error), or None."""
        return self._failure

    @contextlib.contextmanager
    def step(self) -> Iterator[Dumper]:
        """One engine step = one pass. Nested ``step()`` blocks belong to the outer pass."""
        self._settle_implicit()
        opened = self._open_pass() if self._pass is None and not self._suspended() else False
        if opened:
            self._explicit_passes += 1
        elif self._adopt_implicit(owner=None):
            opened = True
        self._step_depth += 1  # root forwards inside belong to this step, armed or not
        try:
            yield self
        except BaseException:  # Ctrl-C or an error cut the step short: what it captured is partial
            if opened:
                opened = False
                self._close_pass(truncated=True)
            raise
        finally:
            self._step_depth -= 1
            self._pending_batch = None  # a set_batch() of this step never outlives it
            if opened:
                self._close_pass()

    @contextlib.contextmanager
    def profiling(self) -> Iterator[None]:
        """Suspend this dumper: no capture, and no pass index is used (the engine's profile run)."""
        self._suspend_depth += 1
        try:
            yield
        finally:
            self._suspend_depth -= 1

    def set_rows(self, rows: int | None) -> None:
        """Report the batch rows of the coming work (for ``MAX_ROWS``); None lifts the row gate."""
        self._rows = rows

    def set_batch(
        self,
        seq_ids: Sequence[int | str] | torch.Tensor,
        positions: Sequence[int] | torch.Tensor | None = None,
        input_ids: Sequence[int] | torch.Tensor | None = None,
    ) -> None:
        """Say which sequence and position each token row of this step holds, so ``tracedump diff
        --align tokens`` can line a batching engine's steps up with a batch-1 reference.

        One entry per token row (the rows along ``TOKEN_DIM``): ``seq_ids`` the request of each row,
        ``positions`` its position in that request (default: each request's rows continue where its
        previous step ended), ``input_ids`` its token id (lets ``diff`` match requests by their
        tokens when the two sides name them differently). Call it inside ``step()`` or just before;
        it is stored in the pass file's metadata (``tracedump.batch``). Pass host lists or CPU
        tensors: a CUDA tensor costs a device sync here. A call with rows that disagree raises
        ``ValueError``: it is a bug in the engine's bookkeeping, caught where it is made."""
        batch = batch_metadata(seq_ids, positions, input_ids)
        if self._pass is not None:
            self._pass.batch = batch
            self._skip_unrequested(self._pass, batch)
        else:
            self._pending_batch = batch

    def record(self, tag: str, tensor: torch.Tensor, once: bool = False) -> None:
        """Store a tensor that is not a module output under ``tag``, whole and in its own dtype.

        ``once=True`` keeps only the first write (e.g. the prefill logits). Inside a pass it goes to
        that pass's file; outside every pass, to ``records.safetensors`` at close. A tag the file
        format reserves (``__metadata__``) raises ``ValueError`` here: it is a bug in the calling
        code, and storing it would make the whole pass file unreadable.
        """
        _check_tag(tag)
        self._record_safely(tag, tensor, once=once)

    def record_step(self, tag: str, tensor: torch.Tensor) -> None:
        """Store ``tag_<n>``, n counting this tag's calls from 0 (e.g. a margin per decode step)."""
        _check_tag(tag)
        self._record_safely(tag, tensor, numbered=True)

    def flush(self) -> None:
        """Wait until every pass closed so far is on disk (the open pass is not cut short)."""
        self._writer.flush()

    def close(self) -> None:
        """Flush everything captured, remove every hook this dumper added; safe to call twice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._detach()
        if os.getpid() != self._pid:  # a forked child that never dumped owns nothing here
            return
        self._settle_implicit(at_close=True)
        if self._pass is not None:
            # A root forward still on record never returned: interrupted (Ctrl-C, then exit).
            self._close_pass(truncated=bool(self._root_hooks.opened))
        if self._loose:
            self._writer.submit(PassJob(-1, None, "records", self._loose, 0, file_name=RECORDS_FILE))
        self._writer.close()
        if self._control is not None:
            self._control.close()
            self._writer.write_manifest(control=self._control.state())
        self._finish_manifest()

    def _detach(self) -> None:
        """Remove every hook this dumper added and drop it from the module-level ``record()`` target."""
        if self in _active:
            _active.remove(self)
        atexit.unregister(self.close)
        for handle in self._handles:
            handle.remove()

    def __enter__(self) -> Dumper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("failed" if self._failure else "open")
        return (
            f"Dumper({self.run_dir}, modules={len(self.modules)}, mode={self.settings.mode}, "
            f"next_pass={self._next_index}, {state})"
        )

    # ---------------------------------------------------------------- passes

    def _suspended(self) -> bool:
        return self._suspend_depth > 0 or gates.globally_suspended()

    def _open_pass(self) -> bool:
        if self._closed:
            return False
        if os.getpid() != self._pid and not self._rebind_after_fork():
            return False
        if self._rank_provisional:
            self._settle_rank()
        index = self._next_index
        if self._control is not None:
            index = self._boundaries
            self._boundaries += 1
            if not self._arm(index):
                return False
        # After a write error a pass still counts as selected: its captures are counted as lost.
        self._pass = _Pass(index, selected=index in self._steps)
        self._pass.batch, self._pending_batch = self._pending_batch, None
        if self._pass.batch is not None:
            self._skip_unrequested(self._pass, self._pass.batch)
        return True

    def _count_armed(self, current: _Pass) -> None:
        """A closed pass of an armed window: it counts towards ``--steps`` and fixes the run's mode."""
        assert self._control is not None
        window = self._control.window
        if window is not None and window.order.request is not None and current.batch is None:
            self._warn_once(
                "control_request",
                "tracedump: an order armed with --request needs the engine to call set_batch() each "
                "step; this step said nothing of its sequences and is dumped whole",
            )
        if current.selected:
            self._control.counted()
            self._control.fixed_mode = self._mode

    def _warn_once(self, key: str, message: str) -> None:
        warn_once(f"{key}_{self._serial}", message)

    def _skip_unrequested(self, current: _Pass, batch: str) -> None:
        """An order armed for one request: a step without that sequence is no dumped step (decided
        by the step's latest ``set_batch``)."""
        window = self._control.window if self._control is not None else None
        if window is None or window.order.request is None:
            return
        held = {str(s) for s in json.loads(batch)["seq_ids"]}
        current.selected = current.index in self._steps and window.order.request in held

    def _arm(self, step: int) -> bool:
        """Control mode, at a step boundary: whether this step is armed, with the order's overrides.

        An order's ``--mode`` becomes the run's mode (a run dir holds passes of one mode: the
        controller refuses another once a pass is written), so it is not reverted at disarm."""
        assert self._control is not None
        window, changed = self._control.at_boundary(step)
        order = window.order if window is not None else None
        self._idle = order is None
        if order is not None and order.mode and order.mode != self._mode:
            self._mode, self._full = order.mode, order.mode != "stats"
            settings = {**self._writer.manifest.get("settings", {}), "mode": self._mode}
            self._writer.write_manifest(settings=settings)
        self._inputs = bool(order and order.inputs) or self.settings.inputs
        self._name_filter = re.compile(order.filter) if order and order.filter else None
        if changed:
            self._writer.write_manifest(control=self._control.state())
        return order is not None

    def _open_auto_pass(self, nested: bool = False) -> bool:
        """Called by the root pre-hook: a pass per root forward when the engine opened none.

        The pass belongs to the calling thread. A root forward entering from another thread while
        it is open would mix two forwards into one pass: that forward is refused instead (see
        :meth:`_refuse_concurrent`), and its thread starts afresh at its next root forward."""
        if self._suspended() or self._step_depth:
            return False
        if nested and self._control is not None and self._pass is None:
            return False  # an inner root call is no step boundary, armed or idle
        me = threading.get_ident()
        self._settle_implicit()
        with self._lock:
            current = self._pass
            if current is not None:
                if current.owner not in (None, me):
                    self._local.concurrent = True
                    self._refuse_concurrent(count=False)
                    return False
                return self._adopt_implicit(owner=me)
            self._local.concurrent = False
            if not self._open_pass():
                return False
            self._pass.owner = me  # type: ignore[union-attr]
            self._explicit_passes += 1
            return True

    def _open_implicit_pass(self) -> _Pass | None:
        """A selected module ran with no pass open, called by a method of the root model (its
        *anchor*: ``generate()`` running the encoder of an encoder-decoder model before the first
        decoder forward, ``vae.decode()`` running the decoder without the VAE's forward).

        The captures go into an *implicit* pass: a root forward (or ``step()``) that starts while
        the anchor still runs adopts it as its own, so the encoder lands in pass 0 before the
        decoder; one that ends with its anchor (no root forward inside) is settled by
        :meth:`_settle_implicit`. A call from anywhere else stays ``outside_pass``, as before."""
        if self._implicit_off:
            return None
        anchor = _outermost_frame_of(self._root_ref())
        if anchor is None:
            # A program that calls parts itself does so at every step: after many such captures
            # and no method-made one, stop walking the stack for each (the old, cheap path).
            self._anchorless += 1
            self._implicit_off = self._anchorless >= _ANCHORLESS_LIMIT and not self._anchored
            return None
        self._anchored += 1
        with self._lock:
            if self._pass is None and self._open_pass():
                self._pass.implicit = True  # type: ignore[union-attr]
                self._pass.owner = threading.get_ident()  # type: ignore[union-attr]
                self._pass.anchor = anchor  # type: ignore[union-attr]
            return self._pass

    def _adopt_implicit(self, owner: int | None) -> bool:
        """Make an implicit pass of this thread the pass of the root forward (or step) starting."""
        current = self._pass
        if current is None or not current.implicit or current.owner != threading.get_ident():
            return False
        current.implicit, current.owner, current.anchor = False, owner, None
        self._explicit_passes += 1
        return True

    def _settle_implicit(self, *, at_close: bool = False) -> None:
        """End an implicit pass whose anchor method returned without a root forward inside it.

        With no root-forward pass so far (a VAE only ever ``decode()``-d), each such call is a
        pass of its own. Once root forwards have made passes, parts called after them (an engine's
        ``compute_logits()`` after each forward) would shift every later pass index, so their
        captures are dropped and counted as ``outside_pass``, and this dumper stops copying such
        calls at all: what it did before, and what keeps its passes aligned with a reference."""
        current = self._pass
        if current is None or not current.implicit or current.owner != threading.get_ident():
            return
        if not at_close and current.anchor is not None and _on_stack(current.anchor):
            return
        if self._explicit_passes and not current.parts:
            self._pass = None
            self.skipped["outside_pass"] += current.kept
            self._implicit_off = True
            return
        self._close_pass()

    def _note_compiled(self) -> None:
        """Once per dumper: warn that compiled calls go undumped, and say so in the manifest."""
        if self._closed or "compiled" in self._anomalies:
            return
        self._anomalies["compiled"] = (
            f"torch.compile compiled this model's forward (first at pass {self.pass_index}); compiled "
            "calls run no capture hook, so their passes are missing"
        )
        self._writer.write_manifest(anomalies=dict(self._anomalies))
        warn_once(f"compiled_{self._serial}", _COMPILED_WARNING.format(what=f"the dumped {self.root_label}"))

    def _refuse_concurrent(self, count: bool = True) -> None:
        """Count a capture of a thread that does not own the open pass; say it once."""
        if count:
            self.skipped["concurrent_thread"] += 1
        if "concurrent_threads" in self._anomalies:
            return
        self._anomalies["concurrent_threads"] = (
            "root forwards from several threads overlapped; the captures of a thread whose forward "
            "began while another thread's pass was open were skipped (skipped.concurrent_thread)"
        )
        self._writer.write_manifest(anomalies=dict(self._anomalies))
        warn_once(
            f"concurrent_{self._serial}",
            "tracedump: a root forward entered from a second thread while another thread's pass "
            "was open; its captures are skipped, not mixed into that pass. Run the dumped model "
            "from one thread at a time, or attach one dumper per model copy.",
        )

    def _close_pass(self, truncated: bool = False) -> None:
        """End the open pass and queue its files. ``truncated``: its forward did not finish (an
        exception, Ctrl-C), so the pass holds only the captures made before that; it is written,
        marked in its file's metadata and in the manifest's ``truncated_passes``."""
        current, self._pass = self._pass, None
        if current is None or current.is_warmup:
            return
        self._next_index = current.index + 1
        if self._control is not None:
            self._count_armed(current)
        if truncated and current.selected:
            current.truncated = True
            self._truncated.append(current.index)
            self._writer.write_manifest(truncated_passes=list(self._truncated))
        try:
            if current.entries:  # a pass whose last capture was spilled has no tail: no empty part file
                part = current.parts + 1 if current.parts else None
                self._writer.submit(current.take_job(part, self._mode))
            if current.stats:
                self._writer.submit(StatsJob(current.index, current.stats))
            if _in_worker_process():
                self._flush_for_termination()
        except Exception as e:
            self._report_run_error(f"pass {current.index}", e)

    def _flush_for_termination(self) -> None:
        """In a multiprocessing worker, write the pass before its forward returns.

        ``with Pool(...)`` ends with ``terminate()``: SIGTERM to every worker, which skips atexit
        and multiprocessing's finalizers, so a pass still queued for the writer thread would be
        lost and the manifest would list none. Here the pass is on disk, and listed, when the
        task's forward returns; the manifest says why it may stay unclosed."""
        self._writer.flush()
        if self._failure is None:
            self._writer.write_manifest(incomplete_reason=_WORKER_NOT_CLOSED, skipped=dict(self.skipped))

    # ---------------------------------------------------------------- hot path

    def _on_module_tensors(self, name: str, value: Any, *, is_input: bool) -> None:
        if self._idle or (is_input and not self._inputs):
            return
        if self._name_filter is not None and not self._name_filter.search(name):
            return
        current, suspended = self._pass, self._suspended()
        if current is None:
            if getattr(self._local, "concurrent", False):  # its forward was refused (see above)
                self.skipped["concurrent_thread"] += 1
                return
            if suspended:
                return
            current = self._open_implicit_pass()
            if current is None:
                self.skipped["outside_pass"] += 1
                return
        elif current.implicit and current.owner == threading.get_ident() and not _on_stack(current.anchor):
            # the anchor call returned: settle that pass (it is this thread's), then start afresh
            self._settle_implicit()
            self._on_module_tensors(name, value, is_input=is_input)
            return
        if current.owner is not None and current.owner != threading.get_ident():
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
            self._report_run_error(name, e)

    def _gated_leaves(self, current: _Pass, value: Any, is_input: bool) -> list[tuple[str, torch.Tensor]]:
        """The tensor leaves of a capture that the warm-up gates let through; none if refused.

        The gates also run in passes that STEPS does not keep, copying nothing: a warm-up step must
        take no pass index even when that index is unselected, or every later pass number shifts.
        """
        settings = self.settings
        if not gates.row_gate_allows(self._rows, settings.max_rows):
            return self._refuse(current, "row_gate")
        leaves = flatten_inputs(*value) if is_input else list(flatten_tensors(value))
        if leaves and not gates.token_gate_allows(leaves[0][1], settings.tokens, settings.token_dim):
            return self._refuse(current, "token_gate")
        return leaves

    def _refuse(self, current: _Pass, gate: str) -> list[tuple[str, torch.Tensor]]:
        current.gated += 1
        if current.selected:
            self.skipped[gate] += 1
        return []

    def _capture_module(
        self, current: _Pass, name: str, leaves: list[tuple[str, torch.Tensor]], is_input: bool
    ) -> None:
        settings = self.settings
        if self._failure is not None:
            self._count_after_failure([tensor for _, tensor in leaves])
            return
        if stream_is_capturing():
            self.skipped["graph_capture"] += 1
            warn_once(
                "graph_capture",
                "tracedump: a hook fired during CUDA graph capture; its copy was "
                "skipped (replays fire no hooks). Disable CUDA graphs while dumping: "
                "tracedump.resolve_cuda_graph().",
            )
            return
        call = current.next_call(name + "@in" if is_input else name)
        call_suffix = f"::call{call}" if call else ""
        for suffix, tensor in leaves:
            if not _storable(tensor):
                self.skipped["unsupported_tensor"] += 1
                continue
            if self._full:
                kept = last_row(tensor, settings.token_dim) if self._mode == "last_row" else tensor
                host, event = copy_to_host(kept, self._sync_escape, self._writer.buffers)
                current.add(f"{name}{suffix}{call_suffix}", host, event)
                self._apply_back_pressure(current)
            else:
                self._keep_stats(current, name, suffix, call, tensor, is_input)

    def _keep_stats(
        self, current: _Pass, name: str, suffix: str, call: int, tensor: torch.Tensor, is_input: bool
    ) -> None:
        numeric, values, extras = compute_stats(tensor, self.settings.stats)
        host, event = copy_to_host(values, self._sync_escape)
        label = "in" + suffix.removeprefix("@in") if is_input else "out" + suffix
        base = {
            "module": name,
            "tensor": label,
            "pass": current.index,
            "call": call,
            "seq": current.next_seq(),
            **extras,
        }
        current.stats.append((base, numeric, host, event))
        current.kept += 1

    def _apply_back_pressure(self, current: _Pass) -> None:
        """Hold host memory under the cap: wait for the writer; spill a pass too big for the cap.

        Free pooled buffers count too; over the cap they are released first, since waiting for the
        writer cannot shrink them."""
        cap = self.settings.max_pending_bytes
        writer = self._writer
        if current.nbytes + writer.pending_bytes + writer.buffers.free_bytes <= cap:
            return
        writer.buffers.clear()
        self._writer.wait_below(cap - current.nbytes)
        if current.nbytes > cap or current.nbytes + self._writer.pending_bytes > cap:
            current.parts += 1
            self._writer.submit(current.take_job(current.parts, self._mode))

    def _record_safely(
        self, tag: str, tensor: torch.Tensor, *, once: bool = False, numbered: bool = False
    ) -> None:
        try:
            self._record(tag, tensor, once=once, numbered=numbered)
        except Exception as e:
            self._report_run_error(f"record({tag!r})", e)

    def _record(self, tag: str, tensor: torch.Tensor, *, once: bool, numbered: bool) -> None:
        if self._idle or self._closed or self._suspended() or (once and tag in self._once_tags):
            return
        if not gates.row_gate_allows(self._rows, self.settings.max_rows):
            self.skipped["row_gate"] += 1  # a warm-up call uses no record_step number either
            return
        if numbered:
            count = self._step_counts[tag]
            self._step_counts[tag] = count + 1
            tag = f"{tag}_{count}"
        if not isinstance(tensor, torch.Tensor):
            tensor = torch.as_tensor(tensor)
        if not _storable(tensor):
            self.skipped["unsupported_tensor"] += 1
            return
        current = self._pass
        if current is not None and not current.selected:
            current.kept += 1  # a real step's record: the pass keeps its index (see _gated_leaves)
            if once:  # the first real write happened, STEPS just did not keep it
                self._once_tags.add(tag)
            return
        if self._failure is not None:
            self._count_after_failure([tensor])
            return
        host, event = copy_to_host(tensor, self._sync_escape, self._writer.buffers)
        if current is None:
            self._loose.append((tag, host, event))
        else:
            call = current.next_call(tag)
            current.add(f"{tag}::call{call}" if call else tag, host, event)
            self._apply_back_pressure(current)
        if once:
            self._once_tags.add(tag)

    # ---------------------------------------------------------------- reporting

    def _count_after_failure(self, tensors: list[torch.Tensor]) -> None:
        """Captures refused because dumping stopped: each one, and its bytes, counts as lost."""
        self.skipped["after_failure"] += len(tensors)
        self.skipped["after_failure_bytes"] += sum(t.numel() * t.element_size() for t in tensors)

    def _note_error(self, text: str) -> None:
        if len(self._errors) < _MAX_ERRORS_KEPT:
            self._errors[text] = None

    def _report_run_error(self, where: str, error: Exception) -> None:
        self.skipped["errors"] += 1
        self._note_error(f"{type(error).__name__}: {error}")
        warn_once(
            f"run_error_{self._serial}",
            f"tracedump: capture failed at {where}: "
            f"{type(error).__name__}: {error}. The model continues; further failures are only "
            f"counted (manifest 'skipped.errors').",
        )

    def _finish_manifest(self) -> None:
        totals = self._writer.totals
        skipped = dict(self.skipped)
        if totals.dropped_jobs:
            skipped["dropped_files"] = totals.dropped_jobs
            skipped["dropped_captures"] = totals.dropped_captures
            skipped["dropped_bytes"] = totals.dropped_bytes
        self._writer.write_manifest(
            complete=self._failure is None,
            incomplete_reason=self._failure,
            skipped=skipped,
            errors=list(self._errors),
            end_time=dt.datetime.now(dt.timezone.utc).isoformat(),
            records_file=RECORDS_FILE if self._loose else None,
        )
        print(
            f"tracedump: {self.run_dir}: {len(totals.passes)} passes, {human_bytes(totals.bytes)}"
            + (f"; skipped {skipped}" if skipped else ""),
            file=sys.stderr,
        )
        losses = {k: v for k, v in skipped.items() if k not in _INTENDED_SKIPS}
        if losses and self._failure is None:
            warn_once(
                f"skipped_{self._serial}",
                f"tracedump: {self.run_dir}: captures lost: {losses} (see manifest.json 'skipped')",
            )


def run_precision(model: nn.Module) -> dict[str, Any]:
    """What the comparator needs to judge this run's numbers: the dtypes its parameters hold, and
    whether fp32 matmuls on CUDA may run in TF32 (a 10-bit mantissa in an fp32 run)."""
    counts: dict[str, int] = {}
    devices: set[str] = set()
    for param in model.parameters():
        name = str(param.dtype).removeprefix("torch.")
        counts[name] = counts.get(name, 0) + param.numel()
        devices.add(param.device.type)
    on_cuda = "cuda" in devices
    tf32 = on_cuda and (
        torch.get_float32_matmul_precision() != "highest" or bool(torch.backends.cuda.matmul.allow_tf32)
    )
    return {
        "parameters": counts,
        "devices": sorted(devices),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "tf32": tf32,
    }


def _as_list(values: Sequence[Any] | torch.Tensor | None) -> list[Any] | None:
    if values is None:
        return None
    if isinstance(values, torch.Tensor):
        return values.detach().reshape(-1).cpu().tolist()
    return list(values)


def batch_metadata(
    seq_ids: Sequence[int | str] | torch.Tensor,
    positions: Sequence[int] | torch.Tensor | None,
    input_ids: Sequence[int] | torch.Tensor | None,
) -> str:
    """The ``tracedump.batch`` JSON of one step, checked: one entry per token row in every list."""
    rows = _as_list(seq_ids) or []
    batch: dict[str, list[Any]] = {"seq_ids": [s if isinstance(s, str) else int(s) for s in rows]}
    for name, values in (("positions", positions), ("input_ids", input_ids)):
        listed = _as_list(values)
        if listed is None:
            continue
        if len(listed) != len(rows):
            raise ValueError(
                f"tracedump set_batch(): {len(listed)} {name} for {len(rows)} seq_ids; "
                "give one entry per token row"
            )
        batch[name] = [int(v) for v in listed]
    return json.dumps(batch, separators=(",", ":"))


_WORKER_NOT_CLOSED = (
    "not closed: a multiprocessing worker (a Pool may terminate it before it exits); each pass "
    "listed here was flushed when its forward returned"
)


def _in_worker_process() -> bool:
    """A multiprocessing child (Pool worker, Process): it may be terminated without any exit hook.
    Only looked at when multiprocessing is already imported; importing it here would cost the host."""
    mp = sys.modules.get("multiprocessing")
    return mp is not None and mp.parent_process() is not None


_ANCHORLESS_LIMIT = 1000


def _outermost_frame_of(model: nn.Module | None) -> Any:
    """The outermost running frame of a method of ``model`` (``generate``, ``decode``), or None."""
    found, frame = None, sys._getframe(2)
    while frame is not None and model is not None:
        if "self" in frame.f_code.co_varnames and frame.f_locals.get("self") is model:
            found = frame
        frame = frame.f_back
    return found


def _on_stack(anchor: Any) -> bool:
    frame = sys._getframe(1)
    while frame is not None:
        if frame is anchor:
            return True
        frame = frame.f_back
    return False


def _check_tag(tag: str) -> None:
    """Refuse a record tag no pass file can hold, at the call that names it."""
    if not isinstance(tag, str) or not tag:
        raise ValueError(f"tracedump.record(): the tag must be a non-empty str, not {tag!r}")
    if tag in RESERVED_NAMES:
        raise ValueError(
            f"tracedump.record(): the tag {tag!r} is reserved by the safetensors format "
            "(it holds the file's metadata); choose another name"
        )


def _storable(tensor: torch.Tensor) -> bool:
    """Whether the pass file can hold ``tensor``. One unwritable tensor (``complex128``, ``int3``)
    would make the whole file unwritable, so it is skipped and counted here instead."""
    return (
        tensor.layout == torch.strided
        and not tensor.is_quantized
        and tensor.device.type != "meta"
        and tensor.dtype in STORABLE_DTYPES
    )
