"""Diff throughput on two >= 1 GB dumps vs. the raw read bandwidth of the same files, in one run.

Two dumps of fp32 tensors are written to a scratch dir: B carries 1e-7 relative noise everywhere
(no pair is bit-identical, as between two kernels) and A a 1e-3 bug in its last tensor, which the
diff must name. Then, interleaved round by round so that load from other processes hits both
alike:

- **raw read**: every pass file read end to end into a reused 1 MiB buffer (``readinto``): the
  fastest a program can get these bytes, whatever it then does with them;
- **diff**: ``tracedump.compare.compare(A, B)``, the pipeline behind ``tracedump diff`` (load,
  plan, read every tensor pair, all metrics, verdicts), in process so start-up is not counted.

The tensors are flat, as when the benchmark was written; the same bytes shaped as activations
(``[1, tokens, hidden]``, which adds the per-token error to every tensor's work) are measured
too, under ``activations``, without a target.

Both read the same page-cache-resident files (written, synced, then read once to warm up), so the
ratio compares the comparator's work with a read, not one disk state with another. Targets: ratio
>= 0.8, and peak anonymous memory <= 4x the largest tensor, measured in one more, untimed diff
(``RssAnon`` sampled every 5 ms): memory-mapped file pages are page cache, not the diff's own.

Run alone: ``python benchmarks/bench_diff.py [--quick]`` prints the JSON; temp files are deleted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import common

TARGET_RATIO = 0.8  # the diff reads at least this share of a raw read's bandwidth
MEMORY_TARGET = 4.0  # "a few times the largest tensor, not the dump"
GiB = 1 << 30


def _write_dump(
    root: Path, passes: int, tensors: int, numel: int, under_test: bool, shape: tuple[int, ...] | None = None
) -> int:
    """One run dir of fp32 pass files, generated tensor by tensor from seeds shared by both sides.

    The reference carries 1e-7 relative noise everywhere (another kernel order: rel_diff ~1e-14,
    within tolerance) so no tensor pair is bit-identical; the run under test has a 1e-3 bug in the
    last tensor of the last pass, the divergence the diff must find.
    """
    from tracedump.dump.writer import save_tensors_atomic
    from tracedump.store.format import pass_file_name

    run_dir = root / "rank0_pid1"
    run_dir.mkdir(parents=True)
    total = 0
    for index in range(passes):
        data = {}
        for k in range(tensors):
            tensor = torch.randn(numel, generator=torch.Generator().manual_seed(index * tensors + k))
            bug = under_test and index == passes - 1 and k == tensors - 1
            scale = 1e-3 if bug else 0.0 if under_test else 1e-7
            if scale:
                noise = torch.randn(
                    numel, generator=torch.Generator().manual_seed(10_000 + index * tensors + k)
                )
                tensor.mul_(noise.mul_(scale).add_(1))
            data[f"model.layers.{index}.t{k}"] = tensor if shape is None else tensor.reshape(shape)
        total += save_tensors_atomic(run_dir / pass_file_name(index), data, {"tracedump.mode": "full"})
    manifest = {"rank": 0, "pid": 1, "root": "Bench", "settings": {"mode": "full"}, "complete": True}
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    return total


def _raw_read(paths: list[Path], buffer: bytearray) -> float:
    view = memoryview(buffer)
    start = time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as handle:
            while handle.readinto(view):
                pass
    return time.perf_counter() - start


class _AnonPeak:
    """Samples ``RssAnon`` in a thread: the memory the diff itself holds (not mapped page cache)."""

    def __init__(self) -> None:
        self.peak_kib = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.peak_kib = max(self.peak_kib, common.proc_status_kib("RssAnon") or 0)
            time.sleep(0.005)

    def __enter__(self) -> _AnonPeak:
        self.peak_kib = common.proc_status_kib("RssAnon") or 0
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@contextlib.contextmanager
def _numpy_path() -> Iterator[None]:
    """The comparator without its C kernel, as where the extension was not built."""
    from tracedump.compare.measure import metrics

    kernel, metrics.kernel = metrics.kernel, None
    try:
        yield
    finally:
        metrics.kernel = kernel


def _activations(
    scratch: Path, passes: int, tensors: int, numel: int, rounds: int, buffer: bytearray
) -> dict[str, Any]:
    """The same bytes shaped as activations, ``[1, tokens, hidden]``: the diff then also measures
    every token's error (``per_token``), as it does on real dumps. Not a target; it shows what
    the per-token figures cost on top of the metrics."""
    from tracedump.compare import compare

    hidden = next((h for h in (2176, 2048, 1024) if numel % h == 0), numel)
    shape = (1, numel // hidden, hidden)
    total = _write_dump(scratch / "a3", passes, tensors, numel, under_test=True, shape=shape)
    total += _write_dump(scratch / "b3", passes, tensors, numel, under_test=False, shape=shape)
    paths = sorted((scratch / "a3").rglob("*.safetensors")) + sorted((scratch / "b3").rglob("*.safetensors"))
    os.sync()
    _raw_read(paths, buffer)
    raw_seconds, diff_seconds = [], []
    for _ in range(rounds):
        raw_seconds.append(_raw_read(paths, buffer))
        start = time.perf_counter()
        report = compare(scratch / "a3", scratch / "b3")
        diff_seconds.append(time.perf_counter() - start)
    first = report.first_divergence
    return {
        "shape": list(shape),
        "raw_read_GBps": total / common.median(raw_seconds) / 1e9,
        "diff_GBps": total / common.median(diff_seconds) / 1e9,
        "ratio": common.median(raw_seconds) / common.median(diff_seconds),
        "first_divergence": _first_name(report),
        "per_token": first is not None and first.per_token is not None,
    }


def run(quick: bool = False, rounds: int | None = None) -> dict[str, Any]:
    """Write the dumps, measure both sides interleaved, delete everything; return the figures."""
    from tracedump.compare import compare

    per_dump = (64 << 20) if quick else (GiB + (64 << 20))  # strictly more than 1 GiB per dump
    passes, tensors = (2, 4) if quick else (8, 4)
    numel = per_dump // (passes * tensors * 4)
    rounds = rounds or (1 if quick else 5)
    with common.scratch_dir("tracedump-bench-diff-") as scratch:
        bytes_a = _write_dump(scratch / "a", passes, tensors, numel, under_test=True)
        bytes_b = _write_dump(scratch / "b", passes, tensors, numel, under_test=False)
        paths = [
            *sorted((scratch / "a").rglob("*.safetensors")),
            *sorted((scratch / "b").rglob("*.safetensors")),
        ]
        os.sync()  # no writeback competing with either side for the CPU
        buffer = bytearray(1 << 20)  # cache-sized: the fastest plain read (16 MiB buffers are slower)
        _raw_read(paths, buffer)  # warm-up: both sides start from the same page-cache state
        raw_seconds, diff_seconds, numpy_seconds = [], [], []
        baseline = common.proc_status_kib("RssAnon") or 0  # before any diff: its buffers count too
        for _ in range(rounds):
            raw_seconds.append(_raw_read(paths, buffer))
            start = time.perf_counter()
            report = compare(scratch / "a", scratch / "b")
            diff_seconds.append(time.perf_counter() - start)
            with _numpy_path():
                start = time.perf_counter()
                numpy_report = compare(scratch / "a", scratch / "b")
                numpy_seconds.append(time.perf_counter() - start)
        with _AnonPeak() as peak:  # a separate run: the sampling thread must not slow the timed ones
            report = compare(scratch / "a", scratch / "b")
        anon_peak = max(peak.peak_kib - baseline, 0) * 1024
        activations = _activations(scratch, passes, tensors, numel, rounds, buffer)
    total = bytes_a + bytes_b
    raw_bw = total / common.median(raw_seconds)
    diff_bw = total / common.median(diff_seconds)
    largest_tensor = numel * 4
    ratio = diff_bw / raw_bw
    memory_ratio = anon_peak / largest_tensor
    targets = {
        "throughput": {
            "target": f">= {TARGET_RATIO}",
            "measured": ratio,
            "met": ratio >= TARGET_RATIO,
            "what": "diff throughput / raw read bandwidth of the same files",
        },
        "memory": {
            "target": f"<= {MEMORY_TARGET}",
            "measured": memory_ratio,
            "met": memory_ratio <= MEMORY_TARGET,
            "what": "diff peak anonymous memory / largest tensor",
        },
    }
    return {
        "dump_bytes": [bytes_a, bytes_b],
        "tensors_per_dump": passes * tensors,
        "largest_tensor_bytes": largest_tensor,
        "rounds": rounds,
        "raw_read_GBps": raw_bw / 1e9,
        "diff_GBps": diff_bw / 1e9,
        "ratio": ratio,
        "kernel": _kernel_built(),
        "numpy_path_ratio": common.median(raw_seconds) / common.median(numpy_seconds),
        "numpy_path_first_divergence": _first_name(numpy_report),
        "target_ratio": TARGET_RATIO,
        "meets_target": ratio >= TARGET_RATIO,
        "diff_peak_anon_bytes": anon_peak,
        "diff_peak_anon_over_largest_tensor": memory_ratio,
        "targets": targets,
        "activations": activations,
        "activations_ratio": activations["ratio"],
        "first_divergence": _first_name(report),
        "exit_code": report.exit_code,
        "machine": common.machine_info(),
    }


def _first_name(report: Any) -> str | None:
    first = report.first_divergence
    return first.name if first else None


def _kernel_built() -> bool:
    from tracedump.compare.measure import metrics

    return metrics.kernel is not None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="64 MiB dumps, one round (a smoke test)")
    args = parser.parse_args()
    print(json.dumps(run(quick=args.quick), indent=2))


if __name__ == "__main__":
    main()
