"""Row sums of a measured pair: what its per-token errors are made of.

Kept apart from :mod:`.metrics` (the chunked pass that fills them): each token's rel_diff from its
rows' Σd² and Σ(a² + b²), and a row's sums redone in float64 over its finite positions where the
fp32 ones are not finite or underflowed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RowSums:
    """Per row of the last dim: Σd² and Σ(a² + b²) over the positions finite on both sides."""

    dd: np.ndarray  # float64, one per row
    norm: np.ndarray


def per_token_from_rows(rows: RowSums, shape: tuple[int, ...], dim: int) -> tuple[float, ...]:
    """Each token's rows added up, over every other dim (``dim`` is not the last dim)."""
    per_row = shape[:-1]
    others = tuple(axis for axis in range(len(per_row)) if axis != dim)
    return token_rel_diff(
        rows.dd.reshape(per_row).sum(axis=others), rows.norm.reshape(per_row).sum(axis=others)
    )


def token_rel_diff(dd: np.ndarray, norm: np.ndarray) -> tuple[float, ...]:
    """rel_diff of each token from its Σd² and Σ(a² + b²): 1 where only the error is nonzero."""
    empty = np.where(dd > 0, 1.0, 0.0)
    with np.errstate(all="ignore"):  # an infinite sum gives inf or NaN for its token, not a warning
        rel = np.divide(dd, norm, out=empty, where=norm > 0)
    return tuple(rel.tolist())


def finite_rows(
    x: np.ndarray, y: np.ndarray, both: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Each row's Σd² and Σ(a² + b²) in float64 over its positions finite on both sides (``both``,
    when the caller has it): NaN/Inf rows, and rows whose fp32 sums overflowed or underflowed."""
    if both is None:
        both = np.isfinite(x) & np.isfinite(y)
    xz = np.where(both, np.asarray(x, dtype=np.float64), 0.0)
    yz = np.where(both, np.asarray(y, dtype=np.float64), 0.0)
    dz = xz - yz
    return np.einsum("ij,ij->i", dz, dz), np.einsum("ij,ij->i", xz, xz) + np.einsum("ij,ij->i", yz, yz)
