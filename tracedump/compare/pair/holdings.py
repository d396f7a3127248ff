"""What each module of one side holds: the checkpoint tensors (and which rows of them) its
parameters were filled from. From an engine's recorded load (:func:`engine_holdings`, every rank's
merged by :func:`merged_holdings`), or, for a run that loaded no checkpoint itself (HF, a port),
from its parameters' names and fingerprints (:func:`plain_holdings`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ...store.correspondence import Correspondence, Load, fingerprints_match, shared_tail
from .engine_classes import parent


@dataclass(frozen=True)
class Piece:
    """Rows ``[start, start + count)`` of a module's weight, filled from ``source`` (its rows
    from ``source_row``); ``whole``: the piece is all of the source tensor."""

    source: str
    start: int
    count: int
    source_row: int
    whole: bool
    expert: int | None = None


@dataclass
class Holdings:
    """One side: each module's direct checkpoint tensors, each module's weight pieces."""

    direct: dict[str, set[str]] = field(default_factory=dict)
    pieces: dict[str, list[Piece]] = field(default_factory=dict)  # the weight (dims >= 2) param's
    experts: set[str] = field(default_factory=set)  # modules loaded per expert
    unresolved: set[str] = field(default_factory=set)  # modules holding parameters of no known source
    # modules whose every known parameter holds values several checkpoint tensors hold (fresh
    # norms all ones, zero biases): per parameter, the candidate tensors; paired by structure
    ambiguous: dict[str, list[frozenset[str]]] = field(default_factory=dict)

    def subtree(self, universe: set[str]) -> dict[str, frozenset[str]]:
        """Every module (ancestors included) -> the known checkpoint tensors of its subtree."""
        out: dict[str, set[str]] = {}
        for module, sources in self.direct.items():
            kept = sources & universe
            name = module
            while True:
                out.setdefault(name, set()).update(kept)
                if not name:
                    break
                name = parent(name)
        return {name: frozenset(s) for name, s in out.items()}


def _is_weight(param: str, meta: Mapping[str, Any] | None) -> bool:
    shape = (meta or {}).get("shape") or []
    return len(shape) >= 2 or param.endswith(".weight")


def engine_holdings(record: Correspondence) -> Holdings:
    """From the loads an engine recorded: which checkpoint tensors (and rows) each module holds;
    a shared parameter (a tied head) counts for every module holding it."""
    out = Holdings()
    by_param: dict[str, list[Load]] = {}
    for load in record.loads:
        by_param.setdefault(load.param, []).append(load)
    for name, meta in record.parameters.items():
        if meta.get("same_as") in by_param and name not in by_param:
            by_param[name] = [Load(**{**x.__dict__, "param": name}) for x in by_param[meta["same_as"]]]
    for param, loads in by_param.items():
        module = param.rpartition(".")[0]
        out.direct.setdefault(module, set()).update(load.source for load in loads)
        if any(load.expert is not None for load in loads):
            out.experts.add(module)
            continue
        meta = record.parameters.get(param)
        if not _is_weight(param, meta):
            continue
        for load in loads:
            out.pieces.setdefault(module, []).extend(_pieces(load, record.sources.get(load.source)))
    for module in out.pieces:
        out.pieces[module].sort(key=lambda p: p.start)
    return out


def merged_holdings(records: list[Correspondence]) -> Holdings:
    """Rank 0's holdings, a piece counted whole when the ranks' pieces of its source together cover
    it (a tensor-parallel shard: the gathered output holds all of it, in the single-rank layout)."""
    held = engine_holdings(records[0])
    if len(records) == 1:
        return held
    covered: dict[tuple[str, str], int] = {}
    for record in records:
        for module, pieces in engine_holdings(record).pieces.items():
            for piece in pieces:
                covered[(module, piece.source)] = covered.get((module, piece.source), 0) + piece.count
    sizes = {name: (meta.get("shape") or [0])[0] for name, meta in records[0].sources.items()}
    for module, pieces in held.pieces.items():
        held.pieces[module] = [
            replace(p, whole=covered.get((module, p.source)) == sizes.get(p.source)) for p in pieces
        ]
    return held


def _pieces(load: Load, source: Mapping[str, Any] | None) -> list[Piece]:
    """The weight rows one load filled: the region's first dim past the dropped leading ones."""
    if load.rows is None or load.region is None:
        return []
    source_shape = list((source or {}).get("shape") or [])
    dim = max(len(load.region) - len(source_shape), 0) if source_shape else 0
    base = load.region[dim][0] if dim < len(load.region) else 0
    source_rows = source_shape[0] if source_shape else None
    whole = load.cols is None and len(load.rows) == 1 and load.rows[0][1] == 0
    return [
        Piece(
            source=load.source,
            start=base + block_row,
            count=count,
            source_row=source_row,
            whole=whole and count == source_rows,
            expert=load.expert,
        )
        for block_row, source_row, count in load.rows
    ]


