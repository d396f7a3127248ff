"""How a tensor-parallel engine's outputs are put back together from its ranks, read off every
rank's recorded load (no ``--unshard`` rule needed), and one rank's outputs whose rows its model's
``load_weights`` reordered, put back in the checkpoint's row order. A hand ``--unshard`` rule
overrides these joins, but one that joins a tensor otherwise than the record says is reported
(:func:`joins_contradicted`), never silently trusted."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Protocol

from ...store.correspondence import RAW_LOGITS, Correspondence
from ..options import DiffOptions, UnshardRule
from .engine_classes import is_kind
from .holdings import Piece, engine_holdings
from .unshard import SideEntry


def tensor_parallel_joins(
    records: list[Correspondence], classes: Mapping[str, str]
) -> tuple[UnshardRule, ...]:
    """How each of a tensor-parallel engine's outputs is put back together from its ranks, from the
    loads each rank recorded (no ``--unshard`` rule): a column-parallel output (its weight rows a
    slice of their sources) gathered along its last dim in the checkpoint's order, the attention
    op's and an ``*AndMul``'s per-rank slices concatenated by rank, the logits taken from rank 0
    (gathered there); everything else (row-parallel outputs, reduced; norms) is replicated.
    One rank: only the outputs whose rows a model's ``load_weights`` reordered (a fused
    ``query_key_value`` interleaved per head) are gathered, back in the checkpoint's row order."""
    if not records:
        return ()
    if len(records) < 2:
        return _reordered(records[0], classes)
    per_rank = [engine_holdings(r) for r in records]
    rules: list[UnshardRule] = []
    for module, pieces0 in per_rank[0].pieces.items():
        if (
            module in per_rank[0].experts
            or all(p.whole for p in pieces0)
            or is_kind("embedding", classes.get(module))
        ):
            continue  # an embedding's rows are the vocabulary, not its output: vLLM all-reduces it
        if any(load.cols is not None for load in records[0].loads if load.module == module):
            continue  # row-parallel: its output is reduced across the ranks
        order = list(dict.fromkeys(p.source for p in pieces0))
        gathered: list[tuple[int, int, int]] = []
        for source in order:
            found = sorted(
                (p.source_row, rank, p.start, p.count)
                for rank, held in enumerate(per_rank)
                for p in held.pieces.get(module, [])
                if p.source == source
            )
            gathered += [(rank, start, start + count) for _, rank, start, count in found]
        pattern = re.compile(rf"^{re.escape(module)}(\[0\])?$")
        layout = _gather_layout(order, pieces0, tuple(gathered))
        rules.append(UnshardRule(pattern, "gather", -1, tuple(gathered), recorded=layout))
    for module, qualname in classes.items():
        if is_kind("attention", qualname) or is_kind("act_and_mul", qualname):
            rules.append(UnshardRule(re.compile(rf"^{re.escape(module)}$"), "cat", -1, recorded=CAT_LAYOUT))
        elif is_kind("logits", qualname):  # the processor's output and its recorded head output
            pattern = re.compile(rf"^{re.escape(module)}({re.escape(RAW_LOGITS)})?$")
            rules.append(UnshardRule(pattern, "first", recorded=FIRST_LAYOUT))
    return tuple(rules)


CAT_LAYOUT = "each rank computes its own heads' (or rows') slice, concatenated by rank along dim -1"
FIRST_LAYOUT = "gathered to rank 0, whose tensor is the whole (the other ranks hold none)"


def _gather_layout(
    sources: list[str], pieces: list[Piece], gathered: tuple[tuple[int, int, int], ...]
) -> str:
    """A gathered output's layout in words: what each rank holds along its last dim, and the order
    the ranks' pieces are joined in (the checkpoint's)."""
    held = " | ".join(f"{source} rows" for source in sources)
    shown = ", ".join(f"rank {rank} [{start}:{stop}]" for rank, start, stop in gathered[:8])
    more = f", ... {len(gathered) - 8} more" if len(gathered) > 8 else ""
    width = sum(p.count for p in pieces)
    return (
        f"each rank's {width} outputs are [{held}] (a slice of each), joined source by source: {shown}{more}"
    )


