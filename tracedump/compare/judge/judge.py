"""The judge: the one function that sets a tensor pair's status, from typed evidence.

:func:`judge` reads what the measure stage recorded of a pair
(:class:`~tracedump.compare.measure.evidence.Evidence`:
the plan's kind of a pair never read, a read failure, a routing flip, a stats pair's error, a rank
that disagrees, the tokens a near-tie flip left alike, the fp32 shadow), what the error upstream
explains (:class:`.noise.Upstream`), the baseline's measured noise and, for a grafted A, the
local evidence (:class:`LocalEvidence`), and returns a :class:`Verdict`: the status, the number
judged, its threshold, the basis of that threshold, the rule that decided and why. Nothing else
in the package sets a status: the executor only measures, :func:`.verdict.judge_all` only walks
the pairs in execution order keeping the running level, and the report prints the verdict.

The rules, in the order :func:`judge` applies them:

1. a pair that was never measured keeps what the plan found (not comparable, shape mismatch, an op
   in one run only, an ``--unshard`` problem); a read failure is an ``error``; rows missing on a
   side ``not_aligned``; a replicated tensor that differs across ranks ``rank_mismatch``;
2. a router's top-k indices that differ: a near-tie flip is reported (``routing_flip``), any other
   a divergence; a tensor of the flipped block whose kept tokens cannot be picked out: ``routing``;
3. a stats pair: its worst statistic against ``rtol`` (a fixed rule);
4. a measured tensor: downstream of a near-tie flip with no baseline, its provably unaffected
   tokens only (:func:`_after_flip`); else a fixed rule (integers exact, ``max_abs``, a user's
   ``--rtol``), or the noise model (:mod:`.noise`) on the baseline's noise or the upstream level;
5. a grafted A's local tensor: the verdict of 4, replaced by its local error (the counting rule of
   :mod:`.allowance`) or its two shadow parts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Protocol

from ..measure.evidence import Evidence
from ..measure.metrics import TensorMetrics
from ..measure.shadow import ShadowMeasure
from ..pair.kinds import PairKind
from ..results import AfterFlip, Measured, TensorResult
from .allowance import LocalAllowance, ShadowParts
from .noise import (
    BASELINE_FACTOR,
    GROWTH,
    NOISE_MODEL,
    Upstream,
    explained,
    input_rounding,
    last_dim,
    rounding_floor,
)
from .reason import Judged, Reason, worded
from .status import Status
from .tolerance import Tolerance

# The plan's kinds of pairs that are never read, and the status each is reported with.
_UNMEASURED = {
    PairKind.NOT_COMPARABLE: Status.NOT_COMPARABLE,
    PairKind.SHAPE_MISMATCH: Status.SHAPE_MISMATCH,
    PairKind.RANK_MISMATCH: Status.RANK_MISMATCH,
    PairKind.ERROR: Status.ERROR,
    PairKind.EXTRA_OP: Status.EXTRA_OP,
}
_FLIP_REACHES = "a near-tie routing flip reaches it: the shadow's routing is its own"


@dataclass(frozen=True, kw_only=True)
class LocalEvidence:
    """A grafted A's tensor local to a grafted module: its allowance and what may split it."""

    allowance: LocalAllowance
    source: str  # the counting rule's words (what the module may add, and how that was counted)
    flip_inside: bool  # a near-tie flip ran inside that grafted module, before this tensor
    shadow: ShadowParts | None = None  # its error split by the shadow, where the shadow stands
    shadow_source: str | None = None  # the shadow rule's words
    shadow_unused: str | None = None  # why a shadow it has is not used
    shadows_present: bool = False  # A holds shadows: a tensor judged by counting says why


class LocalJudging(Protocol):
    """What the judge stage asks of a grafted A, pair by pair in execution order (:mod:`.local`)."""

    def evidence(self, result: Measured) -> LocalEvidence | None:
        """The pair's local evidence; None when it is not local to a grafted module."""

    def labelled(self, result: TensorResult) -> TensorResult:
        """The judged pair, labelled with where it lies in the graft."""


