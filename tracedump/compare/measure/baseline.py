"""``--baseline C``: the reference rerun under the difference the user accepts, measured against B.

Part of the measure stage: ``err(C, B)`` of each measured pair of A and B, by the same executor
(:class:`.execute.Executor`); the judge (:func:`tracedump.compare.judge.judge.judge`) then holds A's
error to ``BASELINE_FACTOR`` x that noise instead of what the error upstream explains.
"""

from __future__ import annotations

from dataclasses import replace

from ...errors import UsageError
from ..load.sources import Side, open_side
from ..options import DiffOptions
from ..pair.align import SequenceWorkspace, baseline_plan
from ..pair.plan import Plan, build_plan
from ..results import DiffReport, Measured
from .execute import Executor


def baseline_noise(
    options: DiffOptions, side_b: Side, measured: list[Measured], report: DiffReport
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


def baseline_noise_by_sequence(
    options: DiffOptions,
    plan: Plan,
    workspace: SequenceWorkspace,
    measured: list[Measured],
    report: DiffReport,
) -> dict[int, float]:
    """``--baseline C`` under ``--align tokens``: ``err(C, B)`` of each measured pair, on the rows
    of the same positions of the sequence C's run pairs with B's
    (:func:`~tracedump.compare.pair.align.baseline_plan`),
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


def _noise_of(result: Measured) -> tuple[float, float]:
    """(rel_diff, 1 - cosine) of C against B; on the tokens C's routers routed alike where C flipped
    at a near-tie (as A's error is measured where A flipped: the same tie flips the same tokens)."""
    assert result.metrics is not None
    kept = result.evidence.kept
    if kept is not None:
        return kept.error, kept.error
    return result.metrics.rel_diff, result.metrics.one_minus_cosine


def noise_of_baseline(
    options: DiffOptions,
    plan: Plan,
    workspace: object,
    side_b: Side,
    measured: list[Measured],
    report: DiffReport,
) -> dict[int, float] | None:
    """``err(C, B)`` of each measured pair, by sequence under ``--align tokens``, else by pass;
    None without ``--baseline``."""
    if options.baseline is None:
        return None
    if isinstance(workspace, SequenceWorkspace):
        return baseline_noise_by_sequence(options, plan, workspace, measured, report)
    return baseline_noise(options, side_b, measured, report)
