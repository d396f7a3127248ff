"""Plan stage: decide every comparison from metadata alone, before any tensor byte is read.

Two planners make the one kind of :class:`Plan`: :func:`build_plan` here pairs passes (``--align
passes``), :func:`.align.plan_tokens` pairs sequences (``--align tokens``: a unit is a sequence
pair, and each pair's :class:`Rows` say which positions to gather over A's and B's steps). The one
executor (:mod:`..measure.execute`) measures either, and the one verdict judges it.

Alignment is by (pass, name including ``::callN``) in A's capture order; A's names go through
``--map`` first. Roots pair by their manifest "root" label (a side with a single root pairs with the
other side's single root whatever the labels). Shapes are compared after squeezing size-1 dims, so a
``[7, 32]`` engine tensor lines up with HF's ``[1, 7, 32]``. Against a ``last_row`` dump, each tensor
of the full side is cut to its last row along the dim that makes the shapes agree (:func:`cut_to_last_row`).

The result is a frozen :class:`Plan`; the open :class:`PassView`\\ s it refers to live beside it in
:class:`Workspace`, which the executor reads and then closes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ...errors import UsageError
from ...store.format import last_row_dim
from ..judge.tolerance import Tolerance, is_integer, pair_precision, resolve, resolve_stats
from ..load.reader import Stored
from ..load.sources import PassView, RootGroup, Side
from ..options import DiffOptions
from .bridge import matcher_for
from .expr import BridgedPair, Expr, size_splits
from .kinds import PairKind
from .matcher import PLAIN_REASONS, Matcher, known_different
from .ops_align import EXTRA_OP, ExtraOp, OpAlignment, align_ops, split_ops
from .rank_joins import joins_contradicted
from .unshard import SideEntry, plan_entry


@dataclass(frozen=True)
class Unit:
    """One pass of one root pair (or, under ``--align tokens``, one sequence pair: ``pass_a`` and
    ``pass_b`` are the steps that hold its first compared position): the comparisons inside it
    share their open files and one running error level."""

    root: str | None
    pass_a: int
    pass_b: int
    causal: bool | None = None  # both runs' attentions declared causal (the manifests' "attention")
    sequence: str | None = None  # --align tokens: "seq 0", or "seq 0 (B: 3)" when B names it otherwise


@dataclass(frozen=True, kw_only=True)
class Rows:
    """``--align tokens``: what a pair gathers, the rows of each side's expression at
    ``positions`` of its unit's sequences, and A's step that computed each row."""

    a: Expr
    b: Expr
    positions: tuple[int, ...]
    steps: tuple[int, ...]


# a side's gathered rows, their dtype as shown, or why they cannot be gathered
Gathered = tuple[Stored | None, str | None, str | None]


@dataclass(frozen=True, kw_only=True)
class PairPlan:
    """One comparison to make. ``kind`` says how: values, statistics, or not at all (and why)."""

    unit: int
    a: SideEntry
    b: SideEntry
    kind: PairKind
    tolerance: Tolerance
    message: str | None = None
    bridge: str | None = None  # how the bridge made this pair (compare/pair/bridge.py), None: by name
    rows: Rows | None = None  # --align tokens: the rows to gather (None: the entries of one pass)
    paired_by: str | None = None  # what proves the pair (bridge.PAIRED_BY); None: an op pair (OPS)
    pairing: str | None = None  # what the pairing saw beside it: two classes, a weights finding


@dataclass(frozen=True, kw_only=True)
class Unmatched:
    """A name present on one side only (for A, with the name ``--map`` made of it, when it differs)."""

    pass_index: int
    root: str | None
    name: str
    mapped: str | None = None
    reason: str = ""  # why it has no counterpart ("" for the plain case: no such name on the other side)
    sequence: str | None = None  # --align tokens: the sequence pair it was looked for in

    def to_json(self) -> dict[str, object]:
        data: dict[str, object] = {"pass": self.pass_index, "name": self.name}
        if self.root is not None:
            data["root"] = self.root
        if self.sequence is not None:
            data["sequence"] = self.sequence
        if self.mapped is not None and self.mapped != self.name:
            data["mapped"] = self.mapped
        if self.reason:
            data["reason"] = self.reason
        return data


@dataclass(frozen=True, kw_only=True)
class Plan:
    units: tuple[Unit, ...]
    pairs: tuple[PairPlan, ...]
    only_in_a: tuple[Unmatched, ...]
    only_in_b: tuple[Unmatched, ...]
    passes_only_in_a: tuple[int, ...]
    passes_only_in_b: tuple[int, ...]
    roots_only_in_a: tuple[str, ...] = ()
    roots_only_in_b: tuple[str, ...] = ()


@dataclass
class Workspace:
    """The open pass views of every unit, per side (a list: one view per rank)."""

    views: list[tuple[list[PassView], list[PassView]]] = field(default_factory=list)

    def close_unit(self, unit: int) -> None:
        for view in (*self.views[unit][0], *self.views[unit][1]):
            view.close()

    def close(self) -> None:
        for unit in range(len(self.views)):
            self.close_unit(unit)

    def gather(self, pair: PairPlan) -> tuple[Gathered, Gathered]:
        """A pair's rows of a sequence on each side (``--align tokens`` only)."""
        raise TypeError("a plan of passes gathers no rows")