@dataclass(frozen=True, kw_only=True)
class PairEvidence:
    """Everything :func:`judge` reads of one pair."""

    measured: Measured
    upstream: Upstream
    noise: float | None = None  # --baseline: err(C, B) of this pair, when C has it
    local: LocalEvidence | None = None


@dataclass(frozen=True, kw_only=True)
class Verdict:
    """A pair's status and the reason for it: the number judged against its threshold, where the
    threshold came from (``basis``), the rule that decided (:data:`.reason.RULES`) and why, in
    words (:func:`settle` words the :class:`.reason.Reason` the report prints)."""

    status: Status
    rule: str
    error: float | None = None
    threshold: float | None = None
    basis: str | None = None
    why: str | None = None
    noise: float | None = None
    absorbed: float | None = None  # the whole error of a tensor judged on kept tokens
    level_before: str | None = None
    after_flip: AfterFlip | None = None
    tolerance_source: str | None = None  # the local rule's words, in place of the tolerance's
    joins_level: float | None = None  # what this pair adds to its running level
    flip_effect: float | None = None  # its error a near-tie flip let through (the level's flipped)


def judge(evidence: PairEvidence) -> Verdict:
    """The status of one pair, and why: the only place a status is decided."""
    verdict = _propagated(evidence)
    if evidence.local is not None:
        return _local(evidence.measured, evidence.local, verdict)
    return verdict


def settle(measured: Measured, verdict: Verdict) -> TensorResult:
    """The pair's record with its verdict and its reason in words: what the report prints."""
    values = {name: getattr(measured, name) for name in Measured.__dataclass_fields__}
    values["after_flip"] = verdict.after_flip
    if verdict.tolerance_source is not None:
        values["tolerance"] = replace(measured.tolerance, source=verdict.tolerance_source)
    return TensorResult(
        reason=_reason(measured, verdict, values["tolerance"]),
        **values,
        status=verdict.status,
        error=verdict.error,
        threshold=verdict.threshold,
        message=verdict.why,
        noise=verdict.noise,
        basis=verdict.basis,
        absorbed=verdict.absorbed,
        level_before=verdict.level_before,
        rule=verdict.rule,
    )


def _reason(measured: Measured, verdict: Verdict, tolerance: Tolerance) -> Reason:
    metrics = measured.metrics
    return worded(
        Judged(
            status=verdict.status,
            rule=verdict.rule,
            metric=measured.metric,
            error=verdict.error,
            threshold=verdict.threshold,
            basis=verdict.basis,
            tolerance=tolerance,
            noise=verdict.noise,
            nonfinite=metrics.nonfinite_mismatch if metrics is not None else 0,
            baseline_factor=BASELINE_FACTOR,
        )
    )


# ------------------------------------------------------------------------------ the propagated verdict


def _propagated(evidence: PairEvidence) -> Verdict:
    """Rules 1 to 4 (the module docstring), with what the pair adds to its running level."""
    verdict = _decided(evidence)
    metric = evidence.measured.metric
    flip_effect = verdict.absorbed if verdict.status is Status.ROUTING_FLIP else None
    joins = None
    if verdict.status in (Status.OK, Status.ROUTING_FLIP) and metric in NOISE_MODEL:
        joins = verdict.absorbed if verdict.absorbed is not None else verdict.error or 0.0
    return replace(verdict, joins_level=joins, flip_effect=flip_effect)


