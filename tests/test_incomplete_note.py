"""A dump whose manifest says ``complete: false`` is noted by ``diff``, whether or not it gives a
reason (a killed process, a full disk: the manifest was never finalised); the exit code stays."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import tracedump
from tracedump.cli import main


def _dump(base: Path) -> Path:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    dumper = tracedump.attach(model, {"dir": str(base)})
    with torch.no_grad():
        model(torch.randn(3, 4))
    dumper.close()
    return base


@pytest.mark.parametrize(
    ("edit", "said"),
    [
        ({"complete": False, "incomplete_reason": None}, "never finalised"),
        (
            {"complete": False, "incomplete_reason": None, "skipped": {}, "passes": {"count": 0}},
            "never finalised",
        ),
        ({"complete": False}, "never finalised"),
        ({"complete": False, "incomplete_reason": "write failed: No space left on device"}, "No space left"),
    ],
)
@pytest.mark.parametrize("side", ["a", "b"])
def test_an_unfinished_side_is_noted_and_the_exit_code_kept(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], edit: dict, said: str, side: str
) -> None:
    a, b = _dump(tmp_path / "a"), _dump(tmp_path / "b")
    (run,) = (a if side == "a" else b).iterdir()
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["complete"] is True  # the premise: a closed dump is complete
    manifest.pop("incomplete_reason", None)
    manifest.update(edit)
    (run / "manifest.json").write_text(json.dumps(manifest))
    capsys.readouterr()

    code = main(["diff", str(a), str(b), "--json", str(tmp_path / "r.json")])

    out = capsys.readouterr().out
    notes = json.loads((tmp_path / "r.json").read_text())["settings"]["notes"]
    assert code == 0
    assert any(n.startswith(f"{side.upper()} ") and "incomplete" in n and said in n for n in notes), notes
    assert f"note: {side.upper()} " in out and said in out
