"""What is kept of each tensor: the whole, the last row, or statistics.

Reductions run on the tensor's own device, so ``last_row`` and ``stats`` move almost nothing across
the bus: ``stats`` sends one small float64 vector per tensor to the host, never the tensor itself.

It lives with the on-disk contract because both halves use it: the dump side reduces with it, and the
comparator recomputes a full dump's statistics with the same :func:`compute_stats`, so a stats dump
and a full dump are compared on the same numbers. Nothing else in ``store/`` imports it (reading a
dump never imports torch for it).
"""

from __future__ import annotations

import contextlib
import functools
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

import torch

from .format import NUMERIC_STAT_NAMES, dtype_name, last_row_dim

__all__ = [
    "NUMERIC_STATS",
    "SweepKernel",
    "compiled_kernel",
    "compute_stats",
    "dtype_name",
    "last_row",
    "last_row_dim",
    "stats_numbers",
    "stats_values",
    "sweep",
    "sweep_plan",
    "use_kernel",
]

_F64 = torch.float64
_F32 = struct.Struct("f")  # a float rounded to float32 and back: pack, unpack
_F32_MAX = 3.4028234663852886e38
NUMERIC_STATS = NUMERIC_STAT_NAMES  # the statistics that are numbers, in their canonical order


def last_row(tensor: torch.Tensor, token_dim: int) -> torch.Tensor:
    """The last index along the token dim of a tensor with >= 2 dims (kept as a size-1 dim)."""
    dim = last_row_dim(tuple(tensor.shape), token_dim)
    return tensor if dim is None else tensor.narrow(dim, tensor.shape[dim] - 1, 1)


def _reduction_input(tensor: torch.Tensor) -> torch.Tensor:
    """What the reductions read. No widening of stored bits (that is the comparator's
    ``compare.reader.widen``, on host numpy arrays): a live tensor, on its own device, kept narrow
    where its kernels read it narrow. Integers as float64 (exact for counts and indices); floats as
    they are, except narrow floats on the CPU: its reductions of bf16/fp16 into a float32
    accumulator are slower than one widening copy followed by float32 kernels
    (docs/performance.md), while on a GPU the reductions read the narrow values directly, half the
    bytes of a widened copy. A complex tensor as its real and imaginary parts, the floats
    ``torch.view_as_real`` shows (no copy): every statistic is of those parts together, as
    ``tracedump diff`` reads a complex pass tensor, so ``mean`` is the mean of the parts and
    ``abs_mean`` of their magnitudes, not both the mean modulus; ``l2`` is the complex norm."""
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor.resolve_conj())
    if tensor.is_floating_point():
        narrow = tensor.dtype not in (torch.float32, _F64)
        return tensor.float() if narrow and tensor.is_cpu else tensor
    return tensor.double()


def _accumulator(x: torch.Tensor) -> torch.dtype:
    """float32 for float32 and narrower floats (bf16/fp16/fp8 are summed in float32), float64 for float64."""
    return _F64 if x.dtype == _F64 else torch.float32


# Floats whose Σ|x| an accelerator computes in one fused reduction (vector_norm's L1 kernel).
_FUSED_L1_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


def _abs_sum(x: torch.Tensor) -> torch.Tensor:
    """Σ|x| in the accumulator dtype. On an accelerator, ``vector_norm(x, 1)`` is one fused pass
    that reads x once (|x| is never written out: on a GPU that saves a write and a read of every
    activation, and an allocation). On the CPU that kernel is not vectorised (several times slower
    than ``x.abs().sum()``: docs/performance.md), so there |x| is made and summed, exact in x's dtype."""
    accumulator = _accumulator(x)
    if x.device.type == "cpu" or x.dtype not in _FUSED_L1_DTYPES:
        return x.abs().sum(dtype=accumulator)
    return torch.linalg.vector_norm(x, 1, dtype=accumulator)


