"""``--align tokens``: a continuous-batching engine (chunked prefill, mixed decode steps) against a
batch-1 HF reference, aligned by sequence and position; ``set_batch`` and the loader's view of it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import tracedump
import tracedump.cli
from tracedump.compare import compare
from tracedump.errors import UsageError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import batching
from engine import ModelConfig, build_model

BUG_LAYER = 1


def _serve(
    out: Path, monkeypatch: pytest.MonkeyPatch, bug_layer: int | None = None
) -> list[batching.Request]:
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(out))
    monkeypatch.setenv("TRACEDUMP_DUMP_MODULES", "all")
    served = batching.serve(build_model(ModelConfig()), batching.default_requests(), bug_layer=bug_layer)
    monkeypatch.delenv("TRACEDUMP_DUMP_DIR")
    return served


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("align")
    with pytest.MonkeyPatch.context() as mp:
        served = _serve(root / "engine", mp)
        _serve(root / "buggy", mp, BUG_LAYER)
        mp.setenv("TRACEDUMP_DUMP_MODULES", "all")
        mp.setenv("TRACEDUMP_DUMP_DIR", str(root / "reference"))
        batching.reference(build_model(ModelConfig()), batching.fed_tokens(served))
        first = sorted(served, key=lambda r: r.arrival)[0]
        mp.setenv("TRACEDUMP_DUMP_DIR", str(root / "generate"))
        model = build_model(ModelConfig())
        dumper = tracedump.attach(model)
        assert dumper is not None
        with torch.no_grad():
            model.generate(
                torch.tensor([first.prompt]), max_new_tokens=first.new_tokens, do_sample=False,
                pad_token_id=0,
            )  # fmt: skip
        dumper.close()
    return {"engine": root / "engine", "buggy": root / "buggy", "reference": root / "reference",
            "generate": root / "generate", "served": served}  # type: ignore[dict-item]  # fmt: skip


def test_the_engine_steps_mix_requests_chunked_prefill_and_decode(dumps: dict[str, Path]) -> None:
    run = tracedump.open_dump(dumps["engine"]).run()
    found = run.batches()
    held = [set(batch.seq_ids) for batch in found.values()]
    assert any(len(s) >= 2 for s in held)  # several requests in one step
    first = found[0]
    assert first.declared and first.seq_ids == (0,) * 4 and first.positions == (0, 1, 2, 3)  # a chunk
    assert run.passes[0]["model.embed_tokens"].shape == (4, 32)  # [tokens, hidden]


def test_a_bug_free_batching_engine_matches_the_batch_1_reference(dumps: dict[str, Path]) -> None:
    report = compare(dumps["engine"], dumps["reference"], align="tokens")
    assert report.exit_code == 0, [r.message for r in report.results if r.status != "ok"][:3]
    # the HF reference's rows carry the layout of their forwards (sequences 0, 1, 2 in run order)
    assert report.alignment is not None and report.alignment[0]["matched_by"] == "seq id"
    assert len(report.alignment[0]["pairs"]) == 3
    lengths = sorted(r.shape_a[0] for r in report.results if r.name == "model.embed_tokens")
    assert lengths == sorted(len(t) for t in batching.fed_tokens(dumps["served"]))  # type: ignore[arg-type]


def test_a_decode_only_bug_is_named_with_its_layer_sequence_position_and_step(
    dumps: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "report.json"
    code = tracedump.cli.main(
        ["diff", str(dumps["buggy"]), str(dumps["reference"]), "--align", "tokens", "--json", str(out)]
    )
    assert code == 1
    first = json.loads(out.read_text())["summary"]["alignment"][0]["first"]
    served = sorted(dumps["served"], key=lambda r: r.arrival)  # type: ignore[arg-type]
    prompt = {r.seq_id: len(r.prompt) for r in served}
    assert f".layers.{BUG_LAYER}." in first["name"]
    seq = int(first["sequence"].split()[1])
    assert first["position"] == prompt[seq]  # the first decode position: prefill rows were right
    run = tracedump.open_dump(dumps["buggy"]).run()
    assert run.sequences()[seq].rows[first["position"]][0] == first["step"]


def test_against_hf_generate_one_pass_per_token(dumps: dict[str, Path]) -> None:
    report = compare(dumps["engine"], dumps["generate"], align="tokens", filter=r"layers|embed|norm|lm_head")
    pairs = report.alignment[0]["pairs"]  # type: ignore[index]
    assert pairs[0] == [0, 0]  # generate(): a prefill pass, then one pass per token, all sequence 0
    assert report.exit_code == 0
    seq0 = [r for r in report.results if r.sequence and r.sequence.startswith("seq 0")]
    positions = {r.shape_a[0] for r in seq0 if r.name != "lm_head"}
    assert positions == {14}  # 11 prompt tokens and 3 decoded ones were fed
    logits = next(r for r in seq0 if r.name == "lm_head")  # generate() keeps the last row's logits
    assert logits.status == "ok" and logits.positions == (10, 11, 12, 13)


def test_the_loader_gathers_a_sequence_in_position_order(dumps: dict[str, Path]) -> None:
    run = tracedump.open_dump(dumps["engine"]).run()
    tensors = run.sequence(1)
    served = {r.seq_id: r for r in dumps["served"]}  # type: ignore[attr-defined]
    assert tensors["model.embed_tokens"].shape == (len(served[1].tokens) - 1, 32)
    reference = tracedump.open_dump(dumps["reference"]).run().sequence(1)
    torch.testing.assert_close(
        tensors["model.embed_tokens"], reference["model.embed_tokens"]
    )  # [positions, 32]
    generated = tracedump.open_dump(dumps["generate"]).run().sequence(0)
    assert generated["model.embed_tokens"].shape == (14, 32)  # the prefill's 11 rows, then 3 decode steps
    with pytest.raises(KeyError, match="no sequence 9"):
        run.sequence(9)


def _dump_steps(out: Path, steps: list[dict[str, object]], rows: list[int]) -> Path:
    model = torch.nn.Linear(4, 4)
    dumper = tracedump.attach(model, {"dir": str(out)})
    assert dumper is not None
    for batch, count in zip(steps, rows, strict=True):
        with dumper.step():
            dumper.set_batch(**batch)  # type: ignore[arg-type]
            model(torch.ones(count, 4))
    dumper.close()
    return out


def test_a_position_held_twice_in_one_step_is_refused_naming_pass_and_sequence(tmp_path: Path) -> None:
    steps = [{"seq_ids": [7, 7], "positions": [0, 1]}, {"seq_ids": [7, 7], "positions": [2, 2]}]
    bad = _dump_steps(tmp_path / "a", steps, [2, 2])
    good = _dump_steps(tmp_path / "b", [{"seq_ids": [7, 7, 7]}], [3])
    with pytest.raises(UsageError, match=r"pass 1: sequence 7 holds position 2 again"):
        compare(bad, good, align="tokens")
    assert tracedump.cli.main(["diff", str(bad), str(good), "--align", "tokens"]) == 2


def test_metadata_whose_rows_disagree_with_the_tensors_is_refused(tmp_path: Path) -> None:
    bad = _dump_steps(tmp_path / "a", [{"seq_ids": [1, 1, 2]}], [4])
    good = _dump_steps(tmp_path / "b", [{"seq_ids": [1, 1, 1, 1]}], [4])
    with pytest.raises(UsageError, match=r"pass 0: set_batch\(\) declared 3 rows .* hold 4"):
        compare(bad, good, align="tokens")


def test_sequences_on_one_side_only_are_reported(tmp_path: Path) -> None:
    a = _dump_steps(tmp_path / "a", [{"seq_ids": [1, 1, 2, 2]}], [4])
    b = _dump_steps(tmp_path / "b", [{"seq_ids": [1, 1, 3]}], [3])
    report = compare(a, b, align="tokens")
    alignment = report.alignment[0]  # type: ignore[index]
    assert (
        alignment["matched_by"] == "seq id"
        and alignment["only_in_a"] == [2]
        and alignment["only_in_b"] == [3]
    )
    assert any("only in A: 2" in line for line in report.alignment_lines)


def test_a_pair_with_no_common_position_is_said(tmp_path: Path) -> None:
    a = _dump_steps(tmp_path / "a", [{"seq_ids": [1, 1], "positions": [4, 5]}, {"seq_ids": [2, 2]}], [2, 2])
    b = _dump_steps(tmp_path / "b", [{"seq_ids": [1, 1]}, {"seq_ids": [2, 2]}], [2, 2])
    report = compare(a, b, align="tokens")
    assert any(
        "sequence 1 (B: 1) shares no position: A holds 4-5, B holds 0-1" in line
        for line in report.alignment_lines
    )


def test_set_batch_checks_its_rows_at_the_call(tmp_path: Path) -> None:
    dumper = tracedump.attach(torch.nn.Linear(2, 2), {"dir": str(tmp_path)})
    assert dumper is not None
    with pytest.raises(ValueError, match="2 positions for 3 seq_ids"):
        dumper.set_batch(seq_ids=[0, 0, 1], positions=[0, 1])
    dumper.close()


def test_stats_dumps_cannot_be_aligned(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 4)
    dumper = tracedump.attach(model, {"dir": str(tmp_path / "s"), "mode": "stats"})
    assert dumper is not None
    model(torch.ones(2, 4))
    dumper.close()
    with pytest.raises(UsageError, match="needs full dumps"):
        compare(tmp_path / "s", tmp_path / "s", align="tokens")


def test_the_batching_demo_names_the_decode_bug(tmp_path: Path) -> None:
    import subprocess

    script = Path(__file__).resolve().parents[1] / "examples" / "demo_batching.py"
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "position 11 (its first decoded token), step 3, model.layers.1.self_attn.o_proj" in done.stdout
    assert (tmp_path / "demo_out" / "batching" / "report.json").is_file()


@pytest.mark.parametrize("shape", [(40, 64), (40, 3, 64), (40,)])
def test_a_sequences_rows_are_measured_per_token_in_the_metrics_pass(shape: tuple[int, ...]) -> None:
    """Gathered rows (tokens along dim 0) get the per-token figures a separate pass gives: the
    executor measures them with ``compare_by_row``, then ``per_token_of`` from its row sums."""
    from tracedump.compare.load.reader import stored_from_torch
    from tracedump.compare.measure.metrics import (
        compare_arrays,
        compare_by_row,
        per_token_of,
        per_token_rel_diff,
    )

    def _measure_rows(rows_a, rows_b, tokens):  # type: ignore[no-untyped-def]
        metrics, sums = compare_by_row(rows_a, rows_b)
        return metrics, per_token_of(rows_a, rows_b, metrics, 0, sums)

    generator = torch.Generator().manual_seed(3)
    a = torch.randn(shape, generator=generator)
    b = a.clone()
    b[30:] += 1e-2 * torch.randn(b[30:].shape, generator=generator)  # tokens 30 on diverge
    rows_a, rows_b = stored_from_torch(a), stored_from_torch(b)
    metrics, per_token = _measure_rows(rows_a, rows_b, shape[0])
    assert metrics.rel_diff == pytest.approx(compare_arrays(rows_a, rows_b).rel_diff, rel=1e-5)
    assert per_token == pytest.approx(per_token_rel_diff(rows_a, rows_b, 0), rel=1e-5)
    assert all(v == 0 for v in per_token[:30]) and all(v > 0 for v in per_token[30:])
    assert _measure_rows(rows_a, rows_a, shape[0])[1] == (0.0,) * shape[0]
