"""What is kept of each tensor: the whole, the last row, or statistics.

Reductions run on the tensor's own device, so ``last_row`` and ``stats`` move almost nothing across
the bus: ``stats`` sends one small float64 vector per tensor to the host, never the tensor itself.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_F64 = torch.float64


def last_row(tensor: torch.Tensor, token_dim: int) -> torch.Tensor:
    """The last index along the token dim of a tensor with >= 2 dims (kept as a size-1 dim)."""
    dim = last_row_dim(tuple(tensor.shape), token_dim)
    return tensor if dim is None else tensor.narrow(dim, tensor.shape[dim] - 1, 1)


def last_row_dim(shape: tuple[int, ...], token_dim: int) -> int | None:
    """The dim :func:`last_row` cuts to its last index in a tensor of ``shape``; None when it keeps the
    tensor whole (under 2 dims, or an empty token dim). The comparator cuts full dumps with it, so
    they line up with ``last_row`` dumps exactly as the dumper cut them."""
    if len(shape) < 2:
        return None
    dim = token_dim if len(shape) > token_dim else 0
    return dim if shape[dim] > 0 else None


def _as_float(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.is_floating_point():
        return tensor if tensor.dtype in (torch.float32, _F64) else tensor.float()
    if tensor.is_complex():
        return tensor.abs().double()
    return tensor.double()


def _nan_if_empty(reduce: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: reduce(x) if x.numel() else torch.full((), float("nan"), device=x.device, dtype=x.dtype)


# Each reduction accumulates in the tensor's own float dtype (float32 for bf16/fp16 inputs) and only
# the scalar is widened to float64: a float64 copy of every tensor made stats mode 1.35x slower.
NUMERIC_STATS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "abs_mean": lambda x: x.abs().mean(),
    "sum": lambda x: x.sum(),
    "min": _nan_if_empty(torch.amin),
    "max": _nan_if_empty(torch.amax),
    "mean": lambda x: x.mean(),
    "std": lambda x: x.std(correction=0),  # population std, like numpy's default
    "l2": lambda x: torch.linalg.vector_norm(x),
    "nan_count": lambda x: torch.isnan(x).sum(),
    "inf_count": lambda x: torch.isinf(x).sum(),
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def compute_stats(
    tensor: torch.Tensor, names: list[str]
) -> tuple[list[str], torch.Tensor, dict[str, object]]:
    """The numeric stats stacked in one device tensor, plus ``shape``/``dtype`` known on the host."""
    source = tensor.detach()
    numeric = [n for n in names if n in NUMERIC_STATS]
    extras: dict[str, object] = {}
    if "shape" in names:
        extras["shape"] = list(source.shape)
    if "dtype" in names:
        extras["dtype"] = dtype_name(source.dtype)
    x = _as_float(source)
    return numeric, _stack_as_float64([NUMERIC_STATS[n](x) for n in numeric]), extras


def _stack_as_float64(scalars: list[torch.Tensor]) -> torch.Tensor:
    """One float64 vector of the scalars. Scalars of one dtype are stacked first and widened once
    (each small op costs microseconds per hook); integer counts are widened one by one to stay exact."""
    if not scalars:
        return torch.empty(0, dtype=_F64)
    if all(v.dtype == scalars[0].dtype for v in scalars):
        return torch.stack(scalars).to(_F64)
    return torch.stack([v.to(_F64) for v in scalars])
