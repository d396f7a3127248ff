"""``tracedump --help``, ``ls`` and ``show`` start without importing torch (most of a 2 s start-up);
``--help`` and ``ls`` without numpy or the comparator either."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tracedump

# Runs the CLI as the console script does, then fails if torch (or anything below it) was imported;
# with PROBE_LIGHT set, also numpy or a module of the comparator (its argparse front aside).
_PROBE = """
import os, sys
from tracedump.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:
    code = e.code
heavy = sorted(m for m in ("torch", "safetensors.torch", "tracedump.dump.dumper") if m in sys.modules)
if os.environ.get("PROBE_LIGHT"):
    heavy += sorted(
        m for m in sys.modules
        if m == "numpy" or m.startswith("tracedump.compare.") and m != "tracedump.compare.command"
    )
assert not heavy, f"imported {heavy}"
sys.exit(code)
"""


@pytest.fixture(scope="module")
def bf16_dump(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("dump")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()).to(torch.bfloat16)
    dumper = tracedump.attach(model, {"dir": str(base)})
    with torch.no_grad():
        model(torch.linspace(-1, 1, 12, dtype=torch.bfloat16).reshape(3, 4))
    dumper.close()
    return base


@pytest.mark.parametrize(
    "command", [["--help"], ["ls", "{dump}"], ["show", "{pass}"], ["show", "{pass}", "--filter", "1"]]
)
def test_help_ls_and_show_never_import_torch(bf16_dump: Path, command: list[str]) -> None:
    (run_dir,) = bf16_dump.iterdir()
    argv = [a.format(dump=bf16_dump, **{"pass": run_dir / "pass00000.safetensors"}) for a in command]

    light = {"PROBE_LIGHT": "1"} if command[0] in ("--help", "ls") else {}
    result = subprocess.run(
        [sys.executable, "-c", _PROBE, *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **light},
    )

    assert result.returncode == 0, result.stderr[-2000:]
    assert "usage" in result.stdout or "rank0" in result.stdout or "bfloat16" in result.stdout


def test_show_widens_bf16_from_its_bits_to_the_values_torch_reads(bf16_dump: Path) -> None:
    (run_dir,) = bf16_dump.iterdir()
    path = run_dir / "pass00000.safetensors"

    result = subprocess.run([sys.executable, "-c", _PROBE, "show", str(path)], capture_output=True, text=True)

    relu = tracedump.load_pass(path)["1"].double()
    row = next(line for line in result.stdout.splitlines() if line.startswith("│ 1 "))
    expected = [f"{v:.4g}" for v in (relu.min(), relu.max(), relu.mean(), relu.abs().mean())]
    assert [cell.strip() for cell in row.split("│")[4:8]] == expected


@pytest.fixture(scope="module")
def diff_pair(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Full bf16 and stats dumps of a reference and of a port whose last layer is 1.5x too large."""
    base = tmp_path_factory.mktemp("pair")
    out = {}
    for mode in ("full", "stats"):
        for side, scale in (("port", 1.5), ("ref", 1.0)):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32))
            model = model.to(torch.bfloat16)
            with torch.no_grad():
                model[2].weight.mul_(scale)
            dumper = tracedump.attach(model, {"dir": str(base / mode / side), "mode": mode})
            with torch.no_grad():
                model(torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1)).bfloat16())
            dumper.close()
            out[f"{mode}/{side}"] = base / mode / side
    return out


@pytest.mark.parametrize("mode", ["full", "stats"])
def test_diff_of_pass_files_never_imports_torch(diff_pair: dict[str, Path], mode: str) -> None:
    """`tracedump diff` reads pass files with numpy (bf16 widened from its bits): torch, most of its
    start-up, is imported only for fp8, .pt inputs and a full side against a stats side."""
    port, ref = diff_pair[f"{mode}/port"], diff_pair[f"{mode}/ref"]
    argv = ["diff", str(port), str(ref), "--json", "-"]

    result = subprocess.run(
        [sys.executable, "-c", _PROBE, *argv], capture_output=True, text=True, timeout=120
    )

    assert result.returncode == 1, result.stderr[-2000:]  # the planted layer, found without torch
    assert '"first_divergence"' in result.stdout and '"2"' in result.stdout
    same = subprocess.run(
        [sys.executable, "-c", _PROBE, "diff", str(ref), str(ref)], capture_output=True, text=True
    )
    assert same.returncode == 0, same.stderr[-2000:]
