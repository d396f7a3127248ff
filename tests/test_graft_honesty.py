"""Grafting's honesty rules and its three entry points.

A call whose reference inputs are missing runs on its own inputs and is recorded as not grafted,
with the reason; a grafted run never writes into its reference; the host's numbers are untouched
outside a graft; grafting is refused under torch.compile and CUDA graph capture; the env-var path
(``TRACEDUMP_DUMP_GRAFT_FROM``) and ``tracedump run --graft-from`` give the same run dir as
``tracedump.graft()``; ``--align tokens`` on a grafted dump is exit 2.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_llama
from torch import nn

import tracedump
from tracedump import ConfigError
from tracedump.compare import compare

pytest.importorskip("transformers")

IDS = torch.tensor([[3, 14, 15, 9, 26, 5, 7]])
LAYER = r"layers\.\d+$"


def _reference(path: Path, ids: torch.Tensor = IDS, **config: object) -> Path:
    model = make_tiny_llama()
    dumper = tracedump.attach(model, {"dir": str(path), "modules": "all", "inputs": True, **config})
    assert dumper is not None
    with torch.no_grad():
        model(ids)
    dumper.close()
    return path


@pytest.fixture(scope="module")
def ref(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _reference(tmp_path_factory.mktemp("graft_ref") / "ref")


def _manifest(path: Path) -> dict:
    return tracedump.open_dump(path).run().manifest


def _start(graft: tracedump.Graft) -> None:
    """Enter and leave a graft (what fails, fails at the start, before any hook)."""
    with graft:
        pass


def _digest(path: Path) -> dict[str, str]:
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in path.rglob("*")
        if p.is_file()
    }


def test_graft_is_public() -> None:
    assert "graft" in tracedump.__all__ and "Graft" in tracedump.__all__
    assert callable(tracedump.graft)


def test_graft_replaces_the_inputs_and_writes_a_run_dir_that_says_so(ref: Path, tmp_path: Path) -> None:
    model = make_tiny_llama().to(torch.bfloat16)
    with tracedump.graft(model, ref, dir=tmp_path / "g", level=LAYER) as g, torch.no_grad():
        g.run(IDS)
    graft = _manifest(tmp_path / "g")["graft"]
    assert graft["level"] == LAYER and graft["modules"] == ["model.layers.0", "model.layers.1"]
    assert graft["grafted_calls"] == {"model.layers.0": 1, "model.layers.1": 1}
    a = tracedump.open_dump(tmp_path / "g").run().passes[0]
    b = tracedump.open_dump(ref).run().passes[0]
    for layer in graft["modules"]:
        assert torch.equal(a[f"{layer}@in[0]"], b[f"{layer}@in[0]"].to(torch.bfloat16))
    # the leaves inside a grafted layer run on the layer's own values, not the reference's
    assert not torch.equal(
        a["model.layers.1.mlp.down_proj@in[0]"], b["model.layers.1.mlp.down_proj@in[0]"].to(torch.bfloat16)
    )
    saved = g.save(tmp_path / "copy")
    assert json.loads((saved / "manifest.json").read_text())["graft"]["level"] == LAYER


def test_graft_without_dir_writes_a_temp_run_dir(ref: Path) -> None:
    model = make_tiny_llama()
    with tracedump.graft(model, ref) as g, torch.no_grad():
        model(IDS)  # a direct root forward inside the block is a pass too
    try:
        assert g.run_dir.parent.name.startswith("tracedump-graft-")
        assert compare(g.run_dir, ref).exit_code == 0  # the same fp32 model on its reference's inputs
        assert _manifest(g.run_dir)["graft"]["level"] == "leaves"
    finally:
        shutil.rmtree(g.run_dir.parent)


def test_the_host_is_untouched_outside_the_graft(ref: Path, tmp_path: Path) -> None:
    model = make_tiny_llama()
    with torch.no_grad():
        before = model(IDS).logits
    hooks = [(m._forward_pre_hooks.copy(), m._forward_hooks.copy()) for m in model.modules()]
    with tracedump.graft(model, ref, dir=tmp_path, level=LAYER) as g, torch.no_grad():
        inside = g.run(IDS + 1).logits  # other tokens: grafted layers still get the reference's
    with torch.no_grad():
        after = model(IDS).logits
    assert torch.equal(before, after)
    assert [(m._forward_pre_hooks, m._forward_hooks) for m in model.modules()] == hooks
    # inside, the last layer ran on the reference's input (made from IDS), whatever the tokens were
    assert torch.equal(inside, before)


def test_a_call_without_reference_inputs_keeps_its_own_and_says_why(tmp_path: Path) -> None:
    """The reference dumped inputs of layer 0 only: the other leaves are not grafted, with the reason,
    in the manifest and in the diff (JSON ``not_grafted``, ``local: false``)."""
    ref = _reference(tmp_path / "ref", filter=r"layers\.0\.")
    model = make_tiny_llama()
    with tracedump.graft(model, ref, dir=tmp_path / "g") as g, torch.no_grad():
        g.run(IDS)
    graft = _manifest(tmp_path / "g")["graft"]
    assert "model.layers.0.mlp.down_proj" in graft["grafted_calls"]
    missing = graft["not_grafted"]["model.layers.1.mlp.down_proj"]
    assert missing["calls"] == 1 and "dumped no input" in missing["listed"][0]["reason"]
    report = compare(tmp_path / "g", ref)
    rows = {t["name"]: t for t in report.to_json()["tensors"]}
    assert rows["model.layers.0.mlp.down_proj"]["local"] is True
    assert any("not grafted" in note for note in report.notes)


def test_another_shape_is_not_grafted(ref: Path, tmp_path: Path) -> None:
    model = make_tiny_llama()
    with tracedump.graft(model, ref, dir=tmp_path / "g", level=LAYER) as g, torch.no_grad():
        g.run(IDS[:, :5])  # 5 tokens here, 7 in the reference
    reason = _manifest(tmp_path / "g")["graft"]["not_grafted"]["model.layers.0"]["listed"][0]["reason"]
    assert "shape [1, 5, 32] here, [1, 7, 32] in the reference" in reason
    assert _manifest(tmp_path / "g")["graft"]["grafted_calls"] == {}


@dataclasses.dataclass
class Box:
    x: torch.Tensor


class Boxed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)

    def forward(self, box: Box) -> torch.Tensor:
        return self.inner(box.x)


class Wrapper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.boxed = Boxed()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.boxed(Box(x))


def test_an_input_grafting_cannot_rebuild_is_not_grafted(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, x = Wrapper(), torch.randn(2, 4)
    dumper = tracedump.attach(model, {"dir": str(tmp_path / "ref"), "modules": "all", "inputs": True})
    assert dumper is not None
    model(x)
    dumper.close()
    with tracedump.graft(model, tmp_path / "ref", dir=tmp_path / "g", level=r"^boxed$") as g:
        g.run(x)
    reason = _manifest(tmp_path / "g")["graft"]["not_grafted"]["boxed"]["listed"][0]["reason"]
    assert "Box" in reason and "does not rebuild" in reason


def test_a_reference_without_inputs_is_refused_naming_inputs(tmp_path: Path) -> None:
    ref = _reference(tmp_path / "ref", inputs=False)
    with pytest.raises(ConfigError, match="INPUTS=1"), tracedump.graft(make_tiny_llama(), ref):
        pass


def test_a_grafted_run_never_writes_into_its_reference(ref: Path, tmp_path: Path) -> None:
    before = _digest(ref)
    run_dir = tracedump.open_dump(ref).run().path
    for target in (ref, run_dir, ref / "sub"):
        with pytest.raises(ConfigError, match="never writes into its reference"):
            _start(tracedump.graft(make_tiny_llama(), ref, dir=target))
    with tracedump.graft(make_tiny_llama(), run_dir, dir=tmp_path / "g") as g, torch.no_grad():
        g.run(IDS)
    assert _digest(ref) == before
    assert not (ref / "sub").exists()


def test_grafting_is_refused_under_torch_compile(ref: Path, tmp_path: Path) -> None:
    model = make_tiny_llama()
    compiled = torch.compile(model, backend="eager")
    with pytest.raises(ConfigError, match=r"torch\.compile"):
        _start(tracedump.graft(compiled, ref, dir=tmp_path / "a"))
    with pytest.raises(ConfigError, match=r"torch\.compile"):
        tracedump.attach(compiled, {"dir": str(tmp_path / "b"), "graft_from": str(ref)})
    model.compile(backend="eager")  # in place
    with pytest.raises(ConfigError, match=r"torch\.compile"):
        _start(tracedump.graft(model, ref, dir=tmp_path / "c"))
    torch._dynamo.reset()
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_grafting_is_refused_during_cuda_graph_capture(
    ref: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    capturing = [True]
    module = importlib.import_module("tracedump.dump.grafter")  # where the capture check runs
    monkeypatch.setattr(module, "stream_is_capturing", lambda: capturing[0])
    with pytest.raises(ConfigError, match="CUDA graph capture"):
        _start(tracedump.graft(make_tiny_llama(), ref, dir=tmp_path / "a"))
    capturing[0] = False
    with tracedump.graft(make_tiny_llama(), ref, dir=tmp_path / "b", level=LAYER) as g, torch.no_grad():
        capturing[0] = True  # a capture that starts later: the calls run on their own inputs
        g.run(IDS)
    reason = _manifest(tmp_path / "b")["graft"]["not_grafted"]["model.layers.0"]["listed"][0]["reason"]
    assert "CUDA graph capture" in reason


def test_the_env_var_path_grafts_an_attach_based_engine(
    ref: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path / "env"))
    monkeypatch.setenv("TRACEDUMP_DUMP_GRAFT_FROM", str(ref))
    monkeypatch.setenv("TRACEDUMP_DUMP_GRAFT_LEVEL", LAYER)
    model = make_tiny_llama()
    dumper = tracedump.attach(model)
    assert dumper is not None
    with dumper.step(), torch.no_grad():
        model(IDS)
    dumper.close()
    graft = _manifest(tmp_path / "env")["graft"]
    assert graft["level"] == LAYER and graft["grafted_calls"] == {"model.layers.0": 1, "model.layers.1": 1}
    assert "model.layers.0" in _manifest(tmp_path / "env")["modules"]  # a grafted module is dumped
    assert compare(tmp_path / "env", ref).exit_code == 0


def test_bad_graft_settings_fail_at_attach_naming_the_env_var(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ref: Path
) -> None:
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path / "d"))
    monkeypatch.setenv("TRACEDUMP_DUMP_GRAFT_FROM", str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="TRACEDUMP_DUMP_GRAFT_FROM"):
        tracedump.attach(make_tiny_llama())
    monkeypatch.setenv("TRACEDUMP_DUMP_GRAFT_FROM", str(ref))
    monkeypatch.setenv("TRACEDUMP_DUMP_GRAFT_LEVEL", "layers.(")
    with pytest.raises(ConfigError, match="TRACEDUMP_DUMP_GRAFT_LEVEL"):
        tracedump.attach(make_tiny_llama())
    monkeypatch.setenv("TRACEDUMP_DUMP_GRAFT_LEVEL", "no_such_module")
    with pytest.raises(ConfigError, match="matches no module"):
        tracedump.attach(make_tiny_llama())
    assert not (tmp_path / "d").exists()


SCRIPT = """
import sys, torch
sys.path.insert(0, {tests!r})
from conftest import make_tiny_llama
model = make_tiny_llama().to(torch.bfloat16)
with torch.no_grad():
    model(torch.tensor([[3, 14, 15, 9, 26, 5, 7]]))
