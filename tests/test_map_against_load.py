"""A hand ``--map`` rule checked against an engine's load record: an engine run whose two layers'
projections hold the checkpoint's ``model.layers.{0,1}.mlp.down_proj.weight`` (as its
``correspondence.json`` records), against an HF-style reference holding those two modules. The
engine names them its own way (``layers.{i}.fc``) or as the checkpoint does (vLLM's names, where
the mapped names meet the rows the load derived for the other layer).

A ``--map`` that swaps the layers is the user's word and is applied (a divergence: layer 0's output
against layer 1's), but the rows and the printed summary say that the load record pairs each
projection with its own layer's ``down_proj``. A ``--map`` that pairs as the record does says
nothing. Real files on disk, the writer's own pass format, no engine needed.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from conftest import checkpoint_source, write_recorded_run

from tracedump.cli import main
from tracedump.compare import compare
from tracedump.store.correspondence import Correspondence, Load

H, TOKENS, LAYERS = 8, 5, 2
OWN, CHECKPOINTS = "layers.{}.fc", "model.layers.{}.mlp.down_proj"  # the engine's module names
# layer 0 <-> layer 1, by way of a name neither side holds (the rules apply in order)
SWAP = {
    OWN: (r"^layers\.0\.fc$=model.layers.1.mlp.down_proj", r"^layers\.1\.fc$=model.layers.0.mlp.down_proj"),
    CHECKPOINTS: (r"layers\.0\.=layers.T.", r"layers\.1\.=layers.0.", r"layers\.T\.=layers.1."),
}


def _checkpoint(layer: int) -> str:
    return f"model.layers.{layer}.mlp.down_proj.weight"


def _weights() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {_checkpoint(i): torch.randn(H, H, generator=generator) for i in range(LAYERS)}


def _engine(base: Path, weights: dict[str, torch.Tensor], x: torch.Tensor, naming: str) -> Path:
    """One rank; layer i's projection (``naming``) was filled whole from its ``down_proj``."""
    loads = [
        Load(
            param=f"{naming.format(i)}.weight",
            source=_checkpoint(i),
            region=[[0, H], [0, H]],
            rows=[[0, 0, H]],
        )
        for i in range(LAYERS)
    ]
    params = {
        f"{naming.format(i)}.weight": {"module": naming.format(i), "shape": [H, H]} for i in range(LAYERS)
    }
    sources = {name: checkpoint_source(w) for name, w in weights.items()}
    record = Correspondence(parameters=params, sources=sources, loads=loads)
    classes = {"": "Toy"}
    for i in range(LAYERS):  # every module above the projection
        parts = naming.format(i).split(".")
        classes |= {".".join(parts[:k]): "Block" for k in range(1, len(parts))}
        classes[naming.format(i)] = "RowParallelLinear"
    manifest = {
        "rank": 0,
        "pid": 100,
        "root": "Toy",
        "world_size": 1,
        "framework": "vllm",
        "module_classes": classes,
    }
    outputs = {naming.format(i): x @ weights[_checkpoint(i)].T for i in range(LAYERS)}
    write_recorded_run(base / "rank0_pid100", manifest, outputs, record)
    return base


def _reference(base: Path, weights: dict[str, torch.Tensor], x: torch.Tensor) -> Path:
    params = {
        name: {"module": name.rpartition(".")[0], **checkpoint_source(w)} for name, w in weights.items()
    }
    classes = {"": "Toy", "model": "Model", "model.layers": "ModuleList"}
    for i in range(LAYERS):
        classes |= {f"model.layers.{i}": "Layer", f"model.layers.{i}.mlp": "MLP"}
        classes |= {f"model.layers.{i}.mlp.down_proj": "Linear"}
    manifest = {
        "rank": 0, "pid": 200, "root": "Toy", "world_size": 1, "framework": "transformers",
        "module_classes": classes,
    }  # fmt: skip
    outputs = {_checkpoint(i).removesuffix(".weight"): x @ weights[_checkpoint(i)].T for i in range(LAYERS)}
    write_recorded_run(base / "rank0_pid200", manifest, outputs, Correspondence(parameters=params))
    return base


def _runs(tmp_path: Path, naming: str) -> tuple[Path, Path]:
    weights = _weights()
    x = torch.randn(TOKENS, H, generator=torch.Generator().manual_seed(1))
    return _engine(tmp_path / "engine", weights, x, naming), _reference(tmp_path / "hf", weights, x)


