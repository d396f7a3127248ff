"""The bridge derived from the weight load: two module trees paired by the checkpoint tensors
their parameters hold, with no rule file (docs/engines.md, "The derived correspondence").

An engine that loads an HF checkpoint itself (the vLLM plugin) records in ``correspondence.json``
which checkpoint tensors, and which rows of them, filled each of its parameters; every dumped run
records its parameters' names and fingerprints (:mod:`tracedump.store.correspondence`). From the
two records, with nothing written per family:

- **leaves**: a module whose parameters hold the same checkpoint tensors as a module of the other
  side computes the same thing, whatever the two classes: compared (its ``(out, bias)`` tuple
  unwrapped). A fused module (vLLM's ``qkv_proj``, ``gate_up_proj``) whose weight rows come from
  several checkpoint tensors held whole by modules of the other side: its output is split at the
  recorded row offsets, in row order, each piece against its module;
- **containers** (decoder layers, attention, MLP / MoE blocks, the model): the modules whose
  subtrees hold the same checkpoint tensors pair; a container returning ``(hidden, residual)``
  compares ``hidden + residual``, a plain or tuple output its first element;
- **weightless parts, engine-wide** (:data:`ENGINE_CLASSES`): a fused add + norm's running
  residual against the other norm's input, every ``*AndMul`` against ``act(gate) * up``, the
  attention op against the output projection's input, rotary embeddings and fused experts listed
  as not comparable with the reason, the logits against the head's counterpart.

The result is an ordinary :class:`~.bridge_rules.Bridge` of synthesised rules, so the executor,
the table's ``bridged`` column and the JSON stay the same; ``--bridge FILE`` overrides it. It also
carries the module pairs (``Bridge.modules``: leaves, containers, a fused leaf with its first
piece's module): whose inputs pair, by what they hold (:mod:`.input_roles`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ...store.correspondence import (
    RAW_LOGITS,
    ROUTING_PATHS,
    Correspondence,
    Load,
    fingerprints_match,
    routing_name,
    shared_tail,
)
from ...store.format import Key
from ..options import UnshardRule
from .bridge_rules import Bridge, parse_bridge
from .conventions import (
    FIRST,
    SUM,
    SideValues,
    Told,
    copies_previous,
    returns_last_child,
    same,
    tuple_output,
    tuple_roles,
)

DERIVED_NAME = "derived from the weight load"

ROTARY_REASON = (
    "the rotary embedding: one side returns the rotated q and k, the other cos/sin tables or "
    "rotates inside a function (different quantities); a rotary bug shows at the attention output"
)
EXPERTS_REASON = (
    "fused experts: every expert runs in one kernel whose per-expert outputs are never tensors; "
    "compared as the MoE block's output and its router"
)
RESIDUAL_REASON = (
    "the running residual (input + residual) of a fused add + norm: the other side's norm input, "
    "dumped with --inputs; without it, the residual stream is compared at each decoder layer"
)
ATTENTION_REASON = (
    "the attention op: the other side computes it in a function, not a module; dump it with "
    "--inputs to compare it with the output projection's input"
)
ACT_REASON = (
    "a fused act(gate) * up: the other side's act and up outputs (or its down projection's input, "
    "with --inputs) were not dumped as whole tensors"
)

ROUTER_LOGITS_REASON = (
    "the router logits recorded beside the fused experts: the tensor the gate module returned "
    "({gate}), compared once, as that module's output against {router}"
)
ACT_INPUT_REASON = (
    "the input of an act(gate) * up or of the act alone: the gate (and up) projection's output, "
    "compared as that output (a fused projection split at the load's offsets); one side's act "
    "takes both halves, the other's the gate half"
)

EXTRA_REASON = (
    "an extra output of this module (attention probabilities, a router's top-k weights and ids) "
    "that the engine's counterpart does not return (its fused kernel computes them inside)"
)

EXPERTS_DIFFER_REASON = (
    "{whole}'s experts module returns its MoE block's whole output (the shared "
    "experts added inside), {part}'s the routed experts only (its block adds the rest): measured "
    "in the run; compared as the MoE block's output"
)
RETURNS_REASON = "its output is its last child's ({child}) as it is, measured in the run"
ROLE_REASON = (
    "which output of {router} holds the {what} is not told by the two runs (no single output of "
    "its dtype and last dim): listed, never paired by position"
)
UNTOLD_REASON = (
    "which of (hidden, residual) is this layer's output is not told by the run: {why}; listed, "
    "never compared by a guess (dump with --inputs so the next layer's inputs tell)"
)
RESIDUAL_PASSED = "the residual handed on beside the layer's output ({why}): not an output of its own"
ADDS_REASON = (
    "{adds}'s block adds something (the residual) to its last child's output, "
    "{plain}'s returns that output as it is (A's {child_a}, B's {child_b}): measured in the run; "
    "compared at its children and at the decoder layer"
)
NOT_A_COPY_REASON = (
    "an identity-class module (dropout) whose output is not the tensor recorded before it: its "
    "input (attention probabilities) was computed in a function and not dumped"
)
IDENTITY = re.compile(r"Dropout\d?d?|Identity")

# Weightless modules, engine-wide (never per family): class name regexes (searched in the bare
# class name) and what they are compared with.
ENGINE_CLASSES: dict[str, str] = {
    "act_and_mul": r"AndMul$",
    "attention": r"^(Attention|MLAAttention|EncoderOnlyAttention)$",
    "rotary": r"Rotary|RoPE|Rope",
    "logits": r"^LogitsProcessor$",
    "norm": r"Norm",
    "embedding": r"Embedding|LMHead",
    "scaled": r"Scaled",  # an embedding that multiplies by a scale inside itself (HF's Gemma)
}
LOGITS_REASON = (
    "the logits processor's output: the head's logits after its soft cap and scale where the model "
    "has them (Gemma2's final_logit_softcapping, Granite's logits_scaling), which the other side "
    "applies after its head in no module: the logits are compared before them, as {raw}"
)
SCALE_REASON = (
    "a scale factor applied between modules: one side's embedding scales its output inside "
    "itself ({scaled}), the other after its embedding module; compared where both hold the "
    "scaled value (the first layer's input, dumped with --inputs)"
)


def _bare(qualname: str) -> str:
    return qualname.rsplit(".", 1)[-1]


def _is(kind: str, qualname: str | None) -> bool:
    return bool(qualname) and re.search(ENGINE_CLASSES[kind], _bare(qualname or "")) is not None


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def _esc(name: str) -> str:
    return re.escape(name)


# ------------------------------------------------------------------ what each module holds


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
                name = _parent(name)
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


def tensor_parallel_joins(
    records: list[Correspondence], classes: Mapping[str, str]
) -> tuple[UnshardRule, ...]:
    """How each of a tensor-parallel engine's outputs is put back together from its ranks, from the
    loads each rank recorded (no ``--unshard`` rule): a column-parallel output (its weight rows a
    slice of their sources) gathered along its last dim in the checkpoint's order, the attention
    op's and an ``*AndMul``'s per-rank slices concatenated by rank, the logits taken from rank 0
    (gathered there); everything else (row-parallel outputs, reduced; norms) is replicated.
    One rank: only the outputs whose rows a model's ``load_weights`` reordered (a fused
    ``query_key_value`` interleaved per head) are gathered, back in the checkpoint's row order."""
    if not records:
        return ()
    if len(records) < 2:
        return _reordered(records[0], classes)
    per_rank = [engine_holdings(r) for r in records]
    rules: list[UnshardRule] = []
    for module, pieces0 in per_rank[0].pieces.items():
        if (
            module in per_rank[0].experts
            or all(p.whole for p in pieces0)
            or _is("embedding", classes.get(module))
        ):
            continue  # an embedding's rows are the vocabulary, not its output: vLLM all-reduces it
        if any(load.cols is not None for load in records[0].loads if load.module == module):
            continue  # row-parallel: its output is reduced across the ranks
        order = list(dict.fromkeys(p.source for p in pieces0))
        gathered: list[tuple[int, int, int]] = []
        for source in order:
            found = sorted(
                (p.source_row, rank, p.start, p.count)
                for rank, held in enumerate(per_rank)
                for p in held.pieces.get(module, [])
                if p.source == source
            )
            gathered += [(rank, start, start + count) for _, rank, start, count in found]
        pattern = re.compile(rf"^{re.escape(module)}(\[0\])?$")
        rules.append(UnshardRule(pattern, "gather", -1, tuple(gathered)))
    for module, qualname in classes.items():
        if _is("attention", qualname) or _is("act_and_mul", qualname):
            rules.append(UnshardRule(re.compile(rf"^{re.escape(module)}$"), "cat", -1))
        elif _is("logits", qualname):  # the processor's output and its recorded head output
            rules.append(
                UnshardRule(re.compile(rf"^{re.escape(module)}({re.escape(RAW_LOGITS)})?$"), "first")
            )
    return tuple(rules)


