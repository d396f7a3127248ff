"""``diff --align tokens`` on two >= 1 GB dumps: time against a raw read, memory against one sequence.

A (the batching engine): every pass holds rows of four sequences, ``[tokens, hidden]`` fp32 with
``tracedump.batch`` metadata, positions continuing over the passes. B (the reference): one pass per
sequence, ``[1, seq, hidden]``. Each sequence's rows are spread over every pass of A, so aligning
gathers rows from all of A's passes for every tensor. Measured, in one run:

- **raw read**: every file of both dumps read end to end into a reused buffer;
- **align**: ``compare(A, B, align="tokens")`` (gather, compare, per-token error, verdicts);
- **memory**: peak anonymous memory (``RssAnon``, sampled every 5 ms) during one more, untimed
  align, less this process's own before it (``make bench`` runs every benchmark in one process: its
  model and the other benchmarks' leftovers are not the align's), over the largest tensor of one
  sequence: what aligning holds beyond the memory-mapped files.

Run alone: ``python benchmarks/bench_align.py [--quick]`` prints the JSON; temp files are deleted.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import common
from benchmarks.bench_diff import _AnonPeak, _raw_read

GiB = 1 << 30
SEQUENCES = 4


def _manifest(run_dir: Path) -> None:
    manifest = {"rank": 0, "pid": 1, "root": "Bench", "settings": {"mode": "full", "token_dim": 0}}
    (run_dir / "manifest.json").write_text(json.dumps({**manifest, "complete": True}))


def _values(seq: int, k: int, positions: range, hidden: int) -> torch.Tensor:
    """Rows of sequence ``seq`` for tensor ``k``: a function of (seq, k, position), so both sides
    hold the same values wherever they store them."""
    base = torch.arange(hidden, dtype=torch.float32)[None, :]
    pos = torch.tensor(list(positions), dtype=torch.float32)[:, None]
    return torch.sin(base * 0.001 * (k + 1) + pos * 0.01 + seq)


def _write(root: Path, passes: int, tensors: int, rows: int, hidden: int) -> tuple[int, int]:
    from tracedump.dump.writer import save_tensors_atomic
    from tracedump.store.format import BATCH_KEY, MODE_KEY, pass_file_name

    engine, reference = root / "a" / "rank0_pid1", root / "b" / "rank0_pid1"
    engine.mkdir(parents=True)
    reference.mkdir(parents=True)
    written_a = written_b = 0
    for index in range(passes):
        span = range(index * rows, (index + 1) * rows)
        data = {
            f"model.layers.{k}.out": torch.cat([_values(s, k, span, hidden) for s in range(SEQUENCES)])
            for k in range(tensors)
        }
        batch = {"seq_ids": [s for s in range(SEQUENCES) for _ in span], "positions": list(span) * SEQUENCES}
        meta = {MODE_KEY: "full", BATCH_KEY: json.dumps(batch)}
        written_a += save_tensors_atomic(engine / pass_file_name(index), data, meta)
    for seq in range(SEQUENCES):
        span = range(passes * rows)
        # another kernel's rounding: no pair is bit-identical, so per-token errors are measured too
        data = {
            f"model.layers.{k}.out": _values(seq, k, span, hidden).mul_(1 + 1e-7)[None]
            for k in range(tensors)
        }
        batch = {"seq_ids": [seq] * len(span)}
        meta = {MODE_KEY: "full", BATCH_KEY: json.dumps(batch)}
        written_b += save_tensors_atomic(reference / pass_file_name(seq), data, meta)
    _manifest(engine)
    _manifest(reference)
    return written_a, written_b


def run(quick: bool = False, rounds: int | None = None) -> dict[str, Any]:
    from tracedump.compare import compare

    passes, tensors, hidden = (4, 4, 1024) if quick else (8, 4, 4096)
    per_dump = (64 << 20) if quick else (GiB + (64 << 20))
    rows = per_dump // (passes * tensors * SEQUENCES * hidden * 4)
    rounds = rounds or (1 if quick else 3)
    with common.scratch_dir("tracedump-bench-align-") as scratch:
        bytes_a, bytes_b = _write(scratch, passes, tensors, rows, hidden)
        files = sorted(scratch.rglob("*.safetensors"))
        buffer = bytearray(1 << 20)
        _raw_read(files, buffer)  # warm the page cache
        raw, align = [], []
        report = None
        for _ in range(rounds):
            raw.append(_raw_read(files, buffer))
            start = time.perf_counter()
            report = compare(scratch / "a", scratch / "b", align="tokens")
            align.append(time.perf_counter() - start)
        baseline = common.proc_status_kib("RssAnon") or 0  # this process before the measured align
        with _AnonPeak() as peak:
            compare(scratch / "a", scratch / "b", align="tokens")
        held = max(peak.peak_kib - baseline, 0) * 1024
    assert report is not None
    sequence_tensor = passes * rows * hidden * 4
    raw_s, align_s = common.median(raw), common.median(align)
    return {
        "dump_bytes": {"a": bytes_a, "b": bytes_b},
        "sequences": SEQUENCES,
        "passes_a": passes,
        "rows_per_sequence_per_pass": rows,
        "largest_sequence_tensor_bytes": sequence_tensor,
        "raw_read_s": raw_s,
        "align_s": align_s,
        "align_GBps": (bytes_a + bytes_b) / align_s / 1e9,
        "ratio_vs_raw_read": raw_s / align_s,
        "process_peak_anon_bytes": peak.peak_kib * 1024,
        "peak_anon_bytes": held,
        "peak_anon_over_sequence_tensor": held / sequence_tensor,
        "exit_code": report.exit_code,
        "compared": report.compared,
        "machine": common.machine_info(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="64 MiB dumps, one round (a smoke test)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(json.dumps(run(quick=args.quick), indent=2))


if __name__ == "__main__":
    main()
