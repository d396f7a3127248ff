"""Dump-side defects a hostile run found: a full disk at close, the shadow and the host's
hooks, a dump written into its own reference, worker threads in one step, complex statistics.

Each test builds its premise (a really full filesystem, a forced interleaving of two threads) and
failed on the code before its fix.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from pathlib import Path

import pytest
import torch
from conftest import tracedump_warnings
from hostile_fs import full_filesystem
from torch import nn

import tracedump
from tracedump.dump.writer import MANIFEST_RESERVE

pytestmark = pytest.mark.usefixtures("fresh_warn_once")


def _manifest(run_dir: Path) -> dict:
    return json.loads((run_dir / "manifest.json").read_text())


class _Wide(nn.Module):
    """Two leaves whose outputs take a few KiB a pass: a 64 KiB disk fills within a few passes."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 512)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.up(x))


def _fill(where: Path) -> None:
    """Fill what is left of the filesystem at ``where`` (another program filling the disk)."""
    with contextlib.suppress(OSError), open(where / "more_ballast", "wb") as ballast:
        while True:
            ballast.write(b"\0" * 512)
            ballast.flush()


# ------------------------------------------------------------------ 1. a full disk at close


def test_a_disk_filled_mid_run_still_gets_the_last_manifest_saying_why_and_what_was_lost(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    model = _Wide().eval()
    with full_filesystem(tmp_path / "full", keep_free=40 << 10) as full:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with tracedump.attach(model, {"dir": full / "d"}) as dumper, torch.no_grad():
                with dumper.step():
                    model(torch.ones(2, 16))
                dumper.flush()
                assert (dumper.run_dir / "pass00000.safetensors").is_file()
                _fill(full)  # the premise: not one more block on the disk
                with pytest.raises(OSError):
                    (full / "probe").write_bytes(b"\0" * 4096)
                for _ in range(3):
                    with dumper.step():
                        model(torch.ones(2, 16))
        manifest = _manifest(dumper.run_dir)
        left = sorted(p.name for p in dumper.run_dir.iterdir())
    assert manifest["complete"] is False
    assert "No space left" in manifest["incomplete_reason"]
    assert manifest["passes"]["count"] == 1 and manifest["passes"]["indices"] == [0]
    lost = manifest["skipped"]
    assert lost.get("dropped_files", 0) + lost.get("after_failure", 0) >= 2, lost  # pass 1's, and later
    assert "end_time" in manifest  # the version written at close, not an earlier one
    assert any(e["where"] == "writer" for e in manifest["errors"])
    assert MANIFEST_RESERVE not in left and not [n for n in left if n.endswith(".tmp")]
    said = "\n".join(tracedump_warnings(caught)) + capfd.readouterr().err
    assert "is marked incomplete" in said and "could not be updated" not in said


def test_a_manifest_that_cannot_be_written_is_never_said_to_be_marked_incomplete(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """No reserve left (another program took the space first, say): stderr says the manifest is stale."""
    model = _Wide().eval()
    with full_filesystem(tmp_path / "full", keep_free=40 << 10) as full:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with tracedump.attach(model, {"dir": full / "d"}) as dumper, torch.no_grad():
                dumper.rundir.writer.drop_reserve()
                _fill(full)
                with dumper.step():
                    model(torch.ones(2, 16))
        manifest = _manifest(dumper.run_dir)
    said = "\n".join(tracedump_warnings(caught)) + capfd.readouterr().err
    assert manifest["incomplete_reason"] is None  # the premise: the manifest kept its first version
    assert "is marked incomplete" not in said
    assert "could not be updated" in said and "No space left" in said


# ------------------------------------------------------------------ 7. a dump written into its reference


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A reference a graft can read: one pass with the modules' inputs."""
    root = tmp_path_factory.mktemp("reference") / "ref"
    model = _Wide().eval()
    with tracedump.attach(model, {"dir": root, "inputs": True}), torch.no_grad():
        model(torch.ones(2, 16))
    return root


def _runs(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.name.startswith("rank"))


@pytest.mark.parametrize("where", ["itself", "inside", "inside_its_run", "link", "run_dir_parent"])
def test_a_graft_whose_dump_dir_is_inside_its_reference_is_refused_naming_both_variables(
    reference: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    (run,) = _runs(reference)
    graft_from = reference / run if where == "run_dir_parent" else reference
    out = {
        "itself": reference,
        "inside": reference / "again",
        "inside_its_run": reference / run / "sub",
        "link": tmp_path / "link",
        "run_dir_parent": reference,
    }[where]
    if where == "link":
        out.symlink_to(reference)
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(out))
    monkeypatch.setenv("TRACEDUMP_DUMP_GRAFT_FROM", str(graft_from))
    with pytest.raises(tracedump.ConfigError) as info:
        tracedump.attach(_Wide().eval())
    message = str(info.value)
    assert f"TRACEDUMP_DUMP_DIR={str(out)!r}" in message, message
    assert "TRACEDUMP_DUMP_GRAFT_FROM" in message and "into the reference" in message
    assert _runs(reference) == [run] and not (reference / "again").exists()
    assert not (reference / run / "sub").exists()


def test_graft_into_its_own_reference_is_refused_and_beside_it_is_not(
    reference: Path, tmp_path: Path
) -> None:
    model = _Wide().eval()
    with pytest.raises(tracedump.ConfigError, match="into the reference"):
        tracedump.graft(model, reference, dir=reference / "g").__enter__()
    with torch.no_grad(), tracedump.graft(model, reference, dir=tmp_path / "g") as graft:
        graft.run(torch.ones(2, 16))
    assert len(_runs(tmp_path / "g")) == 1 and len(_runs(reference)) == 1
