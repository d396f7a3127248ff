"""The correspondence derived from vLLM's weight load, on the real engine: vLLM against HF
transformers with no flag and no rule file, per family (compare/pair/correspondence.py), and each
assumption about vLLM's internals (integrations/vllm_compat.py) exercised by a real load.

One vLLM dump and one HF dump per family, shared by the tests of the session (an engine start is
~30 s); a planted one-layer bug (the test plugin in ``testbug/``) in a dense and an MoE family."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import PYTHON, SCRIPTS, OfflineRun, diff

FAMILIES = [
    "llama-tied", "phi3", "mixtral", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "qwen3-moe",
    "cohere", "falcon", "qwen2-moe",
]  # fmt: skip
MIN_COVERAGE = 0.8  # every family, MoE included: the plugin records vLLM's routing (its top-k)
BUGS = {  # family -> (the parameter scaled, the layer named)
    "phi3": ("model.layers.1.mlp.down_proj.weight*1.05", "model.layers.1."),
    "mixtral": ("model.layers.1.block_sparse_moe.experts.routed_experts.w2_weight*1.05", "model.layers.1."),
    "cohere": ("model.layers.1.mlp.down_proj.weight*1.05", "model.layers.1."),  # hidden already summed
    "falcon": ("transformer.h.1.mlp.dense_4h_to_h.weight*1.05", "transformer.h.1."),  # qkv reordered on load
    "qwen2-moe": ("model.layers.1.mlp.shared_expert.down_proj.weight*1.05", "model.layers.1."),
}


@pytest.fixture(scope="session")
def hf_reference(
    session_dir: Path, tiny_model: Callable[..., Path], run_engine: Callable[..., Any]
) -> Callable[..., Path]:
    """``hf_reference(arch)`` -> the HF dump of one tiny model (eager attention), every module."""
    done: dict[str, Path] = {}

    def make(arch: str) -> Path:
        if arch not in done:
            out = session_dir / "hf" / f"corr-{arch}"
            script = [PYTHON, str(SCRIPTS / "hf_reference.py"), str(tiny_model(arch=arch)), "--attn", "eager"]
            run_engine(
                [PYTHON, "-m", "tracedump", "run", "-q", "--dir", str(out), "--modules", "all", "--", *script]
            )
            done[arch] = out
        return done[arch]

    return make


@pytest.fixture(scope="session")
def family(
    tiny_model: Callable[..., Path],
    offline_dump: Callable[..., OfflineRun],
    hf_reference: Callable[..., Path],
) -> Callable[..., tuple[OfflineRun, Path]]:
    """``family(arch)`` -> (the vLLM dump, the HF dump) of one tiny model, fp32, every module."""

    def make(arch: str) -> tuple[OfflineRun, Path]:
        return offline_dump(f"corr-{arch}", model=tiny_model(arch=arch)), hf_reference(arch)

    return make


def _stored(label: str) -> set[str]:
    """The stored tensors a bridged label is made of (``a + b``, ``a * b``, ``x[..][0:8]``)."""
    label = re.sub(r"^cat\((.*), dim=-?\d+\)$", r"\1", label)
    return {part.strip() for part in re.split(r" \+ | \* |, ", label)}


def coverage_of_b(report: dict[str, Any]) -> tuple[float, set[str]]:
    """The share of B's tensor names (per sequence, all steps) compared, and those left out."""
    compared: set[str] = set()
    for t in report["tensors"]:
        if t["status"] != "not_comparable":
            compared |= _stored(t.get("name_b") or t["name"])
    left = {u["name"] for u in report["only_in_b"]} - compared
    return len(compared) / max(len(compared | left), 1), left


def _tolerances(rows: list[dict[str, Any]]) -> list[float]:
    """Each row's tolerance, once per prompt position (< 3) it holds, in the rows' order."""
    return [t["tolerance"] for t in rows for pos in t["per_token"]["positions"] if pos < 3]


