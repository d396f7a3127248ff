"""An op key is told from a module key by its grammar: a ``ModuleDict`` key ending in
``/<digits>:<x>`` stays a module's name, never an op of its parent."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import tracedump
from tracedump.compare import compare
from tracedump.compare.pair.ops_align import parse_op_key, suggest_ops


class _Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleDict({"a/1:b": nn.Linear(4, 4), "a/2:b": nn.Linear(4, 4)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks["a/2:b"](self.blocks["a/1:b"](x))


def _dump(path: Path, scale: float = 1.0, **settings: object) -> Path:
    torch.manual_seed(0)
    model = _Blocks().eval()
    with torch.no_grad():
        model.blocks["a/1:b"].weight.mul_(scale)
    dumper = tracedump.attach(model, {"dir": str(path), **settings})
    assert dumper is not None
    with torch.no_grad():
        model(torch.linspace(-1, 1, 12).reshape(3, 4))
    dumper.close()
    return path


@pytest.mark.parametrize(
    "name", ["blocks.a/1:b", "blocks.a/1:b[0]", "m/03:aten.mul.Tensor", "m/3:mul", "/3:aten.mul.Tensor"]
)
def test_a_name_that_is_no_op_key_is_not_parsed_as_one(name: str) -> None:
    assert parse_op_key(name) is None


def test_op_keys_the_dumper_writes_still_parse() -> None:
    key = parse_op_key("blocks.a/1:b/12:aten.split.Tensor[1]::call2")
    assert key is not None
    assert (key.module, key.index, key.op, key.path, key.call) == (
        "blocks.a/1:b",
        12,
        "aten.split.Tensor",
        "[1]",
        2,
    )


def test_a_module_dict_key_like_an_op_is_compared_and_named_as_a_module(tmp_path: Path) -> None:
    a, b = _dump(tmp_path / "a", scale=1.1), _dump(tmp_path / "b")
    assert "blocks.a/1:b" in tracedump.open_dump(a).run().passes[0].names  # the premise

    report = compare(a, b)

    assert report.exit_code == 1
    first = report.first_divergence
    assert first is not None and first.name == "blocks.a/1:b" and first.status == "diverged"
    assert report.look_inside == suggest_ops("blocks.a/1:b", {}) == "TRACEDUMP_DUMP_OPS='^blocks$'"


def test_ops_inside_a_module_dict_key_like_an_op_are_its_ops(tmp_path: Path) -> None:
    a = _dump(tmp_path / "a", ops=r"^blocks\.a/1:b$")
    names = tracedump.open_dump(a).run().passes[0].names
    ops = [n for n in names if parse_op_key(n) is not None]
    assert ops and all(parse_op_key(n).module == "blocks.a/1:b" for n in ops), names  # type: ignore[union-attr]
    assert parse_op_key("blocks.a/1:b") is None and "blocks.a/1:b" in names
    assert compare(a, _dump(tmp_path / "b", ops=r"^blocks\.a/1:b$")).exit_code == 0
