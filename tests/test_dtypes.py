"""The one dtype table (tracedump/store/dtypes.py): its explicit precision order is the one
docs/comparator.md states, and every table derived from it holds the values the per-dtype literals
it replaced held (copied here verbatim from before the table existed)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from tracedump.compare.judge import tolerance, verdict
from tracedump.compare.load import reader
from tracedump.compare.load.reader import Stored, stored_from_torch, widen
from tracedump.compare.measure import metrics
from tracedump.store import dtypes, header, stformat

DOCS = Path(__file__).resolve().parent.parent / "docs"

OLD_REL_DIFF = {
    "float64": 1e-10,
    "float32": 1e-8,
    "tfloat32": 2e-4,
    "float16": 2e-4,
    "bfloat16": 1e-2,
    "float8_e4m3fn": 5e-2,
    "float8_e4m3fnuz": 5e-2,
    "float8_e5m2": 2e-1,
    "float8_e5m2fnuz": 2e-1,
}
OLD_MAX_ABS = {
    "float64": (1e-7, 1e-7),
    "float32": (1.3e-6, 1e-5),
    "tfloat32": (1e-3, 1e-5),
    "float16": (1e-3, 1e-5),
    "bfloat16": (1.6e-2, 1e-5),
    "float8_e4m3fn": (1.25e-1, 1e-3),
    "float8_e4m3fnuz": (1.25e-1, 1e-3),
    "float8_e5m2": (2.5e-1, 1e-3),
    "float8_e5m2fnuz": (2.5e-1, 1e-3),
}
OLD_STATS = {
    "float64": 1e-6,
    "float32": 1e-5,
    "tfloat32": 2e-2,
    "float16": 2e-2,
    "bfloat16": 1e-1,
    "float8_e4m3fn": 3e-1,
    "float8_e4m3fnuz": 3e-1,
    "float8_e5m2": 5e-1,
    "float8_e5m2fnuz": 5e-1,
}
OLD_UNIT_ROUNDOFF = {
    "float64": 2.0**-53,
    "float32": 2.0**-24,
    "tfloat32": 2.0**-11,
    "float16": 2.0**-11,
    "bfloat16": 2.0**-8,
    "float8_e4m3fn": 2.0**-4,
    "float8_e4m3fnuz": 2.0**-4,
    "float8_e5m2": 2.0**-3,
    "float8_e5m2fnuz": 2.0**-3,
}
OLD_INTEGERS = {"bool", "uint8", "int8", "int16", "uint16", "int32", "uint32", "int64", "uint64"}
OLD_CODES_ON_DISK_ORDER = {
    "U64": "uint64",
    "I64": "int64",
    "F64": "float64",
    "C64": "complex64",
    "F32": "float32",
    "U32": "uint32",
    "I32": "int32",
    "BF16": "bfloat16",
    "F16": "float16",
    "U16": "uint16",
    "I16": "int16",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E8M0": "float8_e8m0fnu",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I8": "int8",
    "U8": "uint8",
    "F6_E3M2": "float6_e3m2fn",  # safetensors' sub-byte MX floats: no torch dtype, compared bitwise
    "F6_E2M3": "float6_e2m3fn",
    "F4": "float4_e2m1fn_x2",
    "BOOL": "bool",
}
SUB_BYTE = {"F6_E3M2": 6, "F6_E2M3": 6}
OLD_WIDTHS = {**dict.fromkeys(("F64", "I64", "U64", "C64"), 8), **dict.fromkeys(("F32", "I32", "U32"), 4)}
OLD_WIDTHS |= dict.fromkeys(("BF16", "F16", "I16", "U16"), 2)
OLD_STORAGE = {
    "float64": np.float64,
    "float32": np.float32,
    "float16": np.float16,
    "bfloat16": np.uint16,
    "float8_e4m3fn": np.uint8,
    "float8_e5m2": np.uint8,
    "float8_e4m3fnuz": np.uint8,
    "float8_e5m2fnuz": np.uint8,
    "float8_e8m0fnu": np.uint8,
    "float4_e2m1fn_x2": np.uint8,
    "float6_e3m2fn": np.uint8,
    "float6_e2m3fn": np.uint8,
    "complex64": np.float32,
    "int64": np.int64,
    "int32": np.int32,
    "int16": np.int16,
    "int8": np.int8,
    "uint64": np.uint64,
    "uint32": np.uint32,
    "uint16": np.uint16,
    "uint8": np.uint8,
    "bool": np.bool_,
}
OLD_BITS_VIEW = {name for name in OLD_STORAGE if name.startswith(("bfloat", "float8", "float4", "float6_"))}
OLD_FP8 = {"float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"}
OLD_WIDE = {"float64", "int64", "uint64", "int32", "uint32"}
OLD_SHORT = {"float64": "fp64", "float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def test_the_precision_order_is_the_one_the_docs_state() -> None:
    """docs/comparator.md's table of per-dtype ceilings lists the run precisions most precise first;
    the table's explicit ranks give that order (the fnuz variants each just after their fn twin)."""
    text = (DOCS / "comparator.md").read_text()
    table = text.split("### Per-dtype ceilings", 1)[1].split("How the flags combine", 1)[0]
    documented = [m.group(1) for m in re.finditer(r"^\| (\w+)[ |]", table, re.M) if m.group(1) != "run"]
    documented = [d for d in documented if d != "integers"]
    assert documented == [
        "float64",
        "float32",
        "tfloat32",
        "float16",
        "bfloat16",
        "float8_e4m3fn",
        "float8_e5m2",
    ]
    assert [d for d in dtypes.PRECISION_ORDER if d in documented] == documented
    assert tuple(OLD_REL_DIFF) == dtypes.PRECISION_ORDER
    ranks = [dtypes.BY_NAME[d].precision_rank for d in dtypes.PRECISION_ORDER]
    assert ranks == sorted(set(ranks))  # distinct: no tie left to the order of a literal
    for row in table.splitlines():  # and the documented values are the table's
        cells = [c.strip() for c in row.strip("|").split("|")]
        name = cells[0].split(" ")[0]
        if name in dtypes.BY_NAME:
            entry = dtypes.BY_NAME[name]
            assert float(cells[1].strip("*")) == entry.rel_diff, name
            assert tuple(float(v) for v in cells[2].split(",")) == entry.max_abs, name
            assert float(cells[3]) == entry.stats, name


