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
- **weightless parts, engine-wide** (:data:`.engine_classes.ENGINE_CLASSES`): a fused add + norm's running
  residual against the other norm's input, every ``*AndMul`` against ``act(gate) * up``, the
  attention op against the output projection's input, rotary embeddings and fused experts listed
  as not comparable with the reason, the logits against the head's counterpart.

The result is a pairing table (:class:`~.table.Bridge`) whose rows are built as data, the type a
rule file is read into, so one matcher applies both, and the executor, the table's ``bridged``
column and the JSON are the same for either; ``--bridge FILE`` overrides it. It also carries the
module pairs (``Bridge.modules``: leaves, containers, a fused leaf with its first piece's module):
whose inputs pair, by what they hold (:mod:`.input_roles`).

The stages, each its own module: what each module holds (:mod:`.holdings`), the modules paired
(:mod:`.module_pairing`), their rows (:mod:`.derive_rows`, :mod:`.derive_weightless`), in the words
of :mod:`.reasons`; how a tensor-parallel side's ranks join (:mod:`.rank_joins`), and what the
weights say of a pair made by name (:mod:`.weight_evidence`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from ...store.correspondence import Correspondence
from .conventions import Observed, SideValues
from .derive_rows import synthesise_rules
from .holdings import engine_holdings, merged_holdings, plain_holdings
from .module_pairing import Pairing, pair_by_place, pair_modules
from .reasons import DERIVED_NAME, UNHELD_NOTE, proven_by
from .table import Bridge, numbered


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
    untold: tuple[str | None, str | None] = (None, None),
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
    untold_e = untold[1] if swap else untold[0]
    observed = Observed(values_b, values_a, untold_e) if swap else Observed(values_a, values_b, untold_e)
    rows = synthesise_rules(
        pairing,
        held_engine,
        held_other,
        classes_e,
        classes_o,
        weightless=bool(engine.loads),
        observed=observed if (observed.a or observed.b) else None,
    )
    loaded = bool(engine.loads)
    rules = numbered([replace(rule, paired_by=proven_by(rule.id, loaded=loaded)) for rule in rows])
    fw_e, fw_o = (framework_b, framework_a) if swap else (framework_a, framework_b)
    modules = [*pairing.leaves.items(), *pairing.containers.items()]
    modules += [*pairing.weightless.items(), *pairing.unheld.items()]
    modules += [(module, pieces[0]) for module, pieces in pairing.splits.items()]  # one input, stacked rows
    side, other_side = ("B", "A") if swap else ("A", "B")
    bridge = Bridge(
        name=DERIVED_NAME,
        source="correspondence.json",
        a=fw_e,
        b=fw_o,
        architectures=(),
        align=None,
        rules=rules,
        description="modules paired by the checkpoint tensors they hold (correspondence.json)",
        modules=tuple(modules),
        ambiguous=tuple((side, m, tuple(c)) for m, c in pairing.ambiguous.items()),
        notes=tuple((side, m, UNHELD_NOTE.format(other=other_side)) for m in pairing.unheld),
        proven=_proven(pairing),
    )
    return bridge.swapped() if swap else bridge


def _proven(pairing: Pairing) -> tuple[tuple[str, str], ...]:
    """The module pairs the held checkpoint tensors alone prove: leaves (not those several modules'
    shared values left to structure) and containers by their subtrees."""
    leaves = [(m, o) for m, o in pairing.leaves.items() if m not in pairing.placed]
    return (*leaves, *pairing.containers.items())


def _shapes(record: Correspondence) -> dict[str, list[Any]]:
    """Module -> the shapes of the parameters it holds directly."""
    out: dict[str, list[Any]] = {}
    for name, meta in record.parameters.items():
        out.setdefault(name.rpartition(".")[0], []).append(list(meta.get("shape") or []))
    return out
