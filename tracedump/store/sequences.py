"""Which sequence and position each token row of each pass holds: the reading side of ``set_batch``.

A batching engine puts the tokens of several requests into one step (``[tokens, hidden]``, requests
concatenated), chunks prefills over steps and adds one token per request per decode step; a
reference runs one request per forward. To compare them, every row of every pass is given a
``(sequence, position)``:

- a pass whose engine called ``Dumper.set_batch()`` carries ``tracedump.batch`` in its metadata:
  ``seq_ids`` (one per row), optional ``positions`` (default: each sequence continues where its
  previous step ended) and optional ``input_ids``;
- a pass without it holds **one** sequence: a pass of several tokens starts a new one (a full
  forward, a ``generate()`` prefill) named ``pass<N>``, a pass of one token continues the last one
  (a ``generate()`` decode step). Its token count is read from its first tensor of 2+ dims (the
  first dim of size > 1), so a batch-1 HF forward ``[1, seq, hidden]`` and an engine's
  ``[tokens, hidden]`` both work.

Rows of a tensor are taken along the dim whose size is the pass's token count (the run's
``TOKEN_DIM`` when it fits, else the first such dim), so tensors without a token dim, or with
another per-token shape, are reported rather than guessed.

A batch may also be a ``grid`` ``[batch, seq]`` (a padded HF batch, ``[batch, seq, hidden]``
tensors): its rows are the grid's cells in row-major order, found in a tensor as two adjacent
dims of those sizes (or one dim of ``batch * seq``: ``[tokens, hidden]``). A row whose seq id is
``None`` (JSON ``null``) is padding: it belongs to no sequence and is never compared.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Protocol, TypeVar

from pydantic import ConfigDict, Field, TypeAdapter, with_config
from typing_extensions import Required, TypedDict

from ..errors import SequenceError
from .format import BATCH_KEY

SeqId = int | str
Row = SeqId | None  # None: a padding row


@dataclass(frozen=True, kw_only=True)
class Batch:
    """The rows of one pass: per row its sequence id, position, and token id when known."""

    pass_index: int
    seq_ids: tuple[Row, ...]
    positions: tuple[int, ...]
    input_ids: tuple[int, ...] | None
    declared: bool  # from set_batch(); False when inferred (one sequence per pass)
    grid: tuple[int, int] | None = None  # [batch, seq]: the rows are its cells, row-major

    @property
    def tokens(self) -> int:
        return len(self.seq_ids)

    @property
    def padding(self) -> int:
        """Rows that belong to no sequence."""
        return sum(seq is None for seq in self.seq_ids)

    def spans(self) -> dict[SeqId, tuple[int, int, int]]:
        """Each sequence (in order of first appearance) -> (lowest position, highest, rows held):
        one walk over the rows, whatever the number of sequences."""
        found: dict[SeqId, tuple[int, int, int]] = {}
        for seq, position in zip(self.seq_ids, self.positions, strict=True):
            if seq is None:
                continue
            low, high, rows = found.get(seq, (position, position, 0))
            found[seq] = (min(low, position), max(high, position), rows + 1)
        return found

    def summary(self, listed: int | None = None) -> str:
        """For ``tracedump ls``: ``0: 0-5, 1: 3`` (positions held per sequence). ``listed``: at most
        that many sequences are named; a pass holding more is counted instead
        (``2048 sequences, 2048 rows, positions 0-7; first: 0: 3, 1: 0, ...``). Linear in the rows."""
        spans = self.spans()
        shown = spans if listed is None else dict(itertools.islice(spans.items(), listed))
        parts = [
            f"{seq}: {low}-{high}" if rows > 1 else f"{seq}: {low}"
            for seq, (low, high, rows) in shown.items()
        ]
        if len(shown) < len(spans):
            low = min(span[0] for span in spans.values())
            high = max(span[1] for span in spans.values())
            rows = sum(span[2] for span in spans.values())
            counted = f"{len(spans)} sequences, {rows} rows, positions {low}-{high}"
            parts = [f"{counted}; first: {', '.join(parts)}, ..." if parts else counted]
        if self.padding:
            parts.append(f"{self.padding} padding rows")
        layout = f"[{self.grid[0]} x {self.grid[1]}] " if self.grid is not None else ""
        return layout + ", ".join(parts)

    def row_dim(self, shape: tuple[int, ...], preferred: int) -> tuple[int, tuple[int, ...]] | None:
        """Where a tensor of ``shape`` holds this pass's rows: the dim, and the shape with a grid's
        two dims merged into it (``[2, 5, 256]`` -> ``(0, (10, 256))``); None when it holds none."""
        if self.grid is not None:
            batch, seq = self.grid
            for dim in range(len(shape) - 1):
                if shape[dim] == batch and shape[dim + 1] == seq:
                    return dim, (*shape[:dim], batch * seq, *shape[dim + 2 :])
        dim = token_dim(shape, self.tokens, preferred)
        return None if dim is None else (dim, shape)

    @property
    def sequence_ids(self) -> list[SeqId]:
        """The pass's sequences in order of first appearance (padding rows belong to none)."""
        return [seq for seq in dict.fromkeys(self.seq_ids) if seq is not None]

    def layout(self, shape: tuple[int, ...], preferred: int) -> tuple[str, int, tuple[int, ...]] | None:
        """How a tensor of this pass holds its rows, as (kind, dim, shape with a ``[batch, seq]``
        grid's two dims merged into one): one per token row (``tokens``), or one per sequence
        (``sampled``: logits, computed for each sequence's last token of the step only), or
        neither (None)."""
        found = self.row_dim(shape, preferred)
        if found is not None:
            return "tokens", found[0], found[1]
        seqs = len(self.sequence_ids)
        if seqs < self.tokens:
            dim = token_dim(shape, seqs, preferred)
            if dim is not None:
                return "sampled", dim, shape
        return None


