"""Execute stage: read each planned pair (one pair at a time) and measure it; never judge it.

Both planners' plans run here: a pair of one pass reads its entries
(:func:`~tracedump.compare.pair.unshard.assemble`);
a pair of a sequence (``--align tokens``) gathers its rows over the steps that computed them
(:meth:`~tracedump.compare.pair.plan.Workspace.gather`), tokens along dim 0. From there the two are measured
alike:
metrics, per-token errors, MoE routing flips and the tokens they leave alike, a grafted A's fp32
shadow. What a pair showed beside its numbers is recorded as :class:`.evidence.Evidence`; the
status is the judge's (:func:`tracedump.compare.judge.judge.judge`).

Peak memory is a few chunks plus whatever a pair needs materialised: nothing for plain pass files
(the arrays are views of the page cache), one joined tensor for ``--unshard cat``, a float64 sum
for ``--unshard sum``. Each unit's files are closed as soon as its pairs are done.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ...errors import DumpReadError
from ...store.dtypes import BY_NAME
from ...store.format import Key
from ...store.sequences import token_dim
from ..judge.judge import fixed_rule
from ..judge.tolerance import Tolerance, is_integer
from ..load.reader import Stored
from ..load.sources import PassView
from ..pair.plan import PairPlan, Plan, Workspace
from ..pair.unshard import SideEntry, assemble
from ..results import AfterFlip, Measured
from .evidence import Evidence, KeptTokens, RouterFlip, StatsFound
from .metrics import TensorMetrics, compare_arrays, compare_by_row, per_token_of
from .routing import (
    Flip,
    detect,
    downstream_of,
    flipped_before,
    is_router_indices,
    kept_rows,
    merged,
    module_of,
    unaffected_tokens,
)
from .shadow import measure_shadow
from .stats import compare_stats, numeric_stats, stats_of

Progress = Callable[[int], None]  # called with the bytes just compared


def _numel(shape: tuple[int, ...] | None) -> int | None:
    return None if shape is None else math.prod(shape)


class Executor:
    """Runs a plan pair by pair and returns the results in execution order."""

    def __init__(
        self,
        plan: Plan,
        workspace: Workspace,
        progress: Progress | None = None,
        *,
        per_token: bool = True,
        shadow: bool = False,
    ) -> None:
        """``shadow``: A is a grafted run; each of its tensors with a fp32 shadow (``shadow~KEY``)
        has that shadow measured with it (:func:`.shadow.measure_shadow`)."""
        self.plan = plan
        self.shadow = shadow
        self.workspace = workspace
        self.progress = progress
        self.per_token = per_token
        self.flips: list[Flip] = []
        self._unit_flips: list[Flip] = []
        self._tokens: int | None = None
        self._by_name: dict[str, PairPlan] = {}
        # each unit's pairs by A's name, in one walk over the plan (a walk per unit was quadratic
        # in the passes)
        self._units_by_name: dict[int, dict[str, PairPlan]] = {}
        for pair in plan.pairs:
            self._units_by_name.setdefault(pair.unit, {})[pair.a.name] = pair
        self._sequences: set[tuple[int, int]] = set()  # (batch, seq) of the unit's [batch, seq, hidden]
        self._causal: bool | None = None
        self._one_sequence = False  # the unit is a sequence pair: its rows are one sequence's tokens

    def run(self) -> list[Measured]:
        results: list[Measured] = []
        current_unit = -1
        try:
            for pair in self.plan.pairs:
                if pair.unit != current_unit:
                    if current_unit >= 0:
                        self.workspace.close_unit(current_unit)
                    current_unit = pair.unit
                    self._enter_unit(current_unit)
                results.append(self._one(len(results), pair))
                if self.progress is not None:
                    self.progress(pair_bytes(pair))
        finally:
            self.workspace.close()
        return results

    def _enter_unit(self, unit: int) -> None:
        self._unit_flips, self._tokens, self._sequences = [], None, set()
        self._by_name = self._units_by_name.get(unit, {})
        self._causal = self.plan.units[unit].causal
        self._one_sequence = self.plan.units[unit].sequence is not None

    def _one(self, index: int, pair: PairPlan) -> Measured:
        unit = self.plan.units[pair.unit]
        views_a, views_b = self.workspace.views[pair.unit]
        base = replace(_planned(index, unit.pass_a, unit.pass_b, unit.root, pair), sequence=unit.sequence)
        if pair.kind not in ("tensor", "stats"):
            return _found(base, Evidence(unmeasured=pair.kind, note=pair.message))
        try:
            if pair.kind == "stats":
                return self._stats_pair(base, pair, views_a, views_b)
            if pair.rows is not None:
                return self._rows_pair(base, pair)
            stored = assemble(pair.a, views_a), assemble(pair.b, views_b)
            measured = self._tensor_pair(base, pair, stored, views_a, views_b)
        except DumpReadError:
            raise  # a tensor the diff cannot read: damaged input (exit 2), never a row
        except (ValueError, OSError, RuntimeError) as e:
            return _found(base, Evidence(failure=f"{type(e).__name__}: {e}", note=f"{type(e).__name__}: {e}"))
        if self.shadow and any(view.shadow for view in views_a):
            measured = self._with_shadow(measured, pair, views_a, views_b)
        return measured

    def _with_shadow(
        self, measured: Measured, pair: PairPlan, views_a: list[PassView], views_b: list[PassView]
    ) -> Measured:
        """``measured`` with A's fp32 shadow of it, read as the pair was; a shadow that cannot be
        read is said on the row (the tensor is then judged without it) and in the report's notes."""
        try:
            shadow = measure_shadow(pair, views_a, views_b)
        except (ValueError, OSError, KeyError, RuntimeError) as e:  # DumpReadError too: not the tensor's
            return _found(measured, replace(measured.evidence, shadow_failure=f"{type(e).__name__}: {e}"))
        if shadow is None:
            return measured
        return _found(measured, replace(measured.evidence, shadow=shadow))

    def _rows_pair(self, base: Measured, pair: PairPlan) -> Measured:
        """``--align tokens``: one sequence's rows of the pair, gathered over the steps that
        computed them, then measured as any tensor pair is (token rows along dim 0)."""
        (rows_a, dtype_a, why_a), (rows_b, dtype_b, why_b) = self.workspace.gather(pair)
        base = replace(
            base,
            shape_a=rows_a.shape if rows_a is not None else None,
            shape_b=rows_b.shape if rows_b is not None else None,
            dtype_a=dtype_a,
            dtype_b=dtype_b,
            token_dim=0,
        )
        if rows_a is None or rows_b is None:
            why = "; ".join(f"{side}: {text}" for side, text in (("A", why_a), ("B", why_b)) if text)
            return _found(base, Evidence(unaligned=True, note=f"rows not compared: {why}"))
        if rows_a.shape != rows_b.shape:
            message = f"per-token shapes {list(rows_a.shape[1:])} vs {list(rows_b.shape[1:])}"
            return _found(base, Evidence(shapes_differ=True, note=message))
        return self._tensor_pair(base, pair, (rows_a, rows_b), [], [])

    def _tensor_pair(
        self,
        base: Measured,
        pair: PairPlan,
        stored: tuple[Stored, Stored],
        views_a: list[PassView],
        views_b: list[PassView],
    ) -> Measured:
        stored_a, stored_b = stored
        want_max_b = pair.tolerance.metric == "max_abs"
        dim = 0 if pair.rows is not None else self._token_dim(stored_a.shape, stored_b.shape)
        rows = None
        if dim is None:
            metrics = compare_arrays(stored_a, stored_b, want_max_b=want_max_b)
        else:  # the per-token sums come from the same pass
            metrics, rows = compare_by_row(stored_a, stored_b, want_max_b=want_max_b)
        for side, entry, views in (("A", pair.a, views_a), ("B", pair.b, views_b)):
            disagreement = _rank_disagreement(entry, views, pair.tolerance)
            if disagreement is not None:
                found = Evidence(rank_disagreement=disagreement, note=f"{side}: {disagreement}")
                return _found(replace(base, metrics=metrics), found)
        if pair.tolerance.metric == "exact" and metrics.max_abs > 0:
            flipped = self._router_flip(base, pair, (stored_a, stored_b), metrics, views_a, views_b)
            if flipped is not None:
                return flipped
        covering = next((f for f in self._unit_flips if f.covers(pair.a.name)), None)
        if covering is not None:
            flip = merged(covering, self._unit_flips)  # and the tokens earlier routers flipped
            inside = self._inside_flipped_block(base, flip, (stored_a, stored_b), metrics)
            earlier = [f for f in self._unit_flips[: self._unit_flips.index(covering)] if f.flipped]
            if earlier and inside.evidence.kept is not None:  # also downstream of an earlier router's flip
                return self._with_unaffected(inside, flip, (stored_a, stored_b))
            return inside
        if self.per_token and self._tokens is None and not is_integer(pair.a.meta.dtype):
            self._tokens = self._unit_tokens(stored_a.shape)  # from the unit's first float tensor
        if len(stored_a.shape) == 3 and not is_integer(pair.a.meta.dtype):
            self._sequences.add((stored_a.shape[0], stored_a.shape[1]))
        per_token = None if dim is None else per_token_of(stored_a, stored_b, metrics, dim, rows)
        after = self._unit_flips and any(f.near_tie and f.flipped for f in self._unit_flips)
        if after and pair.tolerance.metric in ("rel_diff", "cosine") and not is_integer(pair.a.meta.dtype):
            downstream = downstream_of(self._unit_flips, stored_a.shape)
            if downstream is not None:
                return self._after_flip(base, downstream, (stored_a, stored_b), metrics, dim, per_token)
            why = "its rows are not the router's tokens"
            return replace(
                base,
                metrics=metrics,
                token_dim=dim,
                per_token=per_token,
                after_flip=AfterFlip(router=self._first_router(), tokens=0, error=None, why=why),
            )
        return replace(base, metrics=metrics, token_dim=dim, per_token=per_token)

    def _sequence_length(self, tokens: int) -> int | None:
        """How long each sequence of the router's ``tokens`` is: from a ``[batch, seq, hidden]``
        tensor of the unit whose batch x seq is that count (one length, or none known)."""
        if self._one_sequence:  # a sequence pair's rows: one sequence, in position order
            return tokens
        lengths = {s for b, s in self._sequences if b * s == tokens}
        return lengths.pop() if len(lengths) == 1 else None

    def _after_flip(
        self,
        base: Measured,
        flip: Flip,
        stored: tuple[Stored, Stored],
        metrics: TensorMetrics,
        dim: int | None,
        per_token: tuple[float, ...] | None,
    ) -> Measured:
        """A tensor downstream of a near-tie flip in this pass, whose rows are the router's tokens:
        judged on the tokens that kept their experts (the flipped ones carry another expert's
        answer from there on), its whole error joining the level as the block's does."""
        kept_a, kept_b = kept_rows(stored[0], flip), kept_rows(stored[1], flip)
        assert kept_a is not None and kept_b is not None  # downstream_of checked the rows
        result = _on_kept_tokens(base, flip, (kept_a, kept_b), metrics, token_dim=dim, per_token=per_token)
        return self._with_unaffected(result, flip, stored)

    def _with_unaffected(self, result: Measured, flip: Flip, stored: tuple[Stored, Stored]) -> Measured:
        """``result`` with its :class:`~tracedump.compare.results.AfterFlip`: the error on the tokens
        ``flip``'s
        consequence provably did not reach (none, when that cannot be shown)."""
        keep, why = unaffected_tokens(flip, self._sequence_length(flip.tokens), self._causal)
        error = None
        if keep is not None and keep.any():
            clean_a, clean_b = kept_rows(stored[0], flip, keep), kept_rows(stored[1], flip, keep)
            assert clean_a is not None and clean_b is not None
            error = compare_arrays(clean_a, clean_b).rel_diff
        tokens = int(keep.sum()) if keep is not None else 0
        if keep is not None and not tokens:
            why = "causal attention, but a flipped token at the start of every sequence"
        after = AfterFlip(router=self._first_router(), tokens=tokens, error=error, why=why)
        return replace(result, after_flip=after)

    def _first_router(self) -> str:
        """The router of the pass's first near-tie flip: where the flip's consequence starts."""
        return next(f.router for f in self._unit_flips if f.near_tie and f.flipped)

    def _affected(self, tokens: int) -> frozenset[int]:
        """The router's tokens that may carry an earlier near-tie flip's consequence by now: the
        flipped ones, and every one not provably unaffected (:func:`.routing.unaffected_tokens`)."""
        flipped = flipped_before(self._unit_flips, tokens)
        if not flipped:
            return flipped
        flip = next(f for f in self._unit_flips if f.tokens == tokens and f.near_tie)
        keep, _ = unaffected_tokens(
            replace(flip, flipped=tuple(sorted(flipped))), self._sequence_length(tokens), self._causal
        )
        if keep is None:
            return frozenset(range(tokens))
        return flipped | frozenset(int(t) for t in range(tokens) if not keep[t])

    def _unit_tokens(self, shape: tuple[int, ...]) -> int | None:
        """The unit's token count: the second-to-last dim of its first measured float tensor of 2
        or 3 dims (``[tokens, hidden]``, ``[batch, seq, hidden]``), or this tensor's when none was
        measured before it. Integer tensors (input ids, positions: ``[batch, seq]``, the root's
        first input with ``INPUTS=1``) have no hidden dim, so they never set it. Units whose
        tensors are images (4-D and up) get none: their dims are channels and pixels, not tokens."""
        if self._tokens is not None:
            return self._tokens
        return shape[-2] if 2 <= len(shape) <= 3 else None

    def _token_dim(self, shape: tuple[int, ...], shape_b: tuple[int, ...]) -> int | None:
        """The dim whose size is the unit's token count (:meth:`_unit_tokens`), if any."""
        if not self.per_token:
            return None
        tokens = self._unit_tokens(shape)
        if not tokens or tokens < 2 or shape_b != shape or len(shape) < 2:
            return None
        return token_dim(shape, tokens, len(shape))  # no preferred dim: the first of that size

    def _router_flip(
        self,
        base: Measured,
        pair: PairPlan,
        indices: tuple[Stored, Stored],
        metrics: TensorMetrics,
        views_a: list[PassView],
        views_b: list[PassView],
    ) -> Measured | None:
        shape = indices[0].shape if pair.rows is not None else pair.a.meta.shape  # gathered rows: theirs
        if not is_router_indices(shape, pair.a.meta.dtype, pair.b.meta.dtype):
            return None
        if Key.parse(pair.a.name).input:  # a module's input indices (INPUTS=1) are no router's output
            return None
        router = module_of(pair.a.name)
        tokens, k = indices[0].shape
        scores = self._router_scores(router, pair, tokens, k, views_a, views_b)
        flip = detect(router, indices, scores, self._affected(tokens))
        if flip is None:
            return None
        self.flips.append(flip)
        if flip.near_tie:  # not a divergence: the block's tensors are compared on the kept tokens
            self._unit_flips.append(flip)
        found = Evidence(
            router=RouterFlip(near_tie=flip.near_tie, flipped=len(flip.flipped)), note=flip.message()
        )
        return _found(replace(base, metrics=metrics), found)

    def _router_scores(
        self,
        router: str,
        pair: PairPlan,
        tokens: int,
        k: int,
        views_a: list[PassView],
        views_b: list[PassView],
    ) -> tuple[Stored, Stored] | None:
        """The router's float ``[tokens, experts]`` output beside its indices, on both sides (not its
        ``[tokens, k]`` top-k weights: the margin needs the experts that were not chosen)."""
        for name, sibling in self._by_name.items():
            if name == pair.a.name or module_of(name) != router or sibling.kind != "tensor":
                continue
            if Key.parse(name).input:  # INPUTS=1: the router's own input is no score
                continue
            if sibling.a.meta.dtype is None or not sibling.a.meta.dtype.startswith(("float", "bfloat")):
                continue
            if sibling.rows is not None:  # a sequence's rows: their shape is known once gathered
                (a, _, _), (b, _, _) = self.workspace.gather(sibling)
                if (
                    a is not None
                    and b is not None
                    and a.shape == b.shape
                    and _scores_shape(a.shape, tokens, k)
                ):
                    return a, b
                continue
            if _scores_shape(sibling.a.meta.shape, tokens, k):
                return assemble(sibling.a, views_a), assemble(sibling.b, views_b)
        return None

    def _inside_flipped_block(
        self, base: Measured, flip: Flip, stored: tuple[Stored, Stored], metrics: TensorMetrics
    ) -> Measured:
        """A tensor of a MoE block whose router flipped at a near-tie: compared on the kept tokens."""
        kept_a, kept_b = kept_rows(stored[0], flip), kept_rows(stored[1], flip)
        if kept_a is None or kept_b is None:
            why = f"not compared: {flip.router} routed {len(flip.flipped)} tokens differently"
            return _found(replace(base, metrics=metrics), Evidence(flipped_block=True, note=why))
        return _on_kept_tokens(base, flip, (kept_a, kept_b), metrics)

    def _stats_pair(
        self, base: Measured, pair: PairPlan, views_a: list[PassView], views_b: list[PassView]
    ) -> Measured:
        stats_b_raw = _stats_or_none(pair.b, views_b)
        stats_a_raw = _stats_or_none(pair.a, views_a)
        recorded = [stats for stats in (stats_a_raw, stats_b_raw) if stats is not None]
        names = [name for name in recorded[0] if all(name in stats for stats in recorded)]
        if not names:
            why = _no_common_stats(stats_a_raw, stats_b_raw)
            return _found(base, Evidence(failure=why, note=why))
        stats_a = stats_a_raw if stats_a_raw is not None else stats_of(assemble(pair.a, views_a), names)
        stats_b = stats_b_raw if stats_b_raw is not None else stats_of(assemble(pair.b, views_b), names)
        numel = _numel(pair.b.meta.shape) or _numel(pair.a.meta.shape)
        error, deltas = compare_stats(stats_a, stats_b, numel, pair.tolerance.atol)  # fixed rule
        worst = max(deltas, key=lambda n: deltas[n].rel_err) if deltas else None
        words = f"{worst}: {deltas[worst].a:.6g} vs {deltas[worst].b:.6g}" if worst else None
        return _found(replace(base, stats=deltas), Evidence(stats=StatsFound(error=error, worst=words)))


