"""The verdict: which measured error is a divergence, judged by the numerical physics of the run.

Every decision the comparator makes on the numbers it measured is here, in this order:

- each pair's threshold and status (:func:`judge_all`: the noise model below, the fixed rules of
  :func:`fixed_rule`, a stats pair's :func:`stats_rule`, a router's :func:`router_rule`, a tensor
  inside a block whose router flipped at a near-tie :func:`flipped_block_rule`);
- a grafted dump's local error (:func:`local_allowance_of`, :func:`judge_locally`; :mod:`.local`
  says which tensors are local);
- the report's findings (:func:`conclude`): the first divergence (in execution order, or with
  ``--align tokens`` the diverged row computed earliest), the largest growth, the exit code, and
  the verdict's reach (:func:`reach`: per layer, the smallest relative error its allowances would
  have flagged, and the rerun that would see more where that is above a few percent).

Whether a router's flip is a near-tie is measured in :mod:`..measure.routing` (its margins against its
scores' noise, ``TIE_FACTOR``); what that flip then means for the pair is decided here.

A fixed threshold per dtype cannot be right. Two bf16 runs of the same code agree *exactly* up to
a bug, and a one-layer bug then shows as an error of ~1e-4 (rel_diff) after exact zeros: far below
a bf16 threshold that must also pass bf16-vs-fp32 noise, which reaches ~1e-4 after a few layers
and keeps growing through a deep model. So each tensor is judged against what the error already
present *upstream* explains (rel_diff and 1 - cosine; both are squared relative errors):

    explained = G * L + R            (G = GROWTH, R = K_ROUNDING * (u_run^2 + n * u_acc^2))

- ``L`` is the running level: the largest error of the tensors before this one, in execution order,
  that were themselves explained; for a container's later output leaves (attention weights), the
  level before its last child started (:mod:`.containers`: recorded later is not computed later).
  Modules downstream of a noisy one inherit its noise, amplified by their conditioning (a softmax
  over logits of a few units, a residual with cancellation): ``G`` allows one op to amplify it
  100x in rel_diff (10x in RMS error).
- ``R`` is what one more op can add at the run precision: a few roundings of the output dtype
  (``u_run`` its unit roundoff: 2^-8 for bf16, 2^-24 for fp32) plus the fp32 accumulation over the
  tensor's last dim (``n``), which dominates fp32 runs. An error from exact zeros is a divergence
  when it exceeds a few roundings of one op: a kernel change in bf16 starts at ~0.4 u^2, a 2% MLP
  scale bug at ~13 u^2.
- Between runs at different precisions (bf16 against fp32) the model's inputs already differ by one
  rounding (u^2/3), so the level starts there instead of at exact zero.
- The per-dtype default (:mod:`.tolerance`) is a ceiling that the growth allowance never lifts: an
  error that jumps past it is a divergence, however noisy upstream. Errors carried in from earlier
  passes (a diffusion loop feeding its latents back, a KV cache) are upstream too; the ceiling is
  lifted only for a tensor whose own error neared it in an earlier pass, to ``CARRY_GROWTH`` x that
  error: a 25-step bf16 loop grows its errors step by step, not one module at once.

With ``--baseline C`` (the reference rerun under the difference the user accepts, e.g. in A's
dtype), each pair's threshold is its own measured noise instead: ``BASELINE_FACTOR * err(C, B) + R``
(``R`` is the floor where the noise is exactly zero), under the same ceiling, except past a near-tie
routing flip, where both runs are measured on the tokens their routers routed alike and a measured
noise is not overruled. The error is reported as "x noise".

A user ``--rtol`` (global, or a ``REGEX=VALUE`` rule matching the name) fixes that pair's threshold
instead; ``max_abs`` is an allclose test and keeps its fixed rule; integers compare exactly.
A near-tie MoE routing flip's effect joins the running level.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ...errors import ExitCode
from ...store.dtypes import UNIT_ROUNDOFF
from ..measure.metrics import TensorMetrics
from ..results import DiffReport, Findings, FirstInTime, Growth, Reach, ReachLayer, TensorResult
from .containers import anchors
from .status import Status
from .tolerance import Tolerance

GROWTH = 100.0  # how much one op may amplify the upstream error (rel_diff, i.e. 10x in RMS)
CARRY_GROWTH = 10.0  # how much one step of a loop may grow a tensor's own error past the ceiling
K_ROUNDING = 3.0  # roundings one op may add, in units of u^2 (rel_diff of one rounding ~ u^2/3)
BASELINE_FACTOR = 10.0  # x the measured noise err(C, B) (about 3x in RMS error)
NOISE_MODEL = ("rel_diff", "cosine")  # metrics the noise model judges; the others keep fixed rules


def rounding_floor(precision: str | None, last_dim: int) -> float:
    """``R``: the error one op can add at ``precision`` (output rounding plus fp32 accumulation)."""
    u_run, u_acc = _roundoffs(precision)
    return K_ROUNDING * (u_run**2 + max(last_dim, 1) * u_acc**2)


def _roundoffs(precision: str | None) -> tuple[float, float]:
    """(u_run, u_acc): the unit roundoff of the run's output dtype and of its accumulator (fp32,
    fp64 for an fp64 run): the two roundings every allowance of this module is made of."""
    u_run = UNIT_ROUNDOFF.get(precision or "float32", UNIT_ROUNDOFF["float32"])
    return u_run, UNIT_ROUNDOFF["float64" if precision == "float64" else "float32"]


@dataclass(kw_only=True)
class _Level:
    """The running error level of one root pair: this pass's, and what earlier passes carried."""

    pass_index: int | None = None
    in_pass: float = 0.0
    carried: float = 0.0
    flipped: float = 0.0  # this pass's error let through by near-tie routing flips
    own: dict[str, float] = field(default_factory=dict)  # each tensor's largest error in earlier passes
    this_pass: dict[str, float] = field(default_factory=dict)

    def enter(self, pass_index: int) -> None:
        if pass_index != self.pass_index:
            self.carried = max(self.carried, self.in_pass)
            for name, error in self.this_pass.items():
                self.own[name] = max(self.own.get(name, 0.0), error)
            self.in_pass, self.flipped, self.this_pass = 0.0, 0.0, {}
            self.pass_index = pass_index

    def absorb(self, name: str, error: float) -> None:
        self.in_pass = max(self.in_pass, error)
        self.this_pass[name] = max(self.this_pass.get(name, 0.0), error)

    def cap(self, name: str, ceiling: float) -> float:
        """The ceiling, lifted only for a tensor whose own error already neared it in an earlier
        pass (a loop that feeds its output back grows each tensor's error step by step)."""
        return max(ceiling, CARRY_GROWTH * self.own.get(name, 0.0))


