"""How a tensor-parallel engine's outputs are put back together from its ranks, read off every
rank's recorded load (no ``--unshard`` rule needed), and one rank's outputs whose rows its model's
``load_weights`` reordered, put back in the checkpoint's row order."""

from __future__ import annotations

import re
from collections.abc import Mapping

from ...store.correspondence import RAW_LOGITS, Correspondence
from ..options import UnshardRule
from .engine_classes import is_kind
from .holdings import Piece, engine_holdings


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
        rules.append(UnshardRule(pattern, "gather", -1, tuple(gathered)))
    for module, qualname in classes.items():
        if is_kind("attention", qualname) or is_kind("act_and_mul", qualname):
            rules.append(UnshardRule(re.compile(rf"^{re.escape(module)}$"), "cat", -1))
        elif is_kind("logits", qualname):  # the processor's output and its recorded head output
            rules.append(
                UnshardRule(re.compile(rf"^{re.escape(module)}({re.escape(RAW_LOGITS)})?$"), "first")
            )
    return tuple(rules)


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
