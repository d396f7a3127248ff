"""Every fact tracedump knows about a dtype, in one table; the per-dtype tables are derived from it.

Why one table: the safetensors codes and their on-disk order (:mod:`.stformat`), the bytes per
element (:mod:`.loader`), numpy's storage of each dtype (:mod:`tracedump.compare.load.reader`), which
dtypes fp32 cannot hold (:mod:`tracedump.compare.measure.metrics`), the unit roundoffs of the noise model
(:mod:`tracedump.compare.judge.verdict`) and the default tolerances (:mod:`tracedump.compare.judge.tolerance`)
were seven tables that had to agree. Orders are stated as ranks, never taken from the order of a
literal: ``precision_rank`` says which dtype is less precise (0: the most precise), ``disk_rank``
where safetensors lays a tensor out. Imports nothing (no numpy, no torch): ``tracedump ls`` reads
headers with it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class DType:
    """One dtype: how it is stored and how precise it is. ``None``: the fact does not apply."""

    name: str  # torch's name (``torch.bfloat16`` -> ``"bfloat16"``), the one dumps and reports use
    kind: str  # "float", "int", "bool", "complex" (real and imaginary parts), "packed" (float4 pairs)
    significand_bits: int  # bits of a value's significand, the implicit bit included (ints: value bits)
    code: str | None = None  # safetensors dtype code; None: no storage dtype (tfloat32)
    disk_rank: int | None = None  # safetensors' on-disk order (its Dtype enum, descending): 0 first
    bytes: int | None = None  # bytes per element as stored (float4_e2m1fn_x2: a pair of values a byte)
    bits: int | None = None  # bits per element of a sub-byte dtype (float6: 6, four values in 3 bytes)
    storage: str | None = None  # numpy dtype of the stored values (bit patterns where numpy has none)
    torch_widens: bool = False  # stored as bits, made numbers by torch (the fp8s); float4 stays bytes
    precision_rank: int | None = None  # 0: most precise; None: no tolerance of its own (ints, scales)
    rel_diff: float | None = None  # ceiling of rel_diff and 1 - cosine (tolerance.py says why)
    max_abs: tuple[float, float] | None = None  # (rtol, atol) of max_abs: torch.testing.assert_close's
    stats: float | None = None  # relative tolerance of each statistic of a stats-mode dump
    short: str | None = None  # the report's spelling (fp32)

    @property
    def integer(self) -> bool:
        """Compared exactly: integers and bool."""
        return self.kind in ("int", "bool")

    @property
    def unit_roundoff(self) -> float:
        """Half the spacing of the numbers near 1: ``2^-p`` for ``p`` significand bits."""
        return 2.0**-self.significand_bits

    @property
    def wider_than_float32(self) -> bool:
        """Values float32 cannot hold exactly (24 significand bits): compared in float64."""
        return self.significand_bits > 24

    @property
    def bits_stored(self) -> bool:
        """A float numpy has no type for, stored as its bit pattern in an unsigned int."""
        return (
            self.kind in ("float", "packed") and self.storage is not None and self.storage.startswith("uint")
        )


def _int(name: str, code: str, disk_rank: int, nbytes: int) -> DType:
    bits = 8 * nbytes - (not name.startswith("uint"))  # the sign bit holds no value
    # fmt: off
    return DType(name=name, kind="int", significand_bits=bits, code=code, disk_rank=disk_rank, bytes=nbytes,
                 storage=name)
    # fmt: on


def _fp8(
    name: str,
    code: str,
    disk_rank: int,
    significand_bits: int,
    *,
    rank: int | None = None,
    rel_diff: float | None = None,
    max_abs: tuple[float, float] | None = None,
    stats: float | None = None,
) -> DType:
    """An 8-bit float: its byte stored as a uint8, made a number by torch."""
    return DType(
        name=name,
        kind="float",
        significand_bits=significand_bits,
        code=code,
        disk_rank=disk_rank,
        bytes=1,
        storage="uint8",
        torch_widens=True,
        precision_rank=rank,
        rel_diff=rel_diff,
        max_abs=max_abs,
        stats=stats,
    )


# fmt: off
DTYPES: tuple[DType, ...] = (
    DType(name="float64", kind="float", significand_bits=53, code="F64", disk_rank=2, bytes=8,
          storage="float64", precision_rank=0, rel_diff=1e-10, max_abs=(1e-7, 1e-7), stats=1e-6,
          short="fp64"),
    DType(name="float32", kind="float", significand_bits=24, code="F32", disk_rank=4, bytes=4,
          storage="float32", precision_rank=1, rel_diff=1e-8, max_abs=(1.3e-6, 1e-5), stats=1e-5,
          short="fp32"),
    # no storage dtype: an fp32 run whose matmuls ran in TF32 (the manifest's precision says so)
    DType(name="tfloat32", kind="float", significand_bits=11,
          precision_rank=2, rel_diff=2e-4, max_abs=(1e-3, 1e-5), stats=2e-2),
    DType(name="float16", kind="float", significand_bits=11, code="F16", disk_rank=8, bytes=2,
          storage="float16", precision_rank=3, rel_diff=2e-4, max_abs=(1e-3, 1e-5), stats=2e-2,
          short="fp16"),
    DType(name="bfloat16", kind="float", significand_bits=8, code="BF16", disk_rank=7, bytes=2,
          storage="uint16", precision_rank=4, rel_diff=1e-2, max_abs=(1.6e-2, 1e-5), stats=1e-1,
          short="bf16"),
    _fp8("float8_e4m3fn", "F8_E4M3", 14, 4, rank=5, rel_diff=5e-2, max_abs=(1.25e-1, 1e-3), stats=3e-1),
    _fp8("float8_e4m3fnuz", "F8_E4M3FNUZ", 12, 4, rank=6, rel_diff=5e-2, max_abs=(1.25e-1, 1e-3), stats=3e-1),
    _fp8("float8_e5m2", "F8_E5M2", 15, 3, rank=7, rel_diff=2e-1, max_abs=(2.5e-1, 1e-3), stats=5e-1),
    _fp8("float8_e5m2fnuz", "F8_E5M2FNUZ", 11, 3, rank=8, rel_diff=2e-1, max_abs=(2.5e-1, 1e-3), stats=5e-1),
    # power-of-two scales (MX formats): a value is an exponent alone
    _fp8("float8_e8m0fnu", "F8_E8M0", 13, 1),
    # torch cannot widen it: kept as its byte values, compared bitwise (any difference diverges)
    DType(name="float4_e2m1fn_x2", kind="packed", significand_bits=2, code="F4", disk_rank=20, bytes=1,
          storage="uint8"),
    # MX float6 (no torch dtype): its packed bytes, compared bitwise as float4's are
    DType(name="float6_e3m2fn", kind="packed", significand_bits=3, code="F6_E3M2", disk_rank=18, bits=6,
          storage="uint8"),
    DType(name="float6_e2m3fn", kind="packed", significand_bits=4, code="F6_E2M3", disk_rank=19, bits=6,
          storage="uint8"),
    # as (real, imag) float32 pairs: twice the values, each compared as a float
    DType(name="complex64", kind="complex", significand_bits=24, code="C64", disk_rank=3, bytes=8,
          storage="float32"),
    _int("uint64", "U64", 0, 8),
    _int("int64", "I64", 1, 8),
    _int("uint32", "U32", 5, 4),
    _int("int32", "I32", 6, 4),
    _int("uint16", "U16", 9, 2),
    _int("int16", "I16", 10, 2),
    _int("int8", "I8", 16, 1),
    _int("uint8", "U8", 17, 1),
    DType(name="bool", kind="bool", significand_bits=1, code="BOOL", disk_rank=21, bytes=1, storage="bool"),
)
# fmt: on

BY_NAME: dict[str, DType] = {d.name: d for d in DTYPES}
_RANKED = sorted((d for d in DTYPES if d.precision_rank is not None), key=lambda d: d.precision_rank or 0)
_STORED = sorted((d for d in DTYPES if d.disk_rank is not None), key=lambda d: d.disk_rank or 0)

# The dtypes with tolerances of their own, most precise first: the pair's less precise one decides.
PRECISION_ORDER: tuple[str, ...] = tuple(d.name for d in _RANKED)
INTEGER_DTYPES: frozenset[str] = frozenset(d.name for d in DTYPES if d.integer)
UNIT_ROUNDOFF: dict[str, float] = {d.name: d.unit_roundoff for d in _RANKED}
# safetensors code -> dtype name, in the order safetensors lays tensors out on disk
CODES_ON_DISK_ORDER: dict[str, str] = {d.code: d.name for d in _STORED if d.code is not None}
ELEMENT_BYTES: dict[str, int] = {
    d.code: d.bytes for d in _STORED if d.code is not None and d.bytes is not None
}
# safetensors code -> bits per element, for the codes of less than a byte an element (float6)
ELEMENT_BITS: dict[str, int] = {d.code: d.bits for d in _STORED if d.code is not None and d.bits is not None}
NUMPY_STORAGE: dict[str, str] = {d.name: d.storage for d in DTYPES if d.storage is not None}
BITS_STORED: frozenset[str] = frozenset(d.name for d in DTYPES if d.bits_stored)
TORCH_WIDENED: frozenset[str] = frozenset(d.name for d in DTYPES if d.torch_widens)
WIDER_THAN_FLOAT32: frozenset[str] = frozenset(d.name for d in DTYPES if d.wider_than_float32)
SHORT_NAMES: dict[str, str] = {d.name: d.short for d in _RANKED if d.short is not None}
