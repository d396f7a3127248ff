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
the ``typing.Dict``-era file. Frame walking (``sys._getframe``) is CPython's own.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Callable, Iterator
from types import FrameType
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


# ------------------------------------------------------------------------------ hook dicts


def hook_registrations() -> int:
    """A number that changes whenever torch registers a hook anywhere: ``RemovableHandle.next_id``,
    the class-wide counter each new handle takes its id from (incremented per registration in
    ``torch/utils/hooks.py``, read back to 2.3, run in 2.13)."""
    return RemovableHandle.next_id


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


# ------------------------------------------------------------------------------ safetensors


def safetensors_writable_dtypes() -> frozenset[torch.dtype]:
    """The dtypes this safetensors can write: the keys of ``safetensors.torch._SIZE`` (its private
    dtype -> byte size table); empty when a release drops the table (the caller then trusts its own
    list)."""
    return frozenset(getattr(safetensors.torch, "_SIZE", None) or ())
