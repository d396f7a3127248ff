"""A decode-only bug in a continuous-batching engine, found with ``tracedump diff --align tokens``.

Dumps ``examples/batching.py`` (three requests, chunked prefill, decode steps shared between
requests) with the bug planted in layer 1 (a decode token's key rotated for the next position),
dumps the batch-1 HF reference (one forward over each request's full sequence), and compares them
sequence by sequence. The first divergence must be layer 1 at the first decoded position of a
request: every prefill row is right. Files go to ``demo_out/batching/``; exit 0 when the bug is
named, 1 otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BUG_LAYER = 1


def _run(argv: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    merged = {k: v for k, v in os.environ.items() if not k.upper().startswith("TRACEDUMP_")}
    return subprocess.run(argv, env={**merged, **env}, capture_output=True, text=True, timeout=300)


def main() -> int:
    out = Path("demo_out/batching")
    shutil.rmtree(out, ignore_errors=True)
    dump = {"TRACEDUMP_DUMP_MODULES": "all"}
    script = str(HERE / "batching.py")
    engine = _run(
        [sys.executable, script, "--bug-layer", str(BUG_LAYER)],
        TRACEDUMP_DUMP_DIR=str(out / "engine"),
        **dump,
    )
    reference = _run(
        [sys.executable, script, "--reference"], TRACEDUMP_DUMP_DIR=str(out / "reference"), **dump
    )
    for job in (engine, reference):
        if job.returncode != 0:
            print(job.stdout + job.stderr)
            return 1
    print(f"engine (bug in layer {BUG_LAYER}, decode only):\n{engine.stdout}")
    listing = _run([sys.executable, "-m", "tracedump", "ls", str(out / "engine")])
    print(listing.stdout)
    report = out / "report.json"
    argv = ["diff", str(out / "engine"), str(out / "reference"), "--align", "tokens", "--max-rows", "12"]
    diff = _run([sys.executable, "-m", "tracedump", *argv, "--json", str(report)])
    print(f"$ tracedump {' '.join(argv)}\n{diff.stdout}")
    first = json.loads(report.read_text())["summary"]["alignment"][0]["first"]
    if diff.returncode != 1 or first is None or f".layers.{BUG_LAYER}." not in first["name"]:
        print(f"DEMO FAILED: exit {diff.returncode}, first divergence {first}")
        return 1
    print(
        f"Found: {first['sequence']}, position {first['position']} (its first decoded token), "
        f"step {first['step']}, {first['name']}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
