"""Dump-side defects found by feeding tracedump hostile programs and files.

Each test names its defect and failed on the code before its fix.
"""

from __future__ import annotations

import json
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import make_tiny_llama, read_passes, tracedump_warnings
from torch import nn

import tracedump
from tracedump import ConfigError
from tracedump.cli import main

pytestmark = pytest.mark.usefixtures("fresh_warn_once")


def _manifest(run_dir: Path) -> dict:
    return json.loads((run_dir / "manifest.json").read_text())


class _Returns(nn.Module):
    """A leaf that returns whatever ``make`` builds from its input."""

    def __init__(self, make: Callable[[torch.Tensor], Any]) -> None:
        super().__init__()
        self.make = make

    def forward(self, x: torch.Tensor) -> Any:
        return self.make(x)


class _Root(nn.Module):
    def __init__(self, make: Callable[[torch.Tensor], Any]) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.odd = _Returns(make)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        self.odd(y)
        return y


def _dump_one_forward(
    tmp_path: Path, make: Callable[[torch.Tensor], Any]
) -> tuple[dict[str, torch.Tensor], dict, list[str]]:
    model = _Root(make)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tracedump.attach(model, {"dir": tmp_path / "d"}) as dumper, torch.no_grad():
            model(torch.ones(1, 4))
    return read_passes(dumper.run_dir)[0], _manifest(dumper.run_dir), tracedump_warnings(caught)


# ------------------------------------------------------------------ 17. two leaves, one key


def test_an_int_and_a_str_dict_key_that_print_alike_get_distinct_keys(tmp_path: Path) -> None:
    tensors, manifest, _ = _dump_one_forward(tmp_path, lambda x: {0: x + 1, "0": x + 2})
    assert list(tensors) == ["lin", "odd[0]", "odd[0#1]"]
    assert torch.equal(tensors["odd[0]"], tensors["lin"] + 1)
    assert torch.equal(tensors["odd[0#1]"], tensors["lin"] + 2)
    assert manifest["skipped"] == {}


def test_a_distinct_key_never_takes_a_key_the_output_itself_holds(tmp_path: Path) -> None:
    tensors, _, _ = _dump_one_forward(tmp_path, lambda x: {0: x + 1, "0": x + 2, "0#1": x + 3})
    assert sorted(tensors) == ["lin", "odd[0#1]", "odd[0#2]", "odd[0]"]
    assert torch.equal(tensors["odd[0#1]"], tensors["lin"] + 3)  # the real key keeps its name
    assert torch.equal(tensors["odd[0#2]"], tensors["lin"] + 2)


def test_a_key_holding_brackets_that_spells_a_nested_path_gets_a_distinct_key(tmp_path: Path) -> None:
    tensors, _, _ = _dump_one_forward(tmp_path, lambda x: {"a": {"b": x + 1}, "a][b": x + 2})
    assert list(tensors) == ["lin", "odd[a][b]", "odd[a][b#1]"]


