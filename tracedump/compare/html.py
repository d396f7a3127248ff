"""``--html PATH``: the diff as one self-contained page to look at and to share.

The page is built from the report's JSON document (:meth:`DiffReport.to_json`, the ``--json``
schema) and the verdict lines the terminal prints, never from the table's text: whatever a flag
adds to the results (a baseline's noise, sequences, unsharded or bridged tensors) reaches the page.
It holds, in order: the summary (exit code, first divergence and why, with the numbers), the
error through the model (one line per pass or sequence, log axis, thresholds), the per-token
heatmap, the full table (sortable, filterable) and the notes (flips, tensors not compared, mapped
names, settings and versions of both runs).

Why plain SVG written here rather than a plotting library: the page has two fixed charts, both
simple geometry (a polyline per pass on a log axis, an image of cells), and the standard library
draws them; plotly or bokeh would inline 1-4 MB of JavaScript into every report and be a dependency
of every machine that runs the diff. The heatmap is a palette PNG (zlib) in the SVG, one pixel per
cell, so a 240 x 512 heatmap costs tens of KB, not 120 000 SVG elements. A few lines of JavaScript
sort and filter the table, toggle lines and show a heatmap cell's value; without JavaScript the
page still shows everything (hover names come from SVG ``<title>`` elements).

Safety: every string from a dump (names, paths, messages, settings) goes through :func:`esc`
(HTML escaping, control and bidi characters shown as ``\\x1b`` / ``\\u202e``); the JSON the
script reads is embedded with ``<``, ``>`` and ``&`` escaped; and a Content-Security-Policy allows
only this page's own script and style (by hash) and ``data:`` images, so the page can fetch
nothing and no injected script could run.

Bounds, for dumps of many passes: at most :data:`MAX_LINES` lines and :data:`MAX_POINTS` points
(decimated by keeping each bucket's extremes and every tensor that is not ok), a heatmap of at most
:data:`HEATMAP_ROWS` x :data:`HEATMAP_COLS` cells (the rows that matter most, columns binned by
their maximum), :data:`MAX_TABLE_ROWS` table rows (chosen as the terminal's ``--max-rows``
chooses) and :data:`MAX_LISTED` names per note list; the page says what was left out.

Bounded in bytes too, not only in rows (issue 34, defect 16: 100 names of 100 KB once made a
50 MB page): every string from a dump is cut at :data:`MAX_TEXT` characters, with a marker that
says how much was cut, and a page over :data:`MAX_PAGE_BYTES` is drawn again with tighter limits
(:data:`_TIGHTER`: shorter strings, fewer rows, points and names), and at last as its summary
alone, which is bounded whatever the dump holds. The ``--json`` report keeps every string whole.
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
import math
import re
import struct
import zlib
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..store.fsio import write_output
from .display import dtype_text
from .results import DiffReport
from .status import Status, status_text

MAX_LINES = 24
MAX_POINTS = 3000  # markers in the curve, over every line
HEATMAP_ROWS = 240
HEATMAP_COLS = 512
MAX_TABLE_ROWS = 4000
MAX_LISTED = 200
MAX_TEXT = 1000  # characters of one string from a dump (a name, a message) shown before the cut
MAX_LINES_SHOWN = 400  # lines of the terminal's verdict in the summary
MAX_PAGE_BYTES = 6 << 20  # "a few MB" (docs/comparator.md): the page is drawn again, tighter, above it


@dataclass
class _Limits:
    """The bounds one drawing of the page works within, and how many strings it cut."""

    text: int
    table_rows: int
    points: int
    listed: int
    heat_rows: int
    lines: int
    summary_only: bool = False
    cut: int = 0  # strings cut at ``text`` characters in this drawing


def _first_limits() -> _Limits:
    """The module's constants, read when a page is drawn (tests set them smaller)."""
    return _Limits(
        text=MAX_TEXT,
        table_rows=MAX_TABLE_ROWS,
        points=MAX_POINTS,
        listed=MAX_LISTED,
        heat_rows=HEATMAP_ROWS,
        lines=MAX_LINES_SHOWN,
    )


# Each further drawing of a page over MAX_PAGE_BYTES: (text, divisor of rows/points/names/lines).
_TIGHTER = ((200, 4), (60, 20))
_LIMITS: ContextVar[_Limits | None] = ContextVar("tracedump_html_limits", default=None)


def _limit() -> _Limits:
    """The limits of the drawing in progress (outside one, the module's: :func:`esc` is public)."""
    current = _LIMITS.get()
    return current if current is not None else _first_limits()


def cut(text: str) -> str:
    """``text`` whole, or its first characters and ``… [N more characters]`` when over the page's
    limit for one string (the ``--json`` report holds it whole)."""
    limits = _limit()
    if len(text) <= limits.text:
        return text
    limits.cut += 1
    return f"{text[: limits.text]}… [{len(text) - limits.text} more characters]"


# ----------------------------------------------------------------------------- strings and numbers

