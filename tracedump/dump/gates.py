"""Gates that keep a dump comparable with a batch-1 reference: the token gate and the row gate.

An engine runs forwards that a reference never runs: warm-up batches with padded shapes, whose
captures the gates drop so that the remaining passes line up with the reference, and a dummy
profile forward, switched off as a whole by ``tracedump.profiling()`` (:mod:`tracedump.dump.suspend`).
"""

from __future__ import annotations

import torch


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
