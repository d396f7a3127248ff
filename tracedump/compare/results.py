"""Typed output records of a diff, each with its JSON record (the ``--json`` model that writes them
and its schema: :mod:`tracedump.compare.report.schema`).

Statuses of a tensor pair:

- ``ok``: within tolerance;
- ``diverged``: beyond tolerance, or a NaN/Inf on one side where the other has a number;
- ``shape_mismatch``: shapes differ even after squeezing size-1 dims (not compared);
- ``rank_mismatch``: a multi-rank side disagrees with itself (a replicated tensor differs across
  ranks, or a name is missing on some ranks);
- ``error``: the pair could not be compared (an ``--unshard`` rule that cannot apply, stats with no
  numeric statistic on both sides, a tensor whose data cannot be read);
- ``routing_flip``: a MoE router sent some tokens to other experts at a near-tie of its top-k
  (within the run's noise): reported, not a divergence; tensors of that MoE block are then compared
  on the tokens that kept their experts (:mod:`tracedump.compare.measure.routing`);
- ``routing``: a tensor inside that MoE block that cannot line up once routing differs (the
  per-expert calls): not compared;
- ``not_aligned``: with ``--align tokens``, a tensor whose rows of a sequence cannot be found on
  a side (no dim of the pass's token count, e.g. logits of the last token only): reported, not
  compared;
- ``not_judged``: downstream of a near-tie routing flip, a tensor whose tokens may all have
  received a flipped token's value (through attention in a later layer), with no ``--baseline``
  and no graft to measure what that flip moves: measured, listed with the reason, never judged
  (:attr:`TensorResult.after_flip`; :mod:`tracedump.compare.judge.verdict`);
- ``extra_op``: an op that one run ran and the other did not, inside a module both tapped with
  ``OPS`` (:mod:`tracedump.compare.pair.ops_align`): a divergence of its own, never measured;
- ``not_comparable``: one name, two module classes known to compute different quantities (the
  manifests' ``module_classes``: vLLM's ``SiluAndMul`` against HF's ``SiLUActivation``), and no
  bridge rule relates them: never measured, listed with both class names and the reason
  (:func:`~tracedump.compare.pair.bridge.known_different`). A class difference alone is compared.

Each pair says how it was paired (``paired_by``: ``load``, ``name``, ``weights``, ``structure``,
``rule`` or ``map``; docs/comparator.md, "How two runs are paired").

Every status but ``ok``, ``routing_flip``, ``routing``, ``not_aligned``, ``not_judged`` and ``not_comparable``
makes the exit code 1; so do inputs that differ (:attr:`DiffReport.inputs_differ`). Those rules, the
first divergence and the largest growth are decided in :mod:`tracedump.compare.judge.verdict`
(:func:`~tracedump.compare.judge.verdict.conclude`);
this module holds what they decide, as :class:`Findings`.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ..errors import ExitCode
from ..store.format import json_number
from .judge.reason import Reason
from .judge.status import Status
from .judge.tolerance import Tolerance
from .measure.evidence import MEASURED, Evidence
from .measure.metrics import TensorMetrics
from .measure.stats import StatDelta
from .pair.bridge import PAIRED_BY
from .pair.ops_align import suggest_ops
from .pair.plan import Plan


def _number(value: float | None) -> float | str | None:
    return None if value is None else json_number(float(value))


def strict_json(value: Any) -> Any:
    """``value`` with every NaN and infinity, however deep, as the strings ``"nan"``, ``"inf"``,
    ``"-inf"`` (as :func:`~tracedump.store.format.json_number` writes the measured numbers).

    For what the report copies from files it did not write: a manifest may hold ``NaN`` or
    ``Infinity`` (Python's json reads them), and ``--json`` writes strict JSON, which has neither
    (one such value once lost the whole report to "Out of range float values")."""
    if isinstance(value, float):
        return json_number(value)
    if isinstance(value, dict):
        return {key: strict_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(item) for item in value]
    return value


def unravel(flat: int | None, shape: tuple[int, ...] | None) -> list[int] | None:
    """A flat index as coordinates in ``shape`` (C order), for "where is the largest error"."""
    if flat is None or shape is None:
        return None
    coords = []
    for size in reversed(shape):
        size = max(size, 1)
        coords.append(flat % size)
        flat //= size
    return list(reversed(coords))


@dataclass(frozen=True, kw_only=True)
class AfterFlip:
    """A tensor downstream of a near-tie routing flip, outside the flipped MoE block: which of its
    tokens provably carry none of the flip's consequence (under a causal mask on both runs, the
    positions before the first flipped one of each sequence) and their error; ``error`` None when
    none does (an empty prefix, a mask not known causal, rows that are not the router's tokens)."""

    router: str  # the router(s) that flipped
    tokens: int  # how many of the router's tokens are provably unaffected
    error: float | None  # rel_diff on those tokens
    why: str  # why only those (for the report)

    def reason(self) -> str:
        """The not-judged reason, as the summary counts it."""
        return f"downstream of a near-tie routing flip in {self.router}, judge with `--baseline` or a graft"


@dataclass(frozen=True, kw_only=True)
class Measured:
    """One pair as the measure stage leaves it: what was planned, what was measured, and the
    :class:`.measure.evidence.Evidence` found beside the numbers; no status (the judge gives it)."""

    index: int
    pass_index: int  # A's pass
    root: str | None
    name: str
    name_b: str
    kind: str  # tensor | stats
    shape_a: tuple[int, ...] | None
    shape_b: tuple[int, ...] | None
    dtype_a: str | None
    dtype_b: str | None
    tolerance: Tolerance
    metric: str  # the number judged: rel_diff | cosine (1 - cosine) | max_abs | exact | stats
    metrics: TensorMetrics | None = None
    stats: dict[str, StatDelta] | None = None
    unshard_a: str | None = None
    unshard_b: str | None = None
    token_dim: int | None = None  # the dim per_token runs along
    per_token: tuple[float, ...] | None = None  # rel_diff of each token position
    positions: tuple[int, ...] | None = None  # --align tokens: the sequence position of each row
    pass_b: int | None = None  # B's pass (differs from A's when pass files are given)
    bridge: str | None = None  # how the bridge paired it ("split -1 (rule 4: qkv)"); None: by name
    paired_by: str | None = None  # what proves the pair (bridge.PAIRED_BY); None: an op pair (OPS)
    pairing: str | None = None  # what the pairing saw beside it: two classes, a weights finding
    after_flip: AfterFlip | None = None  # downstream of a near-tie flip, outside its MoE block
    # --align tokens: the sequence pair whose rows were compared (``seq 0``, ``seq 0 (B: 3)``)
    sequence: str | None = None
    evidence: Evidence = field(default=MEASURED, compare=False, repr=False)  # for the judge only

    @property
    def label(self) -> str:
        """The name as shown: ``root:name`` when several roots are compared, ``seq 0:name`` under
        ``--align tokens``."""
        return ":".join(part for part in (self.root, self.sequence, self.name) if part)

    @property
    def scope(self) -> tuple[str | None, str | None]:
        """(root, sequence): the results that share one running error level, pass by pass (under
        ``--align tokens`` each sequence pair is its own)."""
        return self.root, self.sequence

    @property
    def dtype_differs(self) -> bool:
        """Stored dtypes differ (stats records' dtypes may be guesses, so they do not count)."""
        known = self.kind == "tensor" and self.dtype_a is not None and self.dtype_b is not None
        return known and self.dtype_a != self.dtype_b

    @property
    def worst_token(self) -> tuple[int, float] | None:
        """(position, rel_diff) of the token with the largest error, if measured per token (with
        ``--align tokens``, the sequence position; else the index along ``token_dim``)."""
        if not self.per_token:
            return None
        row = max(range(len(self.per_token)), key=lambda i: self.per_token[i])  # type: ignore[index]
        return (self.positions[row] if self.positions else row), self.per_token[row]


@dataclass(frozen=True, kw_only=True)
class TensorResult(Measured):
    """The verdict on one pair (set by :func:`.judge.judge.judge` alone), with every measurement
    behind it."""

    status: Status
    error: float | None = None  # the number judged
    threshold: float | None = None  # what it had to stay under
    message: str | None = None  # why it has its status (the judge's words), when there is more to say
    noise: float | None = None  # err(C, B) of the --baseline run, when one was given
    basis: str | None = None  # how the threshold was set: upstream | baseline | fixed | routing | local
    absorbed: float | None = None  # the whole error of a routing-flip tensor (joins the level)
    level_before: str | None = None  # a container's own output: explained by the level before this tensor
    rule: str | None = None  # which rule of the judge decided (judge.reason.RULES)
    reason: Reason | None = None  # why, in the judge's words: what the report prints

    def to_json(self) -> dict[str, Any]:
        m = self.metrics
        data: dict[str, Any] = {
            "index": self.index,
            "pass": self.pass_index,
            "name": self.name,
            "name_b": self.name_b,
            "kind": self.kind,
            "shape_a": list(self.shape_a) if self.shape_a is not None else None,
            "shape_b": list(self.shape_b) if self.shape_b is not None else None,
            "dtype_a": self.dtype_a,
            "dtype_b": self.dtype_b,
            "max_abs": _number(m.max_abs) if m else None,
            "mean_abs": _number(m.mean_abs) if m else None,
            "rel_diff": _number(m.rel_diff) if m else None,
            "cosine": _number(m.cosine) if m else None,
            "sqnr_db": _number(m.sqnr_db) if m else None,
            "argmax": unravel(m.argmax, self.shape_a) if m else None,
            "a_at_argmax": _number(m.a_at_argmax) if m else None,
            "b_at_argmax": _number(m.b_at_argmax) if m else None,
            "nan_a": m.nan_a if m else None,
            "nan_b": m.nan_b if m else None,
            "inf_a": m.inf_a if m else None,
            "inf_b": m.inf_b if m else None,
            "metric": self.metric,
            "error": _number(self.error),
            "tolerance": _number(self.threshold),
            "rtol": self.tolerance.rtol,
            "atol": self.tolerance.atol,
            "tolerance_source": self.tolerance.source,
            "status": self.status,
        }
        if self.root is not None:
            data["root"] = self.root
        if self.sequence is not None:
            data["sequence"] = self.sequence
        if self.stats is not None:
            data["stats"] = {name: delta.to_json() for name, delta in self.stats.items()}
        if self.unshard_a or self.unshard_b:
            data["unshard"] = {"a": self.unshard_a, "b": self.unshard_b}
        if self.bridge is not None:
            data["bridge"] = self.bridge
        if self.paired_by is not None:
            data["paired_by"] = self.paired_by
        if self.pairing:
            data["pairing"] = self.pairing
        if self.message:
            data["message"] = self.message
        data["basis"] = self.basis
        if self.level_before is not None:
            data["level_before"] = self.level_before
        if self.noise is not None:
            data["noise"] = _number(self.noise)
            data["x_noise"] = _number(self.times_noise)
        if self.after_flip is not None:
            data["after_flip"] = {
                "router": self.after_flip.router,
                "unaffected_tokens": self.after_flip.tokens,
                "unaffected_rel_diff": _number(self.after_flip.error),
                "why": self.after_flip.why,
            }
        if self.per_token is not None:
            worst = self.worst_token
            data["per_token"] = {
                "dim": self.token_dim,
                **({"positions": list(self.positions)} if self.positions is not None else {}),
                "rel_diff": [_number(v) for v in self.per_token],
                "worst": worst[0] if worst else None,
                "worst_rel_diff": _number(worst[1]) if worst else None,
            }
        if self.reason is not None and self.status is not Status.OK:
            data["reason"] = self.reason.to_json()
        return data

    @property
    def times_noise(self) -> float | None:
        """The error as a multiple of the baseline's measured noise (inf over exact-zero noise): a
        reading of the verdict's two numbers, not a third one it judges by."""
        if self.noise is None or self.error is None:
            return None
        if self.noise == 0:
            return 0.0 if self.error == 0 else math.inf
        return self.error / self.noise


@dataclass(frozen=True)
class Growth:
    """Where the error first jumps by more than ``factor`` over the running maximum before it."""

    result: TensorResult
    previous_max: float
    ratio: float

    def to_json(self) -> dict[str, Any]:
        return {
            **_finding(self.result),
            "previous_max": _number(self.previous_max),
            "ratio": _number(self.ratio),
        }


def _finding(result: TensorResult) -> dict[str, Any]:
    data: dict[str, Any] = {
        "index": result.index,
        "pass": result.pass_index,
        "name": result.name,
        "name_b": result.name_b,
        "status": result.status,
        "metric": result.metric,
        "error": _number(result.error),
        "tolerance": _number(result.threshold),
    }
    if result.root is not None:
        data["root"] = result.root
    if result.sequence is not None:
        data["sequence"] = result.sequence
    if result.message:
        data["message"] = result.message
    return data


@dataclass(frozen=True, kw_only=True)
class FirstInTime:
    """``--align tokens``: the diverged row computed earliest
    (:func:`~tracedump.compare.judge.verdict.first_in_time`)."""

    result: TensorResult
    row: int  # the row of ``result``'s gathered rows
    step: int  # A's pass that computed that row

    def to_json(self) -> dict[str, Any]:
        result, row = self.result, self.row
        return {
            "sequence": result.sequence,
            "position": result.positions[row] if result.positions else row,
            "step": self.step,
            "name": result.name,
            "rel_diff": result.per_token[row] if result.per_token else None,
        }


@dataclass(frozen=True, kw_only=True)
class ReachLayer:
    """One layer's reach: the largest relative error one of its allowances let pass."""

    layer: str
    relative: float  # RMS relative error (of the tensor's norm) below which a bug passes unseen
    tensor: str  # the tensor whose allowance it is
    basis: str  # upstream, baseline, fixed

    def to_json(self) -> dict[str, Any]:
        return {
            "layer": self.layer,
            "relative": _number(self.relative),
            "tensor": self.tensor,
            "basis": self.basis,
        }


@dataclass(frozen=True, kw_only=True)
class Reach:
    """What a clean verdict could see (:func:`~tracedump.compare.judge.verdict.reach`)."""

    layers: tuple[ReachLayer, ...]
    warn: float  # above this relative error a layer's reach is said to be short, with a rerun
    rerun: str | None  # the rerun that would see more, where a layer's reach is short

    @property
    def worst(self) -> ReachLayer:
        return max(self.layers, key=lambda x: x.relative)

    def to_json(self) -> dict[str, Any]:
        return {
            "layers": [x.to_json() for x in self.layers],
            "worst": _number(self.worst.relative),
            "warn": self.warn,
            "rerun": self.rerun,
        }


@dataclass(frozen=True, kw_only=True)
class Findings:
    """What :func:`~tracedump.compare.judge.verdict.conclude` decided of a report's judged results."""

    first_divergence: TensorResult | None  # None when the inputs differ: no module is to blame
    largest_growth: Growth | None
    exit_code: ExitCode
    first_in_time: FirstInTime | None = None  # --align tokens: the earliest diverged row
    reach: Reach | None = None  # what a clean verdict could see, per layer


@dataclass(kw_only=True)
class DiffReport:
    """Everything a diff found; :meth:`to_json` is the ``--json`` document."""

    a: dict[str, Any]
    b: dict[str, Any]
    settings: dict[str, Any]
    plan: Plan
    results: list[TensorResult] = field(default_factory=list)
    flips: list[Any] = field(default_factory=list)  # routing.Flip of every router whose top-k differed
    unused_rules: list[str] = field(default_factory=list)  # --rtol/--atol rules that matched no name
    alignment: list[dict[str, Any]] | None = None  # --align tokens: how sequences were paired
    alignment_lines: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what the summary should say besides findings
    bridge: dict[str, Any] | None = None  # the bridge in use: name, source (compare/pair/bridge.py)
    inputs_differ: list[dict[str, Any]] = field(default_factory=list)  # aligned sequences fed other tokens
    # --align tokens: a generated token that differs (a consequence, compare/pair/align.py), with the
    # first divergence before it once concluded
    output_changed: list[dict[str, Any]] = field(default_factory=list)
    coverage: dict[str, Any] | None = (
        None  # compared / reference tensors per step (compare/judge/coverage.py)
    )
    # modules whose weights several modules of the other side hold, no structure telling which
    ambiguous: list[dict[str, Any]] = field(default_factory=list)
    findings: Findings | None = None  # set by verdict.conclude once the results are final

    @property
    def concluded(self) -> Findings:
        """The verdict's findings; a report is read only after
        :func:`~tracedump.compare.judge.verdict.conclude`."""
        if self.findings is None:
            raise RuntimeError("the report has no findings yet: verdict.conclude(report) decides them")
        return self.findings

    @property
    def first_divergence(self) -> TensorResult | None:
        return self.concluded.first_divergence

    @property
    def largest_growth(self) -> Growth | None:
        return self.concluded.largest_growth

    @property
    def look_inside(self) -> str | None:
        """The rerun that shows the ops inside a module-level first divergence
        (``TRACEDUMP_DUMP_OPS='^model\\.layers\\.2\\.mlp$'``,
        :func:`~tracedump.compare.pair.ops_align.suggest_ops`); None
        when there is none, or it is an op already."""
        first = self.first_divergence
        if first is None:
            return None
        return suggest_ops(first.name, {r.name: None for r in self.results})

    def count(self, status: Status) -> int:
        return sum(1 for r in self.results if r.status == status)

    @property
    def compared(self) -> int:
        """Pairs whose values (or statistics) were compared."""
        return sum(1 for r in self.results if r.error is not None)

    @property
    def exit_code(self) -> int:
        return self.concluded.exit_code

    def not_judged_by_reason(self) -> dict[str, int]:
        """Tensors measured but not judged (``not_judged``), counted by why."""
        counts: dict[str, int] = {}
        for r in self.results:
            if r.status is Status.NOT_JUDGED:
                reason = r.after_flip.reason() if r.after_flip is not None else (r.message or "not judged")
                counts[reason] = counts.get(reason, 0) + 1
        return counts

    @property
    def judged(self) -> int:
        """Pairs the verdict judged (a number against a threshold): compared, less not judged."""
        return sum(1 for r in self.results if r.error is not None and r.status is not Status.NOT_JUDGED)

    def paired_by_counts(self) -> dict[str, int]:
        """Pairs counted by what proves them (``name``, ``weights``, ...), strongest first."""
        counts = Counter(r.paired_by for r in self.results if r.paired_by is not None)
        return {kind: counts[kind] for kind in PAIRED_BY if kind in counts}

    def leftovers_by_reason(self) -> dict[str, dict[str, int]]:
        """Tensors without a counterpart, per side, counted by why (plain: "no tensor of that name")."""
        counts: dict[str, dict[str, int]] = {}
        for which, items in (("A", self.plan.only_in_a), ("B", self.plan.only_in_b)):
            side: dict[str, int] = {}
            for item in items:
                reason = item.reason or f"no tensor of that name in {'B' if which == 'A' else 'A'}"
                side[reason] = side.get(reason, 0) + 1
            counts[which] = side
        return counts

    def summary(self) -> dict[str, Any]:
        first, growth = self.first_divergence, self.largest_growth
        plan = self.plan
        return {
            "coverage": self.coverage,
            "compared": self.compared,
            "judged": self.judged,
            "not_judged": self.not_judged_by_reason(),
            "not_compared": sum(
                1 for r in self.results if r.error is None and r.status is not Status.NOT_JUDGED
            ),
            "ok": self.count(Status.OK),
            "diverged": self.count(Status.DIVERGED),
            "shape_mismatch": self.count(Status.SHAPE_MISMATCH),
            "rank_mismatch": self.count(Status.RANK_MISMATCH),
            "errors": self.count(Status.ERROR),
            "extra_ops": self.count(Status.EXTRA_OP),
            "routing_flips": [flip.to_json() for flip in self.flips],
            "not_compared_routing": self.count(Status.ROUTING),
            "not_aligned": self.count(Status.NOT_ALIGNED),
            "not_comparable": self.count(Status.NOT_COMPARABLE),
            "bridged": sum(1 for r in self.results if r.bridge is not None),
            "bridge": self.bridge,
            "paired_by": self.paired_by_counts(),
            "ambiguous": list(self.ambiguous),
            "inputs_differ": list(self.inputs_differ),
            "output_changed": list(self.output_changed),
            "leftovers": self.leftovers_by_reason(),
            "notes": list(self.notes),
            "unused_rules": list(self.unused_rules),
            **({"alignment": self.alignment} if self.alignment is not None else {}),
            "dtype_mismatch": sum(1 for r in self.results if r.dtype_differs),
            "only_in_a": len(plan.only_in_a),
            "only_in_b": len(plan.only_in_b),
            "passes": sorted({u.pass_a for u in plan.units}),
            "passes_only_in_a": list(plan.passes_only_in_a),
            "passes_only_in_b": list(plan.passes_only_in_b),
            "roots_only_in_a": list(plan.roots_only_in_a),
            "roots_only_in_b": list(plan.roots_only_in_b),
            "first_divergence": _finding(first) if first else None,
            "look_inside": self.look_inside,
            "largest_growth": growth.to_json() if growth else None,
            "exit_code": self.exit_code,
            "verdict": self.verdict_line(),
            "reach": self.findings.reach.to_json() if self.findings and self.findings.reach else None,
        }

    def verdict_line(self) -> str:
        """What the exit code says, about what was judged only: "no divergence" covers the judged
        tensors, and the ones not judged are counted beside it."""
        if self.first_divergence is not None:
            return f"first divergence: {self.first_divergence.label}"
        if self.exit_code != 0:
            return "diverged"  # the verdict line's word, not a status
        unjudged = sum(self.not_judged_by_reason().values())
        return f"no divergence among the {self.judged} judged tensors" + (
            f"; {unjudged} not judged" if unjudged else ""
        )

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` document, written by its typed model
        (:func:`~tracedump.compare.report.schema.written`)."""
        from .report.schema import written

        return written(self.records())

    def records(self) -> dict[str, Any]:
        """The report's records as plain dicts, before the model validates and writes them."""
        return {
            "a": self.a["path"],
            "b": self.b["path"],
            # what came from files or options, walked: a manifest's NaN must not void the report
            "sides": strict_json({"a": self.a, "b": self.b}),
            "settings": strict_json(self.settings),
            "summary": strict_json(self.summary()),
            "tensors": [r.to_json() for r in self.results],  # every number already through _number
            "only_in_a": [u.to_json() for u in self.plan.only_in_a],
            "only_in_b": [u.to_json() for u in self.plan.only_in_b],
        }
