"""Conventions read off the run (compare/pair/conventions.py): which of a decoder layer's
``(hidden, residual)`` is its output, whether a block adds something to its last child's output,
whether a dropout is a copy of the tensor before it: from what the same run's values say, never
from a family's name. The tensors are built here as each convention computes them (the vLLM
families of tests_vllm/ exercise the real engines)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tracedump.compare.pair.conventions import (
    FIRST,
    SUM,
    SideValues,
    copies_previous,
    returns_last_child,
    tuple_output,
    tuple_roles,
)


def _side(tensors: dict[str, np.ndarray], dtype: str = "float32") -> SideValues:
    return SideValues(list(tensors), lambda n: tensors[n].astype(np.float64), dict.fromkeys(tensors, dtype))


def _rand(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((5, 16)).astype(np.float32)


def test_a_deferred_residual_is_told_by_the_next_fused_add_norm() -> None:
    """Llama in vLLM: the next layer's fused add + norm returns ``hidden + residual``."""
    hidden, residual = _rand(0), _rand(1)
    side = _side({
        "layers.0.mlp": hidden,
        "layers.0[0]": hidden,
        "layers.0[1]": residual,
        "layers.1.input_layernorm[0]": _rand(2),
        "layers.1.input_layernorm[1]": (hidden + residual).astype(np.float32),
    })  # fmt: skip
    told = tuple_output(side, "layers.0")
    assert told.what == SUM and "layers.1.input_layernorm[1]" in told.why


def test_a_summed_hidden_is_told_by_a_consumer_taking_it_alone() -> None:
    """Cohere in vLLM: ``hidden`` already holds the residual; the next norm hands it on as is."""
    hidden, residual = _rand(0), _rand(1)
    side = _side({
        "layers.0[0]": hidden,
        "layers.0[1]": residual,
        "layers.1.input_layernorm[0]": _rand(2),
        "layers.1.input_layernorm[1]": hidden,
    })  # fmt: skip
    assert tuple_output(side, "layers.0").what == FIRST


def test_inputs_that_hand_the_pair_on_tell_nothing_the_consumer_inside_does() -> None:
    """With --inputs, the next layer takes hidden and residual apart: its fused norm adds them."""
    hidden, residual = _rand(0), _rand(1)
    side = _side({
        "layers.0[0]": hidden,
        "layers.0[1]": residual,
        "layers.1@in[1]": hidden,
        "layers.1@in[2]": residual,
        "layers.1.input_layernorm[1]": (hidden + residual).astype(np.float32),
    })  # fmt: skip
    assert tuple_output(side, "layers.0").what == SUM


def test_nothing_downstream_that_tells_is_unknown_with_the_reason() -> None:
    hidden, residual = _rand(0), _rand(1)
    side = _side({"layers.1[0]": hidden, "layers.1[1]": residual, "norm[0]": _rand(3), "norm[1]": residual})
    told = tuple_output(side, "layers.1")
    assert told.what is None and "nothing recorded after it" in told.why


def test_out_none_is_its_first_element() -> None:
    side = _side({"layers.0[0]": _rand(0), "layers.1[0]": _rand(1)})
    assert tuple_output(side, "layers.0").what == FIRST


def test_a_block_adding_the_residual_inside_is_measured() -> None:
    dense, residual = _rand(0), _rand(1)
    plain = _side({"attn.dense": dense, "attn": dense})
    adds = _side({"attn.dense": dense, "attn[0]": (dense + residual).astype(np.float32), "attn[1]": _rand(4)})
    assert returns_last_child(plain, "attn").what is True
    assert returns_last_child(adds, "attn").what is False


def test_a_dropout_after_a_tensor_of_another_shape_is_no_copy() -> None:
    qkv = _rand(0)
    probs = np.random.default_rng(5).random((4, 5, 5)).astype(np.float32)
    side = _side({"attn.qkv": qkv, "attn.attention_dropout": probs, "attn.dense": _rand(1), "drop": _rand(1)})
    assert copies_previous(side, "attn.attention_dropout") is False
    assert copies_previous(side, "drop") is True


def test_bf16_roundings_of_a_fused_add_still_match() -> None:
    """A fused add rounds its sum to the run's dtype: within a rounding of bf16, not exact."""
    hidden, residual = _rand(0), _rand(1)
    rounded = (hidden.astype(np.float64) + residual) * (1 + 2**-9)  # half a bf16 rounding off
    side = _side(
        {"layers.0[0]": hidden, "layers.0[1]": residual, "layers.1.norm[1]": rounded.astype(np.float32)},
        dtype="bfloat16",
    )
    assert tuple_output(side, "layers.0").what == SUM


