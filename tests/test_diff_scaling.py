"""A diff's work grows with the passes, not with their square.

Counted, not timed: how often each side's batch layouts are read, and how often the executor
walks the whole plan. Both were once per pass (500 / 2000 one-tensor passes took 4 / 74 s on the
development VM; after: 0.9 / 1.2 s, 8000 passes 3.9 s, docs/comparator.md "Scale").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_compare_unshard import write_run

from tracedump.compare import compare
from tracedump.compare.measure import execute as execute_module
from tracedump.store.loader import Run


def _passes(tmp_path: Path, count: int) -> tuple[Path, Path]:
    values = {"x": torch.ones(2, 3)}
    a, b = tmp_path / f"a{count}", tmp_path / f"b{count}"
    write_run(a, 0, dict.fromkeys(range(count), values))
    write_run(b, 0, dict.fromkeys(range(count), values))
    return a, b


class _CountedPairs(tuple):  # type: ignore[type-arg]
    """A plan's pairs that count the walks over them."""

    walks = 0

    def __iter__(self) -> Any:
        _CountedPairs.walks += 1
        return super().__iter__()


@pytest.mark.parametrize("count", [5, 40])
def test_each_side_s_batch_layouts_are_read_once_whatever_the_passes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, count: int
) -> None:
    reads: list[Path] = []
    original = Run.batches

    def counted(self: Run) -> Any:
        reads.append(self.path)
        return original(self)

    monkeypatch.setattr(Run, "batches", counted)
    report = compare(*_passes(tmp_path, count))
    assert len(report.plan.units) == count and report.exit_code == 0
    assert len(reads) == 2, f"{len(reads)} reads of the batch layouts for {count} passes"


@pytest.mark.parametrize("count", [5, 40])
def test_the_executor_walks_the_plan_a_fixed_number_of_times(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, count: int
) -> None:
    original = execute_module.Executor.__init__

    def counted_init(self: Any, plan: Any, *args: Any, **kwargs: Any) -> None:
        from dataclasses import replace

        original(self, replace(plan, pairs=_CountedPairs(plan.pairs)), *args, **kwargs)

    monkeypatch.setattr(execute_module.Executor, "__init__", counted_init)
    _CountedPairs.walks = 0
    report = compare(*_passes(tmp_path, count))
    assert len(report.results) == count
    assert _CountedPairs.walks <= 3, f"{_CountedPairs.walks} walks over the plan for {count} passes"
