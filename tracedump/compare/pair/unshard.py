"""Tensor-parallel shards: put a TP=N run's tensors back together so they compare with TP=1.

``--unshard 'REGEX=cat:DIM'`` concatenates the ranks' tensors along DIM (column-parallel outputs),
``--unshard 'REGEX=sum'`` adds them (row-parallel partial results before the all-reduce). A name that
matches no rule is taken as *replicated*: rank 0's tensor is compared, and every other rank is
checked to agree with it within the pair's tolerance; a rank that does not is reported as
``rank_mismatch``, never ignored.

Two halves, like the rest of the comparator: :func:`plan_entry` works on metadata (shapes) only,
:func:`assemble` touches the data.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..load.reader import Stored, last_row_cut, widen
from ..load.sources import EntryMeta, PassView
from ..options import UnshardRule
from .kinds import PairKind


@dataclass(frozen=True, kw_only=True)
class SideEntry:
    """One side's entry for one name, as the comparison sees it (after unsharding)."""

    name: str
    meta: EntryMeta
    how: str | None = None  # "cat:1", "sum", "replicated" (several ranks) or None (one rank)
    problem: str | None = None  # why this entry cannot be compared, if it cannot
    problem_status: PairKind | None = None  # RANK_MISMATCH or ERROR: the pair's kind
    cut: int | None = None  # cut to the last index along this dim once assembled (vs a last_row dump)
    op: str | None = None  # a bridge's derived entry (compare/pair/bridge.py): sum, product, concat, split
    parts: tuple[SideEntry, ...] = ()  # the entries it is derived from
    piece: tuple[int, int, int] | None = None  # split: (dim, start, stop)
    gather: tuple[tuple[int, int, int], ...] = ()  # how "gather:DIM": (rank, start, stop) in order


def _cat_shape(shapes: list[tuple[int, ...]], dim: int) -> tuple[int, ...] | str:
    ndim = len(shapes[0])
    if any(len(s) != ndim for s in shapes):
        return f"ranks disagree on the number of dims: {shapes}"
    if not -ndim <= dim < ndim:
        return f"cat:{dim} is out of range for {ndim}-dim tensors"
    axis = dim % ndim
    rest = {s[:axis] + s[axis + 1 :] for s in shapes}
    if len(rest) > 1:
        return f"cannot concatenate shapes {shapes} along dim {dim}"
    return (*shapes[0][:axis], sum(s[axis] for s in shapes), *shapes[0][axis + 1 :])


def plan_entry(name: str, views: list[PassView], rule: UnshardRule | None) -> SideEntry:
    """The entry ``name`` across the ranks in ``views``, with the shape it will have once unsharded."""
    metas = [view.entries.get(name) for view in views]
    present = [m for m in metas if m is not None]
    first = present[0]
    one_rank = rule is not None and rule.op == "gather" and all(r == 0 for r, _, _ in rule.pieces)
    if len(views) == 1 and one_rank and rule is not None:  # rows a single rank's load reordered
        return _plan_gather(name, first, [(m.shape or ()) if m is not None else () for m in metas], rule)
    if len(views) == 1:
        return SideEntry(name=name, meta=first)
    if rule is not None and rule.op == "first" and metas[0] is not None:
        return SideEntry(name=name, meta=metas[0], how="rank0")  # gathered to rank 0 (the logits)
    missing = [view.rank for view, meta in zip(views, metas, strict=True) if meta is None]
    if missing:
        return SideEntry(
            name=name,
            meta=first,
            how=None,
            problem=f"missing on rank(s) {missing}",
            problem_status=PairKind.RANK_MISMATCH,
        )
    if any(m.kind == "stats" for m in present):
        if rule is not None:
            return SideEntry(
                name=name,
                meta=first,
                how=str(rule),
                problem="--unshard needs whole tensors, not statistics",
                problem_status=PairKind.ERROR,
            )
        return SideEntry(name=name, meta=first, how="replicated")
    shapes = [m.shape or () for m in present]
    if rule is None:
        if len(set(shapes)) > 1:
            return SideEntry(
                name=name,
                meta=first,
                how="replicated",
                problem=f"no --unshard rule and shapes differ across ranks: {shapes}",
                problem_status=PairKind.RANK_MISMATCH,
            )
        return SideEntry(name=name, meta=first, how="replicated")
    if rule.op == "gather":
        return _plan_gather(name, first, shapes, rule)
    how = "sum" if rule.op == "sum" else f"cat:{rule.dim}"
    if rule.op == "sum":
        if len(set(shapes)) > 1:
            return SideEntry(
                name=name,
                meta=first,
                how=how,
                problem=f"sum needs equal shapes, got {shapes}",
                problem_status=PairKind.ERROR,
            )
        return SideEntry(name=name, meta=EntryMeta("tensor", shapes[0], first.dtype), how=how)
    shape = _cat_shape(shapes, rule.dim or 0)
    if isinstance(shape, str):
        return SideEntry(name=name, meta=first, how=how, problem=shape, problem_status=PairKind.ERROR)
    return SideEntry(name=name, meta=EntryMeta("tensor", shape, first.dtype), how=how)


