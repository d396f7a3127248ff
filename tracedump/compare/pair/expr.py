"""What one side of a pair compares (:class:`Expr`: a stored tensor, or an op over several of
that side's tensors), a pair of them (:class:`BridgedPair`, with how it was made and what proves
it), and split pieces sized from their counterparts' shapes (:func:`size_splits`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from ..judge.tolerance import pair_precision
from ..load.sources import EntryMeta
from .kinds import PairKind
from .unshard import SideEntry

_COMBINE = {"sum": " + ", "product": " * "}


@dataclass(frozen=True, kw_only=True)
class Expr:
    """One side of a pair: a stored tensor, or an op over several of that side's tensors.

    ``label`` is the name the report shows (``model.layers.0[0] + model.layers.0[1]``,
    ``model.layers.0.self_attn.qkv_proj[0][..., 0:256]``)."""

    names: tuple[str, ...]
    op: str | None = None  # None (one tensor), sum, product, concat, split
    dim: int = -1
    piece: tuple[int, int] | None = None  # split: [start, stop) along dim
    whole: int | None = None  # split: what the pieces add up to along dim

    @property
    def label(self) -> str:
        if self.op in _COMBINE:
            return _COMBINE[self.op].join(self.names)
        if self.op == "concat":
            return f"cat({', '.join(self.names)}, dim={self.dim})"
        if self.op == "split" and self.piece is not None:
            where = "" if self.dim == -1 else f"dim {self.dim}: "
            return f"{self.names[0]}[{where}{self.piece[0]}:{self.piece[1]}]"
        return self.names[0]

    def entry(self, entries: Mapping[str, SideEntry]) -> SideEntry | None:
        """This side's entry for one pass (None when a tensor it needs is not in the pass); a
        derived entry knows its shape from the parts' metadata, its values from :func:`.unshard.assemble`."""
        parts = [entries.get(name) for name in self.names]
        if any(p is None for p in parts):
            return None
        found = [p for p in parts if p is not None]
        if self.op is None:
            return found[0]
        first = found[0]
        problem = next((p.problem for p in found if p.problem is not None), None)
        if problem is None and any(p.meta.kind != "tensor" for p in found):
            problem = f"{self.op} needs whole tensors, not statistics"
        shape, why = self._shape([p.meta.shape for p in found])
        dtypes = {p.meta.dtype for p in found}
        # parts of several dtypes (bf16 + fp32) are joined as numbers (unshard._derive widens each
        # from its own dtype), judged at the least precise of them
        dtype = first.meta.dtype if len(dtypes) == 1 or self.op != "concat" else pair_precision(*dtypes)
        meta = EntryMeta("tensor", shape, dtype)
        status = next((p.problem_status for p in found if p.problem is not None), None)
        return SideEntry(
            name=self.label,
            meta=meta,
            how=first.how,
            problem=problem or why,
            problem_status=status or (PairKind.ERROR if why else None),
            op=self.op,
            parts=tuple(found),
            piece=(self.dim, *self.piece) if self.piece is not None else (self.dim, 0, 0),
        )

    def _shape(self, shapes: list[tuple[int, ...] | None]) -> tuple[tuple[int, ...] | None, str | None]:
        if any(s is None for s in shapes):
            return None, None
        known = [s for s in shapes if s is not None]
        if self.op == "split":
            shape = known[0]
            if not -len(shape) <= self.dim < len(shape):
                return shape, f"split: dim {self.dim} is out of range for a tensor of shape {list(shape)}"
            axis = self.dim % len(shape)
            if self.piece is None or self.piece[1] > shape[axis]:
                return shape, f"split: {list(shape)} has no [{self.piece}] along dim {self.dim}"
            if self.whole is not None and self.whole != shape[axis]:
                return shape, (
                    f"split: the pieces add up to {self.whole} along dim {self.dim}, "
                    f"the tensor {list(shape)} has {shape[axis]}"
                )
            return (*shape[:axis], self.piece[1] - self.piece[0], *shape[axis + 1 :]), None
        if self.op == "concat":
            ndim = len(known[0])
            if not ndim or not -ndim <= self.dim < ndim:
                return known[0], (
                    f"concat: dim {self.dim} is out of range for parts of shapes {[list(s) for s in known]}"
                )
            axis = self.dim % ndim
            if any(
                len(s) != ndim or s[:axis] + s[axis + 1 :] != known[0][:axis] + known[0][axis + 1 :]
                for s in known
            ):
                return known[0], f"concat: shapes {[list(s) for s in known]} do not join along dim {self.dim}"
            return (*known[0][:axis], sum(s[axis] for s in known), *known[0][axis + 1 :]), None
        squeezed = {tuple(d for d in s if d != 1) for s in known}
        if len(squeezed) > 1:
            return known[0], f"{self.op}: shapes differ: {[list(s) for s in known]}"
        return known[0], None


@dataclass(frozen=True, kw_only=True)
class BridgedPair:
    """One comparison the bridge decided: A's expression, B's, and how (for the table)."""

    a: Expr
    b: Expr
    how: str | None  # "split -1", "sum", ... ; None for a pair matched by name
    rule: str | None = None  # "rule 3 (split)"
    # set: not comparable (one name, two classes known to compute different quantities, no rule)
    classes: tuple[str, str] | None = None
    paired_by: str = "name"  # what proves the pair: name | weights | load | structure | rule | map
    note: str | None = None  # what the pairing saw beside it: two classes, a weights finding

    def describe(self) -> str | None:
        """``split -1 (rule 4: qkv)``: what the table's bridge column shows; None for a name match."""
        if self.how is None:
            return None
        return f"{self.how} ({self.rule})" if self.rule else self.how


def size_splits(
    pairs: list[BridgedPair], entries_a: Mapping[str, SideEntry], entries_b: Mapping[str, SideEntry]
) -> list[BridgedPair]:
    """Give every split piece its bounds: the counterpart pieces' sizes along the split dim, in order.
    A piece whose counterpart's shape is unknown keeps an empty bound (reported as an error)."""
    offsets: dict[tuple[str, str, int], int] = {}
    out = []
    for pair in pairs:
        for which, fused, other, entries in (
            ("a", pair.a, pair.b, entries_b),
            ("b", pair.b, pair.a, entries_a),
        ):
            if fused.op != "split" or fused.piece is None or fused.piece[0] != -1:
                continue
            entry = entries.get(other.names[0])
            shape = entry.meta.shape if entry is not None else None
            key = (which, fused.names[0], fused.dim)
            start = offsets.get(key, 0)
            size = shape[fused.dim] if shape and -len(shape) <= fused.dim < len(shape) else 0
            offsets[key] = start + size
            sized = replace(fused, piece=(start, start + size))
            pair = replace(pair, **{which: sized})
        out.append(pair)
    return [_with_whole(pair, offsets) for pair in out]


def _with_whole(pair: BridgedPair, offsets: dict[tuple[str, str, int], int]) -> BridgedPair:
    """Each split piece knows what its pieces add up to: a fused tensor of another size is an
    error, never a silently dropped remainder."""
    for which in ("a", "b"):
        fused: Expr = getattr(pair, which)
        if fused.op == "split":
            pair = replace(
                pair, **{which: replace(fused, whole=offsets.get((which, fused.names[0], fused.dim)))}
            )
    return pair
