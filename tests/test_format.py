"""tracedump.store.format, the on-disk contract: keys, names, records and the manifest as real dumps hold
them, and the version check every reader makes."""

from __future__ import annotations

import ast
import json
import types
import typing
from pathlib import Path
from typing import Any, Union

import pytest
import torch
from conftest import make_tiny_llama
from safetensors.torch import save_file

import tracedump
from tracedump.cli import main
from tracedump.errors import FormatVersionError
from tracedump.store import format as fmt
from tracedump.store.format import Key, Manifest
from tracedump.store.stats import StatsLine, record_problem

ROOT = Path(__file__).resolve().parent.parent


def _dump(base: Path, mode: str) -> Path:
    """A tiny Llama, every module and its inputs, and a tag recorded twice in the one pass."""
    model = make_tiny_llama()
    dumper = tracedump.attach(model, {"dir": str(base), "modules": "all", "inputs": True, "mode": mode})
    assert dumper is not None
    with torch.no_grad(), dumper.step():
        model(torch.tensor([[3, 14, 15, 9]]))
        tracedump.record("logits", torch.ones(2))
        tracedump.record("logits", torch.zeros(2))
    dumper.close()
    return dumper.run_dir


@pytest.fixture(scope="module")
def full_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _dump(tmp_path_factory.mktemp("full"), "full")


@pytest.fixture(scope="module")
def stats_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _dump(tmp_path_factory.mktemp("stats"), "stats")


# ------------------------------------------------------------------ keys


def test_every_key_of_a_real_dump_parses_and_formats_back(full_run: Path) -> None:
    run = tracedump.open_dump(full_run).run()
    names = run.passes[0].names
    modules = set(run.manifest["modules"]) | {"logits"}
    keys = [Key.parse(name) for name in names]

    assert [key.format() for key in keys] == names
    assert all(Key.parse(str(key)) == key for key in keys)
    assert {key.module for key in keys} <= modules
    # every kind of key is there: outputs, nested outputs, inputs, keyword inputs, repeat calls
    assert Key("model.layers.0.self_attn", "[0]") in keys
    assert Key("model.layers.0", "[0]", input=True) in keys
    assert any(key.input and not key.path[1:2].isdigit() for key in keys)  # a keyword input
    assert Key("logits") in keys and Key("logits", call=1) in keys
    assert "logits::call1" in names


def test_stats_records_name_the_keys_a_full_dump_stores(full_run: Path, stats_run: Path) -> None:
    full = tracedump.open_dump(full_run).run()
    stats = tracedump.open_dump(stats_run).run()

    from_stats = [Key.from_stats(record).format() for record in stats.stats()]
    whole = stats.passes[0].names  # record() calls, stored whole in a stats-mode run too

    assert sorted(from_stats + whole) == sorted(full.passes[0].names)
    for record in stats.stats():
        key = Key.from_stats(record)
        assert record["tensor"] == key.tensor_label
        # what the dumper and the writer wrote is what the format's own builders make
        base = fmt.stats_record(key, record["pass"], record["seq"], {"shape": record["shape"]})
        numbers = [n for n in fmt.NUMERIC_STAT_NAMES if n in record]
        values = [float(record[n]) for n in numbers]
        assert fmt.with_numbers(base, numbers, values) == record
        assert record_problem(record) is None  # the typed reader's StatsLine takes it
        assert set(fmt.NUMERIC_STAT_NAMES) <= StatsLine.model_fields.keys()
        assert set(record) <= set(fmt.StatsRecord.__annotations__)


@pytest.mark.parametrize(
    "text, key",
    [
        ("model.layers.0.mlp", Key("model.layers.0.mlp")),
        ("model[last_hidden_state]", Key("model", "[last_hidden_state]")),
        ("sub[1][a]::call1", Key("sub", "[1][a]", call=1)),
        ("sub@in[0]::call12", Key("sub", "[0]", input=True, call=12)),
        ("m@in[attention_mask][0]", Key("m", "[attention_mask][0]", input=True)),
        ("margin_3", Key("margin_3")),
        ("x::call0", Key("x::call0")),  # no call of ours is numbered 0: part of the tag
    ],
)
def test_key_parse_and_format(text: str, key: Key) -> None:
    assert Key.parse(text) == key
    assert key.format() == text


def test_any_string_formats_back_from_its_parse() -> None:
    for text in ("[0]", "a]b[", "m[a[0]]", "a@in", "a::call1::call2", "é[ü]"):
        assert Key.parse(text).format() == text
    with pytest.raises(ValueError, match="not a tensor key"):
        Key.parse("")


def test_stats_label_round_trip() -> None:
    for key in (Key("m"), Key("m", "[0][k]"), Key("m", "[scale]", input=True, call=3)):
        record = fmt.stats_record(key, 0, 0)
        assert Key.from_stats(record) == key
    assert Key.from_stats({"module": "m"}) == Key("m")  # "tensor" and "call" absent: the output, call 0


# ------------------------------------------------------------------ names and metadata


