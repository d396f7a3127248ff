"""Format stage: the ``rich`` table, the summary lines, the progress bar. Nothing here decides."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ...store.dtypes import SHORT_NAMES
from ...util.console import console, printable
from ..judge.coverage import line as coverage_line
from ..judge.coverage import warnings as coverage_warnings
from ..judge.reason import number
from ..judge.status import Status
from ..measure.execute import Progress, pair_bytes
from ..measure.metrics import WORK_DTYPE_RULE
from ..pair.inputs import describe as describe_inputs
from ..pair.inputs import describe_output_change
from ..pair.plan import Plan, Unmatched
from ..results import DiffReport, Growth, TensorResult

STATUS_TEXT = {status.value: status.text for status in Status}  # the table's and the page's words
_STATUS_STYLE = {  # ok rows keep the table's style
    Status.DIVERGED: "red",
    Status.SHAPE_MISMATCH: "yellow",
    Status.RANK_MISMATCH: "magenta",
    Status.ERROR: "yellow",
    Status.ROUTING_FLIP: "cyan",
    Status.ROUTING: "dim",
    Status.NOT_ALIGNED: "dim",
    Status.NOT_COMPARABLE: "dim",
    Status.EXTRA_OP: "red",
}
_LISTED = 10  # names shown per "only in" line


_num = number  # the table's numbers as the reason words them


def _cosine(result: TensorResult) -> str:
    m = result.metrics
    if m is None:
        return "-"
    if m.one_minus_cosine == 0:
        return "1"
    if m.one_minus_cosine < 1e-4:
        return f"1-{m.one_minus_cosine:.1e}"
    return f"{m.cosine:.5f}"


def _times_noise(result: TensorResult) -> str:
    ratio = result.times_noise
    return "-" if ratio is None else f"{ratio:.3g}x"


def _worst_token(result: TensorResult) -> str:
    worst = result.worst_token
    if worst is None:
        return "-"
    return f"{worst[0]}: {_num(worst[1])}" if worst[1] > 0 else "0"


def _shape(result: TensorResult) -> str:
    a = list(result.shape_a) if result.shape_a is not None else "?"
    if result.status is Status.SHAPE_MISMATCH:
        b = list(result.shape_b) if result.shape_b is not None else "?"
        return f"{a} vs {b}"
    return str(a)


def _dtype(result: TensorResult) -> str:
    return dtype_text(result.dtype_a, result.dtype_b)


def dtype_text(dtype_a: str | None, dtype_b: str | None) -> str:
    """A pair's dtypes as the table and the report page print them: ``bf16``, or ``bf16 vs fp32``."""
    a = SHORT_NAMES.get(dtype_a or "?", dtype_a or "?")
    b = SHORT_NAMES.get(dtype_b or "?", dtype_b or "?")
    return a if a == b else f"{a} vs {b}"


def _status(result: TensorResult, first: TensorResult | None, growth: Growth | None) -> str:
    text = STATUS_TEXT.get(result.status, result.status)
    if result.kind == "stats" and result.error is not None:
        text += f" (stats {_num(result.error)})"
    if first is not None and result.index == first.index:
        text += " <- first divergence"
    if growth is not None and result.index == growth.result.index:
        text += f" <- error x{growth.ratio:.3g}"
    return text


def _rows_to_show(report: DiffReport, max_rows: int) -> list[int]:
    """Every row when they fit. Else, in this order until ``max_rows``: the first divergence and its
    neighbours, the growth row, the other rows that are not ok, then the largest errors."""
    results = report.results
    if max_rows <= 0 or len(results) <= max_rows:
        return list(range(len(results)))
    wanted: list[int] = []
    first, growth = report.first_divergence, report.largest_growth
    if first is not None:
        wanted.extend(range(max(first.index - 2, 0), min(first.index + 2, len(results))))
    if growth is not None:
        wanted.append(growth.result.index)
    wanted.extend(r.index for r in results if r.status is not Status.OK)
    by_error = sorted((r for r in results if r.error is not None), key=lambda r: -(r.error or 0.0))
    wanted.extend(r.index for r in by_error)
    return sorted(list(dict.fromkeys(wanted))[:max_rows])