def squeeze(shape: tuple[int, ...] | None) -> tuple[int, ...] | None:
    return None if shape is None else tuple(s for s in shape if s != 1)


def pair_roots(a: Side, b: Side) -> tuple[list[tuple[RootGroup, RootGroup]], list[str], list[str]]:
    """Root groups of A and B that belong together, and the labels found on one side only."""
    if len(a.groups) == 1 and len(b.groups) == 1:
        return [(a.groups[0], b.groups[0])], [], []
    b_by_label = {g.label: g for g in b.groups}
    pairs = [(g, b_by_label[g.label]) for g in a.groups if g.label in b_by_label]
    a_labels = {g.label for g in a.groups}
    only_a = [g.label for g in a.groups if g.label not in b_by_label]
    only_b = [g.label for g in b.groups if g.label not in a_labels]
    if not pairs:
        raise UsageError(
            f"no root in common: A has {sorted(a_labels)}, B has {sorted(b_by_label)} "
            "(pass one run dir per side to compare runs of different roots)"
        )
    return pairs, only_a, only_b


def pair_passes(
    a: RootGroup, b: RootGroup, options: DiffOptions
) -> tuple[list[tuple[int, int]], list[int], list[int]]:
    """(pass of A, pass of B) to compare, and the passes present on one side only.

    A pass file given on the command line is one pass: against another pass file it pairs whatever
    the indices; against a dump it pairs with that dump's pass of the same index (or ``--pass N``).
    """
    passes_a, passes_b = a.pass_indices(), b.pass_indices()
    if a.is_pass_file and b.is_pass_file:
        return [(passes_a[0], passes_b[0])], [], []
    if a.is_pass_file or b.is_pass_file:
        fixed, other, fixed_is_a = (
            (passes_a[0], passes_b, True) if a.is_pass_file else (passes_b[0], passes_a, False)
        )
        wanted = fixed if fixed >= 0 or len(other) != 1 else other[0]
        if options.passes:
            wanted = options.passes.ranges[0][0]  # the first pass asked for
        if wanted not in other:
            side = "B" if fixed_is_a else "A"
            raise UsageError(
                f"pass {wanted} is not in {side} (passes: {short_list(other)}); choose one with --pass"
            )
        return ([(fixed, wanted)] if fixed_is_a else [(wanted, fixed)]), [], []
    common = sorted(set(passes_a) & set(passes_b))
    only_a = sorted(set(passes_a) - set(passes_b))
    only_b = sorted(set(passes_b) - set(passes_a))
    if options.passes is not None:
        absent = options.passes.missing(common)  # ranges stay ranges: never expanded
        if absent:
            raise UsageError(
                f"--pass {absent}: not in both dumps (A: {short_list(passes_a)}; B: {short_list(passes_b)})"
            )
        return [(p, p) for p in options.passes.pick(common)], [], []
    return [(p, p) for p in common], only_a, only_b


def short_list(indices: list[int] | tuple[int, ...]) -> str:
    """Pass indices for a message: ``0-7`` for a run, else up to 20 of them."""
    indices = list(indices)
    if not indices:
        return "none"
    if indices == list(range(indices[0], indices[-1] + 1)) and len(indices) > 2:
        return f"{indices[0]}-{indices[-1]}"
    return ",".join(map(str, indices[:20])) + (" ..." if len(indices) > 20 else "")


def _cut_shape(shape: tuple[int, ...], dim: int | None) -> tuple[int, ...]:
    return shape if dim is None else (*shape[:dim], 1, *shape[dim + 1 :])


