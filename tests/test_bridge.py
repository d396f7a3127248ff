"""The structural bridge (compare/pair/bridge.py) on hand-built dumps: every rule operation, captured
layer indices, no eval, bad rule files, not comparable by class, leftovers counted by reason, the
composition with --map, --bridge none, and the built-in vLLM/HF rules selected by the manifests."""

from __future__ import annotations

import builtins
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from tracedump.cli import main
from tracedump.compare import compare
from tracedump.compare.pair.bridge_rules import Template, builtin_bridges, load_bridge
from tracedump.errors import UsageError
from tracedump.store.format import ORDER_KEY, pass_file_name, pass_metadata

TOKENS, HIDDEN, KV, FF = 4, 8, 4, 6


def write_run(
    root: Path,
    passes: list[dict[str, torch.Tensor]],
    *,
    framework: str | None = None,
    model_class: str = "toy.LlamaForCausalLM",
    classes: dict[str, str] | None = None,
    batches: list[dict[str, list[Any]]] | None = None,
) -> Path:
    """A run dir as the dumper writes one: a manifest and one pass file per dict, in its order."""
    run = root / "rank0_pid1"
    run.mkdir(parents=True)
    manifest: dict[str, Any] = {
        "format": "1",
        "model_class": model_class,
        "root": model_class.rsplit(".", 1)[-1],
        "rank": 0,
        "world_size": 1,
        "settings": {"mode": "full", "token_dim": 0},
        "complete": True,
    }
    if framework is not None:
        manifest["framework"] = framework
    if classes is not None:
        manifest["module_classes"] = classes
    (run / "manifest.json").write_text(json.dumps(manifest))
    for index, tensors in enumerate(passes):
        batch = json.dumps(batches[index]) if batches else None
        metadata = pass_metadata(index, "full", batch=batch)
        metadata[ORDER_KEY] = json.dumps(list(tensors))
        stored = {k: v.contiguous().clone() for k, v in tensors.items()}  # no shared memory in a file
        save_file(stored, run / pass_file_name(index), metadata=metadata)
    return root