def _nan_if_empty(reduce: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: reduce(x) if x.numel() else torch.full((), float("nan"), device=x.device)


# The reductions, one call each over the tensor. Each accumulates in float32 (float64 for float64
# inputs) without a widened copy of the tensor: a float64 copy of every tensor made stats mode
# markedly slower (docs/performance.md). ``mean`` and ``abs_mean`` are sums scaled by 1/numel in
# the final multiply, so ``sum`` and ``mean`` together cost one pass, and no mean runs a second
# division kernel.
_REDUCTIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sum": lambda x: x.sum(dtype=_accumulator(x)),
    "abs_sum": _abs_sum,
    "min": _nan_if_empty(torch.amin),
    "max": _nan_if_empty(torch.amax),
    # min and max together in one pass; the empty tensor has neither
    "minmax": lambda x: (
        torch.stack(torch.aminmax(x)) if x.numel() else torch.full((2,), float("nan"), device=x.device)
    ),
    # population std, like numpy's default; NaN for the empty tensor without torch's UserWarning,
    # which would otherwise reach the host's log whenever an engine step has no tokens
    "std": _nan_if_empty(lambda x: x.to(_accumulator(x)).std(correction=0)),
    "l2": lambda x: torch.linalg.vector_norm(x, dtype=_accumulator(x)),
    "nan_count": lambda x: torch.isnan(x).sum(),
    "inf_count": lambda x: torch.isinf(x).sum(),
}
# statistic -> (reduction, scaled by 1/numel)
_STAT_OF: dict[str, tuple[str, bool]] = {
    "abs_mean": ("abs_sum", True),
    "sum": ("sum", False),
    "min": ("min", False),
    "max": ("max", False),
    "mean": ("sum", True),
    "std": ("std", False),
    "l2": ("l2", False),
    "nan_count": ("nan_count", False),
    "inf_count": ("inf_count", False),
}
assert tuple(_STAT_OF) == NUMERIC_STAT_NAMES


# What the one-pass C sweep returns, in its order: statistics made only of these run there (CPU).
_SWEEP = ("sum", "abs_sum", "min", "max")


@dataclass(frozen=True, kw_only=True)
class _StatsRecipe:
    """How to compute one list of statistics: the reductions it needs, each run once, and where
    each statistic reads its value. Made once per distinct list, then looked up (``_recipe``)."""

    reductions: tuple[str, ...]
    picks: tuple[int, ...]  # statistic i is reductions[picks[i]]
    means: tuple[bool, ...]  # statistic i is scaled by 1/numel
    sweep: tuple[int, ...] | None  # statistic i is the sweep's value sweep[i]; None: not all are there


_RECIPES: dict[tuple[str, ...], _StatsRecipe] = {}
_SCALES: dict[tuple[_StatsRecipe, int, torch.device], torch.Tensor] = {}
_MAX_SCALES = 4096  # distinct (stats, numel, device) seen; an engine repeats a few hundred shapes


def _recipe(numeric: tuple[str, ...]) -> _StatsRecipe:
    recipe = _RECIPES.get(numeric)
    if recipe is None:
        both = "min" in numeric and "max" in numeric
        kinds = ["minmax" if both and n in ("min", "max") else _STAT_OF[n][0] for n in numeric]
        reductions = tuple(dict.fromkeys(kinds))
        picks = tuple(reductions.index(kind) for kind in kinds)
        sources = [_STAT_OF[n][0] for n in numeric]
        sweep = tuple(_SWEEP.index(k) for k in sources) if all(k in _SWEEP for k in sources) else None
        recipe = _RECIPES[numeric] = _StatsRecipe(
            reductions=reductions, picks=picks, means=tuple(_STAT_OF[n][1] for n in numeric), sweep=sweep
        )
    return recipe


class SweepKernel(Protocol):
    """What the one-pass sweep needs of a kernel: ``util/kernel.c``'s ``stats``, or a stand-in."""

    def stats(self, values: Any, /) -> Sequence[float]:
        """``(sum, abs_sum, min, max)`` of a C-contiguous float32 array (any shape: its buffer is
        read whole), in one pass. A tuple of four floats is kept as it is until the writer thread
        writes it; any other sequence is copied into one first."""
        ...


@functools.cache
def compiled_kernel() -> ModuleType | None:
    """The compiled one-pass sums (``util/kernel.c``), imported at the first stats of a CPU
    tensor; optional at install, so None where it was not built."""
    try:
        from ..util import kernel
    except ImportError:
        return None
    return kernel if hasattr(kernel, "stats") else None


def _no_kernel() -> None:
    return None


# Where the sweep gets its kernel: a module global read once per stats call, exactly as the cached
# lookup it defaults to was, so choosing costs the hot path nothing. Only :func:`use_kernel` sets it.
_chosen_kernel: Callable[[], SweepKernel | None] = compiled_kernel


