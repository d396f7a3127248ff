"""The correspondence derived from the weight load, on fake records (no vLLM): which modules pair,
which fused outputs split where, which weightless parts follow the engine-wide rules, and the
dump side's load recording (:mod:`tracedump.dump.weights`) on real tensors.

The records have the shape the vLLM plugin writes (tests_vllm/test_correspondence.py checks that
on the real engine): a Llama-like vLLM layer (fused qkv / gate_up, a tied head) against HF's."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from tracedump.compare.options import parse_options
from tracedump.compare.pair.correspondence import derive_bridge
from tracedump.compare.pair.holdings import engine_holdings, plain_holdings
from tracedump.compare.pair.matcher import Matcher
from tracedump.compare.pair.module_pairing import pair_modules
from tracedump.compare.pair.table import Tensors
from tracedump.dump.weights import fingerprint, module_parameters, source_slices, written_region
from tracedump.store.correspondence import Correspondence, Load, read_correspondence, write_correspondence

H, INTER = 8, 12  # hidden, intermediate


def _src(shape: list[int], seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "shape": shape,
        "dtype": "torch.float32",
        "fingerprint": fingerprint(torch.randn(shape, generator=g)),
    }


def _hf_sources(layers: int = 2) -> dict[str, dict]:
    out = {"model.embed_tokens.weight": _src([32, H], 1), "model.norm.weight": _src([H], 2)}
    seed = 10
    for i in range(layers):
        p = f"model.layers.{i}."
        for name, shape in (
            ("self_attn.q_proj.weight", [H, H]),
            ("self_attn.k_proj.weight", [H, H]),
            ("self_attn.v_proj.weight", [H, H]),
            ("self_attn.o_proj.weight", [H, H]),
            ("mlp.gate_proj.weight", [INTER, H]),
            ("mlp.up_proj.weight", [INTER, H]),
            ("mlp.down_proj.weight", [H, INTER]),
            ("input_layernorm.weight", [H]),
            ("post_attention_layernorm.weight", [H]),
        ):
            out[p + name] = _src(shape, seed)
            seed += 1
    return out


def _vllm_record(layers: int = 2) -> Correspondence:
    sources = _hf_sources(layers)
    loads, params = [], {}

    def add(param: str, shape: list[int], parts: list[tuple[str, int, int]], shards=None) -> None:
        params[param] = {"module": param.rpartition(".")[0], "shape": shape, "dtype": "torch.float32"}
        for k, (source, start, count) in enumerate(parts):
            region = [[start, start + count]] + [[0, d] for d in shape[1:]]
            loads.append(
                Load(param=param, source=source, shard=shards[k] if shards else None, region=region,
                     rows=[[0, 0, count]])
            )  # fmt: skip

    add("model.embed_tokens.weight", [32, H], [("model.embed_tokens.weight", 0, 32)])
    params["lm_head.weight"] = {"module": "lm_head", "shape": [32, H], "same_as": "model.embed_tokens.weight"}
    add("model.norm.weight", [H], [("model.norm.weight", 0, H)])
    for i in range(layers):
        p = f"model.layers.{i}."
        qkv = [(p + f"self_attn.{x}_proj.weight", k * H, H) for k, x in enumerate("qkv")]
        add(p + "self_attn.qkv_proj.weight", [3 * H, H], qkv, shards=["q", "k", "v"])
        add(p + "self_attn.o_proj.weight", [H, H], [(p + "self_attn.o_proj.weight", 0, H)])
        gate_up = [(p + "mlp.gate_proj.weight", 0, INTER), (p + "mlp.up_proj.weight", INTER, INTER)]
        add(p + "mlp.gate_up_proj.weight", [2 * INTER, H], gate_up, shards=["0", "1"])
        add(p + "mlp.down_proj.weight", [H, INTER], [(p + "mlp.down_proj.weight", 0, H)])
        for norm in ("input_layernorm", "post_attention_layernorm"):
            add(p + norm + ".weight", [H], [(p + norm + ".weight", 0, H)])
    return Correspondence(parameters=params, sources=sources, loads=loads)


def _hf_record(layers: int = 2, tied: bool = True) -> Correspondence:
    params = {}
    for name, meta in _hf_sources(layers).items():
        params[name] = {"module": name.rpartition(".")[0], **meta}
    params["lm_head.weight"] = (
        {"module": "lm_head", "shape": [32, H], "same_as": "model.embed_tokens.weight"}
        if tied
        else {"module": "lm_head", **_hf_sources()["model.embed_tokens.weight"]}
    )
    return Correspondence(parameters=params)


VLLM_CLASSES = {
    "": "vllm.LlamaForCausalLM",
    "model": "vllm.LlamaModel",
    "model.embed_tokens": "vllm.VocabParallelEmbedding",
    **{
        f"model.layers.{i}{m}": c
        for i in range(2)
        for m, c in (
            ("", "LlamaDecoderLayer"),
            (".self_attn", "LlamaAttention"),
            (".self_attn.qkv_proj", "QKVParallelLinear"),
            (".self_attn.o_proj", "RowParallelLinear"),
            (".self_attn.rotary_emb", "RotaryEmbedding"),
            (".self_attn.attn", "Attention"),
            (".mlp", "LlamaMLP"),
            (".mlp.gate_up_proj", "MergedColumnParallelLinear"),
            (".mlp.down_proj", "RowParallelLinear"),
            (".mlp.act_fn", "SiluAndMul"),
            (".input_layernorm", "RMSNorm"),
            (".post_attention_layernorm", "RMSNorm"),
        )
    },
    "model.norm": "RMSNorm",
    "lm_head": "ParallelLMHead",
    "logits_processor": "LogitsProcessor",
}
HF_CLASSES = {
    "": "LlamaForCausalLM",
    "model": "LlamaModel",
    "model.embed_tokens": "Embedding",
    "model.rotary_emb": "LlamaRotaryEmbedding",
    **{
        f"model.layers.{i}{m}": c
        for i in range(2)
        for m, c in (
            ("", "LlamaDecoderLayer"),
            (".self_attn", "LlamaAttention"),
            (".self_attn.q_proj", "Linear"),
            (".self_attn.k_proj", "Linear"),
            (".self_attn.v_proj", "Linear"),
            (".self_attn.o_proj", "Linear"),
            (".mlp", "LlamaMLP"),
            (".mlp.gate_proj", "Linear"),
            (".mlp.up_proj", "Linear"),
            (".mlp.down_proj", "Linear"),
            (".mlp.act_fn", "SiLUActivation"),
            (".input_layernorm", "LlamaRMSNorm"),
            (".post_attention_layernorm", "LlamaRMSNorm"),
        )
    },
    "model.norm": "LlamaRMSNorm",
    "lm_head": "Linear",
}


def test_modules_pair_by_the_checkpoint_tensors_they_hold_whatever_their_names() -> None:
    engine = engine_holdings(_vllm_record())
    other = plain_holdings(_hf_record(), _vllm_record().sources)
    pairing = pair_modules(engine, other)
    assert pairing.splits["model.layers.1.self_attn.qkv_proj"] == [
        "model.layers.1.self_attn.q_proj",
        "model.layers.1.self_attn.k_proj",
        "model.layers.1.self_attn.v_proj",
    ]
    assert pairing.splits["model.layers.0.mlp.gate_up_proj"] == [
        "model.layers.0.mlp.gate_proj",
        "model.layers.0.mlp.up_proj",
    ]
    assert pairing.leaves["model.layers.0.mlp.down_proj"] == "model.layers.0.mlp.down_proj"
    # the tied head: both hold the embedding; an equal name breaks the tie
    assert pairing.leaves["model.embed_tokens"] == "model.embed_tokens"
    assert pairing.leaves["lm_head"] == "lm_head"
    assert pairing.containers["model.layers.1"] == "model.layers.1"
    assert pairing.containers["model.layers.0.self_attn"] == "model.layers.0.self_attn"
    assert pairing.containers["model"] == "model"


def test_a_renamed_parameter_is_found_by_its_fingerprint() -> None:
    hf = _hf_record()
    renamed = {k.replace("mlp.", "feed_forward."): v for k, v in hf.parameters.items()}
    for meta in renamed.values():
        meta["module"] = meta["module"].replace("mlp.", "feed_forward.") if "module" in meta else ""
    other = plain_holdings(Correspondence(parameters=renamed), _vllm_record().sources)
    pairing = pair_modules(engine_holdings(_vllm_record()), other)
    assert pairing.leaves["model.layers.0.mlp.down_proj"] == "model.layers.0.feed_forward.down_proj"
    assert pairing.containers["model.layers.0.mlp"] == "model.layers.0.feed_forward"


def _match(names_a: list[str], names_b: list[str], swap: bool = False):
    a, b = _vllm_record(), _hf_record()
    if swap:
        bridge = derive_bridge(
            b, a, framework_a="transformers", framework_b="vllm", classes_a=HF_CLASSES, classes_b=VLLM_CLASSES
        )
        matcher = Matcher(bridge=bridge, classes_a=HF_CLASSES, classes_b=VLLM_CLASSES)
        return matcher.match(names_b, names_a, parse_options("x", "y"))
    bridge = derive_bridge(
        a, b, framework_a="vllm", framework_b="transformers", classes_a=VLLM_CLASSES, classes_b=HF_CLASSES
    )
    assert bridge is not None
    matcher = Matcher(bridge=bridge, classes_a=VLLM_CLASSES, classes_b=HF_CLASSES)
    return matcher.match(names_a, names_b, parse_options("x", "y"))


VLLM_NAMES = [
    "model.embed_tokens",
    "model.layers.0.input_layernorm",
    "model.layers.0.self_attn.qkv_proj[0]",
    "model.layers.0.self_attn.rotary_emb[0]",
    "model.layers.0.self_attn.rotary_emb[1]",
    "model.layers.0.self_attn.attn",
    "model.layers.0.self_attn.o_proj[0]",
    "model.layers.0.self_attn",
    "model.layers.0.post_attention_layernorm[0]",
    "model.layers.0.post_attention_layernorm[1]",
    "model.layers.0.mlp.gate_up_proj[0]",
    "model.layers.0.mlp.act_fn",
    "model.layers.0.mlp.down_proj[0]",
    "model.layers.0.mlp",
    "model.layers.0[0]",
    "model.layers.0[1]",
    "model.norm[0]",
    "model.norm[1]",
    "model",
    "logits_processor",
]
HF_NAMES = [
    "model.embed_tokens",
    "model.rotary_emb[0]",
    "model.rotary_emb[1]",
    "model.layers.0.input_layernorm",
    "model.layers.0.self_attn.q_proj",
    "model.layers.0.self_attn.k_proj",
    "model.layers.0.self_attn.v_proj",
    "model.layers.0.self_attn.o_proj",
    "model.layers.0.self_attn[0]",
    "model.layers.0.post_attention_layernorm",
    "model.layers.0.mlp.gate_proj",
    "model.layers.0.mlp.act_fn",
    "model.layers.0.mlp.up_proj",
    "model.layers.0.mlp.down_proj",
    "model.layers.0.mlp",
    "model.layers.0",
    "model.norm",
    "model[last_hidden_state]",
    "lm_head",
]


def _pairs(matched) -> dict[str, str]:
    return {pair.a.label: pair.b.label for pair in matched.pairs}


@pytest.mark.parametrize("swap", [False, True])
def test_the_derived_bridge_compares_every_hf_tensor_but_the_rotary_tables(swap: bool) -> None:
    matched = _match(VLLM_NAMES, HF_NAMES, swap=swap)
    pairs = {(p.a.label, p.b.label) if not swap else (p.b.label, p.a.label) for p in matched.pairs}
    qkv = {a: b for a, b in pairs if a.startswith("model.layers.0.self_attn.qkv_proj[0][")}
    # pieces in the load's row order, sized from the counterparts' shapes once they are read
    assert qkv == {
        f"model.layers.0.self_attn.qkv_proj[0][-1:{k}]": f"model.layers.0.self_attn.{x}_proj"
        for k, x in enumerate("qkv")
    }
    for a, b in (
        ("model.layers.0[0] + model.layers.0[1]", "model.layers.0"),
        ("model.layers.0.mlp.act_fn", "model.layers.0.mlp.act_fn * model.layers.0.mlp.up_proj"),
        ("model.layers.0.post_attention_layernorm[0]", "model.layers.0.post_attention_layernorm"),
        ("model.norm[0]", "model.norm"),
        ("model", "model[last_hidden_state]"),
        ("logits_processor", "lm_head"),
        ("model.layers.0.self_attn", "model.layers.0.self_attn[0]"),
    ):
        assert (a, b) in pairs, (a, b)
    assert all(pair.classes is None for pair in matched.pairs)  # nothing "not comparable"
    compared_b = {n for p in matched.pairs for n in (p.a.names if swap else p.b.names)}
    assert set(HF_NAMES) - compared_b == {"model.rotary_emb[0]", "model.rotary_emb[1]"}
    # without the engine's model output, HF's is compared with the final norm's
    no_model = _match([n for n in VLLM_NAMES if n != "model"], HF_NAMES, swap=swap)
    found = {(p.a.label, p.b.label) if not swap else (p.b.label, p.a.label) for p in no_model.pairs}
    assert ("model.norm[0]", "model[last_hidden_state]") in found
    reasons = {u.name: u.reason for u in matched.leftovers}
    assert "rotary" in reasons["model.rotary_emb[0]"]
    assert "--inputs" in reasons["model.layers.0.self_attn.attn"]
    assert "residual" in reasons["model.layers.0.post_attention_layernorm[1]"]


@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("engine_head", [True, False])
def test_the_logits_are_compared_before_the_processors_soft_cap(swap: bool, engine_head: bool) -> None:
    """The head's output the plugin records inside vLLM's LogitsProcessor (``[raw]``, before the
    soft cap / scale that HF applies in no module) against HF's head; the processor's own output
    listed with the reason. An engine that keeps no head module (vLLM's Gemma2: the tied
    embedding computes the logits) is paired with HF's tied head all the same."""
    names_a = [n for n in VLLM_NAMES if n != "logits_processor"] + [
        "logits_processor[raw]",
        "logits_processor",
    ]
    a, b = _vllm_record(), _hf_record()
    classes_a = dict(VLLM_CLASSES)
    if not engine_head:
        a = Correspondence(
            parameters={k: v for k, v in a.parameters.items() if k != "lm_head.weight"},
            sources=a.sources,
            loads=a.loads,
        )
        classes_a.pop("lm_head")
    sides = [(a, classes_a, names_a, "vllm"), (b, HF_CLASSES, HF_NAMES, "transformers")]
    if swap:
        sides.reverse()
    (ra, ca, na, fa), (rb, cb, nb, fb) = sides
    bridge = derive_bridge(ra, rb, framework_a=fa, framework_b=fb, classes_a=ca, classes_b=cb)
    matched = Matcher(bridge=bridge, classes_a=ca, classes_b=cb).match(na, nb, parse_options("x", "y"))
    pairs = {(p.a.label, p.b.label) if not swap else (p.b.label, p.a.label) for p in matched.pairs}
    assert ("logits_processor[raw]", "lm_head") in pairs
    assert not [x for x in pairs if x[0] == "logits_processor"]
    reasons = {u.name: u.reason for u in matched.leftovers}
    assert "soft cap" in reasons["logits_processor"]
    assert "lm_head" not in reasons