def table(report: DiffReport, max_rows: int) -> Any:
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    show_pass = len(report.plan.units) > 1
    title = escape(printable(f"tracedump diff  A={report.a['path']}  B={report.b['path']}"))
    grid = Table(title=title, title_justify="left")
    if show_pass:
        grid.add_column("pass", justify="right", no_wrap=True)
    # In a narrow terminal the name and the verdict fold; the numbers stay whole.
    longest = max((len(r.label) for r in report.results), default=4)
    grid.add_column("name", overflow="fold", min_width=min(longest, 28))
    with_noise = report.settings.get("baseline") is not None
    with_tokens = any(r.per_token for r in report.results)
    with_bridge = any(r.bridge for r in report.results)
    with_paired = any(r.paired_by not in (None, "name") for r in report.results)
    columns = ["shape", "dtype", "max_abs", "rel_diff", "cosine"]
    columns += ["x noise"] if with_noise else []
    columns += ["worst token"] if with_tokens else []
    columns += ["paired"] if with_paired else []
    columns += ["bridged"] if with_bridge else []
    for column in (*columns, "status"):
        numeric = column in ("max_abs", "rel_diff", "cosine", "x noise")
        grid.add_column(column, justify="right" if numeric else "left", no_wrap=column != "status")
    first, growth = report.first_divergence, report.largest_growth
    previous = -1
    for index in _rows_to_show(report, max_rows):
        if index != previous + 1:
            grid.add_row(*([""] if show_pass else []), f"... {index - previous - 1} hidden", style="dim")
        previous = index
        result = report.results[index]
        is_first = first is not None and result.index == first.index
        m = result.metrics
        cells = [
            result.label,
            _shape(result),
            _dtype(result),
            _num(m.max_abs) if m else "-",
            _num(m.rel_diff) if m else "-",
            _cosine(result),
            *([_times_noise(result)] if with_noise else []),
            *([_worst_token(result)] if with_tokens else []),
            *([result.paired_by or "-"] if with_paired else []),
            *([result.bridge or "-"] if with_bridge else []),
            _status(result, first, growth),
        ]
        style = "bold red reverse" if is_first else _STATUS_STYLE.get(result.status)
        # Text, not str: rich would read `model[last_hidden_state]` as markup and drop the brackets.
        # printable: a name from a file must not send a control character to the terminal.
        cells = [Text(printable(cell)) for cell in cells]
        grid.add_row(*([str(result.pass_index)] if show_pass else []), *cells, style=style)
    hidden = len(report.results) - 1 - previous
    if hidden > 0:
        grid.add_row(*([""] if show_pass else []), f"... {hidden} hidden", style="dim")
    if len(report.results) > max_rows > 0:
        grid.caption = f"{max_rows} of {len(report.results)} rows shown (--max-rows 0 shows all)"
    return grid


def _names(items: tuple[Unmatched, ...]) -> str:
    """Up to ten names, each once (a name missing from every pass or sequence is counted each
    time, listed once)."""
    unique = list(
        dict.fromkeys(
            f"{u.name}" + (f" (as {u.mapped})" if u.mapped and u.mapped != u.name else "") for u in items
        )
    )
    shown = unique[:_LISTED]
    more = f", ... {len(unique) - _LISTED} more" if len(unique) > _LISTED else ""
    return ", ".join(shown) + more


def _classes(result: TensorResult) -> str:
    """``A SiluAndMul vs B SiLUActivation``: a not-comparable result's message up to its colon."""
    return (result.message or "").split(":", 1)[0]


def _aligned_where(report: DiffReport) -> str | None:
    """``sequence 0, position 11, step 3, name`` for a diff with --align tokens."""
    first = next((a.get("first") for a in report.alignment or [] if a.get("first")), None)
    if first is None:
        return None
    return f"{first['sequence']}, position {first['position']}, step {first['step']}, {first['name']}"


def _where(result: TensorResult) -> str:
    return f"pass {result.pass_index} {result.label}" + (
        f" (B: {result.name_b})" if result.name_b != result.name else ""
    )


# What each ``paired_by`` means, for the summary's legend (docs/comparator.md, "How two runs are paired").
PAIRED_BY_LEGEND = {
    "load": "the engine's load record",
    "name": "one name on both sides",
    "weights": "the same parameter values",
    "structure": "the place among proven pairs",
    "rule": "a bridge rule",
    "map": "a --map rule",
}


def pairing_lines(report: DiffReport) -> list[str]:
    """How the pairs were made: counted by evidence with the legend (when any pair was made by
    more than a name), the modules no evidence paired, and what the weights say of a pair."""
    counts = report.paired_by_counts()
    lines = []
    if set(counts) - {"name"}:
        lines.append(
            "paired by: "
            + ", ".join(f"{n} {kind}" for kind, n in counts.items())
            + " ("
            + "; ".join(f"{kind}: {PAIRED_BY_LEGEND[kind]}" for kind in counts if kind in PAIRED_BY_LEGEND)
            + ")"
        )
    if report.ambiguous:
        shown = [
            f"{item['side']} {item['module']} (one of {', '.join(item['candidates'])})"
            for item in report.ambiguous[:_LISTED]
        ]
        more = f", ... {len(report.ambiguous) - _LISTED} more" if len(report.ambiguous) > _LISTED else ""
        lines.append(f"ambiguous ({len(report.ambiguous)}), not paired: {'; '.join(shown)}{more}")
    noted = list(
        dict.fromkeys(
            f"{r.name}: {part}"
            for r in report.results
            for part in (r.pairing or "").split("; ")
            if part.startswith(("weights:", "--map"))
        )
    )
    for line in noted[:_LISTED]:
        lines.append(f"pairing: {line}")
    if len(noted) > _LISTED:
        lines.append(f"pairing: ... {len(noted) - _LISTED} more (the JSON's pairing field)")
    return lines


