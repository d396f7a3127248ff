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
so; ``--min-coverage FRACTION`` makes a lower coverage exit 2 (:func:`enforce`) where the diff would
otherwise pass.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import ExitCode, UsageError
from .results import DiffReport, TensorResult
from .unshard import SideEntry

LOW = 0.5  # below this fraction of the reference compared, the summary says so


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
        fraction = len(compared) / len(reference) if reference else 0.0
        return {
            "compared": len(compared),
            "reference": len(reference),
            "fraction": round(fraction, 4),
            "low": fraction < LOW,
        }


def line(coverage: Mapping[str, Any]) -> str:
    """``compared N of M reference tensors per step (K %)``: the first line of every report."""
    percent = 100.0 * coverage["fraction"]
    shown = f"{percent:.0f}" if percent >= 1 or percent == 0 else f"{percent:.2g}"
    counts = f"{coverage['compared']} of {coverage['reference']}"
    return f"compared {counts} reference tensors per step ({shown} %)"


def warnings(coverage: Mapping[str, Any]) -> list[str]:
    """What the summary adds when less than half of the reference was compared."""
    if not coverage.get("low"):
        return []
    percent = 100.0 * coverage["fraction"]
    return [
        f"warning: less than half of the reference (B) was compared ({percent:.0f} %): a clean verdict "
        "covers only that part (why the rest was not: not comparable, not aligned, only in B, below)"
    ]


def nothing_comparable(report: DiffReport) -> None:
    """Exit 2 when nothing was measured and there is no failure or input difference to report:
    "no divergence" over zero tensors is not a verdict."""
    if report.compared or report.inputs_differ or report.exit_code != ExitCode.OK:
        return
    reasons: list[str] = []
    for status, what in (("not_comparable", "not comparable"), ("not_aligned", "without token rows")):
        found = [r for r in report.results if r.status == status]
        if found:
            example = f"{found[0].label}: {(found[0].message or '').split(':', 1)[0]}"
            reasons.append(f"{len(found)} pairs {what} (e.g. {example})")
    for which, items in (("A", report.plan.only_in_a), ("B", report.plan.only_in_b)):
        if items:
            reasons.append(f"{len(items)} tensors only in {which}")
    why = "; ".join(reasons) or "no pair of tensors"
    raise UsageError(f"nothing comparable: no tensor's values were compared ({why})")


def enforce(report: DiffReport, min_coverage: float | None) -> None:
    """``--min-coverage``: a diff that would pass but compared less than the fraction exits 2 (a
    divergence found in what was compared keeps exit 1: it is the more specific answer)."""
    coverage = report.coverage
    if min_coverage is None or coverage is None or report.exit_code != ExitCode.OK:
        return
    if coverage["fraction"] < min_coverage:
        report.notes.append(
            f"coverage {100 * coverage['fraction']:.0f} % is below --min-coverage {min_coverage:g}: exit 2"
        )
        report.findings = replace(report.concluded, exit_code=ExitCode.USAGE)
