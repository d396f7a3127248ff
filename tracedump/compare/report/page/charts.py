"""The page's two charts, as data the template draws: the error through the model (a line per
pass or sequence on a log axis, with its thresholds) and the per-token heatmap.

The curve is SVG the template writes: a few hundred points stay small as SVG, and each point
keeps its hover title and its link to the table's row. The heatmap's cells are one PNG, one pixel
per cell (a 240 x 512 heatmap costs tens of KB, not 120 000 SVG elements), drawn by matplotlib:
without matplotlib (``pip install 'tracedump[plot]'``) the page leaves the heatmap out and says so.
"""

from __future__ import annotations

import base64
import io
import math
from dataclasses import dataclass
from typing import Any

from ...judge.status import Status
from . import limits
from .limits import clip, clip_end, current, fmt, num, visible
from .rows import Page, Row

LINE_COLOURS = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#9467bd",
    "#17becf",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#393b79",
)
_STATUS_FILL = {Status.DIVERGED: "#d62728", Status.RANK_MISMATCH: "#9467bd", Status.ROUTING_FLIP: "#17becf"}
_W, _H = 1100, 380
_LEFT, _RIGHT, _TOP, _BOTTOM = 64, 16, 28, 44


@dataclass
class _Axis:
    """A log10 y axis (exact zeros at the bottom, a decade under every value shown) and a linear x."""

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


def _axis(rows: list[Row], width: int) -> _Axis:
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


def _pick_units(page: Page, plotted: dict[int, list[Row]]) -> list[int]:
    """Every line when they fit; else the first divergence's, then those with a tensor that is not
    ok, then the others, each group evenly spread over the run."""
    units = sorted(plotted)
    most = limits.MAX_LINES
    if len(units) <= most:
        return units
    chosen = {page.row(page.first_index).unit} if page.first_index is not None else set()
    failing = [u for u in units if u not in chosen and any(r.status != Status.OK for r in plotted[u])]
    chosen |= set(_spread(failing, most - len(chosen)))
    others = [u for u in units if u not in chosen]
    chosen |= set(_spread(others, most - len(chosen)))
    page.left_out.append(
        f"curve: {len(chosen)} of {len(units)} {'sequences' if page.aligned else 'passes'} drawn (the first "
        "divergence's, then those with a tensor that is not ok, then the others, each evenly spread)"
    )
    return sorted(chosen)


def _decimate(rows: list[Row], budget: int, keep: set[int]) -> list[Row]:
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
    chosen |= {r.position for r in rows if r.index in keep or r.status != Status.OK}
    return [r for r in rows if r.position in chosen]