def explained(
    level: _Level, name: str, floor: float, ceiling: float, inputs: float = 0.0, in_pass: float | None = None
) -> float:
    """What the upstream error explains: growth within the pass, and growth of what earlier passes
    carried in, both under the ceiling (see :meth:`_Level.cap`). ``inputs`` is the error the
    model's inputs already carry; ``in_pass`` the level of this pass that may explain it, when
    that is not the whole running level (a container's own outputs, :mod:`.containers`)."""
    within_level = level.in_pass if in_pass is None else in_pass
    within = min(GROWTH * max(within_level, inputs) + floor, ceiling)
    carried = min(GROWTH * level.carried + floor, level.cap(name, ceiling))
    return max(within, carried)


def input_rounding(precision: str | None) -> float:
    """rel_diff of one rounding to ``precision`` (~u^2/3): what the inputs of two runs at different
    precisions differ by before any module runs (a prompt's embeddings, latents, timesteps)."""
    return UNIT_ROUNDOFF.get(precision or "float32", UNIT_ROUNDOFF["float32"]) ** 2 / 3


def _last_dim(result: TensorResult) -> int:
    shape = result.shape_b or result.shape_a or ()
    return shape[-1] if shape else 1


def judge_all(results: list[TensorResult], noise: dict[int, float] | None = None) -> list[TensorResult]:
    """Give every measured result its threshold and status, in execution order.

    ``noise`` maps a result's index to ``err(C, B)`` from the baseline run, when one was given."""
    levels: dict[tuple[str | None, str | None], _Level] = {}
    judged: list[TensorResult] = []
    anchor = anchors(results)
    before: list[float] = []  # the running level of this result's pass and root, before it
    for position, result in enumerate(results):
        level = levels.setdefault(result.scope, _Level())
        level.enter(result.pass_index)
        before.append(level.in_pass)
        own = anchor[position]
        scope = None if own == position else (before[own], results[own].name)
        verdict = _judge(result, level, noise, scope)
        if verdict.status == "routing_flip" and verdict.absorbed is not None:
            level.flipped = max(level.flipped, verdict.absorbed)
        if verdict.status in ("ok", "routing_flip") and verdict.metric in NOISE_MODEL:
            error = verdict.absorbed if verdict.absorbed is not None else verdict.error or 0.0
            level.absorb(verdict.name, error)
        judged.append(verdict)
    return judged


