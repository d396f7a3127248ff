"""``tracedump ls`` is linear in a pass's sequences: it summarises a pass of many sequences by
default, and lists every one with ``--sequences``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tracedump
from tracedump.cli import main
from tracedump.store.sequences import Batch


class _CountedRows(tuple):
    """A tuple that counts the walks over it: the operation count a quadratic summary multiplies."""

    walks = 0

    def __iter__(self):  # type: ignore[no-untyped-def]
        type(self).walks += 1
        return super().__iter__()


@pytest.mark.parametrize("sequences", [256, 1024])
def test_a_pass_summary_walks_its_rows_a_fixed_number_of_times(sequences: int) -> None:
    _CountedRows.walks = 0
    batch = Batch(
        pass_index=0,
        seq_ids=_CountedRows(range(sequences)),
        positions=tuple(range(sequences)),
        input_ids=None,
        declared=True,
    )

    full, short = batch.summary(), batch.summary(listed=8)

    assert _CountedRows.walks <= 6  # a few walks in all, not one per sequence
    assert full.count(": ") == sequences and full.startswith("0: 0, 1: 1, ")
    counted = f"{sequences} sequences, {sequences} rows, positions 0-{sequences - 1}"
    assert short.startswith(f"{counted}; first: 0: 0,")


def test_spans_give_each_sequence_its_lowest_and_highest_position() -> None:
    batch = Batch(
        pass_index=3,
        seq_ids=("a", "b", "a", None, "a"),
        positions=(4, 0, 2, -1, 3),
        input_ids=None,
        declared=True,
    )
    assert batch.spans() == {"a": (2, 4, 3), "b": (0, 0, 1)}
    assert batch.summary() == "a: 2-4, b: 0, 1 padding rows"


@pytest.fixture(scope="module")
def engine_dump(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """25 engine steps of 512 one-row sequences each (a decode step of a large batch)."""
    base = tmp_path_factory.mktemp("ls")
    model = torch.nn.Linear(4, 4)
    dumper = tracedump.attach(model, {"dir": str(base)})
    assert dumper is not None
    with torch.no_grad():
        for step in range(25):
            with dumper.step():
                dumper.set_batch([f"r{i}" for i in range(512)], positions=[step] * 512)
                model(torch.ones(512, 4))
    dumper.close()
    return base


def test_ls_summarises_by_default_and_lists_everything_with_sequences(
    engine_dump: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["ls", str(engine_dump)]) == 0
    short = capsys.readouterr().out
    assert main(["ls", str(engine_dump), "--sequences"]) == 0
    full = capsys.readouterr().out

    assert "pass 0: 512 sequences, 512 rows, positions 0-0; first: r0: 0, r1: 0," in short
    assert "... 5 more passes (`tracedump ls --sequences` lists every one)" in short
    assert "pass 24:" not in short and len(short) < 10_000
    assert "pass 24: r0: 24, r1: 24," in full and "r511:" in full
    assert sum(line.startswith("  pass ") for line in full.splitlines()) == 25
