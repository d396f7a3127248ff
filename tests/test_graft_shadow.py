"""The grafted verdict's allowance from each tensor's own computation: the fp32 shadow.

A grafted run (``GRAFT_SHADOW`` on by default) runs each grafted call a second time in float32 on
the reference's own inputs, and stores the shadow beside each tensor. The comparator judges the
logic on the shadow against the reference (within the weights' rounding, measured) and the rounding
on the run against its own shadow. Here:

- HF Phi3 (fused ``qkv_proj`` and ``gate_up_proj``: more ops between leaves than Llama, which the
  old counting rule flagged, clean, at ``model.layers.0.mlp.down_proj@in[0]``), bf16 grafted from an
  fp32 reference: clean exit 0 at layer and leaf level; a residual x1.05 and a rope theta x2 in
  layer 2 each named in layer 2 at layer level, no baseline; the margins >= 2x both ways;
- the Llama worked example of docs/comparator.md (MLP x1.02) with the same margins;
- the shadow never changes the run's own numbers, and a module that refuses float32 falls back to
  the counting rule, saying so per tensor.

Every verdict asserts its premise first (the fused modules exist, the shadow ran, the bug changed
the layer's numbers). Rounding-dependent tests are marked ``numerics`` (``make test-numerics``
reruns them under the ISA caps and ``TRACEDUMP_TEST_SEED``).
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import graft_bf16_onto_fp32
from torch import nn

import tracedump
from benchmarks.calibrate import INIT, Family, _random_norms
from benchmarks.calibrate_graft import LEVELS, dump, family
from tracedump.compare import compare
from tracedump.compare.judge.local import LocalResult

pytest.importorskip("transformers")

SEED = int(os.environ.get("TRACEDUMP_TEST_SEED", "0") or 0)
numerics = pytest.mark.numerics
LAYER = r"layers\.\d+$"
PLANTED = "model.layers.2"


# ----------------------------------------------------------------------------------- Phi3


def _scale_layer_input(layer: nn.Module, factor: float) -> None:
    """Residual x ``factor``: the layer's input scaled inside its forward. The input norm cancels
    the scale (up to its eps), so what changes is the residual stream the layer adds to."""
    original = layer.forward

    def forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return original(hidden_states * factor, *args, **kwargs)

    layer.forward = forward  # type: ignore[method-assign]


def _rope_theta(attention: nn.Module, config: Any, factor: float) -> None:
    """This attention's cos/sin from a rotary embedding of theta x ``factor`` (the others keep the
    model's): a wrong rope base in one layer's port."""
    modeling = sys.modules[type(attention).__module__]
    changed = copy.deepcopy(config)
    changed.rope_parameters = {
        **config.rope_parameters,
        "rope_theta": config.rope_parameters["rope_theta"] * factor,
    }
    rotary = modeling.Phi3RotaryEmbedding(config=changed)
    original = attention.forward

    def forward(hidden_states: torch.Tensor, position_embeddings: Any, *args: Any, **kwargs: Any) -> Any:
        positions = torch.arange(hidden_states.shape[1], device=hidden_states.device)[None]
        return original(hidden_states, rotary(hidden_states, positions), *args, **kwargs)

    attention.forward = forward  # type: ignore[method-assign]


def phi3_family() -> Family:
    from transformers import Phi3Config, Phi3ForCausalLM

    def config(attention: str) -> Any:
        return Phi3Config(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            initializer_range=INIT,
            pad_token_id=0,
            eos_token_id=1,
            bos_token_id=1,
            attn_implementation=attention,
        )

    def build(dtype: torch.dtype, attention: str) -> nn.Module:
        torch.manual_seed(SEED)
        return _random_norms(Phi3ForCausalLM(config(attention))).eval().to(dtype)

    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(1 + SEED))

    def run(model: nn.Module) -> None:
        model(input_ids=ids)

    layer = lambda m: m.model.layers[2]  # noqa: E731
    return Family(
        "phi3",
        build,
        run,
        {
            "residual": lambda m: _scale_layer_input(layer(m), 1.05),
            "rope_theta": lambda m: _rope_theta(layer(m).self_attn, m.config, 2.0),
        },
        r"\.layers\.2\.",
        attentions=("eager",),
    )


@pytest.fixture(scope="module")
def phi3(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    fam = phi3_family()
    root = tmp_path_factory.mktemp("graft_phi3")
    dumps = {"ref": dump(fam, "fp32-eager", root / "ref"), "plain": dump(fam, "bf16-eager", root / "plain")}
    for variant in ("bf16-eager", "bf16-eager+residual", "bf16-eager+rope_theta"):
        for level, regex in (("layer", LAYER), ("leaf", None)):
            if level == "leaf" and variant != "bf16-eager":
                continue
            dumps[f"{variant}@{level}"] = dump(fam, variant, root / f"{variant}-{level}", dumps["ref"], regex)
    return dumps


def _pass(path: Path) -> Any:
    return tracedump.open_dump(path).run().passes[0]


def _local(report: Any) -> list[LocalResult]:
    return [
        r
        for r in report.results
        if isinstance(r, LocalResult)
        and r.local
        and r.error is not None
        and r.threshold
        and r.status in ("ok", "diverged")
    ]


def _worst(report: Any, outside: str | None = None) -> float:
    """The largest error / threshold of a local tensor (outside the module ``outside``)."""
    return max(
        r.error / r.threshold  # type: ignore[operator]
        for r in _local(report)
        if outside is None or not (r.name == outside or r.name.startswith((outside + ".", outside + "@")))
    )


def _assert_shadowed(path: Path, modules: list[str]) -> None:
    """The premise of a shadow verdict: each grafted call ran its shadow, stored beside its tensors."""
    graft = tracedump.open_dump(path).run().manifest["graft"]
    shadowed = graft["shadow"]["shadowed_calls"]
    assert all(shadowed.get(m) == 1 for m in modules), graft["shadow"]
    names = _pass(path).names
    assert "shadow~model.layers.0.mlp.down_proj@in[0]" in names
    assert "shadow-noise~model.layers.0.mlp.down_proj@in[0]" in names


def test_phi3_has_the_fused_projections_the_counting_rule_missed(phi3: dict[str, Path]) -> None:
    names = _pass(phi3["bf16-eager@layer"]).names
    for fused in ("model.layers.0.self_attn.qkv_proj", "model.layers.0.mlp.gate_up_proj"):
        assert fused in names
    assert "model.layers.0.mlp.gate_proj" not in names  # gate and up: one GEMM, chunked in the forward


@numerics
@pytest.mark.parametrize("level", ["layer", "leaf"])
def test_clean_phi3_bf16_grafted_from_fp32_exits_0_with_half_its_allowance_to_spare(
    phi3: dict[str, Path], level: str
) -> None:
    grafted = phi3[f"bf16-eager@{level}"]
    if level == "layer":
        _assert_shadowed(grafted, [f"model.layers.{i}" for i in range(4)])
    report = compare(grafted, phi3["ref"])
    assert max(r.error for r in _local(report)) > 0  # bf16 noise is there to be judged
    assert report.exit_code == 0, report.first_divergence
    assert _worst(report) <= 0.5
    by_name = {r.name: r for r in _local(report)}
    # where the counting rule failed, inside the layer (at leaf level: the leaf's own grafted input,
    # a cast, keeps the counting rule; its output is judged by the shadow)
    name = "model.layers.0.mlp.down_proj" + ("@in[0]" if level == "layer" else "")
    assert "fp32 shadow" in by_name[name].tolerance.source, by_name[name].tolerance.source


@numerics
@pytest.mark.parametrize("bug", ["residual", "rope_theta"])
def test_a_phi3_bug_is_named_in_its_layer_by_a_layer_graft_without_baseline(
    phi3: dict[str, Path], bug: str
) -> None:
    grafted = phi3[f"bf16-eager+{bug}@layer"]
    clean = phi3["bf16-eager@layer"]
    layer_out = torch.equal(_pass(grafted)[PLANTED].float(), _pass(clean)[PLANTED].float())
    assert not layer_out  # the premise: the bug changed the planted layer's output
    assert torch.equal(_pass(grafted)["model.layers.1"], _pass(clean)["model.layers.1"])  # and nothing before
    _assert_shadowed(grafted, [f"model.layers.{i}" for i in range(4)])
    report = compare(grafted, phi3["ref"])
    first = report.first_divergence
    assert report.exit_code == 1 and first is not None, first
    assert first.name == PLANTED or first.name.startswith((PLANTED + ".", PLANTED + "@")), first.name
    assert first.basis == "local" and "logic" in first.tolerance.source
    assert first.error >= 2 * first.threshold, (first.error, first.threshold)
    assert _worst(report, outside=PLANTED) <= 0.5


# ----------------------------------------------------------------------------------- Llama


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    fam = family("llama")
    root = tmp_path_factory.mktemp("shadow_llama")
    ref = dump(fam, "fp32-eager", root / "ref")
    return {
        "ref": ref,
        "clean": dump(fam, "bf16-eager", root / "clean", ref, LEVELS["llama"]),
        "mlp_scale": dump(fam, "bf16-eager+mlp_scale", root / "mlp", ref, LEVELS["llama"]),
        "unshadowed": _unshadowed(fam, root / "unshadowed", ref),
    }


def _unshadowed(fam: Family, out: Path, ref: Path) -> Path:
    """The clean bf16 run grafted with GRAFT_SHADOW=0."""
    model = fam.build(torch.bfloat16, "eager")
    config = {"dir": str(out), "modules": "all", "inputs": True, "graft_from": str(ref)}
    config.update(graft_level=LEVELS["llama"], graft_shadow=False)
    dumper = tracedump.attach(model, config)
    assert dumper is not None
    with torch.no_grad():
        fam.run(model)
    dumper.close()
    return out


@numerics
def test_the_llama_worked_example_holds_with_a_margin_of_two_both_ways(llama: dict[str, Path]) -> None:
    clean = compare(llama["clean"], llama["ref"])
    buggy = compare(llama["mlp_scale"], llama["ref"])
    assert clean.exit_code == 0 and _worst(clean) <= 0.5, clean.first_divergence
    first = buggy.first_divergence
    assert buggy.exit_code == 1 and first is not None and first.name == "model.layers.3.mlp", first
    assert first.error >= 2 * first.threshold, (first.error, first.threshold)


def test_the_shadow_never_changes_the_runs_own_numbers(llama: dict[str, Path]) -> None:
    shadowed, plain = _pass(llama["clean"]), _pass(llama["unshadowed"])
    own = [n for n in shadowed.names if not n.startswith("shadow")]
    assert set(own) == set(plain.names)
    assert all(torch.equal(shadowed[n], plain[n]) for n in own)
    assert not any(n.startswith("shadow") for n in plain.names)
    assert "shadow" not in tracedump.open_dump(llama["unshadowed"]).run().manifest["graft"]


def test_without_a_shadow_every_tensor_keeps_the_counting_rule(llama: dict[str, Path]) -> None:
    report = compare(llama["unshadowed"], llama["ref"])
    assert report.exit_code == 0
    assert all("shadow" not in r.tolerance.source for r in _local(report))


# ----------------------------------------------------------------------------------- fallback


class _Bf16Only(nn.Module):
    """A module whose kernel takes bf16 only (a custom kernel): its shadow cannot run."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(64, 64)
        self.strict = False  # on in the bf16 model under test

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.strict and x.dtype != torch.bfloat16:
            raise TypeError("this kernel takes bfloat16 only")
        return self.proj(x)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(64, 64), nn.GELU())
        self.odd = _Bf16Only()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.odd(self.inner(x))


