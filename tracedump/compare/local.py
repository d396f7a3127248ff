"""Local error: the verdict on a grafted dump (``tracedump.graft``, ``DUMP_GRAFT_FROM``).

In a grafted run each grafted module ran on the reference's own inputs (cast to the run's dtype),
so its output differs from the reference's by what that module alone adds, not by everything
upstream. Such a tensor is judged against what one module may add at the run precision, with no
growth allowance and no baseline:

    a grafted leaf:                    K_LEAF * u^2                       + n * u_acc^2
    a tensor of a grafted level:       min(K_OP * (1 + ops), K_LEVEL) * u^2 + n * u_acc^2

``u`` the run precision's unit roundoff, ``n`` the tensor's last dim (fp32 accumulation, which
dominates fp32 runs). A leaf's allowance is three roundings: the grafted input's cast to the run's
dtype, the weights held at that dtype, its output's own rounding. Inside a grafted level (a
decoder layer, its leaves running on the layer's own values) each tensor may carry what the
``ops`` leaves of the level that ran before it (its own included, counted in execution order) each
added, up to the level's most; the level's own grafted inputs are one cast. The constants are
calibrated by ``benchmarks/calibrate_graft.py`` (docs/comparator.md).

Tensors *inside* a grafted module are local to it: they depend on nothing but its grafted input.
Everything else (modules outside every graft, calls that were not grafted, with the reason from
the manifest) keeps the propagated verdict of :mod:`.verdict`, unchanged. This module only adds
to a report that :mod:`.verdict` judged; it changes nothing for a dump that was not grafted.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from ..errors import UsageError
from ..store.format import Key
from .options import DiffOptions
from .results import DiffReport, TensorResult
from .sources import Side, open_side
from .verdict import NOISE_MODEL, UNIT_ROUNDOFF

K_LEAF = 3.0  # roundings a grafted leaf may add, in u^2 (input cast, weights, output)
K_OP = 1.0  # what each leaf run inside a grafted level may add to what follows it, in u^2
K_LEVEL = 10.0  # the most the ops inside a grafted level may add, in u^2 (calibrate_graft.py)
TAIL_Z = 3.0  # sigmas of a mean of n squared roundings (chi-square: relative spread sqrt(2/n))
N_CALIBRATED = 1024  # elements of the smallest tensor the constants were set on (16 tokens x 64)
ROW_K = 3.4  # TAIL_Z x one row's relative spread (measured on prefill rows: up to 1.13, attention weights)
ROWS_CALIBRATED = 16  # rows (tokens) of a prefill the constants hold for (set on 24, checked on 16)
LEAVES = "leaves"


@dataclass(frozen=True, kw_only=True)
class GraftInfo:
    """What one grafted run's manifest says: from which dump, at which modules, what was not."""

    source: str
    level: str
    modules: tuple[str, ...]
    not_grafted: dict[str, tuple[tuple[int, int, str], ...]] = field(default_factory=dict)
    never: dict[str, str] = field(default_factory=dict)  # modules no call of which was grafted
    containers: frozenset[str] = frozenset()  # grafted modules with children (judged as a level)
    inner: dict[str, frozenset[str]] = field(default_factory=dict)  # each grafted container's leaves
    dumped: frozenset[str] = frozenset()  # the modules the grafted run dumped

    @classmethod
    def from_manifest(cls, entry: dict[str, Any], dumped: list[str] | None = None) -> GraftInfo:
        calls = entry.get("grafted_calls") if isinstance(entry.get("grafted_calls"), dict) else {}
        missing: dict[str, tuple[tuple[int, int, str], ...]] = {}
        never: dict[str, str] = {}
        for name, info in (entry.get("not_grafted") or {}).items():
            listed = info.get("listed", []) if isinstance(info, dict) else []
            missing[name] = tuple((int(c["pass"]), int(c["call"]), str(c["reason"])) for c in listed)
            if not calls.get(name):
                never[name] = missing[name][0][2] if missing[name] else "not grafted"
        return cls(
            source=str(entry.get("from", "")),
            level=str(entry.get("level") or LEAVES),
            modules=tuple(str(m) for m in entry.get("modules", [])),
            not_grafted=missing,
            never=never,
            containers=frozenset(str(m) for m in entry.get("containers", [])),
            inner={str(k): frozenset(str(n) for n in v) for k, v in (entry.get("leaves") or {}).items()},
            dumped=frozenset(str(m) for m in dumped or []),
        )

    @property
    def is_leaf_level(self) -> bool:
        return self.level == LEAVES

    def owner(self, module: str) -> str | None:
        """The grafted module that ``module`` is, or lies inside (the longest such name)."""
        best = None
        for name in self.modules:
            if (module == name or module.startswith(name + ".")) and (best is None or len(name) > len(best)):
                best = name
        return best

    def why_not(self, owner: str, pass_index: int, call: int | None) -> str | None:
        """Why a call of ``owner`` (any call in that pass, when ``call`` is None) ran on its own inputs."""
        if owner in self.never:
            return self.never[owner]
        for p, c, reason in self.not_grafted.get(owner, ()):
            if p == pass_index and (call is None or c == call):
                return reason
        return None