class _Keyword(nn.Module):
    def forward(self, x: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        return x + kwargs["0"]


class _CallsWithKeyword(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.odd = _Keyword()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.odd(x, **{"0": x * 3})


def test_an_input_keyword_named_like_a_position_gets_a_distinct_key(tmp_path: Path) -> None:
    model = _CallsWithKeyword()
    with tracedump.attach(model, {"dir": tmp_path / "d", "inputs": True}) as dumper, torch.no_grad():
        model(torch.ones(1, 4))
    tensors = read_passes(dumper.run_dir)[0]
    assert list(tensors) == ["odd@in[0]", "odd@in[0#1]", "odd"]
    assert torch.equal(tensors["odd@in[0]"], torch.ones(1, 4))
    assert torch.equal(tensors["odd@in[0#1]"], torch.full((1, 4), 3.0))


# ------------------------------------------------------------------ 18. deeper than 8 levels


def _nested(tensor: torch.Tensor, depth: int) -> object:
    value: object = tensor
    for _ in range(depth):
        value = [value]
    return value


def test_tensors_nested_deeper_than_eight_levels_are_counted_and_warned(tmp_path: Path) -> None:
    tensors, manifest, said = _dump_one_forward(
        tmp_path, lambda x: (_nested(x, 7), _nested(x + 1, 8), _nested(x + 2, 12), {"k": _nested(x, 9)})
    )
    assert list(tensors) == ["lin", "odd[0][0][0][0][0][0][0][0]"]  # 8 containers deep: kept
    assert manifest["skipped"] == {"too_deep": 3}
    assert any("too_deep" in message for message in said)


def test_a_self_referencing_output_is_walked_once_and_counted(tmp_path: Path) -> None:
    def loop(x: torch.Tensor) -> list:
        value: list = [x]
        value.append(value)
        return value

    tensors, manifest, _ = _dump_one_forward(tmp_path, loop)
    assert len(tensors) == 1 + 8  # the tensor at each of the 8 levels, as before
    assert manifest["skipped"] == {"too_deep": 1}


# ------------------------------------------------------------------ 19. GRAFT_MAP nested too deep


@pytest.mark.parametrize("name", ["GRAFT_MAP", "FILTER"])
@pytest.mark.parametrize("value", ["[" * 100000, '["' + "(" * 100000 + '=x"]'])
def test_a_list_setting_nested_too_deep_is_a_config_error_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path / "d"))
    monkeypatch.setenv(f"TRACEDUMP_DUMP_{name}", value)
    with pytest.raises(ConfigError, match=f"TRACEDUMP_DUMP_{name}="):
        tracedump.attach(nn.Linear(2, 2))
    assert not (tmp_path / "d").exists()


def test_a_graft_level_nested_too_deep_is_a_config_error_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path / "d"))
    monkeypatch.setenv("TRACEDUMP_DUMP_GRAFT_LEVEL", "(" * 100000)
    with pytest.raises(ConfigError, match="TRACEDUMP_DUMP_GRAFT_LEVEL="):
        tracedump.attach(nn.Linear(2, 2))


# ------------------------------------------------------------------ 20, 21. a reference that can't graft

IDS = torch.tensor([[3, 14, 15, 9, 26, 5, 7]])


def _reference(path: Path, inputs: bool = True) -> Path:
    model = make_tiny_llama()
    dumper = tracedump.attach(model, {"dir": str(path), "modules": "all", "inputs": inputs})
    assert dumper is not None
    with torch.no_grad():
        model(IDS)
        model(IDS)
    dumper.close()
    return path


def _truncate_pass0(reference: Path) -> None:
    (pass0,) = reference.glob("rank*/pass00000.safetensors")
    data = pass0.read_bytes()
    pass0.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("damage", ["truncated", "no_inputs"])
def test_a_reference_that_cannot_graft_is_a_config_error_naming_graft_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    reference = _reference(tmp_path / "ref", inputs=damage != "no_inputs")
    if damage == "truncated":
        _truncate_pass0(reference)
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path / "d"))
    monkeypatch.setenv("TRACEDUMP_DUMP_GRAFT_FROM", str(reference))
    with pytest.raises(ConfigError, match="TRACEDUMP_DUMP_GRAFT_FROM=") as caught:
        tracedump.attach(make_tiny_llama())
    assert ("no module inputs" in str(caught.value)) == (damage == "no_inputs")
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("damage", ["truncated", "no_inputs"])
def test_tracedump_run_with_a_reference_that_cannot_graft_exits_2_before_the_command(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], damage: str
) -> None:
    reference = _reference(tmp_path / "ref", inputs=damage != "no_inputs")
    if damage == "truncated":
        _truncate_pass0(reference)
    marker = tmp_path / "started"
    status = main(
        ["run", "--graft-from", str(reference), "--dir", str(tmp_path / "d"), "--", "touch", str(marker)]
    )
    assert status == 2
    assert not marker.exists()
    err = capfd.readouterr().err
    assert "TRACEDUMP_DUMP_GRAFT_FROM=" in err and "COMMAND not started" in err