def test_file_and_run_dir_names_parse_back() -> None:
    assert fmt.parse_pass_file_name(fmt.pass_file_name(3)) == (3, None)
    assert fmt.parse_pass_file_name(fmt.pass_file_name(123456, part=2)) == (123456, 2)
    assert fmt.parse_pass_file_name(".pass00001.safetensors.tmp") is None
    assert fmt.parse_run_dir_name(fmt.run_dir_name(1, 77)) == (1, 77, 1)
    assert fmt.run_dir_name(1, 77, 3) == "rank1_pid77-3"
    assert fmt.parse_run_dir_name("rank1_pid77-3") == (1, 77, 3)
    assert fmt.parse_run_dir_name("rank1_pid77.bak") is None


def test_real_files_carry_only_the_formats_metadata_keys(full_run: Path) -> None:
    run = tracedump.open_dump(full_run).run()
    metadata = run.passes[0].metadata
    assert set(metadata) <= set(fmt.METADATA_KEYS)
    assert metadata[fmt.FORMAT_KEY] == fmt.FORMAT_VERSION
    built = fmt.pass_metadata(0, "full", part=2, seqs=[0, 1], truncated=True, batch="{}")
    assert set(built) == set(fmt.METADATA_KEYS) - {fmt.ORDER_KEY}


# ------------------------------------------------------------------ manifest

MANIFEST_KEYS = tuple(Manifest.__annotations__)  # in the order the dumper writes them
AT_CLOSE = {"end_time", "records_file"}  # written at close; control, compiled, manifest_error only sometimes
MANIFEST_AT_START = frozenset(MANIFEST_KEYS) - AT_CLOSE - {"control", "compiled", "manifest_error"}


def manifest_problems(data: Any, *, closed: bool = False) -> list[str]:
    """Each way ``data`` is not a manifest as this version writes one: a key missing (those written
    at start; with ``closed``, also those written at close), a key it does not know, a value of
    another type. [] for a valid manifest."""
    if not isinstance(data, dict):
        return ["not a JSON object"]
    required = MANIFEST_AT_START | (AT_CLOSE if closed else set())
    problems = [f"'{key}' missing" for key in MANIFEST_KEYS if key in required and key not in data]
    return problems + _typed_dict_problems(data, Manifest, "")


def _typed_dict_problems(data: dict[str, Any], schema: Any, prefix: str) -> list[str]:
    hints = typing.get_type_hints(schema)
    problems = [f"unknown key '{prefix}{key}'" for key in data if key not in hints]
    for key, hint in hints.items():
        if key not in data:
            if key in schema.__required_keys__:
                problems.append(f"'{prefix}{key}' missing")
            continue
        if typing.is_typeddict(hint):
            if isinstance(data[key], dict):
                problems += _typed_dict_problems(data[key], hint, f"{prefix}{key}.")
                continue
        elif _conforms(data[key], hint):
            continue
        name = getattr(hint, "__name__", None) or str(hint).replace("typing.", "")
        problems.append(f"'{prefix}{key}' is {data[key]!r}, not {name}")
    return problems