def _reordered(record: Correspondence, classes: Mapping[str, str]) -> tuple[UnshardRule, ...]:
    """The one-rank outputs to put back in the checkpoint's row order: a module whose weight rows
    from one source were written in another order than the source's (the load record's ``rows``
    runs, matched against the tensor as read), gathered source by source in source-row order."""
    held = engine_holdings(record)
    rules: list[UnshardRule] = []
    for module, pieces in held.pieces.items():
        if module in held.experts or _is("embedding", classes.get(module)):
            continue
        by_source: dict[str, list[Piece]] = {}
        for piece in pieces:
            by_source.setdefault(piece.source, []).append(piece)
        in_order = all(
            [p.source_row for p in sorted(group, key=lambda p: p.start)]
            == sorted(p.source_row for p in group)
            for group in by_source.values()
        )
        if in_order:
            continue
        gathered = tuple(
            (0, p.start, p.start + p.count)
            for group in by_source.values()
            for p in sorted(group, key=lambda p: p.source_row)
        )
        # the engine's linear layers return (out, bias): only its [0] is reordered, never the other
        # side's tensor of the same module name (an unshard rule knows no side)
        pattern = re.compile(rf"^{re.escape(module)}\[0\]$")
        rules.append(UnshardRule(pattern, "gather", -1, gathered))
    return tuple(rules)


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
    Linear's zero bias beside its unique weight), else left to :func:`pair_modules`' structure."""
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
        homes = {_parent(s) for s in out.direct.get(module, ())}
        for param, found in params:
            leaf = param.rpartition(".")[2]
            mine = [s for s in found if _parent(s) in homes and s.rpartition(".")[2] == leaf]
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


# ------------------------------------------------------------------ pairing


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


def _ancestors(name: str) -> list[str]:
    """``a.b.c`` -> ``["a.b", "a", ""]``: every module above, nearest first, the root last."""
    out = []
    while name:
        name = _parent(name)
        out.append(name)
    return out


def _under(name: str, top: str) -> bool:
    return not top or name == top or name.startswith(top + ".")


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
        home = next((p for p in _ancestors(module) if p in boxes_paired), "")
        there = boxes_paired[home]
        kept = []
        for candidate in candidates:
            if candidate in taken or not _under(candidate, there):
                continue
            boxes = [p for p in _ancestors(candidate) if p in reverse and _under(p, there) and p != there]
            if all(_under(module, reverse[p]) for p in boxes):
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


# ------------------------------------------------------------------ rules


def _rule(op: str, match: str, **keys: Any) -> dict[str, Any]:
    return {"op": op, "match": match, **keys}


def synthesise_rules(
    pairing: Pairing,
    engine: Holdings,
    other: Holdings,
    classes_engine: Mapping[str, str],
    classes_other: Mapping[str, str],
    *,
    weightless: bool = True,
    observed: Observed | None = None,
) -> list[dict[str, Any]]:
    """The rules of the derived bridge (engine side "a"), in the order they are tried; the
    engine-wide rules for weightless parts only when side "a" is an engine that recorded its load
    (two plain runs pair by their weights alone, the rest by name). ``observed``: the two runs'
    values, where the conventions are measured (:mod:`.conventions`); without them (a bridge
    built from the records alone) a ``(hidden, residual)`` container compares their sum."""
    rules: list[dict[str, Any]] = []
    split_id = "fused, split at the load's offsets"
    for module, counterpart in pairing.leaves.items():
        m, c = _esc(module), counterpart
        leaf_id = PLACED_ID if module in pairing.placed else SAME_WEIGHTS_ID
        if _is("scaled", classes_engine.get(module)) != _is("scaled", classes_other.get(counterpart)):
            rules.extend(_scaled(module, counterpart, pairing, classes_engine, classes_other))
            continue
        if _is("norm", classes_engine.get(module)):  # a fused add + norm: (normed, input + residual)
            rules.append(_rule("rename", m + r"\[1\]", b=c + "@in[0]", id="add + norm residual"))
            rules.append(_rule("skip", m + r"\[1\]", reason=RESIDUAL_REASON, id="add + norm residual"))
        role = _leaf_role(module, counterpart, observed)
        if role is not None:  # a tuple whose element holding A's output is not the first
            rules.append(_rule("rename", m + r"\[0\]", b=role, id="same weights, output by its role"))
        rules.append(_rule("unwrap", m, b=c, index=0, id=leaf_id))
        rules.append(_rule("rename", m, b=c, id=leaf_id))
        rules.append(_rule("rename", m + r"\[0\]", b=c + "[0]", id=leaf_id))
        rules.append(
            _rule("skip", _esc(c) + r"\[[1-9]\d*\]", side="b", reason=EXTRA_REASON, id="extra output")
        )
    for module, pieces in pairing.splits.items():
        m = _esc(module)
        rules.append(_rule("split", m + r"\[0\]", b=pieces, dim=-1, id=split_id))
        rules.append(_rule("split", m, b=pieces, dim=-1, id=split_id))
    differ = _differences(pairing, observed)
    for module, counterpart in pairing.containers.items():
        rules.extend(_container(module, counterpart, observed, differ.get(module)))
    if observed is not None:
        rules.extend(_not_copies(observed, classes_engine, classes_other))
        rules.extend(_returned_children(pairing, observed))
    if weightless:
        rules.extend(_weightless(pairing, engine, other, classes_engine, classes_other, observed))
    rules.extend(_structure_rules(pairing))
    return rules


@dataclass(frozen=True)
class Observed:
    """Both runs' values (their first pass), read to measure what the records cannot say
    (:mod:`.conventions`); a side is None when its dump holds no values (stats)."""

    a: SideValues | None
    b: SideValues | None

    def output_of(self, module: str) -> Told:
        """Which of the engine container's ``(hidden, residual)`` is its output, from the run."""
        if self.a is None:
            return Told(SUM, "no values to read")
        return tuple_output(self.a, module)


