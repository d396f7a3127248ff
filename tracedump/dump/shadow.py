"""The fp32 shadow of a grafted call: the same module run again in float32, beside the real run.

Why: a grafted module's output differs from the fp32 reference's by two things, the rounding of
the run's narrow dtype (bf16: every op between the grafted input and the tensor, the chunk of a
fused projection and the residual adds as much as the GEMMs) and the module's logic. A count of
what ran can only guess the first. The shadow measures it instead: right after a grafted call
returns, a hook-free copy of the module, its parameters and buffers upcast to float32, runs on
the reference's own values of the call's inputs (float32, not cast). Its tensors are then

- ``shadow~KEY``: the shadow's value of every tensor the run dumped inside the call (``KEY`` the
  real capture's key); the comparator judges the logic on shadow vs reference (the fp32 rounding
  of the same code, plus what the run's narrow *weights* change), the rounding on run vs shadow;
- ``shadow-noise~KEY``: float64 ``[NOISE_DRAWS, 2]``, per draw ``[rel_diff, 1 - cosine]`` of the
  shadow run again with its weights moved by a uniform draw within half a unit in the last place
  of the run's parameter dtype, against the first: what rounding the reference's weights to that
  dtype may change in the tensor (measured, per tensor), the logic check's allowance. Several
  draws, because one draw is one sample of a random error: a tensor that depends on few weight
  directions (a router's top-k weights, a gate of one output) has an error of few degrees of
  freedom, whose single draw can come out several times smaller than the real rounding's. The
  comparator takes the largest draw.

Never the host's numbers: the copy shares no storage with the module (its parameters are fresh
float32 tensors), runs under ``no_grad`` with every dumper's capture off for this thread, and its
non-tensor inputs (a KV cache the call updates) are deep copies. Never the host's hooks either:
no hook runs in the copy, neither the module's own nor torch's global module hooks, so a host's
probe sees each of the host's calls once and the run's own output, never the shadow's float32
reruns. (A host hook that changes a module's output is therefore no part of its shadow.) A call it
cannot shadow (the run is float32 already, the reference is not, the copy or its forward raises) is
counted by reason in the manifest (``graft.shadow``); its tensors keep the counting rule.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import types
import zlib
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ..store.format import SHADOW_NOISE_PREFIX, SHADOW_PREFIX, key_text
from .hooks import flatten_inputs, output_leaves
from .recorder import leaf_path
from .torch_compat import (
    call_without_hooks,
    forward_hooks,
    forward_pre_hooks,
    global_forward_hooks,
    module_hook_dicts,
)

__all__ = ["Shadow", "fp32_inputs", "shadow_applies", "upcast"]

MAX_STATES = 4  # objects (KV caches) whose shadow copies are kept: a new generate() makes a new one
MAX_REASONS = 20  # distinct reasons kept in the manifest (all calls are counted)
# Weight-rounding draws per shadowed call: with the largest of 6 draws, a one-degree-of-freedom
# error exceeds K_WEIGHTS (compare/judge/verdict.py) times it about once in a thousand tensors.
NOISE_DRAWS = 6


def shadow_applies(own: torch.Tensor, reference_dtype: str) -> str | None:
    """None when a call with this float input can be shadowed; else why not. The shadow separates
    a narrow run's rounding from its logic against a float32 (or wider) reference."""
    if own.is_floating_point() and torch.finfo(own.dtype).bits >= 32:
        return "the run computes in float32 or wider already: no rounding to separate"
    if reference_dtype not in ("float32", "float64"):
        return f"the reference is {reference_dtype}, not float32: its own rounding is not the shadow's"
    return None


