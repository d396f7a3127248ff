"""``OPS``: an allocation op's output (``empty_like``: memory it never wrote) is never compared; two
identical computations exit 0 whatever that memory held."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import tracedump
from tracedump.cli import main
from tracedump.compare.pair.ops_align import unwritten_reason


class _Scratch(nn.Module):
    """A module that allocates its output and then writes it (a kernel's ``out=`` buffer)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        torch.mul(x, 2.0, out=out)
        return out + 1


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.scratch = _Scratch()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scratch(self.proj(x))


def _dump(path: Path) -> Path:
    torch.manual_seed(0)
    model = _Model().eval()
    dumper = tracedump.attach(model, {"dir": str(path), "ops": "^scratch$"})
    assert dumper is not None
    with torch.no_grad():
        model(torch.linspace(-1, 1, 12).reshape(3, 4))
    dumper.close()
    return path


def _garble(run: Path, name: str) -> None:
    """What another allocation could have handed out: other bytes in the never-written output."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    (path,) = run.glob("*/pass00000.safetensors")
    with safe_open(str(path), "pt") as handle:
        metadata = handle.metadata()
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
    tensors[name] = torch.full_like(tensors[name], 1e30)
    save_file(tensors, str(path), metadata=metadata)


@pytest.mark.parametrize(
    "op",
    [
        "aten.empty.memory_format",
        "aten.empty_like.default",
        "aten.new_empty.default",
        "aten.empty_strided.default",
    ],
)
def test_allocation_ops_are_named(op: str) -> None:
    assert unwritten_reason(op) is not None
    assert (
        unwritten_reason("aten.mul.Tensor") is None
        and unwritten_reason("aten.empty_likeness.default") is None
    )


def test_two_identical_computations_with_ops_exit_0(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = _dump(tmp_path / "a"), _dump(tmp_path / "b")
    (empty,) = [
        n for n in tracedump.open_dump(b).run().passes[0].names if n.endswith(":aten.empty_like.default")
    ]
    _garble(b, empty)  # the premise: the two runs' allocations held different bytes

    code = main(["diff", str(a), str(b), "--json", str(tmp_path / "r.json"), "--no-progress"])

    report = json.loads((tmp_path / "r.json").read_text())
    assert code == 0, report["summary"]["first_divergence"]
    (row,) = [t for t in report["tensors"] if t["name"] == empty]
    assert row["status"] == "not_comparable" and "uninitialised" in row["message"]
    written = [t for t in report["tensors"] if t["name"].startswith("scratch/") and t["name"] != empty]
    assert written and all(t["status"] == "ok" for t in written)  # what the ops wrote is compared