def test_with_hf_inputs_the_weightless_parts_meet_their_consumers_inputs() -> None:
    names_b = [*HF_NAMES, "model.layers.0.self_attn.o_proj@in[0]", "model.layers.0.mlp.down_proj@in[0]",
               "model.layers.0.post_attention_layernorm@in[0]"]  # fmt: skip
    matched = _match(
        [*VLLM_NAMES, "model.layers.0.mlp.act_fn@in[0]"], [*names_b, "model.layers.0.mlp.act_fn@in[0]"]
    )
    pairs = _pairs(matched)
    assert pairs["model.layers.0.self_attn.attn"] == "model.layers.0.self_attn.o_proj@in[0]"
    # the act's input on each side (the gate_up output, the gate half): listed, not "not comparable"
    listed = {(u.side, u.name): u.reason for u in matched.leftovers}
    for side in ("A", "B"):
        assert "act(gate) * up" in listed[(side, "model.layers.0.mlp.act_fn@in[0]")]
    assert not [p for p in matched.pairs if p.classes is not None]
    assert pairs["model.layers.0.mlp.act_fn"] == "model.layers.0.mlp.down_proj@in[0]"
    assert (
        pairs["model.layers.0.post_attention_layernorm[1]"] == "model.layers.0.post_attention_layernorm@in[0]"
    )