def _record(run: OfflineRun) -> dict[str, Any]:
    (run_dir,) = run.run_dirs()
    return json.loads((run_dir / "correspondence.json").read_text())


@pytest.mark.parametrize("arch", FAMILIES)
def test_vllm_against_hf_with_no_flag_compares_most_of_the_reference(
    arch: str, family: Callable[..., tuple[OfflineRun, Path]], tmp_path: Path
) -> None:
    engine, hf = family(arch)
    code, out, report = diff(tmp_path, engine.dir, hf)
    bad = [(t["name"], t["status"], t.get("message")) for t in report["tensors"] if t["status"] != "ok"][:5]
    assert code == 0, bad
    assert report["summary"]["bridge"]["name"] == "derived from the weight load"
    assert report["summary"]["not_comparable"] == 0
    share, left = coverage_of_b(report)
    assert share >= MIN_COVERAGE, (share, sorted(left))
    assert report["summary"]["coverage"]["fraction"] >= MIN_COVERAGE  # the report says the same
    logits = [t for t in report["tensors"] if t["name"] == "logits_processor[raw]"]
    assert logits and logits[0]["name_b"] == "lm_head" and logits[0]["status"] == "ok"  # every family
    measured = [t for t in report["tensors"] if t["rel_diff"] is not None]
    assert measured and max(t["rel_diff"] for t in measured) < 1e-6  # fp32 both: rounding only
    assert "derived from the weight load" in out