def _differences(pairing: Pairing, observed: Observed | None) -> dict[str, str]:
    """Engine container -> why it and its counterpart compute different quantities (measured:
    :func:`_adds_differently`), innermost first: a container whose last children differ so tells
    nothing of its own output (Bloom's decoder layer, whose MLP pair differs, adds the residual
    on both sides)."""
    found: dict[str, str] = {}
    for module in sorted(pairing.containers, key=lambda m: -m.count(".")):
        why = _adds_differently(module, pairing.containers[module], pairing, observed, found)
        if why is not None:
            found[module] = why
    return found


def _container(
    module: str, counterpart: str, observed: Observed | None, differs: str | None
) -> list[dict[str, Any]]:
    """The rules of one container pair: its output read as the run says (``hidden + residual``
    or ``hidden``), listed with the reason where the run does not tell, or where the two return
    different quantities (one adds the residual to its last child's output, the other not)."""
    m, c = _esc(module), counterpart
    box_id = "same weights below"
    rules: list[dict[str, Any]] = []
    told = observed.output_of(module) if observed is not None else Told(SUM, "no values to read")
    if differs is not None:
        rules.append(_rule("skip", m + r"(\[\d+\])?", reason=differs, id="not comparable"))
        rules.append(_rule("skip", _esc(c) + r"(\[\w+\])?", side="b", reason=differs, id="not comparable"))
        return rules
    if told.what == SUM:
        tuple_a = ["{0}", module + "[1]"]
        rules.append(_rule("sum", m + r"\[0\]", a=tuple_a, b=c, id="(hidden, residual)"))
        rules.append(_rule("sum", m + r"\[0\]", a=tuple_a, b=c + "[0]", id="(hidden, residual)"))
    elif told.what == FIRST:
        for target in (c, c + "[0]", c + "[last_hidden_state]"):
            rules.append(_rule("rename", m + r"\[0\]", b=target, id="hidden, as the run consumes it"))
        rules.append(_rule("skip", m + r"\[1\]", reason=RESIDUAL_PASSED.format(why=told.why), id="residual"))
    elif observed is not None and observed.a is not None and module + "[0]" in observed.a.index:
        reason = UNTOLD_REASON.format(why=told.why)
        rules.append(_rule("skip", m + r"\[[01]\]", a=["{0}", module + "[1]"], reason=reason, id="not told"))
        for target in (c, c + "[0]"):
            rules.append(_rule("skip", _esc(target), side="b", reason=reason, id="not told"))
    for target in (c, c + "[0]", c + "[last_hidden_state]"):
        rules.append(_rule("rename", m, b=target, id=box_id))
    rules.append(_rule("skip", _esc(c) + r"\[[1-9]\d*\]", side="b", reason=EXTRA_REASON, id="extra output"))
    return rules


def _adds_differently(
    module: str, counterpart: str, pairing: Pairing, observed: Observed | None, differ: Mapping[str, str]
) -> str | None:
    """Why the pair computes different quantities, measured: both containers end with a pair of
    children computing the same thing, and one returns that child's output as it is while the
    other adds something (the residual, inside HF's Bloom attention and MLP); None when they agree
    or the run does not show."""
    if observed is None or observed.a is None or observed.b is None:
        return None
    a, b = observed.a, observed.b
    told = observed.output_of(module)
    output = None
    if told.what == SUM and module + "[1]" in a.index:
        hidden, residual = a.value(module + "[0]"), a.value(module + "[1]")
        output = hidden + residual if hidden is not None and residual is not None else None
    mine, theirs = returns_last_child(a, module, output), returns_last_child(b, counterpart)
    if mine.what is None or theirs.what is None or mine.what == theirs.what:
        return None
    child_a, child_b = (_module_of(mine.why), _module_of(theirs.why))
    paired = {**pairing.leaves, **pairing.containers}
    split_first = {m: pieces[0] for m, pieces in pairing.splits.items()}
    if paired.get(child_a, split_first.get(child_a)) != child_b or child_a in differ:
        return None
    adds, plain = ("B", "A") if mine.what else ("A", "B")
    return ADDS_REASON.format(adds=adds, plain=plain, child_a=child_a, child_b=child_b)


