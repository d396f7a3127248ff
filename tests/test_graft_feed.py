"""Grafting an engine whose modules take the reference's values in another form.

An engine-style model (vLLM's shape: decoder layers called ``layer(positions, hidden_states,
residual)`` returning ``(hidden, residual)``, norms that add the residual inside, ``norm(x,
residual)``) is grafted from a reference-style model (HF's shape: each layer takes and returns the
whole residual stream) holding the same weights. Fed by input path, nothing lines up; fed as the
engine integration describes (:mod:`tracedump.integrations.vllm_graft`, duck-typed, no vLLM
needed), each layer takes the stream with a zero residual and each fused add + norm adds it once.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import tracedump
from tracedump.compare import compare
from tracedump.dump.graft_feed import ZERO, InputFeed, fed_paths
from tracedump.errors import GraftFeedRefused
from tracedump.integrations.vllm_graft import graft_feeds
from tracedump.store.correspondence import Correspondence, Load, module_counterparts

HIDDEN, LAYERS, TOKENS = 16, 3, 5
LEVEL = r"layers\.\d+$"


# ------------------------------------------------------------------ fed_paths alone


def test_a_feed_takes_by_parameter_zeroes_the_residual_and_keeps_the_rest() -> None:
    feed = InputFeed(
        params=("positions", "hidden_states", "residual"),
        take={"hidden_states": ("[0]", "[hidden_states]")},
        zero=frozenset({"residual"}),
    )
    fed, kept = fed_paths(feed, ["[0]", "[1]", "[2]"], {"[0]", "[attention_mask]"})
    assert fed == {"[1]": "[0]", "[2]": ZERO} and kept == ["[0]"]
    by_keyword = fed_paths(feed, ["[positions]", "[hidden_states]", "[residual]"], {"[hidden_states]"})
    assert by_keyword == ({"[hidden_states]": "[hidden_states]", "[residual]": ZERO}, ["[positions]"])


def test_a_feed_refuses_a_refused_module_a_missing_input_and_a_call_with_nothing_to_take() -> None:
    with pytest.raises(GraftFeedRefused, match="attention op"):
        fed_paths(InputFeed(refuse="the attention op"), ["[0]"], {"[0]"})
    feed = InputFeed(params=("x", "residual"), take={"x": ("[0]",)}, zero=frozenset({"residual"}))
    with pytest.raises(GraftFeedRefused, match=r"input x \(\[0\]\) takes the reference's \[0\]"):
        fed_paths(feed, ["[0]", "[1]"], {"[weight]"})
    with pytest.raises(GraftFeedRefused, match="no input of this call"):
        fed_paths(feed, ["[1]"], {"[0]"})  # only the residual: nothing from the reference


# ------------------------------------------------------------------ two model shapes, one set of weights


def _rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight


class RefNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(1 + 0.3 * torch.randn(HIDDEN))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return _rms(hidden_states, self.weight)


class RefLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = RefNorm(), RefNorm()
        self.attn, self.mlp = nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, HIDDEN)

    def forward(self, hidden_states: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        hidden_states = hidden_states + self.attn(self.input_layernorm(hidden_states))
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class RefModel(nn.Module):
    """HF's shape: ``[1, tokens, hidden]``, each layer takes and returns the whole stream."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(32, HIDDEN)
        self.layers = nn.ModuleList(RefLayer() for _ in range(LAYERS))
        self.norm = RefNorm()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[-1])[None]
        hidden = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden = layer(hidden, position_ids=positions)
        return self.norm(hidden)


