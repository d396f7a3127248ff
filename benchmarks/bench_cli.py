"""Start-up of the ``tracedump`` command: ``--help``, ``ls``, ``show`` and ``diff`` on a small dump.

Each command runs in a fresh interpreter (as a user runs it), interleaved round by round with two
references timed the same way: the bare interpreter (``python -c pass``, the floor) and
``import torch`` (what the commands used to pay for nothing). The figure per command is the best of
its rounds: another process can only add time to a start-up, never remove it. Each run also
reports whether the command imported torch, which ``--help``/``ls``/``show`` must not do.

Run alone: ``python benchmarks/bench_cli.py [--quick]`` prints the JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import common

TARGET_SECONDS = 0.3  # --help, ls, show
TORCH_FREE = ("help", "ls", "show")
# Runs a CLI command as the console script does and says on stderr whether torch was imported.
_PROBE = """
import sys
from tracedump.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:
    code = e.code
print("TORCH_IMPORTED" if "torch" in sys.modules else "TORCH_FREE", file=sys.stderr)
sys.exit(code)
"""


def _write_dump(root: Path) -> Path:
    """A two-pass bf16 + fp32 dump written by tracedump's own writer (no model needed)."""
    import torch

    from tracedump.dump.writer import save_tensors_atomic
    from tracedump.store.format import pass_file_name

    run_dir = root / "rank0_pid1"
    run_dir.mkdir(parents=True)
    generator = torch.Generator().manual_seed(0)
    for index in range(2):
        tensors = {
            f"model.layers.{layer}.{part}": torch.randn(1, 64, 256, generator=generator).to(dtype)
            for layer in range(4)
            for part, dtype in (("mlp", torch.bfloat16), ("attn", torch.float32))
        }
        save_tensors_atomic(run_dir / pass_file_name(index), tensors, {"tracedump.mode": "full"})
    manifest = {"rank": 0, "pid": 1, "root": "Bench", "settings": {"mode": "full"}, "complete": True}
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    return run_dir


def _timed_run(argv: list[str]) -> tuple[float, bool]:
    start = time.perf_counter()
    result = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    seconds = time.perf_counter() - start
    if result.returncode not in (0, 1):  # diff exits 1 on a divergence; anything else is a failure
        raise RuntimeError(f"{argv[3:]} exited {result.returncode}: {result.stderr[-500:]}")
    return seconds, "TORCH_IMPORTED" in result.stderr


def run(quick: bool = False, rounds: int | None = None) -> dict[str, Any]:
    """Time each command against the bare interpreter and ``import torch``, interleaved."""
    rounds = rounds or (2 if quick else 5)
    python = sys.executable
    with common.scratch_dir("tracedump-bench-cli-") as scratch:
        run_dir = _write_dump(scratch / "dump")
        first = str(run_dir / "pass00000.safetensors")
        commands = {
            "python": [python, "-c", "pass"],
            "import_torch": [python, "-c", "import torch"],
            "help": [python, "-c", _PROBE, "--help"],
            "ls": [python, "-c", _PROBE, "ls", str(run_dir.parent)],
            "show": [python, "-c", _PROBE, "show", first],
            "diff": [python, "-c", _PROBE, "diff", str(run_dir), str(run_dir)],
        }
        imported: dict[str, bool] = {}

        def variant(name: str) -> dict[str, float]:
            seconds, torch_imported = _timed_run(commands[name])
            imported[name] = imported.get(name, False) or torch_imported
            return {"s": seconds}

        samples = common.interleave({name: (lambda n=name: variant(n)) for name in commands}, rounds, 1)
    best = {name: min(values["s"]) for name, values in samples.items()}
    slowest_torch_free = max(best[name] for name in TORCH_FREE)
    return {
        **{f"{name}_s": seconds for name, seconds in best.items()},
        "seconds": best,
        "imports_torch": {
            name: imported[name] for name in commands if name not in ("python", "import_torch")
        },
        "slowest_torch_free_s": slowest_torch_free,
        "target_s": TARGET_SECONDS,
        "meets_target": slowest_torch_free <= TARGET_SECONDS
        and not any(imported[name] for name in TORCH_FREE),
        "rounds": rounds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two rounds (a smoke test)")
    args = parser.parse_args()
    print(json.dumps(run(quick=args.quick), indent=2))


if __name__ == "__main__":
    main()
