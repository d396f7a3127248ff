"""The derived pairing table's rows (:class:`~.table.Rule`, built as data, never as rule text):
from a :class:`~.module_pairing.Pairing`, the rows of each leaf pair (unwrapped, by its role), each
fused leaf (split at the load's offsets), each container (its output read as the run says), the
modules placed by structure and the ambiguous ones; the engine-wide rows of weightless parts come
from :mod:`.derive_weightless`."""

from __future__ import annotations

from collections.abc import Mapping

from ...store.format import Key
from .conventions import FIRST, SUM, Observed, Told, copies_previous, returns_last_child, tuple_roles
from .derive_weightless import scaled_rows, weightless_rows
from .engine_classes import IDENTITY, bare, is_kind
from .holdings import Holdings
from .module_pairing import Pairing
from .reasons import (
    ADDS_REASON,
    AMBIGUOUS_REASON,
    EXTRA_REASON,
    NOT_A_COPY_REASON,
    PLACED_ID,
    RESIDUAL_PASSED,
    RESIDUAL_REASON,
    RETURNS_REASON,
    SAME_WEIGHTS_ID,
    STRUCTURE_ID,
    UNHELD_ID,
    UNTOLD_REASON,
)
from .table import Part, Rule, Tensors, row, skip_pair


def synthesise_rules(
    pairing: Pairing,
    engine: Holdings,
    other: Holdings,
    classes_engine: Mapping[str, str],
    classes_other: Mapping[str, str],
    *,
    weightless: bool = True,
    observed: Observed | None = None,
) -> list[Rule]:
    """The rules of the derived bridge (engine side "a"), in the order they are tried; the
    engine-wide rules for weightless parts only when side "a" is an engine that recorded its load
    (two plain runs pair by their weights alone, the rest by name). ``observed``: the two runs'
    values, where the conventions are measured (:mod:`.conventions`); without them (a bridge
    built from the records alone) a ``(hidden, residual)`` container compares their sum."""
    rules: list[Rule] = []
    split_id = "fused, split at the load's offsets"
    for module, counterpart in pairing.leaves.items():
        m, c = module, counterpart
        leaf_id = PLACED_ID if module in pairing.placed else SAME_WEIGHTS_ID
        if is_kind("scaled", classes_engine.get(module)) != is_kind("scaled", classes_other.get(counterpart)):
            rules.extend(scaled_rows(module, counterpart, pairing, classes_engine, classes_other))
            continue
        if is_kind("norm", classes_engine.get(module)):  # a fused add + norm: (normed, input + residual)
            rules.append(row("rename", Tensors(m, Part.SECOND), b=c + "@in[0]", id="add + norm residual"))
            rules.append(
                row("skip", Tensors(m, Part.SECOND), reason=RESIDUAL_REASON, id="add + norm residual")
            )
        role = _leaf_role(module, counterpart, observed)
        if role is not None:  # a tuple whose element holding A's output is not the first
            rules.append(row("rename", Tensors(m, Part.FIRST), b=role, id="same weights, output by its role"))
        rules.append(row("unwrap", Tensors(m), b=c, index=0, id=leaf_id))
        rules.append(row("rename", Tensors(m), b=c, id=leaf_id))
        rules.append(row("rename", Tensors(m, Part.FIRST), b=c + "[0]", id=leaf_id))
        rules.append(row("skip", Tensors(c, Part.LATER), side="b", reason=EXTRA_REASON, id="extra output"))
    for module, pieces in pairing.splits.items():
        m = module
        rules.append(row("split", Tensors(m, Part.FIRST), b=pieces, dim=-1, id=split_id))
        rules.append(row("split", Tensors(m), b=pieces, dim=-1, id=split_id))
    differ = _differences(pairing, observed)
    for module, counterpart in pairing.containers.items():
        rules.extend(_container(module, counterpart, observed, differ.get(module)))
    if observed is not None:
        rules.extend(_not_copies(observed, classes_engine, classes_other))
        rules.extend(_returned_children(pairing, observed))
    if weightless:
        rules.extend(weightless_rows(pairing, engine, other, classes_engine, classes_other, observed))
    rules.extend(_structure_rules(pairing))
    return rules


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


