"""The verdict on rounding order: what explains an error must have been computed first.

- A container's own outputs (attention weights) are explained by what came before its last child,
  not by the error its last child (``o_proj``) computed later and was recorded earlier: a query
  rotary bug in one layer, bf16 vs bf16 of the same code, is named in that layer for a 6-layer
  Llama (GQA, eager attention) and a 5-layer Qwen2 where ``o_proj`` moves by under one rounding.
- A routing flip the report calls a near-tie is not overruled by the ceiling on the flipped
  tokens: the constructed Qwen3-MoE tie passes bf16 vs fp32 with and without ``--baseline``, and a
  bug downstream of it is still found.

Each test builds its numerical event and asserts it from the dumped tensors ("premise not met")
before the verdict, so a CPU where rounding falls otherwise says so. Run them under the ISA caps
(``ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=AVX2``) and another ``TRACEDUMP_TEST_SEED``.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import benchmarks.calibrate as calibrate
import tracedump
from tracedump.compare import compare
from tracedump.compare.judge.verdict import GROWTH, rounding_floor
from tracedump.compare.results import TensorResult

SEED = int(os.environ.get("TRACEDUMP_TEST_SEED", "0") or 0)
numerics = pytest.mark.numerics  # rerun under capped ISAs and other seeds: make test-numerics
R_BF16 = rounding_floor("bfloat16", 64)  # what one bf16 op may add, from exact zeros


def _dumps(tmp: Path, family_name: str, variants: list[str]) -> dict[str, Path]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(calibrate, "SEED", SEED)
        family = calibrate.FAMILIES[family_name]()
        return {v: calibrate.dump_variant(copy.copy(family), v, tmp / v) for v in variants}


def _by_name(results: list[TensorResult]) -> dict[str, TensorResult]:
    return {r.name: r for r in results}


# ------------------------------------------------------------------ the container rule, on models


@pytest.fixture(scope="module", params=["llama-weights", "qwen2"])
def rotary(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    name = request.param
    return name, _dumps(tmp_path_factory.mktemp(name), name, ["bf16-eager+rotary", "bf16-eager"])


@numerics
def test_a_rotary_bug_seen_only_in_the_attention_weights_is_named_in_its_layer(
    rotary: tuple[str, dict],
) -> None:
    family, dumps = rotary
    report = compare(dumps["bf16-eager+rotary"], dumps["bf16-eager"])
    rows = _by_name(report.results)
    layer = "model.layers.3.self_attn"
    o_proj, weights = rows[f"{layer}.o_proj"], rows[f"{layer}[1]"]
    before_o_proj = report.results[: o_proj.index]
    # The premise, from the dumped tensors: everything before o_proj (q, k, v of the planted layer
    # included) is exact; the weights carry the bug (3 to 15 roundings over seeds); o_proj,
    # computed after them, moves by less than one op's rounding, yet enough that the running level
    # (o_proj recorded first) would have explained the weights.
    assert all(r.metrics.max_abs == 0 for r in before_o_proj if r.metrics is not None), (
        f"premise not met ({family}): a tensor before {layer}.o_proj differs"
    )
    assert weights.metrics is not None and weights.metrics.rel_diff > 2 * R_BF16, (
        f"premise not met ({family}): attention weights rel_diff {weights.metrics.rel_diff:.3g} <= 2 R"
    )
    assert o_proj.metrics is not None and o_proj.metrics.rel_diff <= R_BF16, (
        f"premise not met ({family}): o_proj rel_diff {o_proj.metrics.rel_diff:.3g} > R (it names the bug)"
    )
    assert GROWTH * o_proj.metrics.rel_diff + R_BF16 >= weights.metrics.rel_diff, (
        f"premise not met ({family}): o_proj's error could not have explained the weights anyway"
    )
    # The verdict: the weights are judged by the level before o_proj ran (exact zeros).
    first = report.first_divergence
    assert report.exit_code == 1 and first is not None, f"{family}: the rotary bug passed"
    assert first.name == f"{layer}[1]" and first.level_before == f"{layer}.o_proj"
    assert first.threshold == pytest.approx(R_BF16)
    assert o_proj.status == "ok" and rows[f"{layer}[0]"].status == "ok"  # o_proj's copy: o_proj's level
    row = report.to_json()["tensors"][first.index]
    assert row["level_before"] == f"{layer}.o_proj" and row["status"] == "diverged"


@numerics
def test_clean_bf16_vs_bf16_of_the_same_models_still_passes(rotary: tuple[str, dict]) -> None:
    _, dumps = rotary
    report = compare(dumps["bf16-eager"], dumps["bf16-eager"])
    assert report.exit_code == 0 and all(r.error == 0 for r in report.results if r.error is not None)


# ------------------------------------------------------------------ the container rule, by hand


def _hand_dump(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """A pass file in capture order (``tracedump.order``), as the dumper writes one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    order = json.dumps(list(tensors))
    save_file({k: v.clone() for k, v in tensors.items()}, str(path), metadata={"tracedump.order": order})
    return path


