"""Inputs first: aligned sequences fed different token ids are reported before
any numeric verdict, exit 1, and no module is named as the first divergence. Real HF models (tiny
random Llama), dumped with their token ids in the batch layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_llama

import tracedump
from tracedump.cli import main
from tracedump.compare import compare

PROMPTS = [[1, 5, 9, 23, 44], [1, 7, 3]]


def dump(
    model: torch.nn.Module, out: Path, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> Path:
    """One pass per prompt, each row's sequence, position and token id given by set_batch."""
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(out))
    dumper = tracedump.attach(model)
    assert dumper is not None
    with torch.no_grad():
        for seq, ids in enumerate(prompts):
            with dumper.step():
                dumper.set_batch(seq_ids=[seq] * len(ids), positions=list(range(len(ids))), input_ids=ids)
                model(torch.tensor([ids]))
    dumper.close()
    monkeypatch.delenv("TRACEDUMP_DUMP_DIR")
    return out


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return make_tiny_llama(layers=2)


@pytest.fixture
def reference(model: torch.nn.Module, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return dump(model, tmp_path / "reference", PROMPTS, monkeypatch)


def test_the_same_inputs_say_nothing_and_pass(
    model: torch.nn.Module, reference: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    same = dump(model, tmp_path / "same", PROMPTS, monkeypatch)
    report = compare(same, reference, align="tokens")
    assert report.inputs_differ == [] and report.exit_code == 0


@pytest.mark.parametrize("align", ["tokens", "passes"])
def test_a_different_first_token_is_reported_before_any_number(
    model: torch.nn.Module,
    reference: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    align: str,
) -> None:
    other = dump(model, tmp_path / "other", [PROMPTS[0], [2, 7, 3]], monkeypatch)  # another BOS
    report_path = tmp_path / "report.json"
    code = main(["diff", str(other), str(reference), "--align", align, "--json", str(report_path)])
    out = capsys.readouterr().out
    assert code == 1
    where = "pass 1, " if align == "passes" else ""
    line = f"inputs differ: {where}seq 1, position 0: token 2 vs 1"
    assert line in out
    assert out.startswith("compared ") and "reference tensors per step" in out.splitlines()[0]
    assert out.index(line) < out.index("tensors in ")  # before any verdict
    assert "first divergence: none named" in out
    report = json.loads(report_path.read_text())
    summary = report["summary"]
    assert summary["first_divergence"] is None
    assert summary["inputs_differ"][0]["position"] == 0
    assert summary["inputs_differ"][0].get("kind", "prompt") == "prompt"  # by sequence: told by the layout
    assert (summary["inputs_differ"][0]["a"], summary["inputs_differ"][0]["b"]) == (2, 1)
    diverged = [t["name"] for t in report["tensors"] if t["status"] == "diverged"]
    if align == "passes":
        # the premise: the numbers downstream do differ, so without inputs-first a module would be named
        assert out.index(line) < out.index("DIVERGED") < out.index("tensors in ")
        assert "model.embed_tokens" in diverged
    else:  # by sequence, nothing fed another token is compared: seq 1 differs at position 0
        assert not diverged and {t["sequence"] for t in report["tensors"]} == {"seq 0"}


def test_a_doubled_bos_is_found_at_the_position_it_shifts(
    model: torch.nn.Module, reference: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    doubled = dump(model, tmp_path / "doubled", [[1, *PROMPTS[0]], PROMPTS[1]], monkeypatch)
    report = compare(doubled, reference, align="tokens")
    assert report.exit_code == 1 and report.first_divergence is None
    finding = report.inputs_differ[0]
    assert (finding["sequence"], finding["position"], finding["a"], finding["b"]) == (0, 1, 1, 5)


def test_a_prompt_one_token_off_still_pairs_when_the_others_pair_by_tokens(
    model: torch.nn.Module, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # sequence ids the two sides do not share (an engine's request ids against 0, 1): paired by
    # tokens; the prompt that differs pairs by order among the rest, and the difference is reported
    a = dump(model, tmp_path / "a", [PROMPTS[0], [1, 7, 4]], monkeypatch)
    b_prompts = PROMPTS
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path / "b"))
    dumper = tracedump.attach(model)
    assert dumper is not None
    with torch.no_grad():
        for seq, ids in zip(("req-a", "req-b"), b_prompts, strict=True):
            with dumper.step():
                dumper.set_batch(seq_ids=[seq] * len(ids), input_ids=ids)
                model(torch.tensor([ids]))
    dumper.close()
    report = compare(a, tmp_path / "b", align="tokens")
    finding = report.inputs_differ[0]
    assert (finding["sequence"], finding["sequence_b"], finding["position"]) == (1, "req-b", 2)
    assert report.exit_code == 1 and report.first_divergence is None


def test_the_hf_layout_carries_the_token_ids_without_set_batch(
    model: torch.nn.Module, tmp_path: Path
) -> None:
    """HF's batch layout from its root forward's input_ids (no set_batch): a padded batch against
    the prompts run alone, the second prompt's last token changed."""

    def run(out: Path, batches: list[tuple[list[list[int]], list[list[int]] | None]]) -> Path:
        dumper = tracedump.attach(model, {"dir": str(out)})
        assert dumper is not None
        with torch.no_grad():
            for ids, mask in batches:
                kwargs = {"attention_mask": torch.tensor(mask)} if mask is not None else {}
                model(torch.tensor(ids), **kwargs)
        dumper.close()
        return out

    other = [1, 7, 4]
    padded = [[*PROMPTS[0]], [0, 0, *other]]  # left padding
    mask = [[1] * 5, [0, 0, 1, 1, 1]]
    batched = run(tmp_path / "batched", [(padded, mask)])
    alone = run(tmp_path / "alone", [([PROMPTS[0]], None), ([PROMPTS[1]], None)])
    report = compare(batched, alone, align="tokens")
    assert report.exit_code == 1 and report.first_divergence is None
    finding = report.inputs_differ[0]
    assert (finding["position"], finding["a"], finding["b"]) == (2, 4, 3)
    assert len(report.inputs_differ) == 1  # the first prompt agrees; padding is no input
