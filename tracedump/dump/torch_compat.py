"""Every use of another library's private API, in one module.

Why: tracedump relies on a handful of torch (and safetensors, and CPython) internals that no
release promises to keep: the hook dicts' order, the hook counter, the frame of
``nn.Module._call_impl``, Dynamo's constant-result mark, the in-place compile attribute,
safetensors' dtype table. Spread over the hot path, a torch upgrade that changes one would
silently make implicit passes or key order wrong. Here each is one named function or constant
whose docstring says what it relies on, and ``tests/test_torch_compat.py`` checks each assumption
by itself, so an upgrade fails there first and says which API broke.

Versions: every assumption is **run** against torch 2.13.0+cpu and safetensors 0.8.0 (the test
suite). ``pyproject.toml`` allows torch >= 2.3; for older releases the source was only **read**,
never run: ``torch/utils/hooks.py`` (``next_id`` taken and incremented per handle) and
``torch/nn/modules/module.py`` (``__call__ = _wrapped_call_impl`` -> ``_compiled_call_impl`` or
``_call_impl(self, *args, **kwargs)``; hook dicts created as ``OrderedDict()``;
``_forward_pre_hooks_with_kwargs``), in undated stored revisions of pytorch/pytorch and copies of
the ``typing.Dict``-era file. Frame walking (``sys._getframe``) is CPython's own. The one CPython
private used where torch must not be imported (``tracedump arm``'s ``--filter`` check: the regex
parser) is in :mod:`tracedump.dump.stdlib_compat`.
"""

from __future__ import annotations

import importlib
import sys
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from types import CodeType, FrameType
from typing import Any, TypeVar

import safetensors.torch
import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

CHECKED_TORCH = "2.13.0"  # the torch release every assumption below was run against

# ------------------------------------------------------------------------------ frames (CPython)


def stack_frame(depth: int) -> FrameType | None:
    """``sys._getframe(depth)`` as seen by the caller (0: the caller's own frame, 1: its caller).

    CPython's frame access: the stack walks that find a module's running calls, a method of the
    root model (implicit passes) or a shared module's calling parent all start here."""
    try:
        return sys._getframe(depth + 1)
    except ValueError:  # the stack is shallower than asked
        return None


def frame_self(frame: FrameType) -> Any:
    """The ``self`` of a method's frame, None for a frame of a plain function."""
    return frame.f_locals.get("self") if "self" in frame.f_code.co_varnames else None


def frame_on_stack(frame: FrameType, depth: int = 0) -> bool:
    """Whether ``frame`` is still running on this thread: the caller's frame or one it runs in
    (``depth`` frames from the caller skipped)."""
    current = stack_frame(depth + 1)
    while current is not None:
        if current is frame:
            return True
        current = current.f_back
    return False


def outermost_frame_of(owner: object, depth: int = 0) -> FrameType | None:
    """The outermost running frame of a method of ``owner`` (``generate``, ``decode``) on this
    thread's stack, from the caller's frame outwards (``depth`` frames skipped), or None."""
    found, frame = None, stack_frame(depth + 1)
    while frame is not None and owner is not None:
        if "self" in frame.f_code.co_varnames and frame.f_locals.get("self") is owner:
            found = frame
        frame = frame.f_back
    return found


# ------------------------------------------------------------------------------ Module._call_impl

CALL_IMPL_CODE = nn.Module._call_impl.__code__
"""The code of ``nn.Module._call_impl``: torch runs every eager module call (with or without hooks)
inside one frame of it, whose locals hold the module as ``self`` and the call's keyword arguments
as ``kwargs`` (``__call__ = _wrapped_call_impl`` -> ``_call_impl(self, *args, **kwargs)``)."""


def call_impl_frames(module: nn.Module, start: FrameType | None) -> Iterator[FrameType]:
    """The running ``_call_impl`` frames of ``module`` from ``start`` outwards (innermost first):
    one per call of ``module`` in progress on this thread. Relies on :data:`CALL_IMPL_CODE`."""
    frame = start
    while frame is not None:
        if frame.f_code is CALL_IMPL_CODE and frame.f_locals.get("self") is module:
            yield frame
        frame = frame.f_back


def call_impl_kwargs(frame: FrameType) -> dict[str, Any]:
    """The keyword arguments of the module call a ``_call_impl`` frame runs (its ``**kwargs``)."""
    kwargs = frame.f_locals.get("kwargs")
    return dict(kwargs) if isinstance(kwargs, dict) else {}


V = TypeVar("V")


def call_frame_codes(modules: Iterable[nn.Module]) -> frozenset[CodeType]:
    """The codes whose frames may hold one of ``modules`` as ``self`` while it runs: torch's
    ``_call_impl`` (every eager call) and each module class's own ``forward`` (a ``forward`` called
    directly, or under a wrapper that skips ``_call_impl``)."""
    codes = {CALL_IMPL_CODE}
    for module in modules:
        code = getattr(type(module).forward, "__code__", None)
        if code is not None:
            codes.add(code)
    return frozenset(codes)