def test_less_precise_follows_the_ranks() -> None:
    assert tolerance.less_precise("tfloat32", "float16") == "float16"
    assert tolerance.less_precise("float8_e4m3fnuz", "float8_e4m3fn") == "float8_e4m3fnuz"
    assert tolerance.less_precise("complex64", "float64") == "complex64"  # unranked: as float32


def test_the_derived_tables_hold_the_old_values() -> None:
    assert tolerance.REL_DIFF_DEFAULTS == OLD_REL_DIFF
    assert tolerance.MAX_ABS_DEFAULTS == OLD_MAX_ABS
    assert tolerance.STATS_DEFAULTS == OLD_STATS
    assert tuple(OLD_REL_DIFF) == tolerance.PRECISION_ORDER
    assert tolerance.INTEGER_DTYPES == OLD_INTEGERS
    assert verdict.UNIT_ROUNDOFF == OLD_UNIT_ROUNDOFF
    assert list(stformat.CODES_ON_DISK_ORDER.items()) == list(OLD_CODES_ON_DISK_ORDER.items())
    widths = {code: OLD_WIDTHS.get(code, 1) for code in OLD_CODES_ON_DISK_ORDER if code not in SUB_BYTE}
    assert widths == dtypes.ELEMENT_BYTES
    assert dtypes.ELEMENT_BITS == SUB_BYTE
    assert {name: np.dtype(t) for name, t in OLD_STORAGE.items()} == reader._STORAGE
    assert dtypes.BITS_STORED == OLD_BITS_VIEW
    assert dtypes.TORCH_WIDENED == OLD_FP8
    assert metrics.WIDER_THAN_FLOAT32 == dtypes.WIDER_THAN_FLOAT32 == OLD_WIDE
    assert dtypes.SHORT_NAMES == OLD_SHORT
    assert header.ELEMENT_BYTES is dtypes.ELEMENT_BYTES


@pytest.mark.parametrize("name", sorted(dtypes.CODES_ON_DISK_ORDER.values()))
def test_each_stored_dtype_is_torchs_and_takes_its_bytes(name: str) -> None:
    real = getattr(torch, name, None)
    if real is None:
        pytest.skip(f"torch {torch.__version__} has no {name}")
    entry = dtypes.BY_NAME[name]
    assert torch.empty((), dtype=real).element_size() == entry.bytes
    assert real.is_floating_point == (entry.kind in ("float", "packed"))


def _old_as_float(stored: Stored) -> np.ndarray:
    """routing.as_float, as it was."""
    raw = stored.array
    if stored.dtype == "bfloat16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    if stored.dtype.startswith("float8"):
        return stored.to_torch().float().numpy()
    return raw if raw.dtype == np.float64 else raw.astype(np.float32)


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int64, torch.float8_e4m3fn]
)
def test_widen_gives_the_numbers_the_four_widenings_gave(dtype: torch.dtype) -> None:
    values = torch.randn(257, generator=torch.Generator().manual_seed(3)) * 1000
    stored = stored_from_torch(values.to(dtype))
    whole = widen(stored.array, stored.dtype)
    assert whole.dtype == _old_as_float(stored).dtype
    assert np.array_equal(whole, _old_as_float(stored), equal_nan=True)
    wide = widen(stored.array, stored.dtype, np.float64)
    expected = stored.to_torch().double().numpy()
    assert wide.dtype == np.float64 and np.array_equal(wide, expected, equal_nan=True)
    for work in (np.float32, np.float64):
        buffer = np.full(400, np.nan, work)
        chunk = widen(stored.array, stored.dtype, work, buffer[:257])
        assert chunk.dtype == work
        assert np.array_equal(chunk, expected.astype(work), equal_nan=True)