def _decided(evidence: PairEvidence) -> Verdict:
    m = evidence.measured
    found: Evidence = m.evidence
    kept = found.kept
    plain = {"why": found.note, "after_flip": m.after_flip}
    if found.unmeasured is not None:
        return Verdict(status=_UNMEASURED[PairKind(found.unmeasured)], rule="plan", **plain)
    if found.failure is not None:
        return Verdict(status=Status.ERROR, rule="read", **plain)
    if found.unaligned:
        return Verdict(status=Status.NOT_ALIGNED, rule="rows", **plain)
    if found.shapes_differ:
        return Verdict(status=Status.SHAPE_MISMATCH, rule="rows", **plain)
    if found.stats is not None:
        ok = found.stats.error <= m.tolerance.rtol
        return Verdict(
            status=Status.OK if ok else Status.DIVERGED,
            rule="stats",
            error=found.stats.error,
            threshold=m.tolerance.rtol,
            why=None if ok else found.stats.worst,
            after_flip=m.after_flip,
        )
    metrics = m.metrics
    assert metrics is not None, "a pair measured without metrics"
    if found.rank_disagreement is not None:
        error, threshold, _ = fixed_rule(metrics, m.tolerance)
        return Verdict(status=Status.RANK_MISMATCH, rule="ranks", error=error, threshold=threshold, **plain)
    if found.router is not None:
        if found.router.near_tie:  # not a divergence: the block's tensors are compared on the kept tokens
            return Verdict(
                status=Status.ROUTING_FLIP,
                rule="router",
                error=float(found.router.flipped),
                basis="routing",
                **plain,
            )
        return Verdict(
            status=Status.DIVERGED,
            rule="router",
            error=metrics.max_abs,
            threshold=0.0,
            basis="routing",
            **plain,
        )
    if found.flipped_block:
        return Verdict(status=Status.ROUTING, rule="flipped block", **plain)
    tolerance = m.tolerance
    if kept is not None and tolerance.metric == "exact":  # judged by its router's margins (routing.py)
        return Verdict(
            status=Status.ROUTING_FLIP, rule="router", error=kept.error, absorbed=kept.whole, **plain
        )
    measured_noise = evidence.noise
    if m.after_flip is not None and tolerance.metric in NOISE_MODEL and measured_noise is None:
        return _after_flip(m, evidence.upstream, kept)
    return _on_values(m, evidence.upstream, measured_noise, kept)


def _on_values(m: Measured, upstream: Upstream, measured_noise: float | None, kept: object) -> Verdict:
    """A measured tensor by a fixed rule or the noise model (on the tokens a near-tie flip left
    alike, when ``kept``: that flip's effect on the rest joins the level as ``absorbed``)."""
    tolerance, metrics = m.tolerance, m.metrics
    assert metrics is not None
    found = m.evidence
    whole = found.kept.whole if found.kept is not None else None
    why = found.note or _nonfinite_message(metrics)
    if tolerance.metric not in NOISE_MODEL or tolerance.fixed:
        error, threshold, ok = fixed_rule(metrics, tolerance)
        return Verdict(
            status=Status.OK if ok else Status.DIVERGED,
            rule="fixed",
            error=error,
            threshold=threshold,
            basis="fixed",
            why=why,
            absorbed=whole,
            after_flip=m.after_flip,
        )
    error = metrics.one_minus_cosine if tolerance.metric == "cosine" else metrics.rel_diff
    if found.kept is not None:  # the error on the tokens that kept their experts
        error = found.kept.error
    floor = rounding_floor(tolerance.precision, last_dim(m))
    if measured_noise is not None:
        threshold = BASELINE_FACTOR * measured_noise + floor
        if found.kept is None:  # the ceiling overrules no noise measured past a flip
            threshold = min(threshold, upstream.cap(tolerance.rtol))
        if upstream.flipped:  # a near-tie flip upstream in this pass: its effect, under the ceiling
            threshold = max(threshold, min(GROWTH * upstream.flipped + floor, tolerance.rtol))
        basis = "baseline"
    else:
        inputs = input_rounding(tolerance.precision) if tolerance.mixed else 0.0
        threshold = explained(upstream, floor, tolerance.rtol, inputs)
        basis = "upstream"
    ok = (error <= threshold or metrics.max_abs <= tolerance.atol) and metrics.nonfinite_mismatch == 0
    status = (Status.ROUTING_FLIP if found.kept is not None else Status.OK) if ok else Status.DIVERGED
    return Verdict(
        status=status,
        rule=basis,
        error=error,
        threshold=threshold,
        basis=basis,
        why=why,
        noise=measured_noise,
        absorbed=whole,
        level_before=upstream.level_before if basis == "upstream" else None,
        after_flip=m.after_flip,
    )