def _share(relative: float) -> str:
    """A relative error as a person reads it: ``12%``, ``0.3%``, ``2e-06``."""
    return f"{relative:.2g}" if relative < 1e-3 else f"{100 * relative:.2g}%"


def reach_lines(report: DiffReport) -> list[str]:
    """What a clean verdict could see: the relative error each layer's allowances would have
    flagged (the worst layer), and where a layer could miss more than a few percent, the layers
    and the rerun that would see more."""
    reach = report.findings.reach if report.findings is not None else None
    if reach is None:
        return []
    worst = reach.worst
    lines = [
        f"reach: a relative error above {_share(worst.relative)} in any tensor would have been flagged "
        f"(the largest allowance: {worst.tensor}, {worst.basis}; per layer in the JSON's summary.reach)"
    ]
    short = sorted(
        (x for x in reach.layers if x.relative > reach.warn),
        key=lambda x: (-x.relative, not x.layer[-1:].isdigit()),  # the layers before "outside"
    )
    if short:
        listed = ", ".join(f"{x.layer} ({_share(x.relative)})" for x in short[:4]) + (
            ", ..." if len(short) > 4 else ""
        )
        lines.append(
            f"reach: a bug smaller than this could have passed unseen in {listed} (above "
            f"{reach.warn:.0%}); to see more: {reach.rerun}"
        )
    return lines


def summary_lines(report: DiffReport) -> list[str]:
    """The verdict in a few plain lines (the last thing printed, also what logs keep)."""
    s = report.summary()
    lines = _lead_lines(report)  # coverage, then the inputs: said before any number
    if report.alignment is not None:
        count = len(report.plan.units)
        where = f"{count} sequence{'s' if count != 1 else ''}"
    else:
        count = len(s["passes"])
        where = f"{count} pass{'es' if count != 1 else ''}"
    lines += [
        f"compared {s['compared']} tensors in {where}: "
        f"{s['diverged']} diverged, {s['shape_mismatch']} shape mismatches, "
        f"{s['rank_mismatch']} rank mismatches, "
        + (f"{s['extra_ops']} extra ops, " if s["extra_ops"] else "")
        + f"{s['errors']} errors; {s['only_in_a']} only in A, {s['only_in_b']} only in B"
    ]
    if report.bridge is not None:
        lines.append(f"{report.bridge['why']}: {s['bridged']} tensors bridged (the table's bridged column)")
    lines.extend(pairing_lines(report))
    first = report.first_divergence
    if report.inputs_differ:
        lines.append("first divergence: none named: the two runs were fed different token ids (above)")
    if first is not None:
        lines.append(
            f"first divergence: {_aligned_where(report) or _where(first)}: {_describe_error(first)}"
            + (f"; {first.message}" if first.message else "")
            + (f"; {first.pairing}" if first.pairing else "")
        )
        if report.look_inside is not None:
            lines.append(f"look inside: rerun both runs with {report.look_inside} (each aten op's output)")
    elif report.exit_code == 0:
        unjudged = sum(s["not_judged"].values())
        lines.append(
            f"no divergence: every judged tensor ({s['judged']}) is within tolerance "
            f"({report.settings['tolerance']})" + (f"; {unjudged} not judged (below)" if unjudged else "")
        )
        lines.extend(reach_lines(report))
    lines.extend(describe_output_change(change) for change in report.output_changed)
    if report.coverage is not None:
        lines.extend(coverage_warnings(report.coverage))
    lines.extend(_not_judged_lines(report))
    if first is not None and first.worst_token is not None and first.worst_token[1] > 0:
        position, value = first.worst_token
        lines.append(
            f"worst token of {first.label}: position {position} "
            f"(rel_diff {_num(value)}, dim {first.token_dim})"
        )
    lines.extend(part for text in report.alignment_lines for part in text.split("\n"))
    lines.extend(f"note: {note}" for note in report.notes)
    unaligned = [r for r in report.results if r.status is Status.NOT_ALIGNED]
    if unaligned:
        lines.append(f"not aligned ({len(unaligned)}): {unaligned[0].label}: {unaligned[0].message}")
    for flip in report.flips:
        lines.append(flip.message())
    for rule in report.unused_rules:
        lines.append(f"warning: {rule} matched no tensor name")
    growth = report.largest_growth
    if growth is not None:
        lines.append(
            f"largest growth: {_where(growth.result)}: {growth.result.metric} {_num(growth.result.error)}, "
            f"{growth.ratio:.3g}x the largest error before it ({_num(growth.previous_max)})"
        )
    for result in report.results:
        if result.status in (Status.SHAPE_MISMATCH, Status.ERROR) and result.message:
            lines.append(f"{STATUS_TEXT[result.status]}: {_where(result)}: {result.message}")
            break
    plan: Plan = report.plan
    not_comparable = [r for r in report.results if r.status is Status.NOT_COMPARABLE]
    if not_comparable:
        lines.append(
            f"not comparable ({len(not_comparable)}): "
            + ", ".join(f"{r.label} ({_classes(r)})" for r in not_comparable[:_LISTED])
            + (f", ... {len(not_comparable) - _LISTED} more" if len(not_comparable) > _LISTED else "")
        )
    for which, unmatched in (("A", plan.only_in_a), ("B", plan.only_in_b)):
        by_reason: dict[str, list[Unmatched]] = {}
        for item in unmatched:
            by_reason.setdefault(item.reason, []).append(item)
        for reason, items in by_reason.items():
            why = f", {reason}" if reason else ""
            lines.append(f"only in {which} ({len(items)}{why}): {_names(tuple(items))}")
    for which, passes_only in (("A", plan.passes_only_in_a), ("B", plan.passes_only_in_b)):
        if passes_only:
            lines.append(f"passes only in {which}: {', '.join(map(str, passes_only))}")
    for which, roots in (("A", plan.roots_only_in_a), ("B", plan.roots_only_in_b)):
        if roots:
            lines.append(f"roots only in {which}: {', '.join(roots)}")
    lines.extend(f"note: {note}" for note in report.settings.get("notes", []))
    if report.settings.get("unshard_applied") is False:
        lines.append("note: --unshard had no effect: neither side has several ranks")
    if s["dtype_mismatch"]:
        lines.append(
            f"dtypes differ on {s['dtype_mismatch']} tensors: both sides widened and compared "
            f"{WORK_DTYPE_RULE}, judged at the runs' precision"
        )
    return lines