def _judge(
    result: TensorResult,
    level: _Level,
    noise: dict[int, float] | None,
    scope: tuple[float, str] | None = None,
) -> TensorResult:
    """``scope``: (the level, the name of the first tensor it leaves out) when less than the whole
    running level explains this tensor (a container's own output, :mod:`.containers`)."""
    if result.status not in ("measured", "routing_flip") or result.metrics is None:
        return result
    if result.status == "routing_flip" and result.tolerance.metric == "exact":
        return result  # the router's own indices: judged by their margins (routing.py)
    tolerance, metrics = result.tolerance, result.metrics
    measured = noise is not None and result.index in noise
    if result.after_flip is not None and tolerance.metric in NOISE_MODEL and not measured:
        return judge_after_flip(result, level, scope)
    measured_noise = None
    if tolerance.metric not in NOISE_MODEL or tolerance.fixed:
        error, threshold, ok = fixed_rule(metrics, tolerance)
        status, basis = ("ok" if ok else "diverged"), "fixed"
    else:
        error = metrics.one_minus_cosine if tolerance.metric == "cosine" else metrics.rel_diff
        if result.status == "routing_flip":  # error on the tokens that kept their experts
            error = result.error if result.error is not None else error
        floor = rounding_floor(tolerance.precision, _last_dim(result))
        if measured:
            assert noise is not None
            measured_noise = noise[result.index]
            threshold = BASELINE_FACTOR * measured_noise + floor
            if result.status != "routing_flip":  # the ceiling overrules no noise measured past a flip
                threshold = min(threshold, level.cap(result.name, tolerance.rtol))
            if level.flipped:  # a near-tie flip upstream in this pass: its effect, under the ceiling
                threshold = max(threshold, min(GROWTH * level.flipped + floor, tolerance.rtol))
            basis = "baseline"
        else:
            inputs = input_rounding(tolerance.precision) if tolerance.mixed else 0.0
            within = scope[0] if scope is not None else None
            threshold = explained(level, result.name, floor, tolerance.rtol, inputs, within)
            basis = "upstream"
        ok = error <= threshold or metrics.max_abs <= tolerance.atol
        ok = ok and metrics.nonfinite_mismatch == 0
        status = result.status if result.status == "routing_flip" and ok else ("ok" if ok else "diverged")
    return replace(
        result,
        status=status,
        error=error,
        threshold=threshold,
        noise=measured_noise,
        basis=basis,
        message=result.message or _nonfinite_message(result),
        level_before=scope[1] if scope is not None and basis == "upstream" else None,
    )


def judge_after_flip(
    result: TensorResult, level: _Level, scope: tuple[float, str] | None = None
) -> TensorResult:
    """A tensor downstream of a near-tie routing flip, outside the flipped block, with no baseline.

    Every token that attended to a flipped one in a later layer carries the flip's consequence,
    which no rounding model bounds (another expert's answer, mixed in by attention): judging it
    names a layer that is fine. So only the tokens that provably received nothing of it are judged
    (:attr:`..results.AfterFlip.error`: under a causal mask, the positions before the first flipped
    one), by the upstream rule; when none can be shown, the tensor is ``not_judged``, with the
    reason, never a divergence. ``--baseline`` (a rerun that flips the same tokens) and a grafted
    run (each module fed the reference's inputs) judge it instead."""
    after = result.after_flip
    assert after is not None and result.metrics is not None
    if after.error is None:
        return replace(
            result,
            status="not_judged",
            error=None,
            threshold=None,
            absorbed=None,
            basis="not judged",
            message=f"not judged: {after.reason()} ({after.why})",
        )
    tolerance, metrics = result.tolerance, result.metrics
    floor = rounding_floor(tolerance.precision, _last_dim(result))
    if tolerance.fixed:
        threshold, basis = tolerance.rtol, "fixed"
    else:
        inputs = input_rounding(tolerance.precision) if tolerance.mixed else 0.0
        threshold = explained(level, result.name, floor, tolerance.rtol, inputs, scope[0] if scope else None)
        basis = "upstream"
    ok = (after.error <= threshold or metrics.max_abs <= tolerance.atol) and metrics.nonfinite_mismatch == 0
    return replace(
        result,
        status="routing_flip" if ok else "diverged",
        error=after.error,
        threshold=threshold,
        absorbed=after.error,
        basis=basis,
        message=(
            f"compared on the {after.tokens} tokens no near-tie flip of {after.router} can have reached "
            f"({after.why})"
        ),
        level_before=scope[1] if scope is not None and basis == "upstream" else None,
    )


