"""The page drawn: the view of the report (:mod:`.rows`, :mod:`.summary`, :mod:`.table`,
:mod:`.charts`) poured into the Jinja2 template, within the page's byte bound.

Jinja2 is imported here only, when a page is drawn: ``import tracedump`` and a diff without
``--html`` never load it.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from markupsafe import Markup

from ....store.fsio import write_output
from . import limits
from .charts import curve, heatmap
from .limits import Limits, drawing, shown, visible
from .rows import Page, group
from .summary import summary
from .table import notes, table

if TYPE_CHECKING:
    import jinja2

    from ...results import DiffReport


def render(report: DiffReport, doc: dict[str, Any] | None = None) -> str:
    """The whole page, as text; ``doc`` is ``report.to_json()`` when the caller has it already.

    At most ``MAX_PAGE_BYTES`` (UTF-8): drawn with the module's limits first, then tighter ones,
    then as the summary alone, which is bounded whatever the dump holds."""
    from ..display import summary_lines

    doc = doc if doc is not None else report.to_json()
    lines = summary_lines(report)
    size = 0
    text = ""
    for number, attempt in enumerate(limits.attempts()):
        with drawing(attempt):
            text = _draw(doc, lines, attempt, tightened=(number, size))
        size = len(text.encode("utf-8", "surrogatepass"))
        if size <= limits.MAX_PAGE_BYTES:
            break
    return text


def write_html(report: DiffReport, path: str | Path, doc: dict[str, Any] | None = None) -> Path:
    """Write the page atomically (:func:`tracedump.store.fsio.write_output`): a reader never sees
    half of it; a device, a FIFO (``/dev/stdout``) is written into, a link is followed."""
    return write_output(path, render(report, doc))


def _draw(doc: dict[str, Any], lines: list[str], within: Limits, tightened: tuple[int, int]) -> str:
    """One drawing of the page within ``within``; ``tightened``: (how many drawings were over
    the byte bound before this one, the size of the last)."""
    from ...._version import __version__

    page = group(doc, lines)
    view: dict[str, Any] = {"summary": summary(page), "summary_only": within.summary_only}
    if not within.summary_only:
        view |= {"curve": curve(page), "heatmap": heatmap(page), "table": table(page), "notes": notes(page)}
    view["left_out"] = [shown(line) for line in _bounds(page, within, tightened)]
    first = page.summary.get("first_divergence")
    title = f"tracedump diff: exit {page.summary['exit_code']}"
    if first:
        title += f", first divergence {first['name']}"
    style, script = _static("page.css"), _static("page.js")
    view |= {
        "title": visible(title),
        "a": visible(doc["a"]),
        "b": visible(doc["b"]),
        "baseline": visible(doc["settings"]["baseline"]) if doc["settings"].get("baseline") else None,
        "version": __version__,
        "unit_kind": page.unit_kind,
        "style": Markup(style),
        "script": Markup(script),
        # the page can fetch nothing, and runs only its own script and style
        "policy": (
            f"default-src 'none'; img-src data:; style-src 'sha256-{_sha256(style)}'; "
            f"script-src 'sha256-{_sha256(script)}'"
        ),
    }
    return _environment().get_template("page.html.j2").render(view)


def _bounds(page: Page, within: Limits, tightened: tuple[int, int]) -> list[str]:
    """What this drawing left out, said at the top of the page (tracedump's own lines)."""
    said = list(page.left_out)
    if tightened[0]:
        said.append(
            f"page size: drawn {tightened[0] + 1} times to stay under {limits.MAX_PAGE_BYTES / 2**20:.3g} MB "
            f"(the last drawing was {tightened[1] / 2**20:.1f} MB): "
            + (
                "the summary alone"
                if within.summary_only
                else f"at most {within.table_rows} table rows, {within.points} points, "
                f"{within.listed} names per list"
            )
        )
    if within.cut:
        said.append(
            f"{within.cut} strings (names, messages, values) cut at {within.text} characters, "
            'marked "… [N more characters]"'
        )
    return said


def _inert_json(data: object) -> Markup:
    """Data for the page's script, inert (``application/json`` never runs) and unable to close its tag."""
    text = json.dumps(data, ensure_ascii=True, allow_nan=False)
    return Markup(text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026"))


@functools.cache
def _environment() -> jinja2.Environment:
    """The template environment: the package's templates, every value HTML-escaped."""
    import jinja2

    environment = jinja2.Environment(
        loader=jinja2.PackageLoader("tracedump.compare.report.page", "templates"),
        autoescape=True,  # every template here is HTML
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
    )
    environment.filters["inert_json"] = _inert_json
    return environment


@functools.cache
def _static(name: str) -> str:
    """A stylesheet or script shipped with the package, inlined into the page."""
    return (
        resources.files("tracedump.compare.report.page").joinpath("static", name).read_text(encoding="utf-8")
    )


def _sha256(text: str) -> str:
    """The hash by which the Content-Security-Policy allows exactly this inline script or style."""
    return base64.b64encode(hashlib.sha256(text.encode()).digest()).decode()
