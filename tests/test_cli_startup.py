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
heavy = sorted(m for m in ("torch", "safetensors.torch", "tracedump.dumper") if m in sys.modules)
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