def test_the_attention_op_meets_the_output_projections_input_not_a_norm_defined_after_it() -> None:
    """Qwen3: vLLM defines ``q_norm`` and ``k_norm`` after ``o_proj``; the attention op's output is
    ``o_proj``'s input, never ``k_norm``'s (q and k: before, a false shape mismatch with HF's
    ``--inputs``)."""
    a, b = _vllm_record(), _hf_record()
    classes_a, classes_b = dict(VLLM_CLASSES), dict(HF_CLASSES)
    for i in range(2):
        for k, norm in enumerate(("q_norm", "k_norm")):
            module = f"model.layers.{i}.self_attn.{norm}"
            source = _src([4], 100 + 2 * i + k)
            a.sources[module + ".weight"] = source
            a.parameters[module + ".weight"] = {"module": module, "shape": [4], "dtype": "torch.float32"}
            a.loads.append(
                Load(param=module + ".weight", source=module + ".weight", region=[[0, 4]], rows=[[0, 0, 4]])
            )
            b.parameters[module + ".weight"] = {"module": module, **source}
            classes_a[module], classes_b[module] = "RMSNorm", "Qwen3RMSNorm"
    bridge = derive_bridge(
        a, b, framework_a="vllm", framework_b="transformers", classes_a=classes_a, classes_b=classes_b
    )
    names_b = [*HF_NAMES, "model.layers.0.self_attn.k_norm@in[0]", "model.layers.0.self_attn.o_proj@in[0]"]
    matched = Matcher(bridge=bridge, classes_a=classes_a, classes_b=classes_b).match(
        VLLM_NAMES, names_b, parse_options("x", "y")
    )
    assert _pairs(matched)["model.layers.0.self_attn.attn"] == "model.layers.0.self_attn.o_proj@in[0]"