@dataclass
class Sequence:
    """One sequence over a run: which pass holds each of its positions, at which row.

    ``prompt_end``: the positions before it are the sequence's prompt, told from the batch layout
    (:func:`sequences`): the rows of the first step that holds the sequence, and of each following
    step that continues that prefill with more than one row (a chunked prefill); a step holding
    one row of it is a decode step, and every position from there on was fed a generated token.
    ``recomputed``: (first position, pass) of each step that held positions of the sequence again
    (preemption with recompute): its rows replaced the first computation's."""

    seq_id: SeqId
    rows: dict[int, tuple[int, int]] = field(default_factory=dict)  # position -> (pass, row)
    input_ids: dict[int, int] = field(default_factory=dict)  # position -> token id
    prompt_end: int = 0
    recomputed: list[tuple[int, int]] = field(default_factory=list)
    _last_grouping: tuple[tuple[tuple[int, ...], int], dict[int, tuple[list[int], list[int]]]] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    def is_prompt(self, position: int) -> bool:
        """Whether ``position`` holds a prompt token (else a generated one, fed back)."""
        return position < self.prompt_end

    def before(self, position: int) -> Sequence:
        """The sequence cut before ``position``: the rows computed before it was fed."""
        return Sequence(
            self.seq_id,
            rows={p: r for p, r in self.rows.items() if p < position},
            input_ids={p: t for p, t in self.input_ids.items() if p < position},
            prompt_end=self.prompt_end,
            recomputed=list(self.recomputed),
        )

    @property
    def positions(self) -> list[int]:
        return sorted(self.rows)

    def rows_by_pass(self, positions: list[int]) -> dict[int, list[int]]:
        """The rows of ``positions`` grouped by the pass that holds them, in position order."""
        return {index: rows for index, (_, rows) in self._grouped(positions).items()}

    def positions_by_pass(self, positions: list[int]) -> dict[int, list[int]]:
        """``positions`` grouped by the pass that holds them, in position order."""
        return {index: at for index, (at, _) in self._grouped(positions).items()}

    def _grouped(self, positions: list[int]) -> dict[int, tuple[list[int], list[int]]]:
        """Per pass, the positions it holds and their rows. Kept for the last ``positions`` asked
        about: a token-aligned diff asks again for every tensor of the sequence, and one walk over
        a long sequence's rows costs more than comparing a small tensor (docs/performance.md).
        ``rows`` is complete once :func:`sequences` has built it (nothing rewrites a row after);
        callers read the lists returned, never change them."""
        key = (tuple(positions), len(self.rows))
        last = self._last_grouping  # read once: a second read could see another call's grouping
        if last is not None and last[0] == key:
            return last[1]
        grouped: dict[int, tuple[list[int], list[int]]] = {}
        for position in positions:
            index, row = self.rows[position]
            at, rows = grouped.setdefault(index, ([], []))
            at.append(position)
            rows.append(row)
        self._last_grouping = (key, grouped)
        return grouped

    def tokens(self) -> list[int] | None:
        """Token ids in position order from 0, when every position has one."""
        positions = self.positions
        if positions and positions == list(range(len(positions))) and set(positions) <= self.input_ids.keys():
            return [self.input_ids[p] for p in positions]
        return None