def cut_to_last_row(full: SideEntry, kept: SideEntry, token_dim: int) -> SideEntry:
    """``full`` cut to its last row so it lines up with ``kept``, from a ``last_row`` dump.

    The two models may put tokens on different dims (an engine's ``[tokens, hidden]`` with
    TOKEN_DIM=0 against HF's ``[1, seq, hidden]``), so the dim is chosen per pair: none when the
    shapes already agree (records are stored whole), else the first of the last_row side's
    TOKEN_DIM, 1, 0 whose cut gives ``kept``'s shape (after squeezing size-1 dims). When none does,
    the cut at TOKEN_DIM stands and the shapes are reported as a mismatch.
    """
    shape, target = full.meta.shape, squeeze(kept.meta.shape)
    if full.meta.kind != "tensor" or shape is None or squeeze(shape) == target:
        return full
    dims = [last_row_dim(shape, d) for d in dict.fromkeys((token_dim, 1, 0))]
    dim = next((d for d in dims if squeeze(_cut_shape(shape, d)) == target), dims[0])
    if dim is None:
        return full
    return replace(full, meta=replace(full.meta, shape=_cut_shape(shape, dim)), cut=dim)


def _apply_cut(
    a: SideEntry, b: SideEntry, group_a: RootGroup, group_b: RootGroup
) -> tuple[SideEntry, SideEntry]:
    """A full side paired with a ``last_row`` side: its tensors cut as the dumper would have."""
    if group_a.mode == "last_row" and group_b.mode == "full":
        return a, cut_to_last_row(b, a, group_a.token_dim)
    if group_b.mode == "last_row" and group_a.mode == "full":
        return cut_to_last_row(a, b, group_b.token_dim), b
    return a, b


def side_entries(views: list[PassView], options: DiffOptions) -> dict[str, SideEntry]:
    """Entries of one side for one pass, in rank 0's capture order, unsharded when several ranks
    (one rank: only a recorded row order is put back, :func:`.unshard.plan_entry`)."""
    order = dict.fromkeys(name for view in views for name in view.entries)
    return {name: plan_entry(name, views, options.unshard_rule(name)) for name in order}


def pair_tolerance(
    options: DiffOptions,
    names: tuple[str, str],
    dtypes: tuple[str | None, str | None],
    precisions: tuple[str | None, str | None],
    stats: bool = False,
) -> Tolerance:
    """The tolerance of one pair: the user's rules for its names, else the defaults of its run
    precision; ``mixed`` when the two runs computed at different precisions."""
    rtol, atol = options.tolerances_for(*names)
    precision = pair_precision(*precisions, *dtypes)
    if stats:
        tolerance = resolve_stats(*dtypes, rtol, atol, precision)
    else:
        tolerance = resolve(options.metric, *dtypes, rtol, atol, precision)
    if None not in precisions and precisions[0] != precisions[1]:
        tolerance = replace(tolerance, mixed=True)
    return tolerance


def _pair(
    unit: int,
    a: SideEntry,
    b: SideEntry,
    options: DiffOptions,
    precisions: tuple[str | None, str | None],
) -> PairPlan:
    stats = a.meta.kind == "stats" or b.meta.kind == "stats"
    tolerance = pair_tolerance(options, (a.name, b.name), (a.meta.dtype, b.meta.dtype), precisions, stats)
    for side, entry in (("A", a), ("B", b)):
        if entry.problem is not None:
            return PairPlan(
                unit=unit,
                a=a,
                b=b,
                kind=entry.problem_status or PairKind.ERROR,
                tolerance=tolerance,
                message=f"{side}: {entry.problem}",
            )
    shape_a, shape_b = squeeze(a.meta.shape), squeeze(b.meta.shape)
    if shape_a is not None and shape_b is not None and shape_a != shape_b:
        message = f"shapes {list(a.meta.shape or ())} vs {list(b.meta.shape or ())}"
        kind = PairKind.SHAPE_MISMATCH
        return PairPlan(unit=unit, a=a, b=b, kind=kind, tolerance=tolerance, message=message)
    kind = PairKind.STATS if tolerance.metric == "stats" else PairKind.TENSOR
    return PairPlan(unit=unit, a=a, b=b, kind=kind, tolerance=tolerance)


