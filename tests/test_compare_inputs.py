"""The comparator on hand-made dumps whose right answer is known: how stats lines and records
interleave, stats without a common statistic, ``last_row`` against full dumps whose token dims
differ, dumps with no pass in common, and malformed input (which must exit 2, never a traceback).

Files are written by hand (``safetensors.torch.save_file`` with tracedump's metadata, stats lines
as JSON), so these tests fix the format the comparator reads, not what today's dumper writes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from tracedump.cli import main
from tracedump.compare import compare
from tracedump.compare.report.display import summary_lines
from tracedump.errors import DumpReadError, UsageError
from tracedump.store.format import MANIFEST, ORDER_KEY, STATS_FILE, pass_file_name
from tracedump.store.loader import SEQ_KEY


def write_run(
    run_dir: Path,
    mode: str = "full",
    passes: dict[int, dict[str, torch.Tensor]] | None = None,
    stats: list[dict[str, Any]] | None = None,
    seq: dict[int, list[int]] | None = None,
    token_dim: int = 0,
) -> Path:
    """A run dir as the dumper leaves it: manifest, pass files (with ``seq`` when given), stats."""
    run_dir.mkdir(parents=True)
    manifest = {"rank": 0, "pid": 1, "root": "Toy", "settings": {"mode": mode, "token_dim": token_dim}}
    (run_dir / MANIFEST).write_text(json.dumps(manifest))
    for index, tensors in (passes or {}).items():
        metadata = {"tracedump.mode": mode, ORDER_KEY: json.dumps(list(tensors))}
        if seq is not None:
            metadata[SEQ_KEY] = json.dumps(seq[index])
        save_file(tensors, str(run_dir / pass_file_name(index)), metadata=metadata)
    if stats is not None:
        (run_dir / STATS_FILE).write_text("".join(json.dumps(line) + "\n" for line in stats))
    return run_dir


def stats_line(module: str, abs_mean: float, seq: int | None = None, **extra: Any) -> dict[str, Any]:
    line: dict[str, Any] = {"module": module, "tensor": "out", "pass": 0, "call": 0, "abs_mean": abs_mean}
    if seq is not None:
        line["seq"] = seq
    return {**line, **extra}


# ------------------------------------------------------------------------------ stats and records


def stats_run_with_a_record(base: Path, shift: float, with_seq: bool) -> Path:
    """Captures m0, then record ``rec``, then m1; ``shift`` moves m0 and ``rec`` off the reference."""
    lines = [
        stats_line("m0", 1.0 + shift, 0 if with_seq else None),
        stats_line("m1", 3.0, 2 if with_seq else None),
    ]
    record = {"rec": torch.full((4,), 2.0 + shift)}
    return write_run(base, "stats", {0: record}, lines, {0: [1]} if with_seq else None)


def test_records_and_stats_lines_interleave_by_capture_sequence(tmp_path: Path) -> None:
    a = stats_run_with_a_record(tmp_path / "a", shift=0.5, with_seq=True)
    b = stats_run_with_a_record(tmp_path / "b", shift=0.0, with_seq=True)
    report = compare(a, b)
    assert [r.name for r in report.results] == ["m0", "rec", "m1"]
    assert report.first_divergence is not None and report.first_divergence.name == "m0"


def test_dumps_without_sequence_numbers_keep_records_first(tmp_path: Path) -> None:
    a = stats_run_with_a_record(tmp_path / "a", shift=0.5, with_seq=False)
    b = stats_run_with_a_record(tmp_path / "b", shift=0.0, with_seq=False)
    assert [r.name for r in compare(a, b).results] == ["rec", "m0", "m1"]


def test_stats_without_a_numeric_statistic_in_common_are_an_error_not_a_pass(tmp_path: Path) -> None:
    def shapes_only(base: Path) -> Path:
        return write_run(base, "stats", stats=[{"module": "m0", "pass": 0, "shape": [2], "dtype": "float32"}])

    report = compare(shapes_only(tmp_path / "a"), shapes_only(tmp_path / "b"))
    (result,) = report.results
    assert result.status == "error" and report.exit_code == 1
    assert (
        result.message is not None
        and "no numeric statistic on both sides (A: none; B: none)" in result.message
    )


# ------------------------------------------------------------------------------ last_row vs full


@pytest.mark.parametrize("engine_is_a", [True, False])
def test_a_last_row_engine_dump_compares_with_a_full_hf_dump(tmp_path: Path, engine_is_a: bool) -> None:
    """Engine ``[tokens, hidden]`` (TOKEN_DIM=0) cut to ``[1, hidden]``; HF ``[1, seq, hidden]``: the
    HF side must be cut along dim 1, its token dim, not dim 0 (its batch). Earlier rows of HF differ,
    so a cut in the wrong place would diverge; a record is stored whole on both sides."""
    generator = torch.Generator().manual_seed(0)
    hf = torch.randn(1, 5, 8, generator=generator)
    engine = hf[0, -1:].clone()
    hf[0, :-1] += 1.0
    record = torch.randn(3, 4, generator=generator)
    last_row = write_run(tmp_path / "engine", "last_row", {0: {"h": engine, "rec": record}}, token_dim=0)
    full = write_run(tmp_path / "hf", "full", {0: {"h": hf, "rec": record}})
    report = compare(last_row, full) if engine_is_a else compare(full, last_row)
    assert {r.name: r.status for r in report.results} == {"h": "ok", "rec": "ok"}
    assert report.exit_code == 0


def test_a_full_engine_dump_compares_with_a_last_row_hf_dump(tmp_path: Path) -> None:
    """The other way round: HF's TOKEN_DIM=1 does not exist in the engine's 2-dim tensor's sense of
    tokens; its dim 0 does."""
    engine = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    hf_last = engine[-1:].reshape(1, 1, 8).clone()
    full = write_run(tmp_path / "engine", "full", {0: {"h": engine}})
    last_row = write_run(tmp_path / "hf", "last_row", {0: {"h": hf_last}}, token_dim=1)
    (result,) = compare(full, last_row).results
    assert result.status == "ok" and result.shape_a == (1, 8)


# ------------------------------------------------------------------------------ what to compare


def test_dumps_without_a_pass_in_common_say_so(tmp_path: Path) -> None:
    a = write_run(tmp_path / "a", passes={0: {"x": torch.ones(2)}, 1: {"x": torch.ones(2)}})
    b = write_run(tmp_path / "b", passes={5: {"x": torch.ones(2)}})
    with pytest.raises(UsageError, match=r"no pass is in both dumps \(A: 0,1; B: 5\)"):
        compare(a, b)


def test_differing_dtypes_are_described_as_the_arithmetic_is_done(tmp_path: Path) -> None:
    values = torch.randn(16, generator=torch.Generator().manual_seed(2))
    a = write_run(tmp_path / "a", passes={0: {"x": values.bfloat16()}})
    b = write_run(tmp_path / "b", passes={0: {"x": values}})
    lines = summary_lines(compare(a, b))
    assert any("dtypes differ on 1 tensors" in line and "in float32 (float64 when" in line for line in lines)
    assert not any("float64 after upcasting" in line for line in lines)


# ------------------------------------------------------------------------------ unreadable input


def test_a_stats_line_without_a_module_exits_2_naming_its_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = [stats_line("m0", 1.0), stats_line("m1", 2.0)]
    a = write_run(tmp_path / "a", "stats", stats=[good[0], {"pass": 0, "abs_mean": 2.0}])
    b = write_run(tmp_path / "b", "stats", stats=good)
    with pytest.raises(DumpReadError, match=rf"{STATS_FILE}:2: not a stats record: no \"module\" name"):
        compare(a, b)
    for command in (["diff", str(a), str(b)], ["ls", str(a)]):
        assert main(command) == 2
        assert f"{a / STATS_FILE}:2:" in capsys.readouterr().err


@pytest.mark.parametrize(
    "line",
    [
        '["not", "an", "object"]',
        '{"module": "m", "pass": 0, "abs_mean": [1]}',
        '{"module": "m"}',
        '{"module": "m", "pass": 0, "shape": [-5, -16], "abs_mean": 1.0}',  # as a header's
        '{"module": "m", "pass": 0, "shape": [1.5, 5, 16], "abs_mean": 1.0}',
    ],
)
def test_malformed_stats_lines_are_read_errors(tmp_path: Path, line: str) -> None:
    run = write_run(tmp_path / "a", "stats", stats=[stats_line("m0", 1.0)])
    with (run / STATS_FILE).open("a") as handle:
        handle.write(line + "\n")
    with pytest.raises(DumpReadError, match=f"{STATS_FILE}:2: not a stats record"):
        compare(run, run)


def test_a_permission_error_exits_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    run = write_run(tmp_path / "a", passes={0: {"x": torch.ones(2)}})
    victim = run / pass_file_name(0)
    real_open = Path.open

    def refuse(self: Path, *args: Any, **kwargs: Any) -> Any:
        if self == victim:
            raise PermissionError(13, "Permission denied", str(self))
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", refuse)
    for command in (["diff", str(run), str(run)], ["show", str(victim)], ["ls", str(run)]):
        assert main(command) == 2, command
        assert f"{victim}: cannot read (Permission denied)" in capsys.readouterr().err
