"""The pipeline: load -> plan (metadata) -> execute (data) -> report (text, JSON, plot).

:func:`run` is what ``tracedump diff`` calls and returns the exit code; :func:`compare` is the same
pipeline for Python callers and returns the :class:`DiffReport`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from .display import print_report, progress_bar
from .execute import Executor
from .notes import side_notes
from .options import DiffOptions, NameMap, UnshardRule, UsageError, compile_regex, parse_passes
from .plan import Plan, build_plan, short_list
from .plot import check_available, write_plot
from .results import GROWTH_FACTOR, GROWTH_FLOOR, DiffReport
from .sources import open_side
from .tolerance import table_rows


def _settings(options: DiffOptions) -> dict[str, Any]:
    if options.rtol is None and options.atol is None:
        tolerance = f"{options.metric} by dtype defaults"
    else:
        given = ", ".join(
            f"{k} {v:g}" for k, v in (("--rtol", options.rtol), ("--atol", options.atol)) if v is not None
        )
        tolerance = f"{options.metric} with {given}"
    return {
        "metric": options.metric,
        "rtol": options.rtol,
        "atol": options.atol,
        "tolerance": tolerance,
        "passes": options.passes.as_json() if options.passes is not None else None,
        "rank": options.rank,
        "filter": options.filter.pattern if options.filter else None,
        "map": [str(rule) for rule in options.maps],
        "unshard": [str(rule) for rule in options.unshard],
        "growth_factor": GROWTH_FACTOR,
        "growth_floor": GROWTH_FLOOR,
        "defaults": table_rows(),
    }


def _why_nothing(plan: Plan, options: DiffOptions) -> str:
    """Why a plan has no pair: no pass in common, or no name in common (and what may fix that)."""
    if not plan.units:
        return (
            f"no pass is in both dumps (A: {short_list(plan.passes_only_in_a)}; "
            f"B: {short_list(plan.passes_only_in_b)}); to compare passes of different indices, "
            "give one pass file per side"
        )
    hint = " (--filter matched nothing?)" if options.filter else " (names differ: does A need --map?)"
    return (
        f"no tensor name of A is in B{hint}; "
        f"{len(plan.only_in_a)} names only in A, {len(plan.only_in_b)} only in B"
    )


def build_report(options: DiffOptions) -> DiffReport:
    """Load both sides, plan, execute: the whole comparison, without printing anything."""
    side_a = open_side("A", options.a, options)
    side_b = open_side("B", options.b, options)
    plan, workspace = build_plan(side_a, side_b, options)
    if not plan.pairs:
        workspace.close()
        raise UsageError(f"nothing to compare: {_why_nothing(plan, options)}")
    settings = _settings(options)
    if options.unshard:
        settings["unshard_applied"] = any(len(g.runs) > 1 for side in (side_a, side_b) for g in side.groups)
    settings["notes"] = side_notes(side_a) + side_notes(side_b)
    report = DiffReport(side_a.describe(), side_b.describe(), settings, plan)
    with progress_bar(plan, options.progress) as advance:
        report.results = Executor(plan, workspace, advance).run()
    return report


def write_json(report: DiffReport, target: str) -> None:
    text = json.dumps(report.to_json(), indent=1, allow_nan=False)
    if target == "-":
        sys.stdout.write(text + "\n")
        return
    path = Path(target)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def run(options: DiffOptions) -> int:
    """``tracedump diff``: 0 no divergence, 1 divergence, 2 usage error or unreadable input."""
    if options.plot_path is not None:
        check_available(options.plot_path)
    report = build_report(options)
    json_to_stdout = options.json_path == "-"
    try:
        if options.json_path is not None:
            write_json(report, options.json_path)
        if options.plot_path is not None:
            write_plot(report, options.plot_path)
    except OSError as e:
        raise UsageError(f"cannot write the report: {e}") from e
    print_report(report, options.max_rows, table_too=not json_to_stdout, stderr=json_to_stdout)
    return report.exit_code


def compare(
    a: str | Path,
    b: str | Path,
    *,
    passes: str | None = None,
    rank: int | None = None,
    filter: str | None = None,
    maps: list[str] | tuple[str, ...] = (),
    unshard: list[str] | tuple[str, ...] = (),
    metric: str = "rel_diff",
    rtol: float | None = None,
    atol: float | None = None,
) -> DiffReport:
    """Compare dump ``a`` (under test) with ``b`` (reference) from Python; same rules as the CLI."""
    options = DiffOptions(
        a=Path(a),
        b=Path(b),
        passes=parse_passes(passes),
        rank=rank,
        filter=compile_regex(filter, "--filter") if filter else None,
        maps=tuple(NameMap.parse(m) for m in maps),
        unshard=tuple(UnshardRule.parse(u) for u in unshard),
        metric=metric,  # type: ignore[arg-type]
        rtol=rtol,
        atol=atol,
        progress=False,
    )
    return build_report(options)
