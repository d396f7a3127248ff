"""The report's JSON document grouped for the page: a row per tensor record, the line (pass,
root or sequence) it belongs to, and what the page had to leave out.

The page is built from the ``--json`` document
(:meth:`~tracedump.compare.results.DiffReport.to_json`), never from the
terminal's table: whatever a flag adds to the records reaches the page.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from markupsafe import Markup, escape

from ...judge.status import Status, status_text
from .limits import num, visible

NOT_COMPARED = tuple(s.value for s in Status if s.not_compared)  # the order the summary looks in
# Keys of a tensor record the table shows in columns of its own; any other key (a later flag's)
# is shown in the row's details cell, so nothing a result carries is lost from the page.
_SHOWN = (
    "index pass name name_b root sequence kind shape_a shape_b dtype_a dtype_b max_abs mean_abs rel_diff "
    "cosine sqnr_db argmax a_at_argmax b_at_argmax nan_a nan_b inf_a inf_b metric error tolerance rtol atol "
    "tolerance_source status message basis noise x_noise per_token stats"
)
SHOWN_KEYS = frozenset(_SHOWN.split())
# Keys shown in places of their own when a record carries them: how the pair was made, and the
# record of why the status was set.
OPTIONAL_KEYS = frozenset(("paired_by", "reason"))
# Likewise the summary's keys the page shows in its own places; any other is listed in the notes.
_SUMMARY = (
    "compared ok diverged shape_mismatch rank_mismatch errors routing_flips not_compared_routing "
    "not_aligned notes unused_rules alignment dtype_mismatch only_in_a only_in_b passes passes_only_in_a "
    "passes_only_in_b roots_only_in_a roots_only_in_b first_divergence largest_growth exit_code"
)
SUMMARY_SHOWN = frozenset(_SUMMARY.split())


@dataclass
class Row:
    """One tensor record of the JSON report and where it sits."""

    data: dict[str, Any]
    unit: int  # the line it belongs to (pass, root) / sequence
    position: int  # its place in that line

    @property
    def index(self) -> int:
        return int(self.data["index"])

    @property
    def status(self) -> str:
        return str(self.data["status"])

    @property
    def why(self) -> str:
        """The judge's reason in a sentence (the record's ``reason``), else its status in words."""
        reason = self.data.get("reason")
        if isinstance(reason, dict) and reason.get("text"):
            return str(reason["text"])
        return status_text(self.status)

    @cached_property
    def error(self) -> float | None:
        return num(self.data.get("error"))

    @cached_property
    def threshold(self) -> float | None:
        return num(self.data.get("tolerance"))

    @property
    def name(self) -> str:
        name = str(self.data.get("name"))
        root = self.data.get("root")
        return f"{root}:{name}" if root is not None else name


@dataclass
class Page:
    """The report's JSON, grouped for drawing, and what the page had to leave out."""

    doc: dict[str, Any]
    lines: list[str]
    rows: list[Row] = field(default_factory=list)
    units: list[str] = field(default_factory=list)  # each line's label, by unit number
    left_out: list[str] = field(default_factory=list)
    by_index: dict[int, Row] = field(default_factory=dict)

    def row(self, index: int) -> Row:
        """The row of a tensor record's ``index`` (the summary and the table refer to rows by it)."""
        return self.by_index[index]

    def unit_of(self, index: int) -> str:
        """The label of the line the record ``index`` belongs to."""
        return self.units[self.row(index).unit]

    @property
    def summary(self) -> dict[str, Any]:
        return self.doc["summary"]

    @property
    def aligned(self) -> bool:
        return self.doc["settings"].get("align") == "tokens"

    @property
    def unit_kind(self) -> str:
        """What a line is: a sequence (``--align tokens``) or a pass."""
        return "sequence" if self.aligned else "pass"

    @property
    def first_index(self) -> int | None:
        first = self.summary.get("first_divergence")
        return int(first["index"]) if first else None

    @property
    def growth_index(self) -> int | None:
        growth = self.summary.get("largest_growth")
        return int(growth["index"]) if growth else None


def group(doc: dict[str, Any], lines: list[str]) -> Page:
    """The document's records as rows, each in its line: a pass (and root), or a sequence."""
    page = Page(doc, lines)
    aligned = page.aligned
    units: dict[tuple[Any, Any, Any], int] = {}
    counts: list[int] = []
    for data in doc["tensors"]:
        key = (None if aligned else data.get("pass"), data.get("root"), data.get("sequence"))
        if key not in units:
            units[key] = len(units)
            counts.append(0)
            root = data.get("root")
            if aligned:
                page.units.append(" ".join(str(part) for part in (root, data.get("sequence")) if part))
            else:
                page.units.append(f"pass {data.get('pass')}" + (f" {root}" if root is not None else ""))
        unit = units[key]
        row = Row(data, unit, counts[unit])
        page.rows.append(row)
        page.by_index[row.index] = row
        counts[unit] += 1
    return page


def html(template: str, *values: object) -> Markup:
    """A small piece of markup: ``template`` (this package's own literal) with each value shown
    (:func:`visible`) and HTML-escaped, except pieces already built as markup. ``str.format`` of
    escaped values rather than ``Markup.format``: the same result, several times faster, which a
    table of thousands of rows notices."""
    return Markup(template.format(*(v if isinstance(v, Markup) else escape(visible(v)) for v in values)))


def link(index: int, content: object) -> Markup:
    """A link to the table's row of the record ``index``."""
    return html("<a href='#t-{}'>{}</a>", index, content)


def code(value: object) -> Markup:
    return html("<code>{}</code>", value)
