"""``--html PATH``: the diff as one self-contained page to look at and to share.

The page is built from the report's JSON document
(:meth:`~tracedump.compare.results.DiffReport.to_json`, the ``--json`` schema) and the verdict
lines the terminal prints, never from the table's text: whatever a flag adds to the results (a
baseline's noise, sequences, unsharded or bridged tensors) reaches the page.
It holds, in order: the summary (exit code, first divergence and why, with the numbers), the
error through the model (one line per pass or sequence, log axis, thresholds), the per-token
heatmap, the full table (sortable, filterable) and the notes (flips, tensors not compared, mapped
names, settings and versions of both runs).

Where things are: the markup is a Jinja2 template (``templates/``, autoescaped), the style and
the script are files (``static/``) inlined into the page; Python only chooses and formats what
the template shows (:mod:`.summary`, :mod:`.table`, :mod:`.charts`). A few lines of JavaScript
sort and filter the table, toggle lines and show a heatmap cell's value; without JavaScript the
page still shows everything (hover names come from SVG ``<title>`` elements).

Safety: every string from a dump (names, paths, messages, settings) is shown with control and
bidi characters as ``\\x1b`` / ``\\u202e`` (:func:`.limits.visible`) and HTML-escaped by the
template; the JSON the script reads is embedded with ``<``, ``>`` and ``&`` escaped; and a
Content-Security-Policy allows only this page's own script and style (by hash) and ``data:``
images, so the page can fetch nothing and no injected script could run.

Bounds, for dumps of many passes (:mod:`.limits`): at most ``MAX_LINES`` lines and
``MAX_POINTS`` points in the curve (decimated by keeping each bucket's extremes and every tensor
that is not ok), a heatmap of at most ``HEATMAP_ROWS`` x ``HEATMAP_COLS`` cells (the rows that
matter most, columns binned by their maximum), ``MAX_TABLE_ROWS`` table rows (chosen as the
terminal's ``--max-rows`` chooses) and ``MAX_LISTED`` names per note list; the page says what was
left out. Bounded in bytes too, not only in rows (long names once made a 50 MB page): every
string from a dump is cut at ``MAX_TEXT`` characters, with a marker that says how much was cut,
and a page over ``MAX_PAGE_BYTES`` is drawn again with tighter limits (shorter strings, fewer
rows, points and names), and at last as its summary alone. The ``--json`` report keeps every
string whole.
"""

from __future__ import annotations

from .render import render, write_html

__all__ = ["render", "write_html"]
