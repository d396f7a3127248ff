"""Hostile orders, heartbeats and files against live control."""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import tracedump
import tracedump.cli
from tracedump.dump.control import ORDER_FILE, STATE_FILE

pytestmark = pytest.mark.usefixtures("fresh_warn_once")

_OPENED: list[tracedump.Dumper] = []


@pytest.fixture(autouse=True)
def _close_every_dumper() -> Iterator[None]:
    yield
    while _OPENED:
        _OPENED.pop().close()


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))


def _attach(dump: Path, model: torch.nn.Module, **settings: object) -> tracedump.Dumper:
    dumper = tracedump.attach(model, {"dir": str(dump), "control": True, **settings})
    assert dumper is not None
    _OPENED.append(dumper)
    return dumper


def _steps(dumper: tracedump.Dumper, model: torch.nn.Module, count: int) -> None:
    for _ in range(count):
        with dumper.step():
            model(torch.ones(2, 4))


def _until(dumper: tracedump.Dumper, model: torch.nn.Module, event: str, limit: int = 200_000) -> None:
    assert dumper.recorder.control is not None
    for _ in range(limit):
        history = dumper.recorder.control.history
        if history and any(e["event"] == event and e["id"] == history[-1]["id"] for e in history):
            return
        _steps(dumper, model, 1)
    raise AssertionError(f"the order never reached {event!r}: {dumper.recorder.control.history}")


def _hand_written(dump: Path, data: dict[str, object]) -> Path:
    """An order file written by hand (the owner's, 0600): what the engine reads, not what the CLI checks."""
    path = dump / ORDER_FILE
    path.write_text(json.dumps(data))
    path.chmod(0o600)
    return path


# ------------------------------------------------------------------ 1: an armed filter cannot stall


