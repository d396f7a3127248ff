"""What a grafted tensor may differ by: the allowances of the local rule and of the fp32 shadow.

A grafted module ran on the reference's own inputs: it is judged by what it alone may add at the
run precision (:mod:`.local` says which tensors are local and why; :func:`.judge.judge` decides
their status from these allowances). The constants are calibrated by
``benchmarks/calibrate_graft.py`` (docs/comparator.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...store.dtypes import UNIT_ROUNDOFF
from ..results import Measured


def roundoffs(precision: str | None) -> tuple[float, float]:
    """(u_run, u_acc): the unit roundoff of the run's output dtype and of its accumulator (fp32,
    fp64 for an fp64 run): the two roundings every allowance of the judge is made of."""
    u_run = UNIT_ROUNDOFF.get(precision or "float32", UNIT_ROUNDOFF["float32"])
    return u_run, UNIT_ROUNDOFF["float64" if precision == "float64" else "float32"]


K_LEAF = 3.0  # roundings a grafted leaf may add, in u^2 (input cast, weights, output)
K_OP = 1.0  # what each leaf run inside a grafted level may add to what follows it, in u^2
K_LEVEL = 10.0  # the most the ops inside a grafted level may add, in u^2 (calibrate_graft.py)
TAIL_Z = 3.0  # sigmas of a mean of n squared roundings (chi-square: relative spread sqrt(2/n))
N_CALIBRATED = 1024  # elements of the smallest tensor the constants were set on (16 tokens x 64)
ROW_K = 3.4  # TAIL_Z x one row's relative spread (measured on prefill rows: up to 1.13, attention weights)
ROWS_CALIBRATED = 16  # rows (tokens) of a prefill the constants hold for (set on 24, checked on 16)


def level_roundings(ops: int | None) -> float:
    """In u^2: what a tensor of a grafted level may carry after ``ops`` leaves of that level ran
    (its own included): ``K_OP`` each, at most ``K_LEVEL``; ``K_LEVEL`` when the depth is unknown."""
    return K_LEVEL if ops is None else min(K_OP * (1 + ops), K_LEVEL)


def tail_factor(elements: int, rows: int | None = None) -> float:
    """How much wider than the calibrated constants a tensor of ``elements`` values in ``rows``
    rows (tokens: its elements over its last dim) may read.

    rel_diff is a mean of squared roundings. Over ``elements`` independent values its relative
    spread is about ``sqrt(2 / elements)`` (chi-square); but a row's values share its norm scale and
    its input's cast, so a row is one draw too, of spread ``ROW_K / TAIL_Z`` (measured on
    prefill passes' per-token rel_diff). The constants were set on prefill passes of at least
    ``N_CALIBRATED`` elements and ``ROWS_CALIBRATED`` rows, whose spread they already cover; a
    smaller tensor (a decode pass of one token) is allowed the extra ``TAIL_Z`` sigmas of its own,
    the wider of the two. The factor is 1 for every tensor as large as the calibrated ones (no
    looser there) and grows as ``1 / sqrt(n)`` below that."""
    spread = 1 + TAIL_Z * (2 / max(elements, 1)) ** 0.5
    by_elements = spread / (1 + TAIL_Z * (2 / N_CALIBRATED) ** 0.5)
    rows = max(rows if rows is not None else elements, 1)
    by_rows = (1 + ROW_K / rows**0.5) / (1 + ROW_K / ROWS_CALIBRATED**0.5)
    return max(1.0, by_elements, by_rows)


def local_allowance(precision: str | None, last_dim: int, roundings: float) -> float:
    """What ``roundings`` (in u^2) at ``precision`` come to, plus fp32 accumulation over ``last_dim``."""
    u_run, u_acc = roundoffs(precision)
    return roundings * u_run**2 + max(last_dim, 1) * u_acc**2


def _numel(shape: tuple[int, ...] | list[int]) -> int:
    count = 1
    for size in shape:
        count *= int(size)
    return count


@dataclass(frozen=True, kw_only=True)
class LocalAllowance:
    """What one grafted tensor may differ by: ``roundings`` x ``tail`` in u^2, as ``threshold``."""

    roundings: float  # K_LEAF, K_OP or level_roundings(ops)
    tail: float  # tail_factor of its size (1 for tensors as large as the calibrated ones)
    elements: int
    threshold: float


def local_allowance_of(result: Measured, *, leaf: bool, own_input: bool, ops: int | None) -> LocalAllowance:
    """The allowance of a grafted tensor: a leaf's ``K_LEAF``, a grafted level's own input one cast
    (``K_OP``), any other tensor of a level what its ``ops`` leaves run so far may add."""
    if leaf:
        roundings = K_LEAF
    elif own_input:
        roundings = K_OP  # the level's own input: the cast of the reference's, one rounding
    else:
        roundings = level_roundings(ops)
    shape = result.shape_b or result.shape_a or ()
    elements = _numel(shape)
    tail = tail_factor(elements, elements // max(shape[-1], 1) if shape else 1)
    threshold = local_allowance(result.tolerance.precision, shape[-1] if shape else 1, roundings * tail)
    return LocalAllowance(roundings=roundings, tail=tail, elements=elements, threshold=threshold)


# ------------------------------------------------------------------------- the fp32 shadow
# A grafted run with its fp32 shadow (dump/shadow.py) splits each local tensor's error in two
# (compare/measure/shadow.py measures both): the logic (the shadow against the reference) and the rounding
# (the run against its own shadow). Each is judged on its own allowance.

K_WEIGHTS = 4.0  # x the measured effect of the weights' rounding on the shadow (the logic's noise)
ROUNDING_HEADROOM = 4.0  # x the counting rule, for the run's rounding against its own shadow


@dataclass(frozen=True, kw_only=True)
class ShadowParts:
    """One local tensor's error, split by its shadow: each part's error and threshold."""

    logic: tuple[float, float]  # (the shadow vs the reference, its allowance)
    rounding: tuple[float, float]  # (the run vs its shadow, its allowance)
    weights: float  # the measured effect of the weights' rounding (the logic's noise)


def shadow_parts(
    result: Measured,
    allowance: LocalAllowance,
    logic: tuple[float, float],
    rounding: tuple[float, float],
    weights: tuple[float, float],
) -> ShadowParts:
    """The two allowances of a tensor with a shadow, in the result's metric.

    logic: ``K_WEIGHTS`` x the weights' measured rounding effect (x the size factor of
    :func:`tail_factor`) plus fp32's own floor (``K_LEAF`` roundings at float32 and the fp32
    accumulation over the last dim): the shadow and the reference compute the same code in float32,
    so what is left is the weights' rounding to the run's dtype, and a bug.
    rounding: ``ROUNDING_HEADROOM`` x the counting rule (:func:`local_allowance_of`): the run's own
    rounding, which no logic bug changes; only a defect of the narrow dtype's path (an accumulation
    in bf16, an overflow) reaches it."""
    pick = 1 if result.tolerance.metric == "cosine" else 0
    shape = result.shape_b or result.shape_a or ()
    last = shape[-1] if shape else 1
    floor = local_allowance("float32", last, K_LEAF)
    logic_threshold = K_WEIGHTS * allowance.tail * weights[pick] + floor
    return ShadowParts(
        logic=(logic[pick], logic_threshold),
        rounding=(rounding[pick], ROUNDING_HEADROOM * allowance.threshold),
        weights=weights[pick],
    )
