"""The one atomic writer (:mod:`tracedump.store.fsio`): every file tracedump writes goes through it.

A failure mid-write (here a real one: the file-size limit of ``ulimit -f``, which fails a write with
``EFBIG`` past that many bytes, as a full disk fails it with ``ENOSPC``) leaves no file under the
final name; ``diff``'s outputs get the umask's mode, a run's files ``0600``; and no module but
``store/fsio.py`` renames a file or makes a temp file, so none can write around it.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import resource
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tracedump
from tracedump.cli import main
from tracedump.store import fsio

PACKAGE = Path(tracedump.__file__).parent
FILE_SIZE_LIMIT = 1024  # bytes: far less than any --json, --html or --plot output of the diff below


@pytest.fixture
def pair(tmp_path: Path) -> tuple[Path, Path]:
    """Two ``.pt`` files that diverge: a diff that has a report to write."""
    values = {f"layer{i}": torch.randn(16, 32, generator=torch.Generator().manual_seed(i)) for i in range(8)}
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    torch.save(values, a)
    torch.save({k: v + (1.0 if k == "layer3" else 0.0) for k, v in values.items()}, b)
    return a, b


def _limit_file_size() -> None:  # runs in the child, before exec
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_SIZE_LIMIT, FILE_SIZE_LIMIT))


@pytest.mark.parametrize(
    "flag, name", [("--json", "out.json"), ("--html", "out.html"), ("--plot", "out.png")]
)
def test_a_write_failing_mid_way_leaves_no_file_under_the_final_name(
    pair: tuple[Path, Path], tmp_path: Path, flag: str, name: str
) -> None:
    if flag == "--plot" and importlib.util.find_spec("matplotlib") is None:
        pytest.skip("--plot needs matplotlib")
    a, b = pair
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "tracedump", "diff", str(a), str(b), flag, str(out_dir / name)],
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=_limit_file_size,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "cannot write the report" in done.stderr
    assert list(out_dir.iterdir()) == []  # neither a truncated output nor its temp file
    # the same diff, without the limit, writes the whole file: the limit was what failed it
    assert main(["diff", str(a), str(b), flag, str(out_dir / name)]) == 1
    assert (out_dir / name).stat().st_size > FILE_SIZE_LIMIT
    assert [p.name for p in out_dir.iterdir()] == [name]


@pytest.mark.parametrize(
    "flag, name", [("--json", "out.json"), ("--html", "out.html"), ("--plot", "out.png")]
)
def test_a_failed_write_keeps_the_previous_output(
    pair: tuple[Path, Path], tmp_path: Path, flag: str, name: str
) -> None:
    """Not truncated (``--json`` and ``--plot`` once wrote into the file): a failed diff leaves the
    last good report where it was."""
    if flag == "--plot" and importlib.util.find_spec("matplotlib") is None:
        pytest.skip("--plot needs matplotlib")
    a, b = pair
    out = tmp_path / name
    out.write_text("previous\n")
    done = subprocess.run(
        [sys.executable, "-m", "tracedump", "diff", str(a), str(b), flag, str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=_limit_file_size,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert out.read_text() == "previous\n"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_outputs_get_the_umasks_mode_and_a_run_file_0600(tmp_path: Path) -> None:
    shared = fsio.write_output(tmp_path / "new" / "report.html", "<html>")
    assert stat.S_IMODE(shared.stat().st_mode) == 0o666 & ~_umask()
    private = tmp_path / "control.json"
    fsio.write_text_atomic(private, "{}")
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    fsio.write_json_atomic(private, {"a": 1})
    assert private.read_text() == '{\n  "a": 1\n}\n' and stat.S_IMODE(private.stat().st_mode) == 0o600


def test_keep_mode_keeps_a_replaced_files_mode_as_writing_into_it_did(tmp_path: Path) -> None:
    """``--json`` and ``--plot`` once wrote into an existing file, so it kept its mode; ``--html``
    always made a new one (the umask's mode)."""
    target = tmp_path / "out.json"
    target.write_text("old")
    target.chmod(0o640)
    fsio.write_output(target, "new", keep_mode=True)
    assert target.read_text() == "new" and stat.S_IMODE(target.stat().st_mode) == 0o640
    fsio.write_output(target, "newer")
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~_umask()


def test_an_output_through_a_link_or_into_a_fifo_replaces_neither(tmp_path: Path) -> None:
    target = tmp_path / "real" / "out.json"
    target.parent.mkdir()
    link = tmp_path / "link.json"
    link.symlink_to(target)
    assert fsio.write_output(link, "[]\n") == target
    assert link.is_symlink() and target.read_text() == "[]\n"
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo, 0o600)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # so the writer's open() does not block
    try:
        fsio.write_output(fifo, b"bytes")
        assert os.read(reader, 100) == b"bytes" and fifo.is_fifo()
    finally:
        os.close(reader)


def test_a_partial_file_is_appended_to_and_moved_into_place(tmp_path: Path) -> None:
    partial, final = tmp_path / "stats.jsonl.partial", tmp_path / "stats.jsonl"
    for line in ("one", "two"):
        with fsio.open_for_append(partial) as handle:
            handle.write(line + "\n")
    assert stat.S_IMODE(partial.stat().st_mode) == 0o600
    fsio.move_into_place(partial, final)
    assert final.read_text() == "one\ntwo\n" and not partial.exists()


def test_a_failed_block_leaves_the_file_as_it_was_and_no_temp_file(tmp_path: Path) -> None:
    target = tmp_path / "manifest.json"
    target.write_text("before")
    with pytest.raises(RuntimeError), fsio.atomic_path(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("a full disk, say")
    assert target.read_text() == "before" and [p.name for p in tmp_path.iterdir()] == ["manifest.json"]


_RENAMES = {"replace", "rename", "renames"}


def _writes_around_fsio(tree: ast.AST) -> list[str]:
    """Each ``os.replace``/``os.rename``/``os.renames``, ``shutil.move``, ``Path.rename`` call and
    each import of ``tempfile`` (or of those names from ``os``) in ``tree``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if a.name.split(".")[0] == "tempfile"]
        elif isinstance(node, ast.ImportFrom) and node.module in {"tempfile", "os", "shutil"}:
            names = {a.name for a in node.names}
            if node.module == "tempfile" or names & (_RENAMES | {"move"}):
                found.append(f"from {node.module} import {', '.join(sorted(names))}")
        elif isinstance(node, ast.Attribute):
            owner = node.value.id if isinstance(node.value, ast.Name) else None
            if (owner == "os" and node.attr in _RENAMES) or (owner, node.attr) == ("shutil", "move"):
                found.append(f"{owner}.{node.attr}")
            elif owner == "tempfile":
                found.append(f"tempfile.{node.attr}")
            elif node.attr == "rename":  # Path.rename (a str has none)
                found.append(".rename")
    return found


def test_no_module_but_fsio_renames_files_or_makes_temp_files() -> None:
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "store" / "fsio.py":
            continue
        found = _writes_around_fsio(ast.parse(path.read_text(), filename=str(path)))
        if found:
            offenders[str(path.relative_to(PACKAGE))] = found
    assert offenders == {}, "write through tracedump.store.fsio instead"


def test_the_scan_finds_what_it_bans() -> None:
    source = (
        "import os, tempfile\nfrom os import replace\nimport shutil\n"
        "os.replace('a', 'b')\nshutil.move('a', 'b')\np.rename('b')\n"
    )
    assert sorted(_writes_around_fsio(ast.parse(source))) == sorted(
        [
            "import tempfile",
            "from os import replace",
            "os.replace",
            "shutil.move",
            ".rename",
        ]
    )
