"""Defects found running tracedump against real programs and hostile input (issue 13).

Each test names the defect it guards against; each failed on the code before its fix.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest
import torch
from conftest import read_passes, tracedump_warnings
from torch import nn

import tracedump

pytestmark = pytest.mark.usefixtures("fresh_warn_once")


class _Two(nn.Module):
    """A root with two leaves: ``a`` (a Linear) and ``b`` (returns whatever dtype it was built for)."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = _Cast(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        self.b(y)
        return y


class _Cast(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dtype.is_complex:
            return torch.polar(torch.ones_like(x.double()), x.double()).to(self.dtype)
        return x.to(self.dtype)


def _manifest(run_dir: Path) -> dict:
    return json.loads((run_dir / "manifest.json").read_text())


# ------------------------------------------------------------------ 1. unsupported dtypes


@pytest.mark.parametrize("dtype", [torch.complex128, torch.complex32])
def test_an_unwritable_dtype_is_skipped_and_counted_and_the_rest_of_every_pass_is_written(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    model = _Two(dtype)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tracedump.attach(model, {"dir": tmp_path}) as dumper, torch.no_grad():
            for _ in range(2):
                model(torch.ones(1, 4))
    assert dumper.failure is None
    passes = read_passes(dumper.run_dir)
    assert sorted(passes) == [0, 1]
    assert all(list(p) == ["a"] for p in passes.values())
    written = _manifest(dumper.run_dir)
    assert written["complete"] is True
    assert written["skipped"] == {"unsupported_tensor": 2}
    assert any("unsupported_tensor" in m for m in tracedump_warnings(caught))


def test_a_record_of_an_unwritable_dtype_is_skipped_and_counted(tmp_path: Path) -> None:
    model = _Two()
    with tracedump.attach(model, {"dir": tmp_path}) as dumper, torch.no_grad():
        with dumper.step():
            model(torch.ones(1, 4))
            dumper.record("rope", torch.ones(2, dtype=torch.complex128))
            dumper.record("kept", torch.ones(2))
    assert sorted(read_passes(dumper.run_dir)[0]) == ["a", "b", "kept"]
    assert _manifest(dumper.run_dir)["skipped"] == {"unsupported_tensor": 1}


# ------------------------------------------------------------------ 5. reserved record names


def test_a_reserved_record_tag_is_refused_at_record_and_the_pass_is_still_written(tmp_path: Path) -> None:
    model = _Two()
    with tracedump.attach(model, {"dir": tmp_path}) as dumper, torch.no_grad():
        with dumper.step():
            model(torch.ones(1, 4))
            with pytest.raises(ValueError, match="__metadata__.*reserved"):
                dumper.record("__metadata__", torch.ones(1))
            with pytest.raises(ValueError, match="reserved"):
                tracedump.record("__metadata__", torch.ones(1))
    assert sorted(read_passes(dumper.run_dir)[0]) == ["a", "b"]
    assert _manifest(dumper.run_dir)["complete"] is True


# ------------------------------------------------------------------ 13. relative DUMP_DIR


def test_a_relative_dump_dir_is_resolved_at_attach_and_survives_a_chdir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "start").mkdir()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "start")
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", "rel")
    model = _Two()
    dumper = tracedump.attach(model)
    os.chdir(tmp_path / "elsewhere")
    with torch.no_grad():
        model(torch.ones(1, 4))
    dumper.close()
    assert dumper.run_dir.is_absolute()
    assert dumper.run_dir.parent == tmp_path / "start" / "rel"
    assert _manifest(dumper.run_dir)["settings"]["dir"] == str(tmp_path / "start" / "rel")
    assert sorted(read_passes(dumper.run_dir)) == [0]
    assert not (tmp_path / "elsewhere" / "rel").exists()