def fp32_inputs(reference: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """The reference's value of one input, as the shadow runs on it: ``own``'s shape and device,
    float32 when it is a float (not rounded to the run's dtype), else ``own``'s dtype."""
    value = reference.reshape(own.shape) if tuple(reference.shape) != tuple(own.shape) else reference
    dtype = torch.float32 if own.is_floating_point() else own.dtype
    return value.to(device=own.device, dtype=dtype, copy=True)


def upcast(value: Any) -> Any:
    """A float tensor (anywhere in plain tuples, lists, dicts) as float32; everything else as is."""
    if isinstance(value, torch.Tensor):
        return value.detach().float() if value.is_floating_point() else value
    if type(value) in (tuple, list):
        return type(value)(upcast(v) for v in value)
    if type(value) is dict:
        return {k: upcast(v) for k, v in value.items()}
    return value


def _plain(value: Any) -> bool:
    return isinstance(value, torch.Tensor) or value is None or isinstance(value, (bool, int, float, str))


def _swapped(value: Any, swap: Callable[[Any], Any]) -> Any:
    """``value`` with every object that is no tensor, scalar or plain container passed to ``swap``."""
    if _plain(value):
        return value
    if type(value) in (tuple, list):
        return type(value)(_swapped(v, swap) for v in value)
    if type(value) is dict:
        return {k: _swapped(v, swap) for k, v in value.items()}
    return swap(value)


def _fp32_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` with float32 parameters and buffers of its own and no hook: the
    host's hooks (its own and torch's global module hooks) see the host's calls only, never the
    shadow's float32 reruns, and none of tracedump's capture or graft hooks runs in it. A forward
    replaced on an instance (a patch, a wrapper) is kept, bound to the copy."""
    memo: dict[int, Any] = {}
    for param in module.parameters():
        data = param.detach().float() if param.is_floating_point() else param.detach().clone()
        memo[id(param)] = nn.Parameter(data.clone(), requires_grad=False)
    for buffer in module.buffers():
        memo[id(buffer)] = buffer.detach().float().clone() if buffer.is_floating_point() else buffer.clone()
    for hooks in module_hook_dicts(module):
        memo[id(hooks)] = OrderedDict()
    shadow = copy.deepcopy(module, memo)
    for original, copied in zip(module.modules(), shadow.modules(), strict=True):
        if "forward" in original.__dict__:  # a forward replaced on the instance (a patch, a wrapper)
            copied.forward = _rebound(original.__dict__["forward"], memo)
    return shadow


def _ours(hook: Any) -> bool:
    """A hook tracedump registered (a capture, a graft, the launcher's): no part of the host's."""
    target = getattr(hook, "__self__", hook)
    owner = target.__module__ if isinstance(target, types.FunctionType) else type(target).__module__
    return str(owner).startswith("tracedump.")


def host_hooks(name: str, module: nn.Module) -> str | None:
    """Why a call of ``module`` (captured as ``name``) cannot be shadowed because of the host's
    hooks, or None when it has none.

    The shadow runs no host hook (the host's probes see the host's calls only), but a hook may
    change what the module computes (a steering vector, a patch, a planted bug): a shadow without
    it would not be the run's computation, and would judge a change the hook makes as rounding.
    So a call under any host hook, on the module, one inside it, or torch's global module hooks,
    keeps the counting rule, and the manifest says why."""
    if any(not _ours(hook) for hook in global_forward_hooks()):
        return "the host registered global module hooks, which the shadow does not run"
    for relative, sub in module.named_modules():
        hooks = (*forward_pre_hooks(sub).values(), *forward_hooks(sub).values())
        if any(not _ours(hook) for hook in hooks):
            where = f"{name}.{relative}" if relative else name
            return f"the host's hooks on {where} may change what it computes; the shadow runs no host hook"
    return None


class _Watch:
    """Who sees a shadow copy's module calls: the collector of the run in progress, else nobody."""

    __slots__ = ("collector",)

    def __init__(self) -> None:
        self.collector: _Collector | None = None


class _ShadowCall:
    """One shadow module's call: its forward, shown to the watch's collector, and run by torch
    with no hook at all (:func:`~tracedump.dump.torch_compat.call_without_hooks`)."""

    __slots__ = ("module", "watch")

    def __init__(self, module: nn.Module, watch: _Watch) -> None:
        self.module = module
        self.watch = watch

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        collector = self.watch.collector
        if collector is not None:
            collector.before(self.module, args, kwargs)
        output = self.module.forward(*args, **kwargs)
        if collector is not None:
            collector.after(self.module, output)
        return output


def _hookless(shadow: nn.Module) -> _Watch:
    """Every module of ``shadow`` called without hooks, its calls shown to the returned watch."""
    watch = _Watch()
    for sub in shadow.modules():
        call_without_hooks(sub, _ShadowCall(sub, watch))
    return watch


def _rebound(value: Any, memo: dict[int, Any], depth: int = 0) -> Any:
    """``value`` with every reference to a copied module turned to its copy: a bound method of
    one, and the closure cells of a function (a patched ``forward`` that calls the original's);
    anything else, modules outside the copy included, is shared as it is."""
    if isinstance(value, nn.Module):
        return memo.get(id(value), value)
    if isinstance(value, types.MethodType) and isinstance(value.__self__, nn.Module):
        return types.MethodType(value.__func__, _rebound(value.__self__, memo, depth + 1))
    if isinstance(value, types.FunctionType) and value.__closure__ and depth < 4:
        cells = tuple(
            types.CellType(_rebound(cell.cell_contents, memo, depth + 1)) if _filled(cell) else cell
            for cell in value.__closure__
        )
        rebound = types.FunctionType(
            value.__code__, value.__globals__, value.__name__, value.__defaults__, cells
        )
        rebound.__kwdefaults__ = value.__kwdefaults__
        return rebound
    return value


def _filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:  # an empty cell
        return False
    return True


def _perturb(original: nn.Module, shadow: nn.Module, seed: int) -> None:
    """Move each float parameter and buffer of the shadow narrower than float32 in ``original``
    (weights, and constants such as a rotary ``inv_freq`` cast with the model) by a uniform draw
    within half a unit in the last place of its dtype there: another set of float32 values that
    round to the run's."""
    generator = torch.Generator().manual_seed(seed)
    named = (*original.named_parameters(), *original.named_buffers())
    narrow = {n: t.dtype for n, t in named if t.is_floating_point() and torch.finfo(t.dtype).bits < 32}
    for name, tensor in (*shadow.named_parameters(), *shadow.named_buffers()):
        dtype = narrow.get(name)
        if dtype is None:
            continue
        data = tensor.data
        _, exponent = torch.frexp(data)
        ulp = torch.ldexp(torch.full_like(data, torch.finfo(dtype).eps), exponent - 1)
        draw = torch.rand(data.shape, generator=generator).to(data.device) - 0.5
        data.add_(torch.where(data == 0, torch.zeros_like(ulp), draw * ulp))


def _metrics(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(rel_diff, 1 - cosine) as the comparator measures them (compare/measure/metrics.py), in float64."""
    a64, b64 = a.detach().double().flatten(), b.detach().double().flatten()
    norm = float((a64 * a64).sum() + (b64 * b64).sum())
    dd = float(((a64 - b64) ** 2).sum())
    rel = dd / norm if norm > 0 else (0.0 if dd == 0 else 1.0)
    na, nb = float(a64.norm()), float(b64.norm())
    cos = float((a64 * b64).sum()) / (na * nb) if na > 0 and nb > 0 else (1.0 if na == nb else 0.0)
    return rel, max(0.0, 1.0 - cos)


class _Collector:
    """What one shadow run captures: each tensor under the real capture's key, from the calls of
    the shadow's modules that the run dumps (shown by :class:`_ShadowCall`)."""

    def __init__(self, names: dict[nn.Module, str], call: int, inputs: bool, root: nn.Module) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self._names = names
        self._calls: Counter[str] = Counter()
        self._call = call
        self._inputs = inputs
        self._root = root  # its inputs are the reference's own values: not kept again

    def _key(self, name: str, path: str, is_input: bool) -> str:
        return key_text(name, path, input=is_input, call=self._call + self._calls[name])

    def before(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        name = self._names.get(module)
        if name is None or not self._inputs or module is self._root:
            return
        for flat, tensor in flatten_inputs(args, kwargs):
            if tensor.is_floating_point():
                self.tensors[self._key(name, leaf_path(flat, True), True)] = tensor.detach().clone()

    def after(self, module: nn.Module, output: Any) -> None:
        name = self._names.get(module)
        if name is None:
            return
        for suffix, tensor in output_leaves(output):  # integers too: a router's top-k
            self.tensors[self._key(name, leaf_path(suffix, False), False)] = tensor.detach()
        self._calls[name] += 1


class Shadow:
    """Runs the fp32 shadow of each grafted call and records its tensors beside the real ones.

    ``record(tag, tensor)`` stores a tensor in the open pass (the dumper's ``record``); ``quiet()``
    switches every capture of this thread off while the shadow runs; ``captured`` names the
    modules the run dumps (so the shadow keeps the same tensors); ``inputs``: INPUTS is on.
    """

    def __init__(
        self,
        record: Callable[[str, torch.Tensor], None],
        quiet: Callable[[], contextlib.AbstractContextManager[Any]],
        captured: dict[int, str],
        inputs: bool,
    ) -> None:
        self._record = record
        self._quiet = quiet
        self.captured = captured
        self._inputs = inputs
        self._local = threading.local()
        self._states: dict[int, tuple[Any, Any, Any]] = {}  # id -> (the object, shadow 1's, shadow 2's)
        self.lock = threading.Lock()
        self.shadowed: Counter[str] = Counter()  # grafted module -> calls shadowed
        self.skipped: Counter[str] = Counter()  # reason -> calls not shadowed

    def prepare(self, name: str, call: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Keep the shadow's inputs of this call (the reference's values, float32) until it returns.

        Any other object (a KV cache the forward updates) gets two copies of the shadow's own, made
        the first time it is seen (now: before the real call updates it) and kept: each shadow run
        updates its own, so a decode step's shadow reads the keys and values of earlier shadow
        runs, never the run's."""
        with self.lock:
            _swapped((args, kwargs), self._state_of)
        self._pending()[name] = (call, args, kwargs)

    def _state_of(self, value: Any) -> Any:
        if id(value) not in self._states:
            while len(self._states) >= MAX_STATES:  # the oldest (an earlier generate()'s cache)
                self._states.pop(next(iter(self._states)))
            self._states[id(value)] = (value, copy.deepcopy(value), copy.deepcopy(value))
        return value

    def _own_state(self, run: int) -> Callable[[Any], Any]:
        def swap(value: Any) -> Any:
            state = self._states.get(id(value))
            if state is None or state[0] is not value:
                raise ValueError(f"no shadow copy of the call's {type(value).__name__}")
            return state[run]

        return swap

    def _own_state_copy(self, run: int) -> Callable[[Any], Any]:
        """As :meth:`_own_state`, a deep copy of it: a draw that must not grow the kept state."""
        own = self._own_state(run)
        return lambda value: copy.deepcopy(own(value))

    def skip(self, reason: str) -> None:
        with self.lock:
            if reason in self.skipped or len(self.skipped) < MAX_REASONS:
                self.skipped[reason] += 1

    def _pending(self) -> dict[str, Any]:
        if not hasattr(self._local, "pending"):
            self._local.pending = {}
        return self._local.pending  # type: ignore[no-any-return]

    def after(self, name: str, module: nn.Module) -> None:
        """The grafted call returned: run its shadow (never raising into the host's forward)."""
        pending = self._pending().pop(name, None)
        if pending is None or getattr(self._local, "running", False):
            return
        call, args, kwargs = pending
        hooked = host_hooks(name, module)
        if hooked is not None:
            self.skip(hooked)
            return
        self._local.running = True
        try:
            first, draws = self._run(name, module, call, args, kwargs)
        except Exception as e:  # a module that refuses float32, a custom kernel: the counting rule
            self.skip(f"{type(e).__name__}: {str(e)[:200]}")
            return
        finally:
            self._local.running = False
        for key, tensor in first.items():
            self._record(SHADOW_PREFIX + key, tensor)
            if tensor.is_floating_point() and all(
                key in draw and draw[key].shape == tensor.shape for draw in draws
            ):
                noise = torch.tensor([_metrics(draw[key], tensor) for draw in draws], dtype=torch.float64)
                self._record(SHADOW_NOISE_PREFIX + key, noise)
        with self.lock:
            self.shadowed[name] += 1

    def _run(
        self, name: str, module: nn.Module, call: int, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
        """The shadow's tensors, and those of :data:`NOISE_DRAWS` runs with its weights moved. Each
        draw starts from the shadow's own weights; every draw but the last runs on a copy of the
        noise shadow's state (a KV cache), the last on the state itself, so it grows once a call."""
        with torch.no_grad(), self._quiet():
            shadow = _fp32_copy(module)
            watch = _hookless(shadow)
            names = self._names(name, module, shadow)
            first = self._once(shadow, watch, names, call, _swapped((args, kwargs), self._own_state(1)))
            weights = {n: t.data.clone() for n, t in (*shadow.named_parameters(), *shadow.named_buffers())}
            draws = []
            for draw in range(NOISE_DRAWS):
                for n, t in (*shadow.named_parameters(), *shadow.named_buffers()):
                    t.data.copy_(weights[n])
                _perturb(module, shadow, zlib.crc32(f"{name}::{call}::{draw}".encode()))
                last = draw == NOISE_DRAWS - 1
                state = self._own_state(2) if last else self._own_state_copy(2)
                draws.append(self._once(shadow, watch, names, call, _swapped((args, kwargs), state)))
        return first, draws

    def _names(self, name: str, module: nn.Module, shadow: nn.Module) -> dict[nn.Module, str]:
        """The shadow's modules that the run dumps, by the real capture's name."""
        found: dict[nn.Module, str] = {}
        originals = dict(module.named_modules())
        for relative, sub in shadow.named_modules():
            real = originals.get(relative)
            captured = self.captured.get(id(real)) if real is not None else None
            if captured is not None:
                found[sub] = captured
            elif relative == "":
                found[sub] = name
        return found

    def _once(
        self,
        shadow: nn.Module,
        watch: _Watch,
        names: dict[nn.Module, str],
        call: int,
        inputs: tuple[tuple[Any, ...], dict[str, Any]],
    ) -> dict[str, torch.Tensor]:
        collector = watch.collector = _Collector(names, call, self._inputs, shadow)
        args, kwargs = inputs
        try:
            shadow(*args, **kwargs)
        finally:
            watch.collector = None
        return collector.tensors

    def summary(self) -> dict[str, Any]:
        """The manifest's ``graft.shadow``: calls shadowed per module, calls not by reason."""
        return {"shadowed_calls": dict(self.shadowed), "not_shadowed": dict(self.skipped)}

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Inside a shadow run on this thread (the grafter's hooks stand aside)."""
        self._local.running = True
        try:
            yield
        finally:
            self._local.running = False

    def is_running(self) -> bool:
        return bool(getattr(self._local, "running", False))