def nearest_running_call(
    modules: Mapping[int, V], codes: Collection[CodeType], hook_depth: int, limit: int
) -> V | None:
    """``modules[id(m)]`` for the innermost module ``m`` of ``modules`` (module id -> value) with a
    call running around the module call whose forward (pre-)hook is running: the first frame of
    ``codes`` (:func:`call_frame_codes`) whose ``self`` is one of them, at most ``limit`` frames up
    from that call; None when none is found.

    ``hook_depth``: frames from the caller up to the hook torch called (0: the caller is the hook).
    Relies on torch calling hooks from the hooked module's ``_call_impl`` frame or a closure of it
    (``inner``, 2.13): the walk starts two frames above the hook, at that module's own
    ``_call_impl`` (whose ``self`` is the hooked module, so the caller keeps it out of ``modules``)
    or below it; a torch that ran hooks deeper would only make the walk start lower."""
    frame = stack_frame(hook_depth + 3)  # this function, the caller .. the hook, inner, _call_impl
    for _ in range(limit):
        if frame is None:
            return None
        if frame.f_code in codes:
            owner = frame.f_locals.get("self")
            found = modules.get(id(owner)) if owner is not None else None
            if found is not None:
                return found
        frame = frame.f_back
    return None


# ------------------------------------------------------------------------------ children