def bridged_pairs(
    matcher: Matcher,
    entries_a: dict[str, SideEntry],
    entries_b: dict[str, SideEntry],
    options: DiffOptions,
    pass_index: int,
    root: str | None,
) -> tuple[list[tuple[BridgedPair, SideEntry, SideEntry]], list[Unmatched], list[Unmatched]]:
    """The pairs of one pass (by the bridge, then by name) with their entries, and the names left
    on each side with the reason."""
    matched = matcher.match(entries_a, entries_b, options)
    pairs = []
    for pair in size_splits(matched.pairs, entries_a, entries_b):
        entry_a, entry_b = pair.a.entry(entries_a), pair.b.entry(entries_b)
        assert entry_a is not None and entry_b is not None  # the matcher only pairs names it has
        pairs.append((pair, entry_a, entry_b))
    only = {
        side: [
            Unmatched(
                pass_index=pass_index,
                root=root,
                name=u.name,
                mapped=u.mapped,
                reason="" if u.reason in PLAIN_REASONS else u.reason,
            )
            for u in matched.leftovers
            if u.side == side
        ]
        for side in ("A", "B")
    }
    return pairs, only["A"], only["B"]


def not_comparable(planned: PairPlan, message: str) -> PairPlan:
    """The pair listed, never read: its two sides are known to compute different quantities (or
    one wrote nothing), ``message`` says which."""
    return replace(planned, kind=PairKind.NOT_COMPARABLE, message=message)


def not_comparable_message(pair: BridgedPair) -> str:
    assert pair.classes is not None
    why = known_different(*pair.classes) or "they compute different quantities"
    return f"A {pair.classes[0]} vs B {pair.classes[1]}: {why}, and no bridge rule relates them"


def provenance(
    pair: BridgedPair, entries: tuple[SideEntry, SideEntry], options: DiffOptions, matcher: Matcher
) -> dict[str, str | None]:
    """The fields of a planned pair that say how the bridge paired it and on what evidence, with
    what the ranks' load records say against a hand ``--unshard`` rule that joined its entries."""
    notes = [pair.note, *joins_contradicted(entries, options, matcher.unshard)]
    return {
        "bridge": pair.describe(),
        "paired_by": pair.paired_by,
        "pairing": "; ".join(filter(None, notes)) or None,
    }


def build_plan(
    a: Side, b: Side, options: DiffOptions, matcher: Matcher | None = None
) -> tuple[Plan, Workspace]:
    """Everything to compare, in execution order: pass by pass, roots in A's order inside a pass."""
    matcher = matcher if matcher is not None else matcher_for(options, a, b)
    root_pairs, roots_only_a, roots_only_b = pair_roots(a, b)
    labelled = len(root_pairs) > 1
    schedule: list[tuple[int, int, int, RootGroup, RootGroup]] = []
    passes_only_a: set[int] = set()
    passes_only_b: set[int] = set()
    for order, (group_a, group_b) in enumerate(root_pairs):
        passes, only_a, only_b = pair_passes(group_a, group_b, options)
        passes_only_a.update(only_a)
        passes_only_b.update(only_b)
        schedule.extend((pa, order, pb, group_a, group_b) for pa, pb in passes)
    schedule.sort(key=lambda item: (item[0], item[1]))
    units: list[Unit] = []
    pairs: list[PairPlan] = []
    only_in_a: list[Unmatched] = []
    only_in_b: list[Unmatched] = []
    workspace = Workspace()
    for pass_a, _, pass_b, group_a, group_b in schedule:
        root = group_a.label if labelled else None
        views_a = [run.open_pass(pass_a) for run in group_a.runs]
        views_b = [run.open_pass(pass_b) for run in group_b.runs]
        unit = len(units)
        units.append(Unit(root, pass_a, pass_b, causal=causal_attention(group_a, group_b)))
        workspace.views.append((views_a, views_b))
        precisions = (
            run_precision(views_a, group_a.declared_precision),
            run_precision(views_b, group_b.declared_precision),
        )
        entries_a, entries_b = side_entries(views_a, options), side_entries(views_b, options)
        (ops_a, rest_a), (ops_b, rest_b) = split_ops(entries_a), split_ops(entries_b)
        found, unmatched_a, unmatched_b = bridged_pairs(matcher, rest_a, rest_b, options, pass_a, root)
        unit_pairs: list[PairPlan] = []
        for bridged, entry_a, entry_b in found:
            entry_a, entry_b = _apply_cut(entry_a, entry_b, group_a, group_b)
            evidence = provenance(bridged, (entry_a, entry_b), options, matcher)
            planned = replace(_pair(unit, entry_a, entry_b, options, precisions), **evidence)
            if bridged.classes is not None:
                planned = not_comparable(planned, not_comparable_message(bridged))
            unit_pairs.append(planned)
        if ops_a or ops_b:  # OPS: the ops inside tapped modules, aligned by name (compare/pair/ops_align.py)
            alignment = align_ops(ops_a, ops_b, options)
            unit_pairs = _with_ops(unit, unit_pairs, alignment, list(entries_a), options, precisions)
            unmatched_a.extend(_op_leftovers(alignment.only_a, pass_a, root))
            unmatched_b.extend(_op_leftovers(alignment.only_b, pass_a, root))
        pairs.extend(unit_pairs)
        only_in_a.extend(unmatched_a)
        only_in_b.extend(unmatched_b)
    plan = Plan(
        units=tuple(units),
        pairs=tuple(pairs),
        only_in_a=tuple(only_in_a),
        only_in_b=tuple(only_in_b),
        passes_only_in_a=tuple(sorted(passes_only_a)),
        passes_only_in_b=tuple(sorted(passes_only_b)),
        roots_only_in_a=tuple(roots_only_a),
        roots_only_in_b=tuple(roots_only_b),
    )
    return plan, workspace


