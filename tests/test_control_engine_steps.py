"""Control mode as a serving engine meets it: armed before the first step, and a window of N steps
that gets N consecutive steps when the engine computes its logits outside the model's forward."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import tracedump
import tracedump.cli
from tracedump.dump.control import watchers

pytestmark = pytest.mark.usefixtures("fresh_warn_once")


class _Engineish(nn.Module):
    """vLLM's shape: the forward returns hidden states, ``compute_logits`` runs the head after it."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)


_OPENED: list[tracedump.Dumper] = []


@pytest.fixture(autouse=True)
def _close_every_dumper() -> Iterator[None]:
    yield
    while _OPENED:
        _OPENED.pop().close()


def _attach(dump: Path, model: nn.Module) -> tracedump.Dumper:
    dumper = tracedump.attach(model, {"dir": str(dump), "control": True})
    assert dumper is not None
    _OPENED.append(dumper)
    return dumper


def _engine_step(model: _Engineish) -> None:
    model.compute_logits(model(torch.ones(2, 4)))  # no step(): one pass per root forward


def _passes(dump: Path) -> list[int]:
    return sorted(int(p.name[4:9]) for p in next(dump.glob("rank*")).glob("pass*.safetensors"))


def test_an_engine_that_never_stepped_can_be_armed(tmp_path: Path) -> None:
    model = _Engineish()
    dumper = _attach(tmp_path, model)
    (found,) = watchers(tmp_path)  # the heartbeat exists from attach on
    assert found.step == 0 and found.state == "idle"
    assert tracedump.cli.main(["arm", str(tmp_path), "--steps", "2"]) == 0
    for _ in range(8):
        _engine_step(model)
    dumper.close()
    dumped = _passes(tmp_path)
    assert len(dumped) == 2 and dumped[1] == dumped[0] + 1


def test_a_window_of_three_steps_gets_three_consecutive_steps_with_logits_outside_the_forward(
    tmp_path: Path,
) -> None:
    model = _Engineish()
    dumper = _attach(tmp_path, model)
    for _ in range(3):
        _engine_step(model)
    assert tracedump.cli.main(["arm", str(tmp_path), "--steps", "3"]) == 0
    control = dumper.recorder.control
    assert control is not None
    for _ in range(200):
        if any(e["event"] == "done" for e in control.history):
            break
        _engine_step(model)
    for _ in range(3):
        _engine_step(model)
    dumper.close()
    dumped = _passes(tmp_path)
    assert dumped == [dumped[0], dumped[0] + 1, dumped[0] + 2], dumped
    manifest = json.loads((next(tmp_path.glob("rank*")) / "manifest.json").read_text())
    done = [e for e in manifest["control"]["orders"] if e["event"] == "done"]
    assert done and done[0]["dumped"] == 3 and done[0]["step"] == dumped[-1] + 1
    # the head ran outside every pass: counted, never mixed into a step
    assert manifest["skipped"].get("outside_pass", 0) >= 1
