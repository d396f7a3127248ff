"""The hot path's flat-tuple shortcut names leaves exactly as the general walk does."""

from __future__ import annotations

from collections import namedtuple
from typing import Any

import pytest
import torch

from tracedump.dump.hooks import distinct_keys, flatten_tensors, output_leaves


def _walked(value: Any) -> list[tuple[str, torch.Tensor]]:
    return distinct_keys(list(flatten_tensors(value)))


a, b, c = torch.zeros(2), torch.ones(3), torch.full((1,), 2.0)
Pair = namedtuple("Pair", "out residual")


@pytest.mark.parametrize(
    "value",
    [
        (a, None),  # a parallel linear's (out, bias)
        (a, b),  # a fused add + norm's (out, residual)
        [a, None, b],
        (None, None),
        (),
        (a, (b, c)),  # nested: the general walk
        (a, {"x": b}),
        (a, 3, b),  # a non-tensor leaf: the general walk
        tuple([a] * 20),  # longer than the shortcut's table
        Pair(a, b),  # a tuple subclass: the general walk
    ],
)
def test_flat_outputs_are_named_as_the_walk_names_them(value: Any) -> None:
    got = output_leaves(value)
    want = _walked(value)
    assert [path for path, _ in got] == [path for path, _ in want]
    assert all(x is y for (_, x), (_, y) in zip(got, want, strict=True))


def test_a_flat_tuple_keeps_its_indices_across_none() -> None:
    assert [path for path, _ in output_leaves((None, a, None, b))] == ["[1]", "[3]"]