def causal_attention(*groups: RootGroup) -> bool | None:
    """Whether every run of ``groups`` declared every attention causal (the manifest's
    ``attention``, written at ``attach()``): False when one declared otherwise, None when one did
    not say (older dumps, lone pass files, a model whose attention declares nothing)."""
    flags = []
    for group in groups:
        for run in group.runs:
            attention = run.facts.get("attention")
            flags.append(attention.get("causal") if isinstance(attention, dict) else None)
    if any(flag is False for flag in flags):
        return False
    return True if flags and all(flag is True for flag in flags) else None


def _with_ops(
    unit: int,
    pairs: list[PairPlan],
    alignment: OpAlignment,
    order_a: list[str],
    options: DiffOptions,
    precisions: tuple[str | None, str | None],
) -> list[PairPlan]:
    """The unit's pairs with its op pairs and extra ops merged in, in A's capture order: an op
    only B ran takes the place right after the A op it follows in B's sequence."""
    position = {name: float(i) for i, name in enumerate(order_a)}
    placed: list[tuple[float, int, PairPlan]] = []
    at = -1.0
    for planned in pairs:  # the bridge's pairs keep their order; a derived name takes its neighbour's place
        at = position.get(planned.a.name, at)
        placed.append((at, len(placed), planned))
    for entry_a, entry_b in alignment.pairs:
        planned = _pair(unit, entry_a, entry_b, options, precisions)
        if entry_a.name in alignment.unwritten:  # an allocation op's output: nothing it wrote
            planned = not_comparable(planned, alignment.unwritten[entry_a.name])
        placed.append((position[entry_a.name], len(placed), planned))
    for extra in alignment.extras:
        if extra.side == "A":
            at = position[extra.entry.name]
        else:
            after = extra.after
            at = position[after] + 0.5 if after is not None else _first_of(extra, position, order_a)
        tolerance = pair_tolerance(
            options, (extra.entry.name,) * 2, (extra.entry.meta.dtype,) * 2, precisions
        )
        planned = PairPlan(
            unit=unit, a=extra.entry, b=extra.entry, kind=EXTRA_OP, tolerance=tolerance, message=extra.message
        )
        placed.append((at, len(placed), planned))
    return [planned for _, _, planned in sorted(placed, key=lambda item: (item[0], item[1]))]


def _first_of(extra: ExtraOp, position: dict[str, float], order_a: list[str]) -> float:
    """Where an op only B ran, first of its module call, goes: just before A's first op of it."""
    prefix = f"{extra.module}/"
    first = next((position[name] for name in order_a if name.startswith(prefix)), None)
    return first - 0.5 if first is not None else float(len(order_a))


def _op_leftovers(names: list[str], pass_index: int, root: str | None) -> list[Unmatched]:
    reason = "ops of this module call dumped by one run only (OPS)"
    return [Unmatched(pass_index=pass_index, root=root, name=name, reason=reason) for name in names]


def run_precision(views: list[PassView], declared: str | None) -> str | None:
    """The precision a run computed this pass in: the least precise of what its manifest declares
    (parameter dtypes, TF32 matmuls) and every float dtype it stored (autocast shows there). A stats
    record's dtype may be a guess from its max/min, so stats count only when nothing else is known."""
    stored = _float_dtypes(views, "tensor")
    if declared is None and not stored:
        stored = _float_dtypes(views, "stats")
    if declared is None and not stored:
        return None
    return pair_precision(declared, *stored)


def _float_dtypes(views: list[PassView], kind: str) -> set[str]:
    return {
        entry.dtype
        for view in views
        for entry in view.entries.values()
        if entry.kind == kind and entry.dtype is not None and not is_integer(entry.dtype)
    }
