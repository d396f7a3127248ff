"""Per-dtype ceilings, run precision, and the tolerance of one tensor pair.

The dtype that decides a pair's tolerance is the **run precision** (:func:`pair_precision`): the
least precise of both runs' precisions and both stored dtypes. A bf16 run compared with an fp32
reference carries bf16 rounding noise in every tensor, fp32 islands included (an fp32 norm or
router inside a bf16 model computes from bf16 inputs), so all of it is judged at bf16.

The per-dtype values below are **ceilings**: :mod:`.verdict` judges rel_diff and cosine by the error
upstream (or by a ``--baseline`` noise run), and a tensor whose error jumps past the ceiling of its
run precision within one pass is a divergence whatever that model allows. They come from
measurements (``docs/comparator.md``, kept true by ``tests/test_compare_calibration.py``), set about
100x above the noise measured for each dtype, yet far enough below what a real bug produces:

- fp32 eager vs sdpa attention differs by rel_diff <= 1e-12 (3e-13 measured on an 8-layer Llama),
  a planted fp32 bug with 1e-3 RMS relative error gives rel_diff ~5e-7; 1e-8 sits between.
- bf16 vs fp32 of the same model reaches ~1e-4 in the middle layers; 1e-2 leaves room for deeper
  models and outliers. SGLang's 1e-3 for every dtype misses the fp32 bug above.

How ``--rtol``/``--atol`` apply to each metric:

- ``rel_diff``: diverged when ``rel_diff > rtol`` and ``max_abs > atol`` (``atol`` lets tensors that
  are absolutely negligible pass; default 0).
- ``cosine``: the same rule on ``1 - cosine``.
- ``max_abs``: normwise allclose, diverged when ``max|a-b| > atol + rtol * max|b|`` (defaults:
  ``torch.testing.assert_close``'s per-dtype pair).
- integer and bool tensors: exact, whatever the flags.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

from ...store.dtypes import BY_NAME, INTEGER_DTYPES, PRECISION_ORDER

_T = TypeVar("_T")


def _rated(value: _T | None) -> _T:
    """A default of a dtype with a precision rank: the table gives each of them all three."""
    assert value is not None
    return value


# The per-dtype defaults, read from the one dtype table (tracedump/store/dtypes.py) in its
# PRECISION_ORDER (its explicit precision_rank, most precise first); a float dtype without a rank is
# judged as float32. "tfloat32" is no storage dtype: an fp32 run whose matmuls ran in TF32
# (recorded in the manifest).
# rel_diff (and 1 - cosine) thresholds, by the less precise dtype of the pair.
REL_DIFF_DEFAULTS: dict[str, float] = {name: _rated(BY_NAME[name].rel_diff) for name in PRECISION_ORDER}
# (rtol, atol) for the max_abs metric: torch.testing.assert_close's defaults, fp8 from its epsilon.
MAX_ABS_DEFAULTS: dict[str, tuple[float, float]] = {
    name: _rated(BY_NAME[name].max_abs) for name in PRECISION_ORDER
}
# Relative tolerance on each statistic of a stats-mode dump (abs_mean, sum, max, ...).
STATS_DEFAULTS: dict[str, float] = {name: _rated(BY_NAME[name].stats) for name in PRECISION_ORDER}
# Each ranked dtype's precision rank (0: most precise): the larger one decides a pair.
_RANK: dict[str, int] = {name: _rated(BY_NAME[name].precision_rank) for name in PRECISION_ORDER}
# A stats record without a `dtype` stat has its dtype guessed from its max/min (stats.infer_dtype);
# with neither, assume the common engine dtype, so two bf16 runs are not flagged for bf16 noise.
UNKNOWN_DTYPE = "bfloat16"


def is_integer(dtype: str | None) -> bool:
    return dtype in INTEGER_DTYPES


def pair_precision(*dtypes: str | None) -> str:
    """The least precise float of run precisions and stored dtypes (None and integers are skipped)."""
    floats = [d for d in dtypes if d is not None and not is_integer(d)]
    if not floats:
        return "int64" if any(is_integer(d) for d in dtypes) else UNKNOWN_DTYPE
    return max(floats, key=_rank)


def _rank(dtype: str) -> int:
    return _RANK.get(dtype, _RANK["float32"])


def less_precise(dtype_a: str | None, dtype_b: str | None) -> str:
    """The dtype whose rounding dominates the pair (integers defer to the float side; a side
    without a dtype, a stats record, trusts the other)."""
    return pair_precision(dtype_a, dtype_b)


@dataclass(frozen=True, kw_only=True)
class Tolerance:
    """How one pair is judged: which number (``metric``) must stay under which threshold."""

    metric: str  # rel_diff | cosine | max_abs | exact | stats
    rtol: float  # the ceiling (or the user's fixed threshold when ``fixed``)
    atol: float
    source: str  # e.g. "bfloat16 default", "--rtol"
    precision: str | None = None  # the run precision the pair is judged at
    fixed: bool = False  # the user gave rtol for this pair: a fixed threshold, no noise model
    mixed: bool = False  # the runs computed at different precisions: their inputs differ by a rounding

    def to_json(self) -> dict[str, object]:
        return {"metric": self.metric, "rtol": self.rtol, "atol": self.atol, "source": self.source}


def resolve(
    metric: str,
    dtype_a: str | None,
    dtype_b: str | None,
    rtol: float | None,
    atol: float | None,
    precision: str | None = None,
) -> Tolerance:
    """The tolerance for a tensor pair: the user's ``--rtol``/``--atol`` each override their default.

    ``precision`` is the pair's run precision (:func:`pair_precision`); without it, the less precise
    stored dtype decides."""
    if is_integer(dtype_a) and is_integer(dtype_b):
        return Tolerance(metric="exact", rtol=0.0, atol=0.0, source="integers compare exactly")
    dtype = precision or less_precise(dtype_a, dtype_b)
    if metric == "max_abs":
        default_rtol, default_atol = MAX_ABS_DEFAULTS.get(dtype, MAX_ABS_DEFAULTS["float32"])
    else:
        default_rtol, default_atol = REL_DIFF_DEFAULTS.get(dtype, REL_DIFF_DEFAULTS["float32"]), 0.0
    return Tolerance(
        metric=metric,
        rtol=default_rtol if rtol is None else rtol,
        atol=default_atol if atol is None else atol,
        source=_source(dtype, rtol, atol),
        precision=dtype,
        fixed=rtol is not None,
    )


def resolve_stats(
    dtype_a: str | None,
    dtype_b: str | None,
    rtol: float | None,
    atol: float | None,
    precision: str | None = None,
) -> Tolerance:
    """The tolerance for comparing the statistics of a tensor (stats-mode dumps)."""
    dtype = precision or less_precise(dtype_a, dtype_b)
    default = STATS_DEFAULTS.get(dtype, STATS_DEFAULTS["float32"]) if dtype != "int64" else 0.0
    return Tolerance(
        metric="stats",
        rtol=default if rtol is None else rtol,
        atol=0.0 if atol is None else atol,
        source=_source(dtype, rtol, atol),
        precision=dtype,
        fixed=True,
    )


def _source(dtype: str, rtol: float | None, atol: float | None) -> str:
    """``bfloat16 default``, ``--rtol``, or ``--rtol, bfloat16 default atol`` (which value is whose)."""
    if rtol is None and atol is None:
        return f"{dtype} default"
    if rtol is not None and atol is not None:
        return "--rtol --atol"
    given, default = ("--rtol", "atol") if rtol is not None else ("--atol", "rtol")
    return f"{given}, {dtype} default {default}"


def table_rows() -> list[dict[str, object]]:
    """The default table, for ``--json`` settings and the docs."""
    return [
        {
            "dtype": dtype,
            "rel_diff": REL_DIFF_DEFAULTS[dtype],
            "max_abs_rtol": MAX_ABS_DEFAULTS[dtype][0],
            "max_abs_atol": MAX_ABS_DEFAULTS[dtype][1],
            "stats_rtol": STATS_DEFAULTS[dtype],
        }
        for dtype in PRECISION_ORDER
    ]