MAX_ROW_INT = 2**63 - 1  # a position or token id: what a tensor element can hold
_RowInt = Annotated[int, Field(ge=-MAX_ROW_INT, le=MAX_ROW_INT)]
_GridSize = Annotated[int, Field(gt=0, le=MAX_ROW_INT)]


@with_config(ConfigDict(strict=True, extra="allow"))
class BatchLayout(TypedDict, total=False):
    """``tracedump.batch``, typed: one seq id per row (``null``: padding), optional positions,
    token ids and ``[batch, seq]`` grid. Keys a reader does not know are let through."""

    seq_ids: Required[list[_RowInt | str | None]]
    positions: list[_RowInt] | None
    input_ids: list[_RowInt] | None
    grid: Annotated[list[_GridSize], Field(min_length=2, max_length=2)] | None


_BATCH = TypeAdapter(BatchLayout)


def parse_batch(pass_index: int, metadata: dict[str, str]) -> dict[str, list[Any]] | None:
    """The raw ``tracedump.batch`` of a pass, typed (:class:`BatchLayout`) and checked for shape;
    None when the pass has none. A SequenceError names the pass and the field."""
    from .jsonio import loads, validated

    text = metadata.get(BATCH_KEY)
    if text is None:
        return None
    try:
        raw = loads(text)
    except ValueError as e:  # not JSON, nested too deep
        raise SequenceError(f"pass {pass_index}: {BATCH_KEY} is not JSON ({e})") from e
    if not isinstance(raw, dict) or not isinstance(raw.get("seq_ids"), list):
        raise SequenceError(f"pass {pass_index}: {BATCH_KEY} has no list of seq_ids")
    validated(
        _BATCH.validate_python, raw, lambda line: SequenceError(f"pass {pass_index}: {BATCH_KEY} {line}")
    )
    seq_ids = raw["seq_ids"]
    grid = raw.get("grid")
    if grid is not None and grid[0] * grid[1] != len(seq_ids):
        raise SequenceError(
            f"pass {pass_index}: {BATCH_KEY} grid {grid!r} does not hold its {len(seq_ids)} rows"
        )
    for name in ("positions", "input_ids"):
        values = raw.get(name)
        if values is not None and len(values) != len(seq_ids):
            raise SequenceError(f"pass {pass_index}: {BATCH_KEY} {name} is not one integer per row")
    return raw


def token_count(shapes: list[tuple[int, ...]]) -> int | None:
    """A pass's token count without metadata: the first non-1 dim of its first tensor of 2+ dims."""
    for shape in shapes:
        squeezed = [s for s in shape if s != 1]
        if len(shape) >= 2 and squeezed:
            return squeezed[0] if len(squeezed) >= 2 else 1
    return None


