"""Capture hooks and the key naming scheme.

Keys: ``<module>`` for a tensor output, ``<module>[i]`` / ``<module>[key]`` inside tuples, lists,
dicts, dataclasses and HF ``ModelOutput``; ``<module>@in[i]`` / ``<module>@in[kw]`` for inputs; and
``::callN`` last for the N-th repeat call of a module in one pass (``name[0]::call2``).
"""

from __future__ import annotations

import dataclasses
import sys
import threading
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from .dumper import Dumper

_MAX_DEPTH = 8
_CALL_IMPL = nn.Module._call_impl.__code__


def forward_calls_on_stack(module: nn.Module) -> int:
    """How many calls of ``module`` are running on this thread (its ``Module._call_impl`` frames).

    Torch runs ``always_call`` forward hooks only for an ``Exception``; a ``BaseException``
    (Ctrl-C, ``capture()``'s early exit) unwinds a forward without its post-hooks. Looking at the
    stack tells a real nested call from state such an unwind left behind. Walked only when the
    counters say "nested", which for a root module is rare.
    """
    count, frame = 0, sys._getframe(1)
    while frame is not None:
        if frame.f_code is _CALL_IMPL and frame.f_locals.get("self") is module:
            count += 1
        frame = frame.f_back
    return count


def flatten_tensors(value: Any, prefix: str = "", depth: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(suffix, tensor)`` for every tensor leaf of a nested output; other leaves are skipped."""
    if isinstance(value, torch.Tensor):
        yield prefix, value
        return
    if depth >= _MAX_DEPTH:
        return
    if isinstance(value, Mapping):
        items: Any = value.items()
    elif isinstance(value, (tuple, list)):
        items = enumerate(value)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = ((f.name, getattr(value, f.name)) for f in dataclasses.fields(value))
    else:
        return
    for key, item in items:
        yield from flatten_tensors(item, f"{prefix}[{key}]", depth + 1)


def flatten_inputs(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """Inputs as ``@in[i]`` for positional and ``@in[kw]`` for keyword arguments."""
    leaves = list(flatten_tensors(tuple(args), "@in"))
    for key, value in kwargs.items():
        leaves.extend(flatten_tensors(value, f"@in[{key}]"))
    return leaves


def traced_by_dynamo() -> bool:
    """Say that Dynamo is compiling a forward that holds tracedump's hooks.

    A compiled graph runs no Python hook, so its calls are never dumped. This function is marked
    as having a constant result (what ``torch._dynamo.assume_constant_result`` does, without
    importing Dynamo): Dynamo *calls it for real* while tracing, once per compilation, rather than
    tracing it, so the first compiled call warns and marks the manifest instead of dumping
    nothing silently. It adds nothing to the graph and breaks no ``fullgraph=True`` compile.
    """
    from .dumper import note_compiled

    note_compiled()
    return True


traced_by_dynamo._dynamo_marked_constant = True  # type: ignore[attr-defined]


class OutputHook:
    """Forward hook handing a module's output to its dumper; returns None, so outputs are untouched."""

    __slots__ = ("dumper", "name")

    def __init__(self, dumper: Dumper, name: str) -> None:
        self.dumper = dumper
        self.name = name

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling():  # Dynamo traces hooks: a host copy here would break the graph
            traced_by_dynamo()
            return
        self.dumper._on_module_tensors(self.name, output, is_input=False)

    def __repr__(self) -> str:
        return f"OutputHook({self.name!r})"


class InputHook:
    """Forward pre-hook (with kwargs) capturing a module's inputs; returns None."""

    __slots__ = ("dumper", "name")

    def __init__(self, dumper: Dumper, name: str) -> None:
        self.dumper = dumper
        self.name = name

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if torch.compiler.is_compiling():
            traced_by_dynamo()
            return
        self.dumper._on_module_tensors(self.name, (args, kwargs), is_input=True)

    def __repr__(self) -> str:
        return f"InputHook({self.name!r})"


class RootPassHooks:
    """Pre/post hooks on the root model: each outermost root forward is one pass, unless the engine
    opened one with ``dumper.step()``. The post hook is registered with ``always_call=True`` so a
    forward that raises still closes its pass."""

    __slots__ = ("_local", "dumper")

    def __init__(self, dumper: Dumper) -> None:
        self.dumper = dumper
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
                self.dumper._close_pass(truncated=True)
            opened.clear()
        if not opened:
            self.dumper.keep_hooks_last()
        opened.append(self.dumper._open_auto_pass(nested=bool(opened)))

    def after(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling():
            return
        opened = self.opened
        if opened and opened.pop():
            # Torch calls an always_call hook with no output from inside its `except Exception:`
            # when the forward raised: that pass holds only what ran before the error.
            self.dumper._close_pass(truncated=output is None and sys.exc_info()[1] is not None)

    def __repr__(self) -> str:
        return f"RootPassHooks(depth={len(self.opened)})"  # this thread's depth
