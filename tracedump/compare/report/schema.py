"""The ``--json`` report as one typed model: it writes the JSON, and the schema comes from it.

:meth:`..results.DiffReport.to_json` gathers the report's records as plain dicts and hands them to
:func:`written`, which validates them through :class:`Report` (unknown keys refused) and dumps the
model: a key the model does not list can never reach a report, and the schema in
docs/report-schema.md (generated from the same model by ``tools/docs_gen.py``; ``make lint`` and
``tests/test_report_schema.py`` fail when it is stale) lists every key a report can hold, the
grafted run's ``local``, ``grafted_at`` and ``not_grafted`` included.

To add a field (a summary count, a tensor record's key): add it to the record's dict in
:mod:`..results` and to its class here, with a description, and regenerate the doc. Optional keys
(written only when they apply) default to ``None`` here and are marked "absent when ..." in their
description; what was not given is not written (``exclude_unset``), so a report keeps exactly the
keys its records hold, in the model's order.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from ..judge.reason import RULES
from ..judge.status import Status

JsonNumber = float | Literal["nan", "inf", "-inf"]
"""A measured number: NaN and infinities are strings, so the file is strict JSON."""


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class StatDeltaRecord(_Record):
    a: JsonNumber
    b: JsonNumber
    rel_err: JsonNumber


class UnshardRecord(_Record):
    a: str | None
    b: str | None


class PerTokenRecord(_Record):
    dim: int | None = Field(description="the dim per_token runs along")
    positions: list[int] | None = Field(
        None, description="--align tokens: each row's sequence position (absent otherwise)"
    )
    rel_diff: list[JsonNumber | None]
    worst: int | None
    worst_rel_diff: JsonNumber | None


class TensorRecord(_Record):
    """One pair (``tensors[]``), in execution order."""

    index: int = Field(description="its position in tensors[]")
    pass_: int = Field(alias="pass", description="A's pass")
    name: str = Field(description="A's name as stored")
    name_b: str = Field(description="B's name")
    kind: Literal["tensor", "stats"]
    shape_a: list[int] | None
    shape_b: list[int] | None
    dtype_a: str | None
    dtype_b: str | None
    max_abs: JsonNumber | None
    mean_abs: JsonNumber | None
    rel_diff: JsonNumber | None
    cosine: JsonNumber | None
    sqnr_db: JsonNumber | None
    argmax: list[int] | None = Field(description="where max_abs is, as coordinates in A's shape")
    a_at_argmax: JsonNumber | None
    b_at_argmax: JsonNumber | None
    nan_a: int | None
    nan_b: int | None
    inf_a: int | None
    inf_b: int | None
    metric: str = Field(description="the number judged: rel_diff | cosine | max_abs | exact | stats")
    error: JsonNumber | None = Field(description="that number (1 - cosine for cosine)")
    tolerance: JsonNumber | None = Field(description="the threshold the error had to stay under")
    rtol: float | None
    atol: float | None
    tolerance_source: str
    status: Status
    root: str | None = Field(None, description="absent unless several roots are compared")
    sequence: str | None = Field(
        None,
        description="--align tokens: the sequence pair compared ('seq 0', or 'seq 0 (B: 3)' when B "
        "names it otherwise); absent under step alignment",
    )
    stats: dict[str, StatDeltaRecord] | None = Field(None, description="stats pairs only")
    unshard: UnshardRecord | None = Field(None, description="absent unless a side was joined")
    bridge: str | None = Field(None, description="how the bridge paired it; absent: by name")
    paired_by: Literal["load", "name", "weights", "structure", "rule", "map"] | None = Field(
        None,
        description="the evidence that paired it (docs/comparator.md, 'How two runs are paired'); "
        "absent for an op pair (OPS)",
    )
    pairing: str | None = Field(
        None, description="what the pairing saw beside the pair: two classes, what the weights say"
    )
    message: str | None = Field(None, description="absent when there is nothing to say")
    basis: str | None = Field(description="how the threshold was set: upstream | baseline | fixed | routing")
    level_before: str | None = Field(None, description="absent unless judged by the level before it")
    noise: JsonNumber | None = Field(None, description="--baseline: err(C, B); absent otherwise")
    x_noise: JsonNumber | None = Field(None, description="--baseline: the error over the noise")
    after_flip: AfterFlipRecord | None = Field(
        None, description="absent unless downstream of a near-tie flip"
    )
    per_token: PerTokenRecord | None = Field(None, description="absent for a tensor with no token dim")
    local: bool | None = Field(
        None,
        description="a grafted A (GRAFT_FROM): judged by its own module's error (true) or as in an "
        "ungrafted diff (false); absent unless A was grafted",
    )
    grafted_at: str | None = Field(
        None, description="a grafted A: the grafted module it is or lies inside; absent otherwise"
    )
    not_grafted: str | None = Field(
        None, description="a grafted A: why its call kept its own inputs; absent when it was grafted"
    )
    reason: ReasonRecord | None = Field(
        None,
        description="why it has its status, in the judge's words (what the terminal, the page and "
        "the plot print); absent for an ok pair",
    )


class ReasonRecord(_Record):
    """``reason``: why a pair has its status, as the judge words it (the numbers are the record's)."""

    rule: str = Field(description="the rule that decided: " + " | ".join(RULES))
    decided_by: str = Field(description="that rule in words")
    text: str = Field(
        description="the verdict in a sentence: the number judged against its threshold where it "
        "passed it, else the status in words"
    )
    threshold_from: str | None = Field(
        None, description="where the threshold came from; absent unless the number passed it"
    )


class AfterFlipRecord(_Record):
    """``after_flip``: a tensor downstream of a near-tie routing flip (docs/comparator.md)."""

    router: str = Field(description="the router whose near-tie flip it follows")
    unaffected_tokens: int | None = Field(description="tokens provably untouched by the flip")
    unaffected_rel_diff: JsonNumber | None = Field(description="the error on those tokens")
    why: str = Field(description="why the rest is not judged")


class CoverageRecord(_Record):
    """``summary.coverage``: how much of the reference (B) was compared, per step."""

    compared: int = Field(description="reference tensors a measured pair read")
    reference: int = Field(description="distinct names B recorded in the compared steps")
    fraction: float
    low: bool = Field(description="less than half of the reference was compared")


class FindingRecord(_Record):
    """The first divergence (``summary.first_divergence``), a pair named by the summary."""

    index: int
    pass_: int = Field(alias="pass")
    name: str
    name_b: str
    status: Status
    metric: str
    error: JsonNumber | None
    tolerance: JsonNumber | None
    root: str | None = None
    sequence: str | None = Field(None, description="--align tokens: the sequence pair")
    message: str | None = None


class GrowthRecord(FindingRecord):
    """``summary.largest_growth``: the pair, and how far its error jumped."""

    previous_max: JsonNumber
    ratio: JsonNumber


class UnmatchedRecord(_Record):
    """A tensor without a counterpart (``only_in_a[]``, ``only_in_b[]``)."""

    pass_: int = Field(alias="pass")
    name: str
    root: str | None = None
    sequence: str | None = Field(None, description="--align tokens: the sequence pair it was looked for in")
    mapped: str | None = Field(None, description="the name --map or the bridge made of it")
    reason: str | None = Field(None, description="absent: no tensor of that name on the other side")


class ReachLayerRecord(_Record):
    """One layer's reach: the largest relative error one of its allowances let pass."""

    layer: str = Field(description="the name up to its first index (model.layers.1), or 'outside the layers'")
    relative: JsonNumber = Field(description="RMS relative error a bug there may reach unseen")
    tensor: str = Field(description="the tensor whose allowance it is")
    basis: str = Field(description="how that allowance was set: upstream, baseline, fixed")


class ReachRecord(_Record):
    """What a clean verdict could see: per layer, the smallest relative error it would have flagged."""

    layers: list[ReachLayerRecord]
    worst: JsonNumber = Field(description="the largest of the layers' figures")
    warn: float = Field(description="above this, a layer's reach is short and a rerun is suggested")
    rerun: str | None = Field(description="the rerun that would see more, where a layer's reach is short")


class Summary(_Record):
    """``summary``: the counts and the verdict. Helpers that add a count add it here."""

    coverage: CoverageRecord | None = Field(description="null when no step was compared")
    compared: int = Field(description="pairs whose values or statistics were compared")
    judged: int = Field(description="pairs the verdict judged: compared, less not judged")
    not_judged: dict[str, int] = Field(description="pairs measured but not judged, counted by reason")
    not_compared: int = Field(description="pairs whose values were not compared")
    ok: int
    diverged: int
    shape_mismatch: int
    rank_mismatch: int
    errors: int
    routing_flips: list[dict[str, Any]]
    not_compared_routing: int
    not_aligned: int
    not_comparable: int
    bridged: int
    bridge: dict[str, Any] | None
    paired_by: dict[str, int] = Field(description="pairs counted by what proves them")
    ambiguous: list[dict[str, Any]] = Field(description="modules no evidence paired: side, candidates")
    inputs_differ: list[dict[str, Any]]
    output_changed: list[dict[str, Any]] = Field(
        description="--align tokens: sequences whose generated tokens differ, after the first divergence"
    )
    leftovers: dict[str, dict[str, int]]
    notes: list[str]
    unused_rules: list[str]
    alignment: list[dict[str, Any]] | None = Field(None, description="--align tokens only")
    dtype_mismatch: int
    only_in_a: int
    only_in_b: int
    passes: list[int]
    passes_only_in_a: list[int]
    passes_only_in_b: list[int]
    roots_only_in_a: list[str]
    roots_only_in_b: list[str]
    first_divergence: FindingRecord | None
    look_inside: str | None = Field(
        description="OPS: the suggested rerun when the first divergence is a module's tensor, else null"
    )
    extra_ops: int = Field(description="OPS: ops one run only ran (status extra_op)")
    largest_growth: GrowthRecord | None
    exit_code: Literal[0, 1, 2]
    verdict: str = Field(description="what the exit code says, about the judged tensors only")
    reach: ReachRecord | None = Field(
        None, description="what the verdict could see (null when no tensor was judged by an allowance)"
    )


class SideRoot(_Record):
    runs: list[str]
    ranks: list[int]
    mode: str
    manifest: dict[str, Any] = Field(description="the run's manifest less its module and pass lists")


class SideRecord(_Record):
    path: str
    roots: dict[str, SideRoot]


class Report(_Record):
    """The ``--json`` document."""

    a: str = Field(description="A's path")
    b: str = Field(description="B's path")
    sides: dict[Literal["a", "b"], SideRecord]
    settings: dict[str, Any] = Field(description="the options as the report states them")
    summary: Summary
    tensors: list[TensorRecord]
    only_in_a: list[UnmatchedRecord]
    only_in_b: list[UnmatchedRecord]


_REPORT = TypeAdapter(Report)


def written(doc: dict[str, Any]) -> dict[str, Any]:
    """The ``--json`` document of a report's records (``doc``, plain dicts): validated through
    :class:`Report` (a key it does not list, a value of the wrong type: a ValueError, a bug of the
    writer) and dumped from it, the keys ``doc`` holds only, in the model's order."""
    model = _REPORT.validate_python(doc)
    return _REPORT.dump_python(model, mode="json", by_alias=True, exclude_unset=True)


def schema() -> dict[str, Any]:
    """The JSON schema of the ``--json`` report (by alias: ``pass``, not ``pass_``)."""
    return Report.model_json_schema(by_alias=True)


def schema_markdown() -> str:
    """docs/report-schema.md: a few lines on the model, then the schema."""
    statuses = ", ".join(f"`{s.value}` ({s.text})" for s in Status)
    return (
        "# The `--json` report's schema\n\n"
        "Generated from `tracedump/compare/report/schema.py`, the model that writes every `--json`\n"
        "report, by `python tools/docs_gen.py`; do not edit by hand (`make lint` and\n"
        "`tests/test_report_schema.py` fail when it is out of date). What each field means:\n"
        "[comparator.md](comparator.md#json-report---json). NaN and infinities are the strings\n"
        '`"nan"`, `"inf"`, `"-inf"`: the file is strict JSON.\n\n'
        "Statuses of a pair (`Status`, `tracedump/compare/judge/status.py`, shared by the table, the JSON\n"
        f"and the page): {statuses}.\n\n"
        "```json\n" + json.dumps(schema(), indent=1, sort_keys=True) + "\n```\n"
    )
