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


def test_frame_self_is_a_methods_self_and_none_for_a_plain_function() -> None:
    """Auto-attach's root detection reads the ``self`` of a frame (CPython's ``f_locals``)."""

    class Owner:
        def frame(self) -> Any:
            return tc.stack_frame(0)

    owner = Owner()
    frame = owner.frame()
    assert frame is not None and tc.frame_self(frame) is owner, _broken("frame.f_locals", "no self")

    def plain() -> Any:
        return tc.stack_frame(0)

    assert tc.frame_self(plain()) is None

    def shadowing(self: object) -> Any:  # a plain function whose first argument is called self
        return tc.stack_frame(0)

    assert tc.frame_self(shadowing(owner)) is owner


class _Shared(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


class _Parent(nn.Module):
    def __init__(self, shared: nn.Module) -> None:
        super().__init__()
        self.shared = shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared(x)


def _parents_found(codes_of: Any, hook_kind: str) -> list[str | None]:
    """The parent found from a hook of a module shared by two parents, at each of its calls."""
    shared = _Shared()
    first, second = _Parent(shared), _Parent(shared)
    model = nn.Sequential(first, second)
    table = {id(first): "first", id(second): "second"}
    codes = codes_of([first, second])
    found: list[str | None] = []

    def hook(*_: Any) -> None:
        found.append(tc.nearest_running_call(table, codes, hook_depth=0, limit=64))

    if hook_kind == "pre":
        shared.register_forward_pre_hook(hook)
    elif hook_kind == "pre_kwargs":
        shared.register_forward_pre_hook(hook, with_kwargs=True)
    else:
        shared.register_forward_hook(hook)
    model(torch.ones(1))
    return found


def test_a_shared_modules_hook_finds_the_parent_that_calls_it() -> None:
    """Shared modules named by their caller (``CallSites``): from a forward (pre-)hook of a module
    held by two parents, the walk up the stack finds each call's own parent, through torch's
    ``_call_impl`` frames of the (hook-free) parents and through the parents' own ``forward``."""
    for kind in ("pre", "pre_kwargs", "forward"):
        via_call_impl = _parents_found(lambda _: frozenset({tc.CALL_IMPL_CODE}), kind)
        assert via_call_impl == ["first", "second"], _broken(
            "nn.Module._call_impl",
            f"a {kind} hook of a shared module found the parents {via_call_impl}: torch no longer "
            "calls a module from a _call_impl frame holding it as self, or calls hooks from "
            "elsewhere than the hooked module's _call_impl (or a closure of it)",
        )
        via_forward = _parents_found(lambda parents: tc.call_frame_codes(parents) - {tc.CALL_IMPL_CODE}, kind)
        assert via_forward == ["first", "second"], _broken(
            "nn.Module.__call__", f"a {kind} hook found the parents {via_forward} from their forward frames"
        )


def test_nearest_running_call_stops_at_its_frame_limit() -> None:
    """A parent further up than ``limit`` frames is not found: the walk's cost is bounded."""
    shared = _Shared()
    parent = _Parent(shared)
    found: list[str | None] = []
    shared.register_forward_pre_hook(
        lambda *_: found.append(tc.nearest_running_call({id(parent): "p"}, {tc.CALL_IMPL_CODE}, 0, limit=1))
    )
    parent(torch.ones(1))
    assert found == [None]


def test_the_regex_parser_gives_the_items_the_filter_check_reads() -> None:
    """``--filter``'s cost check reads ``re``'s own parse of the pattern (``re._parser``)."""
    from tracedump.dump.stdlib_compat import parsed_regex

    def names(items: Any) -> list[str]:
        return [str(op) for op, _ in items]

    ((op, (low, high, sub)),) = parsed_regex("(?:ab)*")
    assert str(op) == "MAX_REPEAT" and low == 0 and high > 2**16, f"re._parser: repeat read as {op} {high}"
    assert names(sub) == ["LITERAL", "LITERAL"], f"re._parser: repeat items {names(sub)}"
    ((op, arg),) = parsed_regex("a|bc")
    assert str(op) == "BRANCH" and [names(b) for b in arg[1]] == [["LITERAL"], ["LITERAL", "LITERAL"]], (
        f"re._parser: alternation read as {op} {arg}"
    )
    ((op, arg),) = parsed_regex("(a)")
    assert str(op) == "SUBPATTERN" and names(arg[-1]) == ["LITERAL"], f"re._parser: group read as {op} {arg}"
    assert names(parsed_regex(r"(a)\1")) == ["SUBPATTERN", "GROUPREF"]
    ((op, arg),) = parsed_regex("(?>ab)")
    assert str(op) == "ATOMIC_GROUP" and names(arg) == ["LITERAL", "LITERAL"], (
        f"re._parser: atomic {op} {arg}"
    )


def test_registered_children_keep_a_child_held_under_two_names() -> None:
    """``every_name`` walks ``module._modules`` as ``named_modules(remove_duplicate=False)`` does:
    a child under two names of one parent is both, where ``named_children()`` gives it once."""
    parent = nn.Module()
    child = nn.Linear(1, 1)
    parent.first = child
    parent.hole = None  # a None placeholder: skipped
    parent.second = child
    parent.other = nn.ReLU()
    found = [(name, id(c)) for name, c in tc.registered_children(parent)]
    expected = [("first", id(child)), ("second", id(child)), ("other", id(parent.other))]
    assert found == expected, _broken("nn.Module._modules", f"children {found}")
    walked = [(name, id(m)) for name, m in parent.named_modules(remove_duplicate=False) if name]
    assert walked == expected, _broken("named_modules(remove_duplicate=False)", f"gave {walked}")
    assert [name for name, _ in parent.named_children()] == ["first", "other"]


def test_a_dispatch_mode_sees_each_op_once_and_not_the_ops_of_its_own_handler() -> None:
    """``OPS`` relies on ``TorchDispatchMode``: entered with ``__enter__`` (a pre-hook) and left
    with ``__exit__`` (a post-hook), it sees every aten op in between, and torch runs
    ``__torch_dispatch__`` with the mode popped, so the recorder's copies there are not seen."""
    seen: list[str] = []

    class Mode(tc.TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            seen.append(str(func))
            torch.empty(2).copy_(torch.ones(2))  # the handler's own ops: not seen again
            return out

    x = torch.ones(3)
    mode = Mode()
    mode.__enter__()
    try:
        y = x * 2 + 1
    finally:
        mode.__exit__(None, None, None)
    _ = x * 3  # after __exit__: not seen
    assert seen == ["aten.mul.Tensor", "aten.add.Tensor"], _broken("TorchDispatchMode", f"saw {seen}")
    assert y.tolist() == [3.0, 3.0, 3.0]
