"""Grafting a MoE family (Mixtral: 4 experts, top-2, its router's softmax in fp32) and an
encoder-decoder (T5, ``wo`` kept in fp32 inside bf16): bf16 grafted from fp32, no baseline.

Grafted expert calls follow the reference's routing: the experts module's inputs are the hidden
states *and* the reference's ``top_k_index`` / ``top_k_weights``, so at leaf level a near-tie flip
of a router changes nothing downstream, and at layer level each layer starts again from the
reference's own input. A near-tie is built (two experts with the same router row but for 1e-6),
and the premise checked in the dumps before the verdict.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import tracedump
from benchmarks.calibrate_graft import LEVELS, dump, family, planted
from tracedump.compare import compare
from tracedump.compare.judge.local import LocalResult

pytest.importorskip("transformers")


def _passes(path: Path) -> tracedump.PassFile:
    return tracedump.open_dump(path).run().passes[0]


def _local(report: object) -> list[LocalResult]:
    return [r for r in report.results if isinstance(r, LocalResult) and r.local]  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, Path]:
    fam = family("mixtral")
    return fam, dump(fam, "fp32-eager", tmp_path_factory.mktemp("graft_mixtral") / "ref")


@pytest.fixture(scope="module")
def t5(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, Path]:
    fam = family("t5")
    return fam, dump(fam, "fp32-eager", tmp_path_factory.mktemp("graft_t5") / "ref")


@pytest.mark.parametrize("level", ["leaf", "layer"])
def test_mixtral_clean_bf16_grafted_from_fp32_exits_0(mixtral, tmp_path: Path, level: str) -> None:
    fam, ref = mixtral
    grafted = dump(fam, "bf16-eager", tmp_path / "g", ref, None if level == "leaf" else LEVELS["mixtral"])
    a, b = _passes(grafted), _passes(ref)
    module = "model.layers.2.mlp.experts" if level == "leaf" else "model.layers.2"
    assert torch.equal(a[f"{module}@in[0]"], b[f"{module}@in[0]"].to(torch.bfloat16))  # premise
    if level == "leaf":  # the experts run on the reference's routing
        assert torch.equal(a[f"{module}@in[1]"], b[f"{module}@in[1]"])
    report = compare(grafted, ref)
    assert _local(report) and report.exit_code == 0, report.first_divergence


@pytest.mark.parametrize("bug", ["moe_scale", "rotary", "softmax_scale", "norm_eps"])
def test_mixtral_bugs_are_named_at_their_layer_by_a_layer_level_graft(
    mixtral, tmp_path: Path, bug: str
) -> None:
    fam, ref = mixtral
    report = compare(dump(fam, f"bf16-eager+{bug}", tmp_path / "g", ref, LEVELS["mixtral"]), ref)
    first = report.first_divergence
    assert report.exit_code == 1 and first is not None and planted(first.name, "mixtral"), first
    assert first.basis == "local"


def test_mixtral_eps_bug_is_named_at_its_norm_by_a_leaf_level_graft(mixtral, tmp_path: Path) -> None:
    fam, ref = mixtral
    report = compare(dump(fam, "bf16-eager+norm_eps", tmp_path / "g", ref), ref)
    first = report.first_divergence
    assert (
        first is not None
        and first.name == "model.layers.2.post_attention_layernorm"
        and first.basis == "local"
    )


def _tie_layer0(model: torch.nn.Module) -> None:
    """Experts 2 and 3 of layer 0's router score alike but for 1e-6: in bf16 (the row rounded,
    the two equal) the tie is broken by index, in fp32 by the 1e-6, so some tokens flip."""
    gate = model.model.layers[0].mlp.gate
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        row = gate.weight[2].float().clone()
        gate.weight[3] = (row + 1e-6 * torch.randn(row.shape, generator=generator)).to(gate.weight.dtype)


def test_a_near_tie_flip_upstream_does_not_matter_to_grafted_experts(tmp_path: Path) -> None:
    fam = family("mixtral")
    fam.bugs = {"tie": _tie_layer0}  # the tie is part of both models, not a bug
    ref = dump(fam, "fp32-eager+tie", tmp_path / "ref")
    leaf = dump(fam, "bf16-eager+tie", tmp_path / "leaf", ref)
    a, b = _passes(leaf), _passes(ref)
    gate_a, gate_b = a["model.layers.0.mlp.gate[2]"], b["model.layers.0.mlp.gate[2]"]
    flipped = (gate_a.sort(dim=1).values != gate_b.sort(dim=1).values).any(dim=1)
    assert flipped.any(), "premise: the near-tie flips some token in bf16"
    # ... yet the grafted experts ran on the reference's routing
    assert torch.equal(a["model.layers.0.mlp.experts@in[1]"], gate_b)
    report = compare(leaf, ref)
    assert report.flips and all(flip.near_tie for flip in report.flips)
    assert report.exit_code == 0, report.first_divergence
    # at layer level, every layer after the flip starts from the reference's own input
    layer = compare(dump(fam, "bf16-eager+tie", tmp_path / "layer", ref, LEVELS["mixtral"]), ref)
    later = [r for r in layer.results if re.fullmatch(r"model\.layers\.[1-3]", r.name)]
    assert len(later) == 3 and all(isinstance(r, LocalResult) and r.local for r in later)
    assert all(r.status in ("ok", "routing_flip") for r in later), [(r.name, r.status) for r in later]


@pytest.mark.parametrize("level", ["leaf", "layer"])
def test_t5_clean_bf16_grafted_from_fp32_exits_0(t5, tmp_path: Path, level: str) -> None:
    fam, ref = t5
    grafted = dump(fam, "bf16-eager", tmp_path / "g", ref, None if level == "leaf" else LEVELS["t5"])
    graft = tracedump.open_dump(grafted).run().manifest["graft"]
    assert graft["not_grafted"] == {}
    if level == "layer":  # encoder and decoder blocks, each on the reference's inputs
        assert graft["modules"] == [f"{side}.block.{i}" for side in ("encoder", "decoder") for i in range(3)]
        a, b = _passes(grafted), _passes(ref)
        key = "decoder.block.1@in[3]"  # the encoder's output, passed positionally
        assert torch.equal(a[key], b[key].to(torch.bfloat16))
    report = compare(grafted, ref)
    assert _local(report) and report.exit_code == 0, report.first_divergence


@pytest.mark.parametrize("bug", ["ff_scale", "norm_eps"])
def test_t5_bugs_are_named_at_their_block_by_a_layer_level_graft(t5, tmp_path: Path, bug: str) -> None:
    fam, ref = t5
    report = compare(dump(fam, f"bf16-eager+{bug}", tmp_path / "g", ref, LEVELS["t5"]), ref)
    first = report.first_divergence
    assert report.exit_code == 1 and first is not None and planted(first.name, "t5"), first


def test_t5_eps_bug_is_named_at_its_norm_by_a_leaf_level_graft(t5, tmp_path: Path) -> None:
    fam, ref = t5
    report = compare(dump(fam, "bf16-eager+norm_eps", tmp_path / "g", ref), ref)
    first = report.first_divergence
    assert first is not None and first.name == "decoder.block.1.layer.0.layer_norm" and first.basis == "local"
