"""What a report says of how it was made: its ``settings`` block and the bridge in use.

Both ways of building a report, pass by pass (:mod:`~tracedump.compare.pipeline`) and by sequence
(:mod:`~tracedump.compare.pair.align`,
``--align tokens``), write the same header; it lives here so that neither imports the other.
"""

from __future__ import annotations

from typing import Any

from ..judge.tolerance import table_rows
from ..judge.verdict import BASELINE_FACTOR, GROWTH, GROWTH_FACTOR, GROWTH_FLOOR, K_ROUNDING
from ..options import DiffOptions
from ..pair.bridge import Matcher


def report_settings(options: DiffOptions) -> dict[str, Any]:
    """The options as the report states them, with the verdict's constants and the dtype table."""
    if options.rtol is None and options.atol is None:
        tolerance = (
            f"{options.metric} by the noise measured in --baseline"
            if options.baseline is not None
            else f"{options.metric} by the error upstream at the run precision"
        )
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
        "rtol_rules": [str(rule) for rule in options.rtol_rules],
        "atol_rules": [str(rule) for rule in options.atol_rules],
        "baseline": str(options.baseline) if options.baseline is not None else None,
        "align": options.align,
        "bridge": "none" if options.bridge == "none" else getattr(options.bridge, "source", None),
        "verdict": {
            "growth": GROWTH,
            "rounding_k": K_ROUNDING,
            "baseline_factor": BASELINE_FACTOR,
        },
        "growth_factor": GROWTH_FACTOR,
        "growth_floor": GROWTH_FLOOR,
        "defaults": table_rows(),
    }


def bridge_summary(matcher: Matcher) -> dict[str, Any] | None:
    """The bridge in use, for the report: its name, where it came from, why it was chosen."""
    if matcher.bridge is None:
        return None
    return {"name": matcher.bridge.name, "source": matcher.bridge.source, "why": matcher.line}
