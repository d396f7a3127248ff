"""The one list of a tensor pair's statuses, read by the table, the JSON report and the page.

Each status once, with what the terminal and the page print for it and whether it makes the exit
code 1. Kept once because copies of these lists in the table, the page and the JSON had
drifted apart. A ``str`` enum: ``Status.OK == "ok"`` and
``json.dumps`` writes ``"ok"``, so the JSON's values stay exactly the strings they always were.
The only module that holds a status's string: :func:`.judge.judge` is the only function that
sets one (tests/test_status_literals.py checks both). Imports nothing (the comparator's hot path
and ``tracedump ls`` never pay for it).
"""

from __future__ import annotations

from enum import Enum


class Status(str, Enum):
    """A tensor pair's verdict (what each means: docs/comparator.md, :mod:`tracedump.compare.results`)."""

    OK = "ok"
    DIVERGED = "diverged"
    SHAPE_MISMATCH = "shape_mismatch"
    RANK_MISMATCH = "rank_mismatch"
    ERROR = "error"
    ROUTING_FLIP = "routing_flip"
    ROUTING = "routing"
    NOT_ALIGNED = "not_aligned"
    NOT_COMPARABLE = "not_comparable"
    NOT_JUDGED = "not_judged"
    EXTRA_OP = "extra_op"

    def __str__(self) -> str:
        return self.value

    @property
    def text(self) -> str:
        """The status as the table and the page print it."""
        return _TEXT[self]

    @property
    def fails(self) -> bool:
        """Whether a pair of this status makes the exit code 1 (:func:`.verdict.exit_code`)."""
        return self in _FAILS

    @property
    def names_a_divergence(self) -> bool:
        """Whether a pair of this status may be the first divergence: its values (or its ranks, or
        its op) differ, as against a pair that could not be compared."""
        return self in _DIVERGENCE

    @property
    def not_compared(self) -> bool:
        """A pair whose values were not compared, for a reason the page lists in its notes."""
        return self in _NOT_COMPARED


_TEXT = {
    Status.OK: "ok",
    Status.DIVERGED: "DIVERGED",
    Status.SHAPE_MISMATCH: "shape mismatch",
    Status.RANK_MISMATCH: "rank mismatch",
    Status.ERROR: "error",
    Status.ROUTING_FLIP: "routing flip",
    Status.ROUTING: "routing differs",
    Status.NOT_ALIGNED: "no token rows",
    Status.NOT_COMPARABLE: "not comparable",
    Status.NOT_JUDGED: "not judged",
    Status.EXTRA_OP: "EXTRA OP",
}
_FAILS = frozenset(
    {Status.DIVERGED, Status.SHAPE_MISMATCH, Status.RANK_MISMATCH, Status.ERROR, Status.EXTRA_OP}
)
_DIVERGENCE = frozenset({Status.DIVERGED, Status.RANK_MISMATCH, Status.EXTRA_OP})
_NOT_COMPARED = (Status.SHAPE_MISMATCH, Status.ERROR, Status.ROUTING, Status.NOT_ALIGNED)


def status_text(status: str) -> str:
    """What the table and the page print for ``status`` (an unknown one as it is)."""
    try:
        return Status(status).text
    except ValueError:
        return status