def curve(page: Page) -> dict[str, Any] | None:
    """The curve's geometry: ticks, a line per unit (error points, threshold steps, dots) and the
    markers of the first divergence and the largest growth; None when nothing was compared."""
    plotted: dict[int, list[Row]] = {}
    for row in page.rows:
        if row.error is not None:
            plotted.setdefault(row.unit, []).append(row)
    if not plotted:
        return None
    units = _pick_units(page, plotted)
    width = max(max(r.position for r in plotted[u]) + 1 for u in units)
    axis = _axis([r for u in units for r in plotted[u]], width)
    keep = {i for i in (page.first_index, page.growth_index) if i is not None}
    budget = max(current().points // len(units), 50)
    shown = {u: _decimate(plotted[u], budget, keep) for u in units}
    total, drawn = sum(len(plotted[u]) for u in units), sum(len(v) for v in shown.values())
    if drawn < total:
        page.left_out.append(
            f"curve: {drawn} of {total} points drawn (per stretch of tensors its smallest and largest "
            "error, and every tensor that is not ok)"
        )
    metric = page.doc["settings"].get("metric", "rel_diff")
    return {
        "w": _W,
        "h": _H,
        "left": _LEFT,
        "right": _W - _RIGHT,
        "top": _TOP,
        "bottom": _H - _BOTTOM,
        "label": "1 − cosine" if metric == "cosine" else visible(metric),
        "x_label": "position in its sequence" if page.aligned else "position in its pass",
        "y_ticks": _y_ticks(axis, any(r.error == 0 for u in units for r in shown[u])),
        "x_ticks": [(axis.x(p), p) for p in range(0, axis.width, max(1, nice(axis.width / 10)))],
        "lines": [_line(page, axis, u, shown[u]) for u in units],
        "markers": _markers(page, axis),
        "legend": [(u, u % len(LINE_COLOURS), visible(page.units[u])) for u in units],
    }


def _y_ticks(axis: _Axis, zeros: bool) -> list[tuple[float, str]]:
    step = max(1, math.ceil((axis.high - axis.low) / 12))
    return [
        (axis.y(10.0**decade), "exact 0" if decade == axis.low and zeros else f"1e{decade}")
        for decade in range(axis.low, axis.high + 1, step)
    ]


def nice(value: float) -> int:
    """1, 2 or 5 times a power of ten, at least ``value``."""
    if value <= 1:
        return 1
    power = 10 ** math.floor(math.log10(value))
    return int(next(m * power for m in (1, 2, 5, 10) if m * power >= value))


def _line(page: Page, axis: _Axis, unit: int, rows: list[Row]) -> dict[str, Any]:
    colour = LINE_COLOURS[unit % len(LINE_COLOURS)]
    steps: list[str] = []
    half = 0.5 * (axis.x(1) - axis.x(0))
    for r in rows:  # a step per tensor, half way to its neighbours, inside the plot
        if r.threshold is not None:
            x, y = axis.x(r.position), axis.y(r.threshold)
            steps.append(f"{round(max(x - half, _LEFT), 1)},{y} {round(min(x + half, _W - _RIGHT), 1)},{y}")
    label = page.units[unit]
    return {
        "unit": unit,
        "colour": colour,
        "points": " ".join(f"{axis.x(r.position)},{axis.y(r.error)}" for r in rows),
        "steps": " ".join(steps),
        "dots": [
            {
                "index": r.index,
                "status": visible(r.status),
                "x": axis.x(r.position),
                "y": axis.y(r.error),
                "r": 4 if r.status != Status.OK else 2.2,
                "fill": _STATUS_FILL.get(r.status, colour),
                "title": visible(_point_title(label, r)),
            }
            for r in rows
        ],
    }


def _point_title(label: str, row: Row) -> str:
    data = row.data
    text = f"{row.name}\n{label}, #{row.position}: {data['metric']} {fmt(row.error)}"
    text += f", threshold {fmt(row.threshold)}" if row.threshold is not None else ""
    text += f"\n{row.why}"
    if data.get("name_b") != data.get("name"):
        text += f"\nB: {data.get('name_b')}"
    return text


def _markers(page: Page, axis: _Axis) -> list[dict[str, Any]]:
    found = []
    for index, cls, text in (
        (page.growth_index, "growth", "largest growth"),
        (page.first_index, "first", "first divergence"),
    ):
        if index is None or (cls == "growth" and index == page.first_index):
            continue
        row = page.row(index)
        x = axis.x(row.position)
        anchor = "end" if x > _W * 0.7 else "start"
        found.append(
            {
                "cls": cls,
                "x": x,
                "y": axis.y(row.error),
                "text_x": x + (-6 if anchor == "end" else 6),
                "text_y": _TOP + (14 if cls == "first" else 28),
                "anchor": anchor,
                "text": f"{text}: {clip_end(visible(row.name), 90)} ({visible(page.units[row.unit])})",
            }
        )
    return found


# ----------------------------------------------------------------------------- the heatmap

VIRIDIS = (
    (68, 1, 84),
    (71, 45, 123),
    (59, 82, 139),
    (44, 114, 142),
    (33, 145, 140),
    (40, 174, 128),
    (94, 201, 98),
    (173, 220, 48),
    (253, 231, 37),
)
NO_DATA, ZERO, NON_FINITE, FIRST_LEVEL = 0, 1, 2, 3
LEVELS = 256 - FIRST_LEVEL  # the page's script reads a cell's value back from its level


def palette() -> list[tuple[int, int, int, int]]:
    """The RGBA colour of each level: no data transparent, exact zero grey, NaN/Inf red, then
    viridis from the smallest error to the largest."""
    colours = [(255, 255, 255, 0), (236, 236, 236, 255), (214, 39, 40, 255)]
    for level in range(LEVELS):
        t = level / (LEVELS - 1) * (len(VIRIDIS) - 1)
        i = min(int(t), len(VIRIDIS) - 2)
        f = t - i
        r, g, b = (round(a + (c - a) * f) for a, c in zip(VIRIDIS[i], VIRIDIS[i + 1], strict=True))
        colours.append((r, g, b, 255))
    return colours


def png(levels: bytes, width: int, height: int) -> bytes:
    """The cells as a PNG, one pixel per cell, coloured by :func:`palette` (matplotlib writes it;
    ImportError where matplotlib is not installed)."""
    import numpy as np
    from matplotlib.image import imsave

    colours = np.array(palette(), dtype=np.uint8)
    pixels = colours[np.frombuffer(levels, dtype=np.uint8).reshape(height, width)]
    out = io.BytesIO()
    imsave(out, pixels, format="png", metadata={"Software": None})
    return out.getvalue()


def _heat_rows(page: Page) -> list[Row]:
    rows = [r for r in page.rows if (r.data.get("per_token") or {}).get("rel_diff")]
    heat_rows = current().heat_rows
    if len(rows) <= heat_rows:
        return rows

    def worst(r: Row) -> float:
        value = num(r.data["per_token"].get("worst_rel_diff"))
        return value if value is not None and not math.isnan(value) else 0.0

    keep = {i for i in (page.first_index, page.growth_index) if i is not None}
    first_unit = page.row(page.first_index).unit if page.first_index is not None else None
    ranked = sorted(
        rows, key=lambda r: (r.index not in keep, r.unit != first_unit, r.status == Status.OK, -worst(r))
    )
    chosen = {r.index for r in ranked[:heat_rows]}
    page.left_out.append(
        f"heatmap: {heat_rows} of {len(rows)} tensors shown (the first divergence and its "
        f"{page.unit_kind}, those not ok, then the largest worst-token errors), in execution order"
    )
    return [r for r in rows if r.index in chosen]


def cells(rows: list[Row]) -> tuple[list[list[float | None]], int, int]:
    """Each row's per-token errors by column (a sequence position with --align tokens), at most
    ``HEATMAP_COLS`` columns: positions binned, each bin its largest error (NaN wins), so a
    100 000-token sequence costs one pass over its values, never a row per position."""
    lists = []
    for row in rows:
        token = row.data["per_token"]
        values = [num(v) for v in token["rel_diff"]]
        lists.append((token.get("positions") or range(len(values)), values))
    width = max((max(positions, default=-1) + 1 for positions, _ in lists), default=0)
    binned = max(math.ceil(width / limits.HEATMAP_COLS), 1)
    columns = math.ceil(width / binned)
    grid: list[list[float | None]] = []
    for positions, values in lists:
        line: list[float | None] = [None] * columns
        for position, value in zip(positions, values, strict=False):
            line[position // binned] = _larger(line[position // binned], value)
        grid.append(line)
    return grid, width, binned


def _larger(held: float | None, value: float | None) -> float | None:
    """The larger of two errors of one bin; a NaN (an error that is not a number) wins."""
    if held is None or value is None:
        return value if held is None else held
    if math.isnan(held) or math.isnan(value):
        return math.nan
    return max(held, value)


def _level(value: float | None, low: float, high: float) -> int:
    if value is None:
        return NO_DATA
    if not math.isfinite(value) or value < 0:
        return NON_FINITE
    if value == 0:
        return ZERO
    t = (math.log10(value) - low) / (high - low)
    return FIRST_LEVEL + min(max(round(t * (LEVELS - 1)), 0), LEVELS - 1)


def heatmap(page: Page) -> dict[str, Any]:
    """The heatmap's image and geometry; ``{"missing": why}`` when there is nothing to draw or
    no matplotlib to draw it with."""
    rows = _heat_rows(page)
    if not rows:
        return {"missing": "No tensor was measured per token (no token dim found, or stats dumps)."}
    grid, width, binned = cells(rows)
    columns = len(grid[0])
    finite = [v for line in grid for v in line if v is not None and 0 < v < math.inf]
    low = math.log10(min(finite)) if finite else -16.0
    high = max(math.log10(max(finite)) if finite else -15.0, low + 1e-9)
    levels = bytes(_level(v, low, high) for line in grid for v in line)
    try:
        image = base64.b64encode(png(levels, columns, len(grid))).decode()
    except ImportError:
        page.left_out.append("heatmap: left out, matplotlib is not installed (pip install 'tracedump[plot]')")
        return {"missing": "The heatmap needs matplotlib (pip install 'tracedump[plot]'): left out."}
    if binned > 1:
        page.left_out.append(
            f"heatmap: {width} token positions in {columns} columns of {binned} (each the largest error)"
        )
    drawn = _heat_geometry(page, rows, image, columns, binned)
    # what the page's script needs to name a cell under the pointer and read its value back
    drawn["meta"] |= {
        "columns": columns,
        "bin": binned,
        "low": low,
        "high": high,
        "levels": base64.b64encode(levels).decode(),
    }
    return drawn | {
        "low": fmt(10**low),
        "high": fmt(10**high),
        "stops": [(f"{i / (len(VIRIDIS) - 1):.3f}", f"rgb{c}") for i, c in enumerate(reversed(VIRIDIS))],
    }


def _heat_geometry(page: Page, rows: list[Row], image: str, columns: int, binned: int) -> dict[str, Any]:
    cell_w = max(1.0, min(24.0, 900 / columns))
    row_h = max(2.0, min(16.0, 560 / len(rows)))
    labels = row_h >= 9
    several = len({r.unit for r in rows}) > 1
    left = 300 if labels else (90 if several else 16)
    width_px, height_px = round(columns * cell_w, 1), round(len(rows) * row_h, 1)
    drawn, edges, last_label = [], [], -100.0
    for i, row in enumerate(rows):
        y = round(8 + i * row_h, 1)
        if several and not labels and (i == 0 or row.unit != rows[i - 1].unit):
            fits = y - last_label >= 12  # the unit's name where it fits
            edges.append({"y": y, "label": visible(page.units[row.unit]) if fits else None})
            last_label = y if fits else last_label
        token = row.data["per_token"]
        drawn.append(
            {
                "index": row.index,
                "i": i,
                "y": y,
                "first": row.index == page.first_index,
                "title": visible(
                    f"{row.name} ({page.units[row.unit]})\nworst token {token.get('worst')}: "
                    f"rel_diff {fmt(token.get('worst_rel_diff'))}\nclick: its row in the table"
                ),
                "label": clip(visible(row.name), 44) if labels else None,
            }
        )
    step = max(1, nice(columns / 10))
    return {
        "image": image,
        "left": left,
        "width_px": width_px,
        "height_px": height_px,
        "total_w": left + width_px + 90,
        "total_h": height_px + 46,
        "row_h": row_h,
        "rows": drawn,
        "edges": edges,
        "ticks": [
            (round(left + (c + 0.5) * width_px / columns, 1), c * binned) for c in range(0, columns, step)
        ],
        "bar_x": left + width_px + 16,
        "aligned": page.aligned,
        "meta": {
            "rows": [visible(f"{r.name} ({page.units[r.unit]})") for r in rows],
            "left": left,
            "cellW": cell_w,
            "rowH": row_h,
        },
    }
