"""``TRACEDUMP_DUMP_OPS``: the output of every aten operation inside chosen modules.

Module hooks stop at module boundaries: a wrong ``act(gate) * up``, a residual added twice, a mask
built wrong inside ``forward`` are invisible below the module. With ``OPS=<regex>``, every module
whose name matches (``re.search``) gets a pre-hook that enters a
:class:`~torch.utils._python_dispatch.TorchDispatchMode` and a post-hook that leaves it: inside
the call, each aten operation's output is handed to the recorder under the key
``<module>/<i>:<op>`` (``model.layers.2.mlp/3:aten.mul.Tensor``), ``i`` the op's index within that
call of the module, counted from 0 over every op the call runs. Ops of a matching module nested in
another are keyed under the innermost one. A second call of the module in a pass gets ``::call1``
like any key.

What it does not do: ops run while Dynamo traces (a compiled region) are not seen; the mode is
entered only in eager calls. Ops are seen after autograd and composite decomposition (``linear`` is
``t`` + ``mm`` on CPU), and views count as ops (``aten.t.default`` of a weight is copied too).
A module with several names (shared) is tapped once, under the first name that matches.
Off (no ``OPS``): no hook is added and no mode is ever entered.

Cost: every op inside a matching module goes through Python and is copied; choose one module
(``'^model\\.layers\\.2\\.mlp$'``), not a model.
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .torch_compat import TorchDispatchMode

__all__ = ["OP_MARK", "OpTaps", "op_key"]

OP_MARK = "/"  # between the module's name and the op's index: ``<module>/<i>:<op>``


def op_key(module: str, index: int, op: object) -> str:
    """``model.layers.2.mlp/3:aten.mul.Tensor``: the key of op ``index`` of a call of ``module``."""
    return f"{module}{OP_MARK}{index}:{op}"


class _OpMode(TorchDispatchMode):
    """The dispatch mode: runs each op, then hands its output to the taps (torch runs
    ``__torch_dispatch__`` with this mode popped, so the recorder's own copies are not seen)."""

    def __init__(self, taps: OpTaps) -> None:
        super().__init__()
        self.taps = taps

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.taps.on_op(func, out)
        return out


class OpTaps:
    """Hooks on the modules ``OPS`` matches, and the dispatch mode they turn on around each call.

    ``target.on_module_tensors(key, output, is_input=False)`` receives each op's output (the
    recorder: gates, STEPS, the pass, the copy). Per thread: a call on another thread has its own
    stack of running modules. Never raises into the host's forward: a failure is reported once by
    the recorder's ``report``."""

    def __init__(self, target: Any, modules: Iterable[tuple[str, nn.Module]], pattern: str) -> None:
        self.target = target
        self.pattern = re.compile(pattern)
        self._local = threading.local()
        self.handles: list[RemovableHandle] = []
        self.names: list[str] = []
        seen: set[int] = set()  # a module with several names is tapped once, under its first
        try:
            for name, module in modules:
                if not name or id(module) in seen or not self.pattern.search(name):
                    continue
                seen.add(id(module))
                self.names.append(name)
                self.handles.append(module.register_forward_pre_hook(self._enter_hook(name)))
                self.handles.append(module.register_forward_hook(self._leave_hook(), always_call=True))
        except BaseException:
            self.remove()
            raise

    def __repr__(self) -> str:
        return f"OpTaps({self.pattern.pattern!r}, modules={len(self.names)})"

    # ---------------------------------------------------------------- per thread state

    def _state(self) -> threading.local:
        local = self._local
        if not hasattr(local, "stack"):
            local.stack = []  # [name, next op index, mode entered here] per running matched call
            local.paused = 0
        return local

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No op is recorded in the block: the recorder's own work (a module hook's copy inside a
        matched module) is not the host's computation."""
        state = self._state()
        state.paused += 1
        try:
            yield
        finally:
            state.paused -= 1

    # ---------------------------------------------------------------- hooks

    def _enter_hook(self, name: str) -> Any:
        def enter(module: nn.Module, args: Any) -> None:
            if torch.compiler.is_compiling():
                return  # Dynamo cannot trace a dispatch mode entered here; compiled ops are not seen
            try:
                state = self._state()
                mode = None
                if not state.stack:
                    mode = _OpMode(self)
                    mode.__enter__()
                state.stack.append([name, 0, mode])
            except Exception as e:
                self._report(name, e)

        return enter

    def _leave_hook(self) -> Any:
        def leave(module: nn.Module, args: Any, output: Any) -> None:
            if torch.compiler.is_compiling():
                return
            state = self._state()
            if not state.stack:
                return
            _, _, mode = state.stack.pop()
            if mode is not None:
                try:
                    mode.__exit__(None, None, None)
                except Exception as e:
                    self._report("OPS", e)

        return leave

    def on_op(self, func: Any, out: Any) -> None:
        """One op ran inside a matched module: its output goes to the target under its key."""
        state = self._state()
        if state.paused or not state.stack:
            return
        frame = state.stack[-1]
        index = frame[1]
        frame[1] = index + 1
        try:
            self.target.on_module_tensors(op_key(frame[0], index, func), out, is_input=False)
        except Exception as e:  # the recorder reports its own failures; this is a last guard
            self._report(frame[0], e)

    def _report(self, where: str, error: Exception) -> None:
        report = getattr(self.target, "report", None)
        if report is not None:
            report(f"OPS {where}", error)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


class PausingTarget:
    """The recorder as the module hooks see it when ``OPS`` is on: each capture runs with the op
    taps paused, so a nested module hook's copy is not recorded as an op of the matched module."""

    def __init__(self, target: Any, taps: OpTaps) -> None:
        self._target = target
        self._taps = taps

    def on_module_tensors(self, name: str, value: Any, *, is_input: bool) -> None:
        with self._taps.paused():
            self._target.on_module_tensors(name, value, is_input=is_input)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target, name)
