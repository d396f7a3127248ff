"""Module inputs across two module trees (compare/pair/input_roles.py): an engine's decoder layer is
called ``layer(positions, hidden_states, residual)`` and its norms ``norm(x, residual)``, HF's
``layer(hidden_states, position_ids=...)`` and ``norm(stream)``. Dumped with ``INPUTS=1`` on both
sides, the inputs pair by what they hold, never by their place in the call.

Two tiny models of the same weights, dumped by the real ``attach()`` (every module, inputs too);
the engine side's ``correspondence.json`` says each parameter was loaded whole from the checkpoint
tensor of its name (what the vLLM plugin records), so the diff derives its bridge as for vLLM."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import tracedump
from tracedump.cli import main
from tracedump.compare.load.sources import EntryMeta
from tracedump.compare.pair.input_roles import (
    INPUT_ALONE,
    INPUT_AMBIGUOUS,
    INPUT_OTHER_KIND,
    Role,
    input_role,
    pair_inputs,
)
from tracedump.store.correspondence import Correspondence, Load, read_correspondence, write_correspondence

H, VOCAB, LAYERS = 8, 16, 2


class FusedNorm(nn.Module):
    """An engine's RMS norm: ``norm(x)``, or ``norm(x, residual)`` -> ``(normed, x + residual)``."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(H))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> object:
        stream = x if residual is None else x + residual
        normed = stream * torch.rsqrt(stream.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight
        return normed if residual is None else (normed, stream)


class PlainNorm(FusedNorm):
    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> object:
        return super().forward(x)


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.down_proj = nn.Linear(H, H, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(x)


class EngineLayer(nn.Module):
    """vLLM's decoder layer: positions first, the residual add deferred to the next norm. Its
    class name is HF's (as vLLM's ``LlamaDecoderLayer`` is): no class check keeps them apart."""

    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm = FusedNorm()
        self.mlp = Mlp()

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class HFLayer(nn.Module):
    """HF's decoder layer: the whole stream in, the whole stream out, positions by keyword."""

    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm = PlainNorm()
        self.mlp = Mlp()

    def forward(self, hidden: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        return hidden + self.mlp(self.input_layernorm(hidden))


EngineLayer.__qualname__ = "engine.DecoderLayer"
HFLayer.__qualname__ = "hf.DecoderLayer"


class Body(nn.Module):
    def __init__(self, engine: bool) -> None:
        super().__init__()
        self.engine = engine
        self.embed_tokens = nn.Embedding(VOCAB, H)
        self.layers = nn.ModuleList(EngineLayer() if engine else HFLayer() for _ in range(LAYERS))
        self.norm = FusedNorm() if engine else PlainNorm()

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(ids)
        if not self.engine:
            for layer in self.layers:
                hidden = layer(hidden, position_ids=positions)
            return self.norm(hidden)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        return self.norm(hidden, residual)[0]


class Toy(nn.Module):
    def __init__(self, engine: bool) -> None:
        super().__init__()
        self.model = Body(engine)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(ids, positions)


def _dump(where: Path, engine: bool, inputs: bool, monkeypatch: pytest.MonkeyPatch) -> Path:
    """One pass of one side, every module (and its inputs with ``inputs``): the engine's tokens
    flat ``[tokens]``, HF's ``[batch, seq]``."""
    torch.manual_seed(0)
    model = Toy(engine).eval()
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(where))
    monkeypatch.setenv("TRACEDUMP_DUMP_MODULES", "all")
    monkeypatch.setenv("TRACEDUMP_DUMP_INPUTS", "1" if inputs else "0")
    ids = torch.tensor([3, 1, 4, 1, 5])
    positions = torch.arange(5)
    dumper = tracedump.attach(model)
    assert dumper is not None
    with torch.no_grad(), dumper.step():
        model(ids, positions) if engine else model(ids[None], positions[None])
    dumper.close()
    return dumper.run_dir


def _pair_dumps(tmp_path: Path, inputs: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """The engine's dump and HF's, the engine's load recorded as the vLLM plugin records it."""
    tag = "inputs" if inputs else "outputs"
    engine_run = _dump(tmp_path / f"engine-{tag}", True, inputs, monkeypatch)
    hf_run = _dump(tmp_path / f"hf-{tag}", False, inputs, monkeypatch)
    hf, engine = read_correspondence(hf_run), read_correspondence(engine_run)
    assert hf is not None and engine is not None
    sources = {name: {k: v for k, v in meta.items() if k != "module"} for name, meta in hf.parameters.items()}
    loads = []
    for name, meta in engine.parameters.items():
        rows = int(meta["shape"][0])
        region = [[0, rows]] + [[0, d] for d in meta["shape"][1:]]
        loads.append(Load(param=name, source=name, region=region, rows=[[0, 0, rows]]))
    write_correspondence(
        engine_run, Correspondence(parameters=engine.parameters, sources=sources, loads=loads)
    )
    return tmp_path / f"engine-{tag}", tmp_path / f"hf-{tag}"


def _diff(tmp_path: Path, a: Path, b: Path) -> tuple[int, dict]:
    report = tmp_path / f"{a.name}.json"
    code = main(["diff", str(a), str(b), "--json", str(report), "--max-rows", "0"])
    return code, json.loads(report.read_text())


def test_inputs_pair_by_what_they_hold_not_by_their_place_in_the_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The clean pair exits 0 with inputs dumped: the engine's ``positions`` (``@in[0]``, integers)
    is never measured against HF's hidden states (``@in[0]``, floats): before, a shape mismatch,
    exit 1 (and each fused norm's inputs "not comparable" with HF's). Each input meets the one of
    the other side that holds the same thing, or is listed with the reason; the layer outputs pair
    as without inputs."""
    code_out, plain = _diff(tmp_path, *_pair_dumps(tmp_path, False, monkeypatch))
    code, report = _diff(tmp_path, *_pair_dumps(tmp_path, True, monkeypatch))
    assert code_out == 0 and plain["summary"]["bridge"]["name"] == "derived from the weight load"
    rows = {(t["name"], t["name_b"]): t for t in report["tensors"]}
    bad = [(k, t["status"], t.get("message")) for k, t in rows.items() if t["status"] != "ok"]
    assert code == 0 and not bad, bad
    assert report["summary"]["not_comparable"] == 0
    outputs = {(t["name"], t["name_b"]) for t in plain["tensors"]}
    assert outputs <= set(rows)  # every pair made without inputs is made with them
    assert ("model.layers.1[0] + model.layers.1[1]", "model.layers.1") in outputs
    for layer in range(LAYERS):  # the positions: integers on both sides, whatever their place
        assert f"model.layers.{layer}@in[0]" not in {b for a, b in rows if a == f"model.layers.{layer}@in[0]"}
        assert rows[(f"model.layers.{layer}@in[0]", f"model.layers.{layer}@in[position_ids]")]["bridge"] == (
            "input by role (integer ids or positions)"
        )
    # layer 0 takes no residual yet: its one float input is HF's whole stream
    assert rows[("model.layers.0@in[1]", "model.layers.0@in[0]")]["rel_diff"] == 0
    assert rows[("model.layers.0.input_layernorm@in[0]", "model.layers.0.input_layernorm@in[0]")]
    # layer 1 takes (hidden_states, residual) where HF takes their sum: none compared, each listed
    left_a = {u["name"]: u.get("reason") for u in report["only_in_a"]}
    left_b = {u["name"]: u.get("reason") for u in report["only_in_b"]}
    for name in ("model.layers.1@in[1]", "model.layers.1@in[2]", "model.layers.1.input_layernorm@in[1]"):
        assert left_a[name] == INPUT_AMBIGUOUS, name
    assert left_b["model.layers.1@in[0]"] == INPUT_AMBIGUOUS
    assert not [k for k in rows if k[0].startswith("model.layers.1.input_layernorm@in")]
    # the fused norm's stream is compared once, as its residual output against HF's norm input
    assert ("model.layers.1.input_layernorm[1]", "model.layers.1.input_layernorm@in[0]") in rows
    assert set(left_b.values()) <= {INPUT_AMBIGUOUS, INPUT_ALONE, None}


def test_the_pairing_reads_roles_from_the_entries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """HF against the engine (the mirror): the same pairs, each side's names on its side."""
    engine, hf = _pair_dumps(tmp_path, True, monkeypatch)
    code, report = _diff(tmp_path, hf, engine)
    rows = {(t["name"], t["name_b"]) for t in report["tensors"]}
    assert code == 0 and report["summary"]["not_comparable"] == 0
    assert ("model.layers.0@in[position_ids]", "model.layers.0@in[0]") in rows
    assert ("model.layers.0@in[0]", "model.layers.0@in[1]") in rows
    assert {u["name"] for u in report["only_in_a"] if u.get("reason") == INPUT_AMBIGUOUS} >= {
        "model.layers.1@in[0]"
    }


def test_pair_inputs_by_keyword_then_by_a_role_one_input_holds_on_each_side() -> None:
    """The three steps on names alone: a keyword of both sides pairs when it holds the same kind
    (else both listed), a role one input of each side holds pairs them, a role several hold pairs
    none; an input of unknown role pairs by its path only."""
    floats, ints = Role("float", 8), Role("int", None)
    roles_a = {"m@in[0]": ints, "m@in[1]": floats, "m@in[2]": floats, "m@in[x]": floats, "m@in[mask]": ints,
               "m@in[3]": None}  # fmt: skip
    roles_b = {"m@in[0]": floats, "m@in[position_ids]": ints, "m@in[x]": floats, "m@in[mask]": floats,
               "m@in[3]": floats}  # fmt: skip
    got = pair_inputs(list(roles_a), list(roles_b), roles_a, roles_b)
    assert got.pairs == [("m@in[0]", "m@in[position_ids]"), ("m@in[x]", "m@in[x]"), ("m@in[3]", "m@in[3]")]
    assert dict(got.left_a) == {
        "m@in[1]": INPUT_AMBIGUOUS,
        "m@in[2]": INPUT_AMBIGUOUS,
        "m@in[mask]": INPUT_OTHER_KIND,
    }
    assert dict(got.left_b) == {"m@in[0]": INPUT_AMBIGUOUS, "m@in[mask]": INPUT_OTHER_KIND}
    assert input_role(EntryMeta("tensor", (1, 5, 8), "bfloat16")) == floats
    assert input_role(EntryMeta("tensor", (5,), "int32")) == ints
    assert input_role(EntryMeta("stats", None, "float32")) is None


def test_two_ports_of_one_signature_pair_by_place_where_roles_alone_are_ambiguous() -> None:
    """A fused norm's ``(x, residual)`` on both sides: two inputs of one role each side, which roles
    alone cannot tell apart; the same paths holding the same roles pair by path. A signature that
    differs anywhere still pairs by role."""
    floats, ints = Role("float", 8), Role("int", None)
    same = {"n@in[0]": floats, "n@in[1]": floats}
    got = pair_inputs(list(same), list(same), same, same)
    assert got.pairs == [("n@in[0]", "n@in[0]"), ("n@in[1]", "n@in[1]")] and not got.left_a and not got.left_b
    engine = {"n@in[0]": ints, "n@in[1]": floats, "n@in[2]": floats}
    reference = {"n@in[0]": floats, "n@in[1]": ints}
    got = pair_inputs(list(engine), list(reference), engine, reference)
    assert got.pairs == [("n@in[0]", "n@in[1]")]  # the positions, by role
    assert dict(got.left_a) == {"n@in[1]": INPUT_AMBIGUOUS, "n@in[2]": INPUT_AMBIGUOUS}