def _note(naming: str, layer: int, mapped: int) -> str:
    own = naming.format(layer)
    return (
        f"--map pairs {own} with {CHECKPOINTS.format(mapped)}, but the load record says A's {own} holds "
        f"the checkpoint tensors of B's {CHECKPOINTS.format(layer)}: the rule contradicts the recorded load"
    )


NAMINGS = pytest.mark.parametrize("naming", [OWN, CHECKPOINTS], ids=["own names", "checkpoint names"])


@NAMINGS
def test_the_load_record_pairs_each_layer_with_its_own(tmp_path: Path, naming: str) -> None:
    """The premise: with no rule, each projection is paired by the load with its layer's ``down_proj``."""
    engine, hf = _runs(tmp_path, naming)
    report = compare(engine, hf)
    pairs = {r.name: r.name_b for r in report.results}
    assert pairs == {naming.format(i): CHECKPOINTS.format(i) for i in range(LAYERS)}
    assert report.exit_code == 0
    assert all(r.paired_by == "load" for r in report.results)


@NAMINGS
def test_a_map_the_load_record_contradicts_is_reported_on_the_row(
    tmp_path: Path, naming: str, capsys
) -> None:
    engine, hf = _runs(tmp_path, naming)
    report = compare(engine, hf, maps=SWAP[naming])
    rows = {r.name: r for r in report.results}
    assert rows[naming.format(0)].name_b == CHECKPOINTS.format(1)  # the user's word, applied
    assert report.exit_code == 1
    for layer in range(LAYERS):
        row = rows[naming.format(layer)]
        assert row.paired_by == "map"  # not the load: the load paired another module with it
        assert row.pairing is not None and _note(naming, layer, 1 - layer) in row.pairing
    document = report.to_json()
    assert any(_note(naming, 0, 1) in (row.get("pairing") or "") for row in document["tensors"])

    assert main(["diff", str(engine), str(hf), *(w for m in SWAP[naming] for w in ("--map", m))]) == 1
    printed = re.sub(r"\s+", " ", capsys.readouterr().out)
    assert f"pairing: {naming.format(0)}: {_note(naming, 0, 1)}" in printed


def test_a_map_that_pairs_as_the_load_record_does_says_nothing(tmp_path: Path) -> None:
    engine, hf = _runs(tmp_path, OWN)
    report = compare(engine, hf, maps=(r"^layers\.0\.fc$=model.layers.0.mlp.down_proj",))
    rows = {r.name: r for r in report.results}
    assert rows["layers.0.fc"].name_b == "model.layers.0.mlp.down_proj"
    assert report.exit_code == 0
    assert not any("--map" in (r.pairing or "") for r in report.results)


def _rule_file(tmp_path: Path, pairs: dict[int, int]) -> Path:
    """A ``--bridge`` file renaming the engine's projection of each layer to a reference layer's."""
    rules = "\n".join(
        f'[[rule]]\nop = "rename"\nid = "layer {i}"\nmatch = \'{re.escape(OWN.format(i))}\'\n'
        f'b = "{CHECKPOINTS.format(j)}"\n'
        for i, j in pairs.items()
    )
    path = tmp_path / "rules.toml"
    path.write_text(f'[bridge]\nname = "hand"\na = "vllm"\nb = "transformers"\n\n{rules}')
    return path


def test_a_bridge_file_rule_the_load_record_contradicts_is_reported_on_the_row(
    tmp_path: Path, capsys
) -> None:
    """A ``--bridge`` file is the user's word as ``--map`` is: applied, and where it pairs a
    module with another than the one the load record says it holds, the row says so."""
    engine, hf = _runs(tmp_path, OWN)
    swapped = _rule_file(tmp_path, {0: 1, 1: 0})
    report = compare(engine, hf, bridge=swapped)
    rows = {r.name: r for r in report.results}
    assert rows[OWN.format(0)].name_b == CHECKPOINTS.format(1)  # the rule, applied
    assert report.exit_code == 1
    for layer in range(LAYERS):
        row = rows[OWN.format(layer)]
        assert row.paired_by == "rule"
        note = _note(OWN, layer, 1 - layer).replace("--map", f"--bridge rule {1 + layer}: layer {layer}")
        assert row.pairing is not None and note in row.pairing

    assert main(["diff", str(engine), str(hf), "--bridge", str(swapped)]) == 1
    printed = re.sub(r"\s+", " ", capsys.readouterr().out)
    assert "the rule contradicts the recorded load" in printed

    agreeing = _rule_file(tmp_path, {0: 0, 1: 1})
    report = compare(engine, hf, bridge=agreeing)
    assert report.exit_code == 0
    assert not any("contradicts" in (r.pairing or "") for r in report.results)
