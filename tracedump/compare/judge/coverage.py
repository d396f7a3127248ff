"""Coverage: how much of the reference a diff compared, said first and enforced.

A diff that pairs nothing it can measure (every module "not comparable", every tensor without token
rows) used to end with "no divergence" and exit 0: a clean verdict on nothing. So every report
counts, per step, the **reference tensors** (side B's: the reference is what the run under test is
held to) and how many of them took part in a comparison whose values were measured:

    compared N of M reference tensors per step (K %)

- a reference tensor is a distinct name B recorded in the compared steps (a pass, or the first step
  holding a sequence with ``--align tokens``) that ``--filter`` keeps: each module output, each
  tuple element, each ``::callN``; a module's input (``@in``, dumped with ``--inputs``) counts only
  where a pair read it (it is an extra the reference offers, not a tensor to cover);
- compared: a pair whose values or statistics were measured read it (as itself, or as a part of a
  bridge's split, sum, product or concat); a pair that is ``not comparable``, ``not_aligned``, a
  shape mismatch, or a leftover compares nothing.

Nothing compared (and no failure, no input difference to report) is exit 2, "nothing comparable",
with the reason (:func:`nothing_comparable`). Below :data:`LOW` of the reference the summary says
so; ``--min-coverage FRACTION`` makes a lower coverage exit 2 (:func:`below_minimum`) where the diff
would otherwise pass. Both are inputs of the outcome (:func:`.verdict.outcome`), not a rewrite of it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from ...errors import UsageError
from ..pair.unshard import SideEntry
from ..results import DiffReport, TensorResult
from .status import Status

LOW = Fraction(1, 2)  # below this fraction of the reference compared, the summary says so


def _stored_names(entry: SideEntry) -> tuple[str, ...]:
    """The stored tensors of B an entry reads: itself, or the parts of a bridge's derived entry."""
    if entry.parts:
        return tuple(name for part in entry.parts for name in _stored_names(part))
    return (entry.name,)


@dataclass(kw_only=True)
class CoverageCount:
    """Built while a diff plans its pairs: B's tensors per step, and which each pair reads."""

    reference: set[tuple[str, str]] = field(default_factory=set)  # (scope, B's name)
    read_by: dict[int, tuple[tuple[str, str], ...]] = field(default_factory=dict)  # result index -> B's

    def add_step(self, scope: str, entries_b: Iterable[str], selected: Any) -> None:
        """B's names of one compared step; ``selected(name)`` is ``--filter``."""
        self.reference.update((scope, name) for name in entries_b if "@in" not in name and selected(name))

    def add_pair(self, index: int, scope: str, entry_b: SideEntry) -> None:
        self.read_by[index] = tuple((scope, name) for name in _stored_names(entry_b))

    def finish(self, results: Iterable[TensorResult]) -> dict[str, Any]:
        """The summary's ``coverage``: compared, reference, fraction, low."""
        compared: set[tuple[str, str]] = set()
        for result in results:
            if result.error is not None or result.metrics is not None:
                compared.update(self.read_by.get(result.index, ()))
        reference = self.reference | compared  # an @in a pair read counts, once read
        fraction = exact(len(compared), len(reference))
        return {
            "compared": len(compared),
            "reference": len(reference),
            "fraction": round(float(fraction), 4),  # for the reader; every decision uses the counts
            "low": fraction < LOW,
        }


def exact(compared: int, reference: int) -> Fraction:
    """The covered fraction, exact: what ``--min-coverage`` and the "low" warning decide on (the
    rounded ``fraction`` of the JSON would let 20000 of 20001 pass ``--min-coverage 1``)."""
    return Fraction(compared, reference) if reference else Fraction(0)


def _fraction_of(coverage: Mapping[str, Any]) -> Fraction:
    return exact(int(coverage["compared"]), int(coverage["reference"]))


def percent(coverage: Mapping[str, Any]) -> str:
    """The covered share as printed, never more than it is: whole percents rounded down (199 of
    200 is "99", never "100"), a share below 1 % with two significant digits, also rounded down."""
    share = 100 * _fraction_of(coverage)
    if share >= 1 or share == 0:
        return str(share.numerator // share.denominator)
    digits = 0
    while share * 10**digits < 10:  # two significant digits, cut, not rounded
        digits += 1
    cut = Fraction(share.numerator * 10**digits // share.denominator, 10**digits)
    return f"{float(cut):.{digits}f}".rstrip("0").rstrip(".")


def line(coverage: Mapping[str, Any]) -> str:
    """``compared N of M reference tensors per step (K %)``: the first line of every report."""
    counts = f"{coverage['compared']} of {coverage['reference']}"
    return f"compared {counts} reference tensors per step ({percent(coverage)} %)"


def warnings(coverage: Mapping[str, Any]) -> list[str]:
    """What the summary adds when less than half of the reference was compared."""
    if not coverage.get("low"):
        return []
    return [
        f"warning: less than half of the reference (B) was compared ({percent(coverage)} %): a clean verdict "
        "covers only that part (why the rest was not: not comparable, not aligned, only in B, below)"
    ]


def nothing_comparable(report: DiffReport) -> None:
    """Exit 2 when nothing was measured and there is no input difference to report: "no
    divergence" over zero tensors is not a verdict (called by :func:`.verdict.outcome` for a diff
    that found no failure)."""
    if report.compared or report.inputs_differ:
        return
    reasons: list[str] = []
    for status in (Status.NOT_COMPARABLE, Status.NOT_ALIGNED):
        found = [r for r in report.results if r.status is status]
        if found:
            example = f"{found[0].label}: {(found[0].message or '').split(':', 1)[0]}"
            reasons.append(f"{len(found)} pairs {_NOT_MEASURED[status]} (e.g. {example})")
    for which, items in (("A", report.plan.only_in_a), ("B", report.plan.only_in_b)):
        if items:
            reasons.append(f"{len(items)} tensors only in {which}")
    why = "; ".join(reasons) or "no pair of tensors"
    raise UsageError(f"nothing comparable: no tensor's values were compared ({why})")


_NOT_MEASURED = {Status.NOT_COMPARABLE: "not comparable", Status.NOT_ALIGNED: "without token rows"}


def below_minimum(coverage: Mapping[str, Any], min_coverage: float | None) -> str | None:
    """``--min-coverage``: the note that makes a diff that would pass exit 2, when it compared less
    than the fraction (None when it did not, or none was asked for)."""
    if min_coverage is None or _fraction_of(coverage) >= Fraction(repr(min_coverage)):  # the decimal as typed
        return None
    return (
        f"coverage {percent(coverage)} % ({coverage['compared']} of {coverage['reference']}) "
        f"is below --min-coverage {min_coverage!r}: exit 2"
    )
