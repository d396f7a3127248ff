"""What a derived row says in words: the reasons a tensor is listed instead of compared, and the
evidence each row names (its ``id``), with the kind of proof each evidence is
(:func:`proven_by`: ``TensorResult.paired_by``)."""

from __future__ import annotations

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

# the rules that pair by the tensors each side holds: proven by the load where one was recorded,
# else by the parameters' values
_HELD_IDS = frozenset({SAME_WEIGHTS_ID, "fused, split at the load's offsets", "same weights below",
                       "(hidden, residual)", "hidden, as the run consumes it",
                       "same weights, output by its role", "extra output"})  # fmt: skip
# Pairs proven by a place the run shows: among proven pairs, or measured (a container returning
# its last child's output as it is).
_PLACE_IDS = frozenset({PLACED_ID, STRUCTURE_ID, UNHELD_ID, "ambiguous", "no weights, same place",
                        "returns its last child"})  # fmt: skip


def proven_by(rule_id: str, *, loaded: bool) -> str:
    """How a derived rule's pairs are proven (``TensorResult.paired_by``): ``load`` or
    ``weights`` for what the two sides hold, ``structure`` for a place among proven pairs,
    ``rule`` for the engine-wide rules of weightless parts."""
    if rule_id in _HELD_IDS:
        return "load" if loaded else "weights"
    if rule_id in _PLACE_IDS:
        return "structure"
    return "rule"
