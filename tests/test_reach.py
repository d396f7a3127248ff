"""A clean verdict states its reach: the smallest relative error per layer it could have told from
the run's noise (compare/judge/verdict.py ``reach``), and the rerun that would see more where that is
above a few percent (the summary lines and the JSON's ``summary.reach``).

The calibration family ``llama`` (tiny, random weights, seeded) dumped in fp32 and bf16: bf16
against fp32 allows a bf16 rounding per op, fp32 against fp32 an fp32 one."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.calibrate import FAMILIES, dump_variant
from tests.conftest import seeded_build
from tracedump.compare import compare
from tracedump.compare.judge.verdict import REACH_WARN


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    family = FAMILIES["llama"]()
    family.build = seeded_build(family.build)
    root = tmp_path_factory.mktemp("reach")
    return {v: dump_variant(copy.copy(family), v, root / v) for v in ("fp32", "bf16")}


def test_fp32_against_fp32_reaches_far_below_a_percent(dumps: dict[str, Path]) -> None:
    report = compare(dumps["fp32"], dumps["fp32"])
    assert report.exit_code == 0
    reach = report.findings.reach if report.findings else None
    assert reach is not None and reach.rerun is None
    assert reach.worst.relative < 1e-3  # a few fp32 roundings: any bug above 0.1% is seen
    assert any(x.layer.endswith(".layers.0") for x in reach.layers)


def test_bf16_against_fp32_says_what_it_could_miss_and_the_rerun(
    dumps: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "report.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tracedump",
            "diff",
            str(dumps["bf16"]),
            str(dumps["fp32"]),
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={"COLUMNS": "250", "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stdout[-2000:]
    reach = json.loads(out.read_text())["summary"]["reach"]
    layers = {x["layer"]: x for x in reach["layers"]}
    assert reach["worst"] == max(x["relative"] for x in reach["layers"]) > 1e-3  # bf16: coarser
    if reach["worst"] > REACH_WARN:  # the premise of the suggestion: a layer misses a few percent
        assert "--baseline" in reach["rerun"] and "--baseline" in done.stdout
        assert "could have passed unseen in" in done.stdout
    else:
        assert reach["rerun"] is None
    assert "reach: a relative error above" in done.stdout
    assert all(x["tensor"] and x["basis"] for x in layers.values())
