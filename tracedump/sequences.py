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
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .format import BATCH_KEY

SeqId = int | str


class SequenceError(ValueError):
    """Sequence metadata that cannot be lined up (names the pass and the sequence)."""


@dataclass(frozen=True)
class Batch:
    """The rows of one pass: per row its sequence id, position, and token id when known."""

    pass_index: int
    seq_ids: tuple[SeqId, ...]
    positions: tuple[int, ...]
    input_ids: tuple[int, ...] | None
    declared: bool  # from set_batch(); False when inferred (one sequence per pass)

    @property
    def tokens(self) -> int:
        return len(self.seq_ids)

    def summary(self) -> str:
        """For ``tracedump ls``: ``seq 0: 0-5, seq 1: 3`` (positions held per sequence)."""
        parts = []
        for seq in dict.fromkeys(self.seq_ids):
            held = [position for s, position in zip(self.seq_ids, self.positions, strict=True) if s == seq]
            span = f"{min(held)}-{max(held)}" if len(held) > 1 else str(held[0])
            parts.append(f"{seq}: {span}")
        return ", ".join(parts)


@dataclass
class Sequence:
    """One sequence over a run: which pass holds each of its positions, at which row."""

    seq_id: SeqId
    rows: dict[int, tuple[int, int]] = field(default_factory=dict)  # position -> (pass, row)
    input_ids: dict[int, int] = field(default_factory=dict)  # position -> token id

    @property
    def positions(self) -> list[int]:
        return sorted(self.rows)

    def rows_by_pass(self, positions: list[int]) -> dict[int, list[int]]:
        """The rows of ``positions`` grouped by the pass that holds them, in position order."""
        by_pass: dict[int, list[int]] = {}
        for position in positions:
            index, row = self.rows[position]
            by_pass.setdefault(index, []).append(row)
        return by_pass

    def tokens(self) -> list[int] | None:
        """Token ids in position order from 0, when every position has one."""
        positions = self.positions
        if positions and positions == list(range(len(positions))) and set(positions) <= self.input_ids.keys():
            return [self.input_ids[p] for p in positions]
        return None


def parse_batch(pass_index: int, metadata: dict[str, str]) -> dict[str, list[Any]] | None:
    """The raw ``tracedump.batch`` of a pass, checked for shape; None when the pass has none."""
    text = metadata.get(BATCH_KEY)
    if text is None:
        return None
    try:
        raw = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise SequenceError(f"pass {pass_index}: {BATCH_KEY} is not JSON ({e})") from e
    seq_ids = raw.get("seq_ids") if isinstance(raw, dict) else None
    if not isinstance(seq_ids, list) or not all(isinstance(s, (int, str)) for s in seq_ids):
        raise SequenceError(f"pass {pass_index}: {BATCH_KEY} has no list of seq_ids")
    for name in ("positions", "input_ids"):
        values = raw.get(name)
        if values is not None and (
            not isinstance(values, list)
            or len(values) != len(seq_ids)
            or not all(isinstance(v, int) for v in values)
        ):
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
        tokens = token_count(shapes_of(index))
        if raw is not None:
            seq_ids, given, positions = tuple(raw["seq_ids"]), raw.get("positions"), []
            for row, seq in enumerate(seq_ids):  # without given positions, each sequence continues
                positions.append(next_position.get(seq, 0) if given is None else given[row])
                next_position[seq] = max(next_position.get(seq, 0), positions[-1] + 1)
            if tokens is not None and tokens != len(seq_ids):
                raise SequenceError(
                    f"pass {index}: set_batch() declared {len(seq_ids)} rows (sequences "
                    f"{', '.join(map(str, dict.fromkeys(seq_ids)))}) but the pass's tensors hold {tokens}"
                )
            input_ids = raw.get("input_ids")
            out[index] = Batch(
                index, seq_ids, tuple(positions), tuple(input_ids) if input_ids else None, True
            )
            continue
        if tokens is None:
            continue
        if tokens > 1 or last_inferred is None:
            last_inferred = f"pass{index}"
        start = next_position.get(last_inferred, 0)
        next_position[last_inferred] = start + tokens
        out[index] = Batch(index, (last_inferred,) * tokens, tuple(range(start, start + tokens)), None, False)
    return out


def sequences(found: dict[int, Batch]) -> dict[SeqId, Sequence]:
    """Each sequence's positions over the passes; repeated or jumping positions raise, naming the
    pass and the sequence (a silent mis-alignment would compare the wrong rows)."""
    out: dict[SeqId, Sequence] = {}
    for index in sorted(found):
        batch = found[index]
        for row, (seq, position) in enumerate(zip(batch.seq_ids, batch.positions, strict=True)):
            sequence = out.setdefault(seq, Sequence(seq))
            if position in sequence.rows:
                earlier = sequence.rows[position][0]
                raise SequenceError(
                    f"pass {index}: sequence {seq!r} holds position {position} again (first in pass "
                    f"{earlier})"
                )
            sequence.rows[position] = (index, row)
            if batch.input_ids is not None:
                sequence.input_ids[position] = batch.input_ids[row]
    for sequence in out.values():
        positions = sequence.positions
        if positions and positions != list(range(positions[0], positions[0] + len(positions))):
            gap = next(p for a, p in itertools.pairwise(positions) if p != a + 1)
            raise SequenceError(
                f"pass {sequence.rows[gap][0]}: sequence {sequence.seq_id!r} jumps to position {gap} "
                f"(positions held: {_span(positions)})"
            )
    return out


def _span(positions: list[int]) -> str:
    return ",".join(map(str, positions[:12])) + (" ..." if len(positions) > 12 else "")


# ------------------------------------------------------------------ the writing side: set_batch()


def _as_list(values: Any) -> list[Any] | None:
    """A host list of ``values``: a sequence, or a tensor (flattened; a CUDA one costs a sync)."""
    if values is None:
        return None
    if hasattr(values, "detach"):
        return values.detach().reshape(-1).cpu().tolist()
    return list(values)


def batch_metadata(seq_ids: Any, positions: Any, input_ids: Any) -> str:
    """The ``tracedump.batch`` JSON of one step (lists or tensors in), checked: one entry per token
    row in every list."""
    rows = _as_list(seq_ids) or []
    batch: dict[str, list[Any]] = {"seq_ids": [s if isinstance(s, str) else int(s) for s in rows]}
    for name, values in (("positions", positions), ("input_ids", input_ids)):
        listed = _as_list(values)
        if listed is None:
            continue
        if len(listed) != len(rows):
            raise ValueError(
                f"tracedump set_batch(): {len(listed)} {name} for {len(rows)} seq_ids; "
                "give one entry per token row"
            )
        batch[name] = [int(v) for v in listed]
    return json.dumps(batch, separators=(",", ":"))