def _conforms(value: Any, hint: Any) -> bool:
    """Whether a JSON value fits a type hint of the manifest's (no more than those need)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    if typing.is_typeddict(hint):
        return isinstance(value, dict) and not _typed_dict_problems(value, hint, "")
    if origin in (Union, types.UnionType):
        return any(_conforms(value, arg) for arg in args)
    if origin is list:
        return isinstance(value, list) and all(_conforms(item, args[0]) for item in value)
    if origin is dict:
        return isinstance(value, dict) and all(
            isinstance(k, str) and _conforms(v, args[1]) for k, v in value.items()
        )
    if hint is int:
        return type(value) is int
    return isinstance(value, hint)


def test_a_real_manifest_validates_as_manifest(full_run: Path, stats_run: Path) -> None:
    for run_dir in (full_run, stats_run):
        data = json.loads((run_dir / fmt.MANIFEST).read_text())
        assert manifest_problems(data, closed=True) == []
        assert data["format"] == fmt.FORMAT_VERSION == "1.1"
        assert list(data) == [k for k in MANIFEST_KEYS if k in data]  # written in the contract's order
        assert tracedump.open_dump(run_dir).run().manifest == data


def test_a_compiled_runs_manifest_validates_with_its_compiled_counts(tmp_path: Path) -> None:
    dumper = tracedump.attach(torch.nn.Linear(2, 2), {"dir": str(tmp_path), "compiled": True})
    assert dumper is not None
    dumper.close()
    data = json.loads((dumper.run_dir / fmt.MANIFEST).read_text())
    assert manifest_problems(data, closed=True) == []
    assert data["compiled"] == {"taps": 0, "cuda_graphs": 0, "graph_tap_bytes": 0, "idle_graph_steps": 0}
    assert tracedump.open_dump(tmp_path).run().manifest == data


def test_a_manifest_mid_run_validates_too(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    dumper = tracedump.attach(model, {"dir": str(tmp_path)})
    assert dumper is not None
    try:
        data = json.loads((dumper.run_dir / fmt.MANIFEST).read_text())
        assert manifest_problems(data) == []
        assert manifest_problems(data, closed=True) == ["'end_time' missing", "'records_file' missing"]
    finally:
        dumper.close()


def test_manifest_problems_name_what_is_wrong(full_run: Path) -> None:
    data = json.loads((full_run / fmt.MANIFEST).read_text())
    data.update(rank="0", surprise=1, passes={**data["passes"], "count": True})
    data["errors"] = [{"where": "writer", "type": "OSError", "message": "disk full", "count": 1}]  # valid
    del data["hostname"]
    assert manifest_problems(data, closed=True) == [
        "'hostname' missing",
        "unknown key 'surprise'",
        "'rank' is '0', not int",
        "'passes.count' is True, not int",
    ]


# ------------------------------------------------------------------ the version check


def _set_manifest_format(run_dir: Path, version: object) -> Path:
    path = run_dir / fmt.MANIFEST
    data = json.loads(path.read_text())
    data["format"] = version
    path.write_text(json.dumps(data))
    return path


@pytest.fixture
def small_run(tmp_path: Path) -> Path:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    dumper = tracedump.attach(model, {"dir": str(tmp_path / "dump")})
    assert dumper is not None
    model(torch.ones(2, 4))
    dumper.close()
    return dumper.run_dir


@pytest.mark.parametrize("version", ["2", 2, "2.0", "0", "one"])
def test_a_manifest_of_an_unknown_major_is_refused(small_run: Path, version: object, capsys) -> None:
    path = _set_manifest_format(small_run, version)

    with pytest.raises(FormatVersionError) as caught:
        tracedump.open_dump(small_run.parent)
    assert str(caught.value).startswith(f"{path}: format version" if version == "one" else f"{path}: written")
    assert repr(version) in str(caught.value)

    assert main(["ls", str(small_run.parent)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tracedump ls: {path}: ") and repr(version) in err
    assert main(["diff", str(small_run.parent), str(small_run.parent)]) == 2
    assert f"{path}: " in capsys.readouterr().err


@pytest.mark.parametrize("version", [1, "1", "1.0", "1.7", None])
def test_major_1_in_any_spelling_reads(small_run: Path, version: object, capsys) -> None:
    _set_manifest_format(small_run, version)
    assert tracedump.open_dump(small_run.parent).run().complete
    assert main(["ls", str(small_run.parent)]) == 0
    assert main(["diff", str(small_run), str(small_run), "--no-progress"]) == 0


def test_a_pass_file_of_an_unknown_major_is_refused(small_run: Path, tmp_path: Path, capsys) -> None:
    path = small_run / fmt.pass_file_name(0)
    metadata = {fmt.FORMAT_KEY: "9", fmt.MODE_KEY: "full"}
    save_file({"0": torch.ones(2)}, str(path), metadata=metadata)
    lone = tmp_path / "lone.safetensors"
    save_file({"0": torch.ones(2)}, str(lone), metadata=metadata)

    for target in (path, lone):
        with pytest.raises(FormatVersionError, match=rf"^{target}: written in tracedump format '9'"):
            tracedump.load_pass(target)
    with pytest.raises(FormatVersionError):
        tracedump.open_dump(small_run).run().passes[0].names  # noqa: B018

    assert main(["ls", str(small_run)]) == 2
    assert f"tracedump ls: {path}: written in tracedump format '9'" in capsys.readouterr().err
    assert main(["show", str(lone)]) == 2
    assert f"tracedump show: {lone}: written in tracedump format '9'" in capsys.readouterr().err
    assert main(["diff", str(lone), str(lone)]) == 2
    assert f"{lone}: written in tracedump format '9'" in capsys.readouterr().err


def test_a_safetensors_file_without_a_version_still_reads(tmp_path: Path) -> None:
    save_file({"a": torch.ones(2)}, str(tmp_path / "x.safetensors"))
    assert list(tracedump.load_pass(tmp_path / "x.safetensors")) == ["a"]


def test_format_major() -> None:
    assert [fmt.format_major(v) for v in ("1", "1.2", 1, "12.0.3")] == [1, 1, 1, 12]
    assert [fmt.format_major(v) for v in (True, 1.0, "v1", "1.", "", None)] == [None] * 6


# ------------------------------------------------------------------ who imports what


def _imports(path: Path) -> list[tuple[int, str, str]]:
    """(line, module, name) of each ``from ... import name`` in a file, relative modules resolved."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            found += [(node.lineno, module, alias.name) for alias in node.names]
    return found


SOURCES = sorted((ROOT / "tracedump").rglob("*.py"))


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_imports_a_private_name_of_another(path: Path) -> None:
    private = [
        f"{path.name}:{line}: from {module} import {name}"
        for line, module, name in _imports(path)
        if name.startswith("_") and not name.startswith("__")
    ]
    assert not private


def test_the_comparator_reads_the_format_not_the_writer() -> None:
    for path in sorted((ROOT / "tracedump" / "compare").glob("*.py")):
        assert not [m for _, m, _ in _imports(path) if m == "tracedump.dump.writer"], path.name