"""


def test_tracedump_run_graft_from_and_the_diff_of_its_dump(ref: Path, tmp_path: Path) -> None:
    script = tmp_path / "engine.py"
    script.write_text(SCRIPT.format(tests=str(Path(__file__).parent)))
    cli = [sys.executable, "-m", "tracedump"]
    out = tmp_path / "run"
    done = subprocess.run(
        [
            *cli,
            "run",
            "--dir",
            str(out),
            "--graft-from",
            str(ref),
            "--graft-level",
            LAYER,
            "--",
            sys.executable,
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    graft = _manifest(out)["graft"]
    assert graft["grafted_calls"] == {"model.layers.0": 1, "model.layers.1": 1}
    diff = subprocess.run(
        [*cli, "diff", str(out), str(ref), "--json", "-"], capture_output=True, text=True, timeout=120
    )
    assert diff.returncode == 0, diff.stdout + diff.stderr
    rows = {t["name"]: t for t in json.loads(diff.stdout)["tensors"]}
    assert rows["model.layers.1"]["local"] is True and rows["model.layers.1"]["error"] > 0  # bf16 vs fp32
    aligned = subprocess.run(
        [*cli, "diff", str(out), str(ref), "--align", "tokens"], capture_output=True, text=True, timeout=120
    )
    assert aligned.returncode == 2 and "grafted dump" in aligned.stderr


def test_a_grafted_attach_dumps_every_module_unless_modules_is_set(ref: Path, tmp_path: Path) -> None:
    """GRAFT_FROM with MODULES unset dumps every module (as ``tracedump.graft()``), so the tensors
    inside a grafted layer (its MLP) are judged too; an explicit MODULES=leaves is kept."""
    from tracedump.config.settings import DumpSettings

    assert DumpSettings(dir=str(tmp_path / "a"), graft_from=str(ref)).modules == "all"
    assert DumpSettings(dir=str(tmp_path / "a"), graft_from=str(ref), modules="leaves").modules == "leaves"
    assert DumpSettings(dir=str(tmp_path / "a")).modules == "leaves"
