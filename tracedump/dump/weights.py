"""Which checkpoint tensors a model's parameters hold: the dump side of the correspondence.

Two runs that load one checkpoint under other names (vLLM's fused ``qkv_proj`` and HF's
``q_proj``/``k_proj``/``v_proj``) hold the same numbers. Each dumped run records, in
``correspondence.json`` (:mod:`tracedump.store.correspondence`), every parameter's full name, the
module holding it, its shape, dtype and a cheap fingerprint (:func:`fingerprint`); an engine that
loads the checkpoint itself (the vLLM plugin) adds, per parameter, which checkpoint tensors and
which slices of them filled it (:func:`written_region`, :func:`source_slices`). The comparator
pairs modules from those records (:mod:`tracedump.compare.pair.correspondence`), with no rule per family.

Runs only when dumping is on: at ``attach()`` and during an engine's weight load.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

FINGERPRINT_VALUES = 8  # values kept per tensor: spread over its flat index range


@torch.no_grad()
def fingerprint(tensor: torch.Tensor) -> list[float]:
    """A few of the tensor's values at fixed spread positions (the same positions for the same
    shape), as floats: enough to tell which checkpoint tensor a parameter holds when names differ
    (a tied head, a renamed module), cheap for any size. Empty for a tensor with no elements."""
    if tensor.device.type == "meta":  # no values (an offloaded or not yet materialised parameter)
        return []
    flat = tensor.detach().reshape(-1)
    n = flat.numel()
    if n == 0:
        return []
    count = min(FINGERPRINT_VALUES, n)
    index = torch.tensor([(i * (n - 1)) // max(count - 1, 1) for i in range(count)], device=flat.device)
    values = flat.index_select(0, index).to(torch.float64).cpu().tolist()
    return [float(f"{v:.6g}") for v in values]  # 6 digits: a dtype change still matches (1e-2)


def module_parameters(model: nn.Module) -> dict[str, dict[str, Any]]:
    """Every parameter of ``model`` by full name (shared ones under each name that holds them,
    ``same_as`` the first), with its module, shape, dtype and :func:`fingerprint`."""
    out: dict[str, dict[str, Any]] = {}
    first: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        module, _, _ = name.rpartition(".")
        entry: dict[str, Any] = {"module": module, "shape": list(param.shape), "dtype": str(param.dtype)}
        if id(param) in first:
            entry["same_as"] = first[id(param)]
        else:
            first[id(param)] = name
            entry["fingerprint"] = fingerprint(param) if param.is_floating_point() else []
        out[name] = entry
    return out


# ------------------------------------------------------------------ what one load call wrote


def written_region(written: torch.Tensor) -> list[list[int]] | None:
    """The bounding box ``[[start, stop], ...]`` per dim of a boolean mask of written elements;
    None when nothing was written, or the written elements do not fill their box."""
    if written.dim() == 0:
        return [] if bool(written) else None
    box = []
    for dim in range(written.dim()):
        others = [d for d in range(written.dim()) if d != dim]
        along = written.any(dim=others) if others else written
        hit = torch.nonzero(along).flatten()
        if hit.numel() == 0:
            return None
        box.append([int(hit[0]), int(hit[-1]) + 1])
    count = 1
    for start, stop in box:
        count *= stop - start
    return box if count == int(written.sum()) else None


def block_of(param: torch.Tensor, region: list[list[int]]) -> torch.Tensor:
    """The part of ``param`` inside ``region``."""
    block = param
    for dim, (start, stop) in enumerate(region):
        block = block.narrow(dim, start, stop - start)
    return block


@torch.no_grad()
def source_slices(block: torch.Tensor, loaded: torch.Tensor) -> dict[str, Any] | None:
    """Where the written ``block`` came from in the checkpoint tensor ``loaded``:
    ``{"cols": [start, stop] | None, "rows": [[block_row, loaded_row, count], ...]}`` where rows
    run along the block's first dim after leading size-1 dims (an expert's index) are dropped,
    and ``cols`` is the slice of ``loaded``'s second dim (a row-parallel shard). None when the
    values are not a copy of slices of ``loaded`` (a dtype change that rounds, a quantized load)."""
    block = block.detach()
    while block.dim() > loaded.dim() and block.shape[0] == 1:
        block = block[0]
    if block.dim() != loaded.dim() or block.dim() == 0:
        return None
    source = loaded.detach().to(device=block.device, dtype=block.dtype)
    if block.dim() == 1:
        start = _offset_1d(block, source)
        return None if start is None else {"cols": None, "rows": [[0, start, block.shape[0]]]}
    cols = None
    if block.shape[1:] != source.shape[1:]:
        if block.dim() != 2 or block.shape[1] > source.shape[1]:
            return None
        width = block.shape[1]
        for start in _candidates(source.shape[1], width):
            if torch.equal(source[:1, start : start + width], block[:1]) or block.shape[0] == 0:
                cols = [start, start + width]
                break
        if cols is None:
            return None
        source = source[:, cols[0] : cols[1]]
    rows = _row_runs(block, source)
    return None if rows is None else {"cols": cols, "rows": rows}


def _candidates(length: int, width: int) -> list[int]:
    """Offsets to try, multiples of ``width`` first (a tensor-parallel shard), then the rest."""
    aligned = list(range(0, length - width + 1, width)) if width else [0]
    return aligned + [o for o in range(length - width + 1) if width and o % width]


def _offset_1d(block: torch.Tensor, source: torch.Tensor) -> int | None:
    width = block.shape[0]
    for start in _candidates(source.shape[0], width):
        if torch.equal(source[start : start + width], block):
            return start
    return None


def _row_runs(block: torch.Tensor, source: torch.Tensor) -> list[list[int]] | None:
    """``[[block_row, source_row, count], ...]``: each run of block rows that is a run of source
    rows, found by each row's bytes and checked whole; None when a row is not in ``source``."""
    flat_source = source.reshape(source.shape[0], -1)
    flat_block = block.reshape(block.shape[0], -1)
    where: dict[bytes, list[int]] = {}
    for i, row in enumerate(flat_source):
        where.setdefault(_row_key(row), []).append(i)
    runs: list[list[int]] = []
    for i, row in enumerate(flat_block):
        found = where.get(_row_key(row))
        if not found:
            return None
        if runs and runs[-1][1] + runs[-1][2] in found and runs[-1][0] + runs[-1][2] == i:
            runs[-1][2] += 1
        else:
            runs.append([i, found[0], 1])
    for start, origin, count in runs:
        if not torch.equal(flat_block[start : start + count], flat_source[origin : origin + count]):
            return None
    return runs


KEY_VALUES = 16  # a row is looked up by its first values; each run found is then checked whole


def _row_key(row: torch.Tensor) -> bytes:
    """A row's first values as bytes, whatever its dtype (numpy has no bfloat16)."""
    return bytes(row[:KEY_VALUES].contiguous().view(torch.uint8).cpu().numpy().tobytes())
