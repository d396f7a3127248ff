"""The comparator behind ``tracedump diff``: load two dumps, pair their tensors, measure, judge, and
name the first divergence.

Stages, one sub-package each, in the order a diff runs them (:mod:`.pipeline` drives them):

- :mod:`.command` (the ``diff`` flags) -> :mod:`.options` (parsed and checked once, before any
  file is read);
- :mod:`.load`: open each side (dump, run dir, pass file, ranks), map its bytes, read its notes;
- :mod:`.pair`: which tensors of the two runs are one computation, from the evidence in the dumps,
  and the frozen plan (passes, or sequences with ``--align tokens``);
- :mod:`.measure`: one planned pair at a time, read and measured;
- :mod:`.judge`: each pair's status, then the first divergence, the growth and the exit code;
- :mod:`.report`: the table, ``--json``, ``--plot`` and ``--html``, from the typed records of
  :mod:`.results`.

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
