"""Comparing ``stats``-mode dumps: a handful of numbers per tensor instead of the tensor.

Each statistic both sides have is compared with a relative error. The denominators avoid false
alarms on statistics that are legitimately near zero:

- ``sum`` is scaled by ``abs_mean * numel`` and ``mean`` by ``abs_mean`` when those are known (a
  centred tensor's sum is noise around 0; its size is what its magnitude allows);
- ``nan_count`` and ``inf_count`` must match exactly;
- every other statistic by ``max(|a|, |b|)``.

When one side is a full dump, its statistics are computed here with the same code the dumper uses
(``tracedump.store.reduce.compute_stats``), so a stats dump of a 70B engine run can be checked against a
full dump of the HF reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...store.format import NUMERIC_STAT_NAMES as NUMERIC_STATS
from ..load.reader import Stored

_EXACT = frozenset({"nan_count", "inf_count"})


@dataclass(frozen=True)
class StatDelta:
    """One statistic on both sides and its relative error."""

    a: float
    b: float
    rel_err: float

    def to_json(self) -> dict[str, Any]:
        from ...store.format import json_number

        return {"a": json_number(self.a), "b": json_number(self.b), "rel_err": json_number(self.rel_err)}


def _representable(value: float, dtype: str) -> bool:
    """Whether ``value`` is exactly a number of ``dtype``; with numpy, so that a diff of stats
    dumps never imports torch. A bf16 number is an fp32 number whose low 16 bits are zero."""
    with np.errstate(over="ignore"):  # too large: inf, which is not the value
        as_float32 = np.float32(value)
        if dtype == "float16":
            return float(np.float16(value)) == value
    if float(as_float32) != value:
        return False
    return dtype == "float32" or not int(as_float32.view(np.uint32)) & 0xFFFF


def infer_dtype(record: dict[str, Any]) -> str | None:
    """The dtype a stats record was taken from: its ``dtype`` stat, else guessed from ``max``/``min``.

    ``max`` and ``min`` are element values, so they carry the tensor's precision: a bf16 tensor's max
    has its low 16 fp32 bits zero, an fp32 tensor's almost never (odds 2^-16). The guess picks the
    narrowest dtype that holds every such value exactly; with neither stat recorded it is None.
    """
    if isinstance(record.get("dtype"), str):
        return record["dtype"]
    values = [float(record[k]) for k in ("max", "min") if isinstance(record.get(k), (int, float))]
    values = [v for v in values if math.isfinite(v)]
    if not values:
        return None
    for name in ("bfloat16", "float16", "float32"):
        if all(_representable(v, name) for v in values):
            return name
    return "float64"


def numeric_stats(record: dict[str, Any]) -> dict[str, float]:
    """The numeric statistics of a ``stats.jsonl`` record (``"nan"``/``"inf"`` strings back to floats)."""
    return {name: float(record[name]) for name in NUMERIC_STATS if name in record}


def stats_of(stored: Stored, names: list[str]) -> dict[str, float]:
    """The statistics a stats-mode dump would have recorded for this tensor (with torch: the
    dumper's own code, so only a full-against-stats diff imports it)."""
    from ...store.reduce import compute_stats

    wanted = [n for n in names if n in NUMERIC_STATS]
    numeric, values, _ = compute_stats(stored.to_torch(), wanted)
    return dict(zip(numeric, values.tolist(), strict=True))


def _scale(name: str, a: float, b: float, stats_b: dict[str, float], numel: int | None) -> float:
    scale = max(abs(a), abs(b))
    abs_mean = stats_b.get("abs_mean")
    if abs_mean is not None and math.isfinite(abs_mean):
        if name == "sum" and numel:
            scale = max(scale, abs_mean * numel)
        elif name == "mean":
            scale = max(scale, abs_mean)
    return scale


def _relative(
    name: str, a: float, b: float, stats_b: dict[str, float], numel: int | None, atol: float
) -> float:
    if math.isnan(a) or math.isnan(b):
        return 0.0 if math.isnan(a) and math.isnan(b) else math.inf
    if math.isinf(a) or math.isinf(b):
        return 0.0 if a == b else math.inf
    gap = abs(a - b)
    if name in _EXACT:
        return 0.0 if gap == 0 else math.inf
    if gap <= atol:
        return 0.0
    scale = _scale(name, a, b, stats_b, numel)
    return gap / scale if scale > 0 else 0.0


def compare_stats(
    stats_a: dict[str, float], stats_b: dict[str, float], numel: int | None, atol: float
) -> tuple[float, dict[str, StatDelta]]:
    """The largest relative error over the statistics both sides have, and each one's delta."""
    deltas = {
        name: StatDelta(
            stats_a[name], stats_b[name], _relative(name, stats_a[name], stats_b[name], stats_b, numel, atol)
        )
        for name in stats_a
        if name in stats_b
    }
    worst = max((d.rel_err for d in deltas.values()), default=0.0)
    return worst, deltas
