"""Typed output records of a diff, each with its JSON form (the ``--json`` schema lives here).

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
  on the tokens that kept their experts (:mod:`.routing`);
- ``routing``: a tensor inside that MoE block that cannot line up once routing differs (the
  per-expert calls): not compared;
- ``not_aligned``: with ``--align tokens``, a tensor whose rows of a sequence cannot be found on
  a side (no dim of the pass's token count, e.g. logits of the last token only): reported, not
  compared;
- ``not_comparable``: one name, two module classes (the manifests' ``module_classes``: vLLM's
  ``SiluAndMul`` against HF's ``SiLUActivation``), and no bridge rule relates them: never measured,
  listed with both class names (:mod:`.bridge`).

Every status but ``ok``, ``routing_flip``, ``routing``, ``not_aligned`` and ``not_comparable``
makes the exit code 1; so do inputs that differ (:attr:`DiffReport.inputs_differ`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..errors import ExitCode
from ..store.format import json_number
from .metrics import TensorMetrics
from .plan import Plan
from .stats import StatDelta
from .tolerance import Tolerance

FAILING = ("diverged", "shape_mismatch", "rank_mismatch", "error")
NUMERIC_DIVERGENCE = ("diverged", "rank_mismatch")


def _number(value: float | None) -> float | str | None:
    return None if value is None else json_number(float(value))


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


@dataclass(frozen=True)
class TensorResult:
    """The verdict on one pair, with every measurement behind it."""

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
    status: str
    tolerance: Tolerance
    metric: str  # the number judged: rel_diff | cosine (1 - cosine) | max_abs | exact | stats
    error: float | None = None  # that number
    threshold: float | None = None  # what it had to stay under
    metrics: TensorMetrics | None = None
    stats: dict[str, StatDelta] | None = None
    unshard_a: str | None = None
    unshard_b: str | None = None
    message: str | None = None
    noise: float | None = None  # err(C, B) of the --baseline run, when one was given
    basis: str | None = None  # how the threshold was set: upstream | baseline | fixed
    absorbed: float | None = None  # the whole error of a routing-flip tensor (joins the level)
    token_dim: int | None = None  # the dim per_token runs along
    per_token: tuple[float, ...] | None = None  # rel_diff of each token position
    positions: tuple[int, ...] | None = None  # --align tokens: the sequence position of each row
    pass_b: int | None = None  # B's pass (differs from A's when pass files are given)
    level_before: str | None = None  # a container's own output: explained by the level before this tensor
    bridge: str | None = None  # how the bridge paired it ("split -1 (rule 4: qkv)"); None: by name

    @property
    def label(self) -> str:
        """The name as shown: ``root:name`` when several roots are compared."""
        return f"{self.root}:{self.name}" if self.root else self.name

    @property
    def dtype_differs(self) -> bool:
        """Stored dtypes differ (stats records' dtypes may be guesses, so they do not count)."""
        known = self.kind == "tensor" and self.dtype_a is not None and self.dtype_b is not None
        return known and self.dtype_a != self.dtype_b

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
        if self.stats is not None:
            data["stats"] = {name: delta.to_json() for name, delta in self.stats.items()}
        if self.unshard_a or self.unshard_b:
            data["unshard"] = {"a": self.unshard_a, "b": self.unshard_b}
        if self.bridge is not None:
            data["bridge"] = self.bridge
        if self.message:
            data["message"] = self.message
        data["basis"] = self.basis
        if self.level_before is not None:
            data["level_before"] = self.level_before
        if self.noise is not None:
            from .verdict import times_noise

            data["noise"] = _number(self.noise)
            data["x_noise"] = _number(times_noise(self))
        if self.per_token is not None:
            worst = self.worst_token
            data["per_token"] = {
                "dim": self.token_dim,
                **({"positions": list(self.positions)} if self.positions is not None else {}),
                "rel_diff": [_number(v) for v in self.per_token],
                "worst": worst[0] if worst else None,
                "worst_rel_diff": _number(worst[1]) if worst else None,
            }
        return data

    @property
    def worst_token(self) -> tuple[int, float] | None:
        """(position, rel_diff) of the token with the largest error, if measured per token (with
        ``--align tokens``, the sequence position; else the index along ``token_dim``)."""
        if not self.per_token:
            return None
        row = max(range(len(self.per_token)), key=lambda i: self.per_token[i])  # type: ignore[index]
        return (self.positions[row] if self.positions else row), self.per_token[row]


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
    if result.message:
        data["message"] = result.message
    return data


GROWTH_FACTOR = 10.0
# Errors below this are rounding dust: a jump from 1e-16 to 1e-14 is not where a bug starts.
GROWTH_FLOOR = 1e-12


def first_divergence(results: list[TensorResult]) -> TensorResult | None:
    """The first pair in execution order whose values exceed tolerance (or disagree across ranks)."""
    return next((r for r in results if r.status in NUMERIC_DIVERGENCE), None)


def largest_growth(results: list[TensorResult]) -> Growth | None:
    """The first tensor whose error exceeds 10x the largest error seen before it in the same pass.

    bf16 noise grows slowly through the layers; a bug shows as a jump. Errors under
    :data:`GROWTH_FLOOR` neither count as a jump nor set the running maximum.
    """
    running: float | None = None
    unit_key: tuple[int, str | None] | None = None
    for result in results:
        if (result.pass_index, result.root) != unit_key:
            unit_key, running = (result.pass_index, result.root), None
        error = result.error
        if error is None or result.metric == "exact" or not math.isfinite(error) or error < GROWTH_FLOOR:
            continue
        if running is not None and error > GROWTH_FACTOR * running:
            return Growth(result, running, error / running)
        running = error if running is None else max(running, error)
    return None


@dataclass
class DiffReport:
    """Everything a diff found; :meth:`to_json` is the ``--json`` document."""

    a: dict[str, Any]
    b: dict[str, Any]
    settings: dict[str, Any]
    plan: Plan
    results: list[TensorResult] = field(default_factory=list)
    flips: list[Any] = field(default_factory=list)  # routing.Flip of every router whose top-k differed
    unused_rules: list[str] = field(default_factory=list)  # --rtol/--atol rules that matched no name
    first_override: TensorResult | None = None  # --align tokens: the first divergence in time
    alignment: list[dict[str, Any]] | None = None  # --align tokens: how sequences were paired
    alignment_lines: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what the summary should say besides findings
    bridge: dict[str, Any] | None = None  # the bridge in use: name, source (compare/bridge.py)
    inputs_differ: list[dict[str, Any]] = field(default_factory=list)  # aligned sequences fed other tokens

    @property
    def first_divergence(self) -> TensorResult | None:
        """None when the inputs differ: no module is to blame for what its inputs already carry."""
        if self.inputs_differ:
            return None
        return self.first_override or first_divergence(self.results)

    @property
    def largest_growth(self) -> Growth | None:
        return largest_growth(self.results)

    def count(self, status: str) -> int:
        return sum(1 for r in self.results if r.status == status)

    @property
    def compared(self) -> int:
        """Pairs whose values (or statistics) were compared."""
        return sum(1 for r in self.results if r.error is not None)

    @property
    def exit_code(self) -> int:
        failing = self.inputs_differ or any(r.status in FAILING for r in self.results)
        return ExitCode.DIVERGED if failing else ExitCode.OK

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
            "compared": self.compared,
            "ok": self.count("ok"),
            "diverged": self.count("diverged"),
            "shape_mismatch": self.count("shape_mismatch"),
            "rank_mismatch": self.count("rank_mismatch"),
            "errors": self.count("error"),
            "routing_flips": [flip.to_json() for flip in self.flips],
            "not_compared_routing": self.count("routing"),
            "not_aligned": self.count("not_aligned"),
            "not_comparable": self.count("not_comparable"),
            "bridged": sum(1 for r in self.results if r.bridge is not None),
            "bridge": self.bridge,
            "inputs_differ": list(self.inputs_differ),
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
            "largest_growth": growth.to_json() if growth else None,
            "exit_code": self.exit_code,
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "a": self.a["path"],
            "b": self.b["path"],
            "sides": {"a": self.a, "b": self.b},
            "settings": self.settings,
            "summary": self.summary(),
            "tensors": [r.to_json() for r in self.results],
            "only_in_a": [u.to_json() for u in self.plan.only_in_a],
            "only_in_b": [u.to_json() for u in self.plan.only_in_b],
        }
