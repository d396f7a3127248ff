"""Capture hooks and the key naming scheme.

Keys: ``<module>`` for a tensor output, ``<module>[i]`` / ``<module>[key]`` inside tuples, lists,
dicts, dataclasses and HF ``ModelOutput``; ``<module>@in[i]`` / ``<module>@in[kw]`` for inputs; and
``::callN`` last for the N-th repeat call of a module in one pass (``name[0]::call2``).

A module registered under several parents (vLLM's one rotary embedding, held by every layer's
attention) is named by the parent that calls it (:class:`CallSites`): layer 2's call is
``model.layers.2.self_attn.rotary_emb``, and only a second call by the same parent is ``::call1``.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..store.format import INPUT_MARK
from .runtime import runtime
from .torch_compat import (
    call_frame_codes,
    call_impl_frames,
    call_impl_kwargs,
    forward_hooks,
    forward_pre_hooks,
    hook_is_last,
    hook_registrations,
    mark_constant_result,
    move_hook_last,
    nearest_running_call,
    stack_frame,
)

MAX_DEPTH = 8  # nesting levels of an output searched for tensors


def forward_calls_on_stack(module: nn.Module) -> int:
    """How many calls of ``module`` are running on this thread (its ``Module._call_impl`` frames).

    Torch runs ``always_call`` forward hooks only for an ``Exception``; a ``BaseException``
    (Ctrl-C, ``capture()``'s early exit) unwinds a forward without its post-hooks. Looking at the
    stack tells a real nested call from state such an unwind left behind. Walked only when the
    counters say "nested", which for a root module is rare.
    """
    return sum(1 for _ in call_impl_frames(module, stack_frame(1)))


def forward_kwargs_on_stack(module: nn.Module) -> dict[str, Any]:
    """The keyword arguments of the innermost running call of ``module`` (its ``_call_impl``
    frame), ``{}`` when none is found: what a global pre-hook, which sees none, replays."""
    frame = next(call_impl_frames(module, stack_frame(1)), None)
    return call_impl_kwargs(frame) if frame is not None else {}


def flatten_tensors(
    value: Any, prefix: str = "", depth: int = 0, deep: list[int] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(suffix, tensor)`` for every tensor leaf of a nested output; other leaves are skipped.

    Tensors nested more than :data:`MAX_DEPTH` containers deep are not yielded; ``deep`` (a
    one-item counter), when given, is increased by how many there were, so the recorder can count
    them instead of losing them silently."""
    if isinstance(value, torch.Tensor):
        yield prefix, value
        return
    if depth >= MAX_DEPTH:
        if deep is not None:
            deep[0] += _count_tensors(value)
        return
    items = _items(value)
    if items is None:
        return
    for key, item in items:
        yield from flatten_tensors(item, f"{prefix}[{key}]", depth + 1, deep)


def _items(value: Any) -> Iterable[tuple[Any, Any]] | None:
    """The ``(key, item)`` pairs of a container :func:`flatten_tensors` walks into; None for a leaf.

    The cheap tests first: ``None`` and the builtin containers are most of what outputs hold, and
    an ``isinstance`` against the ``Mapping`` ABC costs several times a plain one (hot path)."""
    if value is None:
        return None
    if isinstance(value, (tuple, list)):
        return enumerate(value)
    if isinstance(value, (dict, Mapping)):
        return value.items()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return ((f.name, getattr(value, f.name)) for f in dataclasses.fields(value))
    return None


MAX_DEEP_WALK = 10_000  # containers walked below MAX_DEPTH to count the tensors skipped there


def _count_tensors(value: Any) -> int:
    """How many tensors sit in ``value`` (a container below :data:`MAX_DEPTH`): each container
    walked once (an output that holds itself ends), at most :data:`MAX_DEEP_WALK` of them, so a
    hostile output costs a bounded walk."""
    count, seen, stack = 0, set(), [value]
    while stack and len(seen) < MAX_DEEP_WALK:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            count += 1
        elif id(item) not in seen:
            seen.add(id(item))
            stack.extend(child for _, child in _items(item) or ())
    return count


def distinct_keys(leaves: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """``leaves`` with every suffix unique: two leaves of one output can print alike (``{0: a,
    "0": b}``, a dict key holding ``][``), and a pass file holds one tensor per key. A repeat gets
    ``#1``, ``#2``, ... inside its last bracket (``[0]``, then ``[0#1]``), skipping any suffix the
    output itself holds; leaves keep their order. Free for the usual output (no repeat)."""
    if len(leaves) < 2:
        return leaves
    taken = {suffix for suffix, _ in leaves}
    if len(taken) == len(leaves):
        return leaves
    used: set[str] = set()
    unique = []
    for suffix, tensor in leaves:
        if suffix in used:
            stem, close = (suffix[:-1], "]") if suffix.endswith("]") else (f"{suffix}[", "]")
            n = 1
            while f"{stem}#{n}{close}" in taken or f"{stem}#{n}{close}" in used:
                n += 1
            suffix = f"{stem}#{n}{close}"
        used.add(suffix)
        unique.append((suffix, tensor))
    return unique


def output_leaves(value: Any, deep: list[int] | None = None) -> list[tuple[str, torch.Tensor]]:
    """A module output's tensor leaves under distinct suffixes (``deep``: see :func:`flatten_tensors`)."""
    if isinstance(value, torch.Tensor):
        return [("", value)]
    if type(value) is tuple or type(value) is list:
        flat = flat_leaves(value)
        if flat is not None:
            return flat
    return distinct_keys(list(flatten_tensors(value, deep=deep)))


_INDEX_PATHS = tuple(f"[{i}]" for i in range(16))


def flat_leaves(value: tuple[Any, ...] | list[Any]) -> list[tuple[str, torch.Tensor]] | None:
    """The leaves of a flat tuple or list of tensors and ``None`` (a fused norm's ``(out,
    residual)``, a parallel linear's ``(out, bias)``: most outputs that are not one tensor),
    exactly as :func:`flatten_tensors` names them, without its generators (the hot path,
    docs/performance.md); None for any other shape, which takes the general walk. Index paths are
    distinct by construction."""
    if len(value) > len(_INDEX_PATHS):
        return None
    leaves = []
    for index, item in enumerate(value):
        if isinstance(item, torch.Tensor):
            leaves.append((_INDEX_PATHS[index], item))
        elif item is not None:
            return None
    return leaves


def input_prefix(keyword: str | None = None) -> str:
    """The path that starts a module call's inputs: ``@in`` for the positional ones (then ``[i]``),
    ``@in[kw]`` for keyword argument ``kw``."""
    return INPUT_MARK if keyword is None else f"{INPUT_MARK}[{keyword}]"


def flatten_inputs(
    args: tuple[Any, ...], kwargs: Mapping[str, Any], deep: list[int] | None = None
) -> list[tuple[str, torch.Tensor]]:
    """Inputs as ``@in[i]`` for positional and ``@in[kw]`` for keyword arguments, distinct (a
    keyword named ``"0"`` beside a first positional argument)."""
    leaves = list(flatten_tensors(tuple(args), INPUT_MARK, deep=deep))
    for key, value in kwargs.items():
        leaves.extend(flatten_tensors(value, input_prefix(key), deep=deep))
    return distinct_keys(leaves)


@mark_constant_result
def traced_by_dynamo() -> bool:
    """Say that Dynamo is compiling a forward that holds tracedump's hooks.

    A compiled graph runs no Python hook, so its calls are never dumped. This function is marked
    as having a constant result (:func:`~tracedump.dump.torch_compat.mark_constant_result`):
    Dynamo *calls it for real* while tracing, once per compilation, rather than tracing it, so the
    first compiled call warns and marks the manifest instead of dumping nothing silently. It adds
    nothing to the graph and breaks no ``fullgraph=True`` compile.
    """
    runtime().note_compiled()
    return True


class PassTarget(Protocol):
    """What the hooks need of a recorder (:class:`tracedump.dump.recorder.Recorder`)."""

    def on_module_tensors(self, name: str, value: Any, *, is_input: bool) -> None: ...
    def open_auto_pass(self, nested: bool = False) -> bool: ...
    def close_pass(self, truncated: bool = False) -> None: ...
    def lay_out_batch(self, layout: BatchLayout, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None: ...


class BatchLayout(Protocol):
    """Builds a root forward's ``tracedump.batch`` from its inputs (:mod:`tracedump.dump.hf_layout`)."""

    def observe(self, args: tuple[Any, ...], kwargs: Mapping[str, Any], wanted: bool) -> str | None: ...


Then = Callable[[str, bool, Any], None]


class _ModuleHook:
    """A capture hook on one selected module: hands what it sees to the recorder and returns None,
    so the module's inputs and outputs are untouched. ``then`` (``capture()``'s structured view and
    early exit) runs after the recorder."""

    __slots__ = ("name", "target", "then")

    def __init__(self, target: PassTarget, name: str, then: Then | None = None) -> None:
        self.target = target
        self.name = name
        self.then = then

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


MAX_CALLER_FRAMES = 64  # frames walked up from a shared module's call to find its calling parent


class CallSites:
    """Which of its names a shared module is called under, from the parents running right now.

    A selected module with several names (``named_modules(remove_duplicate=False)``) is named after
    the parent that calls it. Each of its names ``a.b.c`` has a *site*: the deepest module on that
    path (not the module itself) that has one name only, so no other path runs through it (for
    vLLM's rotary embedding, each layer's ``self_attn``). At each call of the shared module its
    hook walks up this thread's stack to the nearest running site of one of its names (a frame of
    a site class's ``forward`` or of ``Module._call_impl`` whose ``self`` is a site), and the call
    takes that name; with none running, the name whose site is the root, else its first name.

    The sites get no hook (a container under ``MODULES=leaves`` stays hook-free, and a
    ``BaseException`` that unwinds one leaves nothing behind): only a shared module's own call
    pays, a few frames' walk. Models without shared modules get none of this, and a module with
    one name is named as it always was.
    """

    def __init__(
        self,
        model: nn.Module,
        names: Mapping[str, nn.Module],
        shared: Mapping[str, list[str]],
        keep: Mapping[str, frozenset[str]] | None = None,
    ) -> None:
        """``keep``: per shared module, the names whose calls are captured (FILTER); None: all."""
        self._keep = keep
        self._root = id(model)
        counts: dict[int, int] = {}
        for module in names.values():
            counts[id(module)] = counts.get(id(module), 0) + 1
        self.sites: dict[int, nn.Module] = {}  # the running parents that name a call
        self._tables: dict[str, dict[int, str]] = {}  # hooked name -> site id -> the name it calls under
        for hooked, aliases in shared.items():
            table: dict[int, str] = {}
            for alias in aliases:
                site = _site(alias, names, counts)
                if site is not None:
                    table.setdefault(id(site), alias)  # two names under one parent: the first, ::callN
                    if id(site) != self._root:
                        self.sites[id(site)] = site
            self._tables[hooked] = table
        self._codes = call_frame_codes(self.sites.values())  # frames that may hold a site as ``self``

    def __bool__(self) -> bool:
        return bool(self._tables)

    def shared(self, name: str) -> bool:
        return name in self._tables

    def name_among(self, hooked: str, callers: Iterable[nn.Module]) -> str | None:
        """:meth:`name_for` from the modules running the call, innermost first, instead of this
        thread's frames: what Dynamo is inlining while it traces (compiled code has no frames)."""
        table = self._tables[hooked]
        name = next((table[id(m)] for m in callers if id(m) in table and id(m) != self._root), None)
        if name is None:
            name = table.get(self._root, hooked)
        if self._keep is not None and name not in self._keep[hooked]:
            return None
        return name

    def name_for(self, hooked: str) -> str | None:
        """The name this call of the shared module ``hooked`` is made under; None when the filter
        keeps no call under that name. Called from its hook, which torch calls from the shared
        module's own ``_call_impl``: the walk starts above that frame."""
        table = self._tables[hooked]
        name = nearest_running_call(table, self._codes, hook_depth=1, limit=MAX_CALLER_FRAMES)
        if name is None:
            name = table.get(self._root, hooked)
        if self._keep is not None and name not in self._keep[hooked]:
            return None
        return name


def _site(alias: str, names: Mapping[str, nn.Module], counts: Mapping[int, int]) -> nn.Module | None:
    """The deepest module on the path of ``alias`` (itself excluded) that has one name only."""
    parts = alias.split(".")
    for end in range(len(parts) - 1, -1, -1):
        module = names.get(".".join(parts[:end]))
        if module is not None and counts.get(id(module)) == 1:
            return module
    return None


class SharedOutputHook(_ModuleHook):
    """:class:`OutputHook` for a module with several names: named by its calling parent."""

    __slots__ = ("sites",)

    def __init__(self, target: PassTarget, name: str, sites: CallSites, then: Then | None = None) -> None:
        super().__init__(target, name, then)
        self.sites = sites

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling():
            traced_by_dynamo()
            return
        name = self.sites.name_for(self.name)
        if name is not None:
            self.target.on_module_tensors(name, output, is_input=False)
        if self.then is not None:
            self.then(self.name, False, output)


class SharedInputHook(_ModuleHook):
    """:class:`InputHook` for a module with several names: named by its calling parent."""

    __slots__ = ("sites",)

    def __init__(self, target: PassTarget, name: str, sites: CallSites, then: Then | None = None) -> None:
        super().__init__(target, name, then)
        self.sites = sites

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if torch.compiler.is_compiling():
            traced_by_dynamo()
            return
        name = self.sites.name_for(self.name)
        if name is not None:
            self.target.on_module_tensors(name, (args, kwargs), is_input=True)
        if self.then is not None:
            self.then(self.name, True, (args, kwargs))


class OutputHook(_ModuleHook):
    """Forward hook on a module's output."""

    __slots__ = ()

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling():  # Dynamo traces hooks: a host copy here would break the graph
            traced_by_dynamo()
            return
        self.target.on_module_tensors(self.name, output, is_input=False)
        if self.then is not None:
            self.then(self.name, False, output)


class InputHook(_ModuleHook):
    """Forward pre-hook (with kwargs) on a module's inputs."""

    __slots__ = ()

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if torch.compiler.is_compiling():
            traced_by_dynamo()
            return
        self.target.on_module_tensors(self.name, (args, kwargs), is_input=True)
        if self.then is not None:
            self.then(self.name, True, (args, kwargs))


class RootPassHooks:
    """Pre/post hooks on the root model: each outermost root forward is one pass, unless the engine
    opened one with ``dumper.step()``. The post hook is registered with ``always_call=True`` so a
    forward that raises still closes its pass."""

    __slots__ = ("_local", "hooks", "layout", "target")

    def __init__(self, target: PassTarget, hooks: HookSet, layout: BatchLayout | None = None) -> None:
        self.target = target
        self.hooks = hooks
        self.layout = layout  # an HF model's batch layout, read from each outermost forward's inputs
        self._local = threading.local()

    @property
    def opened(self) -> list[bool]:
        """One entry per nested root call on this thread: did that call open the pass? Per thread,
        so a forward on a second thread neither closes nor nests into the first one's pass."""
        try:
            return self._local.opened
        except AttributeError:
            self._local.opened = []
            return self._local.opened

    def before(self, module: nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():
            traced_by_dynamo()
            return
        opened = self.opened
        if opened and forward_calls_on_stack(module) <= 1:  # an earlier call was unwound
            if any(opened):
                self.target.close_pass(truncated=True)
            opened.clear()
        if not opened:
            self.hooks.keep_last()
        opened.append(self.target.open_auto_pass(nested=bool(opened)))

    def before_with_kwargs(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        """:meth:`before`, then the batch layout of an outermost forward from its inputs (HF)."""
        self.before(module, args)
        if self.layout is not None and len(self.opened) == 1 and not torch.compiler.is_compiling():
            self.target.lay_out_batch(self.layout, args, kwargs)

    def after(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling():
            return
        opened = self.opened
        if opened and opened.pop():
            # Torch calls an always_call hook with no output from inside its `except Exception:`
            # when the forward raised: that pass holds only what ran before the error.
            self.target.close_pass(truncated=output is None and sys.exc_info()[1] is not None)

    def __repr__(self) -> str:
        return f"RootPassHooks(depth={len(self.opened)})"  # this thread's depth


class HookSet:
    """Every hook one recorder put on one model: registered together, kept last, removed together."""

    def __init__(
        self,
        model: nn.Module,
        target: PassTarget,
        outputs: Iterable[tuple[str, nn.Module]],
        inputs: Iterable[tuple[str, nn.Module]] = (),
        then: Then | None = None,
        passes: bool = True,
        sites: CallSites | None = None,
        layout: BatchLayout | None = None,
        capturing: bool = True,
    ) -> None:
        """``passes``: each outermost root forward is a pass (``attach()``); without, the owner opens
        them (``capture()``'s ``run()``) and the root gets no hook. ``sites``: the call sites of
        the selected modules that have several names (none: every module is named as selected).
        ``layout``: each outermost root forward's batch layout comes from its inputs (HF models;
        the root's pass hook then takes keyword arguments). ``capturing``: register the capture
        hooks now; False leaves them out until :meth:`set_capturing` (``CONTROL=1``, disarmed)."""
        # The pass opens before any capture hook of this call runs (a root that is itself a selected
        # leaf has its input hook on the same module) and closes after the last one.
        self.root = RootPassHooks(target, self, layout)
        self.sites = sites if sites else None
        self.handles: list[RemovableHandle] = []
        self._model = model
        self._kept: list[tuple[dict[int, Any], int]] = []  # hooks on the root, the closer last
        self._last: list[tuple[dict[int, Any], int]] = []  # the other capture hooks registered now
        self._epoch = -1
        # Which hook each module gets is decided here, once; set_capturing registers them. The
        # root's own are registered for good: the root is on torch's hooked call path anyway (its
        # pass hooks), and a hook removed while the root's pre-hooks run would still be called.
        self._inputs = [(m, self._hook(target, name, then, True)) for name, m in inputs if m is not model]
        self._outputs = [(m, self._hook(target, name, then, False)) for name, m in outputs if m is not model]
        self._captures: list[RemovableHandle] = []
        self.capturing: tuple[bool, bool] = (False, False)  # (outputs, inputs) hooks registered
        try:
            if passes and layout is not None:
                opener = model.register_forward_pre_hook(
                    self.root.before_with_kwargs, prepend=True, with_kwargs=True
                )
                self.handles.append(opener)
            elif passes:
                self.handles.append(model.register_forward_pre_hook(self.root.before, prepend=True))
            for name, module in inputs:
                if module is model:
                    handle = module.register_forward_pre_hook(
                        self._hook(target, name, then, True), with_kwargs=True
                    )
                    self._keep_for_good(handle, forward_pre_hooks(module))
            if capturing:
                self.set_capturing(True, inputs=True)
            for name, module in outputs:
                if module is model:
                    handle = module.register_forward_hook(self._hook(target, name, then, False))
                    self._keep_for_good(handle, forward_hooks(module))
            if passes:
                closer = model.register_forward_hook(self.root.after, always_call=True)
                self._keep_for_good(closer, forward_hooks(model))  # the pass closes after all of them
        except BaseException:
            self.remove()
            raise

    def _hook(self, target: PassTarget, name: str, then: Then | None, is_input: bool) -> _ModuleHook:
        sites = self.sites
        if sites is not None and sites.shared(name):
            kind: type[Any] = SharedInputHook if is_input else SharedOutputHook
            return kind(target, name, sites, then)  # type: ignore[no-any-return]
        return InputHook(target, name, then) if is_input else OutputHook(target, name, then)

    def set_capturing(self, outputs: bool, inputs: bool) -> None:
        """Register the capture hooks (``inputs``: the input hooks too), or remove them all.

        Why: a module with any hook leaves torch's fast call path (about 2.6 µs per call on the
        bench machine, before the hook runs), so a disarmed ``CONTROL=1`` engine carries none but
        the root's (whose captures return at their first test while idle). An order registers
        them at the step boundary that starts its window, before that step's forward reaches any
        selected module, and the boundary after its window removes them.
        """
        wanted = (outputs, outputs and inputs)
        if wanted == self.capturing:
            return
        self._drop_captures()
        if outputs:
            if inputs:
                for module, hook in self._inputs:
                    handle = module.register_forward_pre_hook(hook, with_kwargs=True)
                    self._keep(handle, forward_pre_hooks(module))
            for module, hook in self._outputs:
                self._keep(module.register_forward_hook(hook), forward_hooks(module))
        self.capturing = wanted

    def _drop_captures(self) -> None:
        for handle in self._captures:
            handle.remove()
        self._captures, self._last = [], []
        self.capturing = (False, False)

    def _keep(self, handle: RemovableHandle, hooks: dict[int, Any]) -> None:
        self._captures.append(handle)
        self._last.append((hooks, handle.id))

    def _keep_for_good(self, handle: RemovableHandle, hooks: dict[int, Any]) -> None:
        self.handles.append(handle)
        self._kept.append((hooks, handle.id))

    def keep_last(self) -> None:
        """Move each capture hook behind any hook the host added after ``attach()``.

        A host hook that replaces a module's input (pre-hook) or output (forward hook) changes what
        the caller continues with; torch runs hooks in registration order, so a capture hook
        registered earlier would record the value before the replacement. Called at the start of
        every outermost root forward, before any selected module's hooks are read for that call:
        a check per selected module (is ours last?), a move only when a host hook was added.
        """
        epoch = hook_registrations()  # torch numbers every hook it registers, anywhere
        if epoch == self._epoch:
            return  # no hook was added since the last check: ours are still last
        for hooks, hook_id in [*self._last, *self._kept]:
            if hook_id in hooks and not hook_is_last(hooks, hook_id):
                move_hook_last(hooks, hook_id)
        self._epoch = epoch

    def remove(self) -> None:
        self._drop_captures()
        for handle in self.handles:
            handle.remove()
        self.handles = []
