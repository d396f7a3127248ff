"""``--unshard`` and run selection on hand-made dumps: TP ranks, several roots per process.

The dumps are written with the writer's own ``save_tensors_atomic`` and a manifest, exactly the
layout a real run leaves (``rank<R>_pid<P>/pass<NNNNN>.safetensors`` + ``manifest.json``), with
tensors chosen so the right answer is known: column shards concatenate back to the reference,
row-parallel partials sum to it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tracedump.cli import main
from tracedump.compare import compare
from tracedump.dump.writer import save_tensors_atomic
from tracedump.errors import DumpReadError, UsageError
from tracedump.store.format import pass_file_name

WORLD = 2
UNSHARD = ("qkv=cat:-1", "o_proj=sum")


def write_run(
    base: Path,
    rank: int,
    passes: dict[int, dict[str, torch.Tensor]],
    root: str = "Toy",
    pid: int | None = None,
) -> Path:
    pid = pid if pid is not None else 100 + rank
    run_dir = base / f"rank{rank}_pid{pid}"
    serial = 1
    while run_dir.exists():
        serial += 1
        run_dir = base / f"rank{rank}_pid{pid}-{serial}"
    run_dir.mkdir(parents=True)
    for index, tensors in passes.items():
        save_tensors_atomic(run_dir / pass_file_name(index), tensors, {"tracedump.mode": "full"})
    manifest = {"rank": rank, "pid": pid, "root": root, "world_size": WORLD, "settings": {"mode": "full"}}
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    return run_dir


def model_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """The TP=1 reference, and the pieces each rank of a TP=2 run would hold."""
    generator = torch.Generator().manual_seed(seed)
    return {
        "embed": torch.randn(5, 8, generator=generator),
        "qkv": torch.randn(5, 12, generator=generator),
        "partial0": torch.randn(5, 8, generator=generator),
        "partial1": torch.randn(5, 8, generator=generator),
    }


def tp1(base: Path, values: dict[str, torch.Tensor]) -> Path:
    o_proj = values["partial0"] + values["partial1"]
    write_run(
        base, 0, {0: {"embed": values["embed"], "qkv": values["qkv"], "o_proj": o_proj, "out": o_proj * 2}}
    )
    return base


def tp2(
    base: Path, values: dict[str, torch.Tensor], rank1_out_offset: float = 0.0, drop: str | None = None
) -> Path:
    o_proj = values["partial0"] + values["partial1"]
    for rank in range(WORLD):
        tensors = {
            "embed": values["embed"],
            "qkv": values["qkv"].chunk(WORLD, dim=-1)[rank].contiguous(),
            "o_proj": values[f"partial{rank}"],
            "out": o_proj * 2 + (rank1_out_offset if rank == 1 else 0.0),
        }
        if drop is not None and rank == 1:
            del tensors[drop]
        write_run(base, rank, {0: tensors})
    return base


@pytest.fixture
def values() -> dict[str, torch.Tensor]:
    return model_tensors()


def test_unshard_cat_and_sum_rebuild_the_tp1_tensors(tmp_path: Path, values: dict[str, torch.Tensor]) -> None:
    report = compare(tp2(tmp_path / "tp2", values), tp1(tmp_path / "tp1", values), unshard=UNSHARD)
    by_name = {r.name: r for r in report.results}
    assert report.exit_code == 0 and report.compared == 4
    assert by_name["qkv"].shape_a == (5, 12) and by_name["qkv"].metrics.max_abs == 0
    assert by_name["qkv"].unshard_a == "cat:-1" and by_name["o_proj"].unshard_a == "sum"
    assert by_name["o_proj"].metrics.rel_diff < 1e-14  # summed in float64 vs summed in fp32
    assert by_name["embed"].unshard_a == "replicated" and by_name["embed"].unshard_b is None


def test_unshard_applies_to_whichever_side_has_several_ranks(
    tmp_path: Path, values: dict[str, torch.Tensor]
) -> None:
    report = compare(tp1(tmp_path / "tp1", values), tp2(tmp_path / "tp2", values), unshard=UNSHARD)
    assert report.exit_code == 0
    assert {r.unshard_b for r in report.results} == {"replicated", "cat:-1", "sum"}


def test_without_unshard_rank_0_alone_is_compared(tmp_path: Path, values: dict[str, torch.Tensor]) -> None:
    report = compare(tp2(tmp_path / "tp2", values), tp1(tmp_path / "tp1", values))
    statuses = {r.name: r.status for r in report.results}
    assert statuses == {"embed": "ok", "qkv": "shape_mismatch", "o_proj": "diverged", "out": "ok"}
    assert report.a["roots"]["Toy"]["ranks"] == [0]


def test_a_replicated_tensor_that_differs_across_ranks_is_reported(
    tmp_path: Path, values: dict[str, torch.Tensor]
) -> None:
    report = compare(
        tp2(tmp_path / "tp2", values, rank1_out_offset=1e-3), tp1(tmp_path / "tp1", values), unshard=UNSHARD
    )
    out = next(r for r in report.results if r.name == "out")
    assert out.status == "rank_mismatch" and report.exit_code == 1
    assert "rank 1 differs from rank 0" in (out.message or "")
    assert out.metrics is not None and out.metrics.max_abs == 0  # rank 0 itself matches the reference
    assert report.first_divergence is out


def test_a_name_missing_on_one_rank_is_a_rank_mismatch(
    tmp_path: Path, values: dict[str, torch.Tensor]
) -> None:
    report = compare(
        tp2(tmp_path / "tp2", values, drop="out"), tp1(tmp_path / "tp1", values), unshard=UNSHARD
    )
    out = next(r for r in report.results if r.name == "out")
    assert out.status == "rank_mismatch" and "missing on rank(s) [1]" in (out.message or "")


def test_a_rule_that_cannot_apply_is_an_error_not_a_crash(
    tmp_path: Path, values: dict[str, torch.Tensor]
) -> None:
    report = compare(
        tp2(tmp_path / "tp2", values), tp1(tmp_path / "tp1", values), unshard=("qkv=cat:5", "o_proj=sum")
    )
    qkv = next(r for r in report.results if r.name == "qkv")
    assert qkv.status == "error" and "out of range" in (qkv.message or "")
    assert report.exit_code == 1


def test_rank_option_picks_the_run_of_that_rank(tmp_path: Path, values: dict[str, torch.Tensor]) -> None:
    report = compare(tp2(tmp_path / "a", values), tp2(tmp_path / "b", values), rank=1)
    assert report.exit_code == 0
    assert report.a["roots"]["Toy"]["ranks"] == [1] == report.b["roots"]["Toy"]["ranks"]
    with pytest.raises(UsageError, match="no run of rank 3"):
        compare(tmp_path / "a", tmp_path / "b", rank=3)


def test_both_sides_sharded_are_both_unsharded(tmp_path: Path, values: dict[str, torch.Tensor]) -> None:
    report = compare(tp2(tmp_path / "a", values), tp2(tmp_path / "b", values), unshard=UNSHARD)
    assert report.exit_code == 0 and report.results[1].shape_a == report.results[1].shape_b == (5, 12)


def test_unshard_through_the_command_line(tmp_path: Path, values: dict[str, torch.Tensor]) -> None:
    a, b = tp2(tmp_path / "tp2", values), tp1(tmp_path / "tp1", values)
    flags = [arg for rule in UNSHARD for arg in ("--unshard", rule)]
    assert main(["diff", str(a), str(b), *flags, "--json", str(tmp_path / "r.json"), "--no-progress"]) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["settings"]["unshard"] == list(UNSHARD)
    assert report["sides"]["a"]["roots"]["Toy"]["ranks"] == [0, 1]
    assert report["tensors"][1]["unshard"] == {"a": "cat:-1", "b": None}


# ------------------------------------------------------------------------------------------ roots


def test_runs_of_several_roots_pair_by_their_root_label(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(1)
    vision, text = torch.randn(3, 4, generator=generator), torch.randn(2, 4, generator=generator)
    for side in ("a", "b"):
        write_run(tmp_path / side, 0, {0: {"patch": vision}}, root="VisionTower", pid=7)
        write_run(tmp_path / side, 0, {0: {"embed": text}, 1: {"embed": text}}, root="LanguageModel", pid=7)
    write_run(tmp_path / "a", 0, {0: {"extra": text}}, root="Projector", pid=7)
    report = compare(tmp_path / "a", tmp_path / "b")
    assert report.exit_code == 0
    assert [(r.pass_index, r.root, r.name) for r in report.results] == [
        (0, "VisionTower", "patch"),
        (0, "LanguageModel", "embed"),
        (1, "LanguageModel", "embed"),
    ]
    assert report.results[0].label == "VisionTower:patch"
    assert report.summary()["roots_only_in_a"] == ["Projector"]


def test_two_runs_of_one_rank_and_root_ask_for_a_run_dir(tmp_path: Path) -> None:
    tensor = torch.ones(2)
    write_run(tmp_path / "a", 0, {0: {"x": tensor}}, pid=1)
    write_run(tmp_path / "a", 0, {0: {"x": tensor}}, pid=2)
    write_run(tmp_path / "b", 0, {0: {"x": tensor}}, pid=3)
    with pytest.raises(DumpReadError, match="several runs of rank 0 for root 'Toy': rank0_pid1, rank0_pid2"):
        compare(tmp_path / "a", tmp_path / "b")
    assert compare(tmp_path / "a" / "rank0_pid2", tmp_path / "b").exit_code == 0


def test_unshard_without_a_multi_rank_side_says_it_did_nothing(
    tmp_path: Path, values: dict[str, torch.Tensor]
) -> None:
    report = compare(tp1(tmp_path / "a", values), tp1(tmp_path / "b", values), unshard=UNSHARD)
    assert report.exit_code == 0 and report.settings["unshard_applied"] is False
    from tracedump.compare.report.display import summary_lines

    assert "note: --unshard had no effect: neither side has several ranks" in summary_lines(report)