def plain_holdings(record: Correspondence, sources: Mapping[str, Mapping[str, Any]]) -> Holdings:
    """For a run that did not record its load (HF, a port): each parameter is the checkpoint tensor
    of its name, else the one of its shape and fingerprint among ``sources``. A fingerprint several
    tensors share (fresh norms all ones, zero biases) is no identity: such a parameter is kept with
    its candidates, resolved by the module's other parameters where they name one module (a
    Linear's zero bias beside its unique weight), else left to the structure
    (:func:`.module_pairing.pair_modules`)."""
    out = Holdings()
    by_print: dict[tuple[int, ...], list[tuple[str, list[float]]]] = {}
    for name, meta in sources.items():
        by_print.setdefault(tuple(meta.get("shape") or ()), []).append(
            (name, list(meta.get("fingerprint") or []))
        )
    firsts = {name: meta for name, meta in record.parameters.items() if "same_as" not in meta}
    shared: dict[str, list[tuple[str, frozenset[str]]]] = {}
    for param, meta in record.parameters.items():
        module = param.rpartition(".")[0]
        own = firsts.get(meta.get("same_as", param), meta)
        found = _candidates(param, own, sources, by_print)
        if not found:
            out.unresolved.add(module)
            continue
        if len(found) > 1:
            shared.setdefault(module, []).append((param, frozenset(found)))
            continue
        _hold(out, module, param, meta, found[0])
    for module, params in shared.items():
        homes = {parent(s) for s in out.direct.get(module, ())}
        for param, found in params:
            leaf = param.rpartition(".")[2]
            mine = [s for s in found if parent(s) in homes and s.rpartition(".")[2] == leaf]
            if len(homes) == 1 and len(mine) == 1:
                _hold(out, module, param, record.parameters[param], mine[0])
            elif not homes:
                out.ambiguous.setdefault(module, []).append(found)
    return out


def _hold(out: Holdings, module: str, param: str, meta: Mapping[str, Any], source: str) -> None:
    out.direct.setdefault(module, set()).add(source)
    if _is_weight(param, meta):
        rows = int((meta.get("shape") or [0])[0])
        out.pieces.setdefault(module, []).append(Piece(source, 0, rows, 0, True))


def _candidates(
    param: str,
    meta: Mapping[str, Any],
    sources: Mapping[str, Mapping[str, Any]],
    by_print: Mapping[tuple[int, ...], list[tuple[str, list[float]]]],
) -> list[str]:
    """The checkpoint tensors ``param`` may hold: the one of its name and shape; else those of its
    shape and fingerprint, narrowed to the one named most like it where one shares more trailing
    name components than every other (a tied head's ``lm_head.weight``); several when none does."""
    shape = tuple(meta.get("shape") or ())
    if param in sources and tuple(sources[param].get("shape") or ()) == shape:
        return [param]
    mine = list(meta.get("fingerprint") or [])
    if not mine:
        return []
    found = [name for name, theirs in by_print.get(shape, []) if fingerprints_match(mine, theirs)]
    if len(found) <= 1:
        return found
    tails = sorted(((shared_tail(s, param), s) for s in found), reverse=True)
    if tails[0][0] > 0 and tails[0][0] > tails[1][0]:
        return [tails[0][1]]
    return found
