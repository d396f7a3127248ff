"""``TRACEDUMP_DUMP_OPS``: each aten op's output inside chosen modules, and ``tracedump diff``
aligning two runs' ops by name (a bug inside a module, below its boundaries, named at its op)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_llama, read_passes

import tracedump
from tracedump.cli import main
from tracedump.compare.load.sources import EntryMeta
from tracedump.compare.options import parse_options
from tracedump.compare.pair.ops_align import align_ops, parse_op_key, suggest_ops
from tracedump.compare.pair.unshard import SideEntry
from tracedump.store.format import Key

pytest.importorskip("transformers")

MLP = r"^model\.layers\.2\.mlp$"
IDS = torch.tensor([[3, 14, 15, 9, 26, 5, 7]])


def llama(bug: bool = False) -> torch.nn.Module:
    """A 3-layer tiny Llama; ``bug``: layer 2's MLP computes ``act(gate) * up * 1.05`` inside its
    forward, where no module boundary sees it."""
    model = make_tiny_llama(layers=3)
    if bug:
        mlp = model.model.layers[2].mlp

        def forward(x: torch.Tensor) -> torch.Tensor:
            return mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x) * 1.05)

        mlp.forward = forward
    return model


def dump(path: Path, bug: bool = False, **settings: object) -> Path:
    model = llama(bug)
    dumper = tracedump.attach(model, {"dir": path, **settings})
    assert dumper is not None
    with torch.no_grad():
        model(IDS)
    dumper.close()
    return dumper.run_dir


def diff_json(tmp_path: Path, a: Path, b: Path) -> tuple[int, dict]:
    report = tmp_path / "report.json"
    status = main(["diff", str(a), str(b), "--json", str(report), "--no-progress"])
    return status, json.loads(report.read_text())


def test_ops_without_a_dump_dir_attach_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRACEDUMP_DUMP_OPS", MLP)
    model = llama()
    assert tracedump.attach(model) is None
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())


def test_a_bad_ops_regex_fails_at_attach_naming_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path))
    monkeypatch.setenv("TRACEDUMP_DUMP_OPS", "mlp(")
    with pytest.raises(tracedump.ConfigError, match="TRACEDUMP_DUMP_OPS"):
        tracedump.attach(llama())


def test_without_ops_no_key_is_an_op(tmp_path: Path) -> None:
    keys = read_passes(dump(tmp_path / "plain"))[0]
    assert keys and not [k for k in keys if parse_op_key(k) is not None]


def test_each_op_inside_the_matched_module_is_keyed_by_its_index_and_name(tmp_path: Path) -> None:
    tensors = read_passes(dump(tmp_path / "ops", ops=MLP))[0]
    ops = [k for k in tensors if parse_op_key(k) is not None]
    assert ops and all(k.startswith("model.layers.2.mlp/") for k in ops)  # no other module's ops
    assert [parse_op_key(k).index for k in ops] == list(range(len(ops)))  # type: ignore[union-attr]
    # the gate's product with up is an aten.mul.Tensor, with the value the forward computed
    (mul,) = [k for k in ops if k.endswith(":aten.mul.Tensor")]
    gate, up = tensors["model.layers.2.mlp.act_fn"], tensors["model.layers.2.mlp.up_proj"]
    torch.testing.assert_close(tensors[mul], gate * up, rtol=0, atol=0)
    # the recorder's own copies (the module hooks inside the MLP) are not ops of the MLP
    assert not [k for k in ops if "copy" in k or "empty" in k]
    # module keys are still there, unchanged
    assert "model.layers.2.mlp.down_proj" in tensors


def test_op_keys_parse_as_keys_and_round_trip() -> None:
    text = "model.layers.2.mlp/3:aten.mul.Tensor::call1"
    key = Key.parse(text)
    assert key.format() == text and key.call == 1 and key.path == ""
    op = parse_op_key("model.layers.2.mlp/12:aten.split.Tensor[1]")
    assert op is not None and (op.module, op.index, op.op, op.path) == (
        "model.layers.2.mlp",
        12,
        "aten.split.Tensor",
        "[1]",
    )
    assert parse_op_key("model.layers.2.mlp") is None


def test_a_bug_inside_the_mlp_is_named_at_an_op_under_it(tmp_path: Path) -> None:
    a = dump(tmp_path / "a", ops=MLP)
    b = dump(tmp_path / "b", bug=True, ops=MLP)
    status, report = diff_json(tmp_path, a, b)
    assert status == 1
    first = report["summary"]["first_divergence"]
    assert first["name"].startswith("model.layers.2.mlp/")
    tensors = {t["name"]: t for t in report["tensors"]}
    extra = [t for t in report["tensors"] if t["status"] == "extra_op"]
    assert len(extra) == 1 and extra[0]["name"] == first["name"]
    assert extra[0]["name"].endswith(":aten.mul.Tensor")
    # every op of layer 2's MLP before the extra one is ok: the bug is where B ran one more op
    ops = [name for name in tensors if name.startswith("model.layers.2.mlp/")]
    assert all(tensors[n]["status"] == "ok" for n in ops[: ops.index(first["name"])])


def test_an_extra_op_is_reported_by_its_run_and_shifts_no_later_pairing(tmp_path: Path) -> None:
    a = dump(tmp_path / "a", ops=MLP)
    b = dump(tmp_path / "b", bug=True, ops=MLP)
    result = subprocess.run(
        [sys.executable, "-m", "tracedump", "diff", str(a), str(b), "--no-progress"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1, result.stderr
    assert "B runs an extra aten.mul.Tensor in model.layers.2.mlp" in result.stdout
    # B against itself: 0; A against B the other way round: A runs the extra op
    status, report = diff_json(tmp_path, b, a)
    assert status == 1
    first = report["summary"]["first_divergence"]
    assert "A runs an extra aten.mul.Tensor in model.layers.2.mlp" in first["message"]
    # after the extra op, the ops pair with the same op of the other run (B's index one more)
    mlp = [t for t in report["tensors"] if t["name"].startswith("model.layers.2.mlp/")]
    names = {(t["name"], t["name_b"]) for t in mlp}
    for name_a, name_b in names:
        op_a, op_b = parse_op_key(name_a), parse_op_key(name_b)
        assert op_a is not None and op_b is not None and op_a.op == op_b.op


def test_a_module_level_divergence_suggests_the_ops_rerun(tmp_path: Path) -> None:
    a = dump(tmp_path / "a")
    b = dump(tmp_path / "b", bug=True)
    status, report = diff_json(tmp_path, a, b)
    assert status == 1
    assert report["summary"]["first_divergence"]["name"] == "model.layers.2.mlp.down_proj"
    assert report["summary"]["look_inside"] == r"TRACEDUMP_DUMP_OPS='^model\.layers\.2\.mlp$'"


def test_equal_runs_with_ops_agree(tmp_path: Path) -> None:
    a = dump(tmp_path / "a", ops=MLP)
    b = dump(tmp_path / "b", ops=MLP)
    status, report = diff_json(tmp_path, a, b)
    assert status == 0
    assert report["summary"]["extra_ops"] == 0
    assert not report["only_in_a"] and not report["only_in_b"]


def test_ops_dumped_by_one_run_only_are_left_unmatched_not_diverged(tmp_path: Path) -> None:
    a = dump(tmp_path / "a", ops=MLP)
    b = dump(tmp_path / "b")
    status, report = diff_json(tmp_path, a, b)
    assert status == 0
    assert report["only_in_a"] and all("OPS" in u["reason"] for u in report["only_in_a"])


# ------------------------------------------------------------------ alignment alone


def _entries(names: list[str]) -> dict[str, SideEntry]:
    meta = EntryMeta(kind="tensor", dtype="float32", shape=(2,))
    return {name: SideEntry(name=name, meta=meta) for name in names}


def test_alignment_pairs_by_name_sequence_not_by_index() -> None:
    a = _entries(["m/0:aten.t.default", "m/1:aten.mm.default", "m/2:aten.add.Tensor"])
    b = _entries(["m/0:aten.t.default", "m/1:aten.mul.Tensor", "m/2:aten.mm.default", "m/3:aten.add.Tensor"])
    out = align_ops(a, b, parse_options("a", "b"))
    assert [(x.name, y.name) for x, y in out.pairs] == [
        ("m/0:aten.t.default", "m/0:aten.t.default"),
        ("m/1:aten.mm.default", "m/2:aten.mm.default"),
        ("m/2:aten.add.Tensor", "m/3:aten.add.Tensor"),
    ]
    (extra,) = out.extras
    assert (extra.side, extra.entry.name, extra.after) == ("B", "m/1:aten.mul.Tensor", "m/0:aten.t.default")
    assert extra.message == "B runs an extra aten.mul.Tensor in m"


def test_suggestion_names_the_parent_of_a_leaf_and_a_container_itself() -> None:
    rerun = r"TRACEDUMP_DUMP_OPS='^model\.layers\.2\.mlp$'"
    leaves = {"model.layers.2.mlp.down_proj": None, "model.norm": None}
    assert suggest_ops("model.layers.2.mlp.down_proj", leaves) == rerun
    every = {**leaves, "model.layers.2.mlp": None}
    assert suggest_ops("model.layers.2.mlp", every) == rerun
    assert suggest_ops("model.layers.2.mlp/3:aten.mul.Tensor", every) is None