def _module_of(name: str) -> str:
    key = _key(name)
    return key.module if key is not None else name


def _key(name: str) -> Key | None:
    try:
        return Key.parse(name)
    except ValueError:
        return None


def _leaf_role(module: str, counterpart: str, observed: Observed | None) -> str | None:
    """The other side's output element that holds what the engine leaf's ``[0]`` holds, where it
    is not the first: the one element of its dtype kind and last dim (a router returning
    ``(ids, weights, logits)``); None when it is the first, or the runs do not tell."""
    if observed is None or observed.a is None or observed.b is None or module + "[0]" not in observed.a.index:
        return None
    name = module + "[0]"
    shape = observed.a.shapes.get(name)
    if not shape or len(observed.b.outputs(counterpart)) < 2:
        return None
    integer = observed.a.dtypes.get(name, "").startswith(("int", "uint"))
    found = tuple_roles(observed.b, counterpart, {"out": (integer, shape[-1])}).get("out")
    return found if found is not None and found != counterpart + "[0]" else None


def _returned_children(pairing: Pairing, observed: Observed) -> list[dict[str, Any]]:
    """A container of the other side paired with nothing that returns its last child's output as
    it is (measured: HF's shared expert returns its ``down_proj``'s output, where the engine's
    counterpart also applies the expert's gate): compared as that child, against the child's
    counterpart."""
    if observed.a is None or observed.b is None:
        return []
    a, b = observed.a, observed.b
    counterpart_of = {theirs: mine for mine, theirs in pairing.leaves.items()}
    paired = set(pairing.containers.values()) | set(pairing.leaves.values())
    rules: list[dict[str, Any]] = []
    containers = {k.module for k in b.keys if k is not None and not k.input}
    for module in sorted(containers - paired):
        own = b.output(module)
        told = returns_last_child(b, module)
        child = _module_of(told.why) if told.what is True else None
        mine = counterpart_of.get(child) if child is not None else None
        theirs_child = b.output(child) if child is not None else None
        if own is None or mine is None or theirs_child is None or a.output(mine) is None:
            continue
        rules.append(
            _rule(
                "rename",
                _esc(own),
                side="b",
                a=[a.output(mine)],
                reason=RETURNS_REASON.format(child=child),
                id="returns its last child",
            )
        )
    return rules


def _not_copies(
    observed: Observed, classes_engine: Mapping[str, str], classes_other: Mapping[str, str]
) -> list[dict[str, Any]]:
    """Identity-class modules (``Dropout``) whose output is not the tensor recorded before them
    (the attention probabilities' dropout, after a projection whose output they are not): listed
    with the reason, never taken for a copy of that tensor."""
    rules: list[dict[str, Any]] = []
    for side, values, classes in (("a", observed.a, classes_engine), ("b", observed.b, classes_other)):
        if values is None:
            continue
        for module, qualname in classes.items():
            if IDENTITY.fullmatch(_bare(qualname)) and copies_previous(values, module) is False:
                rules.append(
                    _rule("skip", _esc(module), side=side, reason=NOT_A_COPY_REASON, id="not a copy")
                )
    return rules


SAME_WEIGHTS_ID = "same weights"
PLACED_ID = "shared weights, placed by structure"
STRUCTURE_ID = "weightless, placed by structure"
UNHELD_ID = "weights held nowhere else, placed by structure"
UNHELD_NOTE = (
    "weights: its parameters hold values no module of {other} holds (loaded scaled, transposed, other)"
)
AMBIGUOUS_REASON = (
    "ambiguous: its parameters hold values that {count} modules of the other side hold ({names}), "
    'and no structure tells which one it is (docs/comparator.md, "How two runs are paired")'
)


def _structure_rules(pairing: Pairing) -> list[dict[str, Any]]:
    """Weightless modules paired by their place (their outputs, each tuple element against the
    same element), and the ambiguous leaves listed with their candidates."""
    rules: list[dict[str, Any]] = []
    for module, counterpart in pairing.weightless.items():
        m, c = _esc(module), counterpart
        rules.append(_rule("rename", m, b=c, id=STRUCTURE_ID))
        rules.append(_rule("rename", m + r"\[(\d+)\]", b=c + "[{1}]", id=STRUCTURE_ID))
    for module, counterpart in pairing.unheld.items():
        m, c = _esc(module), counterpart
        for target in (c, c + "[0]", c + "[last_hidden_state]"):
            rules.append(_rule("rename", m, b=target, id=UNHELD_ID))
        rules.append(_rule("rename", m + r"\[(\d+)\]", b=c + "[{1}]", id=UNHELD_ID))
    for module, candidates in pairing.ambiguous.items():
        more = f", ... {len(candidates) - 4} more" if len(candidates) > 4 else ""
        shown = ", ".join(candidates[:4]) + more
        reason = AMBIGUOUS_REASON.format(count=len(candidates), names=shown)
        rules.append(_rule("skip", _esc(module) + r"(\[\w+\])?(::call\d+)?", reason=reason, id="ambiguous"))
    return rules


def _weighted(held: Holdings) -> set[str]:
    """Every module holding parameters, and every module above one."""
    found: set[str] = set()
    for module in (*held.direct, *held.unresolved, *held.ambiguous, *held.experts):
        found.add(module)
        found.update(_ancestors(module))
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
        mine = [m for m in classes_engine if m and _parent(m) == home and m not in paired_e]
        theirs = [m for m in classes_other if m and _parent(m) == there and m not in paired_o]
        light = ([m for m in mine if m not in weighted_e], [m for m in theirs if m not in weighted_o])
        _zip_weightless(pairing, *light, classes_engine, classes_other)
        heavy = ([m for m in mine if m in weighted_e], [m for m in theirs if m in weighted_o])
        if not heavy[0] or len(heavy[0]) != len(heavy[1]):
            continue
        for module, counterpart in zip(*heavy, strict=True):
            leaf = not any(_parent(m) == module for m in classes_engine)
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
    for qualname in {_bare(classes_engine[m]) for m in mine}:
        one = [m for m in mine if _bare(classes_engine[m]) == qualname]
        two = [m for m in theirs if _bare(classes_other[m]) == qualname]
        if len(one) == len(two) == 1:
            pairing.weightless[one[0]] = two[0]