def _scores_shape(shape: tuple[int, ...] | None, tokens: int, k: int) -> bool:
    """Whether ``shape`` is a router's ``[tokens, experts]`` scores for ``k`` chosen experts."""
    return shape is not None and len(shape) >= 2 and math.prod(shape[:-1]) == tokens and shape[-1] > k


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
        error, threshold, ok = fixed_rule(metrics, tolerance)
        if not ok:
            return (
                f"rank {view.rank} differs from rank {views[0].rank} ({tolerance.metric} {error:.3g} > "
                f"{threshold:.3g}); replicated tensors must agree across ranks (or add an --unshard rule)"
            )
    return None


def pair_bytes(pair: PairPlan) -> int:
    """Bytes a pair reads (for the progress bar): element counts times each dtype's width (4 where
    the dtype is not known, as for a derived entry)."""
    return sum((_numel(e.meta.shape) or 0) * _element_bytes(e.meta.dtype) for e in (pair.a, pair.b))


def _element_bytes(dtype: str | None) -> int:
    known = BY_NAME.get(dtype or "")
    return known.bytes if known is not None and known.bytes is not None else 4


def _on_kept_tokens(
    base: Measured,
    flip: Flip,
    kept: tuple[Any, Any],
    metrics: TensorMetrics,
    token_dim: int | None = None,
    per_token: tuple[float, ...] | None = None,
) -> Measured:
    """A tensor measured on the tokens ``flip``'s router routed alike: that error is the one to
    judge, the whole tensor's (``metrics``) the flip's effect, which joins the level."""
    on_kept = compare_arrays(*kept)
    found = Evidence(
        kept=KeptTokens(error=on_kept.rel_diff, whole=metrics.rel_diff),
        note=f"compared on the {kept[0].shape[0]} tokens {flip.router} routed alike",
    )
    return _found(replace(base, metrics=metrics, token_dim=token_dim, per_token=per_token), found)


def _found(measured: Measured, evidence: Evidence) -> Measured:
    return replace(measured, evidence=evidence)


def _planned(index: int, pass_a: int, pass_b: int | None, root: str | None, pair: PairPlan) -> Measured:
    """The pair as planned, before anything is read: its names, shapes, dtypes and tolerance, which
    reading it then completes (``dataclasses.replace``)."""
    return Measured(
        index=index,
        pass_index=pass_a,
        pass_b=pass_b,
        root=root,
        name=pair.a.name,
        name_b=pair.b.name,
        kind="stats" if pair.tolerance.metric == "stats" else "tensor",
        shape_a=pair.a.meta.shape,
        shape_b=pair.b.meta.shape,
        dtype_a=pair.a.meta.dtype,
        dtype_b=pair.b.meta.dtype,
        tolerance=pair.tolerance,
        metric=pair.tolerance.metric,
        unshard_a=pair.a.how,
        unshard_b=pair.b.how,
        bridge=pair.bridge,
        paired_by=pair.paired_by,
        pairing=pair.pairing,
        positions=pair.rows.positions if pair.rows is not None else None,
    )
