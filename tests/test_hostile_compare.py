"""Hostile dumps and options against the comparator."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_compare_unshard import UNSHARD, model_tensors, tp1, write_run

from tracedump.cli import main
from tracedump.compare import compare
from tracedump.errors import UsageError


def _tp2_ranks(base: Path, values: dict[str, torch.Tensor], ranks: tuple[int, ...], passes: int = 1) -> Path:
    """A TP=2 dump (manifests say world_size 2) holding only ``ranks``."""
    for rank in ranks:
        tensors = {
            "embed": values["embed"],
            "qkv": values["qkv"].chunk(2, dim=-1)[rank % 2].contiguous(),
            "o_proj": values[f"partial{rank % 2}"],
        }
        write_run(base, rank, {index: tensors for index in range(passes)})
    return base


# ------------------------------------------------------------------ 6: --unshard ranks vs world_size


@pytest.mark.parametrize(
    ("ranks", "named"), [((0, 3), "missing rank(s) [1]"), ((0, 1, 2), "rank(s) [2] beyond")]
)
def test_unshard_refuses_ranks_that_are_not_the_world(
    tmp_path: Path, ranks: tuple[int, ...], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    values = model_tensors()
    a = _tp2_ranks(tmp_path / "a", values, ranks)
    b = tp1(tmp_path / "b", values)
    with pytest.raises(UsageError, match=r"world_size 2") as info:
        compare(a, b, unshard=UNSHARD)
    assert named in str(info.value)
    assert main(["diff", str(a), str(b), "--unshard", UNSHARD[0], "--unshard", UNSHARD[1]]) == 2
    err = capsys.readouterr().err
    assert named in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("world_size", "named"),
    [
        (None, "missing rank(s) [1]"),  # no world_size: the ranks must still be 0..N-1
        ("two", 'world_size "two"'),
        (0, "world_size 0"),
        ("mixed", 'disagree on world_size: "2", 2'),  # was a TypeError from sorted()
    ],
    ids=["absent", "string", "zero", "mixed-types"],
)
def test_unshard_refuses_a_gap_or_a_bad_world_size_in_the_manifests(
    tmp_path: Path, world_size: object, named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    values = model_tensors()
    a = _tp2_ranks(tmp_path / "a", values, (0, 2) if world_size is None else (0, 1))
    for number, run in enumerate(sorted(a.iterdir())):
        manifest = json.loads((run / "manifest.json").read_text())
        if world_size is None:
            del manifest["world_size"]
        else:
            manifest["world_size"] = ("2" if number else 2) if world_size == "mixed" else world_size
        (run / "manifest.json").write_text(json.dumps(manifest))
    b = tp1(tmp_path / "b", values)
    with pytest.raises(UsageError) as info:
        compare(a, b, unshard=UNSHARD)
    assert named in str(info.value)
    assert main(["diff", str(a), str(b), "--unshard", UNSHARD[0], "--unshard", UNSHARD[1]]) == 2
    err = capsys.readouterr().err
    assert named in err and len(err.strip().splitlines()) == 1


# ------------------------------------------------------------------ 7: a pass on one rank only


def test_a_pass_present_on_one_rank_only_is_reported(tmp_path: Path) -> None:
    values = model_tensors()
    a = _tp2_ranks(tmp_path / "a", values, (0,), passes=2)
    _tp2_ranks(tmp_path / "a", values, (1,), passes=3)  # rank 1 also has pass 2
    b = tp1(tmp_path / "b", values)  # pass 0 only
    report = compare(a, b, unshard=UNSHARD)
    assert report.plan.passes_only_in_a == (1, 2)  # rank 0 has 0-1, rank 1 has 0-2, B has 0


def test_a_pass_missing_on_one_rank_of_both_sides_is_a_rank_mismatch_naming_it(tmp_path: Path) -> None:
    values = model_tensors()
    a = _tp2_ranks(tmp_path / "a", values, (0,), passes=1)
    _tp2_ranks(tmp_path / "a", values, (1,), passes=2)
    b = _tp2_ranks(tmp_path / "b", values, (0, 1), passes=2)
    report = compare(a, b, unshard=UNSHARD)
    in_pass_1 = [r for r in report.results if r.pass_index == 1]
    assert in_pass_1 and {r.status for r in in_pass_1} == {"rank_mismatch"}
    assert all("missing on rank(s) [0]" in (r.message or "") for r in in_pass_1)
    assert report.exit_code == 1


# ------------------------------------------------------------------ 8: --map collisions


def _pair_of_dumps(base: Path) -> tuple[Path, Path]:
    values = {"a": torch.ones(3), "b": torch.full((3,), 2.0)}
    write_run(base / "A", 0, {0: values})
    write_run(base / "B", 0, {0: values})
    return base / "A", base / "B"


@pytest.mark.parametrize("maps", [("^.*$=a",), ("^a$=b", "^b$=a")])
def test_map_rules_turning_several_names_into_one_are_an_error_naming_them(
    tmp_path: Path, maps: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = _pair_of_dumps(tmp_path)
    with pytest.raises(UsageError, match=r"'a', 'b' -> 'a'"):
        compare(a, b, maps=maps)
    argv = ["diff", str(a), str(b)] + [arg for rule in maps for arg in ("--map", rule)]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "'a', 'b' -> 'a'" in captured.err and "diverged" not in captured.out


def test_a_map_that_swaps_names_one_to_one_still_compares(tmp_path: Path) -> None:
    a, b = _pair_of_dumps(tmp_path)
    report = compare(a, b, maps=("^a$=x", "^b$=a", "^x$=b"))
    assert {(r.name, r.name_b) for r in report.results} == {("a", "b"), ("b", "a")}


# ------------------------------------------------------------------ 9: header dims


def _raw_pass(path: Path, shape: list[object], nbytes: int) -> Path:
    import struct

    header = json.dumps({"x": {"dtype": "F32", "shape": shape, "data_offsets": [0, nbytes]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * nbytes)
    return path


@pytest.mark.parametrize("shape", [[-5, -16], [1.5, 5, 16], ["5", 16], [True, 80]])
def test_a_header_with_negative_or_non_integer_dims_is_a_bad_header(
    tmp_path: Path, shape: list[object], capsys: pytest.CaptureFixture[str]
) -> None:
    bad = _raw_pass(tmp_path / "pass00000.safetensors", shape, 80 * 4)
    good = _raw_pass(tmp_path / "good.safetensors", [5, 16], 80 * 4)
    for argv in (["show", str(bad)], ["diff", str(bad), str(good)]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "shape" in err and str(bad) in err


# ------------------------------------------------------------------ 10: a NaN-only divergence


def test_a_nan_only_divergence_says_nan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_run(tmp_path / "A", 0, {0: {"x": torch.tensor([1.0, float("nan"), 3.0, 4.0])}})
    write_run(tmp_path / "B", 0, {0: {"x": torch.tensor([1.0, 2.0, 3.0, 4.0])}})
    report = compare(tmp_path / "A", tmp_path / "B")
    (result,) = report.results
    assert result.status == "diverged" and result.metrics is not None and result.metrics.nan_a == 1  # premise
    assert main(["diff", str(tmp_path / "A"), str(tmp_path / "B")]) == 1
    out = capsys.readouterr().out
    assert "NaN" in out and "rel_diff 0 >" not in out


# ------------------------------------------------------------------ 17: control characters shown, not sent

RED = "\x1b[31m"


def _hostile_dump(dump: Path, seed: int) -> Path:
    import tracedump

    torch.manual_seed(seed)
    model = torch.nn.ModuleDict({f"x{RED}red": torch.nn.Linear(4, 4)})
    dumper = tracedump.attach(model, {"dir": str(dump)})
    assert dumper is not None
    with dumper.step():
        dumper.set_batch([f"seq{RED}1", f"seq{RED}1"])
        model[f"x{RED}red"](torch.ones(2, 4))
        dumper.record(f"tag{RED}\u202e", torch.ones(2))
    dumper.close()
    return dump


def test_hostile_names_and_seq_ids_never_reach_the_terminal_raw(tmp_path: Path) -> None:
    import subprocess
    import sys

    a, b = _hostile_dump(tmp_path / "A", 0), _hostile_dump(tmp_path / "B", 1)  # B's weights differ
    pass_file = next(a.glob("rank*/pass00000.safetensors"))
    for argv, status in (
        (["diff", str(a), str(b)], 1),
        (["ls", str(a)], 0),
        (["show", str(pass_file)], 0),
        (["diff", str(a), str(tmp_path / f"nothing{RED}")], 2),
        (["diff", str(a), str(b), "--plot", str(tmp_path / "diff.png")], 1),  # matplotlib warns on glyphs
        (["diff", str(a), str(b), "--html", str(tmp_path / f"report{RED}.html")], 1),  # "html report: PATH"
        (["run", "--dir", str(tmp_path / f"run{RED}"), "--", sys.executable, "-c", "pass"], 0),
        (["run", "--dir", str(tmp_path / f"run{RED}"), "--", f"nothing{RED}"], 127),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "tracedump", *argv], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == status, done.stderr
        shown = done.stdout + done.stderr
        assert "\x1b" not in shown and "\u202e" not in shown, argv
        assert "\\x1b[31m" in shown, (argv, shown)
    listing = subprocess.run(
        [sys.executable, "-m", "tracedump", "ls", str(a)], capture_output=True, text=True, timeout=120
    ).stdout
    assert "seq\\x1b[31m1" in listing  # the sequence ids, escaped
