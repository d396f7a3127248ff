"""One test per private API tracedump relies on (:mod:`tracedump.dump.torch_compat`).

A torch (or safetensors) upgrade that breaks an assumption fails here, with a message naming the API
and the installed version, before it shows up as wrong pass indices or keys elsewhere.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import safetensors
import torch
from torch import nn

from tracedump.dump import torch_compat as tc


def _broken(api: str, what: str) -> str:
    return (
        f"{api}: {what} (torch {torch.__version__}, safetensors {safetensors.__version__}; "
        f"checked on torch {tc.CHECKED_TORCH}). See tracedump/dump/torch_compat.py."
    )


class _Scaled(nn.Module):
    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return x * scale


def test_call_impl_frames_are_found_during_a_forward_with_hooks() -> None:
    """``nn.Module._call_impl`` runs each call in one frame holding ``self`` and ``kwargs``: what
    ``forward_calls_on_stack`` (unwound forwards), ``forward_kwargs_on_stack`` (auto-attach's replay)
    and the shared-module call sites read."""
    module = _Scaled()
    seen: list[tuple[int, dict[str, Any]]] = []

    def pre_hook(mod: nn.Module, args: Any) -> None:
        frames = list(tc.call_impl_frames(mod, tc.stack_frame(0)))
        seen.append((len(frames), tc.call_impl_kwargs(frames[0]) if frames else {}))

    module.register_forward_pre_hook(pre_hook)
    module(torch.ones(2), scale=3.0)
    assert seen == [(1, {"scale": 3.0})], _broken(
        "nn.Module._call_impl.__code__",
        f"a hooked forward should run in one _call_impl frame with self and kwargs; found {seen}",
    )


def test_call_impl_frames_are_found_in_a_forward_without_hooks() -> None:
    counts: list[int] = []

    class Probe(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            counts.append(sum(1 for _ in tc.call_impl_frames(self, tc.stack_frame(0))))
            return x

    Probe()(torch.ones(1))
    assert counts == [1], _broken("nn.Module._call_impl.__code__", f"a plain forward ran in {counts} frames")


def test_hook_dicts_are_ordered_dicts_that_move_to_end_reorders() -> None:
    """``HookSet.keep_last`` moves tracedump's hooks behind a host's with ``move_to_end``."""
    module = nn.Identity()
    order: list[str] = []
    first = module.register_forward_hook(lambda *_: order.append("first"))
    module.register_forward_hook(lambda *_: order.append("second"))
    pre_first = module.register_forward_pre_hook(lambda *_: order.append("pre_first"))
    module.register_forward_pre_hook(lambda *_: order.append("pre_second"))
    dicts = {"_forward_hooks": tc.forward_hooks(module), "_forward_pre_hooks": tc.forward_pre_hooks(module)}
    for name, hooks in dicts.items():
        assert isinstance(hooks, OrderedDict), _broken(f"nn.Module.{name}", f"is a {type(hooks).__name__}")
    assert not tc.hook_is_last(tc.forward_hooks(module), first.id)
    tc.move_hook_last(tc.forward_hooks(module), first.id)
    tc.move_hook_last(tc.forward_pre_hooks(module), pre_first.id)
    assert tc.hook_is_last(tc.forward_hooks(module), first.id)
    module(torch.ones(1))
    assert order == ["pre_second", "pre_first", "second", "first"], _broken(
        "OrderedDict.move_to_end on nn.Module hook dicts", f"hooks ran in the order {order}"
    )


def test_next_id_increments_once_per_hook_registration() -> None:
    """``keep_last`` skips its check while ``RemovableHandle.next_id`` has not moved."""
    module = nn.Identity()
    before = tc.hook_registrations()
    handle = module.register_forward_hook(lambda *_: None, always_call=True)
    after = tc.hook_registrations()
    assert (handle.id, after) == (before, before + 1), _broken(
        "RemovableHandle.next_id", f"was {before}, the handle took {handle.id}, then it was {after}"
    )


def test_the_kwargs_pre_hook_dict_holds_the_with_kwargs_hooks() -> None:
    """Auto-attach replays a new dumper's pre-hooks itself, with kwargs for those registered so."""
    module = nn.Identity()
    plain = module.register_forward_pre_hook(lambda *_: None)
    with_kwargs = module.register_forward_pre_hook(lambda *_: None, with_kwargs=True)
    table = tc.forward_pre_hooks_with_kwargs(module)
    assert with_kwargs.id in table and plain.id not in table, _broken(
        "nn.Module._forward_pre_hooks_with_kwargs", f"holds {dict(table)}"
    )


def test_marked_constant_is_dynamos_own_mark_and_is_called_while_tracing() -> None:
    """``traced_by_dynamo`` is marked as ``torch._dynamo.assume_constant_result`` marks: Dynamo
    calls it for real while tracing, and a ``fullgraph=True`` compile does not break on it."""
    import torch._dynamo

    def reference() -> bool:
        return True

    torch._dynamo.assume_constant_result(reference)
    marked = [name for name in vars(reference) if "constant" in name]
    assert marked == ["_dynamo_marked_constant"], _broken(
        "_dynamo_marked_constant", f"assume_constant_result sets {marked}"
    )
    calls: list[int] = []

    @tc.mark_constant_result
    def note() -> bool:
        calls.append(1)
        return True

    def step(x: torch.Tensor) -> torch.Tensor:
        note()
        return x + 1

    torch._dynamo.reset()
    try:
        compiled = torch.compile(step, backend="eager", fullgraph=True)
        assert torch.equal(compiled(torch.ones(2)), torch.full((2,), 2.0))
        assert calls, _broken("_dynamo_marked_constant", "Dynamo traced the marked function, not called it")
    finally:
        torch._dynamo.reset()


def test_a_compiled_module_exposes_its_original_and_compiled_call_impl() -> None:
    """Grafting refuses a compiled model: ``OptimizedModule._orig_mod`` and, for
    ``module.compile()``, ``_compiled_call_impl``."""
    module = nn.Linear(2, 2)
    assert not tc.compiled_in_place(module) and tc.compiled_original(module) is None
    wrapped = torch.compile(module, backend="eager")
    assert tc.compiled_original(wrapped) is module, _broken(
        "OptimizedModule._orig_mod", f"{type(wrapped).__name__} does not expose the module it runs"
    )
    module.compile(backend="eager")
    assert tc.compiled_in_place(module), _broken(
        "nn.Module._compiled_call_impl", "module.compile() left it unset"
    )


def test_safetensors_dtype_table_holds_the_dtypes_we_write() -> None:
    """``writer.STORABLE_DTYPES`` intersects tracedump's dtypes with ``safetensors.torch._SIZE``."""
    from tracedump.dump.writer import STORABLE_DTYPES

    table = tc.safetensors_writable_dtypes()
    assert table and all(isinstance(dtype, torch.dtype) for dtype in table), _broken(
        "safetensors.torch._SIZE", f"is gone or holds no torch dtypes: {sorted(map(str, table))}"
    )
    wanted = {
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int64,
        torch.int32,
        torch.bool,
    }
    assert wanted <= table, _broken("safetensors.torch._SIZE", f"lacks {sorted(map(str, wanted - table))}")
    assert wanted <= STORABLE_DTYPES


def test_frame_walks_find_a_running_method_and_its_frame() -> None:
    """Implicit passes: the outermost method of the root model that is running, and whether it
    still runs (CPython's ``sys._getframe``)."""

    class Model(nn.Module):
        def generate(self) -> Any:
            return self.inner()

        def inner(self) -> Any:
            return tc.outermost_frame_of(self)

    model = Model()
    frame = model.generate()
    assert frame is not None and frame.f_code.co_name == "generate", _broken(
        "sys._getframe", f"found {frame}"
    )
    assert not tc.frame_on_stack(frame)
    here = tc.stack_frame(0)
    assert here is not None and tc.frame_on_stack(here)