def toy_pair(seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """An engine's tensors (A: fused, tuples, deferred residual) and a reference's (B) that the toy
    rule file below relates exactly."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    q, k, v = r(1, TOKENS, HIDDEN), r(1, TOKENS, KV), r(1, TOKENS, KV)
    gate, up = r(1, TOKENS, FF), r(1, TOKENS, FF)
    hidden, residual, o, ln = r(TOKENS, HIDDEN), r(TOKENS, HIDDEN), r(1, TOKENS, HIDDEN), r(1, TOKENS, HIDDEN)
    act = torch.nn.functional.silu(gate)
    b = {
        "layers.0.ln": ln,
        "layers.0.q": q,
        "layers.0.k": k,
        "layers.0.v": v,
        "layers.0.o": o,
        "layers.0.gate": gate,
        "layers.0.act": act,
        "layers.0.up": up,
        "layers.0.cos": r(1, TOKENS, 2),
        "layers.0": (hidden + residual)[None],
    }
    a = {
        "layers.0.norm": ln[0],
        "layers.0.qkv[0]": torch.cat([q, k, v], -1)[0],
        "layers.0.rot": r(TOKENS, HIDDEN),
        "layers.0.o[0]": o[0],
        "layers.0.o[1]": r(HIDDEN),
        "layers.0.gate_up": torch.cat([gate, up], -1)[0],
        "layers.0.act": (act * up)[0],
        "layers.0[0]": hidden,
        "layers.0[1]": residual,
    }
    return a, b


TOY_RULES = """
[bridge]
name = "toy"
a = "engine"
b = "reference"

[[rule]]
op = "rename"
match = 'layers\\.(\\d+)\\.norm'
b = "layers.{1}.ln"

[[rule]]
op = "split"
id = "qkv"
match = 'layers\\.(\\d+)\\.qkv\\[0\\]'
b = ["layers.{1}.q", "layers.{1}.k", "layers.{1}.v"]

[[rule]]
op = "unwrap"
match = 'layers\\.(\\d+)\\.o'

[[rule]]
op = "concat"
match = 'layers\\.(\\d+)\\.gate_up'
b = ["layers.{1}.gate", "layers.{1}.up"]

[[rule]]
op = "product"
match = 'layers\\.(\\d+)\\.act'
b = ["layers.{1}.act", "layers.{1}.up"]

[[rule]]
op = "sum"
match = 'layers\\.(\\d+)\\[0\\]'
a = ["{0}", "layers.{1}[1]"]
b = "layers.{1}"

[[rule]]
op = "skip"
match = 'layers\\.(\\d+)\\.rot'
reason = "rotary applied in place"

[[rule]]
op = "skip"
side = "b"
match = 'layers\\.(\\d+)\\.cos'
reason = "cos table"
"""


@pytest.fixture
def toy(tmp_path: Path) -> dict[str, Path]:
    a, b = toy_pair()
    rules = tmp_path / "toy.toml"
    rules.write_text(TOY_RULES)
    return {
        "a": write_run(tmp_path / "a", [a], framework="engine"),
        "b": write_run(tmp_path / "b", [b], framework="reference"),
        "rules": rules,
    }


def by_name(report: Any) -> dict[str, Any]:
    return {r.name: r for r in report.results}


def test_every_operation_pairs_what_it_says(toy: dict[str, Path]) -> None:
    report = compare(toy["a"], toy["b"], bridge=toy["rules"])
    results = by_name(report)
    assert report.exit_code == 0, [(r.name, r.status, r.message) for r in report.results]
    expected = {
        "layers.0.norm": ("layers.0.ln", "rename"),
        "layers.0.qkv[0][0:8]": ("layers.0.q", "split -1"),
        "layers.0.qkv[0][8:12]": ("layers.0.k", "split -1"),
        "layers.0.qkv[0][12:16]": ("layers.0.v", "split -1"),
        "layers.0.o[0]": ("layers.0.o", "unwrap [0]"),
        "layers.0.gate_up": ("cat(layers.0.gate, layers.0.up, dim=-1)", "concat"),
        "layers.0.act": ("layers.0.act * layers.0.up", "product"),
        "layers.0[0] + layers.0[1]": ("layers.0", "sum"),
    }
    assert set(results) == set(expected)
    for name, (name_b, how) in expected.items():
        result = results[name]
        assert result.name_b == name_b
        assert result.status == "ok" and result.metrics.rel_diff < 1e-12, name
        assert result.bridge is not None and result.bridge.startswith(how), result.bridge
    assert results["layers.0.qkv[0][8:12]"].shape_a == (TOKENS, KV)  # the piece is k_proj's size
    skipped = {u.name: u.reason for u in report.plan.only_in_a}
    assert "rotary applied in place" in skipped["layers.0.rot"]
    assert "(out, bias) tuple" in skipped["layers.0.o[1]"]  # unwrap drops the other element
    assert "cos table" in {u.name: u.reason for u in report.plan.only_in_b}["layers.0.cos"]


def test_the_table_shows_how_each_tensor_was_bridged(
    toy: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["diff", str(toy["a"]), str(toy["b"]), "--bridge", str(toy["rules"])])
    out = capsys.readouterr().out
    assert code == 0
    assert "bridged" in out and "split -1" in out and "product" in out and "unwrap [0]" in out
    assert "8 tensors bridged" in out
    assert "only in A (1, skipped by rule 7: rotary applied in place): layers.0.rot" in out


def test_a_bug_in_one_split_piece_is_named_at_that_piece(toy: dict[str, Path], tmp_path: Path) -> None:
    a, _b = toy_pair()
    a["layers.0.qkv[0]"] = a["layers.0.qkv[0]"].clone()
    a["layers.0.qkv[0]"][:, 9] += 0.5  # inside k's columns
    buggy = write_run(tmp_path / "buggy", [a], framework="engine")
    report = compare(buggy, toy["b"], bridge=toy["rules"])
    results = by_name(report)
    assert report.exit_code == 1
    assert report.first_divergence.name == "layers.0.qkv[0][8:12]"
    assert report.first_divergence.name_b == "layers.0.k"
    assert results["layers.0.qkv[0][0:8]"].status == "ok"
    assert results["layers.0.qkv[0][12:16]"].status == "ok"


def test_split_sizes_that_do_not_add_up_are_an_error_not_a_guess(
    toy: dict[str, Path], tmp_path: Path
) -> None:
    a, _b = toy_pair()
    a["layers.0.qkv[0]"] = a["layers.0.qkv[0]"][:, :14]  # 14 columns for pieces of 8 + 4 + 4
    short = write_run(tmp_path / "short", [a], framework="engine")
    results = by_name(compare(short, toy["b"], bridge=toy["rules"]))
    assert results["layers.0.qkv[0][12:16]"].status == "error"
    assert "split" in results["layers.0.qkv[0][12:16]"].message


RESIDUAL_RULES = """
[[rule]]
op = "rename"
match = 'layers\\.(\\d+)\\.resid'
b = "layers.{1-1}"

[[rule]]
op = "rename"
match = 'layers\\.0\\.resid'
b = "embed"

[[rule]]
op = "rename"
match = 'layers\\.(\\d+)\\.out'
b = "layers.{1}"
"""


def test_captured_layer_indices_and_offsets_fill_the_counterpart(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(1)
    embed = torch.randn(TOKENS, HIDDEN, generator=g)
    outs = [torch.randn(TOKENS, HIDDEN, generator=g) for _ in range(3)]
    a: dict[str, torch.Tensor] = {}
    b: dict[str, torch.Tensor] = {"embed": embed[None]}
    for n in range(3):
        a[f"layers.{n}.resid"] = embed if n == 0 else outs[n - 1]  # layer n's input: layer n-1's output
        a[f"layers.{n}.out"] = outs[n]
        b[f"layers.{n}"] = outs[n][None]
    rules = tmp_path / "r.toml"
    rules.write_text(RESIDUAL_RULES)
    report = compare(write_run(tmp_path / "a", [a]), write_run(tmp_path / "b", [b]), bridge=rules)
    pairs = {r.name: r.name_b for r in report.results}
    assert pairs == {
        "layers.0.resid": "embed",  # layer 0 has no layer -1: the next rule applies
        "layers.0.out": "layers.0",
        "layers.1.resid": "layers.0",
        "layers.1.out": "layers.1",
        "layers.2.resid": "layers.1",
        "layers.2.out": "layers.2",
    }
    assert report.exit_code == 0


def test_templates_are_text_never_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import re

    found = re.fullmatch(r"layers\.(\d+)", "layers.7")
    assert found is not None
    assert Template("x.{1+2}").fill(found) == "x.9"
    assert Template("x.{1-8}").fill(found) is None  # no layer -1
    assert Template("x.{1*2}.{__import__}").fill(found) == "x.{1*2}.{__import__}"  # literal text

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the bridge evaluated something")

    monkeypatch.setattr(builtins, "eval", refuse)
    monkeypatch.setattr(builtins, "exec", refuse)
    a, b = toy_pair()
    rules = tmp_path / "toy.toml"
    rules.write_text(TOY_RULES)
    report = compare(write_run(tmp_path / "a", [a]), write_run(tmp_path / "b", [b]), bridge=rules)
    assert report.exit_code == 0


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[[rule]]\nop = 'splt'\nmatch = 'x'\nb = 'y'\n", "rule 1: op 'splt': choose rename"),
        ("[[rule]]\nop = 'rename'\nmatch = 'x('\nb = 'y'\n", "rule 1: match 'x(': invalid regex"),
        ("[[rule]]\nop = 'rename'\nmach = 'x'\nb = 'y'\n", "rule 1: unknown key 'mach'"),
        ("[[rule]]\nop = 'rename'\nmatch = 'x'\nb = 'y.{2}'\n", "uses group 2, but match has 0"),
        ("[[rule]]\nop = 'skip'\nmatch = 'x'\n", "skip needs a 'reason'"),
        ("[[rule]]\nop = 'split'\nmatch = 'x'\nb = 'y'\n", "split needs at least two pieces"),
        (
            "[[rule]]\nop = 'sum'\nmatch = 'x'\nb = 'y'\ndim = \"__import__('os')\"\n",
            "'dim' must be an integer",
        ),
        ("[[rule]]\nop = 'rename'\nmatch = 'x'\n", "rename needs 'b'"),
        ("[[rule]\nop = 'rename'\n", "not valid TOML"),
        ("[bridge]\nname = 'empty'\n", "no [[rule]] entries"),
    ],
)
def test_a_bad_rule_file_is_one_line_and_exit_2(
    toy: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str
) -> None:
    rules = tmp_path / "bad.toml"
    rules.write_text(text)
    code = main(["diff", str(toy["a"]), str(toy["b"]), "--bridge", str(rules)])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and err.startswith(f"tracedump diff: --bridge {rules}"), err
    assert message in err
    with pytest.raises(UsageError, match="--bridge"):
        load_bridge(rules)


def test_a_missing_rule_file_is_exit_2(toy: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["diff", str(toy["a"]), str(toy["b"]), "--bridge", "/nonexistent/rules.toml"]) == 2
    assert "cannot read it" in capsys.readouterr().err


def test_a_json_rule_file_works_like_toml(toy: dict[str, Path], tmp_path: Path) -> None:
    rules = tmp_path / "rules.json"
    rules.write_text(
        json.dumps(
            {
                "rule": [
                    {
                        "op": "split",
                        "match": r"layers\.(\d+)\.qkv\[0\]",
                        "b": ["layers.{1}.q", "layers.{1}.k", "layers.{1}.v"],
                    }
                ]
            }
        )
    )
    report = compare(toy["a"], toy["b"], bridge=rules)
    assert {r.name_b for r in report.results if r.bridge} == {"layers.0.q", "layers.0.k", "layers.0.v"}


def test_one_name_two_classes_known_to_differ_and_no_rule_is_never_compared(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    g = torch.Generator().manual_seed(2)
    gate = torch.randn(TOKENS, FF, generator=g)
    a = {"mlp.act_fn": torch.nn.functional.silu(gate) * 2.0, "mlp.down": gate}
    b = {"mlp.act_fn": torch.nn.functional.silu(gate), "mlp.down": gate}
    side_a = write_run(tmp_path / "a", [a], classes={"mlp.act_fn": "SiluAndMul", "mlp.down": "Linear"})
    side_b = write_run(tmp_path / "b", [b], classes={"mlp.act_fn": "SiLUActivation", "mlp.down": "Linear"})
    code = main(["diff", str(side_a), str(side_b), "--json", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    data = json.loads((tmp_path / "r.json").read_text())
    act = next(t for t in data["tensors"] if t["name"] == "mlp.act_fn")
    assert act["status"] == "not_comparable" and act["rel_diff"] is None  # never measured
    assert "SiluAndMul" in act["message"] and "SiLUActivation" in act["message"]
    assert data["summary"]["not_comparable"] == 1
    assert code == 0  # what was compared agrees; the rest is listed
    assert "not comparable (1): mlp.act_fn (A SiluAndMul vs B SiLUActivation)" in out
    assert "act(gate) * up" in act["message"]  # the reason: known to compute other quantities
    # dumps without module_classes (written before format 1.1): compared as before
    old_a, old_b = write_run(tmp_path / "oa", [a]), write_run(tmp_path / "ob", [b])
    report = compare(old_a, old_b)
    assert by_name(report)["mlp.act_fn"].status == "diverged"


def test_qualified_class_names_compare_by_their_last_part(tmp_path: Path) -> None:
    a = {"block": torch.ones(TOKENS, HIDDEN)}
    side_a = write_run(tmp_path / "a", [a], classes={"block": "Outer.Block"})
    side_b = write_run(tmp_path / "b", [a], classes={"block": "Block"})
    assert by_name(compare(side_a, side_b))["block"].status == "ok"


def test_every_leftover_is_counted_by_reason_in_the_json(toy: dict[str, Path], tmp_path: Path) -> None:
    a, b = toy_pair()
    a["layers.0.extra"] = torch.ones(TOKENS, HIDDEN)
    del b["layers.0.up"]  # the product and the concat lose their counterpart
    side_a = write_run(tmp_path / "a2", [a])
    side_b = write_run(tmp_path / "b2", [b])
    out = tmp_path / "r.json"
    assert main(["diff", str(side_a), str(side_b), "--bridge", str(toy["rules"]), "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    leftovers = data["summary"]["leftovers"]["A"]
    assert leftovers["no tensor of that name in B"] == 1  # layers.0.extra
    assert leftovers["rule 4: B has no layers.0.up"] == 1  # the concat, which no other rule could take
    assert leftovers["rule 5: B has no layers.0.up"] == 1
    assert sum(leftovers.values()) == len(data["only_in_a"]) == data["summary"]["only_in_a"]
    reasons = {u["name"]: u.get("reason") for u in data["only_in_a"]}
    assert reasons["layers.0.act"] == "rule 5: B has no layers.0.up"
    assert reasons["layers.0.extra"] is None  # the plain case carries no reason
    assert data["summary"]["leftovers"]["B"]["skipped by rule 8: cos table"] == 1


def test_map_renames_first_and_the_rules_see_the_mapped_names(toy: dict[str, Path], tmp_path: Path) -> None:
    a, _b = toy_pair()
    ported = {name.replace("layers.", "blocks."): t for name, t in a.items()}
    side_a = write_run(tmp_path / "port", [ported])
    report = compare(side_a, toy["b"], bridge=toy["rules"], maps=[r"^blocks\.=layers."])
    results = by_name(report)
    assert report.exit_code == 0
    assert results["blocks.0.qkv[0][8:12]"].name_b == "layers.0.k"  # A's own name in the table
    assert results["blocks.0[0] + blocks.0[1]"].name_b == "layers.0"
    # a --map onto B's name of a bridged tensor wins over the rule: the rules see mapped names
    report = compare(side_a, toy["b"], bridge=toy["rules"], maps=[r"^blocks\.=layers.", r"\.act$=.up"])
    assert by_name(report)["blocks.0.act"].name_b == "layers.0.up"


# ------------------------------------------------------------------ the built-in vLLM/HF bridge


def vllm_and_hf(layers: int = 2, seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """vLLM-like and HF-like tensors of a Llama with the relations the built-in rules assume."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    embed = r(TOKENS, HIDDEN)
    a: dict[str, torch.Tensor] = {"model.embed_tokens": embed}
    b: dict[str, torch.Tensor] = {"model.embed_tokens": embed[None], "model.rotary_emb[0]": r(1, TOKENS, 2)}
    layer_in = embed
    for n in range(layers):
        p = f"model.layers.{n}"
        ln, q, k, v, attn, o = (
            r(TOKENS, HIDDEN),
            r(TOKENS, HIDDEN),
            r(TOKENS, KV),
            r(TOKENS, KV),
            r(TOKENS, HIDDEN),
            r(TOKENS, HIDDEN),
        )
        post, gate, up, down = r(TOKENS, HIDDEN), r(TOKENS, FF), r(TOKENS, FF), r(TOKENS, HIDDEN)
        mid = layer_in + o  # the residual after attention
        out = mid + down
        if n == 0:
            a[f"{p}.input_layernorm"] = ln
        else:
            a[f"{p}.input_layernorm[0]"], a[f"{p}.input_layernorm[1]"] = ln, layer_in
        a[f"{p}.self_attn.qkv_proj[0]"] = torch.cat([q, k, v], -1)
        a[f"{p}.self_attn.rotary_emb[0]"] = r(TOKENS, HIDDEN)
        a[f"{p}.self_attn.attn"] = attn
        a[f"{p}.self_attn.o_proj[0]"] = o
        a[f"{p}.self_attn"] = o
        a[f"{p}.post_attention_layernorm[0]"], a[f"{p}.post_attention_layernorm[1]"] = post, mid
        a[f"{p}.mlp.gate_up_proj[0]"] = torch.cat([gate, up], -1)
        a[f"{p}.mlp.act_fn"] = torch.nn.functional.silu(gate) * up
        a[f"{p}.mlp.down_proj[0]"] = down
        a[f"{p}.mlp"] = down
        a[f"{p}[0]"], a[f"{p}[1]"] = down, mid
        for name, t in (
            ("input_layernorm", ln),
            ("self_attn.q_proj", q),
            ("self_attn.k_proj", k),
            ("self_attn.v_proj", v),
            ("self_attn.o_proj", o),
            ("self_attn[0]", o),
            ("post_attention_layernorm", post),
            ("mlp.gate_proj", gate),
            ("mlp.act_fn", torch.nn.functional.silu(gate)),
            ("mlp.up_proj", up),
            ("mlp.down_proj", down),
            ("mlp", down),
        ):
            b[f"{p}.{name}"] = t[None]
        b[p] = out[None]
        layer_in = out
    final = r(TOKENS, HIDDEN)
    a["model.norm[0]"], a["model.norm[1]"] = final, layer_in
    b["model.norm"] = final[None]
    return a, b


VLLM_CLASSES = {"model.layers.0.mlp.act_fn": "SiluAndMul", "model.layers.1.mlp.act_fn": "SiluAndMul"}
HF_CLASSES = {"model.layers.0.mlp.act_fn": "SiLUActivation", "model.layers.1.mlp.act_fn": "SiLUActivation"}


@pytest.fixture
def engines(tmp_path: Path) -> dict[str, Path]:
    a, b = vllm_and_hf()
    return {
        "vllm": write_run(
            tmp_path / "vllm",
            [a],
            framework="vllm",
            model_class="vllm.model_executor.models.llama.LlamaForCausalLM",
            classes=VLLM_CLASSES,
        ),
        "hf": write_run(
            tmp_path / "hf",
            [b],
            framework="transformers",
            model_class="transformers.models.llama.modeling_llama.LlamaForCausalLM",
            classes=HF_CLASSES,
        ),
    }


def test_the_builtin_bridge_applies_to_vllm_against_hf_with_no_flag(engines: dict[str, Path]) -> None:
    report = compare(engines["vllm"], engines["hf"], align="passes")
    results = by_name(report)
    assert report.exit_code == 0, [(r.name, r.status, r.message) for r in report.results if r.status != "ok"]
    assert report.bridge is not None and report.bridge["name"] == "vllm-transformers-llama"
    assert results["model.layers.1.self_attn.qkv_proj[0][8:12]"].name_b == "model.layers.1.self_attn.k_proj"
    assert results["model.layers.0.mlp.gate_up_proj[0][0:6]"].name_b == "model.layers.0.mlp.gate_proj"
    assert (
        results["model.layers.0.mlp.act_fn"].name_b
        == "model.layers.0.mlp.act_fn * model.layers.0.mlp.up_proj"
    )
    assert results["model.layers.1[0] + model.layers.1[1]"].name_b == "model.layers.1"
    assert results["model.layers.1.input_layernorm[1]"].name_b == "model.layers.0"  # the deferred residual
    assert results["model.layers.0.post_attention_layernorm[1]"].name_b == (
        "model.embed_tokens + model.layers.0.self_attn[0]"
    )
    assert results["model.layers.0.self_attn.o_proj[0]"].name_b == "model.layers.0.self_attn.o_proj"
    assert all(r.status == "ok" and r.bridge for r in report.results)
    left = report.leftovers_by_reason()
    assert sum(left["A"].values()) == 2 * 2 + 1  # rotary and attention core per layer, model.norm[1]
    assert sum(left["B"].values()) == 1  # HF's rotary cos/sin


def test_the_builtin_bridge_also_applies_the_other_way_round(engines: dict[str, Path]) -> None:
    report = compare(engines["hf"], engines["vllm"], align="passes")
    results = by_name(report)
    assert report.exit_code == 0
    assert results["model.layers.1.self_attn.k_proj"].name_b == "model.layers.1.self_attn.qkv_proj[0][8:12]"


def test_old_manifests_are_recognised_by_their_model_class(tmp_path: Path) -> None:
    a, b = vllm_and_hf()
    side_a = write_run(tmp_path / "a", [a], model_class="vllm.model_executor.models.llama.LlamaForCausalLM")
    side_b = write_run(
        tmp_path / "b", [b], model_class="transformers.models.llama.modeling_llama.LlamaForCausalLM"
    )
    report = compare(side_a, side_b, align="passes")
    assert report.bridge is not None and report.exit_code == 0


def test_bridge_none_turns_it_off(engines: dict[str, Path]) -> None:
    report = compare(engines["vllm"], engines["hf"], align="passes", bridge="none")
    results = by_name(report)
    assert report.bridge is None and not any(r.bridge for r in report.results)
    assert results["model.layers.0.mlp.act_fn"].status == "not_comparable"  # SiluAndMul vs SiLUActivation
    assert "model.layers.0.self_attn.qkv_proj[0]" in {u.name for u in report.plan.only_in_a}
    assert report.settings["bridge"] == "none"


def test_a_bridge_chooses_token_alignment_when_none_is_asked(
    engines: dict[str, Path], tmp_path: Path
) -> None:
    assert builtin_bridges()[0].align == "tokens"
    report = compare(engines["vllm"], engines["hf"])  # no align given: the bridge's
    assert report.settings["align"] == "tokens" and report.alignment is not None
    assert report.exit_code == 0


def test_the_engine_page_shows_every_built_in_rule() -> None:
    page = (Path(__file__).resolve().parent.parent / "docs" / "engines.md").read_text()
    section = page[page.index("### The built-in rules") :]
    for bridge in builtin_bridges():
        for rule in bridge.rules:
            row = f"| {rule.number} | {rule.id} | {rule.op} |"
            assert row in section, row
            assert rule.match.pattern.replace("|", "\\|") in section, rule.match.pattern


def test_a_fused_tensor_longer_than_its_pieces_is_an_error_not_a_dropped_remainder(
    toy: dict[str, Path], tmp_path: Path
) -> None:
    a, _b = toy_pair()
    a["layers.0.qkv[0]"] = torch.cat([a["layers.0.qkv[0]"], torch.ones(TOKENS, 2)], -1)  # 18 columns
    longer = write_run(tmp_path / "longer", [a], framework="engine")
    results = by_name(compare(longer, toy["b"], bridge=toy["rules"]))
    pieces = [r for name, r in results.items() if name.startswith("layers.0.qkv[0][")]
    assert len(pieces) == 3 and all(r.status == "error" for r in pieces)
    assert "add up to 16" in pieces[0].message and "has 18" in pieces[0].message


def test_a_map_rule_and_a_name_pair_two_classes(tmp_path: Path) -> None:
    """A class difference alone is no reason not to compare: the ``--map`` pair is compared (the
    user's rule, ``paired_by`` map), so is the pair of one name (``paired_by`` name), the two
    classes on its row."""
    a = {"blocks.0.norm": torch.ones(TOKENS, HIDDEN), "model.layers.0.norm": torch.ones(TOKENS, HIDDEN)}
    b = {
        "model.layers.0.input_layernorm": torch.ones(1, TOKENS, HIDDEN),
        "model.layers.0.norm": torch.ones(TOKENS, HIDDEN),
    }
    side_a = write_run(
        tmp_path / "a", [a], classes={"blocks.0.norm": "RMSNorm", "model.layers.0.norm": "RMSNorm"}
    )
    side_b = write_run(
        tmp_path / "b",
        [b],
        classes={"model.layers.0.input_layernorm": "LlamaRMSNorm", "model.layers.0.norm": "LlamaRMSNorm"},
    )
    results = by_name(compare(side_a, side_b, maps=[r"^blocks\.0\.norm$=model.layers.0.input_layernorm"]))
    assert results["blocks.0.norm"].status == "ok"  # the user's --map said these two compare
    assert results["blocks.0.norm"].paired_by == "map"
    norm = results["model.layers.0.norm"]
    assert norm.status == "ok" and norm.paired_by == "name"  # same name, two classes: compared
    assert norm.pairing == "classes: A RMSNorm, B LlamaRMSNorm"
