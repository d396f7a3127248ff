"""Grafting: each module's own error, bf16 grafted from an fp32 reference, no baseline.

A Llama (6 layers, GQA) in fp32 with eager attention is the reference, dumped with INPUTS=1; the
bf16 model is dumped grafted from it, at leaf level and at decoder-layer level, clean and with one
bug in layer 3. Every verdict is preceded by its premise, read from the dumped tensors: the grafted
module's input is the reference's, cast to bf16; the planted bug really changed that layer's
numbers in an ungrafted run; the clean runs really differ from the reference (bf16 noise is there
to be judged).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import tracedump
from benchmarks.calibrate_graft import LEVELS, dump, family, planted
from tracedump.compare import compare
from tracedump.compare.judge.local import LocalResult
from tracedump.compare.judge.verdict import K_LEAF, ROUNDING_HEADROOM, level_roundings, local_allowance

pytest.importorskip("transformers")

LAYER = LEVELS["llama"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, Path]:
    fam = family("llama")
    root = tmp_path_factory.mktemp("graft_llama")
    return fam, dump(fam, "fp32-eager", root / "ref")


def _grafted(llama: tuple[object, Path], tmp_path: Path, variant: str, level: str | None) -> Path:
    fam, ref = llama
    return dump(fam, variant, tmp_path / variant.replace("+", "_"), ref, level)  # type: ignore[arg-type]


def _run(path: Path) -> tracedump.Run:
    return tracedump.open_dump(path).run()


def _assert_inputs_replaced(grafted: Path, ref: Path, module: str) -> None:
    """The premise of every grafted verdict: the module ran on the reference's input, cast."""
    a, b = _run(grafted).passes[0], _run(ref).passes[0]
    key = f"{module}@in[0]"
    assert a[key].dtype == torch.bfloat16 and b[key].dtype == torch.float32
    assert torch.equal(a[key], b[key].to(torch.bfloat16))


@pytest.mark.parametrize("level", [None, LAYER], ids=["leaf", "layer"])
def test_clean_bf16_grafted_from_fp32_exits_0_at_both_levels(
    llama, tmp_path: Path, level: str | None
) -> None:
    _, ref = llama
    grafted = _grafted(llama, tmp_path, "bf16-eager", level)
    manifest = _run(grafted).manifest
    graft = manifest["graft"]
    assert graft["level"] == (level or "leaves") and Path(graft["from"]) == _run(ref).path
    assert graft["not_grafted"] == {}
    if level is None:
        assert "model.layers.3.mlp.down_proj" in graft["modules"] and "model.layers.3" not in graft["modules"]
        _assert_inputs_replaced(grafted, ref, "model.layers.3.mlp.down_proj")
    else:
        assert graft["modules"] == [f"model.layers.{i}" for i in range(6)]
        _assert_inputs_replaced(grafted, ref, "model.layers.3")
    report = compare(grafted, ref)
    local = [r for r in report.results if isinstance(r, LocalResult) and r.local and r.error is not None]
    assert local and max(r.error for r in local) > 0  # bf16 noise is there to be judged
    assert report.exit_code == 0, report.first_divergence
    summary = report.to_json()
    assert summary["settings"]["graft"]
    by_name = {t["name"]: t for t in summary["tensors"]}
    target = "model.layers.3.mlp.down_proj" if level is None else "model.layers.3"
    assert by_name[target]["local"] is True and by_name[target]["basis"] == "local"
    # per-token error as for any diff (the token count comes from the first tensor measured: the
    # root's [1, seq] input_ids would make it 1, so the filter starts at the layers)
    per_token = compare(grafted, ref, filter=r"layers\.").to_json()["tensors"]
    row = next(t for t in per_token if t["name"] == target)
    assert row["local"] is True and len(row["per_token"]["rel_diff"]) == 24
    # a leaf: three roundings; layer 3's output: after its 10 leaves ran (norms, projections, act)
    roundings = K_LEAF if level is None else level_roundings(10)
    # with the fp32 shadow (the default) that counting rule x ROUNDING_HEADROOM bounds the run's
    # rounding against its own shadow; the logic has its own allowance, measured
    counted = local_allowance("bfloat16", 64, roundings)
    source = by_name[target]["tolerance_source"]
    assert "fp32 shadow" in source and f"within {ROUNDING_HEADROOM * counted:.3g}" in source, source