def fixed_rule(metrics: TensorMetrics, tolerance: Tolerance) -> tuple[float, float, bool]:
    """(the number judged, its threshold, whether it stays under) by a fixed rule: integers exact,
    ``max_abs`` allclose, a user's rtol (or the ceiling) as a plain threshold on rel_diff/cosine."""
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


def stats_rule(error: float, tolerance: Tolerance) -> tuple[str, float]:
    """(status, threshold) of a stats pair: its worst statistic's error against ``rtol``, a fixed
    rule (a statistic is one number per tensor: no noise model applies to it)."""
    return ("ok" if error <= tolerance.rtol else "diverged"), tolerance.rtol


def router_rule(near_tie: bool, flipped: int, metrics: TensorMetrics) -> tuple[str, float, float | None]:
    """(status, error, threshold) of a router's top-k indices that differ: a flip at a near-tie of
    its top-k (within the run's noise, :func:`..measure.routing.detect`) is reported, not a divergence, its
    error the count of tokens flipped; any other flip is a divergence of the indices."""
    if near_tie:
        return "routing_flip", float(flipped), None
    return "diverged", metrics.max_abs, 0.0


def flipped_block_rule(kept_tokens_readable: bool) -> str:
    """The status of a tensor inside a MoE block whose router flipped at a near-tie: judged on the
    tokens both routers routed alike (``routing_flip``, then thresholded by :func:`judge_all` like
    any pair), or, where those tokens cannot be picked out of it, not compared (``routing``): its
    whole-tensor error is the flip's, not a divergence."""
    return "routing_flip" if kept_tokens_readable else "routing"


def _nonfinite_message(result: TensorResult) -> str | None:
    metrics = result.metrics
    if metrics is None or not metrics.nonfinite_mismatch:
        return None
    return (
        f"NaN/Inf differ at {metrics.nonfinite_mismatch} positions "
        f"(A: {metrics.nan_a} NaN, {metrics.inf_a} Inf; B: {metrics.nan_b} NaN, {metrics.inf_b} Inf)"
    )


# ------------------------------------------------------------------------- the report's findings

# Statuses that make the exit code 1 (compare/judge/status.py says which); the others are reported and
# never fail the diff.
FAILING = tuple(status.value for status in Status if status.fails)
NUMERIC_DIVERGENCE = ("diverged", "rank_mismatch", "extra_op")  # the statuses a first divergence may have
GROWTH_FACTOR = 10.0  # a jump: an error this many times the largest before it in its pass
# Errors below this are rounding dust: a jump from 1e-16 to 1e-14 is not where a bug starts.
GROWTH_FLOOR = 1e-12


def first_divergence(results: Sequence[TensorResult]) -> TensorResult | None:
    """The first pair in execution order whose values exceed tolerance (or disagree across ranks)."""
    return next((r for r in results if r.status in NUMERIC_DIVERGENCE), None)


def largest_growth(results: Sequence[TensorResult]) -> Growth | None:
    """The first tensor whose error exceeds 10x the largest error seen before it in the same pass.

    bf16 noise grows slowly through the layers; a bug shows as a jump. Errors under
    :data:`GROWTH_FLOOR` neither count as a jump nor set the running maximum.
    """
    running: float | None = None
    unit_key: tuple[int, tuple[str | None, str | None]] | None = None
    for result in results:
        if (result.pass_index, result.scope) != unit_key:
            unit_key, running = (result.pass_index, result.scope), None
        error = result.error
        if error is None or result.metric == "exact" or not math.isfinite(error) or error < GROWTH_FLOOR:
            continue
        if running is not None and error > GROWTH_FACTOR * running:
            return Growth(result, running, error / running)
        running = error if running is None else max(running, error)
    return None


