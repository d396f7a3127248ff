"""``--plot PATH.png``: the error of every tensor along execution order, on a log scale.

matplotlib is an optional extra (``pip install 'tracedump[plot]'``). It is driven through its
object API with the Agg canvas, never ``pyplot``, so plotting changes no global backend state of
the caller's process.
"""

from __future__ import annotations

import importlib.util
import io
import math
from pathlib import Path

from ...errors import UsageError
from ...store.fsio import write_output
from ...util.console import printable
from ..judge.status import Status
from ..results import DiffReport

MISSING_MATPLOTLIB = "--plot needs matplotlib, which is not installed: pip install 'tracedump[plot]'"
_COLOURS = {Status.OK: "tab:blue", Status.DIVERGED: "tab:red", Status.RANK_MISMATCH: "tab:purple"}


def check_available(path: Path | None = None) -> None:
    """Fail before the diff runs (exit 2), rather than after an hour of reading: matplotlib is
    missing, or ``path`` names a format it cannot write (``x.txt``)."""
    try:
        if importlib.util.find_spec("matplotlib") is None:
            raise ImportError("matplotlib")
        import matplotlib  # noqa: F401  (a broken install fails here, not after the diff)
    except ImportError as e:
        raise UsageError(MISSING_MATPLOTLIB) from e
    if path is not None:
        from matplotlib.backend_bases import FigureCanvasBase

        formats = FigureCanvasBase.get_supported_filetypes()
        suffix = Path(path).suffix.lstrip(".").lower()
        if suffix not in formats:
            raise UsageError(
                f"--plot {path}: cannot write a {suffix or 'suffix-less'!r} file; "
                f"use one of {', '.join('.' + f for f in sorted(formats))}"
            )


def write_plot(report: DiffReport, path: Path) -> Path:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:  # pragma: no cover - check_available() ran first
        raise UsageError(MISSING_MATPLOTLIB) from e
    points = [r for r in report.results if r.error is not None and math.isfinite(r.error)]
    # Exact zeros are drawn a decade below every error *and tolerance* shown: below the smallest
    # error alone they could sit above the tolerance line, and read as failures.
    positive = [v for r in points for v in (r.error, r.threshold) if v and v > 0]
    floor = min(positive) / 10 if positive else 1e-16
    token_rows = [r for r in report.results if r.per_token]
    figure = Figure(figsize=(12, 10 if token_rows else 5), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot(2 if token_rows else 1, 1, 1)
    axes.set_yscale("log")
    xs = [r.index for r in points]
    ys = [max(r.error or 0.0, floor) for r in points]
    axes.plot(xs, ys, color="0.6", linewidth=0.8, zorder=1)
    for status, colour in _COLOURS.items():
        chosen = [(x, y) for x, y, r in zip(xs, ys, points, strict=True) if r.status == status]
        if chosen:
            axes.scatter(*zip(*chosen, strict=True), s=12, color=colour, label=status, zorder=2)
    thresholds = [(r.index, r.threshold) for r in points if r.threshold]
    if thresholds:
        axes.step(
            *zip(*thresholds, strict=True),
            where="mid",
            color="tab:green",
            linestyle="--",
            linewidth=0.8,
            label="tolerance",
        )
    _mark_passes(axes, report)
    _mark_findings(axes, report)
    metric = report.settings.get("metric", "rel_diff")
    axes.set_xlabel("tensor, in execution order")
    axes.set_ylabel("1 - cosine" if metric == "cosine" else metric)
    # the labels are escaped as on the terminal: matplotlib warns about a control character's glyph,
    # and its warning quotes the character raw
    axes.set_title(printable(f"tracedump diff: {report.a['path']} vs {report.b['path']}"), fontsize=9)
    axes.legend(loc="upper left", fontsize=8)
    if token_rows:
        _token_heatmap(figure.add_subplot(2, 1, 2), token_rows, floor)
    figure.tight_layout()
    image = io.BytesIO()  # drawn whole first: a failure mid-way leaves no half image under the name
    figure.savefig(image, format=Path(path).suffix.lstrip(".").lower())
    write_output(path, image.getvalue(), keep_mode=True)
    return Path(path)


def _mark_passes(axes: object, report: DiffReport) -> None:
    previous = None
    for result in report.results:
        if previous is not None and result.pass_index != previous:
            axes.axvline(result.index - 0.5, color="0.85", linewidth=0.8, zorder=0)  # type: ignore[attr-defined]
        previous = result.pass_index


def _mark_findings(axes: object, report: DiffReport) -> None:
    first = report.first_divergence
    if first is not None:
        why = f": {first.reason.text}" if first.reason is not None else ""  # the judge's words
        label = printable(f"first divergence: {first.label}{why}")
        axes.axvline(first.index, color="tab:red", linewidth=1.2, label=label)  # type: ignore[attr-defined]
    growth = report.largest_growth
    if growth is not None and (first is None or growth.result.index != first.index):
        axes.axvline(
            growth.result.index,
            color="tab:orange",
            linewidth=1.0,
            linestyle=":",  # type: ignore[attr-defined]
            label=printable(f"largest growth: {growth.result.label}"),
        )


def _token_heatmap(axes: object, rows: list, floor: float) -> None:
    """Tensor x token position, log colour: position bugs (rotary, masks, KV cache) show as columns."""
    import numpy as np
    from matplotlib.colors import LogNorm

    width = max(len(r.per_token) for r in rows)
    grid = np.full((len(rows), width), np.nan)
    for i, result in enumerate(rows):
        grid[i, : len(result.per_token)] = result.per_token
    positive = grid[grid > 0]
    low = float(positive.min()) if positive.size else floor
    high = float(positive.max()) if positive.size else floor * 10
    image = axes.imshow(  # type: ignore[attr-defined]
        np.where(grid > 0, grid, low), aspect="auto", interpolation="nearest", cmap="viridis",
        norm=LogNorm(vmin=low, vmax=max(high, low * 10)),
    )  # fmt: skip
    axes.set_xlabel("token position")  # type: ignore[attr-defined]
    axes.set_ylabel("tensor (execution order)")  # type: ignore[attr-defined]
    axes.set_title("rel_diff per token (exact zeros at the lowest colour)", fontsize=9)  # type: ignore[attr-defined]
    axes.figure.colorbar(image, ax=axes)  # type: ignore[attr-defined]
