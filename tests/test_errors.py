"""One error root (tracedump/errors.py): a host catches "anything tracedump refused" with one
except clause, the CLI's exit code comes from the error, and the old module paths still answer as
attributes of the package."""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tracedump
from tracedump import errors

PACKAGE = Path(tracedump.__file__).parent
ERRORS = [obj for _, obj in inspect.getmembers(errors, inspect.isclass) if issubclass(obj, Exception)]


def test_every_error_is_under_the_one_root_and_still_a_value_error() -> None:
    assert {e.__name__ for e in ERRORS} == {
        "BridgeError",
        "ConfigError",
        "DumpReadError",
        "FormatVersionError",
        "GraftFeedRefused",
        "LimitError",
        "OrderError",
        "SequenceError",
        "TracedumpError",
        "UsageError",
    }
    for error in ERRORS:
        assert issubclass(error, errors.TracedumpError) and issubclass(error, ValueError), error
        assert error.exit_code == errors.ExitCode.USAGE


def test_no_public_exception_class_is_defined_outside_errors_py() -> None:
    """Private ones (control flow that never leaves its module) are allowed."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "errors.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                bases = {ast.unparse(b) for b in node.bases}
                if any(b.endswith(("Error", "Exception")) for b in bases):
                    found.append(f"{path.relative_to(PACKAGE)}: {node.name}({', '.join(bases)})")
    assert found == []


def test_the_public_errors_are_exported_by_the_package() -> None:
    for name in ("TracedumpError", "ConfigError", "DumpReadError", "FormatVersionError", "UsageError"):
        assert name in tracedump.__all__ and getattr(tracedump, name) is getattr(errors, name)


def test_a_bad_setting_and_a_bad_dump_are_caught_as_one_root(tmp_path: Path) -> None:
    with pytest.raises(tracedump.TracedumpError, match="mode='bogus'"):
        tracedump.attach(torch.nn.Linear(2, 2), {"dir": tmp_path, "mode": "bogus"})
    with pytest.raises(tracedump.TracedumpError):
        tracedump.open_dump(tmp_path / "nothing-here")


def test_the_cli_exit_codes_are_the_table() -> None:
    assert [int(c) for c in errors.ExitCode] == [0, 1, 2, 126, 127]
    result = subprocess.run(
        [sys.executable, "-m", "tracedump", "diff", "/nonexistent/a", "/nonexistent/b"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == errors.ExitCode.USAGE, result.stderr


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("loader", "store.loader"),
        ("settings", "config.settings"),
        ("writer", "dump.writer"),
        ("units", "util.units"),
    ],
)
def test_an_old_top_level_module_name_gives_the_moved_module(old: str, new: str) -> None:
    assert getattr(tracedump, old) is sys.modules[f"tracedump.{new}"]


def test_capture_and_graft_stay_the_functions_after_their_modules_are_imported() -> None:
    import tracedump.dump.capture
    import tracedump.dump.graft

    assert callable(tracedump.capture) and inspect.isfunction(tracedump.capture)
    assert inspect.isfunction(tracedump.graft)


def test_graft_with_a_bad_setting_raises_config_error_and_leaves_no_temp_dir(tmp_path: Path) -> None:
    import tempfile

    before = set(Path(tempfile.gettempdir()).glob("tracedump-graft-*"))
    graft = tracedump.graft(torch.nn.Linear(2, 2), tmp_path / "ref", modules="bogus")
    with pytest.raises(tracedump.ConfigError, match="modules='bogus'") as raised, graft:
        pass
    assert str(raised.value).count("bad setting") == 1  # said once, not nested
    assert set(Path(tempfile.gettempdir()).glob("tracedump-graft-*")) == before


def test_capture_save_to_a_bad_dir_raises_config_error(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with tracedump.capture(model, outputs=["0"]) as cap:
        cap.run(torch.ones(1, 2))
    with pytest.raises(tracedump.ConfigError, match="save"):
        cap.save("   ")
