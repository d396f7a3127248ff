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
calibrated by ``benchmarks/calibrate_graft.py`` (docs/comparator.md); they live in
:mod:`.allowance`, and the status they give is set by :func:`.judge.judge` like every other. Here:
which tensors are local (the manifest's graft record, the leaves run so far in each grafted level),
the local evidence handed to the judge (:class:`GraftJudging`), and what the report says of the
graft.

Tensors *inside* a grafted module are local to it: they depend on nothing but its grafted input.
Everything else (modules outside every graft, calls that were not grafted, with the reason from
the manifest) keeps the propagated verdict, unchanged; nothing changes for a dump that was not
grafted.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from ...errors import UsageError
from ...store.format import Key
from ..load.sources import Side, open_side
from ..measure.shadow import ShadowMeasure
from ..options import DiffOptions
from ..pair.bridge import Matcher
from ..pair.table import Bridge, Rule, Tensors, numbered, row
from ..results import DiffReport, Measured, TensorResult
from .allowance import K_LEAF, K_LEVEL, K_OP, K_WEIGHTS, ROUNDING_HEADROOM, local_allowance_of, shadow_parts
from .judge import LocalEvidence, usable_shadow
from .verdict import judge_all

LEAVES = "leaves"
ZERO_FED, KEPT_OWN = "0", "own"  # graft.fed_inputs: zeros, the run's own value (dump/graft_feed.py)


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


FED_ZERO_REASON = (
    "a grafted input fed zeros (the deferred residual: the reference's input already holds it); "
    "the reference's module takes no such input"
)
FED_OWN_REASON = "a grafted input that kept this run's own value (the reference's module takes no such input)"


def grafted_input_rules(side_a: Side) -> list[Rule]:
    """Pairing rows for each input a grafted A was fed by parameter (the manifest's
    ``graft.fed_inputs``: an engine's decoder layer took the reference's ``[0]`` as its ``[1]``),
    built as data (:func:`..pair.table.row`): each paired with the reference input it took; its zeroed
    and kept inputs listed with the reason, never compared with the reference input of the same
    path (another quantity)."""
    rules: list[Rule] = []
    for group in side_a.groups:
        for source in group.runs:
            entry = (source.run.manifest if source.run is not None else {}).get("graft")
            if not isinstance(entry, dict):
                continue
            names = entry.get("reference_names") or {}
            for module, paths in (entry.get("fed_inputs") or {}).items():
                reference = names.get(module, module)
                for path, taken in paths.items():
                    rules.append(_fed_input_row(Tensors(f"{module}@in{path}"), taken, reference))
    return rules


def _fed_input_row(match: Tensors, taken: str, reference: str) -> Rule:
    """One fed input's row: skipped with the reason when it was zeroed or kept, else renamed to
    the reference module's input at the path it took."""
    if taken == ZERO_FED:
        return row("skip", match, reason=FED_ZERO_REASON, id="fed zeros")
    if taken == KEPT_OWN:
        return row("skip", match, reason=FED_OWN_REASON, id="kept own")
    return row("rename", match, b=f"{reference}@in{taken}", id="grafted input")


def with_grafted_inputs(matcher: Matcher, side_a: Side) -> Matcher:
    """The diff's matcher with :func:`grafted_input_rules` tried first (A unchanged when it was not
    grafted by parameter)."""
    rules = numbered(grafted_input_rules(side_a))
    if not rules:
        return matcher
    if matcher.bridge is None:
        fed = Bridge(
            name="grafted inputs",
            source="manifest.json graft.fed_inputs",
            a=None,
            b=None,
            architectures=(),
            align=None,
            rules=rules,
        )
        return replace(matcher, bridge=fed)
    return replace(matcher, bridge=replace(matcher.bridge, rules=rules + matcher.bridge.rules))


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


def judge_grafted(
    report: DiffReport,
    side_a: Side,
    side_b: Side,
    measured: list[Measured],
    noise: dict[int, float] | None = None,
) -> list[TensorResult]:
    """Every pair judged (:func:`.verdict.judge_all`), each grafted tensor of A with its local
    evidence; as any diff when A was not grafted. Adds the graft to the report's settings and
    notes, and says which shadows could not be read."""
    infos = graft_infos(side_a)
    if graft_infos(side_b):
        report.notes.append(
            "B is a grafted dump: a grafted run is judged as A, against the dump it was grafted from"
        )
    if not infos:
        return judge_all(measured, noise)
    report.settings["graft"] = {label: _describe(info) for label, info in infos.items()}
    for info in infos.values():
        _check_source(report, info, side_b)
    graft = GraftJudging(infos, measured)
    judged = judge_all(measured, noise, graft)
    _summarise(report, judged, infos)
    if graft.shadows_present:
        used = sum(1 for r in judged if r.rule == "shadow")
        counted = sum(1 for r in judged if r.rule == "local")
        report.notes.append(
            f"fp32 shadow: {used} tensors judged by their shadow (logic: the shadow against the "
            f"reference, within {K_WEIGHTS:g}x the weights' measured rounding; rounding: the run against "
            f"its shadow, within {ROUNDING_HEADROOM:g}x the counting rule), {counted} by the "
            "counting rule (no shadow, or a near-tie routing flip)"
        )
    unread = [m for m in measured if m.evidence.shadow_failure is not None]
    if unread:
        report.notes.append(
            f"fp32 shadow: {len(unread)} tensors' shadows could not be read, judged by the counting rule "
            f"(first: {unread[0].label}: {unread[0].evidence.shadow_failure})"
        )
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


class _Depth:
    """How many leaves of each grafted level have run by each tensor, counted in execution order
    (A's capture order) over the leaf outputs dumped; unknown (None) when the run did not dump every
    leaf of that level (a FILTER): counting only some would hold the later tensors too tight."""

    def __init__(self) -> None:
        self.ran: dict[tuple[int, str | None, str], set[str]] = {}

    def after(self, result: Measured, key: Key, owner: str, info: GraftInfo) -> int | None:
        if not key.input:  # a leaf's output: one more op run in every grafted level it lies in
            for container, leaves in info.inner.items():
                if key.module in leaves:
                    ran = self.ran.setdefault((result.pass_index, result.root, container), set())
                    ran.add(f"{key.module}::{key.call}")
        leaves = info.inner.get(owner)
        if not leaves or not leaves <= info.dumped:
            return None
        return len(self.ran.get((result.pass_index, result.root, owner), ()))


_COMBINED = re.compile(r"^cat\((.*), dim=-?\d+\)$")


def a_key(name: str) -> Key | None:
    """A's key of a result. A bridged combination of A's tensors (``x[0] + x[1]``: a decoder
    layer's ``(hidden, residual)``; ``x * y``; ``cat(x, y, dim=d)``) counts as its first tensor's
    when all of them are one module's outputs; None when they are several modules'."""
    inner = _COMBINED.match(name)
    parts = re.split(r" [+*] |, ", inner.group(1) if inner else name)
    keys = [Key.parse(part) for part in parts]
    return keys[0] if all(k.module == keys[0].module and k.input == keys[0].input for k in keys) else None


@dataclass(frozen=True)
class _Place:
    """Where a result of A lies in the graft: the grafted module, and why its call was not grafted."""

    local: bool
    grafted_at: str | None = None
    not_grafted: str | None = None


_OUTSIDE = _Place(local=False)


class GraftJudging:
    """A grafted A's local evidence, pair by pair in execution order (:class:`.judge.LocalJudging`),
    and each result labelled with where it lies in the graft (:class:`LocalResult`).

    Walked in execution order because two facts build up along it: how many leaves of each grafted
    level have run (:class:`_Depth`), and where the shadow routed otherwise than the reference (a
    near-tie: from there on in that grafted module the shadow is not the reference's computation)."""

    def __init__(self, infos: dict[str, GraftInfo], measured: list[Measured]) -> None:
        self.infos = infos
        self.single = next(iter(infos.values())) if len(infos) == 1 else None
        self.depth = _Depth()
        self.flipped_in = self._flipped_in(measured)
        self.routed_otherwise: set[tuple[int, str | None, str]] = set()
        self.shadows_present = any(
            m.evidence.shadow is not None or m.evidence.shadow_failure is not None for m in measured
        )
        self.places: dict[int, _Place] = {}

    def _info(self, result: Measured) -> GraftInfo | None:
        return self.infos.get(result.root or "", self.single) if result.root is not None else self.single

    def _flipped_in(self, measured: list[Measured]) -> dict[tuple[int, str | None, str | None], int]:
        """(pass, root, grafted module) -> the index of its first near-tie routing flip (a router's
        own indices); None as the module: outside every graft. A flip's consequence reaches only
        what runs after it on its values: inside that grafted module, after the router; every
        other grafted module ran on the reference's inputs."""
        found: dict[tuple[int, str | None, str | None], int] = {}
        for m in measured:
            router = m.evidence.router
            if router is not None and router.near_tie:
                info = self._info(m)
                owner = info.owner(Key.parse(m.name).module) if info is not None else None
                found.setdefault((m.pass_index, m.root, owner), m.index)
        return found

    def labelled(self, result: TensorResult) -> LocalResult:
        place = self.places.get(result.index, _OUTSIDE)
        values = {f.name: getattr(result, f.name) for f in fields(TensorResult)}
        return LocalResult(
            **values, local=place.local, grafted_at=place.grafted_at, not_grafted=place.not_grafted
        )

    def evidence(self, result: Measured) -> LocalEvidence | None:
        info = self._info(result)
        if info is None:
            return None
        key = a_key(result.name)
        owner = info.owner(key.module) if key is not None else None
        if key is None or owner is None:
            return None
        shadow = result.evidence.shadow
        if shadow is not None and shadow.routed_otherwise:
            self.routed_otherwise.add((result.pass_index, result.root, owner))
        ops = self.depth.after(result, key, owner, info)
        call = key.call if key.module == owner else None
        why = info.why_not(owner, result.pass_index, call)
        if why is not None:
            self.places[result.index] = _Place(local=False, grafted_at=owner, not_grafted=why)
            return None
        self.places[result.index] = _Place(local=True, grafted_at=owner)
        leaf = info.is_leaf_level and key.module == owner and owner not in info.containers
        allowance = local_allowance_of(
            result, leaf=leaf, own_input=key.module == owner and key.input, ops=ops
        )
        what = owner if key.module == owner else f"{owner} (which {key.module} is inside)"
        how = (
            "a grafted leaf"
            if leaf
            else f"a grafted level, {ops if ops is not None else '?'} of its leaves run"
        )
        tail = allowance.tail
        source = (
            f"local error: what {what} alone may add at {result.tolerance.precision} run precision "
            f"({allowance.roundings * tail:.3g} u^2, {how}"
            + (f", x{tail:.3g} for {allowance.elements} elements" if tail > 1 else "")
            + ")"
        )
        first_flip = self.flipped_in.get((result.pass_index, result.root, owner))
        usable, unused = self._shadow_of(result, owner)
        parts = shadow_source = None
        if usable is not None:
            assert usable.logic is not None and usable.rounding is not None and usable.weights is not None
            parts = shadow_parts(result, allowance, usable.logic, usable.rounding, usable.weights)
            shadow_source = (
                f"local error: what {what} alone may add, split by its fp32 shadow: logic (the shadow vs "
                "the reference) "
                f"{parts.logic[0]:.3g} within {parts.logic[1]:.3g} ({K_WEIGHTS:g} x {parts.weights:.3g}, "
                f"the weights' rounding measured on the shadow, + fp32's floor); rounding (the run vs its "
                f"shadow) {parts.rounding[0]:.3g} within {parts.rounding[1]:.3g} ({ROUNDING_HEADROOM:g} x "
                f"{allowance.roundings * tail:.3g} u^2 at {result.tolerance.precision}, {how})"
            )
        return LocalEvidence(
            allowance=allowance,
            source=source,
            flip_inside=first_flip is not None and first_flip < result.index,
            shadow=parts,
            shadow_source=shadow_source,
            shadow_unused=unused,
            shadows_present=self.shadows_present,
        )

    def _shadow_of(self, result: Measured, owner: str) -> tuple[ShadowMeasure | None, str | None]:
        """(the shadow measure that may judge ``result``, or None; why not, when it has one that
        cannot): the judge still sets it aside where a near-tie flip reaches the tensor."""
        found = result.evidence
        if found.shadow_failure is not None:
            return None, f"its shadow could not be read: {found.shadow_failure}"
        measure = found.shadow
        if measure is not None and measure.unfit is not None:
            return None, measure.unfit
        if not usable_shadow(measure):
            return None, None
        if (result.pass_index, result.root, owner) in self.routed_otherwise:
            return None, "its shadow routed otherwise at a near-tie earlier in the grafted module"
        return measure, None


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