def token_dim(shape: tuple[int, ...], tokens: int, preferred: int) -> int | None:
    """The dim holding the token rows of a tensor of ``shape``: the run's TOKEN_DIM when its size
    is the token count, else the first other such dim (the last dim counts only for 1-D)."""
    if len(shape) > preferred and shape[preferred] == tokens:
        return preferred
    candidates = range(len(shape) - 1) if len(shape) > 1 else range(len(shape))
    return next((d for d in candidates if shape[d] == tokens), None)


def batches(
    pass_indices: list[int],
    metadata_of: Callable[[int], dict[str, str]],
    shapes_of: Callable[[int], list[tuple[int, ...]]],
) -> dict[int, Batch]:
    """Every pass's rows as (sequence, position), in pass order (positions default to continuing)."""
    next_position: dict[SeqId, int] = {}
    last_inferred: SeqId | None = None
    out: dict[int, Batch] = {}
    for index in sorted(pass_indices):
        raw = parse_batch(index, metadata_of(index))
        shapes = shapes_of(index)
        tokens = token_count(shapes)
        if raw is not None:
            seq_ids, given, positions = tuple(raw["seq_ids"]), raw.get("positions"), []
            for row, seq in enumerate(seq_ids):  # without given positions, each sequence continues
                positions.append(next_position.get(seq, 0) if given is None else given[row])
                if seq is not None:
                    next_position[seq] = max(next_position.get(seq, 0), positions[-1] + 1)
            input_ids = raw.get("input_ids")
            grid = (raw["grid"][0], raw["grid"][1]) if raw.get("grid") is not None else None
            ids = tuple(input_ids) if input_ids else None
            batch = Batch(
                pass_index=index,
                seq_ids=seq_ids,
                positions=tuple(positions),
                input_ids=ids,
                declared=True,
                grid=grid,
            )
            if not _rows_fit(batch, shapes, tokens):
                held = ", ".join(map(str, dict.fromkeys(s for s in seq_ids if s is not None)))
                rows = f"{len(seq_ids)} rows" if grid is None else f"a {list(grid)} grid of rows"
                raise SequenceError(
                    f"pass {index}: set_batch() declared {rows} (sequences {held}) but the "
                    f"pass's tensors hold {tokens}"
                )
            out[index] = batch
            continue
        if tokens is None:
            continue
        if tokens > 1 or last_inferred is None:
            last_inferred = f"pass{index}"
        start = next_position.get(last_inferred, 0)
        next_position[last_inferred] = start + tokens
        out[index] = Batch(
            pass_index=index,
            seq_ids=(last_inferred,) * tokens,
            positions=tuple(range(start, start + tokens)),
            input_ids=None,
            declared=False,
        )
    return out


def _rows_fit(batch: Batch, shapes: list[tuple[int, ...]], tokens: int | None) -> bool:
    """A declared batch agrees with the pass's tensors: its first tensor of 2+ dims holds the
    rows (a grid's two dims, or one of its row count)."""
    if batch.grid is None:
        return tokens is None or tokens == batch.tokens
    first = next((shape for shape in shapes if len(shape) >= 2), None)
    return first is None or batch.row_dim(first, 0) is not None


