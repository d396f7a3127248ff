"""Rows gathered from several passes are measured where they lie, exactly as their join is."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from tracedump.compare.load.reader import GatheredRows, Stored
from tracedump.compare.measure import metrics
from tracedump.compare.measure.metrics import compare_arrays, compare_by_row


def _rows(seed: int, count: int, width: int = 40) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((count, width)).astype(np.float32)


def _split(array: np.ndarray, sizes: list[int]) -> GatheredRows:
    edges = np.cumsum([0, *sizes])
    return GatheredRows([array[a:b] for a, b in itertools.pairwise(edges)], "float32")


@pytest.fixture(autouse=True)
def _small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 3 rows of 40: parts of 1 to 11 rows straddle chunk edges, several per part."""
    monkeypatch.setattr(metrics, "CHUNK", 120)


@pytest.mark.parametrize("sizes_a,sizes_b", [([5, 1, 11, 3], [20]), ([7, 13], [2, 2, 16]), ([20], [20])])
def test_parts_measure_as_their_join(sizes_a: list[int], sizes_b: list[int]) -> None:
    a, b = _rows(0, 20), _rows(0, 20)
    b[13, 7] += 0.5  # the largest error, in the third part of A's first split
    b[2] *= 1.01
    joined = compare_by_row(Stored(a, "float32"), Stored(b, "float32"))
    parts = compare_by_row(_split(a, sizes_a), _split(b, sizes_b))
    assert parts[0] == joined[0]
    assert parts[1] is not None and joined[1] is not None
    np.testing.assert_array_equal(parts[1].dd, joined[1].dd)
    np.testing.assert_array_equal(parts[1].norm, joined[1].norm)
    assert joined[0].argmax == 13 * 40 + 7


def test_a_nan_in_one_part_is_counted_as_in_the_join() -> None:
    a, b = _rows(1, 12), _rows(1, 12)
    a[9, 3] = math.nan
    gathered = compare_arrays(_split(a, [4, 4, 4]), _split(b, [12]))
    assert gathered == compare_arrays(Stored(a, "float32"), Stored(b, "float32"))
    assert gathered.nan_a == 1


def test_the_join_is_made_only_when_asked_for() -> None:
    a = _rows(2, 6)
    rows = _split(a, [2, 4])
    assert rows.shape == (6, 40)
    assert rows.unjoined() is not None
    compare_arrays(rows, Stored(a, "float32"))
    assert rows.unjoined() is not None  # measuring read the parts where they lie
    np.testing.assert_array_equal(rows.array, a)
    assert rows.unjoined() is None  # joined once asked for: from then on that array is read
    assert compare_arrays(rows, Stored(a, "float32")).max_abs == 0


def test_no_parts_is_refused() -> None:
    with pytest.raises(ValueError):
        GatheredRows([], "float32")


def test_parts_measure_as_their_join_at_the_real_chunk_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks keep the joined array's grid whatever the parts: the kernel's fp32 lanes add in the
    same order, so the sums are the join's bit for bit, not only to rounding."""
    monkeypatch.setattr(metrics, "CHUNK", 1 << 18)
    rng = np.random.default_rng(3)
    a = rng.standard_normal((9000, 64)).astype(np.float32)
    b = a + rng.standard_normal(a.shape).astype(np.float32) * 1e-3
    b[4321, 5] = np.nan
    joined = compare_by_row(Stored(a, "float32"), Stored(b, "float32"))
    parts = compare_by_row(_split(a, [1234, 3000, 1, 4765]), _split(b, [4500, 4500]))
    assert parts[0] == joined[0]
    assert parts[1] is not None and joined[1] is not None
    np.testing.assert_array_equal(parts[1].dd, joined[1].dd)
    np.testing.assert_array_equal(parts[1].norm, joined[1].norm)


@pytest.mark.parametrize("shape", [(0, 64), (0,), (3, 0)])
def test_empty_tensors_measure_as_before(shape: tuple[int, ...]) -> None:
    empty = np.zeros(shape, np.float32)
    result = compare_arrays(Stored(empty, "float32"), Stored(empty.copy(), "float32"))
    assert result.max_abs == 0 and result.rel_diff == 0
    assert compare_by_row(Stored(empty, "float32"), Stored(empty.copy(), "float32"))[0] == result