def _inside(pairing: Pairing, module: str, counterpart: str) -> bool:
    """Whether every module paired below ``module`` is paired below ``counterpart``, and back."""
    pairs = [*pairing.leaves.items(), *pairing.containers.items(), *pairing.named.items()]
    return all(_under(a, module) == _under(b, counterpart) for a, b in pairs)


def _weightless(
    pairing: Pairing,
    engine: Holdings,
    other: Holdings,
    classes_engine: Mapping[str, str],
    classes_other: Mapping[str, str],
    observed: Observed | None = None,
) -> list[dict[str, Any]]:
    rules: list[dict[str, Any]] = []
    fused = _fused_experts(engine, other, pairing)
    for top, counterpart in fused.items():  # the routed experts' weighted sum, on both sides
        differs = _experts_differ(top, counterpart, observed)
        if differs is not None:
            rules.append(_rule("skip", _esc(top) + r"(\[\d+\])?", reason=differs, id="fused experts"))
            rules.append(
                _rule("skip", _esc(counterpart) + r"(\[\w+\])?", side="b", reason=differs, id="fused experts")
            )
            continue
        rules.append(_rule("rename", _esc(top), b=counterpart, id="fused experts"))
        rules.append(_rule("unwrap", _esc(top), b=counterpart, index=0, id="fused experts"))
    homes = _homes(engine, pairing)
    inside = {top for _, top in homes.values()}
    paired_parents = {_parent(m) for m in [*pairing.leaves, *pairing.splits]}
    rules.extend(_routing(pairing, inside, observed))
    for module, qualname in classes_engine.items():
        m = _esc(module)
        if module in pairing.leaves:
            continue  # a module the experts runner holds but that has weights of its own (the router)
        runs_alone = _parent(module) in paired_parents  # a shared expert the runner calls as a module
        if module in engine.experts or (
            not runs_alone and any(module.startswith(t + ".") or module == t for t in inside)
        ):
            rules.append(_rule("skip", m + r"(\[\d+\])?", reason=EXPERTS_REASON, id="fused experts"))
        elif _is("rotary", qualname):
            rules.append(
                _rule("skip", m + r"(\..*)?(\[\d+\])?(::call\d+)?", reason=ROTARY_REASON, id="rotary")
            )
        elif _is("logits", qualname):
            rules.extend(_logits(module, pairing, engine, other, classes_engine))
        elif _is("attention", qualname):
            consumer = _consumer(module, pairing, classes_engine)
            if consumer is not None:
                rules.append(_rule("rename", m, b=consumer + "@in[0]", id="attention op"))
            rules.append(_rule("skip", m, reason=ATTENTION_REASON, id="attention op"))
        elif _is("act_and_mul", qualname):
            rules.extend(_act_and_mul(module, pairing, classes_engine, classes_other))
    rules.extend(_same_place(pairing, engine, classes_engine, classes_other))
    experts_other = _other_experts(pairing, engine, other)
    for module, qualname in classes_other.items():
        m = _esc(module)
        if _is("rotary", qualname):
            rules.append(
                _rule("skip", m + r"(\[\w+\])?(::call\d+)?", side="b", reason=ROTARY_REASON, id="rotary")
            )
        elif module not in fused.values() and any(
            module == e or module.startswith(e + ".") for e in experts_other
        ):
            rules.append(
                _rule("skip", m + r"(\[\w+\])?", side="b", reason=EXPERTS_REASON, id="fused experts")
            )
    return rules


def _same_place(
    pairing: Pairing, engine: Holdings, classes_engine: Mapping[str, str], classes_other: Mapping[str, str]
) -> list[dict[str, Any]]:
    """A weightless module (an activation) of one name on both sides, inside a container paired
    with the same-named container: compared whatever the two classes (vLLM's ``GELU`` against HF's
    ``GELUActivation``): its place between paired neighbours is the evidence. Tried after the
    engine-wide rules (rotary, ``*AndMul``, the attention op), which know better."""
    rules: list[dict[str, Any]] = []
    for module in classes_engine:
        parent = _parent(module)
        if (
            module in engine.direct
            or module not in classes_other
            or not parent
            or pairing.containers.get(parent) != parent
            or any(_parent(m) == module for m in classes_engine)  # a container: paired by weights
        ):
            continue
        rules.append(_rule("rename", _esc(module), b=module, id="no weights, same place"))
    return rules


def _homes(engine: Holdings, pairing: Pairing) -> dict[str, tuple[str, str]]:
    """Each engine module loaded per expert -> (its nearest paired ancestor, that ancestor's child
    on the way down: the fused experts module whose output is the routed experts' sum)."""
    out = {}
    for module in engine.experts:
        below, name = module, _parent(module)
        while name and name not in pairing.containers:
            below, name = name, _parent(name)
        if name in pairing.containers:
            out[module] = (name, below)
    return out


def _router_roles(block: str, router: str, observed: Observed | None) -> dict[str, str] | None:
    """Which of the other side's router outputs holds the logits, the top-k weights, the top-k
    ids, read from the two runs (the engine's recorded routing tensors' dtypes and last dims
    against each router output's), never from their position; None without values to read (a
    bridge built from the records alone: HF 5's order ``(logits, weights, ids)``)."""
    if observed is None or observed.a is None or observed.b is None:
        return None
    wanted: dict[str, tuple[bool, int]] = {}
    for what in ROUTING_PATHS:
        name = routing_name(block, what)
        shape = observed.a.shapes.get(name)
        if shape:
            wanted[what] = (observed.a.dtypes.get(name, "").startswith(("int", "uint")), shape[-1])
    if wanted.get("logits") == wanted.get("topk_weights"):  # top-k of all experts: not told apart
        wanted.pop("logits", None)
        wanted.pop("topk_weights", None)
    return tuple_roles(observed.b, router, wanted)


