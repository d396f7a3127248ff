"""Hostile files against tracedump's readers: bridge rule files, manifests,
safetensors headers, ``stats.jsonl`` and control files that someone else could have written.

Each crafted input must end in exit 2 with one line naming the file (and the field), never a
traceback and never exit 1 (which ``tracedump diff`` keeps for "diverged"); where a fallback is
the answer (a bad capture order) or an error row (a bridge dim out of range), that is what is checked.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from tracedump.cli import main
from tracedump.compare import compare
from tracedump.errors import BridgeError
from tracedump.store.format import MANIFEST, ORDER_KEY, STATS_FILE, pass_file_name

REPO = Path(__file__).resolve().parents[1]


def write_run(
    run_dir: Path,
    tensors: dict[str, torch.Tensor] | None = None,
    manifest: dict[str, Any] | None = None,
    *,
    order: Any = None,
    stats: list[str] | None = None,
) -> Path:
    """A run dir as the dumper leaves it: a manifest, one pass file, perhaps ``stats.jsonl`` lines."""
    run_dir.mkdir(parents=True)
    base = {"rank": 0, "pid": 1, "root": "Toy", "settings": {"mode": "full", "token_dim": 0}}
    (run_dir / MANIFEST).write_text(
        manifest if isinstance(manifest, str) else json.dumps({**base, **(manifest or {})})
    )
    if tensors is not None:
        metadata = {
            "tracedump.mode": "full",
            ORDER_KEY: json.dumps(list(tensors) if order is None else order),
        }
        save_file(tensors, str(run_dir / pass_file_name(0)), metadata=metadata)
    if stats is not None:
        (run_dir / STATS_FILE).write_text("".join(line + "\n" for line in stats))
    return run_dir


def one_line_error(capsys: pytest.CaptureFixture[str], *named: str) -> str:
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err
    for text in named:
        assert text in err, err
    return err


def cli(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``tracedump ARGV`` in its own process (a FIFO or /dev/zero must not hang the test run)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "tracedump.cli", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=REPO,
    )


@pytest.fixture
def pair(tmp_path: Path) -> tuple[Path, Path]:
    x = {"m": torch.arange(6, dtype=torch.float32)}
    return write_run(tmp_path / "a", x), write_run(tmp_path / "b", x)


# ------------------------------------------------------------------ 1: a bridge file that is no text


RULES = '[[rule]]\nop = "rename"\nmatch = "x"\nb = "y"\n'


@pytest.mark.parametrize(
    ("name", "content", "named"),
    [
        ("rules.toml", b"\xff\xfe" + RULES.encode(), "UTF-8"),
        ("rules.json", b"[" * 200_000, "deep"),
        ("rules.toml", b"a = " + b"[" * 200_000, "deep"),
        ("rules.toml", b"# " + b"x" * (5 << 20), "bytes"),
    ],
    ids=["not-utf8", "json-200k-deep", "toml-200k-deep", "too-large"],
)
def test_a_bridge_file_that_cannot_be_rules_is_one_line_and_exit_2(
    pair: tuple[Path, Path],
    tmp_path: Path,
    name: str,
    content: bytes,
    named: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    rules = tmp_path / name
    rules.write_bytes(content)
    assert main(["diff", str(pair[0]), str(pair[1]), "--bridge", str(rules)]) == 2
    one_line_error(capsys, str(rules), named)


@pytest.mark.parametrize("kind", ["dev-zero", "fifo"])
def test_a_bridge_file_that_is_endless_or_a_fifo_is_refused_at_once(
    pair: tuple[Path, Path], tmp_path: Path, kind: str
) -> None:
    rules = tmp_path / "rules.toml"
    if kind == "fifo":
        os.mkfifo(rules)
    else:
        rules.symlink_to("/dev/zero")
    done = cli("diff", str(pair[0]), str(pair[1]), "--bridge", str(rules), timeout=60)
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "not a regular file" in done.stderr


# ------------------------------------------------------------------ 2, 3: concat across dtypes, odd dims


CONCAT = '[[rule]]\nop = "concat"\nmatch = "gate_up"\nb = ["gate", "up"]\n'


def _concat_pair(
    tmp_path: Path, gate: torch.Tensor, up: torch.Tensor, rules: str = CONCAT
) -> tuple[Path, Path, Path]:
    fused = (
        torch.cat([gate.float(), up.float()], -1) if gate.dim() else torch.stack([gate.float(), up.float()])
    )
    a = write_run(tmp_path / "a", {"gate_up": fused})
    b = write_run(tmp_path / "b", {"gate": gate, "up": up})
    path = tmp_path / "rules.toml"
    path.write_text(rules)
    return a, b, path


@pytest.mark.parametrize("first", ["bfloat16", "float32"])
def test_a_concat_of_parts_of_different_dtypes_widens_each_from_its_own_dtype(
    tmp_path: Path, first: str
) -> None:
    g = torch.Generator().manual_seed(0)
    low = torch.randn(4, 6, generator=g).to(torch.bfloat16)
    high = torch.randn(4, 6, generator=g)
    gate, up = (low, high) if first == "bfloat16" else (high, low)
    a, b, rules = _concat_pair(tmp_path, gate, up)
    report = compare(a, b, bridge=rules)
    (result,) = report.results
    assert result.status == "ok", (result.status, result.message)
    assert result.metrics is not None and result.metrics.rel_diff == 0.0  # the same numbers exactly
    assert report.exit_code == 0


def test_a_concat_of_0d_parts_is_an_error_row(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b, rules = _concat_pair(tmp_path, torch.tensor(1.0), torch.tensor(2.0))
    (result,) = compare(a, b, bridge=rules).results
    assert result.status == "error" and "concat" in (result.message or "")
    # an error row: the tensor could not be compared (its exit code is docs/comparator.md's), no traceback
    main(["diff", str(a), str(b), "--bridge", str(rules)])
    out, err = capsys.readouterr()
    assert "Traceback" not in err and "error" in out


@pytest.mark.parametrize("op", ["concat", "split"])
def test_a_dim_no_tensor_has_is_refused_when_the_rule_file_is_read(
    tmp_path: Path, op: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rules = f'[[rule]]\nop = "{op}"\nmatch = "gate_up"\nb = ["gate", "up"]\ndim = {10**23}\n'
    a, b, path = _concat_pair(tmp_path, torch.randn(4, 6), torch.randn(4, 3), rules)
    with pytest.raises(BridgeError, match="'dim' must lie within"):
        compare(a, b, bridge=path)
    assert main(["diff", str(a), str(b), "--bridge", str(path)]) == 2
    _, err = capsys.readouterr()
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("op", ["concat", "split"])
@pytest.mark.parametrize("dim", [2, -3])
def test_a_dim_out_of_range_is_an_error_row_naming_it(tmp_path: Path, op: str, dim: int) -> None:
    gate, up = torch.randn(4, 6), torch.randn(4, 3)
    if op == "concat":
        rules = f'[[rule]]\nop = "concat"\nmatch = "gate_up"\nb = ["gate", "up"]\ndim = {dim}\n'
    else:
        rules = f'[[rule]]\nop = "split"\nmatch = "gate_up"\nb = ["gate", "up"]\ndim = {dim}\n'
    a, b, path = _concat_pair(tmp_path, gate, up, rules)
    results = compare(a, b, bridge=path).results
    assert results and {r.status for r in results} == {"error"}, [(r.status, r.message) for r in results]
    assert all(f"dim {dim}" in (r.message or "") for r in results)


# ------------------------------------------------------------------ 4-7, 10: manifests


@pytest.mark.parametrize(
    ("manifest", "field"),
    [
        ({"module_classes": {"m": 3}}, "module_classes"),
        ({"module_classes": ["m"]}, "module_classes"),
        ({"graft": {"from": "x", "not_grafted": ["m"]}}, "graft"),
        ({"graft": {"from": "x", "modules": 7}}, "graft"),
        (
            {
                "graft": {
                    "from": "x",
                    "not_grafted": {"m": {"listed": [{"pass": "x", "call": 0, "reason": "r"}]}},
                }
            },
            "graft",
        ),
        ({"integration": "vllm"}, "integration"),
        ({"rank": "abc"}, "rank"),
        ({"anomalies": ["x"]}, "anomalies"),
        ({"truncated_passes": {"x": 1}}, "truncated_passes"),
        ({"settings": []}, "settings"),
        ({"control": {"orders": [1, "x"]}}, "control"),
    ],
    ids=[
        "classes-int",
        "classes-list",
        "not_grafted-list",
        "modules-int",
        "pass-x",
        "integration-str",
        "rank-abc",
        "anomalies-list",
        "truncated-dict",
        "settings-list",
        "orders-not-objects",
    ],
)
@pytest.mark.parametrize("command", ["diff", "ls"])
def test_a_manifest_field_of_the_wrong_type_is_one_line_naming_the_file_and_field(
    tmp_path: Path, manifest: dict[str, Any], field: str, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    x = {"m": torch.arange(6, dtype=torch.float32)}
    a = write_run(tmp_path / "a", x, manifest)
    b = write_run(tmp_path / "b", x)
    argv = ["diff", str(a), str(b)] if command == "diff" else ["ls", str(a)]
    assert main(argv) == 2
    one_line_error(capsys, str(a / MANIFEST), field)


@pytest.mark.parametrize("rank", ['"abc"', "1e400", "true", "-1"])
def test_a_pass_file_beside_a_manifest_with_a_bad_rank_is_exit_2(
    tmp_path: Path, rank: str, capsys: pytest.CaptureFixture[str]
) -> None:
    x = {"m": torch.arange(6, dtype=torch.float32)}
    a = write_run(tmp_path / "a", x, '{"rank": ' + rank + ', "pid": 1}')
    b = write_run(tmp_path / "b", x)
    assert main(["diff", str(a / pass_file_name(0)), str(b / pass_file_name(0))]) == 2
    one_line_error(capsys, str(a / MANIFEST), "rank")


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "1e400"])
def test_a_manifest_value_that_is_no_finite_number_still_gives_strict_json(
    tmp_path: Path, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    x = {"m": torch.arange(6, dtype=torch.float32)}
    a = write_run(
        tmp_path / "a",
        x,
        '{"rank": 0, "pid": 1, "custom": ' + value + ', "settings": {"x": [' + value + "]}}",
    )
    b = write_run(tmp_path / "b", x)
    out = tmp_path / "report.json"
    assert main(["diff", str(a), str(b), "--json", str(out)]) == 0

    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} in strict JSON")

    doc = json.loads(out.read_text(), parse_constant=refuse)
    facts = json.dumps(doc["sides"]["a"])  # the manifest's facts, as the report repeats them
    expected = "inf" if "Inf" in value or "e400" in value else "nan"
    assert f'"custom": "{"-" if value.startswith("-") else ""}{expected}"' in facts


@pytest.mark.parametrize("version", ['"' + "1" * 5001 + '"', "1" * 5001, '"9" ', '"1.' + "0" * 5000 + '"'])
def test_a_format_of_thousands_of_digits_is_an_unknown_version(
    tmp_path: Path, version: str, capsys: pytest.CaptureFixture[str]
) -> None:
    x = {"m": torch.arange(6, dtype=torch.float32)}
    a = write_run(tmp_path / "a", x, '{"rank": 0, "pid": 1, "format": ' + version + "}")
    b = write_run(tmp_path / "b", x)
    if version.startswith('"1.'):  # major 1, however long its minor: readable
        assert main(["diff", str(a), str(b)]) == 0
        return
    for argv in (["diff", str(a), str(b)], ["ls", str(a)]):
        assert main(argv) == 2
        one_line_error(capsys, str(a / MANIFEST), "format")


# ------------------------------------------------------------------ 8, 9: safetensors headers


def _raw_pass(
    path: Path, entries: dict[str, Any], nbytes: int, metadata: dict[str, str] | None = None
) -> Path:
    header = dict(entries)
    if metadata is not None:
        header["__metadata__"] = metadata
    text = json.dumps(header).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"\0" * nbytes)
    return path


@pytest.mark.parametrize(
    "offsets", ["[0, 1e400]", "[0, 24.0]", "[-0, 24, 3]", '"0-24"', "[0, 18446744073709551616]"]
)
def test_header_data_offsets_that_are_no_pair_of_integers_are_exit_2_naming_the_file(
    tmp_path: Path, offsets: str, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "a" / pass_file_name(0)
    bad.parent.mkdir()
    text = ('{"x": {"dtype": "F32", "shape": [6], "data_offsets": ' + offsets + "}}").encode()
    bad.write_bytes(struct.pack("<Q", len(text)) + text + b"\0" * 24)
    good = _raw_pass(
        tmp_path / "b" / pass_file_name(0), {"x": {"dtype": "F32", "shape": [6], "data_offsets": [0, 24]}}, 24
    )
    for argv in (["show", str(bad)], ["diff", str(bad), str(good)], ["ls", str(bad.parent)]):
        code = main(argv)
        if argv[0] == "ls":  # ls reads no header: it lists, and fails on nothing
            capsys.readouterr()
            continue
        assert code == 2, argv
        one_line_error(capsys, str(bad), "data_offsets")


def test_a_capture_order_that_is_no_list_of_the_names_falls_back_to_the_files_order(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tensors = {"1": torch.ones(3), "0": torch.zeros(3)}
    for order in ([1, 0], [1], ["1", "1"], {"1": 0}, ["1", "0", "0"]):
        for side in ("a", "b"):
            (tmp_path / side).exists() and [p.unlink() for p in (tmp_path / side).iterdir()]
            (tmp_path / side).exists() and (tmp_path / side).rmdir()
        a = write_run(tmp_path / "a", tensors, order=order)
        b = write_run(tmp_path / "b", tensors, order=order)
        assert main(["show", str(a / pass_file_name(0))]) == 0
        assert main(["ls", str(a)]) == 0
        assert main(["diff", str(a), str(b)]) == 0
        report = compare(a, b)
        assert [r.name for r in report.results] == ["0", "1"]  # sorted names: the file's own order
        capsys.readouterr()


# ------------------------------------------------------------------ 11, 12: control files


def test_ls_with_control_orders_that_are_not_objects_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = write_run(
        tmp_path / "a", {"m": torch.ones(2)}, {"control": {"state": "idle", "orders": [1, ["x"], "y"]}}
    )
    assert main(["ls", str(a)]) == 2
    one_line_error(capsys, str(a / MANIFEST), "control")


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "garbage", "big"])
def test_ls_never_blocks_on_or_swallows_a_control_state_that_no_engine_wrote(
    tmp_path: Path, kind: str
) -> None:
    a = write_run(tmp_path / "a", {"m": torch.ones(2)}, {"control": {"state": "idle", "orders": []}})
    state = a / "control.state"
    if kind == "fifo":
        os.mkfifo(state)
    elif kind == "dev-zero":
        state.symlink_to("/dev/zero")
    elif kind == "garbage":
        state.write_text('{"state": ["armed"], "armed_until": {"x": 1}, "step": [[1]]}')
    else:
        state.write_text(json.dumps({"state": "armed", "pad": "x" * (1 << 20)}))
    done = cli("ls", str(a), timeout=60)
    assert done.returncode == 0, done.stderr
    assert "control idle" in done.stdout  # the manifest's state: the heartbeat was passed over
    assert "Traceback" not in done.stderr


# ------------------------------------------------------------------ 13: stats.jsonl


@pytest.mark.parametrize(
    "line",
    [
        '{"module": "m", "tensor": "out", "pass": 0, "call": 0, "abs_mean": ' + "9" * 400 + "}",
        '{"module": "m", "tensor": "out", "pass": ' + "9" * 400 + ', "call": 0, "abs_mean": 1.0}',
        '{"module": "m", "tensor": "out", "pass": 0, "call": 0, "shape": ['
        + "9" * 400
        + '], "abs_mean": 1.0}',
    ],
    ids=["abs_mean", "pass", "shape"],
)
@pytest.mark.parametrize("command", ["diff", "ls"])
def test_a_stats_value_of_hundreds_of_digits_is_one_line_naming_the_line(
    tmp_path: Path, line: str, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    good = '{"module": "m", "tensor": "out", "pass": 0, "call": 0, "abs_mean": 1.0}'
    stats = {"settings": {"mode": "stats"}}
    a = write_run(tmp_path / "a", None, stats, stats=[line])
    b = write_run(tmp_path / "b", None, stats, stats=[good])
    argv = ["diff", str(a), str(b)] if command == "diff" else ["ls", str(a)]
    assert main(argv) == 2
    one_line_error(capsys, f"{a / STATS_FILE}:1")


# ------------------------------------------------------------------ the batch layout (tracedump.batch)


@pytest.mark.parametrize(
    ("batch", "named"),
    [
        ({"seq_ids": [0, 0], "input_ids": [True, 5]}, "input_ids[0]"),
        ({"seq_ids": [0, 0], "positions": [0, 10**30]}, "positions[1]"),
        ({"seq_ids": [[0], 0]}, "seq_ids[0]"),
        ({"seq_ids": [0, 0], "grid": [1, 2, 3]}, "grid"),
    ],
    ids=["bool-token", "huge-position", "nested-seq-id", "grid-of-three"],
)
def test_a_batch_layout_of_the_wrong_types_names_its_field(
    tmp_path: Path, batch: dict[str, Any], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "a"
    run.mkdir()
    (run / MANIFEST).write_text(json.dumps({"rank": 0, "pid": 1}))
    metadata = {"tracedump.mode": "full", ORDER_KEY: '["m"]', "tracedump.batch": json.dumps(batch)}
    save_file({"m": torch.ones(2, 3)}, str(run / pass_file_name(0)), metadata=metadata)
    assert main(["ls", str(run)]) == 0  # ls lists the run and says why its sequences cannot be shown
    out = capsys.readouterr().out
    assert "sequence metadata unreadable" in out and named in out, out