def _perturbed(reference: torch.Tensor, rel_diff: float, seed: int) -> torch.Tensor:
    """``reference`` + noise of about the given rel_diff, in bf16."""
    noise = torch.randn(reference.shape, generator=torch.Generator().manual_seed(seed))
    scale = (2 * rel_diff) ** 0.5 * reference.float().norm() / noise.norm()
    return (reference.float() + scale * noise).bfloat16()


def _attention_pass(tmp_path: Path, weights_error: float, o_error: float) -> tuple[Path, Path]:
    generator = torch.Generator().manual_seed(SEED)
    q = torch.randn(1, 8, 64, generator=generator).bfloat16()
    out = torch.randn(1, 8, 64, generator=generator).bfloat16()
    weights = torch.softmax(torch.randn(1, 4, 8, 8, generator=generator), -1).bfloat16()
    layer_out = torch.randn(1, 8, 64, generator=generator).bfloat16()
    out_a = _perturbed(out, o_error, 1)
    b = {"attn.q_proj": q, "attn.o_proj": out, "attn[0]": out, "attn[1]": weights, "layer": layer_out}
    a = {
        "attn.q_proj": q,
        "attn.o_proj": out_a,
        "attn[0]": out_a,  # the container returns o_proj's output: a copy
        "attn[1]": _perturbed(weights, weights_error, 2),
        "layer": _perturbed(layer_out, o_error, 3),
    }
    return _hand_dump(tmp_path / "a" / "pass00000.safetensors", a), _hand_dump(
        tmp_path / "b" / "pass00000.safetensors", b
    )


@numerics
def test_a_containers_own_output_is_explained_by_what_ran_before_its_last_child(tmp_path: Path) -> None:
    a, b = _attention_pass(tmp_path, weights_error=20 * R_BF16, o_error=0.5 * R_BF16)
    report = compare(a, b)
    rows = _by_name(report.results)
    o_proj, weights = rows["attn.o_proj"].metrics, rows["attn[1]"].metrics
    assert o_proj is not None and weights is not None
    assert rows["attn.q_proj"].metrics.max_abs == 0, "premise not met: q_proj differs"
    assert o_proj.rel_diff < R_BF16 < weights.rel_diff < GROWTH * o_proj.rel_diff, (
        f"premise not met: o_proj {o_proj.rel_diff:.3g}, weights {weights.rel_diff:.3g}, R {R_BF16:.3g}"
    )
    assert [r.name for r in report.results if r.status == "diverged"][:1] == ["attn[1]"]
    assert (
        rows["attn[1]"].threshold == pytest.approx(R_BF16) and rows["attn[1]"].level_before == "attn.o_proj"
    )
    assert rows["attn[0]"].status == "ok" and rows["attn[0]"].level_before is None  # the first output leaf
    assert rows["layer"].level_before is None  # not a later output leaf: the whole running level


@numerics
def test_without_the_children_in_the_dump_the_whole_running_level_explains_as_before(tmp_path: Path) -> None:
    """--filter (or MODULES) that leaves the children out: nothing says when the container started,
    so its outputs keep the whole running level (the rule only narrows where the dump shows more)."""
    a, b = _attention_pass(tmp_path, weights_error=20 * R_BF16, o_error=0.5 * R_BF16)
    report = compare(a, b, filter=r"^attn\[")
    rows = _by_name(report.results)
    assert set(rows) == {"attn[0]", "attn[1]"}
    assert rows["attn[0]"].metrics.rel_diff * GROWTH > rows["attn[1]"].metrics.rel_diff, "premise not met"
    assert report.exit_code == 0 and rows["attn[1]"].level_before is None