@dataclass(frozen=True, kw_only=True)
class LocalResult(TensorResult):
    """A result of a grafted dump: ``local`` when the tensor is its module's own error."""

    local: bool = False
    grafted_at: str | None = None  # the grafted module it is (or lies inside)
    not_grafted: str | None = None  # why its call kept its own inputs

    @property
    def label(self) -> str:
        base = super().label
        if self.local:
            return f"{base} [local]"
        return f"{base} [not grafted]" if self.not_grafted else base

    def to_json(self) -> dict[str, Any]:
        data = super().to_json()
        data["local"] = self.local
        if self.grafted_at is not None:
            data["grafted_at"] = self.grafted_at
        if self.not_grafted is not None:
            data["not_grafted"] = self.not_grafted
        return data


def level_roundings(ops: int | None) -> float:
    """In u^2: what a tensor of a grafted level may carry after ``ops`` leaves of that level ran
    (its own included): ``K_OP`` each, at most ``K_LEVEL``; ``K_LEVEL`` when the depth is unknown."""
    return K_LEVEL if ops is None else min(K_OP * (1 + ops), K_LEVEL)


def tail_factor(elements: int, rows: int | None = None) -> float:
    """How much wider than the calibrated constants a tensor of ``elements`` values in ``rows``
    rows (tokens: its elements over its last dim) may read.

    rel_diff is a mean of squared roundings. Over ``elements`` independent values its relative
    spread is about ``sqrt(2 / elements)`` (chi-square); but a row's values share its norm scale and
    its input's cast, so a row is one draw too, of spread ``ROW_K / TAIL_Z`` (measured on
    prefill passes' per-token rel_diff). The constants were set on prefill passes of at least
    ``N_CALIBRATED`` elements and ``ROWS_CALIBRATED`` rows, whose spread they already cover; a
    smaller tensor (a decode pass of one token) is allowed the extra ``TAIL_Z`` sigmas of its own,
    the wider of the two. The factor is 1 for every tensor as large as the calibrated ones (no
    looser there) and grows as ``1 / sqrt(n)`` below that."""
    spread = 1 + TAIL_Z * (2 / max(elements, 1)) ** 0.5
    by_elements = spread / (1 + TAIL_Z * (2 / N_CALIBRATED) ** 0.5)
    rows = max(rows if rows is not None else elements, 1)
    by_rows = (1 + ROW_K / rows**0.5) / (1 + ROW_K / ROWS_CALIBRATED**0.5)
    return max(1.0, by_elements, by_rows)


def local_allowance(precision: str | None, last_dim: int, roundings: float) -> float:
    """What ``roundings`` (in u^2) at ``precision`` come to, plus fp32 accumulation over ``last_dim``."""
    u_run = UNIT_ROUNDOFF.get(precision or "float32", UNIT_ROUNDOFF["float32"])
    u_acc = UNIT_ROUNDOFF["float64" if precision == "float64" else "float32"]
    return roundings * u_run**2 + max(last_dim, 1) * u_acc**2


