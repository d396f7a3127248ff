"""The CLI's guard: exit 1 means "diverged" and nothing else.

Real subprocesses, each with the premise built, never raced: stdout closed by the shell (``>&-``),
a pipe whose reader left before the first write, a Ctrl-C delivered while the diff is held at a
point the test chose, an error no command expects. And a manifest holding NaN / Infinity, which
``--json`` must still write as strict JSON.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_compare_unshard import write_run

from tracedump.cli import main

# Runs ``tracedump diff`` with the pipeline's build_report replaced by HOOK (a line of Python that
# defines ``hook(options)``): the point where the test acts on the process is the test's own.
_HELD = """
import sys, time
import tracedump.compare.pipeline as pipeline
{hook}
pipeline.build_report = hook
from tracedump.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _pair(tmp_path: Path, passes: int = 2, offset: float = 0.0) -> tuple[Path, Path]:
    """Two one-tensor dumps; B's tensor off by ``offset`` (0: a clean diff)."""
    values = torch.arange(8, dtype=torch.float32).reshape(2, 4)
    a = tmp_path / "a"
    b = tmp_path / "b"
    write_run(a, 0, {index: {"x": values} for index in range(passes)})
    write_run(b, 0, {index: {"x": values + offset} for index in range(passes)})
    return a, b


def _tracedump(*args: str | Path) -> list[str]:
    return [sys.executable, "-m", "tracedump", *map(str, args)]


def _held(hook: str, *args: str | Path) -> list[str]:
    return [sys.executable, "-c", _HELD.format(hook=hook), *map(str, args)]


def test_a_clean_diff_exits_0_and_a_divergence_1(tmp_path: Path) -> None:
    """The two codes the guard must leave alone."""
    clean = subprocess.run(_tracedump("diff", *_pair(tmp_path / "clean")), capture_output=True, text=True)
    diverged = subprocess.run(
        _tracedump("diff", *_pair(tmp_path / "off", offset=1.0)), capture_output=True, text=True
    )
    assert (clean.returncode, diverged.returncode) == (0, 1), clean.stderr + diverged.stderr
    assert "first divergence: pass 0 x" in diverged.stdout


def test_a_clean_diff_with_stdout_closed_exits_2_with_one_line(tmp_path: Path) -> None:
    """``>&-``: the report cannot be written; once a traceback and exit 1 ("diverged")."""
    command = " ".join(shlex.quote(part) for part in _tracedump("diff", *_pair(tmp_path)))
    result = subprocess.run(["bash", "-c", f"{command} >&-"], capture_output=True, text=True)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        "tracedump diff: stdout closed before the output was written (exit 2)"
    ]


def test_stdout_closed_is_held_on_devnull_so_no_file_lands_on_fd_1(tmp_path: Path) -> None:
    """With fd 1 closed, the next file opened would be fd 1: the guard takes it first."""
    probe = (
        "import os, sys\n"
        "from tracedump import cli\n"
        "with cli._stdout_guard():\n"
        "    fd = os.open(sys.argv[1], os.O_RDONLY)\n"
        "    os.write(2, f'{fd} {os.readlink(\"/proc/self/fd/1\")}'.encode())\n"
    )
    command = shlex.join([sys.executable, "-c", probe, str(tmp_path)])
    result = subprocess.run(["bash", "-c", f"{command} >&-"], capture_output=True, text=True)
    fd, target = result.stderr.split()
    assert int(fd) > 2 and target == os.devnull, result.stderr


def test_a_pipe_closed_before_the_report_exits_2_not_1(tmp_path: Path) -> None:
    """`| head -1` made certain: the reader's end is closed before the process starts, so the first
    write fails with EPIPE (rich's own handler raised SystemExit(1) there)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run(
            _tracedump("diff", *_pair(tmp_path)), stdout=write_end, stderr=subprocess.PIPE, text=True
        )
    finally:
        os.close(write_end)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and "Exception ignored" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert "stdout closed" in result.stderr


def test_json_to_a_closed_pipe_exits_2(tmp_path: Path) -> None:
    """``--json -`` writes with sys.stdout.write, not rich: the same exit code."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run(
            _tracedump("diff", *_pair(tmp_path), "--json", "-"),
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
        )
    finally:
        os.close(write_end)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr


