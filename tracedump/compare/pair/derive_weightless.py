"""The derived table's engine-wide rows for weightless parts (never one per family): fused
experts and the routing recorded beside them, rotary embeddings, the logits processor, the
attention op, every ``*AndMul``, a weightless module of one name in a paired container, and an
embedding scaled inside itself on one side only."""

from __future__ import annotations

from collections.abc import Mapping

from ...store.correspondence import RAW_LOGITS, ROUTING_PATHS, routing_name
from .conventions import Observed, same, tuple_roles
from .engine_classes import bare, is_kind, parent
from .holdings import Holdings
from .module_pairing import Pairing
from .reasons import (
    ACT_INPUT_REASON,
    ACT_REASON,
    ATTENTION_REASON,
    EXPERTS_DIFFER_REASON,
    EXPERTS_REASON,
    LOGITS_REASON,
    ROLE_REASON,
    ROTARY_REASON,
    ROUTER_LOGITS_REASON,
    SCALE_REASON,
)
from .table import Part, Rule, Tensors, row, skip_pair


def weightless_rows(
    pairing: Pairing,
    engine: Holdings,
    other: Holdings,
    classes_engine: Mapping[str, str],
    classes_other: Mapping[str, str],
    observed: Observed | None = None,
) -> list[Rule]:
    """The rows of an engine's weightless parts, in the order they are tried."""
    rules: list[Rule] = []
    fused = _fused_experts(engine, other, pairing)
    for top, counterpart in fused.items():  # the routed experts' weighted sum, on both sides
        differs = _experts_differ(top, counterpart, observed)
        if differs is not None:
            rules.extend(skip_pair(top, counterpart, reason=differs, id="fused experts"))
            continue
        rules.append(row("rename", Tensors(top), b=counterpart, id="fused experts"))
        rules.append(row("unwrap", Tensors(top), b=counterpart, index=0, id="fused experts"))
    homes = _homes(engine, pairing)
    inside = {top for _, top in homes.values()}
    paired_parents = {parent(m) for m in [*pairing.leaves, *pairing.splits]}
    rules.extend(_routing(pairing, inside, observed))
    for module, qualname in classes_engine.items():
        m = module
        if module in pairing.leaves:
            continue  # a module the experts runner holds but that has weights of its own (the router)
        runs_alone = parent(module) in paired_parents  # a shared expert the runner calls as a module
        if module in engine.experts or (
            not runs_alone and any(module.startswith(t + ".") or module == t for t in inside)
        ):
            rules.append(
                row("skip", Tensors(m, Part.ITSELF_OR_ELEMENT), reason=EXPERTS_REASON, id="fused experts")
            )
        elif is_kind("rotary", qualname):
            rules.append(row("skip", Tensors(m, Part.SUBTREE), reason=ROTARY_REASON, id="rotary"))
        elif is_kind("logits", qualname):
            rules.extend(_logits(module, pairing, engine, other, classes_engine))
        elif is_kind("attention", qualname):
            consumer = _consumer(module, pairing, classes_engine)
            if consumer is not None:
                rules.append(row("rename", Tensors(m), b=consumer + "@in[0]", id="attention op"))
            rules.append(row("skip", Tensors(m), reason=ATTENTION_REASON, id="attention op"))
        elif is_kind("act_and_mul", qualname):
            rules.extend(_act_and_mul(module, pairing, classes_engine, classes_other))
    rules.extend(_same_place(pairing, engine, classes_engine, classes_other))
    experts_other = _other_experts(pairing, engine, other)
    for module, qualname in classes_other.items():
        m = module
        if is_kind("rotary", qualname):
            rules.append(row("skip", Tensors(m, Part.ANY_CALL), side="b", reason=ROTARY_REASON, id="rotary"))
        elif module not in fused.values() and any(
            module == e or module.startswith(e + ".") for e in experts_other
        ):
            rules.append(
                row(
                    "skip",
                    Tensors(m, Part.ITSELF_OR_FIELD),
                    side="b",
                    reason=EXPERTS_REASON,
                    id="fused experts",
                )
            )
    return rules


def _same_place(
    pairing: Pairing, engine: Holdings, classes_engine: Mapping[str, str], classes_other: Mapping[str, str]
) -> list[Rule]:
    """A weightless module (an activation) of one name on both sides, inside a container paired
    with the same-named container: compared whatever the two classes (vLLM's ``GELU`` against HF's
    ``GELUActivation``): its place between paired neighbours is the evidence. Tried after the
    engine-wide rules (rotary, ``*AndMul``, the attention op), which know better."""
    rules: list[Rule] = []
    for module in classes_engine:
        home = parent(module)
        if (
            module in engine.direct
            or module not in classes_other
            or not home
            or pairing.containers.get(home) != home
            or any(parent(m) == module for m in classes_engine)  # a container: paired by weights
        ):
            continue
        rules.append(row("rename", Tensors(module), b=module, id="no weights, same place"))
    return rules


def _homes(engine: Holdings, pairing: Pairing) -> dict[str, tuple[str, str]]:
    """Each engine module loaded per expert -> (its nearest paired ancestor, that ancestor's child
    on the way down: the fused experts module whose output is the routed experts' sum)."""
    out = {}
    for module in engine.experts:
        below, name = module, parent(module)
        while name and name not in pairing.containers:
            below, name = name, parent(name)
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