def test_clean_kernel_change_sdpa_grafted_from_eager_fp32_exits_0(llama, tmp_path: Path) -> None:
    for level in (None, LAYER):
        grafted = _grafted(llama, tmp_path / str(level is None), "bf16-sdpa", level)
        names_a = _run(grafted).passes[0].names
        assert "model.layers.3.self_attn[1]" not in names_a  # sdpa: no attention weights, another kernel
        report = compare(grafted, llama[1])
        assert report.exit_code == 0, report.first_divergence


@pytest.mark.parametrize("bug", ["mlp_scale", "rotary", "softmax_scale", "norm_eps"])
def test_each_bug_is_named_at_its_layer_by_a_layer_level_graft_without_baseline(
    llama, tmp_path: Path, bug: str
) -> None:
    _, ref = llama
    grafted = _grafted(llama, tmp_path, f"bf16-eager+{bug}", LAYER)
    _assert_inputs_replaced(grafted, ref, "model.layers.3")
    report = compare(grafted, ref)
    first = report.first_divergence
    assert report.exit_code == 1 and first is not None
    assert planted(first.name, "llama"), first.name
    assert first.basis == "local" and first.error > first.threshold
    # only the planted layer is wrong: every other layer's local error is within its allowance
    others = [
        r
        for r in report.results
        if re.fullmatch(r"model\.layers\.[0-5]", r.name) and r.name != "model.layers.3"
    ]
    assert len(others) == 5 and all(r.status == "ok" for r in others)


def test_the_eps_bug_is_named_at_its_norm_by_a_leaf_level_graft(llama, tmp_path: Path) -> None:
    _, ref = llama
    grafted = _grafted(llama, tmp_path, "bf16-eager+norm_eps", None)
    _assert_inputs_replaced(grafted, ref, "model.layers.3.input_layernorm")
    report = compare(grafted, ref)
    first = report.first_divergence
    assert first is not None and first.name == "model.layers.3.input_layernorm"
    assert first.basis == "local" and "logic (the shadow vs the reference)" in first.tolerance.source
    assert first.error > 100 * first.threshold  # an eps of 0.5: far beyond the weights' rounding
    assert report.exit_code == 1


def test_a_bug_between_leaves_is_not_seen_at_leaf_level_but_is_at_layer_level(llama, tmp_path: Path) -> None:
    """What each level can see: the MLP block's output scale is code between leaves (the block's
    forward), so every grafted leaf is clean; the layer that contains it is not."""
    _, ref = llama
    leaf = compare(_grafted(llama, tmp_path / "leaf", "bf16-eager+mlp_scale", None), ref)
    assert all(r.status == "ok" for r in leaf.results if isinstance(r, LocalResult) and r.local)
    layer = compare(_grafted(llama, tmp_path / "layer", "bf16-eager+mlp_scale", LAYER), ref)
    assert layer.first_divergence is not None and layer.first_divergence.name == "model.layers.3.mlp"


def test_the_table_marks_grafted_modules_and_the_json_says_local(llama, tmp_path: Path) -> None:
    import subprocess
    import sys

    _, ref = llama
    grafted = _grafted(llama, tmp_path, "bf16-eager+norm_eps", LAYER)
    out = tmp_path / "diff.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tracedump",
            "diff",
            str(grafted),
            str(ref),
            "--json",
            str(out),
            "--max-rows",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    assert "model.layers.3 [local]" in done.stdout
    assert "grafted run: level layers" in done.stdout
    assert "local error: what model.layers.3" in done.stdout
    data = json.loads(out.read_text())
    rows = {t["name"]: t for t in data["tensors"]}
    assert rows["model.layers.3"]["local"] is True and rows["model.layers.3"]["status"] == "diverged"
    assert rows["model.norm"]["local"] is False  # outside every graft: the propagated verdict
    assert data["summary"]["first_divergence"]["name"].startswith("model.layers.3")