@pytest.mark.parametrize("pattern", ["(.*.*)*X", "(a+)+b", "(a|a)*b", ".*.*.*.*X"])
def test_a_backtracking_filter_is_refused_by_the_cli(
    tmp_path: Path, pattern: str, capsys: pytest.CaptureFixture[str]
) -> None:
    model = _model()
    dumper = _attach(tmp_path, model)
    _steps(dumper, model, 1)
    assert tracedump.cli.main(["arm", str(tmp_path), "--filter", pattern, "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "--filter" in err and "stall the engine" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / ORDER_FILE).exists()


@pytest.mark.parametrize(
    "pattern",
    ["(?:a?){30}a{30}", "(?:(?:.?){16}){16}X", ".?" * 60 + "X", ".{0,16}" * 8 + "X", "(?:.|..)" * 20 + "X"],
    ids=["optional-under-bounded", "bounded-under-bounded", "optional-60x", "bounded-8x", "branches-20x"],
)
def test_a_filter_backtracking_through_bounded_repeats_is_refused(
    tmp_path: Path, pattern: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Bounded repeats (``?``, ``{0,16}``) and alternations are choices too: each of these takes
    seconds to years on one module name, though no repeat in it is open-ended."""
    model = _model()
    dumper = _attach(tmp_path, model)
    _steps(dumper, model, 1)
    assert tracedump.cli.main(["arm", str(tmp_path), "--filter", pattern, "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "--filter" in err and "stall the engine" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / ORDER_FILE).exists()


@pytest.mark.parametrize(
    "pattern",
    [r"layers\.(3|4)\.", r"^model\..*\.mlp$", ".*(gate|up)_proj.*", r"layers\.\d{1,2}\.", r"mlp(\.o)?$"],
)
def test_everyday_filters_are_armed(tmp_path: Path, pattern: str) -> None:
    model = _model()
    dumper = _attach(tmp_path, model)
    _steps(dumper, model, 1)
    assert tracedump.cli.main(["arm", str(tmp_path), "--filter", pattern, "--steps", "1"]) == 0
    dumper.close()


def test_a_hand_written_backtracking_filter_is_ignored_by_the_engine(tmp_path: Path) -> None:
    model = _model()
    dumper = _attach(tmp_path, model)
    _steps(dumper, model, 1)
    _hand_written(tmp_path, {"id": 7, "action": "arm", "filter": "(.*.*)*X", "steps": 1})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _steps(dumper, model, 5)
    dumper.close()
    assert dumper.recorder.control is not None and dumper.recorder.control.window is None
    assert any("stall the engine" in str(w.message) for w in caught)
    assert not list(tmp_path.glob("rank*/pass*.safetensors"))


def test_an_armed_filter_is_matched_once_per_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cost of a filter is paid once per module name and order, not once per capture."""
    import re

    searched: list[str] = []
    search = re.search

    def counting(pattern: str, name: str, *args: object) -> object:
        if pattern == "^[02]$":
            searched.append(name)
        return search(pattern, name, *args)

    model = _model()
    dumper = _attach(tmp_path, model)
    _steps(dumper, model, 1)
    assert tracedump.cli.main(["arm", str(tmp_path), "--filter", "^[02]$"]) == 0
    monkeypatch.setattr(re, "search", counting)
    _until(dumper, model, "armed")
    _steps(dumper, model, 6)
    dumper.close()
    assert sorted(searched) == ["0", "1", "2"]  # each name once, over 7 armed steps
    run = tracedump.open_dump(tmp_path).run()
    names = {name.split(".")[0] for p in run.passes.values() for name in p}
    assert len(run.passes) >= 7 and names == {"0", "2"}


# ------------------------------------------------------------------ 2: STEPS with CONTROL


def test_steps_with_control_is_refused_at_attach_naming_both_variables(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path / "dump"))
    monkeypatch.setenv("TRACEDUMP_DUMP_CONTROL", "1")
    monkeypatch.setenv("TRACEDUMP_DUMP_STEPS", "0-5")
    model = _model()
    with pytest.raises(tracedump.ConfigError) as info:
        tracedump.attach(model)
    message = str(info.value)
    assert "TRACEDUMP_DUMP_STEPS='0-5'" in message and "TRACEDUMP_DUMP_CONTROL='1'" in message
    assert not (tmp_path / "dump").exists()
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_steps_with_control_in_a_config_is_refused_too(tmp_path: Path) -> None:
    with pytest.raises(tracedump.ConfigError, match=r"DumpConfig\.steps.*DumpConfig\.control"):
        tracedump.attach(_model(), {"dir": str(tmp_path), "control": True, "steps": "2"})


def test_steps_with_control_under_tracedump_run_does_not_start_the_command(tmp_path: Path) -> None:
    """As every other bad setting: one message and COMMAND not started, not a traceback in it."""
    import os
    import subprocess
    import sys

    marker = tmp_path / "started"
    done = subprocess.run(
        [sys.executable, "-m", "tracedump", "run", "--dir", str(tmp_path / "d"), "--steps", "0-5", "--",
         sys.executable, "-c", f"open({str(marker)!r}, 'w')"],
        env={**os.environ, "TRACEDUMP_DUMP_CONTROL": "1"}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "TRACEDUMP_DUMP_STEPS='0-5' with TRACEDUMP_DUMP_CONTROL='1'" in done.stderr
    assert "COMMAND not started" in done.stderr and "Traceback" not in done.stderr
    assert not marker.exists()


def test_a_dump_dir_component_too_long_under_tracedump_run_does_not_start_the_command(
    tmp_path: Path,
) -> None:
    """A dump dir that cannot be written, under run: each child would warn 'cannot dump' and run
    end 'nothing written', exit 0."""
    import subprocess
    import sys

    marker = tmp_path / "started"
    done = subprocess.run(
        [sys.executable, "-m", "tracedump", "run", "--dir", str(tmp_path / "new" / ("x" * 300)), "--",
         sys.executable, "-c", f"open({str(marker)!r}, 'w')"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "TRACEDUMP_DUMP_DIR=" in done.stderr and "a component of 300 bytes" in done.stderr
    assert "COMMAND not started" in done.stderr
    assert not marker.exists() and not (tmp_path / "new").exists()


# ------------------------------------------------------------------ 11: ranges checked by the CLI


def test_an_out_of_range_step_count_is_refused_by_the_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = _model()
    dumper = _attach(tmp_path, model)
    _steps(dumper, model, 1)
    assert tracedump.cli.main(["arm", str(tmp_path), "--steps", "100000000000000000000000"]) == 2
    err = capsys.readouterr().err
    assert "--steps 100000000000000000000000" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / ORDER_FILE).exists()


def test_a_request_too_long_for_an_order_is_refused_by_the_cli_and_worded_by_the_engine(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A 70 kB --request was armed (exit 0), then ignored by the engine as 'not valid JSON': it read
    the first 64 KiB of a valid file."""
    model = _model()
    dumper = _attach(tmp_path, model)
    _steps(dumper, model, 1)
    assert tracedump.cli.main(["arm", str(tmp_path), "--request", "x" * 70_000, "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "--request" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / ORDER_FILE).exists()
    _hand_written(tmp_path, {"id": 9, "action": "arm", "steps": 1, "filter": "x" * 70_000})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _steps(dumper, model, 2)
    dumper.close()
    ignored = [str(w.message) for w in caught if "ignoring" in str(w.message)]
    assert len(ignored) == 1 and "larger than 65536 bytes" in ignored[0], ignored
    assert "not valid JSON" not in ignored[0]


def test_the_engine_words_an_out_of_range_order_by_its_cause(tmp_path: Path) -> None:
    model = _model()
    dumper = _attach(tmp_path, model)
    _steps(dumper, model, 1)
    _hand_written(tmp_path, {"id": 3, "action": "arm", "steps": 10**23})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _steps(dumper, model, 3)
    messages = [str(w.message) for w in caught if "ignoring" in str(w.message)]
    assert messages and "out of range" in messages[0] and "not valid JSON" not in messages[0]


# ------------------------------------------------------------------ 12: hostile heartbeats


def _heartbeat(dump: Path, **fields: object) -> None:
    import os
    import socket
    import time

    run = dump / "rank0_pid999999"
    run.mkdir(parents=True, exist_ok=True)
    beat = {"step": 5, "time": time.time(), "rate": 10.0, "state": "idle", "pid": os.getpid()}
    beat["host"] = socket.gethostname()
    (run / STATE_FILE).write_text(json.dumps({**beat, **fields}))  # json writes NaN, Infinity as such


@pytest.mark.parametrize(
    "fields",
    [
        {"rate": float("inf")},
        {"rate": float("nan")},
        {"rate": 1e308},
        {"time": float("nan")},
        {"time": "1e400"},
        {"step": 10**23},
        {"step": 1e23},
        {"step": -4},
    ],
    ids=[
        "rate-inf",
        "rate-nan",
        "rate-1e308",
        "time-nan",
        "time-1e400",
        "step-1e23",
        "step-float",
        "step-neg",
    ],
)
def test_arm_on_a_hostile_heartbeat_is_one_line_and_exit_2(
    tmp_path: Path, fields: dict[str, object], capsys: pytest.CaptureFixture[str]
) -> None:
    _heartbeat(tmp_path, **fields)
    assert tracedump.cli.main(["arm", str(tmp_path), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and STATE_FILE in err, err
    assert not (tmp_path / ORDER_FILE).exists()


@pytest.mark.parametrize("kind", ["fifo", "link-to-dev-zero", "huge"])
def test_arm_on_a_heartbeat_that_is_no_file_of_an_engine_neither_hangs_nor_arms(
    tmp_path: Path, kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A FIFO blocked ``arm`` in its read, a link to /dev/zero read without end; no engine writes
    either, so they are passed over like any run dir without a heartbeat."""
    import os

    run = tmp_path / "rank0_pid999999"
    run.mkdir(parents=True)
    beat = run / STATE_FILE
    if kind == "fifo":
        os.mkfifo(beat, 0o600)
    elif kind == "huge":
        beat.write_text(" " * (1 << 17) + "{}")
    else:
        beat.symlink_to("/dev/zero")
    assert tracedump.cli.main(["arm", str(tmp_path), "--steps", "1"]) == 2
    assert "no engine watches it" in capsys.readouterr().err
    assert not (tmp_path / ORDER_FILE).exists()


# ------------------------------------------------------------------ 13: every ignored order is told


def test_each_distinct_ignored_order_warns_once_and_is_recorded_with_its_reason(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    model = _model()
    dumper = _attach(tmp_path, model)
    _steps(dumper, model, 1)
    path = tmp_path / ORDER_FILE
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _hand_written(tmp_path, {"id": 1, "action": "arm"}).chmod(0o666)  # world-writable
        _steps(dumper, model, 2)
        os.utime(path)  # the same file touched: not another order
        _steps(dumper, model, 2)
        path.unlink()
        os.mkfifo(path, 0o600)
        _steps(dumper, model, 2)
        path.unlink()
        path.mkdir(mode=0o700)
        _steps(dumper, model, 2)
        path.rmdir()
        path.write_text("{not json")
        path.chmod(0o600)
        _steps(dumper, model, 2)
    dumper.close()
    ignored = [str(w.message) for w in caught if "ignoring" in str(w.message)]
    assert len(ignored) == 4, ignored
    manifest = json.loads((dumper.run_dir / "manifest.json").read_text())
    events = [o["event"] for o in manifest["control"]["orders"] if o["action"] == "ignored"]
    assert len(events) == 4
    assert "writable by others" in events[0] and "not a regular file" in events[1]
    assert "not a regular file" in events[2] and "not valid JSON" in events[3]
    listing = subprocess.run(
        [sys.executable, "-m", "tracedump", "ls", str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert listing.stdout.count("order file ignored:") == 4, listing.stdout


def test_an_ignored_order_rewritten_in_place_warns_again(tmp_path: Path) -> None:
    """`echo ... > control.json` keeps the inode; the same length with other bytes is another order."""
    import os

    model = _model()
    dumper = _attach(tmp_path, model)
    _steps(dumper, model, 1)
    path = tmp_path / ORDER_FILE
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _hand_written(tmp_path, {"id": 5, "action": "arm"}).chmod(0o666)
        _steps(dumper, model, 2)
        inode = path.stat().st_ino
        with open(path, "r+") as handle:  # in place: same inode, same size
            handle.write(json.dumps({"id": 6, "action": "arm"}))
        os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))  # a coarse clock
        assert path.stat().st_ino == inode
        _steps(dumper, model, 2)
        os.utime(path)  # touched only: not another
        _steps(dumper, model, 2)
    dumper.close()
    ignored = [str(w.message) for w in caught if "ignoring" in str(w.message)]
    assert len(ignored) == 2, ignored
    manifest = json.loads((dumper.run_dir / "manifest.json").read_text())
    assert [o["action"] for o in manifest["control"]["orders"]].count("ignored") == 2


# ------------------------------------------------------------------ 15, 16: the files control writes


def test_control_state_is_0600_like_every_file(tmp_path: Path) -> None:
    import os
    import stat

    model = _model()
    dumper = _attach(tmp_path, model)
    _steps(dumper, model, 2)
    assert tracedump.cli.main(["arm", str(tmp_path), "--steps", "1"]) == 0
    dumper.close()
    for path in [tmp_path / ORDER_FILE, *dumper.run_dir.iterdir()]:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path
    assert not [p.name for p in dumper.run_dir.iterdir() if p.name.startswith(".")]


def test_arm_and_disarm_on_a_failing_disk_name_the_file_and_leave_no_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import errno
    import os

    model = _model()
    dumper = _attach(tmp_path, model)
    _steps(dumper, model, 1)
    replace = os.replace

    def full(source: str, target: object) -> None:  # the bytes went nowhere: the rename never comes
        if str(target).endswith(ORDER_FILE):
            raise OSError(errno.ENOSPC, "No space left on device")
        replace(source, target)

    monkeypatch.setattr(os, "replace", full)
    for argv in (["arm", str(tmp_path), "--steps", "1"], ["disarm", str(tmp_path)]):
        assert tracedump.cli.main(argv) == 2
        err = capsys.readouterr().err
        assert str(tmp_path / ORDER_FILE) in err and "No space left" in err and len(err.splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [dumper.run_dir.name]


def test_arm_and_disarm_on_a_really_full_filesystem(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from hostile_fs import full_filesystem

    import tracedump.dump.control

    with full_filesystem(tmp_path / "full") as full:
        before = sorted(p.name for p in full.iterdir())
        # An engine's heartbeat elsewhere would be refused its writes too: the CLI is what is tested.
        monkeypatch.setattr(tracedump.cli, "_watched", lambda directory: ["an engine"])
        monkeypatch.setattr(tracedump.dump.control, "start_step", lambda found: 10)
        for argv in (["arm", str(full), "--steps", "1"], ["disarm", str(full)]):
            assert tracedump.cli.main(argv) == 2
            err = capsys.readouterr().err
            assert str(full / ORDER_FILE) in err and "No space left" in err
        assert sorted(p.name for p in full.iterdir()) == before  # no 0-byte .control.json.*.tmp