def test_two_runs_without_an_engine_load_pair_by_values_only_when_their_names_differ() -> None:
    hf = _hf_record()
    plain: dict = {"framework_a": "torch", "framework_b": "transformers", "classes_a": {}, "classes_b": {}}
    assert derive_bridge(hf, hf, **plain) is None  # same names: matched by name, as always
    renamed = {
        k.replace("mlp.", "ffn."): {**v, "module": v["module"].replace("mlp.", "ffn.")}
        if "module" in v
        else v
        for k, v in hf.parameters.items()
    }
    bridge = derive_bridge(Correspondence(parameters=renamed), hf, **plain)
    assert bridge is not None
    names_a = ["model.layers.0.ffn.down_proj", "model.layers.0.ffn", "model.layers.0"]
    names_b = ["model.layers.0.mlp.down_proj", "model.layers.0.mlp", "model.layers.0"]
    matched = Matcher(bridge=bridge, classes_a={}, classes_b={}).match(
        names_a, names_b, parse_options("x", "y")
    )
    assert _pairs(matched) == dict(zip(names_a, names_b, strict=True))


# ------------------------------------------------------------------ the dump side


def test_written_region_and_source_rows_of_a_tensor_parallel_shard() -> None:
    q, k, v = (torch.randn(8, 6) for _ in range(3))
    param = torch.full((12, 6), float("nan"))
    param[0:4] = q[4:8]  # rank 1 of 2: its half of q, k and v
    param[4:8] = k[4:8]
    param[8:12] = v[4:8]
    fused = torch.cat([q, k, v])  # Phi3's fused checkpoint tensor
    assert written_region(~torch.isnan(param)) == [[0, 12], [0, 6]]
    assert source_slices(param, fused) == {"cols": None, "rows": [[0, 4, 4], [4, 12, 4], [8, 20, 4]]}
    row_parallel = torch.randn(6, 8)
    assert source_slices(row_parallel[:, 4:8].clone(), row_parallel) == {"cols": [4, 8], "rows": [[0, 0, 6]]}
    expert = torch.zeros(3, 10, 6)
    w1 = torch.randn(5, 6)
    expert[1, 5:10] = w1
    mask = torch.zeros(3, 10, 6, dtype=torch.bool)
    mask[1, 5:10] = True
    assert written_region(mask) == [[1, 2], [5, 10], [0, 6]]
    assert source_slices(expert[1:2, 5:10], w1) == {"cols": None, "rows": [[0, 0, 5]]}
    assert source_slices(torch.randn(5, 6), w1) is None  # not a copy: no slices claimed


