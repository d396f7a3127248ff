"""Hostile settings and arguments: errors that name the variable, one line, nothing left behind."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tracedump
from tracedump.cli import main


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 4))


def _no_hooks(model: torch.nn.Module) -> bool:
    return not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


@pytest.mark.parametrize("parent_exists", [True, False])
def test_a_dir_with_a_component_too_long_is_a_config_error_leaving_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, parent_exists: bool
) -> None:
    parent = tmp_path if parent_exists else tmp_path / "new" / "parents"
    target = parent / ("x" * 300)
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(target))
    model = _model()
    with pytest.raises(tracedump.ConfigError) as info:
        tracedump.attach(model)
    assert "TRACEDUMP_DUMP_DIR=" in str(info.value) and "File name too long" in str(info.value)
    assert "Traceback" not in str(info.value) and len(str(info.value).splitlines()) == 2
    assert sorted(tmp_path.iterdir()) == []  # no parent left behind
    assert _no_hooks(model)


def test_a_dir_whose_deep_part_cannot_be_made_leaves_no_parent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "a" / "b" / ("y" * 300) / "c"
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(target))
    with pytest.raises(tracedump.ConfigError, match="TRACEDUMP_DUMP_DIR="):
        tracedump.attach(_model())
    assert sorted(tmp_path.iterdir()) == []


def test_a_filter_that_recurses_in_the_regex_parser_is_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path / "dump"))
    monkeypatch.setenv("TRACEDUMP_DUMP_FILTER", "[" * 100000)
    model = _model()
    with pytest.raises(tracedump.ConfigError) as info:
        tracedump.attach(model)
    message = str(info.value)
    assert "TRACEDUMP_DUMP_FILTER=" in message and "nested too deep" in message and len(message) < 1000
    assert not (tmp_path / "dump").exists() and _no_hooks(model)


def test_tracedump_run_with_a_recursing_filter_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    script = tmp_path / "host.py"
    script.write_text("import torch, tracedump\ntracedump.attach(torch.nn.Linear(2, 2))\n")
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("TRACEDUMP_")},
        "TRACEDUMP_DUMP_FILTER": "[" * 100000,
    }
    done = subprocess.run(
        [sys.executable, "-m", "tracedump", "run", "--dir", str(tmp_path / "dump"), str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode != 0
    assert "Traceback" not in done.stderr and "TRACEDUMP_DUMP_FILTER" in done.stderr


def test_diff_max_rows_below_zero_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["diff", str(tmp_path), str(tmp_path), "--max-rows", "-5"])
    assert info.value.code == 2 and "--max-rows" in capsys.readouterr().err


def test_a_dump_dir_that_fails_after_its_parents_were_made_leaves_none_of_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno
    import tempfile

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tempfile, "TemporaryFile", full)  # the write probe in the new run dir fails
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path / "new" / "parents" / "dump"))
    with pytest.raises(tracedump.ConfigError, match="No space left"):
        tracedump.attach(_model())
    assert sorted(tmp_path.iterdir()) == []
