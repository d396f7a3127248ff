"""The judge stage: every pair judged in execution order, then the report's findings.

- :func:`judge_all` walks the measured pairs in execution order, keeping each root's running error
  level (:class:`.noise.Level`), and hands each pair's evidence to :func:`.judge.judge`, the one
  function that sets a status; a grafted A adds its local evidence (:mod:`.local`);
- :func:`conclude` decides the report's findings: the first divergence (in execution order, or
  with ``--align tokens`` the diverged row computed earliest), the largest growth, the outcome
  (the exit code, from the statuses, the inputs that differ and the coverage,
  :mod:`.coverage`), and the verdict's reach (:func:`reach`: per layer, the smallest relative
  error its allowances would have flagged, and the rerun that would see more where that is above
  a few percent).

The noise model is :mod:`.noise`; a grafted tensor's allowances :mod:`.allowance`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

from ...errors import ExitCode
from ...store.dtypes import UNIT_ROUNDOFF
from ..results import DiffReport, Findings, FirstInTime, Growth, Measured, Reach, ReachLayer, TensorResult
from .allowance import (
    K_LEAF,
    K_LEVEL,
    K_OP,
    N_CALIBRATED,
    ROUNDING_HEADROOM,
    level_roundings,
    local_allowance,
    tail_factor,
)
from .containers import anchors
from .coverage import below_minimum, nothing_comparable
from .judge import LocalJudging, PairEvidence, judge, settle
from .noise import BASELINE_FACTOR, GROWTH, K_ROUNDING, NOISE_MODEL, Level, rounding_floor
from .status import Status

__all__ = [  # the noise model's and the allowances' constants, read here by the report and the tests
    "BASELINE_FACTOR",
    "GROWTH",
    "K_LEAF",
    "K_LEVEL",
    "K_OP",
    "K_ROUNDING",
    "N_CALIBRATED",
    "ROUNDING_HEADROOM",
    "UNIT_ROUNDOFF",
    "conclude",
    "judge_all",
    "largest_growth",
    "level_roundings",
    "local_allowance",
    "reach",
    "rounding_floor",
    "tail_factor",
]


def judge_all(
    measured: Sequence[Measured], noise: dict[int, float] | None = None, local: LocalJudging | None = None
) -> list[TensorResult]:
    """Every measured pair judged (:func:`.judge.judge`), in execution order.

    ``noise`` maps a pair's index to ``err(C, B)`` from the baseline run, when one was given;
    ``local`` gives a grafted A's local evidence and labels (:mod:`.local`)."""
    levels: dict[tuple[str | None, str | None], Level] = {}
    judged: list[TensorResult] = []
    anchor = anchors(measured)
    before: list[float] = []  # the running level of this pair's pass and root, before it
    for position, pair in enumerate(measured):
        level = levels.setdefault(pair.scope, Level())
        level.enter(pair.pass_index)
        before.append(level.in_pass)
        own = anchor[position]
        scope = None if own == position else (before[own], measured[own].name)
        verdict = judge(
            PairEvidence(
                measured=pair,
                upstream=level.upstream(pair.name, scope),
                noise=noise.get(pair.index) if noise is not None else None,
                local=local.evidence(pair) if local is not None else None,
            )
        )
        if verdict.flip_effect is not None:
            level.flipped = max(level.flipped, verdict.flip_effect)
        if verdict.joins_level is not None:
            level.absorb(pair.name, verdict.joins_level)
        result = settle(pair, verdict)
        judged.append(local.labelled(result) if local is not None else result)
    return judged


# ------------------------------------------------------------------------- the report's findings

# Statuses that make the exit code 1 (compare/judge/status.py says which); the others are reported and
# never fail the diff.
FAILING = tuple(status for status in Status if status.fails)
NUMERIC_DIVERGENCE = tuple(status for status in Status if status.names_a_divergence)
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
        if result.status is not Status.DIVERGED or result.per_token is None:
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


def outcome(report: DiffReport, min_coverage: float | None = None) -> ExitCode:
    """The exit code, from the statuses, the inputs that differ and the coverage: a diff that
    would pass but compared nothing raises "nothing comparable" (exit 2), one that compared less
    of the reference than ``--min-coverage`` is exit 2 with a note (:mod:`.coverage`); a failure
    found in what was compared keeps exit 1, the more specific answer."""
    code = exit_code(report.results, report.inputs_differ)
    if code != ExitCode.OK or report.coverage is None:
        return code
    nothing_comparable(report)
    below = below_minimum(report.coverage, min_coverage)
    if below is not None:
        report.notes.append(below)
        return ExitCode.USAGE
    return code


def conclude(
    report: DiffReport, steps_of: dict[int, tuple[int, ...]] | None = None, min_coverage: float | None = None
) -> Findings:
    """Decide the report's findings from its final results and store them on it.

    The first divergence is none when the inputs differ (no module is to blame for what its inputs
    already carry); with ``--align tokens`` (``steps_of`` given) it is the diverged row computed
    earliest (:func:`first_in_time`), else the first in execution order. The exit code is
    :func:`outcome`'s."""
    in_time = first_in_time(report.results, steps_of) if steps_of is not None else None
    first = None
    if not report.inputs_differ:
        first = in_time.result if in_time is not None else first_divergence(report.results)
    report.findings = Findings(
        first_divergence=first,
        largest_growth=largest_growth(report.results),
        exit_code=outcome(report, min_coverage),
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
    if result.threshold is None or result.metric not in NOISE_MODEL or result.status is not Status.OK:
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