# ------------------------------------------------------------------------------------ reading


def graft_infos(side: Side) -> dict[str, GraftInfo]:
    """Root label -> its graft record, for the runs of ``side`` that were grafted."""
    found: dict[str, GraftInfo] = {}
    for group in side.groups:
        for source in group.runs:
            manifest = source.run.manifest if source.run is not None else {}
            entry, dumped = manifest.get("graft"), manifest.get("modules")
            if isinstance(entry, dict):
                found[group.label] = GraftInfo.from_manifest(
                    entry, dumped if isinstance(dumped, list) else []
                )
    return found


def refuse_grafted_alignment(options: DiffOptions) -> None:
    """``--align tokens`` gathers rows of a sequence over steps; a grafted step was fed the
    reference's own rows pass by pass, so the two cannot be combined (yet): exit 2."""
    for which, path in (("A", options.a), ("B", options.b)):
        if path.is_dir() and graft_infos(open_side(which, path, options)):
            raise UsageError(
                f"--align tokens: {which} ({path}) is a grafted dump; grafting feeds each module the "
                "reference's inputs pass by pass, which token alignment cannot follow yet. Compare a "
                "grafted dump pass by pass (--align passes), against the dump it was grafted from."
            )


# ------------------------------------------------------------------------------------ judging


def judge_local(report: DiffReport, side_a: Side, side_b: Side) -> list[TensorResult]:
    """The report's results with every grafted tensor of A judged by its local error; unchanged
    when A was not grafted. Adds the graft to the report's settings and notes."""
    infos = graft_infos(side_a)
    if graft_infos(side_b):
        report.notes.append(
            "B is a grafted dump: a grafted run is judged as A, against the dump it was grafted from"
        )
    if not infos:
        return report.results
    single = next(iter(infos.values())) if len(infos) == 1 else None
    report.settings["graft"] = {label: _describe(info) for label, info in infos.items()}
    for info in infos.values():
        _check_source(report, info, side_b)
    judged = []
    depth = _Depth()
    for result in report.results:
        info = infos.get(result.root or "", single) if result.root is not None else single
        judged.append(_judge(result, info, depth) if info is not None else _as_local(result, False))
    _summarise(report, judged, infos)
    return judged


def _describe(info: GraftInfo) -> dict[str, Any]:
    return {
        "from": info.source,
        "level": info.level,
        "modules": len(info.modules),
        "k_leaf": K_LEAF,
        "k_op": K_OP,
        "k_level": K_LEVEL,
        "not_grafted": {name: reason for name, reason in info.never.items()},
    }


def _check_source(report: DiffReport, info: GraftInfo, side_b: Side) -> None:
    """Say so when A was grafted from another dump than B: its errors are then local to that one."""
    source = Path(info.source)
    runs = [r.run.path for g in side_b.groups for r in g.runs if r.run is not None]
    if runs and not any(_same(source, run) for run in runs):
        report.notes.append(
            f"A was grafted from {info.source}, not from B's run ({runs[0]}): its errors are local "
            "to that reference, judged against B"
        )


