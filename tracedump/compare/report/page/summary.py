"""The page's summary: the exit code, the first divergence and why (with the verdict's numbers),
the counts, the largest growth and the terminal's verdict lines."""

from __future__ import annotations

from typing import Any

from markupsafe import Markup

from ...judge.status import status_text
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
    return {
        "index": first["index"],
        "name": visible(first["name"]),
        "name_b": visible(first["name_b"]) if first["name_b"] != first["name"] else None,
        "where": where,
        "facts": why(row),
    }


def why(row: dict[str, Any]) -> list[tuple[str, str | Markup]]:
    """Why a record has its status, as (term, text) pairs: the judge's reason (the comparison
    against its threshold, where the threshold came from, the rule that decided), then how the pair
    was made, the judge's detail and the numbers."""
    reason = row.get("reason")
    facts: list[tuple[str, str | Markup]] = (
        reason_facts(reason) if isinstance(reason, dict) else [("why", status_text(row["status"]))]
    )
    if row.get("paired_by"):
        facts.append(("paired by", visible(row["paired_by"])))
    if row.get("message"):
        facts.append(("detail", visible(row["message"])))
    facts += _numbers(row)
    facts.append(("shape, dtype", f"{visible(shape(row))}, {visible(dtype(row))}"))
    return facts


def reason_facts(reason: dict[str, Any]) -> list[tuple[str, str | Markup]]:
    """A record's ``reason`` (:class:`~tracedump.compare.judge.reason.Reason`) as the page's terms."""
    terms = (("why", "text"), ("threshold from", "threshold_from"), ("decided by", "decided_by"))
    return [(term, visible(reason[key])) for term, key in terms if reason.get(key)]


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
