"""The page's summary: the exit code, the first divergence and why (with the verdict's numbers),
the counts, the largest growth and the terminal's verdict lines."""

from __future__ import annotations

import math
from typing import Any

from markupsafe import Markup

from ...judge.status import Status, status_text
from ..display import dtype_text
from .limits import current, fmt, num, visible
from .rows import NOT_COMPARED, Page, html, link


def summary(page: Page) -> dict[str, Any]:
    """What the template's summary section shows, each string from the dump already visible."""
    s = page.summary
    exit_code = int(s["exit_code"])
    view: dict[str, Any] = {
        "exit_code": exit_code,
        "verdict": "diverged" if exit_code else "no divergence",
        "first": None,
        "lead": None,
        "tiles": _tiles(page),
        "growth": _growth(page),
    }
    first = s.get("first_divergence")
    if first is not None:
        view["first"] = _first_divergence(page, first)
    elif exit_code == 0:
        view["lead"] = html(
            "Every compared tensor is within tolerance ({}).", page.doc["settings"].get("tolerance", "")
        )
    else:
        failing = next((r for r in page.rows if r.status in NOT_COMPARED[:2]), None)
        if failing is not None:
            message = failing.data.get("message")
            view["lead"] = html(
                "No numeric divergence, but {}: {}{}",
                link(failing.index, failing.name),
                status_text(failing.status),
                html(" ({})", message) if message else Markup(""),
            )
    limit = current().lines
    view["lines"] = [visible(line) for line in page.lines[:limit]]  # each line cut on its own
    view["more_lines"] = max(len(page.lines) - limit, 0)
    return view


def _first_divergence(page: Page, first: dict[str, Any]) -> dict[str, Any]:
    row = page.row(first["index"]).data
    where = html("in {}", page.unit_of(first["index"]))
    spot = next((a.get("first") for a in page.summary.get("alignment") or [] if a.get("first")), None)
    if spot is not None:
        where = html(
            "<b>{}</b>, position <b>{}</b>, step {}", spot["sequence"], spot["position"], spot["step"]
        )
    elif not page.aligned:
        where = html("pass <b>{}</b>", first["pass"]) + (
            html(", root {}", row["root"]) if row.get("root") else Markup("")
        )
    factor = (page.doc["settings"].get("verdict") or {}).get("baseline_factor")
    return {
        "index": first["index"],
        "name": visible(first["name"]),
        "name_b": visible(first["name_b"]) if first["name_b"] != first["name"] else None,
        "where": where,
        "facts": why(row, factor),
    }


def why(row: dict[str, Any], factor: object) -> list[tuple[str, str | Markup]]:
    """Why a record has its status, as (term, text) pairs: the comparison against its threshold
    and where the threshold came from, the record's reason when it carries one, and its numbers."""
    metric = "1 − cosine" if row["metric"] == "cosine" else row["metric"]
    error, threshold = num(row.get("error")), num(row.get("tolerance"))
    facts: list[tuple[str, str | Markup]] = []
    nonfinite = any(row.get(k) for k in ("nan_a", "nan_b", "inf_a", "inf_b"))
    if (
        row["status"] == Status.DIVERGED
        and error is not None
        and nonfinite
        and not error > (threshold or 0.0)
    ):
        # only the NaN/Inf pattern differs (as the terminal says): "rel_diff 0 > threshold" would be false
        facts.append(
            (
                "why",
                f"NaN/Inf only: {metric} of the finite values {fmt(error)} ≤ threshold "
                f"{fmt(threshold)}; the NaN/Inf positions differ",
            )
        )
        facts.append(("threshold from", visible(_basis(row, factor))))
    elif row["status"] == Status.DIVERGED and error is not None:
        ratio = error / threshold if threshold else math.inf
        facts.append(("why", f"{metric} {fmt(error)} > threshold {fmt(threshold)} ({fmt(ratio)}×)"))
        facts.append(("threshold from", visible(_basis(row, factor))))
    else:
        facts.append(("why", status_text(row["status"])))
    if row.get("reason"):
        facts.append(("reason", reason_text(row["reason"])))
    if row.get("paired_by"):
        facts.append(("paired by", visible(row["paired_by"])))
    if row.get("message"):
        facts.append(("detail", visible(row["message"])))
    facts += _numbers(row)
    facts.append(("shape, dtype", f"{visible(shape(row))}, {visible(dtype(row))}"))
    return facts


def _numbers(row: dict[str, Any]) -> list[tuple[str, str | Markup]]:
    facts: list[tuple[str, str | Markup]] = []
    if row.get("max_abs") is not None:
        where = f" at {visible(row['argmax'])}" if row.get("argmax") is not None else ""
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
            (
                "worst token",
                f"position {visible(token['worst'])}: rel_diff {fmt(token.get('worst_rel_diff'))}",
            )
        )
    return facts


def reason_text(reason: object) -> str:
    """A record's reason for its status as one line: a mapping as ``key value`` parts, the
    ``text`` or ``summary`` field first where it has one."""
    if not isinstance(reason, dict):
        return visible(reason)
    ordered = sorted(reason.items(), key=lambda item: item[0] not in ("text", "summary"))
    return visible(
        "; ".join(
            str(value) if key in ("text", "summary") else f"{key} {value}"
            for key, value in ordered
            if value not in (None, [], {}, "")
        )
    )


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


def _tiles(page: Page) -> list[tuple[str, object, bool]]:
    """(label, count, whether it is bad) for each count of the summary."""
    s = page.summary
    return [
        ("compared", s["compared"], False),
        ("ok", s["ok"], False),
        ("diverged", s["diverged"], bool(s["diverged"])),
        ("shape mismatch", s["shape_mismatch"], bool(s["shape_mismatch"])),
        ("rank mismatch", s["rank_mismatch"], bool(s["rank_mismatch"])),
        ("errors", s["errors"], bool(s["errors"])),
        ("routing flips", len(s.get("routing_flips") or []), False),
        ("not compared", s.get("not_compared_routing", 0) + s.get("not_aligned", 0), False),
        ("only in A", s["only_in_a"], False),
        ("only in B", s["only_in_b"], False),
        (
            "sequences" if page.aligned else "passes",
            len(page.units) if page.aligned else len(s["passes"]),
            False,
        ),
    ]


def _growth(page: Page) -> Markup | None:
    growth = page.summary.get("largest_growth")
    if growth is None or growth["index"] == page.first_index:
        return None
    return html(
        "Largest growth: {} in {}: {} {}, {}× the largest error before it ({}).",
        link(growth["index"], growth["name"]),
        page.unit_of(growth["index"]),
        growth["metric"],
        fmt(growth["error"]),
        fmt(growth["ratio"]),
        fmt(growth["previous_max"]),
    )


def shape(row: dict[str, Any]) -> str:
    a, b = row.get("shape_a"), row.get("shape_b")
    if a is None and b is None:
        return "?"
    return str(a) if a == b or b is None else f"{a} vs {b}"


def dtype(row: dict[str, Any]) -> str:
    return dtype_text(row.get("dtype_a"), row.get("dtype_b"))
