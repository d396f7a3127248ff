"""The comparator behind ``tracedump diff``: load two dumps, align, unshard, measure, name the first
divergence.

Stages, one module each: :mod:`.sources` (load) -> :mod:`.plan` (metadata only, frozen) ->
:mod:`.execute` (reads one tensor pair at a time; :mod:`.metrics`, :mod:`.stats`, :mod:`.unshard`)
-> :mod:`.results` (typed records, JSON) -> :mod:`.display` / :mod:`.plot`. :func:`compare` runs the
pipeline from Python; nothing heavy is imported until it is called.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .results import DiffReport


def compare(a: str | Path, b: str | Path, **options: Any) -> DiffReport:
    """Compare dump ``a`` (the run under test) with ``b`` (the reference); see :func:`.pipeline.compare`."""
    from .pipeline import compare as run_compare

    return run_compare(a, b, **options)


__all__ = ["compare"]
