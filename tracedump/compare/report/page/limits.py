"""The page's bounds, and the strings from a dump as the page shows them (cut, control characters
visible).

Every bound is a module constant read when a page is drawn, so a test can make it small. A
drawing works within one :class:`Limits`; :func:`drawing` sets it for the code that draws, and
:func:`cut` counts the strings it shortened, so the page can say so at its top.
"""

from __future__ import annotations

import html
import math
import re
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

MAX_LINES = 24  # lines (passes or sequences) in the curve
MAX_POINTS = 3000  # markers in the curve, over every line
HEATMAP_ROWS = 240
HEATMAP_COLS = 512
MAX_TABLE_ROWS = 4000
MAX_LISTED = 200
MAX_TEXT = 1000  # characters of one string from a dump (a name, a message) shown before the cut
MAX_LINES_SHOWN = 400  # lines of the terminal's verdict in the summary
MAX_PAGE_BYTES = 6 << 20  # "a few MB" (docs/comparator.md): the page is drawn again, tighter, above it

# Each further drawing of a page over MAX_PAGE_BYTES: (text, divisor of rows/points/names/lines).
TIGHTER = ((200, 4), (60, 20))


@dataclass
class Limits:
    """The bounds one drawing of the page works within, and how many strings it cut."""

    text: int
    table_rows: int
    points: int
    listed: int
    heat_rows: int
    lines: int
    summary_only: bool = False
    cut: int = 0  # strings cut at ``text`` characters in this drawing


def first_limits() -> Limits:
    """The module's constants, read when a page is drawn (tests set them smaller)."""
    return Limits(
        text=MAX_TEXT,
        table_rows=MAX_TABLE_ROWS,
        points=MAX_POINTS,
        listed=MAX_LISTED,
        heat_rows=HEATMAP_ROWS,
        lines=MAX_LINES_SHOWN,
    )


def attempts() -> list[Limits]:
    """The drawings to try in turn: the module's limits, tighter ones, the summary alone."""
    from dataclasses import replace

    first = first_limits()
    tighter = [
        replace(
            first,
            text=text,
            table_rows=max(first.table_rows // divisor, 20),
            points=max(first.points // divisor, 100),
            listed=max(first.listed // divisor, 10),
            heat_rows=max(first.heat_rows // divisor, 12),
            lines=max(first.lines // divisor, 20),
        )
        for text, divisor in TIGHTER
    ]
    return [first, *tighter, replace(tighter[-1], summary_only=True)]


_LIMITS: ContextVar[Limits | None] = ContextVar("tracedump_page_limits", default=None)


@contextmanager
def drawing(limits: Limits) -> Iterator[Limits]:
    """``limits`` in effect for the code that draws one page."""
    token = _LIMITS.set(limits)
    try:
        yield limits
    finally:
        _LIMITS.reset(token)


def current() -> Limits:
    """The limits of the drawing in progress (outside one, the module's: :func:`esc` is public)."""
    limits = _LIMITS.get()
    return limits if limits is not None else first_limits()


def cut(text: str) -> str:
    """``text`` whole, or its first characters and ``… [N more characters]`` when over the page's
    limit for one string (the ``--json`` report holds it whole)."""
    limits = current()
    if len(text) <= limits.text:
        return text
    limits.cut += 1
    return f"{text[: limits.text]}… [{len(text) - limits.text} more characters]"


# C0/C1 controls, bidi overrides and isolates, line/paragraph separators: shown, never obeyed.
_UNSAFE_CHARS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def _escape_char(char: re.Match[str]) -> str:
    code = ord(char.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def shown(text: str) -> str:
    """Control characters and lone surrogates as escapes, nothing cut (tracedump's own lines)."""
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return _UNSAFE_CHARS.sub(_escape_char, text)


def visible(value: object) -> str:
    """Any value as the text a reader sees: cut at the page's limit, control characters and lone
    surrogates as escapes. The template escapes the result for HTML."""
    return shown(cut(str(value)))


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
    """A number of the report in three significant digits; ``-`` where there is none."""
    number = num(value)
    if number is None:
        return "-"
    if not math.isfinite(number):
        return str(number)
    return "0" if number == 0 else f"{number:.3g}"


def sort_key(value: float | None) -> str:
    """A ``data-v`` for the table's sort: missing values sort last either way (JS reads "")."""
    if value is None or math.isnan(value):
        return ""
    return repr(value) if math.isfinite(value) else ("1e999" if value > 0 else "-1e999")


def clip(text: str, width: int) -> str:
    """The end of ``text`` (a module name's last parts say most), at most ``width`` characters."""
    return text if len(text) <= width else "…" + text[-(width - 1) :]


def clip_end(text: str, width: int) -> str:
    """The start of ``text``, at most ``width`` characters."""
    return text if len(text) <= width else text[: width - 1] + "…"