@numerics
def test_a_later_output_that_copies_a_child_keeps_that_childs_level(tmp_path: Path) -> None:
    """A layer returning (hidden, its attention's weights): the weights are self_attn[1]'s copy and
    are judged as self_attn[1] was, whatever the layer's last child (the MLP) added."""
    generator = torch.Generator().manual_seed(SEED)
    q = torch.randn(1, 8, 64, generator=generator).bfloat16()
    weights = torch.softmax(torch.randn(1, 4, 8, 8, generator=generator), -1).bfloat16()
    mlp = torch.randn(1, 8, 64, generator=generator).bfloat16()
    weights_a, mlp_a = _perturbed(weights, 0.5 * R_BF16, 4), _perturbed(mlp, 30 * R_BF16, 5)
    names = ["layer.attn.q_proj", "layer.attn[0]", "layer.attn[1]", "layer.mlp", "layer[0]", "layer[1]"]
    b = dict(zip(names, [q, q, weights, mlp, mlp, weights], strict=True))
    a = dict(zip(names, [q, q, weights_a, mlp_a, mlp_a, weights_a], strict=True))
    report = compare(  # cloned: safetensors stores no shared storage
        _hand_dump(tmp_path / "a" / "pass00000.safetensors", {k: v.clone() for k, v in a.items()}),
        _hand_dump(tmp_path / "b" / "pass00000.safetensors", {k: v.clone() for k, v in b.items()}),
    )
    rows = _by_name(report.results)
    assert rows["layer.attn[1]"].metrics.rel_diff > 0, "premise not met: the weights are exact"
    assert GROWTH * rows["layer.mlp"].metrics.rel_diff > rows["layer[1]"].metrics.rel_diff, "premise not met"
    # attn[1] is judged by the level before attn's last child (q_proj here); its copy the same way
    assert rows["layer.attn[1]"].level_before == "layer.attn.q_proj"
    assert rows["layer[1]"].status == "ok" and rows["layer[1]"].level_before == "layer.attn.q_proj"
    assert rows["layer[1]"].threshold == rows["layer.attn[1]"].threshold


# ------------------------------------------------------------------ the near-tie under the ceiling


