"""Execute stage: read each planned pair (one pair at a time), measure it, judge it.

Peak memory is a few chunks plus whatever a pair needs materialised: nothing for plain pass files
(the arrays are views of the page cache), one joined tensor for ``--unshard cat``, a float64 sum
for ``--unshard sum``. Each unit's files are closed as soon as its pairs are done.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from .metrics import TensorMetrics, compare_arrays
from .plan import PairPlan, Plan, Workspace
from .reader import Stored
from .results import TensorResult
from .sources import PassView
from .stats import compare_stats, numeric_stats, stats_of
from .tolerance import Tolerance
from .unshard import SideEntry, assemble

Progress = Callable[[int], None]  # called with the bytes just compared


def judge(metrics: TensorMetrics, tolerance: Tolerance) -> tuple[float, float, bool]:
    """(the number judged, what it must stay under, whether it does) for one tensor pair."""
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


def _numel(shape: tuple[int, ...] | None) -> int | None:
    return None if shape is None else math.prod(shape)


class Executor:
    """Runs a plan pair by pair and returns the results in execution order."""

    def __init__(self, plan: Plan, workspace: Workspace, progress: Progress | None = None) -> None:
        self.plan = plan
        self.workspace = workspace
        self.progress = progress

    def run(self) -> list[TensorResult]:
        results: list[TensorResult] = []
        current_unit = -1
        try:
            for pair in self.plan.pairs:
                if pair.unit != current_unit:
                    if current_unit >= 0:
                        self.workspace.close_unit(current_unit)
                    current_unit = pair.unit
                results.append(self._one(len(results), pair))
                if self.progress is not None:
                    self.progress(pair_bytes(pair))
        finally:
            self.workspace.close()
        return results

    def _one(self, index: int, pair: PairPlan) -> TensorResult:
        unit = self.plan.units[pair.unit]
        views_a, views_b = self.workspace.views[pair.unit]
        base = {
            "index": index,
            "pass_index": unit.pass_a,
            "root": unit.root,
            "name": pair.a.name,
            "name_b": pair.b.name,
            "kind": "stats" if pair.tolerance.metric == "stats" else "tensor",
            "shape_a": pair.a.meta.shape,
            "shape_b": pair.b.meta.shape,
            "dtype_a": pair.a.meta.dtype,
            "dtype_b": pair.b.meta.dtype,
            "tolerance": pair.tolerance,
            "metric": pair.tolerance.metric,
            "unshard_a": pair.a.how,
            "unshard_b": pair.b.how,
        }
        if pair.kind not in ("tensor", "stats"):
            return TensorResult(**base, status=pair.kind, message=pair.message)
        try:
            if pair.kind == "stats":
                return self._stats_pair(base, pair, views_a, views_b)
            return self._tensor_pair(base, pair, views_a, views_b)
        except (ValueError, OSError, RuntimeError) as e:
            return TensorResult(**base, status="error", message=f"{type(e).__name__}: {e}")

    def _tensor_pair(
        self, base: dict, pair: PairPlan, views_a: list[PassView], views_b: list[PassView]
    ) -> TensorResult:
        metrics = compare_arrays(
            assemble(pair.a, views_a),
            assemble(pair.b, views_b),
            want_max_b=pair.tolerance.metric == "max_abs",
        )
        error, threshold, ok = judge(metrics, pair.tolerance)
        status, message = "ok" if ok else "diverged", _nonfinite_message(metrics)
        for side, entry, views in (("A", pair.a, views_a), ("B", pair.b, views_b)):
            disagreement = _rank_disagreement(entry, views, pair.tolerance)
            if disagreement is not None:
                status, message = "rank_mismatch", f"{side}: {disagreement}"
                break
        return TensorResult(
            **base, status=status, error=error, threshold=threshold, metrics=metrics, message=message
        )

    def _stats_pair(
        self, base: dict, pair: PairPlan, views_a: list[PassView], views_b: list[PassView]
    ) -> TensorResult:
        stats_b_raw = _stats_or_none(pair.b, views_b)
        stats_a_raw = _stats_or_none(pair.a, views_a)
        recorded = [stats for stats in (stats_a_raw, stats_b_raw) if stats is not None]
        names = [name for name in recorded[0] if all(name in stats for stats in recorded)]
        if not names:
            return TensorResult(**base, status="error", message=_no_common_stats(stats_a_raw, stats_b_raw))
        stats_a = stats_a_raw if stats_a_raw is not None else stats_of(assemble(pair.a, views_a), names)
        stats_b = stats_b_raw if stats_b_raw is not None else stats_of(assemble(pair.b, views_b), names)
        numel = _numel(pair.b.meta.shape) or _numel(pair.a.meta.shape)
        error, deltas = compare_stats(stats_a, stats_b, numel, pair.tolerance.atol)
        ok = error <= pair.tolerance.rtol
        worst = max(deltas, key=lambda n: deltas[n].rel_err) if deltas and not ok else None
        return TensorResult(
            **base,
            status="ok" if ok else "diverged",
            error=error,
            threshold=pair.tolerance.rtol,
            stats=deltas,
            message=f"{worst}: {deltas[worst].a:.6g} vs {deltas[worst].b:.6g}" if worst else None,
        )


def _no_common_stats(stats_a: dict[str, float] | None, stats_b: dict[str, float] | None) -> str:
    """Why a stats pair has no verdict: judging it "ok" would pass what was never compared."""

    def recorded(stats: dict[str, float] | None) -> str:
        return "a whole tensor" if stats is None else ", ".join(stats) or "none"

    return (
        f"no numeric statistic on both sides (A: {recorded(stats_a)}; B: {recorded(stats_b)}); "
        "dump with a numeric one in STATS (e.g. abs_mean)"
    )


def _stats_or_none(entry: SideEntry, views: list[PassView]) -> dict[str, float] | None:
    if entry.meta.kind != "stats":
        return None
    return numeric_stats(views[0].stats(entry.name))


def _rank_disagreement(entry: SideEntry, views: list[PassView], tolerance: Tolerance) -> str | None:
    """For a replicated entry of a multi-rank side: the first rank that disagrees with rank 0."""
    if entry.how != "replicated" or len(views) < 2:
        return None
    reference: Stored = views[0].array(entry.name)
    for view in views[1:]:
        metrics = compare_arrays(view.array(entry.name), reference, want_max_b=tolerance.metric == "max_abs")
        error, threshold, ok = judge(metrics, tolerance)
        if not ok:
            return (
                f"rank {view.rank} differs from rank {views[0].rank} ({tolerance.metric} {error:.3g} > "
                f"{threshold:.3g}); replicated tensors must agree across ranks (or add an --unshard rule)"
            )
    return None


def pair_bytes(pair: PairPlan) -> int:
    """Bytes a pair reads (for the progress bar): element counts times a typical 2-4 byte width."""
    total = 0
    for entry in (pair.a, pair.b):
        numel = _numel(entry.meta.shape) or 0
        width = (
            8
            if entry.meta.dtype in ("float64", "int64")
            else 2
            if entry.meta.dtype in ("bfloat16", "float16")
            else 4
        )
        total += numel * width
    return total