def _container(module: str, counterpart: str, observed: Observed | None, differs: str | None) -> list[Rule]:
    """The rules of one container pair: its output read as the run says (``hidden + residual``
    or ``hidden``), listed with the reason where the run does not tell, or where the two return
    different quantities (one adds the residual to its last child's output, the other not)."""
    m, c = module, counterpart
    box_id = "same weights below"
    rules: list[Rule] = []
    told = observed.output_of(module) if observed is not None else Told(SUM, "no values to read")
    if differs is not None:
        return skip_pair(m, c, reason=differs, id="not comparable")
    if told.what == SUM:
        tuple_a = ["{0}", module + "[1]"]
        rules.append(row("sum", Tensors(m, Part.FIRST), a=tuple_a, b=c, id="(hidden, residual)"))
        rules.append(row("sum", Tensors(m, Part.FIRST), a=tuple_a, b=c + "[0]", id="(hidden, residual)"))
    elif told.what == FIRST:
        for target in (c, c + "[0]", c + "[last_hidden_state]"):
            rules.append(row("rename", Tensors(m, Part.FIRST), b=target, id="hidden, as the run consumes it"))
        rules.append(
            row("skip", Tensors(m, Part.SECOND), reason=RESIDUAL_PASSED.format(why=told.why), id="residual")
        )
    elif observed is not None and (
        observed.untold if observed.a is None else module + "[0]" in observed.a.index
    ):
        reason = UNTOLD_REASON.format(why=told.why)
        rules.append(
            row("skip", Tensors(m, Part.FIRST_TWO), a=["{0}", module + "[1]"], reason=reason, id="not told")
        )
        for target in (c, c + "[0]"):
            rules.append(row("skip", Tensors(target), side="b", reason=reason, id="not told"))
    for target in (c, c + "[0]", c + "[last_hidden_state]"):
        rules.append(row("rename", Tensors(m), b=target, id=box_id))
    rules.append(row("skip", Tensors(c, Part.LATER), side="b", reason=EXTRA_REASON, id="extra output"))
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


def _returned_children(pairing: Pairing, observed: Observed) -> list[Rule]:
    """A container of the other side paired with nothing that returns its last child's output as
    it is (measured: HF's shared expert returns its ``down_proj``'s output, where the engine's
    counterpart also applies the expert's gate): compared as that child, against the child's
    counterpart."""
    if observed.a is None or observed.b is None:
        return []
    a, b = observed.a, observed.b
    counterpart_of = {theirs: mine for mine, theirs in pairing.leaves.items()}
    paired = set(pairing.containers.values()) | set(pairing.leaves.values())
    rules: list[Rule] = []
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
            row(
                "rename",
                Tensors(own),
                side="b",
                a=[a.output(mine)],
                reason=RETURNS_REASON.format(child=child),
                id="returns its last child",
            )
        )
    return rules


def _not_copies(
    observed: Observed, classes_engine: Mapping[str, str], classes_other: Mapping[str, str]
) -> list[Rule]:
    """Identity-class modules (``Dropout``) whose output is not the tensor recorded before them
    (the attention probabilities' dropout, after a projection whose output they are not): listed
    with the reason, never taken for a copy of that tensor."""
    rules: list[Rule] = []
    for side, values, classes in (("a", observed.a, classes_engine), ("b", observed.b, classes_other)):
        if values is None:
            continue
        for module, qualname in classes.items():
            if IDENTITY.fullmatch(bare(qualname)) and copies_previous(values, module) is False:
                rules.append(
                    row("skip", Tensors(module), side=side, reason=NOT_A_COPY_REASON, id="not a copy")
                )
    return rules


def _structure_rules(pairing: Pairing) -> list[Rule]:
    """Weightless modules paired by their place (their outputs, each tuple element against the
    same element), and the ambiguous leaves listed with their candidates."""
    rules: list[Rule] = []
    for module, counterpart in pairing.weightless.items():
        m, c = module, counterpart
        rules.append(row("rename", Tensors(m), b=c, id=STRUCTURE_ID))
        rules.append(row("rename", Tensors(m, Part.ELEMENT), b=c + "[{1}]", id=STRUCTURE_ID))
    for module, counterpart in pairing.unheld.items():
        m, c = module, counterpart
        for target in (c, c + "[0]", c + "[last_hidden_state]"):
            rules.append(row("rename", Tensors(m), b=target, id=UNHELD_ID))
        rules.append(row("rename", Tensors(m, Part.ELEMENT), b=c + "[{1}]", id=UNHELD_ID))
    for module, candidates in pairing.ambiguous.items():
        more = f", ... {len(candidates) - 4} more" if len(candidates) > 4 else ""
        shown = ", ".join(candidates[:4]) + more
        reason = AMBIGUOUS_REASON.format(count=len(candidates), names=shown)
        rules.append(row("skip", Tensors(module, Part.ANY_CALL), reason=reason, id="ambiguous"))
    return rules