def first_in_time(
    results: Sequence[TensorResult], steps_of: dict[int, tuple[int, ...]]
) -> FirstInTime | None:
    """``--align tokens``: the diverged row computed earliest, the lowest step (A's pass), then the
    first module in that step. ``steps_of`` maps a result's index to the step of each of its rows;
    a result's row is its first beyond the threshold (its worst when none is)."""
    best: tuple[tuple[int, int], TensorResult, int] | None = None
    for result in results:
        if result.status != "diverged" or result.per_token is None:
            continue
        per_token = result.per_token
        threshold = result.threshold or 0.0
        bad = [i for i, v in enumerate(per_token) if v > threshold]
        row = bad[0] if bad else max(range(len(per_token)), key=lambda i: per_token[i])
        key = (steps_of[result.index][row], result.index)
        if best is None or key < best[0]:
            best = (key, result, row)
    if best is None:
        return None
    (step, _), result, row = best
    return FirstInTime(result=result, row=row, step=step)


def exit_code(results: Sequence[TensorResult], inputs_differ: Sequence[Any]) -> ExitCode:
    """1 when a pair failed (:data:`FAILING`) or aligned sequences were fed other tokens, else 0."""
    failing = bool(inputs_differ) or any(r.status in FAILING for r in results)
    return ExitCode.DIVERGED if failing else ExitCode.OK


def conclude(report: DiffReport, steps_of: dict[int, tuple[int, ...]] | None = None) -> Findings:
    """Decide the report's findings from its final results and store them on it.

    The first divergence is none when the inputs differ (no module is to blame for what its inputs
    already carry); with ``--align tokens`` (``steps_of`` given) it is the diverged row computed
    earliest (:func:`first_in_time`), else the first in execution order."""
    in_time = first_in_time(report.results, steps_of) if steps_of is not None else None
    first = None
    if not report.inputs_differ:
        first = in_time.result if in_time is not None else first_divergence(report.results)
    report.findings = Findings(
        first_divergence=first,
        largest_growth=largest_growth(report.results),
        exit_code=exit_code(report.results, report.inputs_differ),
        first_in_time=in_time,
        reach=reach(report.results),
    )
    return report.findings


# ------------------------------------------------------------------------- what a verdict could see
# A clean verdict covers errors above the allowances it used, and no smaller one: a 5% bug under a
# bf16-against-fp32 allowance of 10% passes. Its reach is said with every exit 0.

REACH_WARN = 0.03  # a layer that could miss a relative error above this gets a rerun suggested
_LAYER = re.compile(r"^(.*?\.\d+)(?=[.\[@:]|$)")
OUTSIDE = "outside the layers"


def _relative(result: TensorResult) -> float | None:
    """The smallest relative error (RMS, of the tensor's norm) ``result``'s threshold would have
    flagged: rel_diff and 1 - cosine are squared relative errors (the latter halved)."""
    if result.threshold is None or result.metric not in NOISE_MODEL or result.status not in ("ok",):
        return None
    squared = 2 * result.threshold if result.metric == "cosine" else result.threshold
    return math.sqrt(max(squared, 0.0))


def reach(results: Sequence[TensorResult]) -> Reach | None:
    """Per layer (the name up to its first index: ``model.layers.1``), the largest relative error
    an allowance of that layer let pass, and the tensor whose allowance it is: a bug of a smaller
    relative size in that tensor could not have been told from the run's noise. The rerun that
    would see more: the reference in A's precision (``--baseline``), both in float32, or A grafted
    onto B (each module judged on B's inputs). None when nothing was judged by an allowance."""
    worst: dict[str, tuple[float, str, str]] = {}
    mixed = False
    for result in results:
        relative = _relative(result)
        if relative is None:
            continue
        mixed = mixed or result.tolerance.mixed
        found = _LAYER.match(result.name)
        layer = found.group(1) if found else OUTSIDE
        if layer not in worst or relative > worst[layer][0]:
            worst[layer] = (relative, result.label, result.basis or "")
    if not worst:
        return None
    layers = tuple(ReachLayer(layer=k, relative=v[0], tensor=v[1], basis=v[2]) for k, v in worst.items())
    blind = [x for x in layers if x.relative > REACH_WARN]
    rerun = None
    if blind:
        bases = {x.basis for x in blind}
        if "baseline" in bases and not mixed:
            rerun = "graft A onto B (TRACEDUMP_DUMP_GRAFT_FROM=B's dump): each module judged on B's inputs"
        elif mixed:
            rerun = (
                "rerun the reference in A's precision and pass it as --baseline (each tensor judged "
                "against its own measured noise), or both runs in float32, or A grafted onto B"
            )
        else:
            rerun = "--baseline (the reference rerun under the difference you accept), or A grafted onto B"
    return Reach(layers=layers, warn=REACH_WARN, rerun=rerun)