def sequences(found: dict[int, Batch]) -> dict[SeqId, Sequence]:
    """Each sequence's positions over the passes. A later step that holds positions of a sequence
    again recomputes them (vLLM's preemption with recompute re-prefills a preempted request's prompt
    and generated tokens): the rows from that position on are the recomputation's, and the step is
    listed in ``recomputed``. A position held twice in one pass, or positions that jump, raise,
    naming the pass and the sequence (a silent mis-alignment would compare the wrong rows)."""
    out: dict[SeqId, Sequence] = {}
    prefilling: dict[SeqId, bool] = {}  # the sequence's prefill may continue in the next step
    for index in sorted(found):
        batch = found[index]
        held: dict[SeqId, list[int]] = {}
        for row, (seq, position) in enumerate(zip(batch.seq_ids, batch.positions, strict=True)):
            if seq is None:  # padding
                continue
            held.setdefault(seq, []).append(position)
            sequence = out.setdefault(seq, Sequence(seq))
            if position in sequence.rows:
                earlier = sequence.rows[position][0]
                if earlier == index:
                    raise SequenceError(
                        f"pass {index}: sequence {seq!r} holds position {position} again (first in "
                        f"pass {earlier})"
                    )
                _recompute(sequence, position, index)
            sequence.rows[position] = (index, row)
            if batch.input_ids is not None:
                sequence.input_ids[position] = batch.input_ids[row]
        for seq, positions in held.items():
            _grow_prompt(out[seq], positions, prefilling)
    for sequence in out.values():
        positions = sequence.positions
        if positions and positions != list(range(positions[0], positions[0] + len(positions))):
            gap = next(p for a, p in itertools.pairwise(positions) if p != a + 1)
            raise SequenceError(
                f"pass {sequence.rows[gap][0]}: sequence {sequence.seq_id!r} jumps to position {gap} "
                f"(positions held: {_span(positions)})"
            )
    return out


def _recompute(sequence: Sequence, position: int, index: int) -> None:
    """A later step computes ``position`` again: the first computation of it and of every later
    position is dropped (the recomputation, in this step and the next, replaces it)."""
    for stale in [p for p in sequence.rows if p >= position]:
        del sequence.rows[stale]
        sequence.input_ids.pop(stale, None)
    sequence.recomputed.append((position, index))


def _grow_prompt(sequence: Sequence, positions: list[int], prefilling: dict[SeqId, bool]) -> None:
    """The prompt of a sequence, from the layout of the steps that hold it: the first step's rows,
    and each next step's while it continues the prefill with several rows (chunked prefill)."""
    seq = sequence.seq_id
    if seq not in prefilling:
        sequence.prompt_end = max(positions) + 1
        prefilling[seq] = len(positions) > 1
    elif prefilling[seq] and len(positions) > 1 and min(positions) == sequence.prompt_end:
        sequence.prompt_end = max(positions) + 1
    else:
        prefilling[seq] = False


class _Rows(Protocol):
    """A numpy array or a torch tensor: what the gathering below needs of either."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    def reshape(self, shape: tuple[int, ...], /) -> Any: ...


_Array = TypeVar("_Array", bound=_Rows)


@dataclass(frozen=True, kw_only=True)
class RowCut:
    """Where one pass holds a sequence's rows in one tensor: reshaped to ``shape`` (a ``[batch,
    seq]`` grid's two dims merged into one), the ``rows`` along ``dim``."""

    pass_index: int
    dim: int
    shape: tuple[int, ...]
    rows: tuple[int, ...]


def sequence_rows(
    sequence: Sequence,
    positions: list[int],
    found: dict[int, Batch],
    shape_in: Callable[[int], tuple[int, ...] | str],
    take: Callable[[RowCut], _Array],
    preferred: int,
    *,
    sampled: bool,
) -> list[_Array] | str:
    """One tensor's rows of ``sequence`` at ``positions``, one piece per pass in position order,
    each ``[rows, ...]`` with its other size-1 dims dropped (a decode step's ``[1, 1, hidden]`` and
    a prefill's ``[1, seq, hidden]`` line up as rows); or why they cannot be gathered.

    The one gathering of a sequence's rows: ``Run.sequence`` (torch) and ``diff --align tokens``
    (numpy) differ only in their arrays. ``shape_in(pass)`` is the tensor's shape in that pass (a
    string: why it has none there); ``take(cut)`` returns its ``cut.rows`` along ``cut.dim``, that
    dim moved first. ``sampled``: a tensor with one row per sequence (logits) gives that row for
    each position the pass holds."""
    pieces: list[_Array] = []
    for index, rows in sequence.rows_by_pass(positions).items():
        shape = shape_in(index)
        if isinstance(shape, str):
            return shape
        batch = found[index]
        layout = batch.layout(shape, preferred) if sampled else _tokens_layout(batch, shape, preferred)
        if layout is None:
            rows_of = f"{batch.tokens}" if batch.grid is None else f"{batch.tokens} ({list(batch.grid)})"
            return f"no token dim of size {rows_of} in {list(shape)}"
        kind, dim, merged = layout
        if kind == "sampled":  # the sequence's row among the pass's sequences, in order of appearance
            rows = [batch.sequence_ids.index(sequence.seq_id)] * len(rows)
        taken = take(RowCut(pass_index=index, dim=dim, shape=merged, rows=tuple(rows)))
        pieces.append(taken.reshape((len(rows), *[s for s in taken.shape[1:] if s != 1])))
    if not pieces:
        return "no rows"
    if any(tuple(p.shape[1:]) != tuple(pieces[0].shape[1:]) for p in pieces):
        return "rows of different shapes across passes"
    return pieces