def test_ctrl_c_during_a_diff_exits_130_without_a_traceback(tmp_path: Path) -> None:
    """The diff is held (it says so, then sleeps) until the test's SIGINT has landed."""
    hook = "def hook(options):\n    print('held', file=sys.stderr, flush=True)\n    time.sleep(120)\n"
    process = subprocess.Popen(
        _held(hook, "diff", *_pair(tmp_path)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert process.stderr is not None
        assert process.stderr.readline().strip() == "held"  # the premise: inside the diff, not before
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert err.strip().splitlines() == ["tracedump diff: interrupted"]
    assert out == ""


def test_an_unexpected_error_exits_2_with_one_line_and_debug_shows_the_traceback(tmp_path: Path) -> None:
    hook = "def hook(options):\n    raise RuntimeError('boom\\nsecond line')\n"
    a, b = _pair(tmp_path)
    plain = subprocess.run(_held(hook, "diff", a, b), capture_output=True, text=True)
    assert plain.returncode == 2
    assert plain.stderr.strip().splitlines() == [
        "tracedump diff: internal error: RuntimeError: boom; rerun with `--debug` for the traceback"
    ]
    for args in (("diff", a, b, "--debug"), ("--debug", "diff", a, b)):
        debug = subprocess.run(_held(hook, *args), capture_output=True, text=True)
        assert debug.returncode == 2
        assert "Traceback (most recent call last)" in debug.stderr
        assert "RuntimeError: boom" in debug.stderr
        assert debug.stderr.strip().splitlines()[-1].startswith("tracedump diff: internal error:")


def test_the_debug_flag_is_not_passed_to_the_command(tmp_path: Path) -> None:
    """``diff``'s options are read from every argparse dest: ``--debug`` must not be one of them."""
    a, b = _pair(tmp_path)
    assert main(["diff", str(a), str(b), "--debug"]) == 0
    assert main(["--debug", "ls", str(a)]) == 0


def test_an_unexpected_error_in_process_never_returns_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import tracedump.compare.pipeline as pipeline

    def broken(options: object) -> object:
        raise AttributeError("'int' object has no attribute 'get'")

    monkeypatch.setattr(pipeline, "build_report", broken)
    a, b = _pair(tmp_path)
    assert main(["diff", str(a), str(b)]) == 2
    err = capsys.readouterr().err
    assert "internal error: AttributeError" in err and len(err.strip().splitlines()) == 1


# ------------------------------------------------------------------ NaN in a manifest


def _strict(text: str) -> object:
    def refuse(constant: str) -> object:
        raise AssertionError(f"{constant} is not strict JSON")

    return json.loads(text, parse_constant=refuse)


def test_a_manifest_holding_nan_and_infinity_still_gives_strict_json(tmp_path: Path) -> None:
    a, b = _pair(tmp_path)
    manifest_path = next(a.iterdir()) / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["settings"]["threshold"] = math.inf
    manifest["calibration"] = {"scale": math.nan, "floor": [-math.inf, 1.5]}
    manifest_path.write_text(json.dumps(manifest))  # Python's json writes NaN / Infinity
    assert "NaN" in manifest_path.read_text()
    result = subprocess.run(_tracedump("diff", a, b, "--json", "-"), capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    doc = _strict(result.stdout)
    assert isinstance(doc, dict)
    (root,) = doc["sides"]["a"]["roots"].values()
    facts = root["manifest"]
    assert facts["calibration"] == {"scale": "nan", "floor": ["-inf", 1.5]}
    assert facts["settings"]["threshold"] == "inf"
    assert doc["summary"]["exit_code"] == 0


def test_a_manifest_holding_nan_still_gives_a_page(tmp_path: Path) -> None:
    a, b = _pair(tmp_path)
    manifest_path = next(a.iterdir()) / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["calibration"] = math.nan
    manifest_path.write_text(json.dumps(manifest))
    page = tmp_path / "report.html"
    assert main(["diff", str(a), str(b), "--html", str(page), "--json", str(tmp_path / "r.json")]) == 0
    assert page.stat().st_size > 0
    assert _strict((tmp_path / "r.json").read_text())
