"""The comparator behind ``tracedump diff``: load two dumps, pair their tensors, measure, judge, and
name the first divergence.

Stages, one module each, in the order a diff runs them (:mod:`.pipeline` drives them):

- :mod:`.command` (the ``diff`` flags) -> :mod:`.options` (parsed and checked once, before any
  file is read; :mod:`.bridge_rules` loads a ``--bridge`` rule file);
- :mod:`.sources` (open each side: dump, run dir, pass file, ranks; :mod:`.reader` maps the bytes,
  :mod:`.notes` says what a side's manifest warns of);
- :mod:`.bridge` (which tensors of two module trees compare: rules or names) -> :mod:`.plan`
  (metadata only, frozen: pairs, tolerances, leftovers; :mod:`.unshard` joins ranks, :mod:`.tolerance`
  holds the per-dtype ceilings);
- :mod:`.execute` (reads one pair at a time: :mod:`.metrics` with the C kernel, :mod:`.stats`,
  :mod:`.routing` for MoE flips) or, with ``--align tokens``, :mod:`.align` (rows of a sequence
  over steps); :mod:`.inputs` checks the two sides were fed the same tokens;
- :mod:`.verdict` (every verdict: each pair's threshold and status, the first divergence, the
  largest growth, the exit code; :mod:`.containers` says which upstream level explains a
  container's own outputs) and :mod:`.local` (a grafted dump: each module's own error);
- :mod:`.results` (typed records, the ``--json`` schema) with :mod:`.report` (its settings block)
  -> :mod:`.display` (the table), :mod:`.plot`, :mod:`.page`.

:func:`compare` runs the pipeline from Python; nothing heavy is imported until it is called.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .results import DiffReport


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
    rtol: float | str | list[str] | None = None,
    atol: float | str | list[str] | None = None,
    baseline: str | Path | None = None,
    align: str | None = None,
    bridge: str | Path | None = None,
    min_coverage: float | None = None,
) -> DiffReport:
    """Compare dump ``a`` (the run under test) with ``b`` (the reference) from Python: the rules of
    ``tracedump diff``, each keyword the flag of the same name, and the report instead of a table.

    - ``passes``: ``--pass`` ("3", "0,2,5-7"); None compares every pass both dumps hold.
    - ``rank``: ``--rank``, one rank of a multi-rank dump; None joins the ranks.
    - ``filter``: ``--filter``, a regex a tensor's name (A's or B's) must contain.
    - ``maps``: ``--map PATTERN=REPL`` rules, applied to A's names in order.
    - ``unshard``: ``--unshard REGEX=cat:DIM|sum`` rules joining ranks' shards.
    - ``metric``: ``--metric``: rel_diff, cosine or max_abs.
    - ``rtol`` / ``atol``: a number (every pair) or ``'REGEX=VALUE'`` rules, as ``--rtol``/``--atol``;
      None judges by the error upstream (or the baseline's noise).
    - ``baseline``: ``--baseline C``, a rerun of the reference whose noise sets each threshold.
    - ``align``: ``--align passes|tokens``; None lets the bridge choose, as on the command line.
    - ``bridge``: ``--bridge``, a rule file, ``"none"``, or None to choose by the two manifests.
    - ``min_coverage``: ``--min-coverage``, the fraction of B's tensors that must be compared.

    Raises :class:`tracedump.errors.UsageError` where the CLI exits 2."""
    from .options import parse_options
    from .pipeline import build_report

    options = parse_options(
        a,
        b,
        passes=passes,
        rank=rank,
        filter=filter,
        maps=maps,
        unshard=unshard,
        metric=metric,
        rtol=_as_rules(rtol),
        atol=_as_rules(atol),
        baseline=baseline,
        align=align,
        bridge=bridge,
        progress=False,
        min_coverage=min_coverage,
    )
    return build_report(options)


def _as_rules(value: float | str | list[str] | None) -> list[str]:
    """A tolerance as ``--rtol``/``--atol`` take it: a list of the texts the flag was given."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [str(v) for v in value]
    return [repr(value) if isinstance(value, float) else str(value)]


__all__ = ["compare"]