def _reordered(record: Correspondence, classes: Mapping[str, str]) -> tuple[UnshardRule, ...]:
    """The one-rank outputs to put back in the checkpoint's row order: a module whose weight rows
    from one source were written in another order than the source's (the load record's ``rows``
    runs, matched against the tensor as read), gathered source by source in source-row order."""
    held = engine_holdings(record)
    rules: list[UnshardRule] = []
    for module, pieces in held.pieces.items():
        if module in held.experts or is_kind("embedding", classes.get(module)):
            continue
        by_source: dict[str, list[Piece]] = {}
        for piece in pieces:
            by_source.setdefault(piece.source, []).append(piece)
        in_order = all(
            [p.source_row for p in sorted(group, key=lambda p: p.start)]
            == sorted(p.source_row for p in group)
            for group in by_source.values()
        )
        if in_order:
            continue
        gathered = tuple(
            (0, p.start, p.start + p.count)
            for group in by_source.values()
            for p in sorted(group, key=lambda p: p.source_row)
        )
        # the engine's linear layers return (out, bias): only its [0] is reordered, never the other
        # side's tensor of the same module name (an unshard rule knows no side)
        pattern = re.compile(rf"^{re.escape(module)}\[0\]$")
        rules.append(UnshardRule(pattern, "gather", -1, gathered))
    return tuple(rules)


# ------------------------------------------------------------------ a hand rule against the record


def join_contradiction(name: str, ndim: int, given: UnshardRule, recorded: UnshardRule) -> str | None:
    """Why a hand ``--unshard`` rule joins ``name`` otherwise than the ranks' load record says
    (None when both join it the same way: a ``cat`` along the last dim is a gather whose ranks'
    pieces come whole, rank after rank)."""
    if _same_join(given, recorded, ndim):
        return None
    how = "adds the ranks' tensors" if given.op == "sum" else f"concatenates the ranks along dim {given.dim}"
    layout = recorded.recorded or str(recorded)
    return (
        f"--unshard '{given}' {how} for {name}, but the ranks' load record says {layout}: "
        "the rule contradicts the recorded load"
    )


def _same_join(given: UnshardRule, recorded: UnshardRule, ndim: int) -> bool:
    if given.op != "cat" or recorded.op not in ("cat", "gather"):
        return given.op == recorded.op
    if ndim and (given.dim or 0) % ndim != (recorded.dim if recorded.dim is not None else -1) % ndim:
        return False
    if recorded.op == "cat":
        return True
    pieces = list(recorded.pieces)
    if pieces != sorted(pieces):  # the ranks' pieces interleaved: [q_0 q_1 | k_0 k_1 | ...]
        return False
    ends: dict[int, int] = {}
    for rank, start, stop in pieces:
        if start != ends.get(rank, 0):
            return False
        ends[rank] = stop
    return True


def joins_contradicted(
    entries: Iterable[SideEntry], options: DiffOptions, recorded: tuple[UnshardRule, ...]
) -> list[str]:
    """What the ranks' load records say against the hand ``--unshard`` rules that joined these
    entries (and the entries they are derived from: a fused output split into pieces)."""
    return list(dict.fromkeys(why for _, why in _contradictions(entries, options, recorded)))


def contradiction_notes(
    pairs: Iterable[PairEntries], options: DiffOptions, recorded: tuple[UnshardRule, ...]
) -> list[str]:
    """The summary's notes: one per hand ``--unshard`` rule the ranks' load records contradict,
    with its first tensor's finding and how many more tensors it joins so (each row says it in
    its ``pairing``)."""
    entries = (entry for pair in pairs for entry in (pair.a, pair.b))
    by_rule: dict[str, list[str]] = {}
    for given, why in _contradictions(entries, options, recorded):
        found = by_rule.setdefault(str(given), [])
        if why not in found:
            found.append(why)
    return [
        found[0]
        + (f" (and {len(found) - 1} more tensors: each row's pairing says so)" if len(found) > 1 else "")
        for found in by_rule.values()
    ]


class PairEntries(Protocol):
    """A planned pair, as far as its entries go."""

    @property
    def a(self) -> SideEntry: ...

    @property
    def b(self) -> SideEntry: ...


def _contradictions(
    entries: Iterable[SideEntry], options: DiffOptions, recorded: tuple[UnshardRule, ...]
) -> list[tuple[UnshardRule, str]]:
    found: list[tuple[UnshardRule, str]] = []
    if not options.unshard or not recorded:
        return found
    for entry in _leaves(entries):
        given = options.unshard_rule(entry.name)
        if given is None or entry.how in (None, "replicated", "rank0") or given in recorded:
            continue  # one rank, not joined by a hand rule, or the recorded join itself
        known = next((rule for rule in recorded if rule.matches(entry.name)), None)
        if known is None:
            continue
        why = join_contradiction(entry.name, len(entry.meta.shape or ()), given, known)
        if why is not None:
            found.append((given, why))
    return found


def _leaves(entries: Iterable[SideEntry]) -> list[SideEntry]:
    out: list[SideEntry] = []
    for entry in entries:
        out.extend(_leaves(entry.parts) if entry.op is not None else [entry])
    return out