def _routing(pairing: Pairing, tops: set[str], observed: Observed | None = None) -> list[dict[str, Any]]:
    """The routing an engine records beside its fused experts (``<block>.routing[logits |
    topk_weights | topk_ids]``, the vLLM plugin: :mod:`tracedump.integrations.vllm_records`)
    against the other side's router outputs ``(logits, top-k weights, top-k ids)`` (HF 5's
    ``MixtralTopKRouter``, ``Qwen3MoeTopKRouter``): the router is the counterpart of the engine's
    leaves in the block (the experts are none; the one named ``gate`` when there are several: a
    shared expert's).
    The top-k ids are compared as routing: a near-tie flip is told from a routing change by the
    logits beside them (docs/comparator.md). The recorded logits are the gate module's output:
    where that output was dumped, it is the one compared with the router's logits (each tensor of
    the other side once) and the record is listed with the reason; else the record is."""
    rules: list[dict[str, Any]] = []
    for top in sorted(tops):
        block = _parent(top)
        counterparts = {c for m, c in pairing.leaves.items() if m.startswith(block + ".")}
        if len(counterparts) > 1:
            counterparts = {c for c in counterparts if c.rpartition(".")[2] == "gate"}
        if len(counterparts) != 1:
            continue
        (router,) = counterparts
        gates = [m for m, c in pairing.leaves.items() if c == router and m.startswith(block + ".")]
        roles = _router_roles(block, router, observed)
        for index, what in enumerate(ROUTING_PATHS):
            target = f"{router}[{index}]" if roles is None else roles.get(what)
            if target is None:
                reason = ROLE_REASON.format(router=router, what=what)
                rules.append(_rule("skip", _esc(routing_name(block, what)), reason=reason, id="routing"))
                continue
            match = _esc(routing_name(block, what))
            if what == "logits":  # the gate module's output is these logits: compared once, as it
                for gate in gates:
                    for output in (gate + "[0]", gate):
                        reason = ROUTER_LOGITS_REASON.format(gate=output, router=router)
                        rules.append(_rule("skip", match, a=["{0}", output], reason=reason, id="routing"))
            rules.append(_rule("rename", match, b=target, id="routing (top-k)"))
    return rules


def _fused_experts(engine: Holdings, other: Holdings, pairing: Pairing) -> dict[str, str]:
    """The engine's fused experts module -> the other side's, where the other side fuses them too
    (one module of parameters of no known source under the counterpart block, HF's ``experts``):
    both output the weighted sum over the routed experts."""
    out = {}
    for home, top in _homes(engine, pairing).values():
        there = pairing.containers[home]
        candidates = [u for u in other.unresolved if _parent(u) == there]
        if len(candidates) == 1:
            out[top] = candidates[0]
    return out


def _experts_differ(top: str, counterpart: str, observed: Observed | None) -> str | None:
    """Why two fused experts modules return different quantities, measured: one is its block's
    whole output (vLLM's MoE runner, which adds the shared experts inside), the other is not (HF's
    ``experts``, the routed ones only, its block adding the shared expert after); None when the
    run does not show it or both agree."""
    if observed is None or observed.a is None or observed.b is None:
        return None
    told = []
    for values, module in ((observed.a, top), (observed.b, counterpart)):
        block, own = values.output(_parent(module)), values.output(module)
        if block is None or own is None:
            return None
        told.append(same(values, values.value(own), values.value(block), own))
    if told[0] == told[1]:
        return None
    whole, part = ("A", "B") if told[0] else ("B", "A")
    return EXPERTS_DIFFER_REASON.format(whole=whole, part=part)


def _other_experts(pairing: Pairing, engine: Holdings, other: Holdings) -> list[str]:
    """The other side's expert modules: those holding only the engine's per-expert checkpoint
    tensors, and those holding tensors of no known source inside the counterpart of a block of
    the engine's fused experts (HF's own fused ``experts``)."""
    expert_sources = set().union(*(engine.direct[m] for m in engine.experts)) if engine.experts else set()
    found = [m for m, sources in other.direct.items() if sources and sources <= expert_sources]
    homes = [pairing.containers[home] for home, _ in _homes(engine, pairing).values()]
    found += [u for u in other.unresolved if any(u.startswith(h + ".") for h in homes)]
    return found


def _scaled(
    module: str,
    counterpart: str,
    pairing: Pairing,
    classes_engine: Mapping[str, str],
    classes_other: Mapping[str, str],
) -> list[dict[str, Any]]:
    """An embedding one side scales inside itself and the other after it (Gemma's
    ``sqrt(hidden)``): the scaled side's output against the other's first norm input (where
    dumped); each unscaled output listed with the reason, never compared as if equal."""
    scaled = _bare(classes_other.get(counterpart) or classes_engine.get(module) or "")
    reason = SCALE_REASON.format(scaled=scaled)
    rules: list[dict[str, Any]] = []
    if _is("scaled", classes_other.get(counterpart)):
        names = list(classes_engine)
        after = names[names.index(module) + 1 :] if module in names else []
        first = next((m for m in after if m in pairing.leaves and _is("norm", classes_engine[m])), None)
        if first is not None:
            rules.append(_rule("rename", _esc(first + "@in[0]"), b=counterpart, id="scaled embedding"))
    rules.append(_rule("skip", _esc(module), reason=reason, id="scaled embedding"))
    rules.append(_rule("skip", _esc(counterpart), side="b", reason=reason, id="scaled embedding"))
    return rules


def _head(pairing: Pairing, engine: Holdings) -> str | None:
    """The counterpart of the engine's output head (the module named ``lm_head``, whose forward
    the engine replaces by its logits processor)."""
    for module, counterpart in pairing.leaves.items():
        if module.rpartition(".")[2] == "lm_head":
            return counterpart
    return None


def _logits(
    module: str, pairing: Pairing, engine: Holdings, other: Holdings, classes_engine: Mapping[str, str]
) -> list[dict[str, Any]]:
    """The logits: the head's output before the logits processor's soft cap and scale (recorded as
    ``<processor>[raw]``) against the other side's head module, the engine's ``lm_head`` or, where
    the engine computes a tied head with its embedding (vLLM's Gemma2), the other side's module
    holding the embedding's tensor. The processor's own output (after the cap) is listed with the
    reason where ``[raw]`` was recorded; a dump without it (made before) compares it with the
    head as before, where the engine has an ``lm_head``."""
    m, raw = _esc(module), module + RAW_LOGITS
    head = _head(pairing, engine)
    rules: list[dict[str, Any]] = []
    target = head or _tied_head(pairing, other, classes_engine)
    if target is not None:
        rules.append(_rule("rename", _esc(raw), b=target, id="logits"))
    # listed only when [raw] is there too (the rule needs both names; [raw] is recorded inside the
    # processor's forward, so it comes first and is paired before this rule claims it)
    rules.append(_rule("skip", m, a=["{0}", raw], reason=LOGITS_REASON.format(raw=raw), id="logits"))
    if head is not None:
        rules.append(_rule("rename", m, b=head, id="logits"))
    return rules


