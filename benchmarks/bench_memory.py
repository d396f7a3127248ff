"""Peak RSS during a long full-dump run with a small ``MAX_PENDING_BYTES`` cap.

The run happens in a fresh child process so its high-water mark (``VmHWM``) is its own. The child
first measures the untouched model's peak (weights + one forward's activations), resets the
high-water mark, then dumps many passes with the cap set through the env var, as an operator would.
The check: peak during dumping <= untouched peak + cap + margin, where the margin is the largest
single captured tensor (back-pressure is checked after each capture is added, so a pass may hold one
tensor beyond the cap before it waits or spills) plus a fixed allowance for the allocator keeping
freed blocks, the writer thread's stack and safetensors' header buffers.

Run alone: ``python benchmarks/bench_memory.py [--quick]`` prints the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import common

SLACK_BYTES = 16 * common.MiB
REPO_ROOT = Path(__file__).resolve().parents[1]


def run(quick: bool = False, cap_bytes: int | None = None, passes: int | None = None) -> dict[str, Any]:
    """Start the child, return its measurements plus the verdict ``within_cap``."""
    cap = cap_bytes or (8 if quick else 64) * common.MiB
    passes = passes or (6 if quick else 20)
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith(common.ENV_PREFIX)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    with common.scratch_dir("tracedump-mem-") as scratch:
        env[common.ENV_PREFIX + "DIR"] = str(scratch)
        env[common.ENV_PREFIX + "MAX_PENDING_BYTES"] = str(cap)
        # glibc raises its mmap threshold to the size of each large block freed (up to 32 MiB), so
        # later blocks of that size come from the heap and stay in RSS after they are freed: from
        # run to run the same dump peaked 84-128 MB above the untouched model. A fixed threshold
        # returns every freed large block at once, in both phases, and the peak then measures what
        # is held (84.1-84.4 MB over six runs). The untouched peak is measured under it too.
        env["MALLOC_MMAP_THRESHOLD_"] = str(128 << 10)
        command = [sys.executable, "-m", "benchmarks.bench_memory", "--child", "--passes", str(passes)]
        if quick:
            command.append("--quick")
        done = subprocess.run(command, env=env, cwd=REPO_ROOT, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"memory benchmark child failed ({done.returncode}):\n{done.stderr[-4000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return _verdict(result, cap)


def _verdict(child: dict[str, Any], cap: int) -> dict[str, Any]:
    margin = child["largest_capture_bytes"] + SLACK_BYTES
    allowed = child["untouched_peak_bytes"] + cap + margin
    peak = child["dump_peak_bytes"]
    return {
        "peak_rss_MB": peak / 1e6,
        "untouched_peak_rss_MB": child["untouched_peak_bytes"] / 1e6,
        "rss_before_model_MB": child["rss_before_model_bytes"] / 1e6,
        "above_untouched_MB": (peak - child["untouched_peak_bytes"]) / 1e6,
        "cap_MB": cap / 1e6,
        "margin_MB": margin / 1e6,
        "allowed_MB": allowed / 1e6,
        "model_MB": child["model_bytes"] / 1e6,
        "pass_MB": child["pass_bytes"] / 1e6,
        "passes": child["passes"],
        "files": child["files"],
        "written_MB": child["written_bytes"] / 1e6,
        "seconds": child["seconds"],
        "within_cap": peak <= allowed,
        "hwm_reset": child["hwm_reset"],
    }


# ---------------------------------------------------------------------------------------------- child


class RssSampler:
    """Polls ``VmRSS`` every few ms: a fallback peak where ``VmHWM`` cannot be reset."""

    def __init__(self, interval_s: float = 0.005) -> None:
        self.peak_kib = 0
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rss-sampler", daemon=True)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            self.peak_kib = max(self.peak_kib, common.proc_status_kib("VmRSS") or 0)


def child(quick: bool, passes: int) -> dict[str, Any]:
    """Untouched peak first, then a long full dump under the cap taken from the env."""
    import tracedump

    torch.manual_seed(0)
    before_model = (common.proc_status_kib("VmRSS") or 0) * 1024
    spec = common.QUICK_SPEC if quick else common.FULL_SPEC
    model = common.build_model(spec)
    ids = common.make_inputs(spec)
    with torch.inference_mode():
        for _ in range(3):
            common.forward(model, ids)
        hwm_reset = common.reset_peak_rss()
        with RssSampler() as sampler:
            for _ in range(3):
                common.forward(model, ids)
        untouched_peak = _peak_bytes(hwm_reset, sampler)

        dumper = tracedump.attach(model)
        if dumper is None:
            raise RuntimeError("TRACEDUMP_DUMP_DIR was not passed to the child")
        hwm_reset = common.reset_peak_rss() and hwm_reset
        start = time.perf_counter()
        with RssSampler() as sampler:
            largest = _largest_capture(model, ids)
            for _ in range(passes - 1):
                common.forward(model, ids)
            dumper.close()
        seconds = time.perf_counter() - start
        dump_peak = _peak_bytes(hwm_reset, sampler)
    totals = dumper.rundir.writer.totals
    return {
        "rss_before_model_bytes": before_model,
        "untouched_peak_bytes": untouched_peak,
        "dump_peak_bytes": dump_peak,
        "largest_capture_bytes": largest,
        "model_bytes": common.model_bytes(model),
        "pass_bytes": totals.bytes / max(1, len(totals.passes)),
        "passes": len(totals.passes),
        "files": totals.files,
        "written_bytes": totals.bytes,
        "seconds": seconds,
        "hwm_reset": hwm_reset,
    }


def _largest_capture(model: torch.nn.Module, ids: torch.Tensor) -> int:
    """Run the first dumped forward with a probe hook noting the largest leaf output."""
    sizes: list[int] = []

    def probe(module: torch.nn.Module, args: Any, output: Any) -> None:
        for tensor in output if isinstance(output, (tuple, list)) else (output,):
            if isinstance(tensor, torch.Tensor):
                sizes.append(tensor.numel() * tensor.element_size())

    handles = [m.register_forward_hook(probe) for m in model.modules() if next(m.children(), None) is None]
    try:
        common.forward(model, ids)
    finally:
        for handle in handles:
            handle.remove()
    return max(sizes, default=0)


def _peak_bytes(hwm_reset: bool, sampler: RssSampler) -> int:
    """``VmHWM`` when it could be reset (exact), else the sampled ``VmRSS`` peak."""
    hwm = common.proc_status_kib("VmHWM") if hwm_reset else None
    return max(hwm or 0, sampler.peak_kib) * 1024


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, few passes: a smoke run")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--passes", type=int, default=None)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.quick, args.passes or 20)))
    else:
        print(json.dumps(run(quick=args.quick, passes=args.passes), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