class RMSNorm(nn.Module):
    """vLLM's shape: ``forward(*args)`` dispatching to ``forward_native(x, residual=None)``."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(HIDDEN))

    def forward(self, *args: torch.Tensor | None) -> object:
        return self.forward_native(*args)

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return _rms(x, self.weight)
        x = x + residual
        return _rms(x, self.weight), x


class SiluAndMul(nn.Module):
    """A weightless fused activation the reference has no module input for."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class EngineLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(), RMSNorm()
        self.attn, self.mlp = nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.act = SiluAndMul()

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden_states = hidden_states, self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.attn(hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.act(self.mlp(hidden_states)), residual


class EngineModel(nn.Module):
    """vLLM's shape: ``[tokens, hidden]`` rows, the residual add deferred to the next norm."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(32, HIDDEN)
        self.layers = nn.ModuleList(EngineLayer() for _ in range(LAYERS))
        self.norm = RMSNorm()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[0])
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        return self.norm(hidden, residual)[0]


IDS = torch.tensor([1, 5, 9, 3, 7])


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[RefModel, EngineModel, Path]:
    torch.manual_seed(0)
    ref = RefModel().eval()
    engine = EngineModel().eval()
    engine.load_state_dict(ref.state_dict())  # one set of weights under the same names
    out = tmp_path_factory.mktemp("feed") / "ref"
    dumper = tracedump.attach(ref, {"dir": str(out), "modules": "all", "inputs": True})
    assert dumper is not None
    with torch.no_grad(), dumper.step():
        ref(IDS[None])
    dumper.close()
    return ref, engine, out


def _graft(engine: nn.Module, ref: Path, out: Path, level: str | None, feeds: bool) -> tracedump.Run:
    with tracedump.graft(engine, ref, dir=out, level=level) as g:
        if feeds:
            g.dumper.set_graft_feeds(graft_feeds(engine))
        with torch.no_grad():
            g.run(IDS)
    return tracedump.open_dump(out).run()


def _graft_record(run: tracedump.Run) -> dict[str, object]:
    return json.loads((run.path / "manifest.json").read_text())["graft"]


def test_fed_by_input_path_an_engine_layer_meets_positions_and_nothing_is_grafted(models, tmp_path) -> None:
    _, engine, ref = models
    record = _graft_record(_graft(engine, ref, tmp_path / "g", LEVEL, feeds=False))
    assert record["grafted_calls"] == {}
    assert record["not_grafted"]["layers.0"]["listed"][0]["reason"].startswith("input [0] has shape [5] here")


def test_each_engine_layer_takes_the_reference_stream_with_a_zero_residual(models, tmp_path) -> None:
    _, engine, ref = models
    run = _graft(engine, ref, tmp_path / "g", LEVEL, feeds=True)
    record = _graft_record(run)
    layers = [f"layers.{i}" for i in range(LAYERS)]
    assert record["grafted_calls"] == {name: 1 for name in layers} and record["not_grafted"] == {}
    assert record["kept_own_inputs"] == {name: ["[0]"] for name in layers}  # positions: its own
    assert "residual <- 0" in record["feeds"]["layers.1"]
    a, b = run.passes[0], tracedump.open_dump(ref).run().passes[0]
    for name in layers:
        assert torch.equal(a[f"{name}@in[1]"], b[f"{name}@in[0]"][0])  # the stream, as given
        if name != "layers.0":
            assert not a[f"{name}@in[2]"].any()  # the deferred residual: zero, so it counts once
        stream = a[f"{name}[0]"] + a[f"{name}[1]"]
        torch.testing.assert_close(stream, b[name][0], rtol=1e-6, atol=1e-6)  # its own error: none


def test_a_fused_add_norm_grafted_at_leaf_level_adds_the_residual_once(models, tmp_path) -> None:
    _, engine, ref = models
    run = _graft(engine, ref, tmp_path / "g", None, feeds=True)
    record = _graft_record(run)
    a, b = run.passes[0], tracedump.open_dump(ref).run().passes[0]
    norm = "layers.1.post_attention_layernorm"
    assert record["grafted_calls"][norm] == 1
    torch.testing.assert_close(a[f"{norm}[1]"], b[f"{norm}@in[0]"][0], rtol=0, atol=0)  # the stream
    torch.testing.assert_close(a[f"{norm}[0]"], b[norm][0], rtol=1e-6, atol=1e-6)
    assert not a[f"{norm}@in[1]"].any()
    reason = record["not_grafted"]["layers.1.act"]["listed"][0]["reason"]
    assert reason.startswith("vLLM's fused act(gate) * up")  # refused, with the reason


def test_without_the_feed_the_fused_add_norm_counts_the_residual_twice(models, tmp_path) -> None:
    """The premise of the fix: fed by path, the norm takes the stream as x and adds its own residual."""
    _, engine, ref = models
    run = _graft(engine, ref, tmp_path / "g", None, feeds=False)
    a, b = run.passes[0], tracedump.open_dump(ref).run().passes[0]
    norm = "layers.1.post_attention_layernorm"
    assert a[f"{norm}@in[1]"].abs().max() > 0.1
    assert not torch.allclose(a[f"{norm}[1]"], b[f"{norm}@in[0]"][0], atol=1e-3)


BRIDGE = """
[bridge]
name = "engine-shape"
a = "engine"
b = "reference"
align = "tokens"

[[rule]]
op = "sum"
id = "decoder layer"
match = 'layers\\.(\\d+)\\[0\\]'
a = ["{0}", "layers.{1}[1]"]
b = "layers.{1}"
"""


@pytest.mark.parametrize("bug", [False, True], ids=["clean", "bug in layer 1"])
def test_a_grafted_engine_is_judged_layer_by_layer_pass_by_pass(models, tmp_path, bug) -> None:
    """The diff of a grafted run compares pass by pass even where the bridge would align tokens,
    and names a bug at its layer only."""
    _, engine, ref = models
    bridge = tmp_path / "bridge.toml"
    bridge.write_text(BRIDGE)
    weight = engine.layers[1].mlp.weight
    saved = weight.detach().clone()
    try:
        if bug:
            with torch.no_grad():
                weight.mul_(1.05)
        _graft(engine, ref, tmp_path / "g", LEVEL, feeds=True)
    finally:
        with torch.no_grad():
            weight.copy_(saved)
    report = compare(tmp_path / "g", ref, bridge=bridge)
    assert report.settings["align"] == "passes"
    layers = [r for r in report.results if r.name_b in {f"layers.{i}" for i in range(LAYERS)}]
    assert [r.name for r in layers] == [f"layers.{i}[0] + layers.{i}[1]" for i in range(LAYERS)]
    assert all(r.local and r.grafted_at == r.name_b for r in layers)  # each layer's own error
    assert report.exit_code == (1 if bug else 0), [(r.name, r.status) for r in report.results]
    fed = {r.name: r for r in report.results if r.name.startswith("layers.1@in")}
    assert fed["layers.1@in[1]"].name_b == "layers.1@in[0]" and fed["layers.1@in[1]"].status == "ok"
    assert "layers.1@in[0]" not in fed and "layers.1@in[2]" not in fed  # positions, zeros: listed
    skipped = {item.name: item.reason for item in report.plan.only_in_a}
    assert "kept this run's own value" in skipped["layers.1@in[0]"]
    assert "fed zeros" in skipped["layers.1@in[2]"]
    if bug:
        assert report.first_divergence is not None and report.first_divergence.name.startswith("layers.1")
        assert [r.name_b for r in layers if r.status == "diverged"] == ["layers.1"]


# ------------------------------------------------------------------ counterparts from the correspondence


def _engine_record() -> Correspondence:
    """A vLLM-style load: q, k, v stacked into qkv_proj's rows; o_proj and the norm whole."""
    sources = {
        f"model.layers.0.{name}.weight": {"shape": shape, "dtype": "float32", "fingerprint": [i + 0.5] * 8}
        for i, (name, shape) in enumerate(
            [
                ("self_attn.q_proj", [16, 16]),
                ("self_attn.k_proj", [8, 16]),
                ("self_attn.v_proj", [8, 16]),
                ("self_attn.o_proj", [16, 16]),
                ("input_layernorm", [16]),
            ]
        )
    }
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    loads = [
        Load(param=qkv, source="model.layers.0.self_attn.k_proj.weight", region=[[16, 24], [0, 16]]),
        Load(param=qkv, source="model.layers.0.self_attn.q_proj.weight", region=[[0, 16], [0, 16]]),
        Load(param=qkv, source="model.layers.0.self_attn.v_proj.weight", region=[[24, 32], [0, 16]]),
        Load(param="model.layers.0.self_attn.o_proj.weight", source="model.layers.0.self_attn.o_proj.weight"),
        Load(param="model.layers.0.input_layernorm.weight", source="model.layers.0.input_layernorm.weight"),
    ]
    return Correspondence(parameters={}, sources=sources, loads=loads)


def _reference_record(engine: Correspondence, prefix: str) -> Correspondence:
    """An HF-style run: one parameter per checkpoint tensor, named with ``prefix`` instead of
    ``model.`` (a renamed port: found by shape and fingerprint)."""
    return Correspondence(
        parameters={
            prefix + name.removeprefix("model."): {"shape": m["shape"], "fingerprint": m["fingerprint"]}
            for name, m in engine.sources.items()
        }
    )


@pytest.mark.parametrize("prefix", ["model.", "language_model."])
def test_each_engine_module_finds_the_reference_module_holding_its_checkpoint_tensors(prefix: str) -> None:
    engine = _engine_record()
    found = module_counterparts(engine, _reference_record(engine, prefix))
    assert found["model.layers.0"] == f"{prefix}layers.0"  # a decoder layer: the same subtree
    assert found["model.layers.0.self_attn"] == f"{prefix}layers.0.self_attn"
    assert found["model.layers.0.input_layernorm"] == f"{prefix}layers.0.input_layernorm"
    # fused: q, k, v stacked along its rows, each held alone by a leaf: q_proj's input is its input
    assert found["model.layers.0.self_attn.qkv_proj"] == f"{prefix}layers.0.self_attn.q_proj"


def test_a_module_whose_tensors_no_reference_module_holds_has_no_counterpart() -> None:
    engine = _engine_record()
    reference = _reference_record(engine, "model.")
    del reference.parameters["model.layers.0.self_attn.k_proj.weight"]
    found = module_counterparts(engine, reference)
    assert "model.layers.0.self_attn.qkv_proj" not in found and "model.layers.0" not in found
    assert found["model.layers.0.self_attn.o_proj"] == "model.layers.0.self_attn.o_proj"