@contextlib.contextmanager
def use_kernel(kernel: SweepKernel | bool = True) -> Iterator[None]:
    """Within the block, CPU stats come from ``kernel``: True, the compiled kernel where it was
    built (the default outside any block); False, torch's own kernels always; or any object with
    the kernel's ``stats`` (a test's spy, a benchmark's stand-in). Process-wide, not per thread:
    for tests and benchmarks that compare the two paths, never needed to dump."""
    global _chosen_kernel
    previous = _chosen_kernel
    if kernel is True:
        _chosen_kernel = compiled_kernel
    elif kernel is False:
        _chosen_kernel = _no_kernel
    else:
        _chosen_kernel = _always(kernel)
    try:
        yield
    finally:
        _chosen_kernel = previous


def _always(kernel: SweepKernel) -> Callable[[], SweepKernel]:
    def given() -> SweepKernel:
        return kernel

    return given


def _swept(x: torch.Tensor, recipe: _StatsRecipe) -> list[float] | None:
    """The statistics from one pass of C over a contiguous float32 CPU tensor, or None (see
    :func:`sweep`) to let torch compute them."""
    raw = sweep(x, recipe)
    return None if raw is None else swept_numbers(raw)


# What :func:`sweep` returns: the recipe, the kernel's (sum, abs_sum, min, max), and the element count.
Swept = tuple[_StatsRecipe, Sequence[float], int]


def sweep(x: torch.Tensor, recipe: _StatsRecipe) -> Swept | None:
    """The C sweep's raw sums of a contiguous float32 CPU tensor, or None (another device or dtype,
    a tensor subclass, no kernel, a NaN or Inf in it) to let torch compute the statistics.

    Why: torch's CPU path for the default ``abs_mean,sum,max`` reads the tensor four times and
    writes ``|x|`` once; without AVX-512 its kernels are half as wide. One sweep reads it once
    (a fraction of those kernels' time over a pass of the bench model, AVX-512 and AVX2 alike:
    docs/performance.md). Only what must see the live tensor happens here, in the host's forward:
    the rounding and scaling (:func:`swept_numbers`) wait for the writer thread, as in the forward
    each Python step costs ~10x its tight-loop time (docs/performance.md, unit costs)."""
    if recipe.sweep is None or type(x) is not torch.Tensor or x.dtype is not torch.float32:
        return None
    if not x.is_cpu or not x.is_contiguous() or x.is_neg():
        return None
    numel = x.numel()
    kernel = _chosen_kernel()
    if not numel or kernel is None:
        return None
    values = kernel.stats((x.detach() if x.requires_grad else x).numpy())  # any C-contiguous buffer
    if type(values) is not tuple or len(values) != 4:  # a stand-in's: the writer reads it later
        values = _four_sums(values)
    # Σ|x| is finite exactly when every element is. A NaN (it compares false), an infinity or a
    # sum past float32's range: torch's reductions say what the statistics are.
    if not -_F32_MAX <= values[1] <= _F32_MAX:
        return None
    return recipe, values, numel


def _four_sums(values: Sequence[float]) -> tuple[float, ...]:
    """A kernel stand-in's result as the compiled kernel returns it: a tuple of four floats that
    nothing changes before the writer thread reads it. Anything else raises here, in the capture
    (reported for that capture), not in the writer (which would stop the dump)."""
    sums = tuple(float(v) for v in values)
    if len(sums) != 4:
        raise ValueError(f"a stats kernel returned {len(sums)} values, not (sum, abs_sum, min, max)")
    return sums


def swept_numbers(swept: Swept) -> list[float]:
    """:func:`sweep`'s sums as the statistics: rounded to float32 as a float32 reduction returns
    them (sums accumulated in float32 lanes, flushed to float64 every 2048 elements; min and max
    exact), widened, and the means scaled, in Python floats: the same IEEE operations, so the same
    bits, as torch's tensor, index, cast and multiply."""
    recipe, values, numel = swept
    factors = _factors(recipe, numel)
    return [
        _F32.unpack(_F32.pack(values[i]))[0] * f for i, f in zip(recipe.sweep or (), factors, strict=True)
    ]


# One capture's statistics as the recorder keeps them until the writer thread writes them.
StatsValues = torch.Tensor | list[float] | Swept


def stats_numbers(values: StatsValues) -> list[float]:
    """What the stats file holds of one capture's values, however the recorder kept them: Python
    floats, a float64 tensor (torch's reductions; wait for its copy first), or a :func:`sweep`."""
    if isinstance(values, list):
        return values
    if isinstance(values, tuple):
        return swept_numbers(values)
    return values.tolist()