def _lead_lines(report: DiffReport) -> list[str]:
    """What every report says first: how much of the reference was compared, then inputs that
    differ (printed before the table)."""
    lines = [coverage_line(report.coverage)] if report.coverage is not None else []
    return lines + [describe_inputs(finding) for finding in report.inputs_differ]


def _not_judged_lines(report: DiffReport) -> list[str]:
    """Tensors measured but not judged, by reason, with their first names."""
    by_reason: dict[str, list[TensorResult]] = {}
    for r in report.results:
        if r.status is Status.NOT_JUDGED:
            reason = r.after_flip.reason() if r.after_flip is not None else (r.message or "not judged")
            by_reason.setdefault(reason, []).append(r)
    return [
        f"not judged ({len(items)}): {reason}: "
        + ", ".join(r.label for r in items[:_LISTED])
        + (f", ... {len(items) - _LISTED} more" if len(items) > _LISTED else "")
        for reason, items in by_reason.items()
    ]


def _describe_error(result: TensorResult) -> str:
    """The judge's reason for a result's status (:class:`..judge.reason.Reason`), with where its
    largest difference lies."""
    numbers = ""
    m = result.metrics
    nonfinite_only = result.reason is not None and result.reason.nonfinite_only
    if m is not None and m.argmax is not None and result.status is Status.DIVERGED and not nonfinite_only:
        numbers = f", max_abs {_num(m.max_abs)} (A {_num(m.a_at_argmax)} vs B {_num(m.b_at_argmax)})"
    if result.reason is None:  # a record the judge never saw
        return STATUS_TEXT.get(result.status, result.status) + numbers
    return result.reason.line(numbers)


def print_report(report: DiffReport, max_rows: int, *, table_too: bool = True, stderr: bool = False) -> None:
    out = console(stderr)
    lines = summary_lines(report)
    first = len(_lead_lines(report))  # coverage and inputs that differ: before any number, the table's too
    for line in lines[:first]:
        out.print(printable(line), soft_wrap=True, markup=False)
    if table_too and report.results:
        out.print(table(report, max_rows))
    for line in lines[first:]:
        out.print(printable(line), soft_wrap=True, markup=False)


@contextmanager
def progress_bar(plan: Plan, enabled: bool | None) -> Iterator[Progress | None]:
    """A transient progress bar on stderr for long diffs in a terminal; never on stdout."""
    total = sum(pair_bytes(p) for p in plan.pairs)
    if enabled is None:
        enabled = sys.stderr.isatty() and (len(plan.pairs) > 200 or total > 256 << 20)
    if not enabled:
        yield None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=console(stderr=True),
        transient=True,
    ) as bar:
        task = bar.add_task(f"diff {len(plan.pairs)} tensors", total=max(total, 1))
        yield lambda nbytes: bar.advance(task, nbytes)
