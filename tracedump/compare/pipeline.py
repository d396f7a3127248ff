"""The pipeline: load -> bridge -> plan (metadata) -> execute (data) -> judge -> report (text, JSON,
plot, html).

:func:`run` is what ``tracedump diff`` calls and returns the exit code; :func:`build_report` is the
whole comparison without printing, which :func:`tracedump.compare.compare` calls for Python callers.
Two planners make one kind of plan: passes (:func:`.pair.plan.build_plan`) or, with ``--align
tokens``, sequences (:func:`.pair.align.plan_tokens`); from there both go through the same executor
(routing flips), ``--baseline``, :func:`.judge.verdict.judge_all` and :func:`.judge.verdict.conclude`.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from typing import Any

from ..errors import UsageError
from ..store.fsio import write_output
from ..util.console import printable
from .judge.coverage import CoverageCount, enforce, nothing_comparable
from .judge.local import graft_infos, judge_local, refuse_grafted_alignment, with_grafted_inputs
from .judge.verdict import conclude, judge_all
from .load.notes import side_notes, truncated_passes
from .load.sources import Side, open_side
from .measure.execute import Executor
from .measure.shadow import measure_shadow
from .options import DiffOptions
from .pair.align import SequenceWorkspace, TokenFindings, baseline_plan, plan_tokens
from .pair.bridge import ambiguous_modules, matcher_for
from .pair.inputs import inputs_differ_by_pass
from .pair.plan import Plan, Unmatched, Workspace, build_plan, short_list
from .pair.rank_joins import contradiction_notes
from .report.display import print_report, progress_bar
from .report.plot import check_available, write_plot
from .report.settings import bridge_summary, report_settings
from .results import DiffReport, TensorResult


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
    """Load both sides, plan, execute, judge: the whole comparison, without printing anything.

    The bridge is chosen first (``--bridge``, else by the two manifests): when the user gave no
    ``--align``, the bridge's own alignment applies (tokens for vLLM against HF), or tokens when
    a side comes from an engine integration (:func:`.pair.bridge.matcher_for`)."""
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
    tokens: TokenFindings | None = None
    if options.align == "tokens":
        refuse_grafted_alignment(options)
        plan, workspace, tokens = plan_tokens(options, side_a, side_b, matcher)
        settings = report_settings(options)
        coverage = tokens.coverage
    else:
        plan, workspace = build_plan(side_a, side_b, options, matcher)
        plan = _cut_short_leftovers(plan, side_a, side_b)
        if not plan.pairs:
            workspace.close()
            raise UsageError(f"nothing to compare: {_why_nothing(plan, options)}")
        settings = report_settings(options)
        if options.unshard:
            settings["unshard_applied"] = any(
                len(g.runs) > 1 for side in (side_a, side_b) for g in side.groups
            )
        coverage = _plan_coverage(plan, workspace, options)
    settings["notes"] = (
        side_notes(side_a) + side_notes(side_b) + contradiction_notes(plan.pairs, options, matcher.unshard)
    )
    report = DiffReport(a=side_a.describe(), b=side_b.describe(), settings=settings, plan=plan)
    report.bridge = bridge_summary(matcher)
    report.ambiguous = ambiguous_modules(matcher)
    if tokens is None:
        report.inputs_differ = inputs_differ_by_pass(side_a, side_b, plan)
    else:
        report.inputs_differ, report.output_changed = tokens.inputs_differ, tokens.output_changed
    with progress_bar(plan, options.progress) as advance:
        executor = Executor(plan, workspace, advance)
        measured = executor.run()
    report.flips = executor.flips
    noise = None
    if options.baseline is not None:
        if isinstance(workspace, SequenceWorkspace):
            noise = _baseline_noise_by_sequence(options, plan, workspace, measured, report)
        else:
            noise = _baseline_noise(options, side_b, measured, report)
    report.results = judge_all(measured, noise)
    if tokens is None:
        report.results = judge_local(  # a grafted A: each module's own error, split by its fp32 shadow
            report, side_a, side_b, lambda: measure_shadow(side_a, side_b, options, matcher)
        )
    report.unused_rules = [
        str(rule)
        for rule in (*options.rtol_rules, *options.atol_rules)
        if not any(rule.matches(r.name, r.name_b) for r in report.results)
    ]
    report.coverage = coverage.finish(report.results)
    findings = conclude(report, tokens.steps_of(plan) if tokens is not None else None)
    if tokens is not None:
        tokens.finish(report, findings)
    return _covered(report, options)


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


def _covered(report: DiffReport, options: DiffOptions) -> DiffReport:
    """Coverage enforced: nothing compared is exit 2; ``--min-coverage`` (compare/judge/coverage.py)."""
    nothing_comparable(report)
    enforce(report, options.min_coverage)
    return report


def _baseline_noise(
    options: DiffOptions, side_b: Side, measured: list[TensorResult], report: DiffReport
) -> dict[int, float] | None:
    """``err(C, B)`` for each measured tensor pair of A and B, keyed by B's pass and name: the
    baseline C is a rerun of the reference, so it pairs with B by B's names; names of C that are
    not B's go through ``--map``, like A's."""
    assert options.baseline is not None
    tensor_pairs = [r for r in measured if r.metrics is not None and r.kind == "tensor"]
    if not tensor_pairs:
        report.notes.append("--baseline applies to tensor pairs; stats pairs keep their fixed rule")
        return None
    plain = replace(options, a=options.baseline, maps=(), filter=None, bridge="none")  # C reruns B: same tree
    side_c = open_side("baseline", options.baseline, plain)
    found = _noise_by_key(side_c, side_b, plain)
    if options.maps:  # C's names that are not B's: as A's, through --map
        mapped = replace(plain, maps=options.maps)
        for key, value in _noise_by_key(side_c, side_b, mapped).items():
            found.setdefault(key, value)
    noise: dict[int, float] = {}
    for result in tensor_pairs:
        pass_b = result.pass_b if result.pass_b is not None else result.pass_index
        value = found.get((pass_b, result.root, result.name_b), found.get((pass_b, None, result.name_b)))
        if value is not None:
            noise[result.index] = value[1] if result.tolerance.metric == "cosine" else value[0]
    if not noise:
        raise UsageError(
            f"--baseline {options.baseline}: no tensor of it lines up with B "
            "(is it a rerun of the reference? same passes, B's names or names --map turns into B's)"
        )
    missing = len(tensor_pairs) - len(noise)
    if missing:
        report.notes.append(
            f"--baseline: {missing} of {len(tensor_pairs)} tensor pairs have no counterpart in "
            f"{options.baseline}: judged by the error upstream instead"
        )
    return noise


def _baseline_noise_by_sequence(
    options: DiffOptions,
    plan: Plan,
    workspace: SequenceWorkspace,
    measured: list[TensorResult],
    report: DiffReport,
) -> dict[int, float]:
    """``--baseline C`` under ``--align tokens``: ``err(C, B)`` of each measured pair, on the rows
    of the same positions of the sequence C's run pairs with B's (:func:`.pair.align.baseline_plan`),
    measured by the same executor as A against B (a near-tie flip of C's routers included)."""
    assert options.baseline is not None
    side_c = open_side("baseline", options.baseline, options)
    plan_c, workspace_c, origin = baseline_plan(plan, workspace, side_c)
    try:
        results_c = Executor(plan_c, workspace_c, per_token=False).run()
    finally:
        workspace_c.close()
    with_metrics = {r.index for r in measured if r.metrics is not None}
    noise: dict[int, float] = {}
    for index, result in zip(origin, results_c, strict=True):
        if result.metrics is None or index not in with_metrics:
            continue
        rel_diff, one_minus_cosine = _noise_of(result)
        noise[index] = one_minus_cosine if measured[index].tolerance.metric == "cosine" else rel_diff
    if with_metrics and not noise:
        raise UsageError(
            f"--baseline {options.baseline}: no tensor of it lines up with B by sequence "
            "(is it a rerun of the reference? the same prompts, B's names)"
        )
    if len(noise) < len(with_metrics):
        report.notes.append(
            f"--baseline: {len(with_metrics) - len(noise)} of {len(with_metrics)} tensor pairs have no "
            f"counterpart in {options.baseline}: judged by the error upstream instead"
        )
    return noise


def _noise_by_key(
    side_c: Side, side_b: Side, options: DiffOptions
) -> dict[tuple[int, str | None, str], tuple[float, float]]:
    """(rel_diff, 1 - cosine) of C against B, by (B's pass, root, B's name)."""
    plan, workspace = build_plan(side_c, side_b, options)
    return {
        (r.pass_b if r.pass_b is not None else r.pass_index, r.root, r.name_b): _noise_of(r)
        for r in Executor(plan, workspace, per_token=False).run()
        if r.metrics is not None
    }


def _noise_of(result: TensorResult) -> tuple[float, float]:
    """(rel_diff, 1 - cosine) of C against B; on the tokens C's routers routed alike where C flipped
    at a near-tie (as A's error is measured where A flipped: the same tie flips the same tokens)."""
    assert result.metrics is not None
    if result.status == "routing_flip" and result.error is not None and result.absorbed is not None:
        return result.error, result.error
    return result.metrics.rel_diff, result.metrics.one_minus_cosine


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
