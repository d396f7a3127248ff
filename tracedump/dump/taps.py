"""``TRACEDUMP_DUMP_COMPILED=1``: the capture as an operation of the compiled graph.

Dynamo traces a module's forward hooks into the graph it compiles; a host copy in a hook would
break the graph, so tracedump's capture hooks stay out of it (:func:`~.hooks.traced_by_dynamo`).
With ``COMPILED=1`` a second set of hooks (:class:`TapHooks`) acts *only while Dynamo traces*:
each selected module's output leaves become the arguments of one call of the custom op
``tracedump::tap(Tensor[] xs, str key) -> ()``, registered with :mod:`torch.library` and marked
effectful (``EffectType.ORDERED``, as ``aten::_print``), so no pass removes or reorders it.
Inductor keeps it as a fallback kernel: at run time, inside the compiled code, the op's
implementation hands the tensors the compiled program computed to the dumper's recorder (gates,
STEPS, the pass, the copy), under the key the eager hook would have used. The root model's hooks
emit two more taps (``open``, with the root's tensor arguments for the HF batch layout, and
``close``), so each compiled root forward is one pass, as an eager one is.

The ``key`` argument is a constant of the graph: ``<dumper serial>\\x1f<kind>\\x1f<name>\\x1f<paths>``
(kind ``out``, ``in``, ``open``, ``close``; paths the output paths of the leaves, joined by
``\\x1e``). Each hook makes its part of the key once, as text, when it is registered: nothing the
trace reads to build a key is an int ``dynamic=True`` could make symbolic. The op looks the dumper
up by its serial in :data:`_TARGETS` (a dumper closed since the graph was compiled is skipped: the
op then does nothing). A module shared by several parents is named, while Dynamo traces, after the
parent whose method Dynamo is inlining (:func:`_caller_name`), as the eager stack walk names it.

Idle: the module taps go into a traced graph only while their dumper wants the step (:data:`LIVE`,
which Dynamo guards on), so an idle step runs the tap-free graph; the root's hooks run uncompiled
when Dynamo meets them as frames of their own (:func:`run_root_hooks_eagerly`).

What compiling cannot keep (docs/compiled.md): an output inductor would have fused away is
materialised for the tap (the tap is an extern call, a fusion boundary; values are the same bits
the fused kernel would have fed on only when inductor does not recompute them inside the fused
kernel); ``OPS`` sees no op of a compiled region.

CUDA graphs: a tap that runs while a CUDA graph is captured copies its tensors into buffers that
live as long as the graph (the copy kernels are captured with it, so every replay refreshes them),
the pass edges (``open``, ``close``) included; :meth:`GraphTaps.replayed` hands them to the dumper
after each replay, in capture order, as :meth:`TapTarget.run` would have. :mod:`.replays` calls
:meth:`GraphTaps.captured` and :meth:`GraphTaps.replayed` from ``torch.cuda.CUDAGraph`` itself.
Tested on CPU with fakes; no GPU was lent when this was written.

Off (``COMPILED`` unset): nothing here runs; the op is registered by the first dumper that asks.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import re
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .cuda import stream_is_capturing
from .hooks import CallSites, RootPassHooks, flatten_inputs, flatten_tensors
from .torch_compat import (
    dynamo_inlined_modules,
    dynamo_skipper,
    forward_hooks,
    forward_pre_hooks,
    mark_constant_result,
    register_ordered_effect,
)

__all__ = ["GraphTaps", "TapHooks", "TapTarget", "register_tap_op", "tap"]

OP_NAMESPACE = "tracedump"
OP_NAME = "tap"
FIELD = "\x1f"  # between the parts of a tap's key
PATH = "\x1e"  # between the paths of its leaves

_MODULE_KINDS = frozenset(("out", "in"))  # the taps of modules; the pass edges are open and close
_TARGETS: dict[int, TapTarget] = {}  # dumper serial -> where its taps go (the one process-wide table)
_serials = itertools.count(1)
_register_lock = threading.Lock()
_registered = False


class TapTarget:
    """What a tap running in compiled code reaches: the recorder's capture entry point and the
    root's pass hooks, for one dumper. ``graph`` keeps the captures made during a CUDA-graph
    capture (:class:`GraphTaps`)."""

    def __init__(
        self,
        capture: Callable[[str, Any, bool], None],
        open_pass: Callable[[tuple[Any, ...], dict[str, Any]], None],
        close_pass: Callable[[], None],
        report: Callable[[str, Exception], None],
        warn: Callable[[str, str], None] | None = None,
        changed: Callable[[], None] | None = None,
        wanted: Callable[[], bool] | None = None,
        capturing: Callable[[], bool] | None = None,
    ) -> None:
        self.capture = capture
        self.open_pass = open_pass
        self.close_pass = close_pass
        self.report = report
        self.warn = warn  # once per key (the dumper's Warner): the CUDA-graph buffers' size
        self.changed = changed  # after a CUDA graph's capture: the manifest's ``compiled`` again
        # Whether this dumper wants captures from the step running or coming (:data:`LIVE`)
        self.wanted = wanted if wanted is not None else (lambda: True)
        self.capturing = capturing if capturing is not None else (lambda: False)  # the open pass is
        self.idle_graph_steps = 0  # wanted steps that ran a graph traced without module taps
        self._taps_at_open = -1
        self.serial = next(_serials)
        self.owner = str(self.serial)  # its key in LIVE
        self.graph = GraphTaps(self)
        self.taps = 0  # taps run (outputs and inputs), for the manifest and the tests

    def summary(self) -> dict[str, int]:
        """The manifest's ``compiled``: taps run, CUDA graphs holding taps, the bytes they hold."""
        return {
            "taps": self.taps,
            "cuda_graphs": len(self.graph.graphs),
            "graph_tap_bytes": self.graph.bytes,
            "idle_graph_steps": self.idle_graph_steps,
        }

    def register(self) -> TapTarget:
        _TARGETS[self.serial] = self
        refresh()
        return self

    def refresh(self) -> None:
        """Set this dumper's :data:`LIVE` entry from :attr:`wanted`: what its own pass edges do.
        Another dumper's entry is set at that dumper's edges, which run before its model's
        compiled frame checks its guard; refreshing every dumper at each edge cost one
        :attr:`wanted` per open dumper and step."""
        try:
            on = bool(self.wanted())
        except Exception as e:  # never into the host: the taps stay traced, the safe side
            on = True
            self.report("COMPILED live state", e)
        LIVE[self.owner] = on

    def unregister(self) -> None:
        _TARGETS.pop(self.serial, None)
        LIVE.pop(self.owner, None)

    def run(self, tensors: list[torch.Tensor], key: str) -> None:
        """One tap, at run time (inside the compiled code): the capture, or a pass edge; during a
        CUDA graph's capture, kept for the graph's replays (:class:`GraphTaps`)."""
        _, kind, name, paths, _ = _parsed(key)
        if stream_is_capturing():
            self.graph.capture(kind, name, paths, tensors)
        else:
            self.dispatch(kind, name, paths, tensors)

    def dispatch(self, kind: str, name: str, paths: str, tensors: list[torch.Tensor]) -> None:
        """What a tap of ``kind`` does with its tensors: open or close the pass, or capture them."""
        if kind == "out" and not paths and len(tensors) == 1:
            self.taps += 1  # one tensor, the module's whole output: nothing to rebuild
            self.capture(name, tensors[0], False)
        elif kind == "open":
            args, kwargs = _rebuild_call(tensors, paths)
            self.open_pass(args, kwargs)
            self.refresh()  # this step's state, for the guard of a model frame compiled apart
            self._taps_at_open = self.taps
        elif kind == "close":
            if self.taps == self._taps_at_open and self.capturing():
                self._ran_idle_graph()
            self.close_pass()
            self.refresh()
        else:
            self.taps += 1
            self.capture(name, _rebuild(kind, paths, tensors), kind == "in")

    def _ran_idle_graph(self) -> None:
        """A wanted step ran no module tap: its graph was the tap-free one (the pass edges and the
        model in one compiled frame, whose guard was checked before this step armed). Counted in
        the manifest's ``compiled.idle_graph_steps``, said once; never silent."""
        self.idle_graph_steps += 1
        if self.idle_graph_steps == 1:
            self.report(
                "COMPILED idle graph",
                RuntimeError(
                    "a dumped step ran the compiled graph traced without its module taps (its guard "
                    "was checked before the step was armed): that step's module outputs are missing"
                ),
            )


