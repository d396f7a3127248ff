"""The pipeline, as the list of its stages: load -> pair -> measure -> judge -> report.

Each stage is a function taking and returning typed objects:

- :func:`load`: both sides opened, the bridge chosen (:class:`Loaded`);
- :func:`pair`: the frozen plan, by one of two planners: passes
(:func:`~tracedump.compare.pair.plan.build_plan`) or,
  with ``--align tokens``, sequences (:func:`~tracedump.compare.pair.align.plan_tokens`) (:class:`Paired`);
- :func:`measure`: every planned pair read and measured by one executor, a grafted A's fp32 shadow
  and the ``--baseline`` noise included (:class:`Measurements`);
- :func:`judge`: every pair's status from its evidence (:func:`~tracedump.compare.judge.verdict.judge_all`,
calling
  :func:`.judge.judge.judge`), the report's findings and its outcome, coverage included
  (:func:`~tracedump.compare.judge.verdict.conclude`);
- the report: :func:`run` writes the JSON, the plot and the page, and prints the table.

:func:`build_report` is the whole comparison without printing, which
:func:`tracedump.compare.compare` calls for Python callers; :func:`run` is what ``tracedump diff``
calls, and returns the exit code.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, replace
from typing import Any

from ..errors import UsageError
from ..store.fsio import write_output
from ..util.console import printable
from .judge.coverage import CoverageCount
from .judge.local import graft_infos, judge_grafted, refuse_grafted_alignment, with_grafted_inputs
from .judge.verdict import conclude, judge_all
from .load.notes import side_notes, truncated_passes
from .load.sources import Side, open_side
from .measure.baseline import noise_of_baseline
from .measure.execute import Executor
from .measure.routing import Flip
from .options import DiffOptions
from .pair.align import TokenFindings, plan_tokens
from .pair.bridge import Matcher, ambiguous_modules, matcher_for
from .pair.inputs import inputs_differ_by_pass
from .pair.plan import Plan, Unmatched, Workspace, build_plan, short_list
from .pair.rank_joins import contradiction_notes
from .report.display import print_report, progress_bar
from .report.plot import check_available, write_plot
from .report.settings import bridge_summary, report_settings
from .results import DiffReport, Measured


def build_report(options: DiffOptions) -> DiffReport:
    """Load both sides, pair, measure, judge: the whole comparison, without printing anything."""
    loaded = load(options)
    paired = pair(loaded)
    report = begin_report(loaded, paired)
    measured = measure(loaded, paired, report)
    return judge(loaded, paired, measured, report)


@dataclass(frozen=True, kw_only=True)
class Loaded:
    """Stage 1: both sides opened, the bridge chosen, and the options as the bridge settled them."""

    options: DiffOptions
    side_a: Side
    side_b: Side
    matcher: Matcher


@dataclass(frozen=True, kw_only=True)
class Paired:
    """Stage 2: the frozen plan, its open files, the settings and how much of B it covers."""

    plan: Plan
    workspace: Workspace
    settings: dict[str, Any]
    coverage: CoverageCount
    tokens: TokenFindings | None  # --align tokens: the sequences' findings


@dataclass(frozen=True, kw_only=True)
class Measurements:
    """Stage 3: every pair measured (no status yet), the routers that flipped, the baseline noise."""

    results: list[Measured]
    flips: list[Flip]
    noise: dict[int, float] | None


def load(options: DiffOptions) -> Loaded:
    """Open both sides and choose the bridge (``--bridge``, else by the two manifests): when the
    user gave no ``--align``, the bridge's own alignment applies (tokens for vLLM against HF), or
    tokens when a side comes from an engine integration
    (:func:`~tracedump.compare.pair.bridge.matcher_for`)."""
    side_a = open_side("A", options.a, options)
    side_b = open_side("B", options.b, options)
    matcher = with_grafted_inputs(matcher_for(options, side_a, side_b), side_a)
    if matcher.unshard and not options.unshard and options.rank is None:
        # every rank joined as the loads say (--unshard or --rank given by hand override them)
        options = replace(options, unshard=matcher.unshard)
        side_a, side_b = open_side("A", options.a, options), open_side("B", options.b, options)
    if (
        not options.align_given
        and matcher.align
        and matcher.align != options.align
        and not graft_infos(side_a)
    ):
        # a grafted A was fed the reference's inputs pass by pass: compared pass by pass
        options = replace(options, align=matcher.align)  # raises UsageError with --baseline and tokens
    return Loaded(options=options, side_a=side_a, side_b=side_b, matcher=matcher)


def pair(loaded: Loaded) -> Paired:
    """Plan every comparison from metadata alone: a unit per pass, or per sequence pair."""
    options, side_a, side_b = loaded.options, loaded.side_a, loaded.side_b
    if options.align == "tokens":
        refuse_grafted_alignment(options)
        plan, workspace, tokens = plan_tokens(options, side_a, side_b, loaded.matcher)
        settings = report_settings(options)
        return Paired(
            plan=plan, workspace=workspace, settings=settings, coverage=tokens.coverage, tokens=tokens
        )
    plan, workspace = build_plan(side_a, side_b, options, loaded.matcher)
    plan = _cut_short_leftovers(plan, side_a, side_b)
    if not plan.pairs:
        workspace.close()
        raise UsageError(f"nothing to compare: {_why_nothing(plan, options)}")
    settings = report_settings(options)
    if options.unshard:
        settings["unshard_applied"] = any(len(g.runs) > 1 for side in (side_a, side_b) for g in side.groups)
    coverage = _plan_coverage(plan, workspace, options)
    return Paired(plan=plan, workspace=workspace, settings=settings, coverage=coverage, tokens=None)


def begin_report(loaded: Loaded, paired: Paired) -> DiffReport:
    """The report as pairing leaves it: the sides, the settings, the bridge, inputs that differ."""
    side_a, side_b, plan, tokens = loaded.side_a, loaded.side_b, paired.plan, paired.tokens
    settings = paired.settings
    settings["notes"] = (
        side_notes(side_a)
        + side_notes(side_b)
        + contradiction_notes(plan.pairs, loaded.options, loaded.matcher.unshard)
    )
    report = DiffReport(a=side_a.describe(), b=side_b.describe(), settings=settings, plan=plan)
    report.bridge = bridge_summary(loaded.matcher)
    report.ambiguous = ambiguous_modules(loaded.matcher)
    if tokens is None:
        report.inputs_differ = inputs_differ_by_pass(side_a, side_b, plan)
    else:
        report.inputs_differ, report.output_changed = tokens.inputs_differ, tokens.output_changed
    return report


def measure(loaded: Loaded, paired: Paired, report: DiffReport) -> Measurements:
    """Read and measure every planned pair (a grafted A's shadow with it), then the baseline's
    noise; what the baseline cannot line up is said in the report's notes."""
    options, plan, workspace = loaded.options, paired.plan, paired.workspace
    shadow = paired.tokens is None and bool(graft_infos(loaded.side_a))
    with progress_bar(plan, options.progress) as advance:
        executor = Executor(plan, workspace, advance, shadow=shadow)
        results = executor.run()
    noise = noise_of_baseline(options, plan, workspace, loaded.side_b, results, report)
    return Measurements(results=results, flips=executor.flips, noise=noise)


def judge(loaded: Loaded, paired: Paired, measured: Measurements, report: DiffReport) -> DiffReport:
    """Every pair's status from its evidence, then the findings and the outcome (the exit code,
    coverage and ``--min-coverage`` included)."""
    options, tokens = loaded.options, paired.tokens
    report.flips = measured.flips
    if tokens is None:  # a grafted A: each module's own error, split by its fp32 shadow
        report.results = judge_grafted(report, loaded.side_a, loaded.side_b, measured.results, measured.noise)
    else:
        report.results = judge_all(measured.results, measured.noise)
    report.unused_rules = [
        str(rule)
        for rule in (*options.rtol_rules, *options.atol_rules)
        if not any(rule.matches(r.name, r.name_b) for r in report.results)
    ]
    report.coverage = paired.coverage.finish(report.results)
    steps_of = tokens.steps_of(paired.plan) if tokens is not None else None
    findings = conclude(report, steps_of, options.min_coverage)
    if tokens is not None:
        tokens.finish(report, findings)
    return report


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


def _cut_short_leftovers(plan: Plan, side_a: Side, side_b: Side) -> Plan:
    """A pass cut short holds only what its forward captured before it raised: the other side's
    tensors it lacks are listed with that reason, not as plain names missing (its tensors that are
    there are compared; the summary notes the truncation)."""
    cut = {
        which: {i for group in side.groups for run in group.runs for i in truncated_passes(run)}
        for which, side in (("A", side_a), ("B", side_b))
    }
    if not cut["A"] and not cut["B"]:
        return plan
    pass_b = {unit.pass_a: unit.pass_b for unit in plan.units}

    def reason(item: Unmatched, cut_side: str, index: int) -> Unmatched:
        if item.reason or index not in cut[cut_side]:
            return item
        return replace(item, reason=f"{cut_side}'s pass {index} was cut short (its step raised)")

    return replace(
        plan,
        only_in_b=tuple(reason(u, "A", u.pass_index) for u in plan.only_in_b),
        only_in_a=tuple(reason(u, "B", pass_b.get(u.pass_index, u.pass_index)) for u in plan.only_in_a),
    )


def _plan_coverage(plan: Plan, workspace: Workspace, options: DiffOptions) -> CoverageCount:
    """B's tensors in every compared pass, and the ones each planned pair reads (a result's index
    is its pair's)."""
    coverage = CoverageCount()
    for unit, (_, views_b) in zip(plan.units, workspace.views, strict=True):
        names = dict.fromkeys(name for view in views_b for name in view.entries)
        coverage.add_step(unit.root or "", names, options.selected)
    for index, pair in enumerate(plan.pairs):
        coverage.add_pair(index, plan.units[pair.unit].root or "", pair.b)
    return coverage


def write_json(report: DiffReport, target: str, doc: dict[str, Any] | None = None) -> None:
    text = json.dumps(doc if doc is not None else report.to_json(), indent=1, allow_nan=False)
    if target == "-":
        sys.stdout.write(text + "\n")
        return
    write_output(target, text + "\n", keep_mode=True)  # atomic: a crash leaves no truncated JSON


def run(options: DiffOptions) -> int:
    """``tracedump diff``: 0 no divergence, 1 divergence, 2 usage error or unreadable input."""
    if options.plot_path is not None:
        check_available(options.plot_path)
    if options.html_path is not None and options.html_path.is_dir():
        raise UsageError(f"--html {options.html_path}: is a directory; give a file name such as report.html")
    report = build_report(options)
    json_to_stdout = options.json_path == "-"
    # --json and --html write the same document: built once (per-token lists of a big diff take seconds)
    doc = report.to_json() if options.json_path is not None and options.html_path is not None else None
    try:
        if options.json_path is not None:
            write_json(report, options.json_path, doc)
        if options.plot_path is not None:
            write_plot(report, options.plot_path)
        if options.html_path is not None:
            from .report.page import write_html  # only here: a diff without --html never imports it

            write_html(report, options.html_path, doc)
    except OSError as e:
        raise UsageError(f"cannot write the report: {e}") from e
    print_report(report, options.max_rows, table_too=not json_to_stdout, stderr=json_to_stdout)
    if options.html_path is not None:
        shown = printable(f"html report: {options.html_path}")
        print(shown, file=sys.stderr if json_to_stdout else sys.stdout)
    return report.exit_code