def _tied_head(pairing: Pairing, other: Holdings, classes_engine: Mapping[str, str]) -> str | None:
    """The other side's head where the engine keeps no head module (a tied head computed with the
    embedding): the one module, not paired, holding the same tensors as the embedding's
    counterpart."""
    paired = set(pairing.leaves.values())
    for module, counterpart in pairing.leaves.items():
        if not _is("embedding", classes_engine.get(module)):
            continue
        held = other.direct.get(counterpart)
        tied = [m for m, s in other.direct.items() if s == held and m != counterpart and m not in paired]
        if len(tied) == 1:
            return tied[0]
    return None


def _consumer(module: str, pairing: Pairing, classes_engine: Mapping[str, str]) -> str | None:
    """The counterpart of the module that consumes ``module``'s output: of its siblings paired
    whole, the last projection the model defines (``o_proj`` after ``qkv_proj``, ``down_proj``
    after ``gate_up_proj``: projections out are defined after projections in). Norms are no
    consumer: Qwen3's ``q_norm`` and ``k_norm``, defined after ``o_proj``, take q and k."""
    parent = _parent(module)
    siblings = [
        m
        for m in classes_engine
        if _parent(m) == parent and m in pairing.leaves and not _is("norm", classes_engine[m])
    ]
    return pairing.leaves[siblings[-1]] if siblings else None


def _act_and_mul(
    module: str, pairing: Pairing, classes_engine: Mapping[str, str], classes_other: Mapping[str, str]
) -> list[dict[str, Any]]:
    """``act(gate) * up``: the down projection's input where dumped, else the product of the other
    side's act module and up projection (the fused sibling's pieces, in row order)."""
    m = _esc(module)
    rules = []
    consumer = _consumer(module, pairing, classes_engine)
    if consumer is not None:
        rules.append(_rule("rename", m, b=consumer + "@in[0]", id="*AndMul"))
    parent = _parent(module)
    own = module.rpartition(".")[2]
    inputs = r"@in(\[.*\])?(::call\d+)?"
    rules.append(_rule("skip", m + inputs, reason=ACT_INPUT_REASON, id="*AndMul input"))
    there = pairing.containers.get(parent)
    for name, qualname in classes_other.items():  # the other side's act: its input is the gate's output
        if (
            there is not None
            and _parent(name) == there
            and (name.rpartition(".")[2] == own or "Activation" in _bare(qualname))
        ):
            rules.append(
                _rule("skip", _esc(name) + inputs, side="b", reason=ACT_INPUT_REASON, id="*AndMul input")
            )
    fused = [
        pieces for name, pieces in pairing.splits.items() if _parent(name) == parent and len(pieces) == 2
    ]
    if len(fused) == 1:
        gate, up = fused[0]
        acts = [
            name
            for name, qualname in classes_other.items()
            if _parent(name) == _parent(gate)
            and (name.rpartition(".")[2] == own or "Activation" in _bare(qualname))
        ]
        if acts:
            rules.append(_rule("product", m, b=[acts[0], up], id="*AndMul"))
    rules.append(_rule("skip", m, reason=ACT_REASON, id="*AndMul"))
    return rules


# ------------------------------------------------------------------ the bridge


def derive_bridge(
    a: Correspondence,
    b: Correspondence,
    *,
    framework_a: str,
    framework_b: str,
    classes_a: Mapping[str, str],
    classes_b: Mapping[str, str],
    ranks_a: list[Correspondence] | None = None,
    ranks_b: list[Correspondence] | None = None,
    ran: tuple[Mapping[str, int], Mapping[str, int]] = ({}, {}),
    values_a: SideValues | None = None,
    values_b: SideValues | None = None,
) -> Bridge | None:
    """The bridge of two runs' records, or None when nothing pairs, or when both name their
    parameters alike (two runs of one engine, two HF runs: paired by name, as always).
    A is the engine side when both recorded one. Two runs without a load whose parameter names
    differ (a port that renamed HF's modules) pair by the values their parameters hold."""
    if set(a.parameters) == set(b.parameters) and bool(a.loads) == bool(b.loads):
        # one tree on both sides (two runs of one engine, two HF runs): paired by name. An engine
        # against HF can name its parameters as the checkpoint does (vLLM's Phi3: qkv_proj and
        # gate_up_proj are fused in both) and still differ in every class: derived all the same.
        return None
    if a.loads:
        engine, other, classes_e, classes_o, swap = a, b, classes_a, classes_b, False
    elif b.loads:
        engine, other, classes_e, classes_o, swap = b, a, classes_b, classes_a, True
    elif set(a.parameters) != set(b.parameters) and a.parameters and b.parameters:
        engine, other, classes_e, classes_o, swap = a, b, classes_a, classes_b, False
    else:
        return None
    if engine.loads:
        ranks = (ranks_b if swap else ranks_a) or [engine]
        held_engine = merged_holdings(ranks)
        held_other = engine_holdings(other) if other.loads else plain_holdings(other, engine.sources)
    else:  # both plain: B's parameters are the checkpoint both hold
        sources = {name: meta for name, meta in other.parameters.items() if "same_as" not in meta}
        held_engine, held_other = plain_holdings(engine, sources), plain_holdings(other, sources)
    order_e, order_o = ({m: i for i, m in enumerate(c)} for c in (classes_e, classes_o))
    ran_e, ran_o = ran[::-1] if swap else ran
    named = frozenset() if engine.loads else frozenset(classes_e.keys() & classes_o.keys())
    pairing = pair_modules(held_engine, held_other, order_e, order_o, named, (ran_e, ran_o))
    if not (pairing.leaves or pairing.splits):
        return None
    if not engine.loads:  # two plain runs: the rest by its place (an engine's weightless: its rules)
        shapes = (_shapes(engine), _shapes(other))
        pair_by_place(pairing, held_engine, held_other, classes_e, classes_o, shapes)
    observed = Observed(values_b, values_a) if swap else Observed(values_a, values_b)
    rules = synthesise_rules(
        pairing,
        held_engine,
        held_other,
        classes_e,
        classes_o,
        weightless=bool(engine.loads),
        observed=observed if (observed.a or observed.b) else None,
    )
    kinds = [_paired_by(str(rule.get("id", "")), loaded=bool(engine.loads)) for rule in rules]
    fw_e, fw_o = (framework_b, framework_a) if swap else (framework_a, framework_b)
    data = {
        "bridge": {
            "name": DERIVED_NAME,
            "description": "modules paired by the checkpoint tensors they hold (correspondence.json)",
            "a": fw_e,
            "b": fw_o,
        },
        "rule": rules,
    }
    modules = [*pairing.leaves.items(), *pairing.containers.items()]
    modules += [*pairing.weightless.items(), *pairing.unheld.items()]
    modules += [(module, pieces[0]) for module, pieces in pairing.splits.items()]  # one input, stacked rows
    parsed = parse_bridge(data, "correspondence.json")
    bridge = replace(
        parsed,
        rules=tuple(replace(rule, paired_by=kind) for rule, kind in zip(parsed.rules, kinds, strict=True)),
        modules=tuple(modules),
        ambiguous=tuple(("B" if swap else "A", m, tuple(c)) for m, c in pairing.ambiguous.items()),
        notes=tuple(
            ("B" if swap else "A", m, UNHELD_NOTE.format(other="A" if swap else "B")) for m in pairing.unheld
        ),
    )
    return bridge.swapped() if swap else bridge


