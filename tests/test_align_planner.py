"""``--align tokens`` is one more planner: its plan runs through the same
executor, ``--baseline`` and verdict as a pass-by-pass plan, so MoE routing flips and the baseline
judge a sequence's rows exactly as they judge the pass that holds them.

The premise is built, not hoped for: the constructed Qwen3-MoE near-tie of
``benchmarks/calibrate.py`` (``qwen3moe-tie``: layer 1's router ties experts 0 and 1 in bf16, not
in fp32), one HF forward of one sequence, so each pass is exactly one sequence and the two
alignments must agree result by result. ``bf16+norm_eps`` plants a bug after the flip.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

import benchmarks.calibrate as calibrate
from tracedump.compare import compare
from tracedump.compare.results import DiffReport

ROUTER = "model.layers.1.mlp.gate"
BUGGY = "model.layers.2.post_attention_layernorm"


@pytest.fixture(scope="module")
def tie(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("planner-tie")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(calibrate, "SEED", 0)
        family = calibrate.FAMILIES["qwen3moe-tie"]()
        return {
            v: calibrate.dump_variant(copy.copy(family), v, root / v)
            for v in ("fp32", "bf16", "bf16+norm_eps")
        }


def _flips(report: DiffReport) -> list[tuple[str, tuple[int, ...], bool]]:
    return [(f.router, tuple(f.flipped), f.near_tie) for f in report.flips]


def _by_name(report: DiffReport) -> dict[str, tuple[str, float | None, str | None]]:
    return {r.name: (r.status, r.error, r.basis) for r in report.results}


def _assert_same_verdicts(steps: DiffReport, tokens: DiffReport) -> None:
    """Every pair both plans hold has one status, error and basis under either alignment (a
    tensor whose rows are no tokens, such as an expert's, is ``not_aligned`` under tokens)."""
    a, b = _by_name(steps), _by_name(tokens)
    common = {name for name in set(a) & set(b) if b[name][0] != "not_aligned"}
    assert ROUTER + "[0]" in common and BUGGY in common and len(common) >= 0.5 * len(a)
    for name in sorted(common):
        (status_a, error_a, basis_a), (status_b, error_b, basis_b) = a[name], b[name]
        assert (status_a, basis_a) == (status_b, basis_b), name
        assert (error_a is None) == (error_b is None), name
        if error_a is not None:
            assert error_b == pytest.approx(error_a, rel=1e-4, abs=1e-12), name


def test_a_routing_flip_is_judged_alike_under_both_alignments(tie: dict[str, Path]) -> None:
    steps = compare(tie["bf16"], tie["fp32"])
    tokens = compare(tie["bf16"], tie["fp32"], align="tokens")
    assert steps.settings["align"] != "tokens" and tokens.settings["align"] == "tokens"
    flips = _flips(steps)
    assert any(router == ROUTER and flipped and near for router, flipped, near in flips), (
        f"premise not met: no near-tie flip in {ROUTER}: {flips}"
    )
    assert _flips(tokens) == flips  # the token plan's router rows go through the same detection
    assert any(r.status == "routing_flip" for r in tokens.results)
    assert tokens.exit_code == steps.exit_code == 0
    _assert_same_verdicts(steps, tokens)
    # the sequence is a field of its own; the root stays the root (one root pair: none)
    assert {r.sequence for r in tokens.results} == {"seq 0"} and {r.root for r in tokens.results} == {None}
    assert {r.sequence for r in steps.results} == {None}


def test_the_baseline_names_a_bug_after_the_flip_alike_under_both_alignments(tie: dict[str, Path]) -> None:
    steps = compare(tie["bf16+norm_eps"], tie["fp32"], baseline=tie["bf16"])
    tokens = compare(tie["bf16+norm_eps"], tie["fp32"], baseline=tie["bf16"], align="tokens")
    for report in (steps, tokens):
        first = report.first_divergence
        assert report.exit_code == 1 and first is not None and first.name == BUGGY, first
        assert first.basis == "baseline" and first.noise is not None
    _assert_same_verdicts(steps, tokens)
    noise = {r.name: r.noise for r in steps.results}
    for r in tokens.results:  # err(C, B) measured on the same rows
        if r.noise is not None and noise.get(r.name) is not None:
            assert r.noise == pytest.approx(noise[r.name], rel=1e-4, abs=1e-12), r.name


def test_a_stats_dump_is_refused_under_token_alignment_with_the_reason(tmp_path: Path) -> None:
    """Statistics hold no rows per token: ``--align tokens`` says so (exit 2), never guesses."""
    import torch
    from conftest import make_tiny_llama

    import tracedump

    model = make_tiny_llama()
    ids = torch.tensor([[3, 14, 15, 9]])
    for name, mode in (("a", "stats"), ("b", "full")):
        with torch.no_grad(), tracedump.attach(model, {"dir": tmp_path / name, "mode": mode}):
            model(ids)
    with pytest.raises(tracedump.TracedumpError, match="--align tokens needs full dumps"):
        compare(tmp_path / "a", tmp_path / "b", align="tokens")
