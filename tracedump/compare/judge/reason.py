"""The reason record: why a pair has its status, in the judge's words.

:func:`.judge.settle` builds one :class:`Reason` for every judged pair, from the verdict alone, and
the report prints it: the terminal's first-divergence line, the page's "why" and each row's
details, the plot's first-divergence label and the ``--json`` record's ``reason``. No printer
rebuilds a "why" from a record's fields; a new rule or basis is worded here, once.

The words hold only ASCII (a terminal with a narrow encoding prints them as they are).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .status import Status
from .tolerance import Tolerance

# The rule that decided a verdict (``Verdict.rule``), in a few words: the reason's ``decided_by``.
RULES = {
    "plan": "the plan found it cannot be compared",
    "read": "reading or measuring it failed",
    "rows": "its rows are missing on a side",
    "ranks": "a replicated tensor differs across ranks",
    "router": "its router's top-k indices differ",
    "flipped block": "inside a MoE block whose router flipped, its kept tokens not readable",
    "stats": "its worst statistic against rtol",
    "fixed": "a fixed rule",
    "upstream": "what the error upstream explains",
    "baseline": "the baseline's measured noise",
    "after flip": "downstream of a near-tie routing flip: the tokens it cannot have reached",
    "local": "a grafted module's own error (counting rule)",
    "shadow": "a grafted module's own error, split by its fp32 shadow",
}


@dataclass(frozen=True, kw_only=True)
class Reason:
    """Why a pair has its status: the rule that decided, the number judged against its threshold
    and where that threshold came from, each also in words.

    ``text`` is the verdict in a sentence (``rel_diff 0.5 > threshold 0.01 (50x)``, or the
    status's words where no threshold was passed); ``threshold_from`` says where the threshold came
    from, for a pair whose number passed it."""

    status: Status
    rule: str  # a key of RULES
    metric: str
    error: float | None
    threshold: float | None
    basis: str | None
    text: str
    threshold_from: str | None = None
    nonfinite_only: bool = False  # only the NaN/Inf pattern differs: the finite values are within

    @property
    def decided_by(self) -> str:
        """The rule that decided, in words."""
        return RULES[self.rule]

    def line(self, numbers: str = "") -> str:
        """The reason on one line, as the terminal prints it; ``numbers`` (the printer's own,
        ``, max_abs ...``) go after the comparison."""
        return (
            self.text + numbers + (f"; threshold from {self.threshold_from}" if self.threshold_from else "")
        )

    def to_json(self) -> dict[str, Any]:
        """The ``reason`` of a tensor record: the words (the numbers are the record's own keys)."""
        data = {"rule": self.rule, "decided_by": self.decided_by, "text": self.text}
        if self.threshold_from is not None:
            data["threshold_from"] = self.threshold_from
        return data


@dataclass(frozen=True, kw_only=True)
class Judged:
    """What a reason is worded from: the verdict's numbers and the pair's tolerance."""

    status: Status
    rule: str
    metric: str
    error: float | None
    threshold: float | None
    basis: str | None
    tolerance: Tolerance  # its ``source`` the local rule's words, where that rule decided
    noise: float | None
    nonfinite: int  # positions where NaN/Inf differ
    baseline_factor: float


def worded(judged: Judged) -> Reason:
    """The pair's :class:`Reason`."""
    text, threshold_from = judged.status.text, None
    diverged = judged.status is Status.DIVERGED and judged.error is not None
    nonfinite_only = (
        diverged and judged.nonfinite > 0 and not (judged.error or 0.0) > (judged.threshold or 0.0)
    )
    if diverged:
        text, threshold_from = _comparison(judged, nonfinite_only), _threshold_from(judged)
    return Reason(
        status=judged.status,
        rule=judged.rule,
        metric=judged.metric,
        error=judged.error,
        threshold=judged.threshold,
        basis=judged.basis,
        text=text,
        threshold_from=threshold_from,
        nonfinite_only=nonfinite_only,
    )


def number(value: float | None) -> str:
    """A number in three significant digits, as the table and the page print one."""
    if value is None:
        return "-"
    if math.isinf(value) or math.isnan(value):
        return str(value)
    return "0" if value == 0 else f"{value:.3g}"


def _comparison(judged: Judged, nonfinite_only: bool) -> str:
    """The number judged against its threshold; a NaN/Inf pattern alone said as such (``error >
    threshold`` would be false there)."""
    metric = "1-cosine" if judged.metric == "cosine" else judged.metric
    error, threshold = judged.error or 0.0, judged.threshold
    if nonfinite_only:
        return (
            f"NaN/Inf only: {metric} of the finite values {number(error)} <= threshold "
            f"{number(threshold)}; the NaN/Inf positions differ"
        )
    ratio = f" ({number(error / threshold)}x)" if threshold else ""
    return f"{metric} {number(error)} > threshold {number(threshold)}{ratio}"


def _threshold_from(judged: Judged) -> str:
    precision = judged.tolerance.precision or "?"
    if judged.basis == "baseline":
        return (
            f"the noise measured in --baseline, err(C, B) = {number(judged.noise)}, "
            f"x {number(judged.baseline_factor)} plus one rounding, at {precision} run precision"
        )
    if judged.basis == "upstream":
        return f"what the error upstream explains at {precision} run precision ({judged.tolerance.source})"
    if judged.basis == "routing":
        return "routing: a router's top-k indices must be equal"
    return f"{judged.basis or 'fixed'}: {judged.tolerance.source}"
