"""Index ranges such as ``0,3,10-20``: the one syntax, parser and type behind the ``STEPS`` setting
and ``tracedump diff --pass``.

Both used to parse the text apart (the settings' ``StepSelection``, the comparator's
``PassSelection``), so the two could drift, and the comparator imported the pydantic settings module
for a parser. Pure Python (no pydantic, no torch): the comparator and the settings both import it.

The ranges are kept, never expanded: ``0-99999999999`` costs two ints, not a 1.5 GB set.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

_ITEM = re.compile(r"([0-9]{1,18})(?:\s*-\s*([0-9]{1,18}))?")  # ASCII digits only: int() alone takes '٣'


@dataclass(frozen=True)
class IndexRanges:
    """Indices (passes, steps) as inclusive ``(lo, hi)`` ranges, in the order written.

    No ranges means no restriction: every index is in it (``STEPS`` unset keeps every pass).
    """

    ranges: tuple[tuple[int, int], ...] = ()

    @classmethod
    def parse(cls, text: str | None) -> IndexRanges:
        """``"0, 3,10-20"``: comma-separated ``N`` or ``LO-HI``; empty items are skipped, so ``""``
        and ``","`` give no ranges. A bad item raises ValueError, its message meant for a person."""
        ranges = []
        for item in ("" if text is None else str(text)).split(","):
            if not (item := item.strip()):
                continue
            match = _ITEM.fullmatch(item)
            if not match:
                raise ValueError(
                    f"bad item {item!r}: expected N or LO-HI with non-negative integers, e.g. '0,3,10-20'"
                )
            lo, hi = int(match.group(1)), int(match.group(2) or match.group(1))
            if hi < lo:
                raise ValueError(f"bad range {item!r}: the end is before the start")
            ranges.append((lo, hi))
        return cls(tuple(ranges))

    def merged(self) -> IndexRanges:
        """The same indices as sorted, disjoint, non-adjacent ranges (``5-7,0,6,2`` -> ``0,2,5-7``)."""
        merged: list[tuple[int, int]] = []
        for lo, hi in sorted(self.ranges):
            if merged and lo <= merged[-1][1] + 1:
                merged[-1] = (merged[-1][0], max(hi, merged[-1][1]))
            else:
                merged.append((lo, hi))
        return IndexRanges(tuple(merged))

    def __contains__(self, index: object) -> bool:
        return isinstance(index, int) and (
            not self.ranges or any(lo <= index <= hi for lo, hi in self.ranges)
        )

    def __str__(self) -> str:
        """The ranges as one would write them: ``0,3,10-20`` (the manifest keeps this text)."""
        return ",".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in self.ranges)

    def count(self) -> int:
        """How many indices the ranges name, counting an index named twice twice (a method, not
        ``len()``: ``len()`` must fit in a machine word, and 18-digit ranges need not)."""
        return sum(hi - lo + 1 for lo, hi in self.ranges)

    def indices(self) -> Iterator[int]:
        """Every index named, in the order written (only for selections known to be small)."""
        return (index for lo, hi in self.ranges for index in range(lo, hi + 1))

    def pick(self, present: list[int]) -> list[int]:
        """The indices among ``present`` that are in the ranges, in ``present``'s order."""
        return [index for index in present if index in self]

    def missing(self, present: list[int]) -> str:
        """The indices in the ranges but not in ``present``, as ranges (at most 10 shown, then
        ``,...``); "" when none. Meant for merged ranges, as :meth:`merged` gives."""
        have = sorted(set(present))
        gaps: list[str] = []
        for lo, hi in self.ranges:
            start = lo
            for index in (i for i in have if lo <= i <= hi):
                if index > start:
                    gaps.append(str(start) if index - 1 == start else f"{start}-{index - 1}")
                start = index + 1
            if start <= hi:
                gaps.append(str(start) if start == hi else f"{start}-{hi}")
        return ",".join(gaps[:10]) + (",..." if len(gaps) > 10 else "")

    def as_json(self, listed: int = 10_000) -> list[int] | str:
        """Every index as a list when there are at most ``listed``; else the ranges' text."""
        return list(self.indices()) if self.count() <= listed else str(self)
