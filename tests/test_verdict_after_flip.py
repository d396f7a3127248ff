"""No false layer after a near-tie routing flip.

A token a router flipped at a near-tie carries another expert's answer from there on, and every
token that attends to it in a later layer receives part of it: no rounding model bounds that, so
the verdict judges only what provably received none of it (under a causal mask, the positions
before the first flipped one) and lists the rest as not judged, with the reason. ``--baseline``
(a rerun that flips the same tokens) and a grafted run (each module fed the reference's inputs)
still name a bug after the flip.

The constructed Qwen3-MoE near-tie (``benchmarks/calibrate.py`` ``qwen3moe-tie``): in layer 1's
router expert 1's row is expert 0's x (1 + 2^-12), a tie in bf16 and not in fp32; the tied
experts' ``down_proj`` x 3 and x -3. Each test asserts that premise (the tie, the flip) from the
dumped tensors first. Marked ``numerics``: ``make test-numerics`` reruns it under the ISA caps and
other seeds, where other tokens flip.
"""

from __future__ import annotations

import copy
import html
import io
import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import benchmarks.calibrate as calibrate
import benchmarks.calibrate_graft as calibrate_graft
import tracedump
from tracedump.compare import compare
from tracedump.compare.judge.reason import RULES
from tracedump.compare.measure.routing import Flip, unaffected_tokens
from tracedump.compare.report.display import summary_lines

SEED = int(os.environ.get("TRACEDUMP_TEST_SEED", "0") or 0)
numerics = pytest.mark.numerics
ROUTER = "model.layers.1.mlp.gate"
BUGGY = "model.layers.2.post_attention_layernorm"
NOT_JUDGED = f"downstream of a near-tie routing flip in {ROUTER}, judge with `--baseline` or a graft"