# C0/C1 controls, bidi overrides and isolates, line/paragraph separators: shown, never obeyed.
_UNSAFE_CHARS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def _visible(char: re.Match[str]) -> str:
    code = ord(char.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def visible(value: object) -> str:
    """Any value as the text a reader sees: control characters and lone surrogates as escapes."""
    text = cut(str(value)).encode("utf-8", "backslashreplace").decode("utf-8")
    return _UNSAFE_CHARS.sub(_visible, text)


def esc(value: object) -> str:
    """Any value as HTML text: :func:`visible`, then HTML-escaped (quotes too, for attributes)."""
    return html.escape(visible(value), quote=True)


def num(value: object) -> float | None:
    """A JSON number of the report (``"nan"``, ``"inf"`` strings included) as a float."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    try:
        return float(str(value))
    except ValueError:
        return None


def fmt(value: object) -> str:
    number = num(value)
    if number is None:
        return "-"
    if not math.isfinite(number):
        return str(number)
    return "0" if number == 0 else f"{number:.3g}"


def _sort_key(value: float | None) -> str:
    """A ``data-v`` for the table's sort: missing values sort last either way (JS reads "")."""
    if value is None or math.isnan(value):
        return ""
    return repr(value) if math.isfinite(value) else ("1e999" if value > 0 else "-1e999")


_NOT_COMPARED = tuple(s.value for s in Status if s.not_compared)  # the order the summary looks in
# Keys of a tensor record the table shows in columns of its own; any other key (a later flag's)
# is shown in the row's details cell, so nothing a result carries is lost from the page.
_SHOWN = (
    "index pass name name_b root sequence kind shape_a shape_b dtype_a dtype_b max_abs mean_abs rel_diff "
    "cosine sqnr_db argmax a_at_argmax b_at_argmax nan_a nan_b inf_a inf_b metric error tolerance rtol atol "
    "tolerance_source status message basis noise x_noise per_token stats"
)
_SHOWN_KEYS = frozenset(_SHOWN.split())
# Likewise the summary's keys the page shows in its own places; any other is listed in the notes.
_SUMMARY = (
    "compared ok diverged shape_mismatch rank_mismatch errors routing_flips not_compared_routing "
    "not_aligned notes unused_rules alignment dtype_mismatch only_in_a only_in_b passes passes_only_in_a "
    "passes_only_in_b roots_only_in_a roots_only_in_b first_divergence largest_growth exit_code"
)
_SUMMARY_SHOWN = frozenset(_SUMMARY.split())


# ----------------------------------------------------------------------------- the page


@dataclass
class _Row:
    """One tensor record of the JSON report and where it sits."""

    data: dict[str, Any]
    unit: int  # the line it belongs to (pass, root) / sequence
    position: int  # its place in that line

    @property
    def index(self) -> int:
        return int(self.data["index"])

    @property
    def error(self) -> float | None:
        return num(self.data.get("error"))

    @property
    def threshold(self) -> float | None:
        return num(self.data.get("tolerance"))

    @property
    def name(self) -> str:
        name = str(self.data.get("name"))
        root = self.data.get("root")
        return f"{root}:{name}" if root is not None else name

    @property
    def aligned(self) -> bool:
        return "positions" in (self.data.get("per_token") or {})


@dataclass
class _Page:
    """The report's JSON, grouped for drawing, and what the page had to leave out."""

    doc: dict[str, Any]
    lines: list[str]
    rows: list[_Row] = field(default_factory=list)
    units: list[str] = field(default_factory=list)  # each line's label, by unit number
    left_out: list[str] = field(default_factory=list)

    by_index: dict[int, _Row] = field(default_factory=dict)

    def row(self, index: int) -> _Row:
        """The row of a tensor record's ``index`` (the summary and the table refer to rows by it)."""
        return self.by_index[index]

    @property
    def summary(self) -> dict[str, Any]:
        return self.doc["summary"]

    @property
    def aligned(self) -> bool:
        return self.doc["settings"].get("align") == "tokens"

    @property
    def first_index(self) -> int | None:
        first = self.summary.get("first_divergence")
        return int(first["index"]) if first else None

    @property
    def growth_index(self) -> int | None:
        growth = self.summary.get("largest_growth")
        return int(growth["index"]) if growth else None


def _group(doc: dict[str, Any], lines: list[str]) -> _Page:
    page = _Page(doc, lines)
    aligned = doc["settings"].get("align") == "tokens"
    units: dict[tuple[Any, Any], int] = {}
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
        page.rows.append(_Row(data, unit, counts[unit]))
        page.by_index[page.rows[-1].index] = page.rows[-1]
        counts[unit] += 1
    return page


def render(report: DiffReport, doc: dict[str, Any] | None = None) -> str:
    """The whole page, as text; ``doc`` is ``report.to_json()`` when the caller has it already.

    At most :data:`MAX_PAGE_BYTES` (UTF-8): drawn with the module's limits first, then tighter
    ones (:data:`_TIGHTER`), then as the summary alone."""
    from .display import summary_lines

    doc = doc if doc is not None else report.to_json()
    lines = summary_lines(report)
    first = _first_limits()
    attempts = [first]
    attempts += [
        replace(
            first,
            text=text,
            table_rows=max(first.table_rows // divisor, 20),
            points=max(first.points // divisor, 100),
            listed=max(first.listed // divisor, 10),
            heat_rows=max(first.heat_rows // divisor, 12),
            lines=max(first.lines // divisor, 20),
        )
        for text, divisor in _TIGHTER
    ]
    attempts.append(replace(attempts[-1], summary_only=True))
    size = 0
    for number, limits in enumerate(attempts):
        token = _LIMITS.set(limits)
        try:
            text = _draw(doc, lines, limits, tightened=(number, size))
        finally:
            _LIMITS.reset(token)
        size = len(text.encode("utf-8", "surrogatepass"))
        if size <= MAX_PAGE_BYTES:
            break
    return text


def _draw(doc: dict[str, Any], lines: list[str], limits: _Limits, tightened: tuple[int, int]) -> str:
    """One drawing of the page within ``limits``; ``tightened``: (how many drawings were over
    :data:`MAX_PAGE_BYTES` before this one, the size of the last)."""
    page = _group(doc, lines)
    body = [_header(page), _summary(page)]
    if not limits.summary_only:
        body += [
            _section("curve-section", "Error through the model", _curve(page)),
            _section("heatmap-section", "Error per token", _heatmap(page)),
            _section("table-section", "Every tensor", _table(page, _table_indices(page))),
            _section("notes-section", "Notes", _notes(page)),
        ]
    if tightened[0]:
        page.left_out.append(
            f"page size: drawn {tightened[0] + 1} times to stay under {MAX_PAGE_BYTES / 2**20:.3g} MB (the "
            f"last drawing was {tightened[1] / 2**20:.1f} MB): "
            + (
                "the summary alone"
                if limits.summary_only
                else f"at most {limits.table_rows} table rows, {limits.points} points, "
                f"{limits.listed} names per list"
            )
        )
    if limits.cut:
        page.left_out.append(
            f"{limits.cut} strings (names, messages, values) cut at {limits.text} characters, "
            'marked "… [N more characters]"'
        )
    # The bounds are known once every part is drawn: said at the top, where a reader starts.
    bounds = (
        "<div class='bounds' id='bounds'><b>This page is bounded:</b><ul>"
        # tracedump's own lines (counts, limits), never cut
        + "".join(f"<li>{html.escape(_UNSAFE_CHARS.sub(_visible, line))}</li>" for line in page.left_out)
        + "</ul>The full per-tensor data is in the <code>--json</code> report.</div>"
        if page.left_out
        else ""
    )
    body.insert(2, bounds)
    script = _SCRIPT
    policy = (
        "default-src 'none'; img-src data:; "
        f"style-src 'sha256-{_sha256(_STYLE)}'; script-src 'sha256-{_sha256(script)}'"
    )
    title = f"tracedump diff: exit {page.summary['exit_code']}"
    first = page.summary.get("first_divergence")
    if first:
        title += f", first divergence {first['name']}"
    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>\n"
        f"<meta http-equiv='Content-Security-Policy' content=\"{policy}\">\n"
        "<meta name='viewport' content='width=device-width, initial-scale=1'>\n"
        f"<title>{esc(title)}</title>\n<style>{_STYLE}</style></head>\n<body>\n"
        + "\n".join(part for part in body if part)
        + f"\n<script>{script}</script>\n</body></html>\n"
    )


def _sha256(text: str) -> str:
    """The hash by which the Content-Security-Policy allows exactly this inline script or style."""
    return base64.b64encode(hashlib.sha256(text.encode()).digest()).decode()


def write_html(report: DiffReport, path: str | Path, doc: dict[str, Any] | None = None) -> Path:
    """Write the page atomically (:func:`tracedump.store.fsio.write_output`): a reader never sees
    half of it; a device, a FIFO (``/dev/stdout``) is written into, a link is followed."""
    return write_output(path, render(report, doc))


def _section(ident: str, title: str, content: str) -> str:
    return f"<section id='{ident}'><h2>{esc(title)}</h2>\n{content}\n</section>"


def _header(page: _Page) -> str:
    doc = page.doc
    from .._version import __version__

    return (
        "<header><h1>tracedump diff</h1>"
        f"<div class='sides'><span>A (under test): <code>{esc(doc['a'])}</code></span>"
        f"<span>B (reference): <code>{esc(doc['b'])}</code></span>"
        + (
            f"<span>baseline: <code>{esc(doc['settings']['baseline'])}</code></span>"
            if doc["settings"].get("baseline")
            else ""
        )
        + f"<span class='muted'>tracedump {esc(__version__)}</span></div></header>"
    )


# ----------------------------------------------------------------------------- summary


def _link(index: int, text: str) -> str:
    return f"<a href='#t-{index}'>{text}</a>"


def _summary(page: _Page) -> str:
    s = page.summary
    code = s["exit_code"]
    verdict = "diverged" if code else "no divergence"
    parts = [
        f"<section id='summary' class='exit-{int(code)}'><div class='verdict'>"
        f"<span class='exit' id='exit-code'>exit {int(code)}</span> <span>{esc(verdict)}</span></div>"
    ]
    first = s.get("first_divergence")
    if first is not None:
        parts.append(_first_divergence(page, first))
    elif code == 0:
        parts.append(
            f"<p class='lead'>Every compared tensor is within tolerance "
            f"({esc(page.doc['settings'].get('tolerance', ''))}).</p>"
        )
    else:
        failing = next((r for r in page.rows if r.data["status"] in _NOT_COMPARED[:2]), None)
        if failing is not None:
            parts.append(
                f"<p class='lead'>No numeric divergence, but {_link(failing.index, esc(failing.name))}: "
                f"{esc(status_text(failing.data['status']))}"
                + (f" ({esc(failing.data['message'])})" if failing.data.get("message") else "")
                + "</p>"
            )
    parts.append(_counts(page))
    growth = s.get("largest_growth")
    if growth is not None and growth["index"] != page.first_index:
        parts.append(
            f"<p>Largest growth: {_link(growth['index'], esc(growth['name']))} in "
            f"{esc(page.units[page.row(growth['index']).unit])}: {esc(growth['metric'])} "
            f"{fmt(growth['error'])}, {fmt(growth['ratio'])}× the largest error before it "
            f"({fmt(growth['previous_max'])}).</p>"
        )
    limit = _limit().lines
    more = len(page.lines) - limit
    parts.append(
        "<details class='lines'><summary>The verdict as the terminal prints it</summary><pre>"
        + "\n".join(esc(line) for line in page.lines[:limit])  # each line cut on its own
        + (f"\n… {more} more lines" if more > 0 else "")
        + "</pre></details></section>"
    )
    return "\n".join(parts)


def _first_divergence(page: _Page, first: dict[str, Any]) -> str:
    row = page.row(first["index"]).data
    where = [f"in {esc(page.units[page.row(first['index']).unit])}"]
    spot = next((a.get("first") for a in page.summary.get("alignment") or [] if a.get("first")), None)
    if spot is not None:
        where = [
            f"<b>{esc(spot['sequence'])}</b>, position <b>{esc(spot['position'])}</b>, "
            f"step {esc(spot['step'])}"
        ]
    elif not page.aligned:
        where = [
            f"pass <b>{esc(first['pass'])}</b>" + (f", root {esc(row['root'])}" if row.get("root") else "")
        ]
    name_b = f" <span class='muted'>(B: <code>{esc(first['name_b'])}</code>)</span>"
    head = (
        f"<p class='lead' id='first-divergence'>First divergence: "
        f"{_link(first['index'], '<code>' + esc(first['name']) + '</code>')}"
        f"{name_b if first['name_b'] != first['name'] else ''}, {', '.join(where)}.</p>"
    )
    return head + _why(row, (page.doc["settings"].get("verdict") or {}).get("baseline_factor"))


def _why(row: dict[str, Any], factor: object) -> str:
    metric = "1 − cosine" if row["metric"] == "cosine" else row["metric"]
    error, threshold = num(row.get("error")), num(row.get("tolerance"))
    facts: list[tuple[str, str]] = []
    nonfinite = any(row.get(k) for k in ("nan_a", "nan_b", "inf_a", "inf_b"))
    if row["status"] == "diverged" and error is not None and nonfinite and not error > (threshold or 0.0):
        # only the NaN/Inf pattern differs (as the terminal says): "rel_diff 0 > threshold" would be false
        facts.append(
            (
                "why",
                f"NaN/Inf only: {esc(metric)} of the finite values {fmt(error)} ≤ threshold "
                f"{fmt(threshold)}; the NaN/Inf positions differ",
            )
        )
        facts.append(("threshold from", esc(_basis(row, factor))))
    elif row["status"] == "diverged" and error is not None:
        ratio = error / threshold if threshold else math.inf
        facts.append(("why", f"{esc(metric)} {fmt(error)} &gt; threshold {fmt(threshold)} ({fmt(ratio)}×)"))
        facts.append(("threshold from", esc(_basis(row, factor))))
    else:
        facts.append(("why", esc(status_text(row["status"]))))
    if row.get("message"):
        facts.append(("detail", esc(row["message"])))
    if row.get("max_abs") is not None:
        where = f" at {esc(row['argmax'])}" if row.get("argmax") is not None else ""
        facts.append(
            (
                "max |A − B|",
                f"{fmt(row['max_abs'])}{where} "
                f"(A {fmt(row.get('a_at_argmax'))} vs B {fmt(row.get('b_at_argmax'))})",
            )
        )
    if row.get("rel_diff") is not None:
        facts.append(("rel_diff", fmt(row["rel_diff"])))
    cosine = num(row.get("cosine"))
    if cosine is not None:
        facts.append(("1 − cosine", fmt(1 - cosine)))
    if row.get("sqnr_db") is not None:
        facts.append(("SQNR", f"{fmt(row['sqnr_db'])} dB"))
    if row.get("x_noise") is not None:
        facts.append(("× noise", f"{fmt(row['x_noise'])}× the baseline's noise {fmt(row.get('noise'))}"))
    token = row.get("per_token") or {}
    if token.get("worst") is not None:
        facts.append(
            ("worst token", f"position {esc(token['worst'])}: rel_diff {fmt(token.get('worst_rel_diff'))}")
        )
    facts.append(("shape, dtype", f"{esc(_shape(row))}, {esc(_dtype(row))}"))
    return "<dl class='why'>" + "".join(f"<dt>{k}</dt><dd>{v}</dd>" for k, v in facts) + "</dl>"


def _basis(row: dict[str, Any], factor: object) -> str:
    basis = row.get("basis")
    if basis == "baseline":
        return (
            f"the noise measured in --baseline, err(C, B) = {fmt(row.get('noise'))}, "
            f"× {fmt(factor)} plus one rounding"
        )
    if basis == "upstream":
        return f"what the error upstream explains at the run precision ({row.get('tolerance_source')})"
    return f"{basis or 'fixed'}: {row.get('tolerance_source')}"


def _counts(page: _Page) -> str:
    s = page.summary
    tiles = [
        ("compared", s["compared"], ""),
        ("ok", s["ok"], ""),
        ("diverged", s["diverged"], "bad" if s["diverged"] else ""),
        ("shape mismatch", s["shape_mismatch"], "bad" if s["shape_mismatch"] else ""),
        ("rank mismatch", s["rank_mismatch"], "bad" if s["rank_mismatch"] else ""),
        ("errors", s["errors"], "bad" if s["errors"] else ""),
        ("routing flips", len(s.get("routing_flips") or []), ""),
        ("not compared", s.get("not_compared_routing", 0) + s.get("not_aligned", 0), ""),
        ("only in A", s["only_in_a"], ""),
        ("only in B", s["only_in_b"], ""),
        (
            "sequences" if page.aligned else "passes",
            len(page.units) if page.aligned else len(s["passes"]),
            "",
        ),
    ]
    return (
        "<div class='tiles'>"
        + "".join(
            f"<div class='tile {cls}'><b>{esc(value)}</b><span>{esc(label)}</span></div>"
            for label, value, cls in tiles
        )
        + "</div>"
    )


def _shape(row: dict[str, Any]) -> str:
    a, b = row.get("shape_a"), row.get("shape_b")
    if a is None and b is None:
        return "?"
    return str(a) if a == b or b is None else f"{a} vs {b}"


def _dtype(row: dict[str, Any]) -> str:
    return dtype_text(row.get("dtype_a"), row.get("dtype_b"))


# ----------------------------------------------------------------------------- the curve

_LINE_COLOURS = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#17becf", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
    "#393b79",
)  # fmt: skip
_STATUS_FILL = {"diverged": "#d62728", "rank_mismatch": "#9467bd", "routing_flip": "#17becf"}
_W, _H = 1100, 380
_LEFT, _RIGHT, _TOP, _BOTTOM = 64, 16, 28, 44


@dataclass
class _Axis:
    """A log10 y axis (exact zeros at ``floor``, a decade under every value shown) and a linear x."""

    low: int  # decade of the bottom
    high: int  # decade of the top
    width: int  # tensors in the longest line

    def x(self, position: float) -> float:
        span = max(self.width - 1, 1)
        return round(_LEFT + (_W - _LEFT - _RIGHT) * position / span, 1)

    def y(self, value: float | None) -> float:
        if value is None or value <= 0:
            level = self.low
        elif not math.isfinite(value):
            level = self.high
        else:
            level = min(max(math.log10(value), self.low), self.high)
        return round(_TOP + (_H - _TOP - _BOTTOM) * (self.high - level) / (self.high - self.low), 1)


def _axis(rows: list[_Row], width: int) -> _Axis:
    positive = [v for r in rows for v in (r.error, r.threshold) if v is not None and 0 < v < math.inf]
    if not positive:
        return _Axis(-17, -15, width)
    low = math.floor(math.log10(min(positive))) - 1
    high = max(math.ceil(math.log10(max(positive))), low + 2)
    return _Axis(low, high, width)


def _spread(items: list[int], count: int) -> list[int]:
    """``count`` of ``items`` evenly spread, first and last included."""
    if count >= len(items):
        return list(items)
    if count <= 1:
        return items[:count]
    step = (len(items) - 1) / (count - 1)
    return [items[round(i * step)] for i in range(count)]


def _pick_units(page: _Page, plotted: dict[int, list[_Row]]) -> list[int]:
    """Every line when they fit; else the first divergence's, then those with a tensor that is not
    ok, then the others, each group evenly spread over the run."""
    units = sorted(plotted)
    if len(units) <= MAX_LINES:
        return units
    chosen = {page.row(page.first_index).unit} if page.first_index is not None else set()
    failing = [u for u in units if u not in chosen and any(r.data["status"] != "ok" for r in plotted[u])]
    chosen |= set(_spread(failing, MAX_LINES - len(chosen)))
    others = [u for u in units if u not in chosen]
    chosen |= set(_spread(others, MAX_LINES - len(chosen)))
    kind = "sequences" if page.aligned else "passes"
    page.left_out.append(
        f"curve: {len(chosen)} of {len(units)} {kind} drawn (the first divergence's, then those with "
        f"a tensor that is not ok, then the others, each evenly spread)"
    )
    return sorted(chosen)


def _decimate(rows: list[_Row], budget: int, keep: set[int]) -> list[_Row]:
    """At most about ``budget`` rows: per bucket its smallest and largest error (spikes survive on
    a log axis), plus every row in ``keep`` and every row that is not ok."""
    if len(rows) <= budget:
        return rows
    buckets = max(budget // 2, 1)
    size = len(rows) / buckets
    chosen: set[int] = set()
    for b in range(buckets):
        chunk = rows[int(b * size) : int((b + 1) * size)] or rows[-1:]
        chunk_errors = [r for r in chunk if r.error is not None]
        if chunk_errors:
            chosen.add(min(chunk_errors, key=lambda r: r.error or 0.0).position)
            chosen.add(max(chunk_errors, key=lambda r: r.error or 0.0).position)
    chosen |= {r.position for r in rows if r.index in keep or r.data["status"] != "ok"}
    return [r for r in rows if r.position in chosen]


def _curve(page: _Page) -> str:
    plotted: dict[int, list[_Row]] = {}
    for row in page.rows:
        if row.error is not None:
            plotted.setdefault(row.unit, []).append(row)
    if not plotted:
        return "<p class='muted'>No tensor's values were compared: nothing to draw.</p>"
    units = _pick_units(page, plotted)
    width = max(max(r.position for r in plotted[u]) + 1 for u in units)
    axis = _axis([r for u in units for r in plotted[u]], width)
    keep = {i for i in (page.first_index, page.growth_index) if i is not None}
    budget = max(_limit().points // len(units), 50)
    shown = {u: _decimate(plotted[u], budget, keep) for u in units}
    total, drawn = sum(len(plotted[u]) for u in units), sum(len(v) for v in shown.values())
    if drawn < total:
        page.left_out.append(
            f"curve: {drawn} of {total} points drawn (per stretch of tensors its smallest and largest "
            "error, and every tensor that is not ok)"
        )
    metric = page.doc["settings"].get("metric", "rel_diff")
    label = "1 − cosine" if metric == "cosine" else metric
    svg = [
        f"<svg id='curve' class='chart' viewBox='0 0 {_W} {_H}' width='{_W}' height='{_H}' role='img' "
        f"aria-label='{esc(label)} per tensor in execution order, log scale'>",
        _y_ticks(axis, any(r.error == 0 for u in units for r in shown[u])),
        _x_ticks(axis),
        f"<text class='axis-label' x='{_LEFT + 4}' y='{_TOP - 10}'>{esc(label)} (log)</text>",
        f"<text class='axis-label' x='{_W - _RIGHT}' y='{_H - 6}' text-anchor='end'>tensor, in execution "
        f"order ({'position in its sequence' if page.aligned else 'position in its pass'})</text>",
    ]
    svg += [_line(page, axis, u, shown[u]) for u in units]
    svg.append(_markers(page, axis))
    svg.append("</svg>")
    return "\n".join(svg) + _legend(page, units) + _curve_key()


def _y_ticks(axis: _Axis, zeros: bool) -> str:
    step = max(1, math.ceil((axis.high - axis.low) / 12))
    parts = []
    for decade in range(axis.low, axis.high + 1, step):
        y = axis.y(10.0**decade)
        text = "exact 0" if decade == axis.low and zeros else f"1e{decade}"
        parts.append(
            f"<line class='grid' x1='{_LEFT}' x2='{_W - _RIGHT}' y1='{y}' y2='{y}'/>"
            f"<text class='tick' x='{_LEFT - 6}' y='{y + 4}' text-anchor='end'>{text}</text>"
        )
    return "".join(parts)


def _x_ticks(axis: _Axis) -> str:
    step = max(1, _nice(axis.width / 10))
    parts = [f"<line class='axis' x1='{_LEFT}' x2='{_W - _RIGHT}' y1='{_H - _BOTTOM}' y2='{_H - _BOTTOM}'/>"]
    for position in range(0, axis.width, step):
        x = axis.x(position)
        parts.append(
            f"<line class='axis' x1='{x}' x2='{x}' y1='{_H - _BOTTOM}' y2='{_H - _BOTTOM + 4}'/>"
            f"<text class='tick' x='{x}' y='{_H - _BOTTOM + 16}' text-anchor='middle'>{position}</text>"
        )
    return "".join(parts)


def _nice(value: float) -> int:
    """1, 2 or 5 times a power of ten, at least ``value``."""
    if value <= 1:
        return 1
    power = 10 ** math.floor(math.log10(value))
    return int(next(m * power for m in (1, 2, 5, 10) if m * power >= value))


def _line(page: _Page, axis: _Axis, unit: int, rows: list[_Row]) -> str:
    colour = _LINE_COLOURS[unit % len(_LINE_COLOURS)]
    points = " ".join(f"{axis.x(r.position)},{axis.y(r.error)}" for r in rows)
    steps: list[str] = []
    half = 0.5 * (axis.x(1) - axis.x(0))
    for r in rows:  # a step per tensor, half way to its neighbours, inside the plot
        if r.threshold is not None:
            x, y = axis.x(r.position), axis.y(r.threshold)
            steps.append(f"{round(max(x - half, _LEFT), 1)},{y} {round(min(x + half, _W - _RIGHT), 1)},{y}")
    label = page.units[unit]
    parts = [
        f"<g class='line' data-unit='{unit}'>",
        f"<polyline class='threshold' stroke='{colour}' points='{' '.join(steps)}'/>" if steps else "",
        f"<polyline class='error' stroke='{colour}' points='{points}'/>",
    ]
    for r in rows:
        status = r.data["status"]
        fill = _STATUS_FILL.get(status, colour)
        radius = 4 if status != "ok" else 2.2
        parts.append(
            f"<a href='#t-{r.index}'><circle class='pt s-{esc(status)}' cx='{axis.x(r.position)}' "
            f"cy='{axis.y(r.error)}' r='{radius}' fill='{fill}'><title>{esc(_point_title(label, r))}</title>"
            "</circle></a>"
        )
    parts.append("</g>")
    return "".join(parts)


def _point_title(label: str, row: _Row) -> str:
    data = row.data
    text = f"{row.name}\n{label}, #{row.position}: {data['metric']} {fmt(row.error)}"
    text += f", threshold {fmt(row.threshold)}" if row.threshold is not None else ""
    text += f"\n{status_text(data['status'])}"
    if data.get("name_b") != data.get("name"):
        text += f"\nB: {data.get('name_b')}"
    return text


def _markers(page: _Page, axis: _Axis) -> str:
    parts = []
    for index, cls, text in (
        (page.growth_index, "growth", "largest growth"),
        (page.first_index, "first", "first divergence"),
    ):
        if index is None or (cls == "growth" and index == page.first_index):
            continue
        row = page.row(index)
        x = axis.x(row.position)
        anchor = "end" if x > _W * 0.7 else "start"
        dx = -6 if anchor == "end" else 6
        parts.append(
            f"<g class='marker {cls}' id='marker-{cls}'>"
            f"<line x1='{x}' x2='{x}' y1='{_TOP}' y2='{_H - _BOTTOM}'/>"
            f"<circle cx='{x}' cy='{axis.y(row.error)}' r='7'/>"
            f"<text x='{x + dx}' y='{_TOP + (14 if cls == 'first' else 28)}' text-anchor='{anchor}'>"
            f"{esc(text)}: {esc(_clip_end(visible(row.name), 90))} ({esc(page.units[row.unit])})</text></g>"
        )
    return "".join(parts)


def _legend(page: _Page, units: list[int]) -> str:
    buttons = "".join(
        f"<button type='button' class='swatch' data-unit='{u}' aria-pressed='true'>"
        f"<i class='c{u % len(_LINE_COLOURS)}'></i>{esc(page.units[u])}</button>"
        for u in units
    )
    return f"<div class='legend' id='legend'>{buttons}</div>"


def _curve_key() -> str:
    return (
        "<p class='muted key'>Solid: the error of each tensor; dashed: its threshold (what it had to "
        "stay under); large red dots: diverged. Hover a dot for the module, click it for its row; "
        "click a legend entry to hide its line.</p>"
    )


# ----------------------------------------------------------------------------- the heatmap

_VIRIDIS = (
    (68, 1, 84), (71, 45, 123), (59, 82, 139), (44, 114, 142), (33, 145, 140), (40, 174, 128),
    (94, 201, 98), (173, 220, 48), (253, 231, 37),
)  # fmt: skip
_NO_DATA, _ZERO, _NON_FINITE, _FIRST_LEVEL = 0, 1, 2, 3
_LEVELS = 256 - _FIRST_LEVEL


def _palette() -> list[tuple[int, int, int]]:
    colours = [(255, 255, 255), (236, 236, 236), (214, 39, 40)]
    for level in range(_LEVELS):
        t = level / (_LEVELS - 1) * (len(_VIRIDIS) - 1)
        i = min(int(t), len(_VIRIDIS) - 2)
        f = t - i
        colours.append(
            tuple(round(a + (b - a) * f) for a, b in zip(_VIRIDIS[i], _VIRIDIS[i + 1], strict=True))
        )  # type: ignore[misc]
    return colours


def png(width: int, height: int, pixels: bytes, palette: list[tuple[int, int, int]]) -> bytes:
    """A palette PNG (one byte per pixel, index 0 transparent): the standard library's zlib suffices."""

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    raw = b"".join(b"\x00" + pixels[y * width : (y + 1) * width] for y in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 3, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"PLTE", b"".join(bytes(c) for c in palette))
        + chunk(b"tRNS", b"\x00")
        + chunk(b"IDAT", zlib.compress(raw, 9))
        + chunk(b"IEND", b"")
    )


def _heat_rows(page: _Page) -> list[_Row]:
    rows = [r for r in page.rows if (r.data.get("per_token") or {}).get("rel_diff")]
    heat_rows = _limit().heat_rows
    if len(rows) <= heat_rows:
        return rows

    def worst(r: _Row) -> float:
        value = num(r.data["per_token"].get("worst_rel_diff"))
        return value if value is not None and not math.isnan(value) else 0.0

    keep = {i for i in (page.first_index, page.growth_index) if i is not None}
    first_unit = page.row(page.first_index).unit if page.first_index is not None else None
    ranked = sorted(
        rows, key=lambda r: (r.index not in keep, r.unit != first_unit, r.data["status"] == "ok", -worst(r))
    )
    chosen = {r.index for r in ranked[:heat_rows]}
    page.left_out.append(
        f"heatmap: {heat_rows} of {len(rows)} tensors shown (the first divergence and its "
        f"{'sequence' if page.aligned else 'pass'}, those not ok, then the largest worst-token errors), "
        "in execution order"
    )
    return [r for r in rows if r.index in chosen]


def _cells(rows: list[_Row]) -> tuple[list[list[float | None]], int, int]:
    """Each row's per-token errors by column (a sequence position with --align tokens), at most
    :data:`HEATMAP_COLS` columns: positions binned, each bin its largest error (NaN wins), so a
    100 000-token sequence costs one pass over its values, never a row per position."""
    lists = []
    for row in rows:
        token = row.data["per_token"]
        values = [num(v) for v in token["rel_diff"]]
        lists.append((token.get("positions") or range(len(values)), values))
    width = max((max(positions, default=-1) + 1 for positions, _ in lists), default=0)
    binned = max(math.ceil(width / HEATMAP_COLS), 1)
    columns = math.ceil(width / binned)
    grid: list[list[float | None]] = []
    for positions, values in lists:
        line: list[float | None] = [None] * columns
        for position, value in zip(positions, values, strict=False):
            line[position // binned] = _larger(line[position // binned], value)
        grid.append(line)
    return grid, width, binned


def _heatmap(page: _Page) -> str:
    rows = _heat_rows(page)
    if not rows:
        return "<p class='muted'>No tensor was measured per token (no token dim found, or stats dumps).</p>"
    cells, width, binned = _cells(rows)
    columns = len(cells[0])
    if binned > 1:
        page.left_out.append(
            f"heatmap: {width} token positions in {columns} columns of {binned} (each the largest error)"
        )
    finite = [v for line in cells for v in line if v is not None and 0 < v < math.inf]
    low = math.log10(min(finite)) if finite else -16.0
    high = max(math.log10(max(finite)) if finite else -15.0, low + 1e-9)
    pixels = bytes(_level(v, low, high) for line in cells for v in line)
    image = base64.b64encode(png(columns, len(cells), pixels, _palette())).decode()
    cell_w = max(1.0, min(24.0, 900 / columns))
    row_h = max(2.0, min(16.0, 560 / len(cells)))
    labels = row_h >= 9
    several = len({r.unit for r in rows}) > 1
    left = 300 if labels else (90 if several else 16)
    width_px, height_px = round(columns * cell_w, 1), round(len(cells) * row_h, 1)
    total_w, total_h = left + width_px + 90, height_px + 46
    first = page.first_index
    parts = [
        f"<svg id='heatmap' class='chart' viewBox='0 0 {total_w} {total_h}' width='{total_w}' "
        f"height='{total_h}' role='img' aria-label='rel_diff per tensor and token position, log colour'>",
        f"<image class='cells' x='{left}' y='8' width='{width_px}' height='{height_px}' "
        f"preserveAspectRatio='none' href='data:image/png;base64,{image}'/>",
    ]
    last_label = -100.0
    for i, row in enumerate(rows):
        y = round(8 + i * row_h, 1)
        if several and not labels and (i == 0 or row.unit != rows[i - 1].unit):
            parts.append(
                f"<line class='unit-edge' x1='{left - 4}' x2='{left + width_px}' y1='{y}' y2='{y}'/>"
            )
            if y - last_label >= 12:  # the unit's name where it fits
                parts.append(
                    f"<text class='tick' x='{left - 6}' y='{y + 9}' text-anchor='end'>"
                    f"{esc(page.units[row.unit])}</text>"
                )
                last_label = y
        token = row.data["per_token"]
        title = (
            f"{row.name} ({page.units[row.unit]})\nworst token {token.get('worst')}: "
            f"rel_diff {fmt(token.get('worst_rel_diff'))}\nclick: its row in the table"
        )
        is_first = " first" if row.index == first else ""
        parts.append(
            f"<a href='#t-{row.index}'><rect class='hrow{is_first}' data-row='{i}' x='{left}' y='{y}' "
            f"width='{width_px}' height='{row_h}'><title>{esc(title)}</title></rect></a>"
        )
        if labels:
            parts.append(
                f"<text class='hlabel{is_first}' x='{left - 6}' y='{y + row_h * 0.75}' text-anchor='end'>"
                f"{esc(_clip(visible(row.name), 44))}</text>"
            )
    parts.append(_heat_axis(left, width_px, height_px, columns, binned))
    parts.append(_colour_bar(left + width_px + 16, height_px, low, high))
    parts.append("</svg>")
    meta = {
        "columns": columns,
        "bin": binned,
        "low": low,
        "high": high,
        "rows": [visible(f"{r.name} ({page.units[r.unit]})") for r in rows],
        "left": left,
        "cellW": cell_w,
        "rowH": row_h,
        "levels": base64.b64encode(pixels).decode(),
    }
    return (
        "\n".join(parts)
        + "<div id='heat-tip' class='tip' hidden></div>"
        + _json_script("heat-data", meta)
        + "<p class='muted key'>Rows: tensors in execution order; columns: token positions"
        + (" (sequence positions)" if page.aligned else "")
        + "; colour: rel_diff per token, log scale; light grey: exactly 0; red: NaN/Inf. "
        "Click a row for its line in the table.</p>"
    )


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else "…" + text[-(width - 1) :]


def _larger(held: float | None, value: float | None) -> float | None:
    """The larger of two errors of one bin; a NaN (an error that is not a number) wins."""
    if held is None or value is None:
        return value if held is None else held
    if math.isnan(held) or math.isnan(value):
        return math.nan
    return max(held, value)


def _level(value: float | None, low: float, high: float) -> int:
    if value is None:
        return _NO_DATA
    if not math.isfinite(value) or value < 0:
        return _NON_FINITE
    if value == 0:
        return _ZERO
    t = (math.log10(value) - low) / (high - low)
    return _FIRST_LEVEL + min(max(round(t * (_LEVELS - 1)), 0), _LEVELS - 1)


def _heat_axis(left: float, width_px: float, height_px: float, columns: int, binned: int) -> str:
    step = max(1, _nice(columns / 10))
    parts = []
    for column in range(0, columns, step):
        x = round(left + (column + 0.5) * width_px / columns, 1)
        parts.append(
            f"<text class='tick' x='{x}' y='{height_px + 22}' text-anchor='middle'>{column * binned}</text>"
        )
    parts.append(
        f"<text class='axis-label' x='{left + width_px}' y='{height_px + 40}' text-anchor='end'>"
        "token position</text>"
    )
    return "".join(parts)


def _colour_bar(x: float, height_px: float, low: float, high: float) -> str:
    stops = "".join(
        f"<stop offset='{i / (len(_VIRIDIS) - 1):.3f}' stop-color='rgb{colour}'/>"
        for i, colour in enumerate(reversed(_VIRIDIS))
    )
    return (
        f"<defs><linearGradient id='viridis' x1='0' x2='0' y1='0' y2='1'>{stops}</linearGradient></defs>"
        f"<rect x='{x}' y='8' width='14' height='{height_px}' fill='url(#viridis)'/>"
        f"<text class='tick' x='{x + 18}' y='16'>{fmt(10**high)}</text>"
        f"<text class='tick' x='{x + 18}' y='{height_px + 8}'>{fmt(10**low)}</text>"
    )


def _json_script(ident: str, data: object) -> str:
    """Data for the page's script, inert (``application/json`` never runs) and unable to close its tag."""
    text = json.dumps(data, ensure_ascii=True, allow_nan=False)
    text = text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    return f"<script type='application/json' id='{ident}'>{text}</script>"


# ----------------------------------------------------------------------------- the table


def _table_indices(page: _Page) -> list[int] | None:
    """The rows in the page: all when they fit; else, as the terminal's ``--max-rows`` picks them,
    the first divergence and its neighbours, the growth row, every row not ok, the largest errors."""
    table_rows = _limit().table_rows
    if len(page.rows) <= table_rows:
        return None
    wanted: list[int] = []
    if page.first_index is not None:
        wanted += [i for i in range(page.first_index - 2, page.first_index + 3) if i in page.by_index]
    if page.growth_index is not None:
        wanted.append(page.growth_index)
    wanted += [r.index for r in page.rows if r.data["status"] != "ok"]
    wanted += [r.index for r in sorted(page.rows, key=lambda r: -(r.error or 0.0)) if r.error is not None]
    return sorted(list(dict.fromkeys(wanted))[:table_rows])


def _table(page: _Page, indices: list[int] | None) -> str:
    rows = page.rows if indices is None else [page.row(i) for i in indices]
    if indices is not None:
        page.left_out.append(
            f"table: {len(rows)} of {len(page.rows)} tensors (the first divergence and its neighbours, "
            "every tensor that is not ok, then the largest errors)"
        )
    with_noise = any(r.data.get("x_noise") is not None for r in page.rows)
    with_tokens = any(r.data.get("per_token") for r in page.rows)
    columns = [
        ("index", "#", "num"),
        ("unit", "sequence" if page.aligned else "pass", "text"),
        ("name", "name", "text"),
        ("shape", "shape", "text"),
        ("dtype", "dtype", "text"),
        ("max_abs", "max_abs", "num"),
        ("rel_diff", "rel_diff", "num"),
        ("cosine", "1 − cosine", "num"),
        ("threshold", "threshold", "num"),
        ("ratio", "× threshold", "num"),
        *([("x_noise", "× noise", "num")] if with_noise else []),
        *([("worst", "worst token", "num")] if with_tokens else []),
        ("status", "status", "text"),
        ("details", "details", "text"),
    ]
    head = "".join(
        f"<th data-col='{i}' data-type='{kind}' aria-sort='none'>"
        f"<button type='button'>{esc(title)}</button></th>"
        for i, (_, title, kind) in enumerate(columns)
    )
    statuses = sorted({r.data["status"] for r in page.rows})
    units = sorted({r.unit for r in rows})
    controls = (
        "<div class='controls'>"
        "<label>name <input id='f-name' type='search' placeholder='part of a name' "
        "autocomplete='off'></label>"
        "<label>status <select id='f-status'><option value=''>all</option>"
        + "".join(f"<option value='{esc(s)}'>{esc(status_text(s))}</option>" for s in statuses)
        + "<option value='!ok'>all but ok</option></select></label>"
        f"<label>{'sequence' if page.aligned else 'pass'} <select id='f-unit'><option value=''>all</option>"
        + "".join(f"<option value='{u}'>{esc(page.units[u])}</option>" for u in units)
        + "</select></label>"
        f"<span id='f-count' class='muted'>{len(rows)} of {len(rows)} rows</span></div>"
    )
    kinds = [kind for _, _, kind in columns]
    body = "".join(_table_row(page, r, kinds, with_noise, with_tokens) for r in rows)
    return (
        controls
        + f"<div class='scroll'><table id='tensors'><thead><tr>{head}</tr></thead>"
        + f"<tbody>{body}</tbody></table></div>"
    )


def _table_row(page: _Page, row: _Row, kinds: list[str], with_noise: bool, with_tokens: bool) -> str:
    d = row.data
    status = d["status"]
    error, threshold = row.error, row.threshold
    ratio = error / threshold if error is not None and threshold else None
    one_minus = None if num(d.get("cosine")) is None else 1 - (num(d.get("cosine")) or 0.0)
    token = d.get("per_token") or {}
    worst = num(token.get("worst_rel_diff"))
    name = f"<code>{_breakable(row.name)}</code>"
    if d.get("name_b") != d.get("name"):
        name += f"<div class='nb'>B: <code>{_breakable(d.get('name_b'))}</code></div>"
    flags = []
    if row.index == page.first_index:
        flags.append("first divergence")
    if row.index == page.growth_index:
        flags.append("largest growth")
    status_html = esc(status_text(status)) + "".join(f"<br>← {esc(f)}" for f in flags)
    cells = [
        (str(row.index), esc(row.index)),
        (esc(page.units[row.unit]), esc(page.units[row.unit])),
        (esc(row.name), name),
        ("", esc(_shape(d))),
        ("", esc(_dtype(d))),
        (_sort_key(num(d.get("max_abs"))), fmt(d.get("max_abs"))),
        (_sort_key(num(d.get("rel_diff"))), fmt(d.get("rel_diff"))),
        (_sort_key(one_minus), fmt(one_minus)),
        (
            _sort_key(threshold),
            f"<span title='set by: {esc(d['basis'])}'>{fmt(threshold)}</span>"
            if d.get("basis")
            else fmt(threshold),
        ),
        (_sort_key(ratio), fmt(ratio)),
        *([(_sort_key(num(d.get("x_noise"))), fmt(d.get("x_noise")))] if with_noise else []),
        *(
            [
                (
                    _sort_key(worst),
                    f"{esc(token['worst'])}: {fmt(worst)}" if token.get("worst") is not None else "-",
                )
            ]
            if with_tokens
            else []
        ),
        (esc(status), f"<span class='st st-{esc(status)}'>{status_html}</span>"),
        ("", _details(d)),
    ]
    tds = "".join(
        f"<td{' class=n' if kind == 'num' else ''}{f' data-v={chr(39)}{v}{chr(39)}' if v else ''}>{text}</td>"
        for (v, text), kind in zip(cells, kinds, strict=True)
    )
    classes = f"s-{esc(status)}" + (" first" if row.index == page.first_index else "")
    return (
        f"<tr id='t-{row.index}' class='{classes}' data-status='{esc(status)}' data-unit='{row.unit}'>"
        f"{tds}</tr>"
    )


def _breakable(name: object) -> str:
    """A dotted module name, escaped, that wraps after a dot rather than inside a word."""
    return esc(name).replace(".", ".<wbr>")


def _details(data: dict[str, Any]) -> str:
    """The message, a stats pair's statistics, and any field of the record no column shows."""
    parts = []
    if data.get("message"):
        parts.append(esc(data["message"]))
    if data.get("kind") == "stats" and data.get("error") is not None and data.get("status") != "ok":
        parts.append(f"stats: largest relative error {fmt(data['error'])}")
    if data.get("stats"):
        parts.append(_stats(data["stats"]))
    for key in sorted(set(data) - _SHOWN_KEYS):
        value = json.dumps(data[key], default=str, ensure_ascii=False)
        parts.append(f"{esc(key)}: {esc(_clip_end(value, 300))}")
    return "<br>".join(parts)


def _stats(stats: dict[str, Any]) -> str:
    """A stats pair's statistics, the most different first: ``max 1.35 vs 0.91 (0.33)``."""
    ranked = sorted(stats.items(), key=lambda item: -(num((item[1] or {}).get("rel_err")) or 0.0))
    return "; ".join(
        f"{esc(name)} {fmt(delta.get('a'))} vs {fmt(delta.get('b'))} ({fmt(delta.get('rel_err'))})"
        for name, delta in ranked[:4]
        if isinstance(delta, dict)
    ) + (f"; {len(ranked) - 4} more" if len(ranked) > 4 else "")


def _clip_end(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


# ----------------------------------------------------------------------------- the notes


def _listing(title: str, items: list[str], ident: str) -> str:
    if not items:
        return ""
    listed = _limit().listed
    shown = items[:listed]
    more = (
        f"<li class='muted'>… {len(items) - listed} more (in the --json report)</li>"
        if len(items) > listed
        else ""
    )
    return (
        f"<details class='note' id='{ident}' open><summary>{esc(title)} ({len(items)})</summary><ul>"
        + "".join(f"<li>{item}</li>" for item in shown)
        + more
        + "</ul></details>"
    )


def _notes(page: _Page) -> str:
    doc, s = page.doc, page.summary
    sections = [
        _listing(
            "Notes", [esc(n) for n in [*s.get("notes", []), *doc["settings"].get("notes", [])]], "n-notes"
        ),
        _listing("Routing flips", [_flip(f) for f in s.get("routing_flips") or []], "n-flips"),
        _listing(
            "Tensors not compared",
            [
                f"{_link(r.index, '<code>' + esc(r.name) + '</code>')} ({esc(page.units[r.unit])}): "
                f"{esc(status_text(r.data['status']))}"
                + (f": {esc(r.data['message'])}" if r.data.get("message") else "")
                for r in page.rows
                if r.data["status"] in _NOT_COMPARED
            ],
            "n-not-compared",
        ),
        _listing("Only in A", [_unmatched(u) for u in doc.get("only_in_a", [])], "n-only-a"),
        _listing("Only in B", [_unmatched(u) for u in doc.get("only_in_b", [])], "n-only-b"),
        _listing(
            "Names mapped (A → B)",
            [
                f"<code>{esc(r.data['name'])}</code> → <code>{esc(r.data['name_b'])}</code>"
                for r in page.rows
                if r.data.get("name_b") != r.data.get("name")
            ],
            "n-mapped",
        ),
        _listing("Other fields of the results", _extra_fields(page), "n-extra"),
        _listing(
            "Warnings",
            [f"{esc(rule)} matched no tensor name" for rule in s.get("unused_rules", [])],
            "n-warn",
        ),
        _listing("Sequences", [_alignment(a) for a in s.get("alignment") or []], "n-align"),
        _listing(
            "Other findings of the summary",
            [
                f"<code>{esc(k)}</code>: {_value(v)}"
                for k, v in s.items()
                if k not in _SUMMARY_SHOWN and v not in (None, [], {}, 0)
            ],
            "n-summary",
        ),
        _passes_only(s),
        _settings(doc),
    ]
    return "\n".join(part for part in sections if part)


def _flip(flip: dict[str, Any]) -> str:
    verdict = "near-tie, not a divergence" if flip.get("near_tie") else "routing changed"
    flipped = flip.get("flipped") or []
    return (
        f"router <code>{esc(flip.get('router'))}</code>: {len(flipped)} of {esc(flip.get('tokens'))} tokens "
        f"({esc(', '.join(map(str, flipped[:16])))}{' …' if len(flipped) > 16 else ''}); widest margin "
        f"{fmt(max(flip.get('margins') or [0]))} vs score noise {fmt(flip.get('noise'))}: {esc(verdict)}"
    )


def _unmatched(item: dict[str, Any]) -> str:
    text = f"pass {esc(item.get('pass'))}: <code>{esc(item.get('name'))}</code>"
    if item.get("mapped"):
        text += f" (as <code>{esc(item['mapped'])}</code>)"
    for where in ("root", "sequence"):
        if item.get(where):
            text += f" [{esc(item[where])}]"
    return text


def _extra_fields(page: _Page) -> list[str]:
    counts: dict[str, list[int]] = {}
    for row in page.rows:
        for key in set(row.data) - _SHOWN_KEYS:
            counts.setdefault(key, []).append(row.index)
    return [
        f"<code>{esc(key)}</code> on {len(indices)} tensors "
        f"(first: {_link(indices[0], '#' + str(indices[0]))}; shown in the table's details)"
        for key, indices in sorted(counts.items())
    ]


def _alignment(alignment: dict[str, Any]) -> str:
    text = f"matched by {esc(alignment.get('matched_by'))}: {len(alignment.get('pairs') or [])} pairs"
    for which in ("only_in_a", "only_in_b"):
        if alignment.get(which):
            text += f"; {which.replace('_', ' ')}: {esc(', '.join(map(str, alignment[which])))}"
    for note in alignment.get("notes") or []:
        text += f"<br>{esc(note)}"
    return text


def _passes_only(s: dict[str, Any]) -> str:
    items = [
        f"{label}: {esc(', '.join(map(str, s.get(key) or [])))}"
        for key, label in (
            ("passes_only_in_a", "passes only in A"),
            ("passes_only_in_b", "passes only in B"),
            ("roots_only_in_a", "roots only in A"),
            ("roots_only_in_b", "roots only in B"),
        )
        if s.get(key)
    ]
    return _listing("Passes and roots on one side only", items, "n-passes")


def _settings(doc: dict[str, Any]) -> str:
    settings = {k: v for k, v in doc["settings"].items() if k not in ("defaults", "notes")}
    rows = "".join(f"<tr><th>{esc(k)}</th><td>{_value(v)}</td></tr>" for k, v in settings.items())
    runs = "".join(_side(which, doc["sides"][key]) for which, key in (("A", "a"), ("B", "b")))
    defaults = doc["settings"].get("defaults") or []
    default_rows = ""
    if defaults:
        keys = list(defaults[0])
        default_rows = (
            "<details class='note'><summary>Default thresholds by dtype</summary><table class='kv'><tr>"
            + "".join(f"<th>{esc(k)}</th>" for k in keys)
            + "</tr>"
            + "".join("<tr>" + "".join(f"<td>{esc(d.get(k))}</td>" for k in keys) + "</tr>" for d in defaults)
            + "</table></details>"
        )
    return (
        "<details class='note' id='n-settings' open><summary>Settings of this diff</summary>"
        f"<table class='kv'>{rows}</table></details>{default_rows}{runs}"
    )


def _side(which: str, side: dict[str, Any]) -> str:
    parts = [
        f"<details class='note run' id='n-run-{which.lower()}'>"
        f"<summary>Run {which}: <code>{esc(side.get('path'))}</code></summary>"
    ]
    for label, root in (side.get("roots") or {}).items():
        facts = {k: v for k, v in root.items() if k != "manifest"}
        manifest = root.get("manifest") or {}
        parts.append(
            f"<h4>root <code>{esc(label or '(unnamed)')}</code></h4><table class='kv'>"
            + "".join(
                f"<tr><th>{esc(k)}</th><td>{_value(v)}</td></tr>" for k, v in {**facts, **manifest}.items()
            )
            + "</table>"
        )
    parts.append("</details>")
    return "".join(parts)


def _value(value: object) -> str:
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return "<br>".join(f"<code>{esc(v)}</code>" for v in value[: _limit().listed])
    if isinstance(value, (dict, list)):
        return f"<code>{esc(_clip_end(json.dumps(value, default=str, ensure_ascii=False), 2000))}</code>"
    return esc("-" if value is None else value)


# ----------------------------------------------------------------------------- style and script

_STYLE = """
:root{--fg:#1d1f23;--muted:#6b7280;--line:#e5e7eb;--bg:#fff;--card:#f8fafc;--bad:#c81e1e;--good:#0a7d32}
*{box-sizing:border-box}
body{margin:0 auto;max-width:1240px;padding:16px 24px 64px;color:var(--fg);background:var(--bg);
  font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif}
h1{font-size:20px;margin:0 0 4px}
h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid var(--line);padding-bottom:4px}
h4{margin:10px 0 4px}
code{font:12.5px/1.3 ui-monospace,SFMono-Regular,Menlo,monospace;overflow-wrap:anywhere}
a{color:#1d4ed8;text-decoration:none}
a:hover{text-decoration:underline}
.muted{color:var(--muted)}
.sides{display:flex;flex-wrap:wrap;gap:4px 24px;color:var(--muted)}
#summary{margin-top:12px;padding:14px 18px;border-radius:8px;background:var(--card);
  border-left:6px solid var(--good)}
#summary.exit-1{border-left-color:var(--bad)}
.verdict{font-size:18px;font-weight:600}
.exit{display:inline-block;padding:1px 10px;border-radius:12px;color:#fff;background:var(--good);
  font-size:15px}
.exit-1 .exit{background:var(--bad)}
.lead{font-size:16px;margin:8px 0}
dl.why{display:grid;grid-template-columns:max-content 1fr;gap:2px 14px;margin:6px 0 10px}
dl.why dt{color:var(--muted)}
dl.why dd{margin:0}
.tiles{display:flex;flex-wrap:wrap;gap:8px;margin:10px 0}
.tile{background:#fff;border:1px solid var(--line);border-radius:6px;padding:4px 10px;min-width:86px}
.tile b{display:block;font-size:17px}
.tile span{color:var(--muted);font-size:12px}
.tile.bad b{color:var(--bad)}
details.lines pre{white-space:pre-wrap;font-size:12px;background:#fff;padding:8px;
  border:1px solid var(--line);border-radius:4px;max-height:320px;overflow:auto}
.bounds{margin:12px 0;padding:8px 14px;background:#fff8e1;border:1px solid #f5d77a;border-radius:6px}
.bounds ul{margin:4px 0}
.chart{display:block;max-width:100%;height:auto;overflow:visible}
.chart text{font-size:11px;fill:#374151}
.chart .axis-label{fill:var(--muted);font-size:12px}
.grid{stroke:#eef0f3}
.axis{stroke:#9ca3af}
.error{fill:none;stroke-width:1.4}
.threshold{fill:none;stroke-width:1.1;stroke-dasharray:4 3;opacity:.55}
.pt{stroke:#fff;stroke-width:.6}
.pt.s-diverged{stroke:#7f1d1d}
.line.off{display:none}
.marker line{stroke-width:1.4}
.marker circle{fill:none;stroke-width:2}
.marker text{font-size:12px;font-weight:600}
.marker.first line,.marker.first circle{stroke:#d62728}
.marker.first text{fill:#b91c1c}
.marker.growth line,.marker.growth circle{stroke:#f59e0b;stroke-dasharray:3 3}
.marker.growth text{fill:#b45309}
.legend{display:flex;flex-wrap:wrap;gap:4px 8px;margin:6px 0 0 60px}
.swatch{border:1px solid var(--line);background:#fff;border-radius:12px;padding:1px 9px;
  font-size:12px;cursor:pointer}
.swatch[aria-pressed=false]{opacity:.4}
.swatch i{display:inline-block;width:14px;height:3px;margin:0 6px 3px 0;vertical-align:middle}
.c0{background:#1f77b4}
.c1{background:#ff7f0e}
.c2{background:#2ca02c}
.c3{background:#9467bd}
.c4{background:#17becf}
.c5{background:#8c564b}
.c6{background:#e377c2}
.c7{background:#7f7f7f}
.c8{background:#bcbd22}
.c9{background:#393b79}
.key{font-size:12px;margin:4px 0 0}
.cells{image-rendering:pixelated;image-rendering:crisp-edges}
.hrow{fill:transparent;cursor:pointer}
.hrow:hover{stroke:#111;stroke-width:1}
.hrow.first{stroke:#d62728;stroke-width:1.5}
.unit-edge{stroke:#fff;stroke-width:1}
.hlabel{font-family:ui-monospace,Menlo,monospace;font-size:10.5px}
.hlabel.first{fill:#b91c1c;font-weight:700}
.tip{position:fixed;z-index:5;pointer-events:none;background:#111827;color:#fff;padding:4px 8px;
  border-radius:4px;font-size:12px;white-space:pre}
.controls{display:flex;flex-wrap:wrap;gap:8px 18px;align-items:center;margin:6px 0}
.controls input,.controls select{font:inherit;padding:2px 6px}
.scroll{overflow:auto;max-height:80vh;border:1px solid var(--line);border-radius:6px}
#tensors{border-collapse:collapse;min-width:100%;font-size:12.5px}
#tensors th{position:sticky;top:0;background:#f3f4f6;text-align:left;white-space:nowrap;z-index:1}
#tensors th button{font:inherit;font-weight:600;border:0;background:none;padding:5px 6px;cursor:pointer}
#tensors th[aria-sort=ascending] button::after{content:" ▲"}
#tensors th[aria-sort=descending] button::after{content:" ▼"}
#tensors td{padding:3px 5px;border-top:1px solid var(--line);vertical-align:top;white-space:nowrap}
#tensors td.n{text-align:right;font-variant-numeric:tabular-nums}
#tensors td:nth-child(2),#tensors td:nth-child(3){text-align:left}
#tensors td:nth-child(3){white-space:normal;min-width:280px;max-width:440px}
#tensors td:last-child{white-space:normal;max-width:420px;color:var(--muted)}
#tensors td code{overflow-wrap:break-word}
#tensors tr.s-diverged{background:#fef2f2}
#tensors tr.first{background:#fecaca;font-weight:600}
#tensors tr.s-shape_mismatch,#tensors tr.s-error{background:#fffbeb}
#tensors tr.s-rank_mismatch{background:#f5f3ff}
#tensors tr.s-routing_flip{background:#ecfeff}
#tensors tr.s-routing,#tensors tr.s-not_aligned{color:var(--muted)}
#tensors tr:target{outline:2px solid #2563eb}
#tensors tr.flash{animation:flash 1.6s}
@keyframes flash{from{background:#bfdbfe}}
.nb{color:var(--muted);font-size:11.5px}
.st-diverged{color:var(--bad);font-weight:700}
details.note{margin:8px 0;border:1px solid var(--line);border-radius:6px;padding:6px 12px}
details.note summary{cursor:pointer;font-weight:600}
details.note ul{margin:6px 0;padding-left:20px}
table.kv{border-collapse:collapse;font-size:12.5px;margin:4px 0}
table.kv th,table.kv td{text-align:left;padding:2px 10px 2px 0;vertical-align:top;
  border-top:1px solid var(--line)}
table.kv th{color:var(--muted);font-weight:500;white-space:nowrap}
"""

_SCRIPT = """
(function () {
  "use strict";
  var table = document.getElementById("tensors");
  var body = table ? table.tBodies[0] : null;
  var nameBox = document.getElementById("f-name");
  var statusBox = document.getElementById("f-status");
  var unitBox = document.getElementById("f-unit");
  var count = document.getElementById("f-count");
  var rows = body ? Array.prototype.slice.call(body.rows) : [];

  function cellValue(row, col, numeric) {
    var cell = row.cells[col];
    var v = cell.getAttribute("data-v");
    if (numeric) { return v === null || v === "" ? NaN : parseFloat(v); }
    return (v === null ? cell.textContent : v).toLowerCase();
  }

  function sortBy(th) {
    var col = parseInt(th.getAttribute("data-col"), 10);
    var numeric = th.getAttribute("data-type") === "num";
    var descending = th.getAttribute("aria-sort") === "ascending";
    Array.prototype.forEach.call(table.tHead.rows[0].cells, function (other) {
      other.setAttribute("aria-sort", "none");
    });
    th.setAttribute("aria-sort", descending ? "descending" : "ascending");
    var keyed = rows.map(function (row, i) { return [cellValue(row, col, numeric), i, row]; });
    keyed.sort(function (x, y) {
      var a = x[0], b = y[0];
      var missingA = numeric ? isNaN(a) : a === "", missingB = numeric ? isNaN(b) : b === "";
      if (missingA !== missingB) { return missingA ? 1 : -1; }
      if (!missingA && a !== b) { return (a < b ? -1 : 1) * (descending ? -1 : 1); }
      return x[1] - y[1];
    });
    keyed.forEach(function (k) { body.appendChild(k[2]); });
    rows = keyed.map(function (k) { return k[2]; });
  }

  function applyFilter() {
    var text = nameBox.value.trim().toLowerCase();
    var status = statusBox.value, unit = unitBox.value, shown = 0;
    rows.forEach(function (row) {
      var name = row.cells[2].textContent.toLowerCase();
      var rowStatus = row.getAttribute("data-status");
      var ok = (!text || name.indexOf(text) >= 0) &&
        (!status || (status === "!ok" ? rowStatus !== "ok" : rowStatus === status)) &&
        (!unit || row.getAttribute("data-unit") === unit);
      row.hidden = !ok;
      if (ok) { shown += 1; }
    });
    count.textContent = shown + " of " + rows.length + " rows";
  }

  function reveal() {
    var id = decodeURIComponent(location.hash.slice(1));
    var row = id ? document.getElementById(id) : null;
    if (!row || row.tagName !== "TR") { return; }
    if (row.hidden) { nameBox.value = ""; statusBox.value = ""; unitBox.value = ""; applyFilter(); }
    row.classList.remove("flash"); void row.offsetWidth; row.classList.add("flash");
    row.scrollIntoView({block: "center"});
  }

  if (table) {
    Array.prototype.forEach.call(table.tHead.rows[0].cells, function (th) {
      th.querySelector("button").addEventListener("click", function () { sortBy(th); });
    });
    nameBox.addEventListener("input", applyFilter);
    statusBox.addEventListener("change", applyFilter);
    unitBox.addEventListener("change", applyFilter);
    window.addEventListener("hashchange", reveal);
    applyFilter();
  }

  Array.prototype.forEach.call(document.querySelectorAll(".swatch"), function (button) {
    button.addEventListener("click", function () {
      var on = button.getAttribute("aria-pressed") !== "true";
      button.setAttribute("aria-pressed", on ? "true" : "false");
      var line = document.querySelector("#curve .line[data-unit='" + button.getAttribute("data-unit") + "']");
      if (line) { line.classList.toggle("off", !on); }
    });
  });

  var heat = document.getElementById("heat-data");
  var svg = document.getElementById("heatmap");
  var tip = document.getElementById("heat-tip");
  if (heat && svg && tip) {
    var meta = JSON.parse(heat.textContent);
    var levels = atob(meta.levels);
    svg.addEventListener("mousemove", function (event) {
      var point = svg.createSVGPoint();
      point.x = event.clientX; point.y = event.clientY;
      var p = point.matrixTransform(svg.getScreenCTM().inverse());
      var col = Math.floor((p.x - meta.left) / meta.cellW), row = Math.floor((p.y - 8) / meta.rowH);
      if (col < 0 || row < 0 || col >= meta.columns || row >= meta.rows.length) { tip.hidden = true; return; }
      var level = levels.charCodeAt(row * meta.columns + col), value;
      if (level === 0) { value = "no data"; }
      else if (level === 1) { value = "rel_diff 0"; }
      else if (level === 2) { value = "NaN/Inf"; }
      else {
        var v = Math.pow(10, meta.low + (level - 3) / 252 * (meta.high - meta.low));
        value = "rel_diff \\u2248 " + v.toPrecision(2);
      }
      var first = col * meta.bin, where = meta.bin > 1 ? first + "-" + (first + meta.bin - 1) : String(first);
      tip.textContent = meta.rows[row] + "\\nposition " + where + ": " + value;
      tip.style.left = (event.clientX + 14) + "px"; tip.style.top = (event.clientY + 10) + "px";
      tip.hidden = false;
    });
    svg.addEventListener("mouseleave", function () { tip.hidden = true; });
  }
  reveal();
})();
"""
