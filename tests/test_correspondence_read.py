"""``correspondence.json`` read as any file of a run: bounded, non-blocking, typed. A crafted record
is exit 2 naming the file and the field, never an internal error, a hang or a read until memory
runs out; a record the writer writes today still pairs."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import tracedump
from tests.conftest import make_tiny_llama
from tracedump.cli import main
from tracedump.errors import DumpReadError
from tracedump.store.correspondence import CORRESPONDENCE_FILE, read_correspondence


def _dump(base: Path, model: torch.nn.Module) -> Path:
    dumper = tracedump.attach(model, {"dir": str(base)})
    with torch.no_grad():
        model(torch.tensor([[3, 14, 15, 9]]))
    dumper.close()
    return base


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, Any]]:
    """A and B: one tiny Llama dumped twice; and an engine-like record for A (each parameter loaded
    whole from the checkpoint tensor of its name, B's parameters standing for the checkpoint), so
    the diff derives its pairing from the record."""
    base = tmp_path_factory.mktemp("pair")
    model = make_tiny_llama(layers=1)
    a, b = _dump(base / "a", model), _dump(base / "b", model)
    (run_a,) = a.iterdir()
    (run_b,) = b.iterdir()
    record = json.loads((run_a / CORRESPONDENCE_FILE).read_text())
    theirs = json.loads((run_b / CORRESPONDENCE_FILE).read_text())["parameters"]
    record["sources"] = {
        n: {k: m[k] for k in ("shape", "dtype", "fingerprint")}
        for n, m in theirs.items()
        if "same_as" not in m
    }
    record["loads"] = [
        {"param": n, "source": n, "region": [[0, d] for d in m["shape"]], "rows": [[0, 0, m["shape"][0]]]}
        for n, m in record["parameters"].items()
        if "same_as" not in m
    ]
    return a, b, record


def _first(record: dict[str, Any]) -> str:
    return next(iter(record["parameters"]))


def _set(path: tuple[Any, ...], value: Any) -> Callable[[dict[str, Any]], Any]:
    def edit(record: dict[str, Any]) -> dict[str, Any]:
        node: Any = record
        for part in path[:-1]:
            node = node[part if part != "FIRST" else _first(record)]
        node[path[-1] if path[-1] != "FIRST" else _first(record)] = value
        return record

    return edit


def _text(text: str) -> Callable[[dict[str, Any]], str]:
    return lambda record: text


def _param(key: str, value: Any) -> Callable[[dict[str, Any]], Any]:
    return _set(("parameters", "FIRST", key), value)


def _load(key: str, value: Any) -> Callable[[dict[str, Any]], Any]:
    return _set(("loads", 0, key), value)


def _raw(record: dict[str, Any], old: str, new: str) -> str:
    """The record as JSON with one placeholder replaced by text JSON cannot hold as a value."""
    return json.dumps(record).replace(json.dumps(old), new)


def _rank_text(new: str) -> Callable[[dict[str, Any]], str]:
    return lambda r: _raw(_set(("tensor_parallel", "rank"), "@@")(r), "@@", new)


def _self_same_as(r: dict[str, Any]) -> dict[str, Any]:
    r["parameters"][_first(r)]["same_as"] = _first(r)
    return r


def _same_as_loop(r: dict[str, Any]) -> dict[str, Any]:
    names = list(r["parameters"])[:2]
    r["parameters"][names[0]]["same_as"], r["parameters"][names[1]]["same_as"] = names[1], names[0]
    return r


def _doubled_loads(r: dict[str, Any]) -> dict[str, Any]:
    r["loads"] = r["loads"] * 2
    return r


def _no_parameters_but_loads(r: dict[str, Any]) -> dict[str, Any]:
    r["parameters"] = {}
    return r


CRAFTED: dict[str, Callable[[dict[str, Any]], Any]] = {
    "tensor_parallel list": _set(("tensor_parallel",), [1]),
    "tensor_parallel null": _set(("tensor_parallel",), None),
    "rank 1e400": _rank_text("1e400"),
    "rank NaN": _rank_text("NaN"),
    "rank 5000 digits": _rank_text("9" * 5000),
    "rank negative": _set(("tensor_parallel", "rank"), -1),
    "rank string": _set(("tensor_parallel", "rank"), "0"),
    "rank float": _set(("tensor_parallel", "rank"), 0.5),
    "size zero": _set(("tensor_parallel", "size"), 0),
    "size 2**70": _set(("tensor_parallel", "size"), 2**70),
    "nested 100k deep": lambda r: _raw(_param("shape", "@@")(r), "@@", "[" * 100_000 + "]" * 100_000),
    "nested 40 deep": lambda r: _raw(_param("shape", "@@")(r), "@@", "[" * 40 + "]" * 40),
    "parameters null": _set(("parameters",), None),
    "parameters list": _set(("parameters",), []),
    "a null parameter record": _set(("parameters", "FIRST"), None),
    "a parameter record a list": _set(("parameters", "FIRST"), [1, 2]),
    "string fingerprint": _param("fingerprint", "abc"),
    "fingerprint of strings": _param("fingerprint", ["0.1", "0.2"]),
    "fingerprint of lists": _param("fingerprint", [[1.0]]),
    "fingerprint of 1e400": lambda r: _raw(_param("fingerprint", "@@")(r), "@@", "[1e400, -1e400]"),
    "fingerprint of NaN": lambda r: _raw(_param("fingerprint", "@@")(r), "@@", "[NaN, NaN, NaN]"),
    "fingerprint of 10k values": _param("fingerprint", [0.5] * 10_000),
    "fingerprint of bools": _param("fingerprint", [True, False]),
    "shape negative": _param("shape", [-1]),
    "shape string": _param("shape", "16"),
    "shape 2**70": _param("shape", [2**70]),
    "shape of 100 dims": _param("shape", [1] * 100),
    "shape null": _param("shape", None),
    "module int": _param("module", 7),
    "same_as int": _param("same_as", 5),
    "same_as nobody": _param("same_as", "no.such.weight"),
    "same_as itself": _self_same_as,
    "same_as loop": _same_as_loop,
    "sources null": _set(("sources",), None),
    "a null source": lambda r: _set(("sources", next(iter(r["sources"]))), None)(r),
    "source shape of floats": lambda r: _set(("sources", next(iter(r["sources"])), "shape"), [1.5])(r),
    "loads null": _set(("loads",), None),
    "loads an object": _set(("loads",), {}),
    "a null load": _set(("loads", 0), None),
    "an empty load": _set(("loads", 0), {}),
    "load param int": _load("param", 1),
    "load rows of two": _load("rows", [[1, 2]]),
    "load rows negative": _load("rows", [[0, 0, -5]]),
    "load rows 1e400": lambda r: _raw(_load("rows", "@@")(r), "@@", "[[0, 0, 1e400]]"),
    "load rows 2**62": _load("rows", [[0, 0, 2**62]]),
    "load rows past the region": _load("rows", [[100, 7, 3]]),
    "load region reversed": _load("region", [[5, 0]]),
    "load region empty": _load("region", []),
    "load region 65 dims": _load("region", [[0, 1]] * 65),
    "load region a number": _load("region", 3),
    "load cols of one": _load("cols", [1]),
    "load expert string": _load("expert", "e"),
    "load expert 1e400": lambda r: _raw(_load("expert", "@@")(r), "@@", "1e400"),
    "load of no parameter": _load("param", "no.such.weight"),
    "load of no source": _load("source", "no.such.weight"),
    "loads twice": _doubled_loads,
    "loads but no parameters": _no_parameters_but_loads,
    "failures of ints": _set(("failures",), [1]),
    "failures a string": _set(("failures",), "x"),
    "version string": _set(("version",), "1"),
    "unknown keys": _set(("future",), {"a": [1, {"b": None}]}),
    "the whole file a list": lambda r: [],
    "the whole file a string": lambda r: "text",
    "not JSON": _text("{"),
    "empty": _text(""),
    "not UTF-8": _text("\udcff"),
}


def _diff(a: Path, b: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["diff", str(a), str(b)])
    return code, capsys.readouterr().err


def test_the_record_as_written_pairs_and_agrees(
    pair: tuple[Path, Path, dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b, record = pair
    copy_a = tmp_path / "a"
    shutil.copytree(a, copy_a)
    (run_a,) = copy_a.iterdir()
    (run_a / CORRESPONDENCE_FILE).write_text(json.dumps(record))
    assert read_correspondence(run_a) is not None and read_correspondence(run_a).loads

    code, err = _diff(copy_a, b, capsys)

    assert (code, err) == (0, "")


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_a_crafted_record_is_never_an_internal_error(
    pair: tuple[Path, Path, dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    a, b, record = pair
    copy_a = tmp_path / "a"
    shutil.copytree(a, copy_a)
    (run_a,) = copy_a.iterdir()
    crafted = CRAFTED[case](copy.deepcopy(record))
    text = crafted if isinstance(crafted, str) else json.dumps(crafted)
    (run_a / CORRESPONDENCE_FILE).write_bytes(text.encode("utf-8", "surrogateescape"))

    code, err = _diff(copy_a, b, capsys)

    assert "internal error" not in err, err
    assert code in (0, 1, 2)
    if code == 2:  # refused: one line naming the file (and, for a typed field, the field)
        assert CORRESPONDENCE_FILE in err and err.count("\n") == 1, err


@pytest.mark.parametrize(
    ("case", "field"),
    [
        ("tensor_parallel list", "'tensor_parallel'"),
        ("rank 1e400", "'tensor_parallel.rank'"),
        ("a null parameter record", "'parameters."),
        ("string fingerprint", ".fingerprint'"),
        ("load rows of two", "'loads[0].rows[0]'"),
        ("an empty load", "'loads[0].param'"),
        ("nested 100k deep", "nested more than"),
    ],
)
def test_a_bad_field_is_named(
    pair: tuple[Path, Path, dict[str, Any]], tmp_path: Path, case: str, field: str
) -> None:
    *_, record = pair
    crafted = CRAFTED[case](copy.deepcopy(record))
    (tmp_path / CORRESPONDENCE_FILE).write_text(crafted if isinstance(crafted, str) else json.dumps(crafted))

    with pytest.raises(DumpReadError) as caught:
        read_correspondence(tmp_path)

    assert CORRESPONDENCE_FILE in str(caught.value) and field in str(caught.value)


def _diff_in_subprocess(a: Path, b: Path) -> subprocess.CompletedProcess[str]:
    """In a child with a timeout: a reader that blocks fails the test instead of hanging it."""
    return subprocess.run(
        [sys.executable, "-m", "tracedump", "diff", str(a), str(b)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_a_fifo_or_a_device_is_refused_not_waited_on_or_read(
    pair: tuple[Path, Path, dict[str, Any]], tmp_path: Path, kind: str
) -> None:
    a, b, _ = pair
    copy_a = tmp_path / "a"
    shutil.copytree(a, copy_a)
    (run_a,) = copy_a.iterdir()
    target = run_a / CORRESPONDENCE_FILE
    target.unlink()
    if kind == "fifo":
        os.mkfifo(target)
    else:
        target.symlink_to("/dev/zero")

    result = _diff_in_subprocess(copy_a, b)

    assert result.returncode == 2, result.stderr
    assert f"{CORRESPONDENCE_FILE}: not a regular file" in result.stderr


def test_a_record_over_the_bound_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tracedump.store.correspondence as store

    (tmp_path / CORRESPONDENCE_FILE).write_text(json.dumps({"parameters": {"x": {"shape": [1] * 8}}}))
    monkeypatch.setattr(store, "MAX_CORRESPONDENCE_BYTES", 16)

    with pytest.raises(DumpReadError, match="larger than 16 bytes"):
        read_correspondence(tmp_path)


def test_a_run_without_the_file_has_no_record(tmp_path: Path) -> None:
    assert read_correspondence(tmp_path) is None
