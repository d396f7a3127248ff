"""HF transformers: the batch layout of each root forward, from its own inputs, with no ``set_batch``.

An HF reference is usually run as one padded batch through ``generate()``: ``input_ids`` and
``attention_mask`` of ``[batch, seq]``, left (or right) padding, then one token per row per step with
a KV cache. To pair its rows with an engine's requests under ``tracedump diff --align tokens``, each
root forward of a ``PreTrainedModel`` gets the layout ``set_batch`` would store for it:

- the rows are the ``[batch, seq]`` grid of the forward's ``input_ids`` (or ``inputs_embeds``);
- a row's **sequence id** is an int counting the sequences of the run in order: a forward with an
  empty cache (a prefill) starts ``batch`` new sequences, numbered on from the last one (row 0 of
  the first ``generate`` is sequence 0, row 1 sequence 1, the next ``generate``'s row 0 sequence
  2, ...); a forward with a cache continues the previous forward's sequences row by row. A batch-1
  reference run prompt by prompt in the same order numbers them alike, and a vLLM run's requests
  (named by request id) pair with them by their tokens;
- a row's **position** is its index among its row's real tokens: ``attention_mask.cumsum(-1) - 1``
  over the whole mask (past and present), so left padding shifts nothing; without a mask, the
  forward's 2-D ``position_ids``, else the cache length plus the row's offset;
- a cell whose mask is 0 is **padding**: seq id ``None``, never compared.

Why it lives on the dump side: it is no engine plugin but part of how every dumper reads an HF
model's root forward (it needs nothing but the inputs and :mod:`tracedump.store.sequences`), so
``dumper.py`` picks it without the dump side depending on ``tracedump.integrations`` (which
depends on the dump side). ``tracedump.integrations.hf`` still names it.

Nothing is imported from transformers: a model is recognised by a ``PreTrainedModel`` of the
``transformers`` package in its class's MRO. Encoder-decoder models (two token grids in one forward)
get no layout. The layout is built once per selected pass, from the forward's small integer
tensors (``tolist``: on CUDA, one sync per pass); the bookkeeping that numbers sequences runs at
every outermost root forward and reads shapes only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..store.sequences import batch_metadata


def is_transformers_model(model: nn.Module) -> bool:
    """A ``transformers.PreTrainedModel``, found by name in the MRO (nothing is imported)."""
    return any(
        cls.__name__ == "PreTrainedModel" and cls.__module__.partition(".")[0] == "transformers"
        for cls in type(model).__mro__
    )


def batch_layout_for(model: nn.Module) -> HFBatchLayout | None:
    """The layout keeper of a transformers decoder model; None for any other model."""
    if not is_transformers_model(model):
        return None
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        return None
    return HFBatchLayout()


def _tensor(value: Any, dims: int) -> torch.Tensor | None:
    return value if isinstance(value, torch.Tensor) and value.dim() == dims else None


class HFBatchLayout:
    """Numbers an HF model's sequences over its root forwards and builds each one's layout."""

    def __init__(self) -> None:
        self.next_id = 0  # the next new sequence's id
        self.rows: list[int] = []  # the sequence id of each batch row of the last forward

    def observe(self, args: tuple[Any, ...], kwargs: Mapping[str, Any], wanted: bool) -> str | None:
        """Account for one outermost root forward; its ``tracedump.batch`` JSON when ``wanted``
        (None when the forward has no token grid, or is not wanted)."""
        ids = _tensor(kwargs.get("input_ids"), 2)
        if ids is None and args and kwargs.get("input_ids") is None:
            first = args[0]
            if isinstance(first, torch.Tensor) and not first.is_floating_point():
                ids = _tensor(first, 2)
        embeds = _tensor(kwargs.get("inputs_embeds"), 3)
        grid = ids if ids is not None else embeds
        if grid is None:
            return None
        batch, seq = grid.shape[0], grid.shape[1]
        mask = _tensor(kwargs.get("attention_mask"), 2)
        past = _cache_length(kwargs, mask, seq)
        if past == 0 or len(self.rows) != batch:
            self.rows = list(range(self.next_id, self.next_id + batch))
            self.next_id += batch
        if not wanted or batch * seq == 0:
            return None
        positions, real = _positions(mask, _tensor(kwargs.get("position_ids"), 2), batch, seq, past)
        if real is None:  # no padding: every cell is its row's sequence
            seq_ids: list[list[int | None]] = [[sid] * seq for sid in self.rows]
        else:
            cells = zip(self.rows, real, strict=True)
            seq_ids = [[sid if keep else None for keep in row] for sid, row in cells]
            positions = [
                [p if keep else -1 for p, keep in zip(row, keep_row, strict=True)]
                for row, keep_row in zip(positions, real, strict=True)
            ]
        return batch_metadata(seq_ids, positions, ids)


def _cache_length(kwargs: Mapping[str, Any], mask: torch.Tensor | None, seq: int) -> int:
    """Tokens already in the cache: the cache's own length, else the mask's extra columns, else
    ``cache_position`` (a sync on CUDA), else 0."""
    cache = kwargs.get("past_key_values", kwargs.get("cache"))
    length = getattr(cache, "get_seq_length", None)
    if callable(length):
        try:
            return int(length())
        except Exception:  # a cache type of its own: fall back to the mask
            pass
    if mask is not None:
        return max(mask.shape[-1] - seq, 0)
    cache_position = _tensor(kwargs.get("cache_position"), 1)
    if cache_position is not None and cache_position.numel():
        return int(cache_position[0])
    return 0


def _positions(
    mask: torch.Tensor | None, position_ids: torch.Tensor | None, batch: int, seq: int, past: int
) -> tuple[list[list[int]], list[list[bool]] | None]:
    """Each cell's position in its row's sequence and whether it is a real token (None: all are)."""
    if mask is not None and mask.shape == (batch, past + seq):
        taken = mask.detach() != 0
        if bool(taken.all()):  # no padding anywhere (a batch-1 run): positions count on from the cache
            return [list(range(past, past + seq)) for _ in range(batch)], None
        counted = taken.long().cumsum(-1)[:, -seq:] - 1
        return counted.tolist(), taken[:, -seq:].tolist()
    if position_ids is not None and position_ids.shape[-1] == seq and position_ids.shape[0] in (1, batch):
        return position_ids.detach().expand(batch, seq).tolist(), None
    return [list(range(past, past + seq)) for _ in range(batch)], None