def test_module_parameters_name_shared_ones_once_and_the_record_round_trips(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    params = module_parameters(model)
    assert params["1.weight"] == {
        "module": "1",
        "shape": [10, 4],
        "dtype": "torch.float32",
        "same_as": "0.weight",
    }
    assert len(params["0.weight"]["fingerprint"]) == 8
    record = Correspondence(
        parameters=params,
        loads=[Load(param="0.weight", source="e", region=[[0, 10], [0, 4]], rows=[[0, 0, 10]])],
    )
    write_correspondence(tmp_path, record)
    assert json.loads((tmp_path / "correspondence.json").read_text())["version"] == 1
    assert read_correspondence(tmp_path) == record


def _moe_records() -> tuple[Correspondence, Correspondence]:
    """One Mixtral-like MoE block: vLLM's per-expert loads into fused w13/w2, its experts runner
    holding the router too; HF 5's block under another name, its experts fused (no checkpoint name)."""
    sources = {"model.layers.0.block_sparse_moe.gate.weight": _src([4, H], 1)}
    loads, params = [], {}
    base = "model.layers.0.block_sparse_moe"
    for e in range(4):
        for k, w in enumerate(("w1", "w3")):
            name = f"{base}.experts.{e}.{w}.weight"
            sources[name] = _src([INTER, H], 10 + 2 * e + k)
            region = [[e, e + 1], [k * INTER, (k + 1) * INTER], [0, H]]
            loads.append(
                Load(param=f"{base}.experts.routed_experts.w13_weight", source=name, shard=w, expert=e,
                     region=region, rows=[[0, 0, INTER]])
            )  # fmt: skip
    loads.append(
        Load(
            param=f"{base}.gate.weight",
            source=f"{base}.gate.weight",
            region=[[0, 4], [0, H]],
            rows=[[0, 0, 4]],
        )
    )
    params[f"{base}.gate.weight"] = {"module": f"{base}.gate", "shape": [4, H]}
    params[f"{base}.experts.gate.weight"] = {
        "module": f"{base}.experts.gate",
        "same_as": f"{base}.gate.weight",
    }
    params[f"{base}.experts.routed_experts.w13_weight"] = {"module": "x", "shape": [4, 2 * INTER, H]}
    engine = Correspondence(parameters=params, sources=sources, loads=loads)
    hf = Correspondence(
        parameters={
            "model.layers.0.mlp.gate.weight": {
                "module": "model.layers.0.mlp.gate",
                **sources[f"{base}.gate.weight"],
            },
            "model.layers.0.mlp.experts.gate_up_proj": {"shape": [4, 2 * INTER, H], "fingerprint": [9.0] * 8},
        }
    )
    return engine, hf


@pytest.mark.parametrize("routing", [False, True])
@pytest.mark.parametrize("gate_dumped", [True, False])
def test_moe_the_router_and_the_fused_experts_pair_and_nothing_per_expert(
    routing: bool, gate_dumped: bool
) -> None:
    """With the engine's routing recorded (the vLLM plugin, under the block), HF's top-k weights
    and ids are compared with it; without it, they are listed with the reason. HF's router logits
    are compared once: with the gate module's output where it was dumped (the recorded logits
    then listed with the reason), else with the recorded logits."""
    engine, hf = _moe_records()
    classes_a = {
        "model.layers.0.block_sparse_moe": "MixtralMoE",
        "model.layers.0.block_sparse_moe.gate": "GateLinear",
        "model.layers.0.block_sparse_moe.experts.gate": "GateLinear",
        "model.layers.0.block_sparse_moe.experts": "MoERunner",
        "model.layers.0.block_sparse_moe.experts.routed_experts": "RoutedExperts",
    }
    classes_b = {
        "model.layers.0.mlp": "MixtralSparseMoeBlock",
        "model.layers.0.mlp.gate": "MixtralTopKRouter",
        "model.layers.0.mlp.experts": "MixtralExperts",
        "model.layers.0.mlp.experts.act_fn": "SiLUActivation",
    }
    bridge = derive_bridge(
        engine, hf, framework_a="vllm", framework_b="transformers", classes_a=classes_a, classes_b=classes_b
    )
    gate = ["model.layers.0.block_sparse_moe.experts.gate[0]"] if gate_dumped else []
    names_a = [*gate, "model.layers.0.block_sparse_moe.experts", "model.layers.0.block_sparse_moe"]
    recorded = [
        f"model.layers.0.block_sparse_moe.routing[{w}]" for w in ("logits", "topk_weights", "topk_ids")
    ]
    names_a = gate + recorded + names_a[len(gate) :] if routing else names_a
    names_b = [
        "model.layers.0.mlp.gate[0]",
        "model.layers.0.mlp.gate[1]",
        "model.layers.0.mlp.gate[2]",
        "model.layers.0.mlp.experts.act_fn",
        "model.layers.0.mlp.experts",
        "model.layers.0.mlp",
    ]
    matched = Matcher(bridge=bridge, classes_a=classes_a, classes_b=classes_b).match(
        names_a, names_b, parse_options("x", "y")
    )
    pairs = _pairs(matched)
    expected = {
        "model.layers.0.block_sparse_moe.experts": "model.layers.0.mlp.experts",  # both: the routed sum
        "model.layers.0.block_sparse_moe": "model.layers.0.mlp",
    }
    if gate_dumped:  # the router, by its weights (the experts runner calls it: named under it)
        expected["model.layers.0.block_sparse_moe.experts.gate[0]"] = "model.layers.0.mlp.gate[0]"
    if routing:  # the engine's own routing against HF's router outputs, in HF's order
        expected[recorded[1]] = "model.layers.0.mlp.gate[1]"
        expected[recorded[2]] = "model.layers.0.mlp.gate[2]"
        if not gate_dumped:
            expected[recorded[0]] = "model.layers.0.mlp.gate[0]"
    assert pairs == expected
    compared_b = [n for p in matched.pairs for n in p.b.names]
    assert len(compared_b) == len(set(compared_b))  # each HF tensor once
    reasons = {u.name: u.reason for u in matched.leftovers}
    assert "fused experts" in reasons["model.layers.0.mlp.experts.act_fn"]
    left_a = {u.name for u in matched.leftovers if u.side == "A"}
    if routing and gate_dumped:
        assert left_a == {recorded[0]}
        assert "model.layers.0.block_sparse_moe.experts.gate[0]" in reasons[recorded[0]]
        assert "compared once" in reasons[recorded[0]]
    else:
        assert not left_a
    if not routing:
        assert "top-k" in reasons["model.layers.0.mlp.gate[2]"]


def test_an_embedding_scaled_inside_one_side_is_listed_not_compared_as_equal() -> None:
    classes_b = {**HF_CLASSES, "model.embed_tokens": "GemmaTextScaledWordEmbedding"}
    bridge = derive_bridge(_vllm_record(), _hf_record(), framework_a="vllm", framework_b="transformers",
                           classes_a=VLLM_CLASSES, classes_b=classes_b)  # fmt: skip
    matcher = Matcher(bridge=bridge, classes_a=VLLM_CLASSES, classes_b=classes_b)
    matched = matcher.match(VLLM_NAMES, HF_NAMES, parse_options("x", "y"))
    assert "model.embed_tokens" not in _pairs(matched)
    reasons = {(u.side, u.name): u.reason for u in matched.leftovers}
    assert "scale" in reasons[("A", "model.embed_tokens")] and "scale" in reasons[("B", "model.embed_tokens")]
    with_inputs = matcher.match(
        [*VLLM_NAMES, "model.layers.0.input_layernorm@in[0]"], HF_NAMES, parse_options("x", "y")
    )
    assert _pairs(with_inputs)["model.layers.0.input_layernorm@in[0]"] == "model.embed_tokens"


def _tp_records() -> list[Correspondence]:
    """A fused qkv_proj (q, k, v of 8 rows each) and a row-parallel o_proj on two ranks."""
    sources = {f"l.{x}_proj.weight": _src([H, H], 40 + k) for k, x in enumerate("qkvo")}
    records = []
    for rank in range(2):
        loads = [
            Load(param="l.qkv_proj.weight", source=f"l.{x}_proj.weight", shard=x,
                 region=[[k * 4, k * 4 + 4], [0, H]], rows=[[0, rank * 4, 4]])
            for k, x in enumerate("qkv")
        ]  # fmt: skip
        loads.append(
            Load(param="l.o_proj.weight", source="l.o_proj.weight", region=[[0, H], [0, 4]],
                 rows=[[0, 0, H]], cols=[rank * 4, rank * 4 + 4])
        )  # fmt: skip
        params = {"l.qkv_proj.weight": {"module": "l.qkv_proj", "shape": [12, H]}}
        records.append(
            Correspondence(parameters=params, sources=sources, loads=loads, tp_rank=rank, tp_size=2)
        )
    return records


def test_tensor_parallel_outputs_are_gathered_in_the_checkpoint_order() -> None:
    from tracedump.compare.pair.holdings import merged_holdings
    from tracedump.compare.pair.rank_joins import tensor_parallel_joins

    records = _tp_records()
    classes = {
        "l.attn": "Attention",
        "logits_processor": "LogitsProcessor",
        "l.qkv_proj": "QKVParallelLinear",
    }
    joins = {rule.pattern.pattern: rule for rule in tensor_parallel_joins(records, classes)}
    qkv = joins[r"^l\.qkv_proj(\[0\])?$"]
    # q of rank 0, q of rank 1, then k, then v: the single-rank layout [q | k | v]
    assert (qkv.op, qkv.pieces) == (
        "gather",
        ((0, 0, 4), (1, 0, 4), (0, 4, 8), (1, 4, 8), (0, 8, 12), (1, 8, 12)),
    )
    assert not any("o_proj" in p for p in joins)  # row-parallel: reduced, replicated
    assert joins[r"^l\.attn$"].op == "cat" and joins[r"^logits_processor(\[raw\])?$"].op == "first"
    assert all(p.whole for p in merged_holdings(records).pieces["l.qkv_proj"])  # so it splits


def test_a_gathered_entry_joins_the_ranks_pieces() -> None:
    import numpy as np

    from tracedump.compare.load.reader import Stored
    from tracedump.compare.load.sources import EntryMeta
    from tracedump.compare.options import UnshardRule
    from tracedump.compare.pair.unshard import assemble, plan_entry

    class View:  # the two methods plan_entry and assemble use
        def __init__(self, rank: int, array: np.ndarray) -> None:
            self.rank, self._array = rank, array
            self.entries = {"qkv[0]": EntryMeta("tensor", array.shape, "float32")}

        def array(self, name: str) -> Stored:
            return Stored(self._array, "float32")

    full = np.arange(2 * 12, dtype=np.float32).reshape(2, 12)  # [q0 q1 | k0 k1 | v0 v1], 2 each
    ranks = [np.concatenate([full[:, 0:2], full[:, 4:6], full[:, 8:10]], axis=1),
             np.concatenate([full[:, 2:4], full[:, 6:8], full[:, 10:12]], axis=1)]  # fmt: skip
    views = [View(r, a) for r, a in enumerate(ranks)]
    pieces = ((0, 0, 2), (1, 0, 2), (0, 2, 4), (1, 2, 4), (0, 4, 6), (1, 4, 6))
    rule = UnshardRule(re.compile("qkv"), "gather", -1, pieces)
    entry = plan_entry("qkv[0]", views, rule)  # type: ignore[arg-type]
    assert entry.meta.shape == (2, 12) and entry.problem is None
    assert np.array_equal(assemble(entry, views).array, full)  # type: ignore[arg-type]


def test_a_parameter_without_values_has_no_fingerprint() -> None:
    assert fingerprint(torch.empty(4, 4, device="meta")) == []
    assert fingerprint(torch.empty(0)) == []
    assert len(fingerprint(torch.arange(100.0))) == 8


def test_a_dropout_is_compared_as_the_tensor_it_returns() -> None:
    classes_b = {**HF_CLASSES, "model.layers.0.resid_attn_dropout": "Dropout"}
    names_b = [*HF_NAMES]
    names_b.insert(names_b.index("model.layers.0.self_attn[0]") + 1, "model.layers.0.self_attn[1]")
    names_b.insert(names_b.index("model.layers.0.self_attn[1]") + 1, "model.layers.0.resid_attn_dropout")
    bridge = derive_bridge(_vllm_record(), _hf_record(), framework_a="vllm", framework_b="transformers",
                           classes_a=VLLM_CLASSES, classes_b=classes_b)  # fmt: skip
    matched = Matcher(bridge=bridge, classes_a=VLLM_CLASSES, classes_b=classes_b).match(
        VLLM_NAMES, names_b, parse_options("x", "y")
    )
    found = {(p.a.label, p.b.label): p.how for p in matched.pairs}
    # its input is the attention's output (the probabilities, a tuple's second element, are not)
    assert found[("model.layers.0.self_attn", "model.layers.0.resid_attn_dropout")] == "identity"
    assert "model.layers.0.resid_attn_dropout" not in {u.name for u in matched.leftovers}


def test_two_runs_of_one_engine_get_no_derived_bridge() -> None:
    """vLLM against vLLM (a bug against a clean run): one tree, matched by name."""
    vllm = _vllm_record()
    kwargs: dict = {
        "framework_a": "vllm",
        "framework_b": "vllm",
        "classes_a": VLLM_CLASSES,
        "classes_b": VLLM_CLASSES,
    }
    assert derive_bridge(vllm, vllm, **kwargs) is None


def test_an_engine_that_names_its_parameters_as_the_checkpoint_does_still_gets_the_derived_bridge() -> None:
    """vLLM's Phi3 keeps HF's names (qkv_proj and gate_up_proj are fused in both): one parameter
    list on both sides, but an engine load on one only, and other classes everywhere. Name matching
    would call every module not comparable; the derived bridge pairs them."""
    hf = _hf_record()
    sources = {name: meta for name, meta in hf.parameters.items() if "same_as" not in meta}
    loads = [
        Load(param=name, source=name, region=[[0, d] for d in meta["shape"]], rows=[[0, 0, meta["shape"][0]]])
        for name, meta in sources.items()
    ]
    engine = Correspondence(parameters=dict(hf.parameters), sources=sources, loads=loads)
    assert set(engine.parameters) == set(hf.parameters) and engine.loads and not hf.loads  # the premise
    kwargs: dict = {
        "framework_a": "vllm",
        "framework_b": "transformers",
        "classes_a": VLLM_CLASSES,
        "classes_b": {name: f"transformers.{cls.rpartition('.')[2]}" for name, cls in VLLM_CLASSES.items()},
    }
    bridge = derive_bridge(engine, hf, **kwargs)
    assert bridge is not None
    matched = {rule.match.name for rule in bridge.rules if isinstance(rule.match, Tensors)}
    assert any("embed_tokens" in name for name in matched)
    assert any("o_proj" in name for name in matched)