def _routing(pairing: Pairing, tops: set[str], observed: Observed | None = None) -> list[Rule]:
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
    rules: list[Rule] = []
    for top in sorted(tops):
        block = parent(top)
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
                rules.append(row("skip", Tensors(routing_name(block, what)), reason=reason, id="routing"))
                continue
            match = Tensors(routing_name(block, what))
            if what == "logits":  # the gate module's output is these logits: compared once, as it
                for gate in gates:
                    for output in (gate + "[0]", gate):
                        reason = ROUTER_LOGITS_REASON.format(gate=output, router=router)
                        rules.append(row("skip", match, a=["{0}", output], reason=reason, id="routing"))
            rules.append(row("rename", match, b=target, id="routing (top-k)"))
    return rules


def _fused_experts(engine: Holdings, other: Holdings, pairing: Pairing) -> dict[str, str]:
    """The engine's fused experts module -> the other side's, where the other side fuses them too
    (one module of parameters of no known source under the counterpart block, HF's ``experts``):
    both output the weighted sum over the routed experts."""
    out = {}
    for home, top in _homes(engine, pairing).values():
        there = pairing.containers[home]
        candidates = [u for u in other.unresolved if parent(u) == there]
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
        block, own = values.output(parent(module)), values.output(module)
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


def scaled_rows(
    module: str,
    counterpart: str,
    pairing: Pairing,
    classes_engine: Mapping[str, str],
    classes_other: Mapping[str, str],
) -> list[Rule]:
    """An embedding one side scales inside itself and the other after it (Gemma's
    ``sqrt(hidden)``): the scaled side's output against the other's first norm input (where
    dumped); each unscaled output listed with the reason, never compared as if equal."""
    scaled = bare(classes_other.get(counterpart) or classes_engine.get(module) or "")
    reason = SCALE_REASON.format(scaled=scaled)
    rules: list[Rule] = []
    if is_kind("scaled", classes_other.get(counterpart)):
        names = list(classes_engine)
        after = names[names.index(module) + 1 :] if module in names else []
        first = next((m for m in after if m in pairing.leaves and is_kind("norm", classes_engine[m])), None)
        if first is not None:
            rules.append(row("rename", Tensors(first + "@in[0]"), b=counterpart, id="scaled embedding"))
    rules.append(row("skip", Tensors(module), reason=reason, id="scaled embedding"))
    rules.append(row("skip", Tensors(counterpart), side="b", reason=reason, id="scaled embedding"))
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
) -> list[Rule]:
    """The logits: the head's output before the logits processor's soft cap and scale (recorded as
    ``<processor>[raw]``) against the other side's head module, the engine's ``lm_head`` or, where
    the engine computes a tied head with its embedding (vLLM's Gemma2), the other side's module
    holding the embedding's tensor. The processor's own output (after the cap) is listed with the
    reason where ``[raw]`` was recorded; a dump without it (made before) compares it with the
    head as before, where the engine has an ``lm_head``."""
    m, raw = module, module + RAW_LOGITS
    head = _head(pairing, engine)
    rules: list[Rule] = []
    target = head or _tied_head(pairing, other, classes_engine)
    if target is not None:
        rules.append(row("rename", Tensors(raw), b=target, id="logits"))
    # listed only when [raw] is there too (the rule needs both names; [raw] is recorded inside the
    # processor's forward, so it comes first and is paired before this rule claims it)
    rules.append(row("skip", Tensors(m), a=["{0}", raw], reason=LOGITS_REASON.format(raw=raw), id="logits"))
    if head is not None:
        rules.append(row("rename", Tensors(m), b=head, id="logits"))
    return rules


def _tied_head(pairing: Pairing, other: Holdings, classes_engine: Mapping[str, str]) -> str | None:
    """The other side's head where the engine keeps no head module (a tied head computed with the
    embedding): the one module, not paired, holding the same tensors as the embedding's
    counterpart."""
    paired = set(pairing.leaves.values())
    for module, counterpart in pairing.leaves.items():
        if not is_kind("embedding", classes_engine.get(module)):
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
    home = parent(module)
    siblings = [
        m
        for m in classes_engine
        if parent(m) == home and m in pairing.leaves and not is_kind("norm", classes_engine[m])
    ]
    return pairing.leaves[siblings[-1]] if siblings else None


def _act_and_mul(
    module: str, pairing: Pairing, classes_engine: Mapping[str, str], classes_other: Mapping[str, str]
) -> list[Rule]:
    """``act(gate) * up``: the down projection's input where dumped, else the product of the other
    side's act module and up projection (the fused sibling's pieces, in row order)."""
    m = module
    rules = []
    consumer = _consumer(module, pairing, classes_engine)
    if consumer is not None:
        rules.append(row("rename", Tensors(m), b=consumer + "@in[0]", id="*AndMul"))
    home = parent(module)
    own = module.rpartition(".")[2]
    rules.append(row("skip", Tensors(m, Part.INPUTS), reason=ACT_INPUT_REASON, id="*AndMul input"))
    there = pairing.containers.get(home)
    for name, qualname in classes_other.items():  # the other side's act: its input is the gate's output
        if (
            there is not None
            and parent(name) == there
            and (name.rpartition(".")[2] == own or "Activation" in bare(qualname))
        ):
            rules.append(
                row("skip", Tensors(name, Part.INPUTS), side="b", reason=ACT_INPUT_REASON, id="*AndMul input")
            )
    fused = [pieces for name, pieces in pairing.splits.items() if parent(name) == home and len(pieces) == 2]
    if len(fused) == 1:
        gate, up = fused[0]
        acts = [
            name
            for name, qualname in classes_other.items()
            if parent(name) == parent(gate)
            and (name.rpartition(".")[2] == own or "Activation" in bare(qualname))
        ]
        if acts:
            rules.append(row("product", Tensors(m), b=[acts[0], up], id="*AndMul"))
    rules.append(row("skip", Tensors(m), reason=ACT_REASON, id="*AndMul"))
    return rules