def _after_flip(m: Measured, upstream: Upstream, kept: object) -> Verdict:
    """A tensor downstream of a near-tie routing flip, outside the flipped block, with no baseline.

    Every token that attended to a flipped one in a later layer carries the flip's consequence,
    which no rounding model bounds (another expert's answer, mixed in by attention): judging it
    names a layer that is fine. So only the tokens that provably received nothing of it are judged
    (:attr:`~tracedump.compare.results.AfterFlip.error`: under a causal mask, the positions before the first
    flipped
    one), by the upstream rule; when none can be shown, the tensor is ``not_judged``, with the
    reason, never a divergence. ``--baseline`` (a rerun that flips the same tokens) and a grafted
    run (each module fed the reference's inputs) judge it instead."""
    after, metrics, tolerance = m.after_flip, m.metrics, m.tolerance
    assert after is not None and metrics is not None
    if after.error is None:
        return Verdict(
            status=Status.NOT_JUDGED,
            rule="after flip",
            basis="not judged",
            why=f"not judged: {after.reason()} ({after.why})",
            after_flip=after,
        )
    floor = rounding_floor(tolerance.precision, last_dim(m))
    if tolerance.fixed:
        threshold, basis = tolerance.rtol, "fixed"
    else:
        inputs = input_rounding(tolerance.precision) if tolerance.mixed else 0.0
        threshold, basis = explained(upstream, floor, tolerance.rtol, inputs), "upstream"
    ok = (after.error <= threshold or metrics.max_abs <= tolerance.atol) and metrics.nonfinite_mismatch == 0
    return Verdict(
        status=Status.ROUTING_FLIP if ok else Status.DIVERGED,
        rule="after flip",
        error=after.error,
        threshold=threshold,
        basis=basis,
        why=(
            f"compared on the {after.tokens} tokens no near-tie flip of {after.router} can have reached "
            f"({after.why})"
        ),
        absorbed=after.error,
        level_before=upstream.level_before if basis == "upstream" else None,
        after_flip=after,
    )


def fixed_rule(metrics: TensorMetrics, tolerance: Tolerance) -> tuple[float, float, bool]:
    """(the number judged, its threshold, whether it stays under) by a fixed rule: integers exact,
    ``max_abs`` allclose, a user's rtol (or the ceiling) as a plain threshold on rel_diff/cosine.
    Also what a replicated tensor's ranks must agree within (:mod:`tracedump.compare.measure.execute`)."""
    if tolerance.metric == "exact":
        error, threshold = metrics.max_abs, 0.0
        ok = error == 0
    elif tolerance.metric == "max_abs":
        error, threshold = metrics.max_abs, tolerance.atol + tolerance.rtol * metrics.max_abs_b
        ok = error <= threshold
    else:
        error = metrics.one_minus_cosine if tolerance.metric == "cosine" else metrics.rel_diff
        threshold = tolerance.rtol
        ok = error <= threshold or metrics.max_abs <= tolerance.atol
    return error, threshold, ok and metrics.nonfinite_mismatch == 0


def _nonfinite_message(metrics: TensorMetrics) -> str | None:
    if not metrics.nonfinite_mismatch:
        return None
    return (
        f"NaN/Inf differ at {metrics.nonfinite_mismatch} positions "
        f"(A: {metrics.nan_a} NaN, {metrics.inf_a} Inf; B: {metrics.nan_b} NaN, {metrics.inf_b} Inf)"
    )


# ------------------------------------------------------------------------------ a grafted A's local error


def _local_judgeable(m: Measured, status: Status) -> bool:
    """Whether the local rule judges a pair: a measured float tensor under the noise model;
    integers (exact), ``max_abs``, a user's ``--rtol`` and routing keep their own rules."""
    return (
        m.metrics is not None
        and m.kind == "tensor"
        and status in (Status.OK, Status.DIVERGED, Status.ROUTING_FLIP, Status.NOT_JUDGED)
        and m.tolerance.metric in NOISE_MODEL
        and not m.tolerance.fixed
    )