def test_fused_modules_split_at_the_recorded_offsets(
    family: Callable[..., tuple[OfflineRun, Path]], tmp_path: Path
) -> None:
    engine, hf = family("llama-tied")
    loads = _record(engine)["loads"]
    qkv = [x for x in loads if x["param"] == "model.layers.0.self_attn.qkv_proj.weight"]
    assert sorted((x["shard"], x["region"][0], x["rows"]) for x in qkv) == [
        ("k", [256, 512], [[0, 0, 256]]),
        ("q", [0, 256], [[0, 0, 256]]),
        ("v", [512, 768], [[0, 0, 256]]),
    ]  # vllm_compat.loader_call_ids, param_weight_loader: the linear layers' shard ids
    assert {x["source"] for x in qkv} == {f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"}
    tied = _record(engine)["parameters"]
    assert (
        "lm_head.weight" not in tied or tied["lm_head.weight"].get("same_as") == "model.embed_tokens.weight"
    )
    _code, _out, report = diff(tmp_path, engine.dir, hf)
    pairs = {(t["name"], t["name_b"]) for t in report["tensors"]}
    assert ("model.layers.0.self_attn.qkv_proj[0][256:512]", "model.layers.0.self_attn.k_proj") in pairs
    assert ("model.layers.0.mlp.gate_up_proj[0][512:1024]", "model.layers.0.mlp.up_proj") in pairs
    assert ("logits_processor[raw]", "lm_head") in pairs  # the tied head: same tensor, paired by name


def test_moe_experts_are_loaded_per_expert_and_listed_not_comparable(
    family: Callable[..., tuple[OfflineRun, Path]], tmp_path: Path
) -> None:
    engine, hf = family("mixtral")
    loads = [
        x
        for x in _record(engine)["loads"]
        if x["param"] == "model.layers.0.block_sparse_moe.experts.routed_experts.w13_weight"
    ]
    # vllm_compat.loader_call_tensors / loader_call_ids: FusedMoE's keyword call, expert and shard
    assert sorted((x["expert"], x["shard"]) for x in loads) == [
        (e, w) for e in range(4) for w in ("w1", "w3")
    ]
    w3 = next(x for x in loads if (x["expert"], x["shard"]) == (2, "w3"))
    assert w3["region"][0] == [2, 3] and w3["source"].endswith("experts.2.w3.weight")
    _code, _out, report = diff(tmp_path, engine.dir, hf)
    names = {t["name"] for t in report["tensors"]}
    assert "model.layers.0.block_sparse_moe" in names  # the block output
    assert any(n.startswith("model.layers.0.block_sparse_moe.gate") for n in names)  # the router
    assert "fused experts" in json.dumps(report["summary"]["leftovers"])
    # vllm_compat.moe_routers / select_experts_call: the engine's own top-k, recorded per layer,
    # against HF's router outputs (logits, top-k weights, top-k ids); the ids judged as routing.
    # HF's router logits once: against the gate module's output, the recorded logits (the same
    # tensor) listed with the reason
    routing = {t["name"]: t for t in report["tensors"] if ".routing[" in t["name"]}
    skipped = {u["name"]: u.get("reason", "") for u in report["only_in_a"]}
    for layer in range(4):
        block = f"model.layers.{layer}.block_sparse_moe.routing"
        assert f"{block}[logits]" not in routing and "compared once" in skipped[f"{block}[logits]"]
        for k, what in enumerate(("topk_weights", "topk_ids"), 1):
            row = routing[f"{block}[{what}]"]
            assert row["name_b"] == f"model.layers.{layer}.mlp.gate[{k}]" and row["status"] == "ok", row
        router = [t for t in report["tensors"] if t.get("name_b") == f"model.layers.{layer}.mlp.gate[0]"]
        assert {t["name"].rpartition(".gate")[0] for t in router} == {
            f"model.layers.{layer}.block_sparse_moe"
        }
        assert len(router) == len({t.get("sequence") for t in router}), router  # once per sequence
        assert all(t["status"] == "ok" for t in router), router


def _layer_outputs(report: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The decoder layers' output pairs (name, name_b, status), once per sequence, sorted."""
    layer = re.compile(r"model\.layers\.\d+(\[0\] \+ model\.layers\.\d+\[1\])?")
    return sorted(
        (t["name"], t["name_b"], t["status"]) for t in report["tensors"] if layer.fullmatch(t["name"])
    )


def test_with_inputs_dumped_on_both_sides_a_clean_pair_exits_0(
    family: Callable[..., tuple[OfflineRun, Path]],
    offline_dump: Callable[..., OfflineRun],
    tiny_model: Callable[..., Path],
    run_engine: Callable[..., Any],
    session_dir: Path,
    tmp_path: Path,
) -> None:
    """INPUTS=1 on both sides (Llama, fp32): vLLM's decoder layer is called ``layer(positions,
    hidden_states, residual)``, HF's ``layer(hidden_states, ...)``. Inputs pair by what they hold
    (compare/pair/input_roles.py): vLLM's positions (``@in[0]``, integers) never meet HF's hidden
    states (``@in[0]``; before: a shape mismatch per layer, exit 1); the clean pair exits 0 and
    the layer outputs pair as without inputs."""
    engine, hf = family("llama-tied")
    model = tiny_model(arch="llama-tied")
    engine_in = offline_dump("corr-llama-tied-inputs", model=model, env={"TRACEDUMP_DUMP_INPUTS": "1"})
    hf_in = session_dir / "hf" / "corr-llama-tied-inputs"
    script = [PYTHON, str(SCRIPTS / "hf_reference.py"), str(model), "--attn", "eager"]
    run_engine(
        [
            PYTHON,
            "-m",
            "tracedump",
            "run",
            "-q",
            "--dir",
            str(hf_in),
            "--modules",
            "all",
            "--inputs",
            "--",
            *script,
        ]
    )
    _code, _out, plain = diff(tmp_path, engine.dir, hf)
    code, out, report = diff(tmp_path, engine_in.dir, hf_in)
    bad = [
        (t["name"], t["name_b"], t["status"], t.get("message"))
        for t in report["tensors"]
        if t["status"] != "ok"
    ]
    assert code == 0 and not bad, (bad[:5], out[-1500:])
    assert report["summary"]["not_comparable"] == 0
    assert _layer_outputs(report) == _layer_outputs(plain) and len(_layer_outputs(plain)) == 4 * 2
    rows = {(t["name"], t["name_b"]): t for t in report["tensors"]}
    for layer in range(4):  # vLLM's positions: against HF's, never against its hidden states
        assert (f"model.layers.{layer}@in[0]", f"model.layers.{layer}@in[0]") not in rows
        assert (f"model.layers.{layer}@in[0]", f"model.layers.{layer}@in[position_ids]") in rows
    assert rows[("model.layers.0@in[1]", "model.layers.0@in[0]")]["rel_diff"] < 1e-6  # no residual yet
    listed = {u["name"]: u.get("reason") or "" for u in report["only_in_a"]}
    assert "which is which" in listed["model.layers.1@in[2]"]  # (hidden_states, residual): listed


@pytest.mark.parametrize("arch", ["gemma", "gemma2"])
def test_the_logits_are_compared_before_the_soft_cap(
    arch: str, family: Callable[..., tuple[OfflineRun, Path]], tmp_path: Path
) -> None:
    """vLLM's Gemma2 keeps no head module (its tied embedding computes the logits inside
    LogitsProcessor, which also applies the final soft cap that HF applies after its lm_head, in
    no module; Gemma ties a head module, with no cap): the head's output recorded inside the
    processor (vllm_compat.logits_processors) is compared with HF's lm_head in both; the
    processor's output is listed."""
    engine, hf = family(arch)
    _code, _out, report = diff(tmp_path, engine.dir, hf)
    rows = {t["name"]: t for t in report["tensors"]}
    assert rows["logits_processor[raw]"]["name_b"] == "lm_head"
    assert (
        rows["logits_processor[raw]"]["status"] == "ok" and rows["logits_processor[raw]"]["rel_diff"] < 1e-6
    )
    listed = {u["name"]: u["reason"] for u in report["only_in_a"]}
    assert "soft cap" in listed["logits_processor"]
    assert "lm_head" not in {u["name"] for u in report["only_in_b"]}


@pytest.mark.parametrize("arch", sorted(BUGS))
def test_a_one_layer_bug_is_named_at_its_layer(
    arch: str,
    hf_reference: Callable[..., Path],
    offline_dump: Callable[..., OfflineRun],
    tiny_model: Callable[..., Path],
    tmp_path: Path,
) -> None:
    spec, layer = BUGS[arch]
    hf = hf_reference(arch)
    bug = offline_dump(f"corr-{arch}-bug", model=tiny_model(arch=arch), env={"TRACEDUMP_TEST_BUG": spec})
    code, out, report = diff(tmp_path, bug.dir, hf)
    assert code == 1
    first = report["summary"]["alignment"][0]["first"]
    assert first is not None and first["name"].startswith(layer), (first, out[-2000:])
    assert first["position"] == 0 and first["sequence"].startswith("seq ")
    # layer 0 agrees on the prompts (a flipped greedy token feeds later positions another input)
    before = [t for t in report["tensors"] if t["name"].startswith(layer.replace(".1.", ".0."))]
    prompt = [
        (t["name"], rel)
        for t in before
        for pos, rel in zip(t["per_token"]["positions"], t["per_token"]["rel_diff"], strict=True)
        if pos < 3
    ]
    assert prompt and all(rel <= t_tol for (_, rel), t_tol in zip(prompt, _tolerances(before), strict=True))


def test_the_tensor_parallel_rank_is_recorded(family: Callable[..., tuple[OfflineRun, Path]]) -> None:
    engine, _hf = family("phi3")
    assert _record(engine)["tensor_parallel"] == {"rank": 0, "size": 1}  # vllm_compat.tensor_parallel


def test_tensor_parallel_2_against_hf_with_no_flag(
    hf_reference: Callable[..., Path],
    offline_dump: Callable[..., OfflineRun],
    tiny_model: Callable[..., Path],
    tmp_path: Path,
) -> None:
    """TP=2 on CPU (the mp backend, one OpenMP thread per rank): each rank's fused outputs
    gathered by the loads it recorded, with no --unshard rule; clean exit 0, a bug named."""
    hf = hf_reference("llama-tied")
    model = tiny_model(arch="llama-tied")
    clean = offline_dump("corr-tp2", model=model, args=["--tp", "2"])
    assert [
        json.loads((d / "correspondence.json").read_text())["tensor_parallel"] for d in clean.run_dirs()
    ] == [
        {"rank": 0, "size": 2},
        {"rank": 1, "size": 2},
    ]
    code, out, report = diff(tmp_path, clean.dir, hf)
    bad = [(t["name"], t["status"], t.get("message")) for t in report["tensors"] if t["status"] != "ok"][:5]
    assert code == 0, (bad, out[-1500:])
    share, left = coverage_of_b(report)
    assert share >= MIN_COVERAGE, (share, sorted(left))
    names = {(t["name"], t["name_b"]) for t in report["tensors"]}
    assert ("model.layers.1.self_attn.qkv_proj[0][256:512]", "model.layers.1.self_attn.k_proj") in names
    bug = offline_dump(
        "corr-tp2-bug",
        model=model,
        args=["--tp", "2"],
        env={"TRACEDUMP_TEST_BUG": "model.layers.1.mlp.down_proj.weight*1.05"},
    )
    code, out, report = diff(tmp_path, bug.dir, hf)
    first = report["summary"]["alignment"][0]["first"]
    assert code == 1 and first is not None and first["name"].startswith("model.layers.1."), out[-2000:]


# ------------------------------------------------------------------ conventions measured in the run


def _listed(report: dict[str, Any], side: str = "a") -> dict[str, str]:
    return {u["name"]: u.get("reason") or "" for u in report[f"only_in_{side}"]}


def test_a_layer_returning_an_already_summed_hidden_is_compared_as_the_run_consumes_it(
    family: Callable[..., tuple[OfflineRun, Path]], tmp_path: Path
) -> None:
    """vLLM's Cohere returns ``(hidden, residual)`` with the residual already in ``hidden``: the
    next layer's norm hands ``hidden`` on alone (compare/pair/conventions.py), so layer 0's output is
    its ``[0]``, never ``[0] + [1]``; the last layer, whose ``hidden`` nothing recorded consumes
    whole (the final norm hands on the residual), is listed with the reason."""
    engine, hf = family("cohere")
    code, out, report = diff(tmp_path, engine.dir, hf)
    assert code == 0, out[-1500:]
    rows = {(t["name"], t["name_b"]): t for t in report["tensors"]}
    assert ("model.layers.0[0]", "model.layers.0") in rows
    assert all(t["status"] == "ok" for (a, _), t in rows.items() if a == "model.layers.0[0]")
    assert not any("model.layers.0[1]" in a for a, _ in rows)  # never the false sum
    listed = _listed(report)
    assert "not told by the run" in listed["model.layers.1[0]"]
    assert "model.layers.1.input_layernorm[1] holds model.layers.0[0] alone" in json.dumps(report)


def test_a_fused_tensor_reordered_on_load_is_compared_in_the_order_written(
    family: Callable[..., tuple[OfflineRun, Path]], tmp_path: Path
) -> None:
    """vLLM's Falcon (the new decoder architecture, 2 KV heads) reorders the checkpoint's
    ``query_key_value``, grouped per KV head (``[q0 q1 k0 v0 | q2 q3 k1 v1]``), into
    ``[q | k | v]`` before its weight loader sees it: the load record matches the written rows
    against the tensor as read, and the output is gathered back into the checkpoint's order before
    it is compared with HF's. Its attention returns ``(out, None)`` (no bias): still paired."""
    engine, hf = family("falcon")
    param = "transformer.h.0.self_attention.query_key_value.weight"
    (load,) = [x for x in _record(engine)["loads"] if x["param"] == param]
    assert load["source"] == param
    assert load["rows"] == [[0, 0, 128], [128, 256, 128], [256, 128, 64], [320, 384, 64], [384, 192, 64],
                            [448, 448, 64]]  # fmt: skip
    code, out, report = diff(tmp_path, engine.dir, hf)
    assert code == 0, out[-1500:]
    rows = {(t["name"], t["name_b"]): t for t in report["tensors"]}
    attention = "transformer.h.0.self_attention"
    qkv = rows[(f"{attention}.query_key_value[0]", f"{attention}.query_key_value")]
    assert qkv["status"] == "ok" and qkv["rel_diff"] < 1e-9
    assert rows[(f"{attention}[0]", f"{attention}[0]")]["status"] == "ok"  # (out, None) against HF's
    act = rows[("transformer.h.0.mlp.act", "transformer.h.0.mlp.act")]  # GELU against GELUActivation
    assert act["status"] == "ok" and "same place" in act["bridge"]


def test_a_block_that_adds_the_residual_inside_is_listed_not_compared(
    tiny_model: Callable[..., Path],
    offline_dump: Callable[..., OfflineRun],
    hf_reference: Callable[..., Path],
    tmp_path: Path,
) -> None:
    """HF's Bloom attention and MLP add the residual inside, vLLM's do not: measured (their last
    children pair, one returns that child's output as it is), both listed with the reason, the
    decoder layer around them compared. Its query_key_value, interleaved per head and reordered
    by vLLM on load, agrees once gathered back. (vLLM's Bloom runs the exact GELU where HF's runs
    the tanh approximation: a real difference, named at layer 0's act.)"""
    engine = offline_dump("corr-bloom", model=tiny_model(arch="bloom"))
    code, _out, report = diff(tmp_path, engine.dir, hf_reference("bloom"))
    rows = {(t["name"], t["name_b"]): t for t in report["tensors"]}
    attention = "transformer.h.0.self_attention"
    qkv = rows[(f"{attention}.query_key_value[0]", f"{attention}.query_key_value")]
    assert qkv["status"] == "ok" and qkv["rel_diff"] < 1e-9
    assert "B's block adds something (the residual)" in _listed(report)[attention]
    assert "B's block adds something (the residual)" in _listed(report, "b")[f"{attention}[0]"]
    assert "B's block adds something (the residual)" in _listed(report)["transformer.h.0.mlp"]
    assert ("transformer.h.0", "transformer.h.0[0]") in rows
    assert "not the tensor recorded before it" in _listed(report, "b")[f"{attention}.attention_dropout"]
    first = report["summary"]["alignment"][0]["first"]
    assert code == 1 and first["name"] == "transformer.h.0.mlp.gelu_impl"  # exact GELU against tanh


def test_a_shared_expert_runner_is_not_compared_with_routed_experts(
    family: Callable[..., tuple[OfflineRun, Path]], tmp_path: Path
) -> None:
    """vLLM's MoE runner returns the routed plus the shared experts (its block's whole output),
    HF's ``experts`` the routed ones only: measured, listed with the reason; the block agrees."""
    engine, hf = family("qwen2-moe")
    code, out, report = diff(tmp_path, engine.dir, hf)
    assert code == 0, out[-1500:]
    rows = {(t["name"], t["name_b"]): t for t in report["tensors"]}
    assert ("model.layers.0.mlp", "model.layers.0.mlp") in rows
    assert "shared experts added inside" in _listed(report)["model.layers.0.mlp.experts"]
    assert "shared experts added inside" in _listed(report, "b")["model.layers.0.mlp.experts"]
    assert not any(b == "model.layers.0.mlp.experts" for _, b in rows)
    # the shared expert the runner calls as a module: its leaves against HF's shared_expert, and
    # HF's shared_expert (which returns its down_proj's output as it is, measured) as that output
    shared = {b: t for (_a, b), t in rows.items() if b.startswith("model.layers.0.mlp.shared_expert")}
    for name in ("gate_proj", "up_proj", "down_proj", "act_fn * model.layers.0.mlp.shared_expert.up_proj"):
        assert shared[f"model.layers.0.mlp.shared_expert.{name}"]["status"] == "ok", name
    assert shared["model.layers.0.mlp.shared_expert"]["name"].endswith("down_proj[0]")
    assert shared["model.layers.0.mlp.shared_expert_gate"]["status"] == "ok"