@pytest.fixture(scope="module")
def tie(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return _dumps(
        tmp_path_factory.mktemp("tie"), "qwen3moe-tie", ["fp32", "bf16", "bf16-eager", "bf16+norm_eps"]
    )


def _router_logits(dump: Path) -> torch.Tensor:
    tensors = tracedump.load_pass(next(dump.glob("rank*/pass00000.safetensors")))
    return tensors["model.layers.1.mlp.gate[0]"]


def _assert_tie_premise(report, tie: dict[str, Path]) -> None:  # type: ignore[no-untyped-def]
    bf16, fp32 = _router_logits(tie["bf16"]), _router_logits(tie["fp32"])
    assert torch.equal(bf16[:, 0], bf16[:, 1]), "premise not met: experts 0 and 1 do not tie exactly in bf16"
    assert not torch.equal(fp32[:, 0], fp32[:, 1]), "premise not met: experts 0 and 1 tie in fp32 too"
    flips = [f for f in report.flips if f.router == "model.layers.1.mlp.gate"]
    assert flips and flips[0].flipped, "premise not met: the tied router of layer 1 flipped no token"
    flip = flips[0]
    assert flip.near_tie and 0 < len(flip.flipped) < flip.tokens, f"premise not met: {flip.message()}"
    block_a, block_b = (_block_output(tie[side]) for side in ("bf16", "fp32"))
    rows = [t for t in flip.flipped]
    d = (block_a[rows] - block_b[rows]).pow(2).sum(-1)
    worst = float((d / (block_a[rows].pow(2).sum(-1) + block_b[rows].pow(2).sum(-1))).max())
    assert worst > 1e-2, (
        f"premise not met: the flipped tokens move the MoE block by {worst:.3g}, under the ceiling"
    )


def _block_output(dump: Path) -> torch.Tensor:
    tensors = tracedump.load_pass(next(dump.glob("rank*/pass00000.safetensors")))
    return tensors["model.layers.1.mlp"].float().reshape(-1, 64)


@numerics
@pytest.mark.parametrize("baseline", [None, "bf16", "bf16-eager"])
def test_a_constructed_near_tie_passes_bf16_vs_fp32(tie: dict[str, Path], baseline: str | None) -> None:
    report = compare(tie["bf16"], tie["fp32"], baseline=tie[baseline] if baseline else None)
    _assert_tie_premise(report, tie)
    layer = _by_name(report.results)["model.layers.1"]
    assert report.exit_code == 0, report.first_divergence and report.first_divergence.message
    if baseline is None:  # tests/test_verdict_after_flip.py
        assert layer.status in ("routing_flip", "not_judged") and layer.after_flip is not None
        return
    assert layer.status == "routing_flip" and layer.error is not None and layer.error < 1e-2
    assert "routed alike" in (layer.message or "")


@numerics
def test_a_bug_downstream_of_the_near_tie_is_still_found(tie: dict[str, Path]) -> None:
    for baseline in (tie["bf16"],):  # without one: tests/test_verdict_after_flip.py
        report = compare(tie["bf16+norm_eps"], tie["fp32"], baseline=baseline)
        _assert_tie_premise(report, tie)
        first = report.first_divergence
        assert report.exit_code == 1 and first is not None
        assert first.name == "model.layers.2.post_attention_layernorm", first.name
        assert first.status == "diverged" and "routed alike" in (first.message or "")
        assert first.error is not None and first.threshold is not None and first.error > first.threshold
        assert first.basis == "baseline" and first.noise is not None  # C's error on the kept tokens


# ------------------------------------------------------------------ the ceiling on flipped tokens, by hand

TOKENS, FLIPPED = 16, (3, 7)


def _routed_pass(tmp_path: Path, side: str, layer_error: float, block_error: float = 0.0) -> Path:
    """B: an fp32 reference; A: a bf16 run whose router flips tokens 3 and 7 at a near-tie (their
    experts 1 and 2 are 1e-3 apart in fp32, equal after bf16 rounding). The flipped tokens' rows
    hold another expert's answer from the block on; the others differ by rounding, plus
    ``layer_error`` (rel_diff) in ``layer`` and ``block_error`` in the block's output ``moe`` (a
    bug on the tokens that kept their experts)."""
    generator = torch.Generator().manual_seed(SEED + 11)
    logits = torch.randn(TOKENS, 4, generator=generator)
    for t in FLIPPED:
        logits[t] = torch.tensor([3.0, 0.9995, 1.0005, -2.0])
    block = torch.randn(1, TOKENS, 64, generator=generator)
    layer = torch.randn(1, TOKENS, 64, generator=generator)
    other = 3 * torch.randn(1, TOKENS, 64, generator=generator)  # another expert's answer
    flipped = list(FLIPPED)
    if side == "a":
        logits = logits.bfloat16()
        assert all(logits[t, 1] == logits[t, 2] for t in FLIPPED)  # a tie in bf16: top-k takes expert 1
        block, layer = (
            (_perturbed(block, block_error, 5) if block_error else block.bfloat16()),
            (_perturbed(layer, layer_error, 6) if layer_error else layer.bfloat16()),
        )
        block[:, flipped] = (block[:, flipped] + other[:, flipped]).bfloat16()
        layer[:, flipped] = (layer[:, flipped] + other[:, flipped]).bfloat16()
    weights, indices = torch.topk(torch.softmax(logits.float(), -1).to(logits.dtype), 2, dim=-1)
    tensors = {
        "moe.gate[0]": logits,
        "moe.gate[1]": weights,
        "moe.gate[2]": indices,
        "moe": block,
        "layer": layer,
    }
    return _hand_dump(tmp_path / side / "pass00000.safetensors", tensors)


@numerics
def test_the_ceiling_does_not_judge_tokens_a_near_tie_flip_sent_elsewhere(tmp_path: Path) -> None:
    a, b = _routed_pass(tmp_path, "a", 0.0), _routed_pass(tmp_path, "b", 0.0)
    report = compare(a, b)
    assert report.flips and report.flips[0].near_tie, "premise not met: no near-tie flip"
    assert set(report.flips[0].flipped) == set(FLIPPED), f"premise not met: {report.flips[0].message()}"
    rows = _by_name(report.results)
    assert rows["layer"].metrics.rel_diff > rows["layer"].tolerance.rtol, "premise not met: under the ceiling"
    assert report.exit_code == 0, rows["layer"]
    assert rows["moe"].status == "routing_flip" and rows["moe"].error < 1e-5  # bf16 rounding
    # after the block, with no manifest to say the attention is causal, nothing is provably
    # out of the flip's reach: listed, not judged
    assert rows["layer"].status == "not_judged" and rows["layer"].after_flip is not None


@numerics
def test_a_bug_on_the_tokens_that_kept_their_experts_is_still_flagged(tmp_path: Path) -> None:
    a, b = _routed_pass(tmp_path / "bug", "a", 0.0, 0.05), _routed_pass(tmp_path / "bug", "b", 0.0)
    report = compare(a, b)
    assert report.flips and report.flips[0].near_tie, "premise not met: no near-tie flip"
    first = report.first_divergence
    assert report.exit_code == 1 and first is not None and first.name == "moe"
    assert first.error is not None and first.error > 0.01


# ------------------------------------------------------------------ calibration, one column per setting


def test_calibrate_runs_each_setting_in_a_process_of_its_own_and_reports_them_side_by_side(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "calibration.json"
    code = calibrate.main(
        ["--families", "gemma2", "--settings", "native,capped", "--markdown", "--out", str(out)]
    )
    printed = capsys.readouterr().out
    document = json.loads(out.read_text())
    assert code == 0 and set(document["settings"]) == {"native", "capped"}
    capped = document["settings"]["capped"]
    assert capped["env"] == {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert capped["capability"] == "DEFAULT"  # the child really ran with ATen's kernels capped
    assert document["cpu"] and all(row["passed"] for row in capped["rows"])
    assert "| family | case | must | native | capped |" in printed  # a column per setting
    count = len(calibrate.cases(calibrate.FAMILIES["gemma2"]()))
    assert f"native: {count} of {count} as expected" in printed
    assert f"capped: {count} of {count} as expected" in printed
    # each row's ratio to its allowance, the margin goal, the minutes each setting took
    assert all(row["ratio"] is not None and "goal_met" in row for row in capped["rows"])
    assert capped["seconds"] > 0 and "native: clean max / bug min" in printed
