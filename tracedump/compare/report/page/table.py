"""The page's table of every tensor (sortable, filterable by its script) and its notes: flips,
tensors not compared, names on one side only, mapped names, settings and both runs' manifests."""

from __future__ import annotations

import json
from typing import Any

from markupsafe import Markup, escape

from ...judge.status import Status, status_text
from .limits import clip_end, current, fmt, num, sort_key, visible
from .rows import NOT_COMPARED, OPTIONAL_KEYS, SHOWN_KEYS, SUMMARY_SHOWN, Page, Row, code, html, link
from .summary import dtype, shape


def table_indices(page: Page) -> list[int] | None:
    """The rows in the page: all when they fit; else, as the terminal's ``--max-rows`` picks them,
    the first divergence and its neighbours, the growth row, every row not ok, the largest errors."""
    table_rows = current().table_rows
    if len(page.rows) <= table_rows:
        return None
    wanted: list[int] = []
    if page.first_index is not None:
        wanted += [i for i in range(page.first_index - 2, page.first_index + 3) if i in page.by_index]
    if page.growth_index is not None:
        wanted.append(page.growth_index)
    wanted += [r.index for r in page.rows if r.status != Status.OK]
    wanted += [r.index for r in sorted(page.rows, key=lambda r: -(r.error or 0.0)) if r.error is not None]
    return sorted(list(dict.fromkeys(wanted))[:table_rows])


def table(page: Page) -> dict[str, Any]:
    """The table's columns (title, ``num`` or ``text``), filter choices and rows."""
    indices = table_indices(page)
    rows = page.rows if indices is None else [page.row(i) for i in indices]
    if indices is not None:
        page.left_out.append(
            f"table: {len(rows)} of {len(page.rows)} tensors (the first divergence and its neighbours, "
            "every tensor that is not ok, then the largest errors)"
        )
    optional = {
        "x_noise": any(r.data.get("x_noise") is not None for r in page.rows),
        "worst": any(r.data.get("per_token") for r in page.rows),
        "paired_by": any(r.data.get("paired_by") for r in page.rows),
    }
    columns = [
        ("index", "#", "num"),
        ("unit", page.unit_kind, "text"),
        ("name", "name", "text"),
        ("shape", "shape", "text"),
        ("dtype", "dtype", "text"),
        ("max_abs", "max_abs", "num"),
        ("rel_diff", "rel_diff", "num"),
        ("one_minus", "1 − cosine", "num"),
        ("threshold", "threshold", "num"),
        ("ratio", "× threshold", "num"),
        ("x_noise", "× noise", "num"),
        ("worst", "worst token", "num"),
        ("status", "status", "text"),
        ("paired_by", "paired by", "text"),  # after the status: the columns before keep their places
        ("details", "details", "text"),
    ]
    columns = [column for column in columns if optional.get(column[0], True)]
    return {
        "columns": columns,
        "statuses": [(s, status_text(s)) for s in sorted({r.status for r in page.rows})],
        "ok": Status.OK.value,  # the filter's "all but ok": the page's script decides by this value
        "units": [(u, page.units[u]) for u in sorted({r.unit for r in rows})],
        "rows": [_row(page, r, [key for key, _, _ in columns]) for r in rows],
    }


def _row(page: Page, row: Row, keys: list[str]) -> dict[str, Any]:
    """One table row: its attributes, and its cells (for each column whether it is a number, its
    sort value and what it shows)."""
    d = row.data
    error, threshold = row.error, row.threshold
    ratio = error / threshold if error is not None and threshold else None
    cosine = num(d.get("cosine"))
    token = d.get("per_token") or {}
    worst = num(token.get("worst_rel_diff"))
    numbers = {
        "max_abs": num(d.get("max_abs")),
        "rel_diff": num(d.get("rel_diff")),
        "one_minus": None if cosine is None else 1 - cosine,
        "threshold": threshold,
        "ratio": ratio,
        "x_noise": num(d.get("x_noise")),
        "worst": worst,
    }
    name = visible(row.name)
    status = visible(row.status)
    unit = visible(page.units[row.unit])
    paired_by = visible(d["paired_by"]) if d.get("paired_by") else ""
    flags = "".join(
        f"<br>← {flag}"
        for index, flag in ((page.first_index, "first divergence"), (page.growth_index, "largest growth"))
        if row.index == index
    )
    text: dict[str, tuple[str, str | Markup]] = {
        "index": (str(row.index), str(row.index)),
        "unit": (unit, unit),
        "name": (name, _name_cell(name, d)),
        "shape": ("", visible(shape(d))),
        "dtype": ("", visible(dtype(d))),
        "status": (
            status,
            Markup(f"<span class='st st-{_e(status)}'>{_e(status_text(row.status))}{flags}</span>"),
        ),
        "paired_by": (paired_by, paired_by),
        "details": ("", Markup("<br>".join(_e(part) for part in _details(d)))),
    }
    for key, value in numbers.items():
        text[key] = (sort_key(value), fmt(value))
    if token.get("worst") is not None:
        text["worst"] = (sort_key(worst), f"{visible(token['worst'])}: {fmt(worst)}")
    if d.get("basis"):
        text["threshold"] = (
            text["threshold"][0],
            html("<span title='set by: {}'>{}</span>", d["basis"], fmt(threshold)),
        )
    return {
        "index": row.index,
        "unit": row.unit,
        "status": status,
        "first": row.index == page.first_index,
        "cells": Markup("".join(_cell(key in numbers, *text[key]) for key in keys)),
    }


