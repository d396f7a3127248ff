"""Two module trees paired by the checkpoint tensors their modules hold (:func:`pair_modules`:
leaves, fused leaves split into pieces, containers by subtree, shared values placed by
structure), and the modules no weights pair placed among their paired neighbours
(:func:`pair_by_place`). The result, a :class:`Pairing`, is what the derived rows are written
from (:mod:`.derive_rows`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .engine_classes import ancestors, bare, parent, under
from .holdings import Holdings


@dataclass
class Pairing:
    """Engine module -> the other side's, and the fused leaves' pieces; how each leaf pair was
    proven, and the modules no evidence could pair with one counterpart."""

    leaves: dict[str, str] = field(default_factory=dict)
    splits: dict[str, list[str]] = field(
        default_factory=dict
    )  # fused engine leaf -> other modules in row order
    containers: dict[str, str] = field(default_factory=dict)
    # leaves whose weights several modules of the other side hold (fresh norms): placed by structure
    placed: set[str] = field(default_factory=set)
    # leaves whose weights several modules hold and no structure told apart -> the candidates
    ambiguous: dict[str, list[str]] = field(default_factory=dict)
    # weightless modules (activations, dropout, rotary) paired by their place (:func:`pair_by_place`)
    weightless: dict[str, str] = field(default_factory=dict)
    # modules holding parameters the other side holds nowhere, paired by their place
    unheld: dict[str, str] = field(default_factory=dict)
    # modules of one name on both sides of two plain runs: paired by the name matcher, no rule
    named: dict[str, str] = field(default_factory=dict)

    def boxes(self) -> dict[str, str]:
        """The paired modules that place others by structure: the roots, containers, named ones."""
        return {"": "", **self.named, **self.containers}


def pair_modules(
    engine: Holdings,
    other: Holdings,
    order_engine: Mapping[str, int] | None = None,
    order_other: Mapping[str, int] | None = None,
    named: frozenset[str] = frozenset(),
    ran: tuple[Mapping[str, int], Mapping[str, int]] = ({}, {}),
) -> Pairing:
    """Pairs by held checkpoint tensors: leaves by their direct tensors (an equal name breaks a
    tie), fused leaves split into the modules holding each piece whole, containers by subtree.

    Values several modules hold are no identity: such a leaf is placed by structure
    (:func:`_place`) once the rest is paired, else listed as ambiguous with its candidates.
    ``order_*``: each side's modules in the order the model defines them; ``ran``: in the order
    each run's outputs were captured (preferred where it places every module concerned). ``named``:
    modules of one name on both sides of two plain runs, paired by their name, which is stronger
    evidence than the values (a loader that filled layer 1 from layer 2 is still layer 1): none of
    them is paired by weights, and they stand as paired containers for the structure."""
    out = Pairing(named={m: m for m in named})
    by_set: dict[frozenset[str], list[str]] = {}
    for module, sources in other.direct.items():
        if module not in named:
            by_set.setdefault(frozenset(sources), []).append(module)
    holder: dict[str, str] = {}
    for module, sources in other.direct.items():
        for source in sources:
            if module not in named:
                holder.setdefault(source, module)
    taken: set[str] = set()
    pending: dict[str, list[str]] = {}
    for module in sorted(engine.direct, key=lambda m: (m.count("."), m)):
        if module in engine.experts or module in named:
            continue
        same = by_set.get(frozenset(engine.direct[module]), [])
        candidates = [m for m in same if m not in taken] or same  # else: one module under two names
        if module in candidates or len(candidates) == 1:
            chosen = module if module in candidates else candidates[0]
            out.leaves[module] = chosen
            taken.add(chosen)
            continue
        if candidates:
            pending[module] = candidates
            continue
        pieces = engine.pieces.get(module, [])
        targets = [holder.get(p.source) for p in pieces]
        if (
            len(pieces) >= 2
            and all(p.whole for p in pieces)
            and all(targets)
            and len(set(targets)) == len(targets)
        ):
            out.splits[module] = [t for t in targets if t is not None]
    for module, params in engine.ambiguous.items():
        if module in named:
            continue
        holders = {m: held for m, held in other.direct.items() if m not in named}
        sets = [{m for m, held in holders.items() if held & found} for found in params]
        candidates = sorted(set.intersection(*sets)) if sets else []
        if candidates:
            pending[module] = candidates
    universe = (
        set().union(*engine.direct.values()) & set().union(*other.direct.values()) if other.direct else set()
    )
    mine, theirs = engine.subtree(universe), other.subtree(universe)
    groups: dict[frozenset[str], tuple[list[str], list[str]]] = {}
    for side, tree, leaves in ((0, mine, engine.direct), (1, theirs, other.direct)):
        for module, sources in tree.items():
            if sources and module and module not in leaves and module not in named:
                groups.setdefault(sources, ([], []))[side].append(module)
    for a_list, b_list in groups.values():
        remaining = sorted(b_list, key=lambda m: (m.count("."), m))
        for module in sorted(a_list, key=lambda m: (m.count("."), m)):
            if not remaining:
                break
            chosen = module if module in remaining else remaining[0]
            out.containers[module] = chosen
            remaining.remove(chosen)
    _place(out, pending, taken, (ran[0], order_engine or {}), (ran[1], order_other or {}))
    return out


def _place(
    out: Pairing,
    pending: Mapping[str, list[str]],
    taken: set[str],
    orders_engine: tuple[Mapping[str, int], ...],
    orders_other: tuple[Mapping[str, int], ...],
) -> None:
    """Leaves whose weights several modules hold, placed by structure: of the candidates, those
    inside the counterpart of the leaf's nearest paired container and not inside the counterpart
    of a container that does not hold the leaf (a norm of ``blocks.2`` among layer 2's norms, the
    final norm outside every layer); several left for several such leaves of one container pair
    in the order each run executed them (where both runs dumped them all), else the order each
    side defines them. What is still open is ambiguous, with its candidates."""
    boxes_paired = out.boxes()  # the two roots: each is the whole model
    reverse = {b: a for a, b in boxes_paired.items()}
    narrowed: dict[str, tuple[str, tuple[str, ...]]] = {}
    for module, candidates in pending.items():
        home = next((p for p in ancestors(module) if p in boxes_paired), "")
        there = boxes_paired[home]
        kept = []
        for candidate in candidates:
            if candidate in taken or not under(candidate, there):
                continue
            boxes = [p for p in ancestors(candidate) if p in reverse and under(p, there) and p != there]
            if all(under(module, reverse[p]) for p in boxes):
                kept.append(candidate)
        narrowed[module] = (home, tuple(sorted(kept)))
    groups: dict[tuple[str, tuple[str, ...]], list[str]] = {}
    for module, key in narrowed.items():
        groups.setdefault(key, []).append(module)
    for (_, candidates), modules in groups.items():
        orders = [
            (mine, theirs)
            for mine, theirs in zip(orders_engine, orders_other, strict=True)
            if _ordered(modules, mine) and _ordered(candidates, theirs)
        ]
        if len(candidates) == len(modules) and orders:
            order_engine, order_other = orders[0]  # the runs' order where it places them all
            mine = sorted(modules, key=lambda m: order_engine.get(m, 0))
            theirs = sorted(candidates, key=lambda m: order_other.get(m, 0))
            for module, counterpart in zip(mine, theirs, strict=True):
                out.leaves[module] = counterpart
                out.placed.add(module)
            continue
        for module in modules:
            out.ambiguous[module] = list(candidates) or sorted(pending[module])


def _ordered(modules: list[str] | tuple[str, ...], order: Mapping[str, int]) -> bool:
    """Whether ``order`` places every one of ``modules`` (a single one needs no order)."""
    return len(modules) == 1 or all(m in order for m in modules)


def _weighted(held: Holdings) -> set[str]:
    """Every module holding parameters, and every module above one."""
    found: set[str] = set()
    for module in (*held.direct, *held.unresolved, *held.ambiguous, *held.experts):
        found.add(module)
        found.update(ancestors(module))
    return found


def pair_by_place(
    pairing: Pairing,
    engine: Holdings,
    other: Holdings,
    classes_engine: Mapping[str, str],
    classes_other: Mapping[str, str],
    shapes: tuple[Mapping[str, list[Any]], Mapping[str, list[Any]]] = ({}, {}),
) -> None:
    """The modules no weights paired, by their place: the unpaired children of two paired modules,
    in the order each side defines them, where both have as many. Weightless ones (activations,
    dropout, rotary, an attention op) with weightless ones (else those of one class name on both
    sides, one each); modules holding parameters no module of the other side holds (a weight
    loaded scaled, transposed, from another layer) with such modules, a leaf only where its
    parameters have the counterpart's shapes (``shapes``: module -> its parameters' shapes), a
    container only where none of its paired modules is paired outside the counterpart; then their
    children in turn."""
    weighted_e, weighted_o = _weighted(engine), _weighted(other)
    paired_e = {*pairing.leaves, *pairing.containers, *pairing.splits, *pairing.ambiguous, *pairing.named}
    paired_o = {*pairing.leaves.values(), *pairing.containers.values(), *pairing.named}
    paired_o |= {p for pieces in pairing.splits.values() for p in pieces}
    paired_o |= {c for found in pairing.ambiguous.values() for c in found}
    homes = list(pairing.boxes().items())
    while homes:
        home, there = homes.pop(0)
        mine = [m for m in classes_engine if m and parent(m) == home and m not in paired_e]
        theirs = [m for m in classes_other if m and parent(m) == there and m not in paired_o]
        light = ([m for m in mine if m not in weighted_e], [m for m in theirs if m not in weighted_o])
        _zip_weightless(pairing, *light, classes_engine, classes_other)
        heavy = ([m for m in mine if m in weighted_e], [m for m in theirs if m in weighted_o])
        if not heavy[0] or len(heavy[0]) != len(heavy[1]):
            continue
        for module, counterpart in zip(*heavy, strict=True):
            leaf = not any(parent(m) == module for m in classes_engine)
            mine_shapes, their_shapes = shapes[0].get(module, []), shapes[1].get(counterpart, [])
            same = sorted(map(str, mine_shapes)) == sorted(map(str, their_shapes))
            fits = same if leaf else _inside(pairing, module, counterpart)
            if fits:
                pairing.unheld[module] = counterpart
                homes.append((module, counterpart))


def _zip_weightless(
    pairing: Pairing,
    mine: list[str],
    theirs: list[str],
    classes_engine: Mapping[str, str],
    classes_other: Mapping[str, str],
) -> None:
    if len(mine) == len(theirs):
        pairing.weightless.update(zip(mine, theirs, strict=True))
        return
    for qualname in {bare(classes_engine[m]) for m in mine}:
        one = [m for m in mine if bare(classes_engine[m]) == qualname]
        two = [m for m in theirs if bare(classes_other[m]) == qualname]
        if len(one) == len(two) == 1:
            pairing.weightless[one[0]] = two[0]


def _inside(pairing: Pairing, module: str, counterpart: str) -> bool:
    """Whether every module paired below ``module`` is paired below ``counterpart``, and back."""
    pairs = [*pairing.leaves.items(), *pairing.containers.items(), *pairing.named.items()]
    return all(under(a, module) == under(b, counterpart) for a, b in pairs)