def _tokens_layout(
    batch: Batch, shape: tuple[int, ...], preferred: int
) -> tuple[str, int, tuple[int, ...]] | None:
    found = batch.row_dim(shape, preferred)
    return None if found is None else ("tokens", *found)


def _span(positions: list[int]) -> str:
    return ",".join(map(str, positions[:12])) + (" ..." if len(positions) > 12 else "")


# ------------------------------------------------------------------ the writing side: set_batch()


def _as_list(values: Any) -> tuple[list[Any], list[int] | None] | None:
    """A flat host list of ``values`` and its grid when they were ``[batch, seq]``: a sequence, a
    sequence of equal-length sequences, or a tensor of 1 or 2 dims (a CUDA one costs a sync)."""
    if values is None:
        return None
    if type(values) is list:  # an engine's host list (each step, on the host's path): as it is
        listed = values
    elif hasattr(values, "detach"):
        tensor = values.detach()
        grid = list(tensor.shape) if tensor.dim() == 2 else None
        return tensor.reshape(-1).cpu().tolist(), grid
    else:
        listed = list(values)
    if listed and isinstance(listed[0], (list, tuple)) and all(isinstance(v, (list, tuple)) for v in listed):
        widths = {len(v) for v in listed}
        if len(widths) != 1:
            raise SequenceError(
                f"tracedump set_batch(): a [batch, seq] grid of rows of lengths {sorted(widths)}"
            )
        return [v for row in listed for v in row], [len(listed), widths.pop()]
    return listed, None


_SEQ_TYPES = frozenset({int, str, type(None)})
_INT = frozenset({int})
# ``json.dumps`` with separators builds an encoder at each call: one, made once (the same text)
_ENCODE_COMPACT = json.JSONEncoder(separators=(",", ":")).encode


def batch_metadata(seq_ids: Any, positions: Any, input_ids: Any) -> str:
    """The ``tracedump.batch`` JSON of one step (lists or tensors in), checked: one entry per token
    row in every list. ``[batch, seq]`` grids (nested lists, 2-D tensors) are stored flat with
    their ``grid``; a seq id ``None`` marks a padding row."""
    rows, grid = _as_list(seq_ids) or ([], None)
    if not set(map(type, rows)) <= _SEQ_TYPES:  # numpy ints, tensors' items: plain ints (checked: cheaper)
        rows = [s if s is None or isinstance(s, str) else int(s) for s in rows]
    batch: dict[str, Any] = {"seq_ids": rows}
    for name, values in (("positions", positions), ("input_ids", input_ids)):
        found = _as_list(values)
        if found is None:
            continue
        listed, its_grid = found
        if len(listed) != len(rows) or (its_grid is not None and grid is not None and its_grid != grid):
            raise SequenceError(
                f"tracedump set_batch(): {len(listed)} {name} for {len(rows)} seq_ids; "
                "give one entry per token row"
            )
        batch[name] = listed if set(map(type, listed)) <= _INT else list(map(int, listed))
    if grid is not None and grid[0] * grid[1] > 0:
        batch["grid"] = grid
    return _ENCODE_COMPACT(batch)
