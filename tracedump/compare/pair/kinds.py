"""What the plan says of a pair: how it is compared, or why it cannot be (never its status).

The judge (:func:`tracedump.compare.judge.judge.judge`) reports a pair that is never read with the
status its kind calls for; the kind itself stays the plan's (``PairPlan.kind``).
"""

from __future__ import annotations

from enum import Enum


class PairKind(str, Enum):
    """A planned pair's kind: values, statistics, or not at all (and why)."""

    TENSOR = "tensor"
    STATS = "stats"
    SHAPE_MISMATCH = "shape_mismatch"
    RANK_MISMATCH = "rank_mismatch"
    ERROR = "error"
    NOT_COMPARABLE = "not_comparable"
    EXTRA_OP = "extra_op"

    def __str__(self) -> str:
        return self.value