def _cell(numeric: bool, sort_value: str, shown: str | Markup) -> str:
    """One ``<td>``: numbers right-aligned, ``data-v`` (what the script sorts by) where there is
    one. Built here, not in the template: a big table is 60 000 cells, and a template expression
    per cell made the page several times slower to draw than its data."""
    attributes = (" class='n'" if numeric else "") + (f" data-v='{_e(sort_value)}'" if sort_value else "")
    return f"<td{attributes}>{_e(shown)}</td>"


def _name_cell(name: str, data: dict[str, Any]) -> Markup:
    """A dotted module name (A's, and B's when it differs) that wraps after a dot, not in a word."""
    cell = f"<code>{_e(name).replace('.', '.<wbr>')}</code>"
    if data.get("name_b") != data.get("name"):
        cell += (
            f"<div class='nb'>B: <code>{_e(visible(data.get('name_b'))).replace('.', '.<wbr>')}</code></div>"
        )
    return Markup(cell)


def _e(text: object) -> str:
    """``text`` HTML-escaped, as a plain string to build a cell from (the hot path of a big table)."""
    return str(escape(text))


def _details(data: dict[str, Any]) -> list[str]:
    """The message, a stats pair's statistics, and any field no column shows (the judge's reason
    is the status, the error, the threshold and their ratio in the columns, the basis in the
    threshold's title; the summary's why and the curve's points say it in words)."""
    parts = []
    if data.get("message"):
        parts.append(visible(data["message"]))
    if data.get("kind") == "stats" and data.get("error") is not None and data.get("status") != Status.OK:
        parts.append(f"stats: largest relative error {fmt(data['error'])}")
    if data.get("stats"):
        parts.append(_stats(data["stats"]))
    for key in sorted(set(data) - SHOWN_KEYS - OPTIONAL_KEYS):
        value = json.dumps(data[key], default=str, ensure_ascii=False)
        parts.append(f"{visible(key)}: {visible(clip_end(value, 300))}")
    return parts


def _stats(stats: dict[str, Any]) -> str:
    """A stats pair's statistics, the most different first: ``max 1.35 vs 0.91 (0.33)``."""
    ranked = sorted(stats.items(), key=lambda item: -(num((item[1] or {}).get("rel_err")) or 0.0))
    return "; ".join(
        f"{visible(name)} {fmt(delta.get('a'))} vs {fmt(delta.get('b'))} ({fmt(delta.get('rel_err'))})"
        for name, delta in ranked[:4]
        if isinstance(delta, dict)
    ) + (f"; {len(ranked) - 4} more" if len(ranked) > 4 else "")


# ----------------------------------------------------------------------------- the notes


def _listing(title: str, items: list[Markup], ident: str) -> dict[str, Any] | None:
    if not items:
        return None
    listed = current().listed
    return {
        "title": title,
        "ident": ident,
        "total": len(items),
        "items": items[:listed],
        "more": max(len(items) - listed, 0),
    }