# ------------------------------------------------------------------ 22. steps on several threads


class _Held(nn.Module):
    """A leaf that, on the thread named ``holder``, waits inside its forward for ``release``."""

    def __init__(self) -> None:
        super().__init__()
        self.holder: int | None = None
        self.inside, self.release = threading.Event(), threading.Event()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if threading.get_ident() == self.holder:
            self.inside.set()
            assert self.release.wait(timeout=60)
        return x * 2


def test_a_step_on_a_second_thread_inside_another_threads_step_is_counted_not_merged(
    tmp_path: Path,
) -> None:
    model = _Root(lambda x: x)
    model.odd = _Held()
    seen: dict[str, torch.Tensor] = {}

    def first() -> None:
        model.odd.holder = threading.get_ident()
        with dumper.step():
            seen["first"] = model(torch.ones(1, 4))

    def second() -> None:
        assert model.odd.inside.wait(timeout=60)
        try:
            with dumper.step():
                seen["second"] = model(torch.full((1, 4), 5.0))
                tracedump.record("margin", torch.ones(2))
        finally:
            model.odd.release.set()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tracedump.attach(model, {"dir": tmp_path / "d"}) as dumper, torch.no_grad():
            threads = [threading.Thread(target=first), threading.Thread(target=second)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=120)
            with dumper.step():
                model(torch.full((1, 4), 2.0))  # afterwards, from one thread: a whole pass
    passes = read_passes(dumper.run_dir)
    assert sorted(passes) == [0, 1]
    assert list(passes[0]) == ["lin", "odd"]  # the first thread's, no ::call1 from the second
    with torch.no_grad():
        assert torch.equal(passes[0]["lin"], model.lin(torch.ones(1, 4)))
        assert torch.equal(passes[1]["lin"], model.lin(torch.full((1, 4), 2.0)))
    manifest = _manifest(dumper.run_dir)
    assert manifest["skipped"] == {"concurrent_thread": 3}  # the second thread's lin, odd, margin
    assert "concurrent_threads" in manifest["anomalies"]
    assert sum("concurrent_thread" in m or "second thread" in m for m in tracedump_warnings(caught)) >= 1
    with torch.no_grad():
        assert torch.equal(seen["second"], model.lin(torch.full((1, 4), 5.0)))  # the host ran untouched


def test_steps_on_four_threads_each_capture_is_written_or_counted(tmp_path: Path) -> None:
    model = _Root(lambda x: x * 2)
    threads_n, steps_n, start = 4, 10, threading.Barrier(4)

    def work(seed: int) -> None:
        start.wait(timeout=60)
        for step in range(steps_n):
            with dumper.step():
                model(torch.full((1, 4), float(seed * 100 + step)))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tracedump.attach(model, {"dir": tmp_path / "d"}) as dumper, torch.no_grad():
            threads = [threading.Thread(target=work, args=(i,)) for i in range(threads_n)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=120)
    passes = read_passes(dumper.run_dir)
    manifest = _manifest(dumper.run_dir)
    written = sum(len(tensors) for tensors in passes.values())
    skipped = manifest["skipped"].get("concurrent_thread", 0)
    assert written + skipped == threads_n * steps_n * 2
    assert set(manifest["skipped"]) <= {"concurrent_thread"}
    for tensors in passes.values():
        assert list(tensors) == ["lin", "odd"]  # one thread's step each, never merged as ::callN
        assert torch.equal(tensors["odd"], tensors["lin"] * 2)  # both captures of the same forward
    if skipped:
        assert "concurrent_threads" in manifest["anomalies"]
        assert any("concurrent_thread" in m or "thread" in m for m in tracedump_warnings(caught))
