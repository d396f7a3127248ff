"""A module registered under several parents is named by the parent that calls it:
vLLM's one rotary embedding held by every layer's attention is ``layers.2.self_attn.rotary_emb``
when layer 2 calls it, not ``layers.0.self_attn.rotary_emb::call2``; a second call by the same
parent keeps ``::call1``; a reused block is named by the branch it runs in."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from torch import nn

import tracedump
import tracedump.cli
from tracedump.store.format import MANIFEST

LAYERS = 3
TWICE = 2  # the layer whose attention applies the shared rotary twice


class Rotary(nn.Module):
    """One rotary embedding for every layer, as vLLM's ``get_rope`` hands out: no parameters,
    the position decides the rotation."""

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, ...]:
        angle = positions[:, None].float() * 0.1
        return q * angle.cos() - k * angle.sin(), k * angle.cos() + q * angle.sin()


class Attention(nn.Module):
    def __init__(self, rotary: Rotary, twice: bool) -> None:
        super().__init__()
        self.q_proj = nn.Linear(8, 8)
        self.k_proj = nn.Linear(8, 8)
        self.rotary_emb = rotary  # the same object in every layer
        self.twice = twice

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k = self.rotary_emb(positions, self.q_proj(x), self.k_proj(x))
        if self.twice:
            q, k = self.rotary_emb(positions, q, k)
        return q + k


class Layer(nn.Module):
    def __init__(self, rotary: Rotary, twice: bool) -> None:
        super().__init__()
        self.self_attn = Attention(rotary, twice)
        self.norm = nn.LayerNorm(8)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.norm(x) + self.self_attn(positions, x))  # norm: called twice, one parent


class SharedRotaryLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        rotary = Rotary()
        self.embed = nn.Embedding(16, 8)
        self.layers = nn.ModuleList(Layer(rotary, twice=i == TWICE) for i in range(LAYERS))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[-1])
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(positions, x)
        return x


IDS = torch.tensor([1, 5, 3, 7, 2])


def _dump(model: nn.Module, out: Path, modules: str = "all", **config: object) -> tracedump.Run:
    dumper = tracedump.attach(model, {"dir": str(out), "modules": modules, **config})
    assert dumper is not None
    with torch.no_grad():
        model(torch.ones(2, 4) if isinstance(model, TiedBranches) else IDS)
    dumper.close()
    return tracedump.open_dump(out).run()


def _rotary_names(names: list[str]) -> list[str]:
    return [n for n in names if "rotary_emb" in n]


@pytest.mark.parametrize("modules", ["all", "leaves"])
def test_the_shared_rotary_is_named_by_the_layer_that_calls_it(tmp_path: Path, modules: str) -> None:
    model = SharedRotaryLM()
    run = _dump(model, tmp_path / "d", modules)
    names = run.passes[0].names
    assert _rotary_names(names) == [
        "layers.0.self_attn.rotary_emb[0]",
        "layers.0.self_attn.rotary_emb[1]",
        "layers.1.self_attn.rotary_emb[0]",
        "layers.1.self_attn.rotary_emb[1]",
        "layers.2.self_attn.rotary_emb[0]",
        "layers.2.self_attn.rotary_emb[1]",
        "layers.2.self_attn.rotary_emb[0]::call1",  # the same parent's second call
        "layers.2.self_attn.rotary_emb[1]::call1",
    ]
    assert "layers.1.norm::call1" in names  # an unshared module called twice by its parent, as before
    # each name holds the call of that layer: recompute layer 1's rotary from its own projections
    tensors = run.passes[0].load()
    rotary, positions = model.layers[1].self_attn.rotary_emb, torch.arange(len(IDS))
    q1, k1 = rotary(positions, tensors["layers.1.self_attn.q_proj"], tensors["layers.1.self_attn.k_proj"])
    torch.testing.assert_close(tensors["layers.1.self_attn.rotary_emb[0]"], q1, rtol=0, atol=0)
    torch.testing.assert_close(tensors["layers.1.self_attn.rotary_emb[1]"], k1, rtol=0, atol=0)
    assert not torch.equal(tensors["layers.0.self_attn.rotary_emb[0]"], q1)

    manifest = json.loads((run.path / MANIFEST).read_text())
    every = [f"layers.{i}.self_attn.rotary_emb" for i in range(LAYERS)]
    assert manifest["shared_modules"] == {every[0]: every}
    assert manifest["modules"].count(every[0]) == 1 and every[1] not in manifest["modules"]
    assert {name: run.module_classes[name] for name in every} == dict.fromkeys(every, "Rotary")


def test_inputs_of_a_shared_module_are_named_by_the_caller_too(tmp_path: Path) -> None:
    run = _dump(SharedRotaryLM(), tmp_path / "d", "leaves", inputs=True)
    inputs = [n for n in run.passes[0].names if "rotary_emb@in[0]" in n]
    assert inputs == [
        "layers.0.self_attn.rotary_emb@in[0]",
        "layers.1.self_attn.rotary_emb@in[0]",
        "layers.2.self_attn.rotary_emb@in[0]",
        "layers.2.self_attn.rotary_emb@in[0]::call1",
    ]


def test_a_shared_module_adds_no_hook_beyond_its_own_capture_hook(tmp_path: Path) -> None:
    model = SharedRotaryLM()
    dumper = tracedump.attach(model, {"dir": str(tmp_path), "modules": "leaves"})
    assert dumper is not None
    try:
        assert dumper.hooks.sites is not None  # call sites found by walking the stack, not by hooks
        with_pre = {name for name, m in model.named_modules() if m._forward_pre_hooks}
        with_post = {name for name, m in model.named_modules() if m._forward_hooks}
        assert with_pre == {""}  # the root's pass hook only: the attentions (sites) have none
        leaves = {name for name, m in model.named_modules() if not list(m.children())}
        assert with_post == {""} | leaves
        assert len(model.layers[0].self_attn.rotary_emb._forward_hooks) == 1
    finally:
        dumper.close()
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())

    plain = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    dumper = tracedump.attach(plain, {"dir": str(tmp_path)})
    assert dumper is not None
    assert dumper.hooks.sites is None  # nothing shared: no call sites at all
    dumper.close()


class Branch(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block  # one block, reused by both branches

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


class TiedBranches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        block = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
        self.enc = Branch(block)
        self.dec = Branch(block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dec(self.enc(x) * 2)


def test_a_reused_block_is_named_by_the_branch_that_runs_it(tmp_path: Path) -> None:
    run = _dump(TiedBranches(), tmp_path, "all")
    assert run.passes[0].names == [
        "enc.block.0", "enc.block.1", "enc.block", "enc",
        "dec.block.0", "dec.block.1", "dec.block", "dec",
    ]  # fmt: skip
    assert run.manifest["shared_modules"]["enc.block.0"] == ["enc.block.0", "dec.block.0"]


def test_capture_names_shared_calls_as_attach_does_also_after_an_early_exit(tmp_path: Path) -> None:
    model = SharedRotaryLM()
    with (
        tracedump.capture(
            model, outputs=["layers.0.self_attn.rotary_emb", "layers.1.self_attn.q_proj"]
        ) as cap,
        torch.no_grad(),
    ):
        assert cap.run(IDS) is not None
        cap.clear()
        # an early exit unwinds layer 1's attention without its post-hooks: nothing of it may
        # name the next run's calls
        cap.early_exit = True
        assert cap.run(IDS) is None
        cap.early_exit = False
        cap.run(IDS)
    assert len(cap["layers.0.self_attn.rotary_emb"].outputs) == 1 + 4  # every call since clear()
    run_dir = cap.save(tmp_path / "cap")
    names = tracedump.open_dump(run_dir).run().passes
    assert _rotary_names(names[1].names) == [
        "layers.0.self_attn.rotary_emb[0]",
        "layers.0.self_attn.rotary_emb[1]",
    ]
    assert _rotary_names(names[2].names)[-2:] == [
        "layers.2.self_attn.rotary_emb[0]::call1",
        "layers.2.self_attn.rotary_emb[1]::call1",
    ]
    assert _rotary_names(names[2].names)[:2] == _rotary_names(names[1].names)


def test_a_bug_in_one_layers_call_of_the_shared_rotary_is_named_at_that_layer(tmp_path: Path) -> None:
    clean = _dump(SharedRotaryLM(), tmp_path / "clean")
    buggy_model = SharedRotaryLM()
    attention = buggy_model.layers[1].self_attn
    original = attention.forward

    def bugged(positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:  # layer 1: positions off by one
        q, k = attention.rotary_emb(positions + 1, attention.q_proj(x), attention.k_proj(x))
        return q + k

    attention.forward = bugged  # type: ignore[method-assign]
    _dump(buggy_model, tmp_path / "buggy")
    attention.forward = original  # type: ignore[method-assign]
    assert clean.passes[0]["layers.1.self_attn.rotary_emb[0]"].shape == (len(IDS), 8)
    out = tmp_path / "report.json"
    code = tracedump.cli.main(["diff", str(tmp_path / "buggy"), str(tmp_path / "clean"), "--json", str(out)])
    assert code == 1
    report = json.loads(out.read_text())
    assert report["summary"]["first_divergence"]["name"] == "layers.1.self_attn.rotary_emb[0]"


def test_a_filter_on_one_layer_keeps_that_layers_calls_of_the_shared_module(tmp_path: Path) -> None:
    run = _dump(SharedRotaryLM(), tmp_path / "d", "leaves", filter=[r"layers\.2\."])
    assert run.passes[0].names == [
        "layers.2.norm",
        "layers.2.self_attn.q_proj",
        "layers.2.self_attn.k_proj",
        "layers.2.self_attn.rotary_emb[0]",  # selected by its name under layer 2, not its first name
        "layers.2.self_attn.rotary_emb[1]",
        "layers.2.self_attn.rotary_emb[0]::call1",
        "layers.2.self_attn.rotary_emb[1]::call1",
        "layers.2.norm::call1",
    ]
    assert run.manifest["skipped"] == {}  # the other layers' calls are not captures lost


def test_the_call_sites_benchmark_runs_and_measures_both_parts() -> None:
    from benchmarks import bench_call_sites

    result = bench_call_sites.run(quick=True)
    sites = result["call_sites"]
    assert sites["model"]["shared_calls_per_step"] == sites["model"]["layers"]
    assert sites["fallback_lookup_ns"] > 0 and sites["sites_vs_no_sites"] > 0
    assert isinstance(sites["naming_us_per_shared_call"], float)
    assert set(result["hf_layout"]) == {
        f"{shape}_{kind}_us"
        for shape in ("prefill_1x256", "decode_8x1_past511")
        for kind in ("kept", "bookkeeping")
    }


def _decorated(forward):  # type: ignore[no-untyped-def]
    """A forward wrapped by a decorator (as engines wrap theirs): its frame's code is not the class's."""

    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        return forward(self, *args, **kwargs)

    return wrapper


class Encoder(nn.Module):
    def __init__(self, shared: nn.Module) -> None:
        super().__init__()
        self.shared = shared

    @_decorated
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._inner(x)

    def _inner(self, x: torch.Tensor) -> torch.Tensor:  # called from a helper, not from forward itself
        return self.shared(x) * 2


class RootAndBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.shared = nn.Linear(4, 4)
        self.enc = Encoder(self.shared)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.enc(self.shared(x))


def test_the_caller_is_found_through_decorators_and_helpers_and_the_root_names_its_own_calls(
    tmp_path: Path,
) -> None:
    dumper = tracedump.attach(model := RootAndBranch(), {"dir": str(tmp_path), "modules": "leaves"})
    assert dumper is not None
    with torch.no_grad():
        model(torch.ones(2, 4))
    dumper.close()
    names = tracedump.open_dump(tmp_path).run().passes[0].names
    assert names == ["shared", "enc.shared"]  # the root's own call, then the encoder's


def test_a_module_graph_with_a_cycle_or_too_many_names_still_attaches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tracedump.dump import selection

    outer = nn.Sequential(nn.Linear(2, 2))
    outer[0].back = outer  # type: ignore[assignment]  # a child holding its parent: a cycle
    names = selection.every_name(outer)
    assert list(names) == ["", "0"]  # the walk does not go round the cycle
    monkeypatch.setattr(selection, "MAX_NAMES", 3)
    wide = SharedRotaryLM()  # more than 3 names: the walk gives up sharing, not attach()
    assert len(selection.every_name(wide)) == len(dict(wide.named_modules()))
    run = _dump(wide, tmp_path / "d", "leaves")
    assert run.manifest["shared_modules"] == {}
    assert "layers.0.self_attn.rotary_emb[0]::call1" in run.passes[0].names  # the old naming