def test_a_routers_outputs_are_told_apart_by_what_they_hold_not_their_position() -> None:
    """A router returning ``(ids, weights, logits)``: each role found by dtype and last dim."""
    ids = np.zeros((5, 2), dtype=np.int64)
    side = SideValues(
        ["gate[0]", "gate[1]", "gate[2]"],
        lambda n: None,
        {"gate[0]": "int64", "gate[1]": "float32", "gate[2]": "float32"},
        {"gate[0]": ids.shape, "gate[1]": (5, 2), "gate[2]": (5, 8)},
    )
    wanted = {"logits": (False, 8), "topk_weights": (False, 2), "topk_ids": (True, 2)}
    assert tuple_roles(side, "gate", wanted) == {
        "logits": "gate[2]",
        "topk_weights": "gate[1]",
        "topk_ids": "gate[0]",
    }
    # two float outputs of one width (top-k of every expert): neither is named
    side.shapes = {"gate[0]": (5, 8), "gate[1]": (5, 8), "gate[2]": (5, 8)}
    assert "logits" not in tuple_roles(side, "gate", wanted)


def test_a_grafted_run_is_never_read_for_conventions(tmp_path: Path) -> None:
    """A grafted run's layers each took the reference's inputs: no layer consumes the one before
    it, so its values would leave every ``(hidden, residual)`` untold. Its conventions come from
    the records alone (the sum), as for a stats dump; the same run dir ungrafted is read."""
    import torch

    import tracedump
    from tracedump.compare.pair.side_info import SideInfo, convention_values

    model = torch.nn.Sequential(torch.nn.Linear(4, 4)).eval()
    dumper = tracedump.attach(model, {"dir": str(tmp_path), "modules": "all"})
    assert dumper is not None
    with torch.no_grad():
        model(torch.ones(1, 4))
    dumper.close()
    (run_dir,) = tmp_path.glob("rank0_pid*")
    plain = SideInfo(framework="torch", root="Sequential", classes={}, run_dir=run_dir)
    assert isinstance(convention_values(plain), SideValues)  # the premise: the run is read
    grafted = SideInfo(framework="torch", root="Sequential", classes={}, run_dir=run_dir, grafted=True)
    assert convention_values(grafted) is None


def test_a_stats_dump_leaves_a_layers_tuple_untold_and_lists_it_with_the_reason() -> None:
    """A stats dump holds no value to read which of a layer's ``(hidden, residual)`` its next
    consumer took: its tuple outputs are listed with that reason, never compared as an assumed
    sum. A run read from its records alone (grafted) keeps the records' sum; the premise that
    the same container with values told is ``test_a_summed_hidden_is_told_...`` above."""
    from tracedump.compare.pair.conventions import Observed
    from tracedump.compare.pair.derive_rows import _container
    from tracedump.compare.pair.side_info import SideInfo, conventions_untold

    stats = SideInfo(framework="vllm", root="LlamaForCausalLM", classes={}, stats=True)
    why = conventions_untold(stats)
    assert why is not None and "statistics" in why
    grafted = SideInfo(framework="vllm", root="LlamaForCausalLM", classes={}, stats=True, grafted=True)
    assert conventions_untold(grafted) is None
    assert conventions_untold(SideInfo(framework="vllm", root="X", classes={})) is None

    layer, hf = "model.layers.0", "model.layers.0"
    rows = _container(layer, hf, Observed(None, None, why), None)
    assert not [r for r in rows if r.op == "sum"]  # no assumed sum
    untold = [r for r in rows if r.op == "skip" and why in r.reason]
    on_a = [r for r in untold if r.side == "a"]
    on_b = [r for r in untold if r.side == "b"]
    assert on_a and all(r.match.fullmatch(f"{layer}[0]") or r.match.fullmatch(f"{layer}[1]") for r in on_a)
    assert any(r.match.fullmatch(f"{layer}[0]") for r in on_a)
    assert {hf, hf + "[0]"} <= {name for r in on_b for name in (hf, hf + "[0]") if r.match.fullmatch(name)}

    records_alone = _container(layer, hf, Observed(None, None), None)
    assert [r for r in records_alone if r.op == "sum"]  # the grafted run's records-only rule
