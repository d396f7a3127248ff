"""``tracedump diff A B --align tokens``: compare sequences, not passes (the token planner).

:func:`plan_tokens` makes the same kind of :class:`.plan.Plan` as the pass planner: a unit per
sequence pair, each tensor pair's :class:`.plan.Rows` naming the positions to gather; the one
executor gathers and measures them (routing flips included), :func:`baseline_plan` gives
``--baseline`` the same rows of C, and the one verdict judges them.

A batching engine's step holds rows of several requests; the reference runs one request per
forward (or ``generate()``, one pass per token). Here every tensor's rows of one sequence are
gathered over all of a side's passes in position order (:mod:`tracedump.store.sequences` says which pass
and row hold each position), on both sides, and the rows of the positions both sides hold are
compared, name by name, with the same metrics and verdict as a pass-by-pass diff. Each compared
row remembers the step (A's pass) it came from, so the first divergence reads as "sequence 2,
position 17, step 5, ``model.layers.3.self_attn.o_proj``": the earliest step in which a row
diverged, and the first module in that step's capture order.

Sequences pair by seq id when both sides name them (``set_batch``) and share ids, else by their
tokens (agreeing at every prompt position, longest shared prefix first: parallel-sampling children
pair once, never by order), else in order of first appearance; the report says which. Tensors
without a token dim, or whose rows have another shape on the other side, are reported, never
guessed.

Causes before consequences: each pair is compared only before the first position where the two
sides fed different tokens. At a prompt position that is an input difference (no module named); at
a generated position, a consequence (``output_changed``), said after the first divergence before
it. A later step that computes positions again (preemption with recompute) replaces them; a pass
cut short by an exception is not compared from its first row on; ``--pass`` picks A's steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ...errors import UsageError
from ...store.sequences import Batch, RowCut, SeqId, Sequence, sequence_rows
from ..judge.coverage import CoverageCount
from ..load.reader import GatheredRows
from ..load.sources import RootGroup, Side
from ..options import DiffOptions
from ..results import DiffReport, Findings
from .expr import Expr
from .inputs import sequence_finding
from .kinds import PairKind
from .matcher import Matcher
from .plan import (
    Gathered,
    PairPlan,
    Plan,
    Rows,
    Unit,
    Unmatched,
    Workspace,
    bridged_pairs,
    causal_attention,
    not_comparable,
    not_comparable_message,
    pair_roots,
    pair_tolerance,
    provenance,
    run_precision,
)
from .sequence_pairing import (
    Alignment,
    SideSequences,
    check_passes,
    cut_truncated,
    pair_notes,
    pair_sequences,
    read_side,
    recompute_notes,
)
from .unshard import SideEntry, assemble


def _last_in_pass(batch: Batch, seq_id: SeqId) -> int:
    """The last position of a sequence a pass computed: where its logits were sampled (a later
    recomputation may have replaced that row in the sequence, never the logits' position)."""
    return max(p for s, p in zip(batch.seq_ids, batch.positions, strict=True) if s == seq_id)


def _held(
    side: SideSequences, sequence: Sequence, expr: Expr, positions: list[int], options: DiffOptions
) -> set[int]:
    """The positions an expression has a row for: all of them, or, for a tensor with one row per
    sequence (logits), each pass's last position of the sequence."""
    held: set[int] = set()
    for index, at in sequence.positions_by_pass(positions).items():
        entry = expr.entry(side.view(index, options)[1])
        shape = () if entry is None else entry.meta.shape or ()
        layout = None if entry is None else side.batches[index].layout(shape, side.group.token_dim)
        if layout is not None and layout[0] == "sampled":
            last = _last_in_pass(side.batches[index], sequence.seq_id)
            held.update(p for p in at if p == last)
        else:
            held.update(at)
    return held


def _rows(
    side: SideSequences, sequence: Sequence, expr: Expr, positions: list[int], options: DiffOptions
) -> Gathered:
    """The rows of ``expr`` at ``positions`` (token dim first, size-1 dims dropped), its dtype, or
    why they cannot be gathered (:func:`~tracedump.store.sequences.sequence_rows` says which)."""
    dtypes: list[tuple[str, str | None]] = []  # per pass: the values' dtype, and the one shown

    def shape_in(index: int) -> tuple[int, ...] | str:
        entry = expr.entry(side.view(index, options)[1])
        if entry is None:
            return f"not in pass {index}"
        return entry.problem if entry.problem is not None else tuple(entry.meta.shape or ())

    def take(cut: RowCut) -> np.ndarray:
        views, entries = side.view(cut.pass_index, options)
        entry = expr.entry(entries)
        assert entry is not None  # shape_in found it
        stored = assemble(entry, views)
        # a bridge's float64 sum holds float64 values, shown as its parts' dtype
        dtypes.append((stored.dtype, entry.meta.dtype if entry.op is not None else stored.dtype))
        same = cut.shape == tuple(entry.meta.shape or ())
        array = stored.array if same else stored.array.reshape(cut.shape)
        return np.moveaxis(_take_rows(array, list(cut.rows), cut.dim), cut.dim, 0)

    found = sequence_rows(
        sequence, positions, side.batches, shape_in, take, side.group.token_dim, sampled=True
    )
    if isinstance(found, str):
        return None, None, found
    kept, dtype = dtypes[-1]
    if dtype is None:
        return None, None, "no rows"
    return GatheredRows(found, kept), dtype, None


def _take_rows(array: np.ndarray, rows: list[int], dim: int) -> np.ndarray:
    """The rows along ``dim``: a view when they are one contiguous run (a sequence's rows in a step
    usually are), else a copy."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return array[(slice(None),) * dim + (slice(rows[0], rows[0] + len(rows)),)]
    return np.take(array, rows, axis=dim)


def _entries_in_order(side: SideSequences, sequence: Sequence, options: DiffOptions) -> dict[str, SideEntry]:
    """The entries of the first pass that holds the sequence, in capture order."""
    first_pass = sequence.rows[sequence.positions[0]][0]
    return side.view(first_pass, options)[1]


def plan_tokens(
    options: DiffOptions, side_a: Side, side_b: Side, matcher: Matcher
) -> tuple[Plan, SequenceWorkspace, TokenFindings]:
    """The token planner: every sequence pair of every root pair becomes one unit of a
    :class:`.plan.Plan`, each of its tensor pairs a :class:`.plan.PairPlan` whose
    :class:`.plan.Rows` say which positions (and A's steps) to gather, so that the one executor
    measures it (routing flips, per-token errors) and the one verdict judges it. Before any
    number: the sequences paired, and the tokens fed that differ (a pair is planned only before
    the first of them)."""
    root_pairs, roots_only_a, roots_only_b = pair_roots(side_a, side_b)
    labelled = len(root_pairs) > 1
    workspace = SequenceWorkspace(options=options)
    findings = TokenFindings()
    builder = _PlanBuilder(options=options, matcher=matcher, workspace=workspace, findings=findings)
    try:
        for group_a, group_b in root_pairs:
            seq_a, seq_b = read_side(side_a, group_a), read_side(side_b, group_b)
            workspace.opened += [seq_a, seq_b]
            check_passes(options, seq_a)
            root = group_a.label if labelled else None
            _plan_root_pair(builder, seq_a, seq_b, root, causal_attention(group_a, group_b))
    except BaseException:
        workspace.close()
        raise
    alignments = findings.alignments
    if not builder.pairs and not findings.inputs_differ:
        workspace.close()
        why = "no sequence is on both sides" if not any(a.pairs for a in alignments) else "no name in common"
        if options.passes is not None and any(a.pairs for a in alignments):
            why = f"no row of A's steps {options.passes} is held by both sides"
        raise UsageError(f"nothing comparable with --align tokens: {why}")
    plan = Plan(
        units=tuple(builder.units),
        pairs=tuple(builder.pairs),
        only_in_a=tuple(builder.only_a),
        only_in_b=tuple(builder.only_b),
        passes_only_in_a=(),
        passes_only_in_b=(),
        roots_only_in_a=tuple(roots_only_a),
        roots_only_in_b=tuple(roots_only_b),
    )
    return plan, workspace, findings


def _plan_root_pair(
    builder: _PlanBuilder, seq_a: SideSequences, seq_b: SideSequences, root: str | None, causal: bool | None
) -> None:
    """One root pair: its sequences paired (and what the summary must say of them), then each
    pair cut before the first token the two sides were fed differently, and planned."""
    findings = builder.findings
    notes = recompute_notes("A", seq_a) + recompute_notes("B", seq_b)
    notes += cut_truncated("A", seq_a) + cut_truncated("B", seq_b)
    matched_by, pairs, children = pair_sequences(seq_a, seq_b)
    paired_a = {a for a, _ in pairs}
    paired_b = {b for _, b in pairs}
    if children:
        notes.append(
            f"{len(children)} sequence(s) of A share their prompt with a B sequence another of "
            f"A's took (parallel sampling, n > 1): {', '.join(map(str, children[:10]))}; "
            "listed as only in A, never paired by order"
        )
    findings.alignments.append(
        Alignment(
            matched_by=matched_by,
            pairs=tuple(pairs),
            only_in_a=tuple(s for s in seq_a.sequences if s not in paired_a),
            only_in_b=tuple(s for s in seq_b.sequences if s not in paired_b),
            notes=tuple(pair_notes(seq_a, seq_b, pairs, matched_by) + notes),
        )
    )
    for name_a, name_b in pairs:
        sequence_a, sequence_b = seq_a.sequences[name_a], seq_b.sequences[name_b]
        finding = sequence_finding(name_a, name_b, sequence_a, sequence_b)
        if finding is not None:  # nothing fed a different token is compared: cut before it
            (findings.inputs_differ if finding["kind"] == "prompt" else findings.output_changed).append(
                finding
            )
            sequence_a = sequence_a.before(finding["position"])
            sequence_b = sequence_b.before(finding["position"])
            previous = sequence_a.rows.get(finding["position"] - 1)
            finding["step"] = previous[0] if previous is not None else None
        builder.plan_sequence(seq_a, seq_b, sequence_a, sequence_b, root, causal)


@dataclass(kw_only=True)
class TokenFindings:
    """What the token planner found besides the plan: how sequences paired, the tokens fed that
    differ, and the reference's coverage."""

    alignments: list[Alignment] = field(default_factory=list)
    inputs_differ: list[dict[str, Any]] = field(default_factory=list)
    output_changed: list[dict[str, Any]] = field(default_factory=list)
    coverage: CoverageCount = field(default_factory=CoverageCount)

    @staticmethod
    def steps_of(plan: Plan) -> dict[int, tuple[int, ...]]:
        """A result's index (its pair's) -> A's step of each of its rows (for ``first_in_time``)."""
        return {index: pair.rows.steps for index, pair in enumerate(plan.pairs) if pair.rows is not None}

    def finish(self, report: DiffReport, findings: Findings) -> None:
        """The alignment as the report shows it, with the first divergence in time; each changed
        output names the cause before its consequence."""
        in_time = findings.first_in_time
        alignments = list(self.alignments)
        if in_time is not None:
            alignments[0] = replace(alignments[0], first=in_time.to_json())
        for change in self.output_changed:
            change["after"] = in_time.to_json() if in_time is not None else None
        report.alignment = [a.to_json() for a in alignments]
        report.alignment_lines = [_describe(a) for a in alignments]


@dataclass(kw_only=True)
class _SequencePair:
    """One unit of a token plan: the two sides' sequences whose rows its pairs gather."""

    side_a: SideSequences
    side_b: SideSequences
    sequence_a: Sequence
    sequence_b: Sequence


@dataclass(kw_only=True)
class SequenceWorkspace(Workspace):
    """The token plan's open files: each side's passes, opened once for every sequence that
    reads them (closed at the end, not per unit), and each unit's sequences."""

    options: DiffOptions
    units: list[_SequencePair] = field(default_factory=list)
    opened: list[SideSequences] = field(default_factory=list)

    def close_unit(self, unit: int) -> None:
        """Nothing: a pass holds rows of several sequences, so it stays open until :meth:`close`."""

    def close(self) -> None:
        for side in self.opened:
            side.close()
        self.opened = []

    def gather(self, pair: PairPlan) -> tuple[Gathered, Gathered]:
        assert pair.rows is not None
        unit = self.units[pair.unit]
        positions = list(pair.rows.positions)
        return (
            _rows(unit.side_a, unit.sequence_a, pair.rows.a, positions, self.options),
            _rows(unit.side_b, unit.sequence_b, pair.rows.b, positions, self.options),
        )


@dataclass(kw_only=True)
class _PlanBuilder:
    """The units and pairs of a token plan as they are planned, sequence pair by sequence pair."""

    options: DiffOptions
    matcher: Matcher
    workspace: SequenceWorkspace
    findings: TokenFindings
    units: list[Unit] = field(default_factory=list)
    pairs: list[PairPlan] = field(default_factory=list)
    only_a: list[Unmatched] = field(default_factory=list)
    only_b: list[Unmatched] = field(default_factory=list)

    def plan_sequence(
        self,
        side_a: SideSequences,
        side_b: SideSequences,
        sequence_a: Sequence,
        sequence_b: Sequence,
        root: str | None,
        causal: bool | None,
    ) -> None:
        """One pair of sequences at the positions both hold (with ``--pass``, those A's chosen
        steps computed): one unit, each bridged tensor pair one :class:`.plan.PairPlan`."""
        options = self.options
        seq_a, seq_b = sequence_a.seq_id, sequence_b.seq_id
        positions = [
            p
            for p in sequence_a.positions
            if p in sequence_b.rows and (options.passes is None or sequence_a.rows[p][0] in options.passes)
        ]
        if not positions:
            return
        label = f"seq {seq_a}" if seq_a == seq_b else f"seq {seq_a} (B: {seq_b})"
        first_step, step_b = sequence_a.rows[positions[0]][0], sequence_b.rows[positions[0]][0]
        unit = len(self.units)
        self.units.append(Unit(root, first_step, step_b, causal=causal, sequence=label))
        self.workspace.units.append(
            _SequencePair(side_a=side_a, side_b=side_b, sequence_a=sequence_a, sequence_b=sequence_b)
        )
        self.workspace.views.append(([], []))  # rows are gathered, never read from one pass
        precisions = (
            run_precision(side_a.view(first_step, options)[0], side_a.group.declared_precision),
            run_precision(side_b.view(step_b, options)[0], side_b.group.declared_precision),
        )
        entries_a = _entries_in_order(side_a, sequence_a, options)
        entries_b = _entries_in_order(side_b, sequence_b, options)
        pairs, only_a, only_b = bridged_pairs(
            matcher=self.matcher,
            entries_a=entries_a,
            entries_b=entries_b,
            options=options,
            pass_index=first_step,
            root=root,
        )
        self.only_a += [replace(u, sequence=label) for u in only_a]
        self.only_b += [replace(u, sequence=label) for u in only_b]
        scope = str(side_b.group.label)
        coverage = self.findings.coverage
        coverage.add_step(scope, entries_b, options.selected)
        for bridged, entry_a, entry_b in pairs:
            coverage.add_pair(len(self.pairs), scope, entry_b)
            held = _held(side_a, sequence_a, bridged.a, positions, options)
            held &= _held(side_b, sequence_b, bridged.b, positions, options)
            rows_at = [p for p in positions if p in held] or positions
            names = (bridged.a.label, bridged.b.label)
            dtypes = (entry_a.meta.dtype, entry_b.meta.dtype)
            rows = Rows(
                a=bridged.a,
                b=bridged.b,
                positions=tuple(rows_at),
                steps=tuple(sequence_a.rows[p][0] for p in rows_at),
            )
            planned = PairPlan(
                unit=unit,
                a=replace(entry_a, name=names[0]),
                b=replace(entry_b, name=names[1]),
                kind=PairKind.TENSOR,
                tolerance=pair_tolerance(options, names, dtypes, precisions),
                **provenance(bridged, (entry_a, entry_b), options, self.matcher),
                rows=rows,
            )
            if bridged.classes is not None:
                planned = not_comparable(planned, not_comparable_message(bridged))
            self.pairs.append(planned)


def baseline_plan(
    plan: Plan, workspace: SequenceWorkspace, side_c: Side
) -> tuple[Plan, SequenceWorkspace, list[int]]:
    """``--baseline C`` under ``--align tokens``: C is a rerun of the reference B, so each of the
    plan's tensor pairs becomes one of C against B, B's expression read on both (C's names are
    B's), at the same positions of the sequence C's run pairs with B's (by seq id, tokens or
    order, as A's do). Returns that plan, its workspace, and each of its pairs' index in ``plan``
    (pairs C does not hold at every position are left out: judged by the error upstream)."""
    options = workspace.options
    own = SequenceWorkspace(options=options)
    groups = {g.label: g for g in side_c.groups}
    read: dict[int, tuple[SideSequences, dict[SeqId, SeqId]]] = {}  # id(B's side) -> C's, B's seq -> C's
    units: list[Unit] = []
    pairs: list[PairPlan] = []
    origin: list[int] = []
    unit_of: dict[int, int | None] = {}
    try:
        for index, pair in enumerate(plan.pairs):
            if pair.rows is None or pair.kind != "tensor":
                continue
            here = workspace.units[pair.unit]
            if id(here.side_b) not in read:
                read[id(here.side_b)] = _baseline_side(side_c, groups, here.side_b)
                own.opened += [read[id(here.side_b)][0], here.side_b]
            seq_c, by_b = read[id(here.side_b)]
            if pair.unit not in unit_of:
                unit_of[pair.unit] = _baseline_unit(plan.units[pair.unit], here, seq_c, by_b, units, own)
            unit = unit_of[pair.unit]
            if unit is None:
                continue
            sequence_c = own.units[unit].sequence_a
            if any(p not in sequence_c.rows for p in pair.rows.positions):
                continue
            entry_c = pair.rows.b.entry(_entries_in_order(seq_c, sequence_c, options))
            if entry_c is None:
                continue
            rows = replace(pair.rows, a=pair.rows.b)
            pairs.append(replace(pair, unit=unit, a=replace(entry_c, name=pair.b.name), rows=rows))
            origin.append(index)
    except BaseException:
        own.close()
        raise
    empty: tuple[Unmatched, ...] = ()
    return (
        Plan(
            units=tuple(units),
            pairs=tuple(pairs),
            only_in_a=empty,
            only_in_b=empty,
            passes_only_in_a=(),
            passes_only_in_b=(),
        ),
        own,
        origin,
    )


def _baseline_side(
    side_c: Side, groups: dict[str | None, RootGroup], seq_b: SideSequences
) -> tuple[SideSequences, dict[SeqId, SeqId]]:
    """C's sequences for B's root group, and B's seq id -> C's."""
    group_b = seq_b.group
    group_c = groups.get(group_b.label) or (side_c.groups[0] if len(side_c.groups) == 1 else None)
    if group_c is None:
        raise UsageError(f"--baseline {side_c.path}: no root {group_b.label!r} (roots: {sorted(groups)})")
    seq_c = read_side(side_c, group_c)
    _, pairs, _ = pair_sequences(seq_b, seq_c)
    return seq_c, dict(pairs)


def _baseline_unit(
    unit: Unit,
    here: _SequencePair,
    seq_c: SideSequences,
    by_b: dict[SeqId, SeqId],
    units: list[Unit],
    own: SequenceWorkspace,
) -> int | None:
    """The unit of C against B for one unit of A against B (None when C holds no such sequence)."""
    seq_id = by_b.get(here.sequence_b.seq_id)
    sequence_c = seq_c.sequences.get(seq_id) if seq_id is not None else None
    if sequence_c is None:
        return None
    units.append(replace(unit, pass_a=sequence_c.rows[sequence_c.positions[0]][0]))
    own.units.append(
        _SequencePair(side_a=seq_c, side_b=here.side_b, sequence_a=sequence_c, sequence_b=here.sequence_b)
    )
    own.views.append(([], []))
    return len(units) - 1


def _describe(alignment: Alignment) -> str:
    line = f"sequences matched by {alignment.matched_by}: {len(alignment.pairs)} pairs"
    for note in alignment.notes:
        line += f"\nnote: {note}"
    if alignment.only_in_a:
        line += f"; only in A: {', '.join(map(str, alignment.only_in_a))}"
    if alignment.only_in_b:
        line += f"; only in B: {', '.join(map(str, alignment.only_in_b))}"
    return line