def notes(page: Page) -> dict[str, Any]:
    """The notes section: lists (each bounded), the settings of the diff and both runs."""
    doc, s = page.doc, page.summary
    listings = [
        _listing(
            "Notes",
            [html("{}", n) for n in [*s.get("notes", []), *doc["settings"].get("notes", [])]],
            "n-notes",
        ),
        _listing("Routing flips", [_flip(f) for f in s.get("routing_flips") or []], "n-flips"),
        _listing(
            "Tensors not compared",
            [
                html("{} ({}): {}", link(r.index, code(r.name)), page.units[r.unit], status_text(r.status))
                + (html(": {}", r.data["message"]) if r.data.get("message") else Markup(""))
                for r in page.rows
                if r.status in NOT_COMPARED
            ],
            "n-not-compared",
        ),
        _listing("Only in A", [_unmatched(u) for u in doc.get("only_in_a", [])], "n-only-a"),
        _listing("Only in B", [_unmatched(u) for u in doc.get("only_in_b", [])], "n-only-b"),
        _listing(
            "Names mapped (A → B)",
            [
                html("{} → {}", code(r.data["name"]), code(r.data["name_b"]))
                for r in page.rows
                if r.data.get("name_b") != r.data.get("name")
            ],
            "n-mapped",
        ),
        _listing("Other fields of the results", _extra_fields(page), "n-extra"),
        _listing(
            "Warnings",
            [html("{} matched no tensor name", rule) for rule in s.get("unused_rules", [])],
            "n-warn",
        ),
        _listing("Sequences", [_alignment(a) for a in s.get("alignment") or []], "n-align"),
        _listing(
            "Other findings of the summary",
            [
                html("{}: {}", code(k), value(v))
                for k, v in s.items()
                if k not in SUMMARY_SHOWN and v not in (None, [], {}, 0)
            ],
            "n-summary",
        ),
        _passes_only(s),
    ]
    settings = {k: v for k, v in doc["settings"].items() if k not in ("defaults", "notes")}
    defaults = doc["settings"].get("defaults") or []
    return {
        "listings": [listing for listing in listings if listing],
        "settings": [(visible(k), value(v)) for k, v in settings.items()],
        "defaults_keys": [visible(k) for k in (defaults[0] if defaults else [])],
        "defaults": [[visible(d.get(k)) for k in defaults[0]] for d in defaults],
        "sides": [_side(which, doc["sides"][key]) for which, key in (("A", "a"), ("B", "b"))],
    }


def _flip(flip: dict[str, Any]) -> Markup:
    verdict = "near-tie, not a divergence" if flip.get("near_tie") else "routing changed"
    flipped = flip.get("flipped") or []
    return html(
        "router {}: {} of {} tokens ({}{}); widest margin {} vs score noise {}: {}",
        code(flip.get("router")),
        len(flipped),
        flip.get("tokens"),
        ", ".join(map(str, flipped[:16])),
        " …" if len(flipped) > 16 else "",
        fmt(max(flip.get("margins") or [0])),
        fmt(flip.get("noise")),
        verdict,
    )


def _unmatched(item: dict[str, Any]) -> Markup:
    text = html("pass {}: {}", item.get("pass"), code(item.get("name")))
    if item.get("mapped"):
        text += html(" (as {})", code(item["mapped"]))
    for where in ("root", "sequence"):
        if item.get(where):
            text += html(" [{}]", item[where])
    return text


def _extra_fields(page: Page) -> list[Markup]:
    counts: dict[str, list[int]] = {}
    for row in page.rows:
        for key in set(row.data) - SHOWN_KEYS - OPTIONAL_KEYS:
            counts.setdefault(key, []).append(row.index)
    return [
        html(
            "{} on {} tensors (first: {}; shown in the table's details)",
            code(key),
            len(indices),
            link(indices[0], f"#{indices[0]}"),
        )
        for key, indices in sorted(counts.items())
    ]


def _alignment(alignment: dict[str, Any]) -> Markup:
    text = html("matched by {}: {} pairs", alignment.get("matched_by"), len(alignment.get("pairs") or []))
    for which in ("only_in_a", "only_in_b"):
        if alignment.get(which):
            text += html("; {}: {}", which.replace("_", " "), ", ".join(map(str, alignment[which])))
    for note in alignment.get("notes") or []:
        text += html("<br>{}", note)
    return text


def _passes_only(s: dict[str, Any]) -> dict[str, Any] | None:
    items = [
        html("{}: {}", label, ", ".join(map(str, s.get(key) or [])))
        for key, label in (
            ("passes_only_in_a", "passes only in A"),
            ("passes_only_in_b", "passes only in B"),
            ("roots_only_in_a", "roots only in A"),
            ("roots_only_in_b", "roots only in B"),
        )
        if s.get(key)
    ]
    return _listing("Passes and roots on one side only", items, "n-passes")


def _side(which: str, side: dict[str, Any]) -> dict[str, Any]:
    roots = []
    for label, root in (side.get("roots") or {}).items():
        facts = {k: v for k, v in root.items() if k != "manifest"}
        manifest = root.get("manifest") or {}
        roots.append(
            (
                visible(label or "(unnamed)"),
                [(visible(k), value(v)) for k, v in {**facts, **manifest}.items()],
            )
        )
    return {"which": which, "path": visible(side.get("path")), "roots": roots}


def value(item: object) -> Markup:
    """A value of the settings or a manifest: a list of names one per line, other lists and
    mappings as JSON (cut), anything else as text."""
    if isinstance(item, list) and item and all(isinstance(v, str) for v in item):
        return Markup("<br>").join(code(v) for v in item[: current().listed])
    if isinstance(item, (dict, list)):
        return code(clip_end(json.dumps(item, default=str, ensure_ascii=False), 2000))
    return html("{}", "-" if item is None else item)