def _local(m: Measured, local: LocalEvidence, propagated: Verdict) -> Verdict:
    """Rule 5: a grafted module ran on the reference's inputs, so its tensor is judged by what it
    alone may add; its propagated verdict still feeds the running level (``joins_level``)."""
    if not _local_judgeable(m, propagated.status):
        return propagated
    parts, why_not = local.shadow, local.shadow_unused
    if parts is not None and (
        propagated.status in (Status.ROUTING_FLIP, Status.NOT_JUDGED) or m.after_flip is not None
    ):
        parts, why_not = None, _FLIP_REACHES
    if parts is not None and not local.flip_inside:
        assert local.shadow_source is not None
        return _by_shadow(m, parts, local.shadow_source, propagated)
    source = local.source
    if local.shadows_present:
        source = f"{source[:-1]}; counting rule: {why_not or 'no shadow of this tensor'})"
    return _counted(m, local, source, propagated)


def _counted(m: Measured, local: LocalEvidence, source: str, propagated: Verdict) -> Verdict:
    """The counting rule (no growth allowance, no baseline). ``flip_inside``: a near-tie routing
    flip ran inside the grafted module this tensor is local to, before it; then the error is the
    one the propagated verdict chose (the tokens routed alike inside the block, the tokens the flip
    provably did not reach after it), and a tensor with none of those stays not judged. A flip
    anywhere else cannot reach it: the grafted module ran on the reference's inputs, so the whole
    tensor is judged."""
    metrics, tolerance = m.metrics, m.tolerance
    assert metrics is not None
    if local.flip_inside and propagated.status is Status.NOT_JUDGED:
        return replace(propagated, rule="local", tolerance_source=source)
    error = metrics.one_minus_cosine if tolerance.metric == "cosine" else metrics.rel_diff
    flipped = local.flip_inside and propagated.status is Status.ROUTING_FLIP  # the tokens routed alike
    if flipped and propagated.error is not None:
        error = propagated.error
    base = propagated
    if not local.flip_inside and propagated.status in (Status.ROUTING_FLIP, Status.NOT_JUDGED):
        base = replace(propagated, why=None, after_flip=None, absorbed=None)
    threshold = local.allowance.threshold
    ok = (error <= threshold or metrics.max_abs <= tolerance.atol) and metrics.nonfinite_mismatch == 0
    return replace(
        base,
        status=(Status.ROUTING_FLIP if flipped else Status.OK) if ok else Status.DIVERGED,
        rule="local",
        error=error,
        threshold=threshold,
        basis="local",
        noise=None,
        tolerance_source=source,
    )


def _by_shadow(m: Measured, parts: ShadowParts, source: str, propagated: Verdict) -> Verdict:
    """Diverged when the logic or the rounding exceeds its own allowance; the part nearest its
    allowance is the error and threshold shown (``source`` says which, and both)."""
    metrics, tolerance = m.metrics, m.tolerance
    assert metrics is not None
    logic_ok = parts.logic[0] <= parts.logic[1]
    rounding_ok = parts.rounding[0] <= parts.rounding[1]
    ok = (logic_ok and rounding_ok) or metrics.max_abs <= tolerance.atol
    ok = ok and metrics.nonfinite_mismatch == 0
    ratio = lambda part: part[0] / part[1] if part[1] > 0 else math.inf  # noqa: E731
    error, threshold = parts.logic if ratio(parts.logic) >= ratio(parts.rounding) else parts.rounding
    return replace(
        propagated,
        status=Status.OK if ok else Status.DIVERGED,
        rule="shadow",
        error=error,
        threshold=threshold,
        basis="local",
        noise=None,
        why=None,
        after_flip=None,
        absorbed=None,
        tolerance_source=source,
    )


def usable_shadow(measure: ShadowMeasure | None) -> bool:
    """Whether a shadow measure holds every part the shadow rule needs."""
    return (
        measure is not None
        and measure.unfit is None
        and measure.logic is not None
        and measure.rounding is not None
        and measure.weights is not None
    )
