"""Gates that keep a dump comparable with a batch-1 reference, and the profiling suspend.

An engine runs forwards that a reference never runs: a dummy profile forward, warm-up batches with
padded shapes. The gates drop those captures so the remaining passes line up with the reference.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

import torch

# Per thread (and per asyncio task): a profile run on one thread must not suspend another's forward.
_suspension: ContextVar[int] = ContextVar("tracedump_suspension", default=0)


@contextlib.contextmanager
def profiling() -> Iterator[None]:
    """Suspend every dumper for the block: nothing is captured and no pass index is used.

    Wrap an engine's dummy profile forward in it. Works whether or not a dumper exists.
    """
    token = _suspension.set(_suspension.get() + 1)
    try:
        yield
    finally:
        _suspension.reset(token)


def globally_suspended() -> bool:
    return _suspension.get() > 0


def token_count(tensor: torch.Tensor, token_dim: int) -> int | None:
    """Size of the token dimension; tensors with fewer dims are judged by their leading dim."""
    if tensor.dim() == 0:
        return None
    return tensor.shape[token_dim] if tensor.dim() > token_dim else tensor.shape[0]


def token_gate_allows(tensor: torch.Tensor, tokens: int | None, token_dim: int) -> bool:
    """The token gate: without a token setting everything passes; else only N-token tensors."""
    return tokens is None or token_count(tensor, token_dim) == tokens


def row_gate_allows(rows: int | None, max_rows: int | None) -> bool:
    """The row gate: closed while the rows the engine last reported exceed ``max_rows``."""
    return max_rows is None or rows is None or rows <= max_rows
