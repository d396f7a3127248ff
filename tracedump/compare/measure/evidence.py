"""What measuring one pair found beside its numbers: the evidence the judge reads, never a status.

The executor (:mod:`.execute`) reads a pair and records what it saw here; the one function that
turns evidence into a status is :func:`tracedump.compare.judge.judge.judge`. Keeping the two apart
means a rule (a routing flip, a rank that disagrees, a statistic's error) is decided in one place,
with every other rule in view, instead of wherever the number happened to be measured.
"""

from __future__ import annotations

from dataclasses import dataclass

from .shadow import ShadowMeasure


@dataclass(frozen=True, kw_only=True)
class RouterFlip:
    """A router's top-k indices that differ between the runs (:func:`.routing.detect`)."""

    near_tie: bool  # every flip within the run's noise of its top-k margin
    flipped: int  # how many tokens were routed otherwise


@dataclass(frozen=True, kw_only=True)
class KeptTokens:
    """A tensor measured on the tokens a near-tie routing flip left routed alike (inside the
    flipped MoE block, or downstream of it where its rows are the router's tokens)."""

    error: float  # rel_diff on those tokens
    whole: float  # rel_diff of the whole tensor: the flip's effect, which joins the running level


@dataclass(frozen=True, kw_only=True)
class StatsFound:
    """A stats pair: its worst statistic's relative error, and that statistic's two values."""

    error: float
    worst: str | None  # "abs_mean: 0.1 vs 0.2" (None when no statistic differs)


@dataclass(frozen=True, kw_only=True)
class Evidence:
    """What measuring a pair found, for the judge. At most one of the first six is set: the
    reason the pair has no plain measurement; none set: its values were measured (``metrics``)."""

    unmeasured: str | None = None  # the plan's kind of a pair never read (PairPlan.kind)
    failure: str | None = None  # reading or measuring it failed, or no statistic is on both sides
    unaligned: bool = False  # --align tokens: its rows are missing on a side
    shapes_differ: bool = False  # --align tokens: its gathered rows' shapes differ
    rank_disagreement: str | None = None  # a replicated tensor differs across a side's ranks
    router: RouterFlip | None = None  # a router whose top-k indices differ
    flipped_block: bool = False  # inside a block whose router flipped; kept tokens not readable
    kept: KeptTokens | None = None  # measured on the tokens a near-tie flip left alike
    stats: StatsFound | None = None
    note: str | None = None  # what the measurement says of itself (the plan's, the flip's words)
    shadow: ShadowMeasure | None = None  # a grafted A's fp32 shadow, measured with the pair
    shadow_failure: str | None = None  # why the shadow could not be measured (then not used)

    @property
    def plain(self) -> bool:
        """The pair's values were measured with nothing else to say (no flip, no failure)."""
        return not (
            self.unmeasured
            or self.failure
            or self.unaligned
            or self.shapes_differ
            or self.rank_disagreement
            or self.router
            or self.flipped_block
            or self.kept
            or self.stats
        )


MEASURED = Evidence()  # a pair whose values were measured, nothing else found
