"""store/sequences.sequence_rows: the one gathering of a sequence's rows, the same cells whether the
caller holds torch tensors (``Run.sequence``) or numpy arrays (``diff --align tokens``)."""

from __future__ import annotations

import numpy as np
import torch

from tracedump.store.sequences import Batch, RowCut, sequence_rows, sequences


def _batches() -> dict[int, Batch]:
    """Pass 0: a [2, 3] grid of two prefills (a, b); pass 1: one decode step of each."""
    prefill = Batch(
        pass_index=0,
        seq_ids=("a",) * 3 + ("b",) * 3,
        positions=(0, 1, 2, 0, 1, 2),
        input_ids=None,
        declared=True,
        grid=(2, 3),
    )
    decode = Batch(pass_index=1, seq_ids=("a", "b"), positions=(3, 3), input_ids=None, declared=True)
    return {0: prefill, 1: decode}


SHAPES = {0: (2, 3, 1, 4), 1: (2, 1, 4)}  # [batch, seq, 1, hidden] then [tokens, 1, hidden]


def _values(index: int) -> np.ndarray:
    return np.arange(np.prod(SHAPES[index]), dtype=np.float32).reshape(SHAPES[index]) + 100 * index


def test_torch_and_numpy_gather_the_same_cells() -> None:
    found = _batches()
    sequence = sequences(found)["b"]

    def take_numpy(cut: RowCut) -> np.ndarray:
        return np.moveaxis(np.take(_values(cut.pass_index).reshape(cut.shape), cut.rows, cut.dim), cut.dim, 0)

    def take_torch(cut: RowCut) -> torch.Tensor:
        tensor = torch.from_numpy(_values(cut.pass_index)).reshape(cut.shape)
        return tensor.index_select(cut.dim, torch.tensor(cut.rows)).movedim(cut.dim, 0)

    args = (sequence, sequence.positions, found, SHAPES.__getitem__)
    numpy_rows = sequence_rows(*args, take_numpy, 0, sampled=False)
    torch_rows = sequence_rows(*args, take_torch, 0, sampled=False)
    assert not isinstance(numpy_rows, str) and not isinstance(torch_rows, str)
    assert [p.shape for p in numpy_rows] == [(3, 4), (1, 4)]  # size-1 dims dropped
    joined = np.concatenate(numpy_rows)
    assert np.array_equal(joined, torch.cat(torch_rows).numpy())
    # b holds the grid's second row (cells 3, 4, 5) and the decode step's second token
    assert np.array_equal(joined[:3], _values(0).reshape(6, 4)[3:])
    assert np.array_equal(joined[3], _values(1).reshape(2, 4)[1])


def test_why_rows_cannot_be_gathered() -> None:
    found = _batches()
    sequence = sequences(found)["a"]
    never = lambda cut: np.zeros(0)  # noqa: E731 - never reached: pass 0 already says why
    missing = lambda index: f"not in pass {index}"  # noqa: E731
    assert (
        sequence_rows(sequence, sequence.positions, found, missing, never, 0, sampled=False)
        == "not in pass 0"
    )
    no_tokens = {0: (5, 4), 1: (5, 4)}
    why = sequence_rows(sequence, sequence.positions, found, no_tokens.__getitem__, never, 0, sampled=False)
    assert why == "no token dim of size 6 ([2, 3]) in [5, 4]"


def test_a_sampled_tensor_gives_the_sequences_row_for_each_position() -> None:
    """Logits [sequences, vocab] of a decode step of three sequences' worth of rows."""
    step = Batch(pass_index=0, seq_ids=("a", "a", "b"), positions=(0, 1, 0), input_ids=None, declared=True)
    sequence = sequences({0: step})["b"]
    shape = (2, 7)  # one row per sequence: a, then b

    def take(cut: RowCut) -> np.ndarray:
        return np.take(np.arange(14).reshape(shape), cut.rows, cut.dim)

    rows = sequence_rows(sequence, sequence.positions, {0: step}, lambda _: shape, take, 0, sampled=True)
    assert not isinstance(rows, str) and rows[0].tolist() == [list(range(7, 14))]
    tokens_only = sequence_rows(
        sequence, sequence.positions, {0: step}, lambda _: shape, take, 0, sampled=False
    )
    assert isinstance(tokens_only, str)
