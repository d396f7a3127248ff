"""The report page is bounded in bytes, not only in rows.

100 names of 100 KB once made a 50 MB page (300: 139 MB); docs/comparator.md promises a few MB.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from test_compare_unshard import write_run

from tracedump.cli import main
from tracedump.compare import compare
from tracedump.compare.report.page import limits, render

LONG = 50_000  # characters of each name


def _long_names(base: Path, count: int = 40) -> tuple[Path, Path, list[str]]:
    """Two dumps of ``count`` tensors whose names are LONG characters each; every third differs."""
    names = [f"model.m{i}.<b>" + "x" * LONG for i in range(count)]
    for side, offset in (("a", 1.0), ("b", 0.0)):
        tensors = {n: torch.ones(2, 4) + offset * (i % 3 == 0) for i, n in enumerate(names)}
        write_run(base / side, 0, {0: tensors})
    return base / "a", base / "b", names


@pytest.fixture(scope="module")
def long_names(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[str]]:
    return _long_names(tmp_path_factory.mktemp("long"))


def test_long_names_are_cut_with_a_marker_and_the_page_stays_small(
    long_names: tuple[Path, Path, list[str]], tmp_path: Path
) -> None:
    a, b, names = long_names
    page, report = tmp_path / "r.html", tmp_path / "r.json"
    assert main(["diff", str(a), str(b), "--html", str(page), "--json", str(report)]) == 1
    text = page.read_text()
    total_name_bytes = len(names) * LONG
    assert total_name_bytes > 1 << 20  # the premise: the names alone are MBs, each shown several times
    assert page.stat().st_size < 1 << 20, page.stat().st_size
    cut = LONG + len(".<b>") + len("model.m0") - limits.MAX_TEXT
    assert f"… [{cut} more characters]" in text
    assert "x" * (limits.MAX_TEXT + 1) not in text
    assert "strings (names, messages, values) cut at 1000 characters" in text  # said at the top
    assert "<b>xxx" not in text and "&lt;b&gt;xxx" in text  # cut, then escaped: no tag, no torn entity
    doc = json.loads(report.read_text())
    assert {t["name"] for t in doc["tensors"]} == set(names)  # the JSON keeps every name whole


def test_a_page_over_the_byte_cap_is_drawn_again_with_tighter_limits(
    long_names: tuple[Path, Path, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b, _ = long_names
    report = compare(a, b)
    roomy = render(report)
    cap = len(roomy.encode()) // 3
    monkeypatch.setattr(limits, "MAX_PAGE_BYTES", cap)
    text = render(report)
    assert len(text.encode()) <= cap
    assert re.search(r"page size: drawn [23] times", text), "the first tighter limits, or the second"
    assert re.search(r"cut at (200|60) characters", text)
    assert "the summary alone" not in text and "id='table-section'" in text


def test_the_summary_alone_when_nothing_else_fits(
    long_names: tuple[Path, Path, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b, _ = long_names
    report = compare(a, b)
    monkeypatch.setattr(limits, "MAX_PAGE_BYTES", 1)  # nothing fits: the last drawing is kept
    text = render(report)
    assert "the summary alone" in text and "page size: drawn 4 times" in text
    assert "id='table-section'" not in text and "id='curve-section'" not in text
    assert len(text.encode()) < 100_000


def test_many_verdict_lines_are_bounded(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The terminal's lines grow with the notes and flips: the page shows MAX_LINES_SHOWN of them."""
    a, b, _ = _long_names(tmp_path, count=3)
    report = compare(a, b)
    report.notes.extend(f"note {i}" for i in range(50))
    monkeypatch.setattr(limits, "MAX_LINES_SHOWN", 10)
    text = render(report)
    assert "more lines" in text