def _plan_gather(name: str, first: EntryMeta, shapes: list[tuple[int, ...]], rule: UnshardRule) -> SideEntry:
    """A column-parallel output put back in the single-rank layout: each rank's pieces along
    ``dim`` (``[q_r | k_r | v_r]`` of a fused ``qkv_proj``), concatenated in the checkpoint's
    order, as the ranks' weight loads recorded."""
    dim = rule.dim if rule.dim is not None else -1
    how = f"gather:{dim}"
    for rank, start, stop in rule.pieces:
        shape = shapes[rank] if rank < len(shapes) else ()
        if not shape or not -len(shape) <= dim < len(shape) or stop > shape[dim]:
            problem = f"gather: rank {rank} has no [{start}:{stop}] along dim {dim} in {list(shape)}"
            return SideEntry(name=name, meta=first, how=how, problem=problem, problem_status=PairKind.ERROR)
    base = list(shapes[0])
    base[dim] = sum(stop - start for _, start, stop in rule.pieces)
    return SideEntry(
        name=name, meta=EntryMeta("tensor", tuple(base), first.dtype), how=how, gather=rule.pieces
    )


def assemble(entry: SideEntry, views: list[PassView]) -> Stored:
    """The entry's values as compared: joined across ranks as the rule says, then cut to the last
    row when the other side is a ``last_row`` dump."""
    stored = _derive(entry, views) if entry.op is not None else _join(entry, views)
    return stored if entry.cut is None else last_row_cut(stored, entry.cut)


def _derive(entry: SideEntry, views: list[PassView]) -> Stored:
    """A bridge's derived entry from its parts: a slice (split), a concatenation, or an exact
    float64 sum or product (row for row, so the token rows of a batch stay where they were)."""
    parts = [assemble(part, views) for part in entry.parts]
    if entry.op == "split":
        assert entry.piece is not None
        dim, start, stop = entry.piece
        array = parts[0].array
        axis = dim % array.ndim
        return Stored(array[(slice(None),) * axis + (slice(start, stop),)], parts[0].dtype)
    if entry.op == "concat":
        dim = entry.piece[0] if entry.piece else -1
        if len({p.dtype for p in parts}) > 1:  # bf16 bits beside fp32 numbers: each widened first
            widened = [widen(p.array, p.dtype, np.float64).reshape(p.shape) for p in parts]
            return Stored(np.concatenate(widened, axis=dim), "float64")
        return Stored(np.concatenate([p.array for p in parts], axis=dim), parts[0].dtype)
    shape = parts[0].shape
    total = widen(parts[0].array, parts[0].dtype, np.float64).reshape(shape)
    for part in parts[1:]:
        # equal once size-1 dims are dropped (plan checks)
        values = widen(part.array, part.dtype, np.float64).reshape(shape)
        total = total + values if entry.op == "sum" else total * values
    return Stored(total, "float64")


def _join(entry: SideEntry, views: list[PassView]) -> Stored:
    """One rank's tensor, or the ranks' tensors joined as the rule says."""
    if entry.how is None or entry.how in ("replicated", "rank0"):
        return views[0].array(entry.name)
    if entry.how.startswith("gather:"):
        dim = int(entry.how.split(":", 1)[1])
        arrays = {rank: views[rank].array(entry.name) for rank, _, _ in entry.gather}
        first = next(iter(arrays.values()))
        pieces = []
        for rank, start, stop in entry.gather:
            array = arrays[rank].array
            axis = dim % array.ndim
            pieces.append(array[(slice(None),) * axis + (slice(start, stop),)])
        return Stored(np.concatenate(pieces, axis=dim), first.dtype)
    parts = [view.array(entry.name) for view in views]
    if entry.how == "sum":
        total = np.zeros(parts[0].shape, np.float64)
        for part in parts:
            total += widen(part.array, part.dtype, np.float64)
        return Stored(total, "float64")
    dim = int(entry.how.split(":", 1)[1])
    return Stored(np.concatenate([p.array for p in parts], axis=dim), parts[0].dtype)