@pytest.fixture(scope="module")
def tie(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("after-flip")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(calibrate, "SEED", SEED)
        family = calibrate.FAMILIES["qwen3moe-tie"]()
        dumps = {
            v: calibrate.dump_variant(copy.copy(family), v, root / v)
            for v in ("fp32", "bf16", "bf16+norm_eps")
        }
        graft = copy.copy(family)
        dumps["ref"] = calibrate_graft.dump(graft, "fp32-eager", root / "ref")
        for variant in ("bf16-eager", "bf16-eager+norm_eps"):
            for level, regex in (("leaf", None), ("layer", r"layers\.\d+$")):
                dumps[f"{variant}@{level}"] = calibrate_graft.dump(
                    graft, variant, root / f"{variant}-{level}", dumps["ref"], regex
                )
    return dumps


def _pass(dump: Path) -> dict[str, torch.Tensor]:
    return tracedump.load_pass(next(dump.glob("rank*/pass00000.safetensors")))


def _assert_premise(report, a: Path, b: Path) -> Flip:  # type: ignore[no-untyped-def]
    logits_a, logits_b = (_pass(d)[f"{ROUTER}[0]"] for d in (a, b))
    if logits_a.dtype == torch.bfloat16:
        assert torch.equal(logits_a[:, 0], logits_a[:, 1]), (
            "premise not met: experts 0 and 1 do not tie in bf16"
        )
    assert not torch.equal(logits_b[:, 0], logits_b[:, 1]), "premise not met: experts 0 and 1 tie in fp32"
    flips = [f for f in report.flips if f.router == ROUTER]
    assert flips and flips[0].flipped, "premise not met: the tied router of layer 1 flipped no token"
    flip = flips[0]
    assert flip.near_tie and 0 < len(flip.flipped) < flip.tokens, f"premise not met: {flip.message()}"
    return flip


def _unknown_mask(dump: Path, out: Path) -> Path:
    """A copy of ``dump`` whose manifest does not say its attention is causal (an older dump)."""
    shutil.copytree(dump, out)
    manifest_path = next(out.glob("rank*/manifest.json"))
    manifest = json.loads(manifest_path.read_text())
    manifest.pop("attention")
    manifest_path.write_text(json.dumps(manifest))
    return out


@numerics
def test_the_near_tie_passes_bf16_vs_fp32_judging_only_the_tokens_before_the_first_flip(
    tie: dict[str, Path],
) -> None:
    report = compare(tie["bf16"], tie["fp32"])
    flip = _assert_premise(report, tie["bf16"], tie["fp32"])
    assert report.exit_code == 0, report.first_divergence and report.first_divergence.message
    router_at = next(r.index for r in report.results if r.name == f"{ROUTER}[2]")
    after = [r for r in report.results if r.after_flip is not None]
    assert after and all(r.index > router_at for r in after)  # only what follows the flip
    first = min(flip.flipped)  # one sequence of 48 tokens: its first flipped position
    for r in after:
        assert r.status in ("routing_flip", "not_judged"), (r.name, r.status)
        if r.status == "routing_flip":  # judged on the positions before the first flipped one
            assert r.after_flip.tokens == first and r.error == r.after_flip.error, r.name
        else:
            assert r.error is None and r.metrics is not None  # measured, listed, not judged
    unjudged = [r for r in after if r.status == "not_judged"]
    assert bool(unjudged) == (first == 0) or all(r.after_flip.tokens == 0 for r in unjudged)
    summary = report.summary()
    assert summary["judged"] + len(unjudged) + summary["not_compared"] == len(report.results)
    if unjudged:
        assert summary["not_judged"] == {NOT_JUDGED: len(unjudged)}


@numerics
def test_without_a_causal_mask_known_everything_after_the_flip_is_listed_not_judged(
    tie: dict[str, Path], tmp_path: Path
) -> None:
    a, b = _unknown_mask(tie["bf16"], tmp_path / "a"), _unknown_mask(tie["fp32"], tmp_path / "b")
    report = compare(a, b)
    _assert_premise(report, a, b)
    assert report.exit_code == 0, report.first_divergence and report.first_divergence.message
    router_at = next(r.index for r in report.results if r.name == f"{ROUTER}[2]")
    unjudged = [r for r in report.results if r.status == "not_judged"]
    assert unjudged and all(r.index > router_at for r in unjudged)
    assert all(r.after_flip is not None and r.after_flip.router == ROUTER for r in unjudged)
    assert all(r.error is None and r.metrics is not None for r in unjudged)  # measured, not judged
    later = [r for r in report.results if r.index > router_at and re.match(r"model\.layers\.2\.", r.name)]
    assert later and all(r.status in ("not_judged", "routing") or r.metric == "exact" for r in later)
    summary = report.summary()
    assert summary["not_judged"] == {NOT_JUDGED: len(unjudged)}
    assert summary["judged"] + len(unjudged) + summary["not_compared"] == len(report.results)
    assert summary["verdict"] == (
        f"no divergence among the {summary['judged']} judged tensors; {len(unjudged)} not judged"
    )
    lines = summary_lines(report)
    assert any(line.startswith(f"not judged ({len(unjudged)}): {NOT_JUDGED}: ") for line in lines), lines
    assert any(line.startswith(f"no divergence: every judged tensor ({summary['judged']})") for line in lines)
    doc = json.loads(json.dumps(report.to_json()))
    listed = [t for t in doc["tensors"] if t["status"] == "not_judged"]
    assert len(listed) == len(unjudged) and all(t["after_flip"]["router"] == ROUTER for t in listed)
    assert doc["summary"]["not_judged"] == {NOT_JUDGED: len(unjudged)}


@numerics
def test_a_bug_after_the_flip_is_named_with_a_baseline(tie: dict[str, Path]) -> None:
    report = compare(tie["bf16+norm_eps"], tie["fp32"], baseline=tie["bf16"])
    _assert_premise(report, tie["bf16+norm_eps"], tie["fp32"])
    first = report.first_divergence
    assert report.exit_code == 1 and first is not None and first.name == BUGGY, first
    assert first.basis == "baseline" and first.error is not None and first.threshold is not None
    assert first.error > first.threshold
    assert report.summary()["not_judged"] == {}  # the baseline judges everything


@numerics
def test_without_a_baseline_a_bug_after_the_flip_is_named_there_or_not_judged(tie: dict[str, Path]) -> None:
    """Without a baseline, the bug is judged only on tokens the flip cannot have reached: named in
    its layer when such tokens exist, else listed as not judged; never another layer."""
    report = compare(tie["bf16+norm_eps"], tie["fp32"])
    _assert_premise(report, tie["bf16+norm_eps"], tie["fp32"])
    buggy = next(r for r in report.results if r.name == BUGGY)
    if buggy.status == "not_judged":
        assert report.exit_code == 0 and report.first_divergence is None
    else:
        assert buggy.after_flip is not None and buggy.after_flip.tokens > 0
        first = report.first_divergence  # in the planted layer (on one token the norm may pass)
        assert first is not None and first.name.startswith("model.layers.2."), first


@numerics
@pytest.mark.parametrize("level", ["leaf", "layer"])
def test_a_grafted_run_passes_clean_and_names_the_bug_after_the_flip(
    tie: dict[str, Path], level: str
) -> None:
    clean = compare(tie[f"bf16-eager@{level}"], tie["ref"])
    buggy = compare(tie[f"bf16-eager+norm_eps@{level}"], tie["ref"])
    _assert_premise(buggy, tie[f"bf16-eager+norm_eps@{level}"], tie["ref"])
    assert clean.exit_code == 0, clean.first_divergence
    first = buggy.first_divergence
    assert buggy.exit_code == 1 and first is not None and first.name == BUGGY, first
    assert first.basis == "local"
    # layer 2's grafted modules ran on the reference's inputs: the flip in layer 1 cannot reach
    # them, they are judged whole (containers outside every graft, at leaf level, keep the
    # propagated verdict)
    layer2 = [
        r
        for r in clean.results
        if r.name.startswith("model.layers.2.self_attn")
        and r.metric == "rel_diff"
        and getattr(r, "local", False)
    ]
    assert layer2 and all(r.status == "ok" and r.basis == "local" for r in layer2)


@numerics
def test_the_dumps_say_their_attention_is_causal(tie: dict[str, Path]) -> None:
    manifest = json.loads(next(tie["bf16"].glob("rank*/manifest.json")).read_text())
    assert manifest["attention"]["causal"] is True and manifest["attention"]["causal_modules"] == 3


def _flip(tokens: int, flipped: tuple[int, ...]) -> Flip:
    return Flip(router="r", block="b", tokens=tokens, flipped=flipped, margins=(0.0,), noise=1.0)


def test_under_a_causal_mask_the_positions_before_each_sequences_first_flip_are_unaffected() -> None:
    keep, why = unaffected_tokens(_flip(8, (2, 6, 7)), sequence=4, causal=True)
    assert keep is not None and "causal" in why
    assert keep.tolist() == [True, True, False, False, True, True, False, False]


def test_nothing_is_provably_unaffected_without_a_causal_mask_or_a_known_layout() -> None:
    for sequence, causal in ((4, False), (4, None), (None, True), (3, True)):
        keep, why = unaffected_tokens(_flip(8, (5,)), sequence=sequence, causal=causal)
        assert keep is None and "every token may have attended" in why
    keep, _ = unaffected_tokens(_flip(8, (0, 4)), sequence=4, causal=True)
    assert keep is not None and not np.any(keep)  # a flip at each sequence's start: nothing left


def _said_alike(report, result) -> dict[str, str]:  # type: ignore[no-untyped-def]
    """The judge's reason for ``result`` as the JSON, the terminal and the page say it: each must
    be the record's words, never a why rebuilt from the numbers."""
    from rich.console import Console

    from tracedump.compare.report.display import table
    from tracedump.compare.report.page import render
    from tracedump.compare.report.page.rows import Row
    from tracedump.compare.report.page.summary import why

    reason = result.reason
    assert reason is not None and reason.status == result.status and reason.rule in RULES, result
    record = report.to_json()["tensors"][result.index]
    assert record["reason"] == reason.to_json()  # the JSON's words are the judge's
    assert record["reason"]["decided_by"] == RULES[reason.rule]
    facts = dict(why(record))  # the page's why of this record
    assert facts["why"] == reason.text and facts.get("threshold from") == reason.threshold_from
    assert facts["decided by"] == reason.decided_by
    assert Row(record, 0, 0).why == reason.text  # the curve's point title
    out = Console(record=True, width=400, file=io.StringIO())
    out.print(table(report, 0))
    (line,) = [x for x in out.export_text().splitlines() if f" {result.label} " in x]
    assert result.status.text in line  # the table's status cell: the reason's status
    page = render(report)
    if report.first_divergence is not None and report.first_divergence.index == result.index:
        (first,) = [x for x in summary_lines(report) if x.startswith("first divergence: ")]
        assert f": {reason.text}" in first  # the terminal's why: the same sentence ...
        assert f"; threshold from {reason.threshold_from}" in first
        summary = page.split("<dl class='why'>")[1].split("</dl>")[0]  # ... as the page's
        assert f"<dt>why</dt><dd>{html.escape(reason.text, quote=False)}</dd>" in summary
    return record["reason"]


@numerics
def test_the_reason_is_the_same_words_in_the_json_the_terminal_and_the_page(tie: dict[str, Path]) -> None:
    """A diverged pair (judged on the baseline's noise), a routing flip and a grafted pair (its
    own error): the judge's reason record is what every printer prints."""
    diverged = compare(tie["bf16+norm_eps"], tie["fp32"], baseline=tie["bf16"])
    _assert_premise(diverged, tie["bf16+norm_eps"], tie["fp32"])
    first = diverged.first_divergence
    assert first is not None and first.name == BUGGY and first.status == "diverged", first
    said = _said_alike(diverged, first)
    assert said["rule"] == "baseline" and re.fullmatch(r"rel_diff \S+ > threshold \S+ \(\S+x\)", said["text"])
    assert said["threshold_from"].startswith("the noise measured in --baseline, err(C, B) = ")

    flipped = compare(tie["bf16"], tie["fp32"])
    _assert_premise(flipped, tie["bf16"], tie["fp32"])
    router = next(r for r in flipped.results if r.status == "routing_flip" and r.rule == "router")
    said = _said_alike(flipped, router)
    assert said == {"rule": "router", "decided_by": RULES["router"], "text": "routing flip"}

    grafted = compare(tie["bf16-eager+norm_eps@leaf"], tie["ref"])
    _assert_premise(grafted, tie["bf16-eager+norm_eps@leaf"], tie["ref"])
    first = grafted.first_divergence
    assert first is not None and first.name == BUGGY and first.basis == "local", first
    said = _said_alike(grafted, first)
    assert said["rule"] in ("local", "shadow") and said["threshold_from"].startswith("local: ")
    assert said["threshold_from"] == f"local: {first.tolerance.source}"
