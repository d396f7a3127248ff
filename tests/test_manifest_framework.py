"""The manifest says which framework made the model and each captured module's class (format 1.1),
for attach(), capture().save() and `tracedump run` (test_run.py), and the loader reads it back and
reads older manifests without it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import tracedump
from tracedump.dump.rundir import framework_of
from tracedump.store.format import MANIFEST

transformers = pytest.importorskip("transformers")


class Port(nn.Module):
    """A script's own model: a plain nn.Module subclass defined outside any package."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(8, 4)
        self.act = nn.SiLU()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.act(self.emb(ids))


def test_an_hf_model_attached_records_transformers_its_version_and_each_module_class(
    llama: nn.Module, tmp_path: Path
) -> None:
    dumper = tracedump.attach(llama, {"dir": str(tmp_path)})
    assert dumper is not None
    with torch.no_grad():
        llama(torch.arange(5).reshape(1, 5))
    dumper.close()
    manifest = json.loads((dumper.run_dir / MANIFEST).read_text())
    assert manifest["framework"] == "transformers"
    assert manifest["framework_version"] == transformers.__version__
    classes = manifest["module_classes"]
    assert set(classes) == set(manifest["modules"])  # every captured module, no other
    assert classes["model.layers.0.mlp.act_fn"] == type(llama.model.layers[0].mlp.act_fn).__qualname__
    assert classes["model.layers.1.self_attn.q_proj"] == "Linear"
    assert classes["model.norm"] == "LlamaRMSNorm"
    run = tracedump.open_dump(tmp_path).run()
    assert (run.framework, run.framework_version) == ("transformers", transformers.__version__)
    assert run.module_classes == classes
    assert run.module_class("model.layers.0.mlp.down_proj::call1") == "Linear"
    assert run.module_class("not.a.module") is None


def test_a_plain_module_is_torch_and_a_subclass_of_an_hf_model_is_transformers(llama: nn.Module) -> None:
    assert framework_of(Port()) == ("torch", torch.__version__)
    assert framework_of(nn.Linear(2, 2)) == ("torch", torch.__version__)

    class MyLlama(type(llama)):  # type: ignore[misc,valid-type]  # a script's subclass, in no package
        pass

    MyLlama.__module__ = "__main__"
    assert framework_of(MyLlama.__new__(MyLlama)) == ("transformers", transformers.__version__)


def test_capture_save_writes_the_same_fields(llama: nn.Module, tmp_path: Path) -> None:
    names = ["model.layers.0.mlp.act_fn", "model.norm"]
    with tracedump.capture(llama, outputs=names) as cap, torch.no_grad():
        cap.run(torch.arange(4).reshape(1, 4))
    run_dir = cap.save(tmp_path / "cap")
    manifest = json.loads((run_dir / MANIFEST).read_text())
    assert manifest["framework"] == "transformers"
    assert manifest["module_classes"] == {
        "model.layers.0.mlp.act_fn": type(llama.model.layers[0].mlp.act_fn).__qualname__,
        "model.norm": "LlamaRMSNorm",
    }
    assert manifest["shared_modules"] == {}
    assert manifest["format"] == "1.1"


def test_a_manifest_written_before_1_1_reads_with_no_framework_and_no_classes(tmp_path: Path) -> None:
    dumper = tracedump.attach(Port(), {"dir": str(tmp_path)})
    assert dumper is not None
    dumper.close()
    path = dumper.run_dir / MANIFEST
    manifest = json.loads(path.read_text())
    assert manifest["framework"] == "torch"
    assert manifest["module_classes"] == {"emb": "Embedding", "act": "SiLU"}
    for key in ("framework", "framework_version", "module_classes", "shared_modules"):
        del manifest[key]
    manifest["format"] = "1"
    path.write_text(json.dumps(manifest))
    run = tracedump.open_dump(tmp_path).run()
    assert (run.framework, run.framework_version, run.module_classes) == ("", None, {})
    assert run.module_class("emb") is None