def _shapes(record: Correspondence) -> dict[str, list[Any]]:
    """Module -> the shapes of the parameters it holds directly."""
    out: dict[str, list[Any]] = {}
    for name, meta in record.parameters.items():
        out.setdefault(name.rpartition(".")[0], []).append(list(meta.get("shape") or []))
    return out


# the rules that pair by the tensors each side holds: proven by the load where one was recorded,
# else by the parameters' values
_HELD_IDS = frozenset({SAME_WEIGHTS_ID, "fused, split at the load's offsets", "same weights below",
                       "(hidden, residual)", "hidden, as the run consumes it",
                       "same weights, output by its role", "extra output"})  # fmt: skip
# Pairs proven by a place the run shows: among proven pairs, or measured (a container returning
# its last child's output as it is).
_PLACE_IDS = frozenset({PLACED_ID, STRUCTURE_ID, UNHELD_ID, "ambiguous", "no weights, same place",
                        "returns its last child"})  # fmt: skip


def _paired_by(rule_id: str, *, loaded: bool) -> str:
    """How a derived rule's pairs are proven (``TensorResult.paired_by``): ``load`` or
    ``weights`` for what the two sides hold, ``structure`` for a place among proven pairs,
    ``rule`` for the engine-wide rules of weightless parts."""
    if rule_id in _HELD_IDS:
        return "load" if loaded else "weights"
    if rule_id in _PLACE_IDS:
        return "structure"
    return "rule"


# ------------------------------------------------------------------ what the weights say of a pair


def _firsts(record: Correspondence) -> dict[str, Mapping[str, Any]]:
    """Each parameter's own entry (a shared one's fingerprint is its first holder's)."""
    params = record.parameters
    return {name: params.get(str(meta.get("same_as")), meta) if "same_as" in meta else meta
            for name, meta in params.items()}  # fmt: skip


def weight_findings(a: Correspondence, b: Correspondence) -> dict[str, str]:
    """Module (of one name on both sides) -> what its recorded weights say against B's where they
    are not B's of that name: it holds another module's values (a loader that filled layer 1 from
    layer 2), B's scaled, B's transposed, or values of B's shape that B holds nowhere. Compared by
    fingerprint (:func:`~tracedump.store.correspondence.fingerprints_match`, which allows a dtype
    change); only for two runs that load no checkpoint themselves (an engine's load is its record)."""
    if a.loads or b.loads:
        return {}
    mine, theirs = _firsts(a), _firsts(b)
    by_print: dict[tuple[int, ...], list[tuple[str, list[float]]]] = {}
    for name, meta in theirs.items():
        by_print.setdefault(tuple(meta.get("shape") or ()), []).append(
            (name, list(meta.get("fingerprint") or []))
        )
    out: dict[str, str] = {}
    for param in mine.keys() & theirs.keys():
        finding = _weight_finding(param, mine[param], theirs[param], by_print)
        if finding is not None:
            module = param.rpartition(".")[0]
            out[module] = f"{out[module]}; {finding}" if module in out else finding
    return out


def _weight_finding(
    param: str,
    mine: Mapping[str, Any],
    theirs: Mapping[str, Any],
    by_print: Mapping[tuple[int, ...], list[tuple[str, list[float]]]],
) -> str | None:
    leaf = param.rpartition(".")[2]
    shape_a, shape_b = list(mine.get("shape") or []), list(theirs.get("shape") or [])
    if shape_a != shape_b:
        turned = len(shape_a) == 2 and shape_a == shape_b[::-1]
        return f"weights: {leaf} {shape_a} is B's {shape_b}" + (" transposed" if turned else "")
    fa, fb = list(mine.get("fingerprint") or []), list(theirs.get("fingerprint") or [])
    if not fa or not fb or fingerprints_match(fa, fb):
        return None
    holders = [n for n, f in by_print.get(tuple(shape_a), []) if n != param and fingerprints_match(fa, f)]
    if len(holders) == 1:
        holder = holders[0]
        named = holder.rpartition(".")[0] if holder.rpartition(".")[2] == leaf else holder
        return f"weights: holds {named}'s values"
    if holders:
        return f"weights: holds values {len(holders)} tensors of B hold ({', '.join(holders[:3])}, ...)"
    ratios = [x / y for x, y in zip(fa, fb, strict=True) if abs(y) > 1e-12]
    if ratios and len(ratios) == len(fa) and max(ratios) - min(ratios) <= 1e-3 * max(abs(r) for r in ratios):
        return f"weights: {leaf} is B's x{sum(ratios) / len(ratios):.4g}"
    return f"weights: {leaf} differs from B's (same shape)"


def weight_pairs(a: Correspondence, b: Correspondence) -> dict[str, str]:
    """A's module -> B's, for the modules whose parameters (or whose subtree's) hold values one
    module of B holds (unique fingerprints only): the evidence a ``--map`` rule is checked against."""
    if a.loads or b.loads:
        return {}
    sources = {name: meta for name, meta in b.parameters.items() if "same_as" not in meta}
    pairing = pair_modules(plain_holdings(a, sources), plain_holdings(b, sources))
    return {**pairing.leaves, **pairing.containers}
