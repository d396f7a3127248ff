"""``stats.jsonl`` as typed records, and its one reader.

A stats-mode dump keeps one JSON line per captured tensor (``store/format.py`` ``StatsRecord``).
Each line read is validated by :class:`StatsLine`: the names are strings, the indices integers in
range, the shape non-negative integers, each statistic a number a float64 can hold (or ``"nan"``,
``"inf"``, ``"-inf"``, as written for them), so a crafted line (a 400-digit integer, a list where a
number goes) is a :class:`~tracedump.errors.DumpReadError` naming ``file:line``, never an
``OverflowError`` in the comparator. A line is at most :data:`MAX_LINE_BYTES`; a torn last line
(a crash mid-write) is skipped with a warning, as before.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from ..errors import DumpReadError
from .jsonio import LimitError, loads, validated

MAX_LINE_BYTES = 1 << 20  # a real line is a few hundred bytes
MAX_INDEX = 2**62  # a pass, call or capture sequence number
MAX_COUNT = 2**63  # an integer statistic (a count, an integer tensor's sum)

Index = Annotated[int, Field(ge=0, le=MAX_INDEX)]
Statistic = (
    Annotated[int, Field(ge=-MAX_COUNT, le=MAX_COUNT)]
    | Annotated[float, Field(allow_inf_nan=False)]
    | Literal["nan", "inf", "-inf"]
)


class StatsLine(BaseModel):
    """One line of ``stats.jsonl``; fields a reader does not know are let through (a minor version
    may add some). Its statistics are ``format.NUMERIC_STAT_NAMES`` (tests/test_format.py checks)."""

    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True)

    module: str
    tensor: str | None = None
    pass_index: Index = Field(alias="pass")
    call: Index | None = None
    seq: Index | None = None
    shape: list[Annotated[int, Field(ge=0, le=2**63 - 1)]] | None = None
    dtype: str | None = None
    abs_mean: Statistic | None = None
    sum: Statistic | None = None
    min: Statistic | None = None
    max: Statistic | None = None
    mean: Statistic | None = None
    std: Statistic | None = None
    l2: Statistic | None = None
    nan_count: Statistic | None = None
    inf_count: Statistic | None = None


_ADAPTER = TypeAdapter(StatsLine)


class _Problem(Exception):
    pass


def record_problem(record: Any) -> str | None:
    """Why a parsed ``stats.jsonl`` line is not a stats record; None when it is one."""
    if not isinstance(record, dict):
        return "not a JSON object"
    if not isinstance(record.get("module"), str):
        return 'no "module" name'
    if type(record.get("pass")) is not int:
        return 'no integer "pass"'
    try:
        validated(_ADAPTER.validate_python, record, _Problem)
    except _Problem as e:
        return str(e)
    return None


def read_stats(path: Path) -> list[dict[str, Any]]:
    """Every record of ``path``, a ``stats.jsonl`` (or its ``.partial``), as written. A torn line
    is skipped with a warning; any other line that is not a record raises DumpReadError naming
    ``file:line``."""
    from .header import open_regular

    records = []
    try:
        with open_regular(path) as handle:
            for number, raw in enumerate(iter(lambda: handle.readline(MAX_LINE_BYTES + 1), b""), 1):
                records.extend(_record(path, number, raw))
    except OSError as e:
        raise DumpReadError(f"{path}: cannot read ({e.strerror or e})") from e
    return records


def _record(path: Path, number: int, raw: bytes) -> list[dict[str, Any]]:
    if len(raw) > MAX_LINE_BYTES:
        raise DumpReadError(f"{path}:{number}: not a stats record: longer than {MAX_LINE_BYTES} bytes")
    if not raw.strip():
        return []
    try:
        record = loads(raw)
    except LimitError as e:
        raise DumpReadError(f"{path}:{number}: not a stats record: {e}") from e
    except UnicodeDecodeError as e:
        raise DumpReadError(f"{path}:{number}: not a stats record: not UTF-8 ({e.reason})") from e
    except ValueError:  # JSONDecodeError
        warnings.warn(f"{path}:{number}: torn line skipped (the run did not close cleanly)", stacklevel=4)
        return []
    problem = record_problem(record)
    if problem is not None:
        raise DumpReadError(f"{path}:{number}: not a stats record: {problem}")
    return [record]