def registered_children(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Every child registration of ``module`` in registration order, ``module._modules``, as
    ``named_modules(remove_duplicate=False)`` walks it: a child registered under two names is given
    under each (``named_children()`` gives it once, so it cannot name every path of a shared
    module); a ``None`` placeholder (``self.bias_module = None``) is skipped, as both do."""
    for name, child in module._modules.items():
        if child is not None:
            yield name, child


# ------------------------------------------------------------------------------ hook dicts


def hook_registrations() -> int:
    """A number that changes whenever torch registers a hook anywhere: ``RemovableHandle.next_id``,
    the class-wide counter each new handle takes its id from (incremented per registration in
    ``torch/utils/hooks.py``, read back to 2.3, run in 2.13)."""
    return RemovableHandle.next_id


# The per-module hook dicts ``nn.Module.__init__`` creates (torch 2.13: forward, forward-pre, their
# kwargs/always-called flags, backward): a copy of a module given empty ones runs none of them.
MODULE_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
)


def module_hook_dicts(module: nn.Module) -> Iterator[dict[int, Any]]:
    """Every hook dict of ``module`` and its submodules (:data:`MODULE_HOOK_DICTS`): what a
    ``deepcopy`` memo maps to empty dicts so that the copy keeps none of the host's hooks."""
    for sub in module.modules():
        for attr in MODULE_HOOK_DICTS:
            hooks = sub.__dict__.get(attr)
            if hooks is not None:
                yield hooks


def forward_pre_hooks(module: nn.Module) -> OrderedDict[int, Any]:
    """``module._forward_pre_hooks``: handle id -> pre-hook, in the order torch runs them (empty
    for an object whose ``nn.Module.__init__`` never ran)."""
    return getattr(module, "_forward_pre_hooks", OrderedDict())


def forward_hooks(module: nn.Module) -> OrderedDict[int, Any]:
    """``module._forward_hooks``: handle id -> forward hook, in the order torch runs them."""
    return module._forward_hooks  # type: ignore[return-value]


def forward_pre_hooks_with_kwargs(module: nn.Module) -> dict[int, bool]:
    """``module._forward_pre_hooks_with_kwargs``: the ids of the pre-hooks registered with
    ``with_kwargs=True`` (torch calls those with ``(module, args, kwargs)``; torch >= 2.0)."""
    return module._forward_pre_hooks_with_kwargs  # type: ignore[return-value]


def hook_is_last(hooks: dict[int, Any], hook_id: int) -> bool:
    """Whether hook ``hook_id`` runs last of ``hooks`` (torch runs a hook dict in its order)."""
    return next(reversed(hooks)) == hook_id


def move_hook_last(hooks: dict[int, Any], hook_id: int) -> None:
    """Make hook ``hook_id`` run after every other hook of ``hooks``. Relies on torch's hook dicts
    being ``OrderedDict``s that it iterates in order (so ``move_to_end`` reorders the calls)."""
    hooks.move_to_end(hook_id)  # type: ignore[attr-defined]


def global_forward_hooks() -> list[Any]:
    """Torch's global module forward pre-hooks and forward hooks (``register_module_forward_pre_hook``,
    ``register_module_forward_hook``): the module-level dicts ``_global_forward_pre_hooks`` and
    ``_global_forward_hooks`` of ``torch/nn/modules/module.py`` (read back to 2.3, run in 2.13)."""
    from torch.nn.modules import module as torch_module

    return [
        *getattr(torch_module, "_global_forward_pre_hooks", {}).values(),
        *getattr(torch_module, "_global_forward_hooks", {}).values(),
    ]


def call_without_hooks(module: nn.Module, call: Callable[..., Any]) -> None:
    """Make every call of ``module`` (``module(...)``, and its parent's ``self.child(...)``) run
    ``call(*args, **kwargs)`` instead of torch's call with hooks: no hook of its own and none of
    torch's global module hooks (``register_module_forward_hook``), which a per-thread switch
    cannot turn off for one copy of a module. Relies on ``__call__ = _wrapped_call_impl`` calling
    ``self._call_impl`` (an instance attribute is found before the class's method) when
    ``_compiled_call_impl`` is None (``torch/nn/modules/module.py``, read back to 2.3, run in 2.13)."""
    module.__dict__["_compiled_call_impl"] = None
    module.__dict__["_call_impl"] = call


# ------------------------------------------------------------------------------ torch.compile

F = TypeVar("F", bound=Callable[..., Any])


def mark_constant_result(function: F) -> F:
    """Mark ``function`` as Dynamo's ``assume_constant_result`` does, without importing Dynamo:
    the ``_dynamo_marked_constant`` attribute, which makes Dynamo call it for real while tracing
    instead of tracing it."""
    function._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return function


def compiled_original(module: nn.Module) -> nn.Module | None:
    """The module a ``torch.compile`` wrapper (``OptimizedModule``) runs, its ``_orig_mod``; None
    for any other module."""
    original = getattr(module, "_orig_mod", None)
    if isinstance(original, nn.Module) and type(module).__name__ == "OptimizedModule":
        return original
    return None


def compiled_in_place(module: nn.Module) -> bool:
    """``module.compile()`` was called: torch then sets ``_compiled_call_impl`` (None otherwise),
    which ``_wrapped_call_impl`` runs instead of ``_call_impl``."""
    return getattr(module, "_compiled_call_impl", None) is not None


# ------------------------------------------------------------------------------ dispatch modes

# ``torch.utils._python_dispatch.TorchDispatchMode`` (``OPS``, :mod:`tracedump.dump.ops`): a
# class whose ``__torch_dispatch__`` sees every aten op while the mode is entered; torch runs that
# method with the mode popped, so the ops it runs itself are not seen again. The module is private
# by name; the class is the documented way to intercept ops (torch's own ``FlopCounterMode``).
TorchDispatchMode = importlib.import_module("torch.utils._python_dispatch").TorchDispatchMode


# ------------------------------------------------------------------------------ safetensors


def safetensors_writable_dtypes() -> frozenset[torch.dtype]:
    """The dtypes this safetensors can write: the keys of ``safetensors.torch._SIZE`` (its private
    dtype -> byte size table); empty when a release drops the table (the caller then trusts its own
    list)."""
    return frozenset(getattr(safetensors.torch, "_SIZE", None) or ())


# ------------------------------------------------------------------ COMPILED: the tap op and Dynamo


def register_ordered_effect(qualname: str) -> None:
    """Mark the custom op ``qualname`` as having an ordered side effect, so that neither Dynamo,
    AOTAutograd nor inductor drops or reorders it (``torch.library._register_effectful_op`` with
    ``torch._library.effects.EffectType.ORDERED``; checked: torch 2.13)."""
    from torch._library.effects import EffectType

    torch.library._register_effectful_op(qualname, EffectType.ORDERED)


def dynamo_skipper() -> Callable[[CodeType], None] | None:
    """A function that makes Dynamo run a code object (and all it calls) as plain Python, never
    traced: ``set_code_exec_strategy`` with ``FrameAction.SKIP`` (torch 2.13's
    ``torch._C._dynamo.eval_frame``); None where this torch has no such switch."""
    try:
        from torch._C._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy
    except ImportError:
        return None
    strategy = FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP)  # the frame and all it calls
    return lambda code: set_code_exec_strategy(code, strategy)


def dynamo_inlined_modules() -> Iterator[nn.Module]:
    """While Dynamo traces: the modules whose methods it is inlining now, innermost first (each
    inlined frame's first argument, from its translator's symbolic locals; torch 2.13's
    ``InstructionTranslator.current_tx()`` and each translator's ``parent``). Raises where this
    torch's translators differ: the caller falls back."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    tx: Any = InstructionTranslator.current_tx().output.current_tx
    while tx is not None:
        code = tx.f_code
        if code.co_argcount:
            module = _traced_module(tx, tx.symbolic_locals.get(code.co_varnames[0]))
            if module is not None:
                yield module
        tx = getattr(tx, "parent", None)


def _traced_module(tx: Any, variable: Any) -> nn.Module | None:
    value = getattr(variable, "value", None)
    if isinstance(value, nn.Module):
        return value
    key = getattr(variable, "module_key", None)
    return tx.output.get_submodule(key) if isinstance(key, str) else None