def _rebuild(kind: str, paths: str, tensors: list[torch.Tensor]) -> Any:
    """A value the recorder flattens to exactly these ``(path, tensor)`` leaves: nested dicts keyed
    by each path's items as text (``flatten_tensors`` writes ``[{key}]``, so ``"0"`` gives ``[0]``).
    An input's value is ``((), kwargs)``, flattened under ``@in`` as its paths were."""
    root: dict[str, Any] = {}
    single = None
    for path, tensor in zip(paths.split(PATH) if paths else [""], tensors, strict=False):
        items = _path_items(path.removeprefix("@in") if kind == "in" else path)
        if not items:
            single = tensor
            continue
        node = root
        for item in items[:-1]:
            node = node.setdefault(item, {})
        node[items[-1]] = tensor
    if kind == "in":
        return ((), root)
    return single if single is not None and not root else root


_ITEM = re.compile(r"\[([^\]]*)\]")


def _path_items(path: str) -> list[str]:
    return _ITEM.findall(path)


def _rebuild_call(tensors: list[torch.Tensor], paths: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The root call's tensor arguments: ``paths`` names each (``0`` positional, else a keyword)."""
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    for name, tensor in zip(paths.split(PATH) if paths else [], tensors, strict=False):
        if name.isdigit():
            index = int(name)
            args.extend([None] * (index + 1 - len(args)))
            args[index] = tensor
        else:
            kwargs[name] = tensor
    return tuple(args), kwargs


@functools.lru_cache(maxsize=65536)
def _parsed(key: str) -> tuple[int, str, str, str, str]:
    """A tap's key taken apart: ``(serial, kind, name, paths, serial as text)``. Cached: each key
    is a constant of its graph, met again at every step (docs/performance.md: compiled models)."""
    serial, kind, name, paths = key.split(FIELD, 3)
    return int(serial), kind, name, paths, serial


def tap(tensors: list[torch.Tensor], key: str) -> None:
    """The op's implementation, on every device: hand the tensors to the dumper whose serial the
    key names. Never raises into the compiled program: a failure is reported by the dumper."""
    serial, kind, _, _, owner = _parsed(key)
    if kind in _MODULE_KINDS and not LIVE.get(owner, True) and not stream_is_capturing():
        return  # its dumper wants no capture now: a graph kept with its taps (guards dropped) idles
    target = _TARGETS.get(serial)
    if target is None:
        return  # the dumper closed since this graph was compiled
    try:
        target.run(tensors, key)
    except Exception as e:
        target.report("COMPILED tap", e)


def register_tap_op() -> Any:
    """``torch.ops.tracedump.tap``, registered once per process (the first ``COMPILED`` dumper):
    a custom op with no output, no fake-mode work, and an ordered effect so that neither Dynamo,
    AOTAutograd nor inductor drops or reorders it."""
    global _registered
    with _register_lock:
        if not _registered:
            library = torch.library.Library(OP_NAMESPACE, "FRAGMENT")
            library.define(f"{OP_NAME}(Tensor[] xs, str key) -> ()")
            library.impl(OP_NAME, tap, "CompositeExplicitAutograd")
            torch.library.register_fake(f"{OP_NAMESPACE}::{OP_NAME}", _fake_tap, lib=library)
            register_ordered_effect(f"{OP_NAMESPACE}::{OP_NAME}")
            _LIBRARIES.append(library)
            _registered = True
    return getattr(torch.ops, OP_NAMESPACE).tap


_LIBRARIES: list[Any] = []  # a torch.library.Library unregisters its ops when collected


def _fake_tap(tensors: list[torch.Tensor], key: str) -> None:
    return None


def _key(serial: int, kind: str, name: str, paths: Iterable[str]) -> str:
    return FIELD.join((str(serial), kind, name, PATH.join(paths)))


# Per open COMPILED dumper (its serial as text): whether the module taps go into the graph Dynamo
# traces now. The tap hooks read it while tracing, so Dynamo guards each compiled frame on its
# dumper's entry: off, the graph is the tap-free one (only the pass edges stay); arming switches
# to the tapped graph, compiled once and cached beside it, and disarming back, with no recompile
# after the first of each. Set at every pass edge, arm and disarm (:func:`refresh`). At run time
# a module tap whose dumper's entry is off returns at once (a graph kept with its taps: vLLM drops
# Dynamo's guards and keeps its first graph for good).
LIVE: dict[str, bool] = {}


def refresh() -> None:
    """Set :data:`LIVE` from every open ``COMPILED`` dumper's :meth:`TapTarget.wanted`."""
    for target in tuple(_TARGETS.values()):
        target.refresh()


class TapHooks:
    """The hooks that put taps into a graph Dynamo traces; in an eager call they return at once.

    One forward hook per selected module (and a pre-hook per module whose inputs are kept), and on
    the root a pre-hook that runs first and a post-hook that runs last (the pass edges). A module
    with several names (``sites``) is named at trace time after the parent that calls it
    (:func:`_caller_name`)."""

    def __init__(
        self,
        model: nn.Module,
        target: TapTarget,
        outputs: Iterable[tuple[str, nn.Module]],
        inputs: Iterable[tuple[str, nn.Module]] = (),
        sites: CallSites | None = None,
        eager: Iterable[RemovableHandle] = (),
    ) -> None:
        """``eager``: the dumper's other hooks; with these, those on the root run uncompiled
        (:func:`run_root_hooks_eagerly`)."""
        self.target = target
        self.op = register_tap_op()
        self.handles: list[RemovableHandle] = []
        serial = target.serial
        eager_ids = {handle.id for handle in eager}
        opener = _RootOpen(self.op, serial, "open")
        closer = _RootClose(self.op, serial, "close")
        # The pass edges ride on the eager pass hooks when the dumper has them (one hook call per
        # edge and step, where separate tap hooks made five: docs/compiled.md, Idle)
        fused = _fuse_edges(model, eager_ids, opener, closer, target)
        try:
            if not fused:
                self.handles.append(model.register_forward_pre_hook(opener, prepend=True, with_kwargs=True))
            for name, module in inputs:
                self.handles.append(
                    module.register_forward_pre_hook(
                        _InputTap(self.op, serial, "in", name, sites), with_kwargs=True
                    )
                )
            for name, module in outputs:
                self.handles.append(
                    module.register_forward_hook(_OutputTap(self.op, serial, "out", name, sites))
                )
            if not fused:
                self.handles.append(model.register_forward_pre_hook(_RootOpened()))
                self.handles.append(model.register_forward_hook(closer, always_call=True))
        except BaseException:
            self.remove()
            raise
        run_root_hooks_eagerly(model, {handle.id for handle in self.handles} | eager_ids)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        for prefix in [p for p, shared in _SHARED.items() if shared[0] == self.target.serial]:
            _SHARED.pop(prefix, None)


def run_root_hooks_eagerly(model: nn.Module, ids: Iterable[int]) -> None:
    """Let tracedump's hooks on the root run as plain Python when Dynamo meets them as frames of
    their own. ``torch.compile(model)`` runs the root's ``_call_impl`` uncompiled and compiles each
    hook it calls as a separate frame: one more guard check and compiled call per hook and step,
    which on a small model cost more than the graph itself. Each of the dumper's root hooks is put
    inside an :class:`_EagerAtTop`, whose frames Dynamo skips at the top: there the eager pass
    hooks open and close the pass (as for an engine whose root stays eager) and the tap hooks
    return at once; traced inline (a compiled function that calls the model) the wrapper is traced
    through, taps and all. Only the hooks of ``ids`` (this ``COMPILED`` dumper's handles) are
    wrapped: another dumper's stay as they are. Private Dynamo API: a torch without it keeps the
    frames."""
    if _SKIP_AT_TOP is None:
        return
    wanted = set(ids)
    for hooks in (forward_pre_hooks(model), forward_hooks(model)):
        for key, hook in list(hooks.items()):
            if key in wanted and not isinstance(hook, (_EagerAtTop, *_AT_TOP)):
                hooks[key] = _EagerAtTop(hook)


def _fuse_edges(
    model: nn.Module, ids: set[int], opener: _RootOpen, closer: _RootClose, target: TapTarget
) -> bool:
    """Put the ``open`` and ``close`` taps inside the dumper's eager pass hooks on the root (its
    first pre-hook and its closing forward hook, both among ``ids``): one hook call per edge.

    Why: a step that dumps nothing still runs the root's hooks, and inside a forward each Python
    call costs many times its tight-loop time (docs/performance.md); separate tap hooks (open,
    the guard's refresh, close) made five calls per step where two do the same work. False (nothing
    changed) when the root has no such pair of hooks: the taps then get hooks of their own."""
    pre, post = forward_pre_hooks(model), forward_hooks(model)
    opening = next((k for k, h in pre.items() if k in ids and _is_pass_hook(h)), None)
    closing = next((k for k, h in post.items() if k in ids and _is_pass_hook(h)), None)
    if opening is None or closing is None:
        return False
    pre[opening] = _OpenEdge(opener, pre[opening], target)
    post[closing] = _CloseEdge(closer, post[closing])
    return True


def _is_pass_hook(hook: object) -> bool:
    """A bound method of :class:`~.hooks.RootPassHooks` that opens (``before``,
    ``before_with_kwargs``) or closes (``after``) the pass."""
    name = getattr(hook, "__name__", "")
    return isinstance(getattr(hook, "__self__", None), RootPassHooks) and name in _EDGE_METHODS


_EDGE_METHODS = frozenset(("before", "before_with_kwargs", "after"))


class _OpenEdge:
    """The root's opening pre-hook for a ``COMPILED`` dumper: traced, the ``open`` tap (then the
    eager hook, which only notes the trace); eager, the pass opened by the eager hook, then
    :meth:`TapTarget.refresh`, so a compiled model frame's guard sees this step's state. ``emit``: what a
    CUDA graph's capture keeps (:class:`_EagerAtTop`)."""

    __slots__ = ("eager", "tap", "target")

    def __init__(self, tap: _RootOpen, eager: Callable[..., None], target: TapTarget) -> None:
        self.tap = tap
        self.eager = eager
        self.target = target

    def __call__(self, module: nn.Module, *rest: Any) -> None:
        if torch.compiler.is_compiling():
            self.emit(module, *rest)
            self.eager(module, *rest)
        elif stream_is_capturing():
            self.emit(module, *rest)  # as :class:`_EagerAtTop` does: the graph keeps the edge
        else:
            self.eager(module, *rest)
            self.target.refresh()

    def emit(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> None:
        self.tap.emit(module, args, kwargs or {})

    def __repr__(self) -> str:
        return f"_OpenEdge({self.eager!r})"


class _CloseEdge:
    """The root's closing forward hook for a ``COMPILED`` dumper: traced, the ``close`` tap, then
    the eager hook (which returns at once there); eager, the eager hook closes the pass."""

    __slots__ = ("eager", "tap")

    def __init__(self, tap: _RootClose, eager: Callable[..., None]) -> None:
        self.tap = tap
        self.eager = eager

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling():
            self.tap.emit(module, args, output)
            self.eager(module, args, output)
        elif stream_is_capturing():
            self.tap.emit(module, args, output)
        else:
            self.eager(module, args, output)

    def emit(self, module: nn.Module, args: Any, output: Any) -> None:
        self.tap.emit(module, args, output)

    def __repr__(self) -> str:
        return f"_CloseEdge({self.eager!r})"


class _EagerAtTop:
    """A root hook whose frame, met by Dynamo at the top, runs uncompiled with all it calls.
    During a CUDA graph's capture it calls the tap hooks' :meth:`emit` only (the op called eagerly
    keeps its buffers in the graph) and the eager pass hooks not at all."""

    __slots__ = ("hook",)

    def __init__(self, hook: Callable[..., Any]) -> None:
        self.hook = hook

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not stream_is_capturing():
            return self.hook(*args, **kwargs)
        # A CUDA graph captures the compiled model: the root's taps go into the graph, replayed
        # with it (pass edges and the root's own output, :class:`GraphTaps`), as they would from
        # compiled frames; the eager pass hooks do nothing during a capture.
        emit = getattr(self.hook, "emit", None)
        return emit(*args, **kwargs) if emit is not None else None


_SKIP_AT_TOP = dynamo_skipper()
# The pass edges of a COMPILED dumper (:func:`_fuse_edges`) act as their own :class:`_EagerAtTop`:
# one Python call fewer per edge and step. Only where Dynamo can skip them.
_AT_TOP: tuple[type, ...] = ()
if _SKIP_AT_TOP is not None:
    try:
        for _code in (_EagerAtTop.__call__, _OpenEdge.__call__, _CloseEdge.__call__):
            _SKIP_AT_TOP(_code.__code__)
        _AT_TOP = (_OpenEdge, _CloseEdge)
    except Exception:
        _SKIP_AT_TOP = None


# A shared module's tap prefix -> (serial, the dumper's call sites, the module's hooked name).
_SHARED: dict[str, tuple[int, str, CallSites, str]] = {}


class _Tap:
    """A hook that, while Dynamo traces, calls the tap op; eager calls return at once.

    ``prefix`` is the key without its paths, a string made here, once: everything the trace reads
    to build a key is a constant of the trace (no int, which ``dynamic=True`` would make symbolic)."""

    __slots__ = ("name", "op", "owner", "prefix", "shared")

    def __init__(
        self, op: Any, serial: int, kind: str, name: str = "", sites: CallSites | None = None
    ) -> None:
        self.op = op
        self.name = name
        self.owner = str(serial)
        self.prefix = _key(serial, kind, name, ())
        self.shared = sites is not None and sites.shared(name)
        if self.shared:
            _SHARED[self.prefix] = (serial, kind, sites, name)  # type: ignore[assignment]

    def key(self, paths: list[str]) -> str | None:
        """The tap's key; None for a shared module's call under a name the filter leaves out."""
        prefix = _caller_name(self.prefix) if self.shared else self.prefix
        return prefix + PATH.join(paths) if prefix else None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class _OutputTap(_Tap):
    __slots__ = ()

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling() and LIVE.get(self.owner, True):
            self.emit(module, args, output)

    def emit(self, module: nn.Module, args: Any, output: Any) -> None:
        leaves = list(flatten_tensors(output))
        key = self.key([p for p, _ in leaves]) if leaves else None
        if key is not None:
            self.op([t for _, t in leaves], key)


class _InputTap(_Tap):
    __slots__ = ()

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if torch.compiler.is_compiling() and LIVE.get(self.owner, True):
            self.emit(module, args, kwargs)

    def emit(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        leaves = flatten_inputs(args, kwargs)
        key = self.key([p for p, _ in leaves]) if leaves else None
        if key is not None:
            self.op([t for _, t in leaves], key)


class _RootOpen(_Tap):
    """The pass's opening edge, traced whatever :data:`LIVE` says: it is what opens (and, with
    ``CONTROL``, arms) a step."""

    __slots__ = ()

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if torch.compiler.is_compiling():
            self.emit(module, args, kwargs)

    def emit(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        named = [(str(i), a) for i, a in enumerate(args)] + list(kwargs.items())
        tensors = [(n, v) for n, v in named if isinstance(v, torch.Tensor)]
        self.op([t for _, t in tensors], self.prefix + PATH.join([n for n, _ in tensors]))


class _RootOpened:
    """In an eager root call, after the pass opened (the engine's root stays eager while its inner
    model runs compiled, as vLLM's does): :func:`refresh`, so the compiled model's guard sees
    this step's state."""

    __slots__ = ()

    def __call__(self, module: nn.Module, args: Any) -> None:
        if not torch.compiler.is_compiling():
            refresh()


class _RootClose(_Tap):
    __slots__ = ()

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling():  # eager: the next step's state is set when it opens
            self.emit(module, args, output)

    def emit(self, module: nn.Module, args: Any, output: Any) -> None:
        self.op([], self.prefix)


@mark_constant_result
def _caller_name(prefix: str) -> str:
    """While Dynamo traces a shared module's tap: the key prefix under the name of the parent that
    calls it, as :class:`~.hooks.CallSites` names an eager call from the Python stack. Dynamo runs
    this function for real (its result a constant of the graph) with its own translators as the
    stack: each inlined frame's first argument is the module whose method it runs. Falls back to
    the module's first name when the walk fails (a Dynamo whose internals differ); ``""`` when
    the filter keeps no call under the caller's name."""
    serial, kind, sites, hooked = _SHARED[prefix]
    try:
        name = sites.name_among(hooked, dynamo_inlined_modules())
    except Exception:
        return prefix
    return _key(serial, kind, name, ()) if name is not None else ""


GRAPH_TAP_WARN_BYTES = 1 << 30  # the CUDA graphs' tap buffers above this: one warning


Tap = tuple[str, str, str, list[torch.Tensor]]  # kind, name, paths, the buffers


class GraphTaps:
    """Taps inside captured CUDA graphs: a graph replays kernels, not Python, so a tap's Python
    implementation runs once, at capture. There it copies its tensors into buffers of their own
    (the copies are captured, and each replay refreshes the buffers) and remembers them, the pass
    edges' too; :meth:`captured` (a capture ended) gives the taps made since the last capture to
    that graph, and :meth:`replayed` (after each replay of it) runs them as :meth:`TapTarget.run`
    would have, in capture order. Each graph holds its own buffers (an engine captures one graph
    per batch size): :attr:`bytes` counts them all, and one warning says when they pass
    :data:`GRAPH_TAP_WARN_BYTES`."""

    def __init__(self, target: TapTarget) -> None:
        self.target = target
        self.pending: list[Tap] = []
        self.graphs: dict[int, list[Tap]] = {}
        self.bytes = 0  # held by every graph's buffers (pending ones not counted)
        self._finalizers: dict[int, weakref.finalize] = {}

    def capture(self, kind: str, name: str, paths: str, tensors: list[torch.Tensor]) -> None:
        buffers = [torch.empty_like(t).copy_(t) for t in tensors]  # captured: refreshed by each replay
        self.pending.append((kind, name, paths, buffers))

    def captured(self, graph: object) -> int:
        """The graph whose capture just ended holds the taps made since the last one: how many.
        A graph captured again (after ``reset()``) lets its earlier buffers go."""
        taps, self.pending = self.pending, []
        self.forget(graph)
        if taps:
            self.graphs[id(graph)] = taps
            self.bytes += _nbytes(taps)
            self._forget_when_collected(graph, taps)
            self._check_size()
        return len(taps)

    def abandon(self) -> None:
        """A capture failed: the taps it made belong to no graph."""
        self.pending = []

    def replayed(self, graph: object) -> int:
        """After a replay of ``graph``: its buffers hold this replay's values; each tap runs now."""
        taps = self.graphs.get(id(graph), ())
        for kind, name, paths, buffers in taps:
            self.target.dispatch(kind, name, paths, buffers)
        return len(taps)

    def forget(self, graph: object) -> None:
        self._drop(id(graph))

    def _drop(self, key: int) -> None:
        taps = self.graphs.pop(key, None)
        if taps is not None:
            self.bytes -= _nbytes(taps)
        finalizer = self._finalizers.pop(key, None)
        if finalizer is not None:
            finalizer.detach()  # its buffers go now (a graph captured again, or collected)

    def _forget_when_collected(self, graph: object, taps: list[Tap]) -> None:
        """The buffers live exactly as long as the graph (its copy kernels write there at every
        replay; freed sooner, that memory could be handed to a later capture in the same pool),
        whether or not this dumper still lives; a graph collected lets them go. The finalizer holds
        the buffers, not this object, so a closed dumper is not kept alive by a graph."""
        with contextlib.suppress(TypeError):  # no weak reference to it (``object()``): kept here
            self._finalizers[id(graph)] = weakref.finalize(
                graph, _collected, weakref.ref(self), id(graph), taps
            )

    def _check_size(self) -> None:
        if self.bytes <= GRAPH_TAP_WARN_BYTES or self.target.warn is None:
            return
        self.target.warn(
            "graph_tap_bytes",
            f"tracedump: the CUDA graphs captured so far hold {self.bytes / (1 << 30):.2f} GiB of "
            f"COMPILED tap buffers ({len(self.graphs)} graphs, each keeping a copy of every tapped "
            "tensor at its own batch size). Narrow TRACEDUMP_DUMP_FILTER / TRACEDUMP_DUMP_MODULES, or "
            "the engine's CUDA-graph capture sizes (vLLM: compilation_config.cudagraph_capture_sizes).",
        )


def _collected(owner: weakref.ref[GraphTaps], key: int, taps: list[Tap]) -> None:
    """A graph collected: what its dumper's :class:`GraphTaps` holds for it goes."""
    graph_taps = owner()
    if graph_taps is not None and graph_taps.graphs.get(key) is taps:
        graph_taps._drop(key)


def _nbytes(taps: list[Tap]) -> int:
    return sum(b.nbytes for _, _, _, buffers in taps for b in buffers)