@dataclass(frozen=True)
class SweepPlan:
    """What the recorder's plain stats path needs of a dumper's STATS, decided once at attach:
    every numeric statistic comes from the sweep, plus which of ``shape``/``dtype`` to add."""

    recipe: _StatsRecipe
    numeric: tuple[str, ...]
    shape: bool
    dtype: str | None  # the name of a swept tensor's dtype, when STATS asks for it


def sweep_plan(names: Sequence[str]) -> SweepPlan | None:
    """The plan for ``names``, or None where some statistic needs torch (``std``, ``l2``, counts)
    or none is numeric: the recorder's general path then computes each capture's."""
    numeric = tuple(n for n in names if n in _STAT_OF)
    if not numeric:
        return None
    recipe = _recipe(numeric)
    if recipe.sweep is None:
        return None
    return SweepPlan(
        recipe=recipe,
        numeric=numeric,
        shape="shape" in names,
        dtype=dtype_name(torch.float32) if "dtype" in names else None,
    )


def _scale(recipe: _StatsRecipe, numel: int, device: torch.device) -> torch.Tensor:
    """float64 factors per statistic (1, or 1/numel for means; NaN for the mean of nothing), cached:
    the final multiply both widens the stacked scalars to float64 and turns sums into means."""
    key = (recipe, numel, device)
    scale = _SCALES.get(key)
    if scale is None:
        if len(_SCALES) >= _MAX_SCALES:
            _SCALES.clear()
        scale = _SCALES[key] = torch.tensor(_factors(recipe, numel), dtype=_F64, device=device)
    return scale


def _factors(recipe: _StatsRecipe, numel: int) -> list[float]:
    """Per statistic: 1, or 1/numel for a mean (NaN for the mean of nothing)."""
    inverse = 1.0 / numel if numel else float("nan")
    return [inverse if mean else 1.0 for mean in recipe.means]


def compute_stats(
    tensor: torch.Tensor, names: list[str]
) -> tuple[list[str], torch.Tensor, dict[str, object]]:
    """The numeric stats as one float64 device vector, plus ``shape``/``dtype`` known on the host.

    Each reduction the statistics need runs once (``sum`` serves ``mean`` too), the scalars are
    stacked in one op and widened and scaled in one more: for the default ``abs_mean,sum,max`` that
    is five small kernels per tensor, three of them passes over it. Nothing waits for the device."""
    numeric, values, extras = stats_values(tensor, names)
    return numeric, values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=_F64), extras


def stats_values(
    tensor: torch.Tensor, names: Sequence[str], *, use_sweep: bool = True
) -> tuple[list[str], torch.Tensor | list[float], dict[str, object]]:
    """:func:`compute_stats` for the recorder: statistics the C sweep computed stay Python floats
    (float64, the same values), since in the forward a ``torch.tensor`` of four floats costs
    13-16 µs (docs/performance.md); those torch computed are its float64 vector, on the
    tensor's device, as :func:`compute_stats` returns them. ``use_sweep=False``: torch's reductions
    only (the caller's sweep already refused the tensor: a NaN or an Inf in it)."""
    source = tensor.detach()
    numeric = [n for n in names if n in _STAT_OF]
    extras: dict[str, object] = {}
    if "shape" in names:
        extras["shape"] = list(source.shape)
    if "dtype" in names:
        extras["dtype"] = dtype_name(source.dtype)
    if not numeric:
        return numeric, [], extras
    recipe = _recipe(tuple(numeric))
    x = _reduction_input(source)
    swept = _swept(x, recipe) if use_sweep else None
    if swept is not None:
        return numeric, swept, extras
    computed = [_REDUCTIONS[kind](x) for kind in recipe.reductions]
    scalars = [
        computed[i] if kind != "minmax" else computed[i][0 if name == "min" else 1]
        for name, i, kind in zip(
            numeric, recipe.picks, (recipe.reductions[i] for i in recipe.picks), strict=True
        )
    ]
    # Floats of different widths (a bf16 max beside float32 sums) promote exactly inside the stack;
    # integer counts beside floats would be rounded to float32 there, so those are widened first.
    if any(not s.is_floating_point() for s in scalars) and any(s.is_floating_point() for s in scalars):
        scalars = [s.to(_F64) for s in scalars]
    return numeric, torch.mul(torch.stack(scalars), _scale(recipe, x.numel(), x.device)), extras