def test_a_module_that_refuses_float32_falls_back_to_the_counting_rule_and_says_so(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _Model().eval()
    x = torch.randn(16, 64)
    dumper = tracedump.attach(model, {"dir": str(tmp_path / "ref"), "modules": "all", "inputs": True})
    assert dumper is not None
    with torch.no_grad():
        model(x)
    dumper.close()
    model = model.to(torch.bfloat16)
    model.odd.strict = True
    with (
        torch.no_grad(),
        tracedump.graft(model, tmp_path / "ref", dir=tmp_path / "g", level="^(inner|odd)$") as g,
    ):
        g.run(x.to(torch.bfloat16))
    graft = tracedump.open_dump(tmp_path / "g").run().manifest["graft"]
    assert graft["shadow"]["shadowed_calls"] == {"inner": 1}  # the premise: odd's shadow could not run
    assert any("bfloat16 only" in reason for reason in graft["shadow"]["not_shadowed"])
    report = compare(tmp_path / "g", tmp_path / "ref")
    assert report.exit_code == 0, report.first_divergence
    by_name = {r.name: r for r in _local(report)}
    assert "fp32 shadow" in by_name["inner"].tolerance.source
    assert "counting rule: no shadow of this tensor" in by_name["odd"].tolerance.source


# ------------------------------------------------------------------------ a shadow that does not fit


def _rewrite_pass(path: Path, edit: Any) -> None:
    """The pass file with ``edit(tensors)`` applied, its metadata kept."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), "pt") as handle:
        metadata = handle.metadata()
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
    edit(tensors)
    save_file(tensors, str(path), metadata=metadata)


@pytest.mark.parametrize("unfit", ["transposed", "integer"])
def test_a_shadow_of_another_shape_or_dtype_is_not_used(tmp_path: Path, unfit: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 48), nn.GELU()).eval()
    graft_bf16_onto_fp32(model, torch.randn(16, 64), tmp_path, level="^0$")
    (path,) = (tmp_path / "g").glob("*/pass00000.safetensors")
    assert "shadow~0" in tracedump.load_pass(path)  # the premise: the grafted call has its shadow

    def edit(tensors: dict[str, torch.Tensor]) -> None:
        shadow = tensors["shadow~0"]
        if unfit == "transposed":  # the same elements in another order: compared element by element, wrong
            tensors["shadow~0"] = (shadow.t().contiguous() * 1.5).to(shadow.dtype)
        else:
            tensors["shadow~0"] = torch.zeros(shadow.shape, dtype=torch.int32)

    _rewrite_pass(path, edit)

    report = compare(tmp_path / "g", tmp_path / "ref")

    assert report.exit_code == 0, report.first_divergence
    (row,) = [r for r in _local(report) if r.name == "0"]
    transposed = "shape [48, 16] is not the tensor's [16, 48]"
    why = transposed if unfit == "transposed" else "dtype int32 does not fit"
    assert "counting rule" in row.tolerance.source and why in row.tolerance.source, row.tolerance.source
