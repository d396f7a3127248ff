"""The bridge of one diff: which pairing table applies (``--bridge FILE``, the one derived from
the two runs' ``correspondence.json``, or a built-in one whose frameworks and architectures fit
the manifests), and the :class:`~.matcher.Matcher` that applies it with the evidence beside it
(the ranks' recorded joins, what the weights say of a pair made by name, the alignment to use).

The pairing stage's parts, each its own module: the table's types (:mod:`.table`), a rule file
read into them (:mod:`.bridge_rules`), the table derived from the records (:mod:`.correspondence`),
each side's facts (:mod:`.side_info`), and the matcher (:mod:`.matcher`, :mod:`.apply_rules`,
:mod:`.expr`). The names the rest of the comparator imports from here are re-exported.
"""

from __future__ import annotations

from typing import Any

from ..load.sources import Side
from ..options import DiffOptions, UnshardRule
from .bridge_rules import builtin_bridges
from .correspondence import derive_bridge
from .expr import BridgedPair, Expr, size_splits
from .matcher import PAIRED_BY, PLAIN_REASONS, Leftover, Matched, Matcher, known_different
from .rank_joins import tensor_parallel_joins
from .side_info import SideInfo, convention_values, conventions_untold, side_info
from .table import Bridge
from .weight_evidence import map_contradiction, weight_findings, weight_pairs

__all__ = [
    "PAIRED_BY",
    "PLAIN_REASONS",
    "BridgedPair",
    "Expr",
    "Leftover",
    "Matched",
    "Matcher",
    "SideInfo",
    "ambiguous_modules",
    "known_different",
    "map_contradiction",
    "matcher_for",
    "select_bridge",
    "side_info",
    "size_splits",
]


def _fits(bridge: Bridge, a: SideInfo, b: SideInfo) -> bool:
    if bridge.a is not None and bridge.a != a.framework:
        return False
    if bridge.b is not None and bridge.b != b.framework:
        return False
    return not bridge.architectures or any(
        p.fullmatch(info.root) for p in bridge.architectures for info in (a, b)
    )


def select_bridge(
    option: Bridge | str | None, a: SideInfo, b: SideInfo, *, mapped: bool = False
) -> tuple[Bridge | None, str]:
    """The bridge to use and a line saying why: the user's file (as given, or swapped when its
    frameworks are the other way round), none, or the first built-in whose frameworks and
    architectures fit the two manifests (either way round)."""
    if option == "none":
        return None, "bridge: off (--bridge none)"
    if isinstance(option, Bridge):
        if option.a is not None and option.b is not None and _fits(option.swapped(), a, b):
            return option.swapped(), f"bridge: {option.name} from {option.source} (A is its {option.b})"
        return option, f"bridge: {option.name} from {option.source}"
    derived = _derived(a, b, mapped=mapped)
    if derived is not None:
        return derived, f"bridge: {derived.name} (correspondence.json; A {a.framework}, B {b.framework})"
    if not a.framework or not b.framework or a.framework == b.framework:
        return None, ""
    for bridge in builtin_bridges():
        if _fits(bridge, a, b):
            return bridge, f"bridge: {bridge.name} ({bridge.source}; A {a.framework}, B {b.framework})"
        if _fits(bridge.swapped(), a, b):
            return (
                bridge.swapped(),
                f"bridge: {bridge.name} ({bridge.source}; A {a.framework}, B {b.framework})",
            )
    return None, f"bridge: none built in for A {a.framework} and B {b.framework} ({a.root})"


def _derived(a: SideInfo, b: SideInfo, *, mapped: bool = False) -> Bridge | None:
    """The bridge derived from the two runs' correspondence records (:mod:`.correspondence`):
    when one side recorded its engine's weight load, or the two name their parameters
    differently; None otherwise (and for dumps without the records)."""
    if a.record is None or b.record is None:
        return None
    if mapped and not (a.record.loads or b.record.loads):
        return None  # two plain runs renamed by --map: the user's rules pair them
    return derive_bridge(
        a.record,
        b.record,
        framework_a=a.framework,
        framework_b=b.framework,
        classes_a=a.classes,
        classes_b=b.classes,
        ranks_a=list(a.ranks) or None,
        ranks_b=list(b.ranks) or None,
        ran=(a.ran, b.ran),
        values_a=convention_values(a),
        values_b=convention_values(b),
        untold=(conventions_untold(a), conventions_untold(b)),
    )


def matcher_for(options: DiffOptions, side_a: Side, side_b: Side) -> Matcher:
    """The matcher of one diff: the bridge chosen for its two manifests (or ``--bridge``), with
    both sides' module classes, and the alignment when the user gave none: the bridge's, else
    ``tokens`` when a side was dumped by an engine integration (the vLLM plugin's
    ``set_batch`` in every step), else passes."""
    info_a, info_b = side_info(side_a), side_info(side_b)
    bridge, line = select_bridge(options.bridge, info_a, info_b, mapped=bool(options.maps))
    align = bridge.align if bridge is not None else None
    if align is None and (info_a.integration or info_b.integration):
        align = "tokens"  # an engine integration batches requests and records each step's layout
    unshard: tuple[UnshardRule, ...] = ()
    for info in (info_a, info_b):  # a tensor-parallel side joined as its ranks' loads say
        unshard += tensor_parallel_joins(list(info.ranks), info.classes)
    findings: dict[str, str] = {}
    held: dict[str, str] = {}
    loaded = False
    if info_a.record is not None and info_b.record is not None:
        findings = weight_findings(info_a.record, info_b.record)
        loaded = bool(info_a.record.loads or info_b.record.loads)
        from_file = isinstance(options.bridge, Bridge)
        if options.maps or from_file:  # the user's rules, checked against what the weights or the load say
            evidence = _derived(info_a, info_b) if from_file and loaded else bridge
            held = weight_pairs(info_a.record, info_b.record, evidence)
    return Matcher(
        bridge=bridge,
        classes_a=info_a.classes,
        classes_b=info_b.classes,
        line=line,
        align=align,
        unshard=unshard,
        inputs_by_role=bridge is not None,  # two module trees: their calls take other arguments
        findings=findings,
        weight_pairs=held,
        pairs_from_load=loaded,
        rules_from_file=isinstance(options.bridge, Bridge) and bool(held),
    )


def ambiguous_modules(matcher: Matcher) -> list[dict[str, Any]]:
    """The modules no evidence paired (their weights held by several modules of the other side, no
    structure telling which), for the report: side, module, candidates."""
    if matcher.bridge is None:
        return []
    return [
        {"side": side, "module": module, "candidates": list(candidates)}
        for side, module, candidates in matcher.bridge.ambiguous
    ]