# ------------------------------------------------------------------------- grafted dumps: local error
# A grafted module ran on the reference's own inputs: it is judged by what it alone may add at the
# run precision (:mod:`.local` says which tensors are local and why; the allowance is decided here).

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
    u_run, u_acc = _roundoffs(precision)
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


def local_judgeable(result: TensorResult) -> bool:
    """Whether the local rule judges ``result``: a measured float tensor under the noise model;
    integers (exact), ``max_abs``, a user's ``--rtol`` and routing keep their own rules."""
    return (
        result.metrics is not None
        and result.kind == "tensor"
        and result.status in ("ok", "diverged", "routing_flip", "not_judged")
        and result.tolerance.metric in NOISE_MODEL
        and not result.tolerance.fixed
    )


def local_allowance_of(
    result: TensorResult, *, leaf: bool, own_input: bool, ops: int | None
) -> LocalAllowance:
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


def judge_locally(
    result: TensorResult, allowance: LocalAllowance, source: str, *, flip_inside: bool = True
) -> TensorResult:
    """``result`` judged by its local error (no growth allowance, no baseline); ``source`` says so
    in its tolerance. ``flip_inside``: a near-tie routing flip ran inside the grafted module this
    tensor is local to, before it; then the error is the one the propagated verdict chose (the
    tokens routed alike inside the block, the tokens the flip provably did not reach after it),
    and a tensor with none of those stays not judged. A flip anywhere else cannot reach it: the
    grafted module ran on the reference's inputs, so the whole tensor is judged."""
    metrics, tolerance = result.metrics, result.tolerance
    assert metrics is not None
    error = metrics.one_minus_cosine if tolerance.metric == "cosine" else metrics.rel_diff
    if flip_inside and result.status == "not_judged":
        return replace(result, tolerance=replace(tolerance, source=source))
    flipped = flip_inside and result.status == "routing_flip"  # the tokens routed alike
    if flipped and result.error is not None:
        error = result.error
    if not flip_inside and result.status in ("routing_flip", "not_judged"):
        result = replace(result, message=None, after_flip=None, absorbed=None)
    threshold = allowance.threshold
    ok = (error <= threshold or metrics.max_abs <= tolerance.atol) and metrics.nonfinite_mismatch == 0
    return replace(
        result,
        status=("routing_flip" if flipped else "ok") if ok else "diverged",
        error=error,
        threshold=threshold,
        basis="local",
        noise=None,
        tolerance=replace(tolerance, source=source),
    )


# ------------------------------------------------------------------------- grafted dumps: the fp32 shadow
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
    result: TensorResult,
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


def judge_with_shadow(result: TensorResult, parts: ShadowParts, source: str) -> TensorResult:
    """``result`` judged by its shadow: diverged when its logic or its rounding exceeds its own
    allowance; the part nearest its allowance is the error and threshold shown (``source`` says
    which, and both)."""
    metrics, tolerance = result.metrics, result.tolerance
    assert metrics is not None
    logic_ok = parts.logic[0] <= parts.logic[1]
    rounding_ok = parts.rounding[0] <= parts.rounding[1]
    ok = (logic_ok and rounding_ok) or metrics.max_abs <= tolerance.atol
    ok = ok and metrics.nonfinite_mismatch == 0
    ratio = lambda part: part[0] / part[1] if part[1] > 0 else math.inf  # noqa: E731
    error, threshold = parts.logic if ratio(parts.logic) >= ratio(parts.rounding) else parts.rounding
    return replace(
        result,
        status="ok" if ok else "diverged",
        error=error,
        threshold=threshold,
        basis="local",
        noise=None,
        message=None,
        after_flip=None,
        absorbed=None,
        tolerance=replace(tolerance, source=source),
    )