def _same(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or a.name == b.name
    except OSError:
        return False


def _as_local(result: TensorResult, local: bool, **extra: Any) -> LocalResult:
    values = {f.name: getattr(result, f.name) for f in fields(TensorResult)}
    return LocalResult(**values, local=local, **extra)


class _Depth:
    """How many leaves of each grafted level have run by each tensor, counted in execution order
    (A's capture order) over the leaf outputs dumped; unknown (None) when the run did not dump every
    leaf of that level (a FILTER): counting only some would hold the later tensors too tight."""

    def __init__(self) -> None:
        self.ran: dict[tuple[int, str | None, str], set[str]] = {}

    def after(self, result: TensorResult, key: Key, owner: str, info: GraftInfo) -> int | None:
        if not key.input:  # a leaf's output: one more op run in every grafted level it lies in
            for container, leaves in info.inner.items():
                if key.module in leaves:
                    ran = self.ran.setdefault((result.pass_index, result.root, container), set())
                    ran.add(f"{key.module}::{key.call}")
        leaves = info.inner.get(owner)
        if not leaves or not leaves <= info.dumped:
            return None
        return len(self.ran.get((result.pass_index, result.root, owner), ()))


def _numel(shape: tuple[int, ...] | list[int]) -> int:
    count = 1
    for size in shape:
        count *= int(size)
    return count


def _judge(result: TensorResult, info: GraftInfo, depth: _Depth) -> LocalResult:
    key = Key.parse(result.name)
    owner = info.owner(key.module)
    if owner is None:
        return _as_local(result, False)
    ops = depth.after(result, key, owner, info)
    call = key.call if key.module == owner else None
    why = info.why_not(owner, result.pass_index, call)
    if why is not None:
        return _as_local(result, False, grafted_at=owner, not_grafted=why)
    judgeable = (
        result.metrics is not None
        and result.kind == "tensor"
        and result.status in ("ok", "diverged", "routing_flip")
        and result.tolerance.metric in NOISE_MODEL
        and not result.tolerance.fixed
    )
    if not judgeable:  # integers (exact), max_abs, a user's --rtol, routing: their own rules stand
        return _as_local(result, True, grafted_at=owner)
    metrics, tolerance = result.metrics, result.tolerance
    assert metrics is not None
    error = metrics.one_minus_cosine if tolerance.metric == "cosine" else metrics.rel_diff
    flipped = result.status == "routing_flip"  # after a near-tie flip: the tokens routed alike
    if flipped and result.error is not None:
        error = result.error
    leaf = info.is_leaf_level and key.module == owner and owner not in info.containers
    shape = result.shape_b or result.shape_a or ()
    if leaf:
        roundings = K_LEAF
    elif key.module == owner and key.input:
        roundings = K_OP  # the level's own input: the cast of the reference's, one rounding
    else:
        roundings = level_roundings(ops)
    elements = _numel(shape)
    tail = tail_factor(elements, elements // max(shape[-1], 1) if shape else 1)
    threshold = local_allowance(tolerance.precision, shape[-1] if shape else 1, roundings * tail)
    ok = (error <= threshold or metrics.max_abs <= tolerance.atol) and metrics.nonfinite_mismatch == 0
    what = owner if key.module == owner else f"{owner} (which {key.module} is inside)"
    how = (
        "a grafted leaf" if leaf else f"a grafted level, {ops if ops is not None else '?'} of its leaves run"
    )
    source = (
        f"local error: what {what} alone may add at {tolerance.precision} run precision "
        f"({roundings * tail:.3g} u^2, {how}"
        + (f", x{tail:.3g} for {elements} elements" if tail > 1 else "")
        + ")"
    )
    return _as_local(
        replace(
            result,
            status=("routing_flip" if flipped else "ok") if ok else "diverged",
            error=error,
            threshold=threshold,
            basis="local",
            noise=None,
            tolerance=replace(tolerance, source=source),
        ),
        True,
        grafted_at=owner,
    )


def _summarise(report: DiffReport, judged: list[TensorResult], infos: dict[str, GraftInfo]) -> None:
    local = sum(1 for r in judged if isinstance(r, LocalResult) and r.local)
    for label, info in infos.items():
        where = f" ({label})" if len(infos) > 1 else ""
        report.notes.append(
            f"grafted run{where}: level {info.level}, from {info.source}: {local} tensors judged by "
            "their local error (what the module alone may add; no growth allowance, no baseline)"
        )
        if info.never:
            shown = ", ".join(f"{name} ({reason})" for name, reason in list(info.never.items())[:3])
            more = f", ... {len(info.never) - 3} more" if len(info.never) > 3 else ""
            report.notes.append(
                f"not grafted{where} ({len(info.never)}): {shown}{more}: judged by the error upstream"
            )
