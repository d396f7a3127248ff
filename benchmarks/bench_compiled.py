"""What ``COMPILED=1`` costs a ``torch.compile``d model (inductor, CPU), beside what a full eager
dump costs the eager model.

Four steps on identical weights (medians of per-round ratios): the eager model untouched and with
a full eager dump, interleaved round by round; the compiled model untouched, then with a full
``COMPILED=1`` dump (one after the other, Dynamo reset between). Each dumped step waits for its
pass to be on disk (``flush``), so the writer's work is not hidden. Compile time (the first
call) is reported apart, once per compiled model. Beside them, each round: the dumped steps as the
host sees them (``*_host_ratio``: the flush not timed), and the compiled graph with its taps whose
target is gone (``compiled_taps_idle_ratio``: what the taps cost the graph itself).

Run alone: ``python benchmarks/bench_compiled.py [--quick]`` prints the JSON.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import tracedump

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import common

SPEC = common.ModelSpec(hidden=128, layers=2, intermediate=344, heads=4, vocab=2000, tokens=64)


def run(quick: bool = False) -> dict[str, Any]:
    """One torch thread for this section (restored after): with two on a loaded 2-core machine
    the eager model's spin-waiting threads took 130-260 ms for a 5 ms step, which said nothing."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {**_run(quick), "torch_threads": 1}
    finally:
        torch.set_num_threads(threads)


def _run(quick: bool) -> dict[str, Any]:
    rounds = 3 if quick else 10
    base = common.build_model(SPEC).eval()
    ids = common.make_inputs(SPEC)
    models = {name: copy.deepcopy(base) for name in ("eager", "eager_dump", "compiled", "compiled_dump")}
    with tempfile.TemporaryDirectory(prefix="td-bench-compiled-") as root:
        dumpers = {
            "eager_dump": tracedump.attach(models["eager_dump"], {"dir": f"{root}/eager"}),
            "compiled_dump": tracedump.attach(
                models["compiled_dump"], {"dir": f"{root}/compiled", "compiled": True}
            ),
        }
        torch._dynamo.utils.counters.clear()
        times: dict[str, list[float]] = {name: [] for name in models}
        compile_s: dict[str, float] = {}
        with torch.inference_mode():
            # Eager pair interleaved. The compiled pair runs one after the other, with Dynamo's
            # caches reset between: Dynamo would reuse one model's graph for its deep copy, hooks
            # or not (docs/compiled.md), so the two cannot be compiled side by side.
            host: dict[str, list[float]] = {"eager_dump": [], "compiled_dump": [], "compiled_taps_idle": []}
            for _ in range(rounds + 1):
                for name in ("eager", "eager_dump"):
                    times[name].append(_timed_step(models[name], dumpers.get(name), ids))
                host["eager_dump"].append(_host_step(models["eager_dump"], dumpers["eager_dump"], ids))
            for name in ("compiled", "compiled_dump"):
                torch._dynamo.reset()
                call = torch.compile(models[name])
                compile_s[name] = _timed_step(call, dumpers.get(name), ids)
                for _ in range(rounds + 1):
                    times[name].append(_timed_step(call, dumpers.get(name), ids))
                    if name == "compiled_dump":
                        host[name].append(_host_step(call, dumpers[name], ids))
                        target = dumpers[name].taps.target
                        target.unregister()  # the taps stay in the graph and return at once
                        host["compiled_taps_idle"].append(_timed_step(call, None, ids))
                        target.register()
        times = {name: values[1:] for name, values in times.items()}  # the first round warms up
        host = {name: values[1:] for name, values in host.items()}
        breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
        for dumper in dumpers.values():
            if dumper is not None:
                dumper.close()
    med = {name: common.median(values) for name, values in times.items()}
    ratios = {
        "eager_dump_ratio": _paired(times["eager_dump"], times["eager"]),
        "compiled_dump_ratio": _paired(times["compiled_dump"], times["compiled"]),
        "compiled_dump_vs_eager_dump": _paired(times["compiled_dump"], times["eager_dump"]),
        # The step as the host sees it (the writer left to work beside the next step), and the
        # compiled graph with its taps but the tap's target gone (the op is called and returns):
        # what the taps cost the graph itself (no fusion across a tapped output, the op's dispatch).
        "eager_dump_host_ratio": _paired(host["eager_dump"], times["eager"]),
        "compiled_dump_host_ratio": common.ratio(common.median(host["compiled_dump"]), med["compiled"]),
        "compiled_taps_idle_ratio": common.ratio(common.median(host["compiled_taps_idle"]), med["compiled"]),
    }
    return {
        "model": f"llama hidden={SPEC.hidden} layers={SPEC.layers} tokens={SPEC.tokens}",
        "rounds": rounds,
        "step_ms": {name: value * 1e3 for name, value in med.items()},
        "host_step_ms": {name: common.median(values) * 1e3 for name, values in host.items()},
        "compile_s": compile_s,
        "graph_breaks": breaks,
        **ratios,
    }


def _timed_step(call: Any, dumper: Any, ids: torch.Tensor) -> float:
    start = time.perf_counter()
    common.forward(call, ids)
    if dumper is not None:
        dumper.flush()
    return time.perf_counter() - start


def _host_step(call: Any, dumper: Any, ids: torch.Tensor) -> float:
    """The step as the host sees it: the flush after it is not timed."""
    start = time.perf_counter()
    common.forward(call, ids)
    elapsed = time.perf_counter() - start
    dumper.flush()
    return elapsed


def _paired(numerator: list[float], denominator: list[float]) -> float:
    return common.median([common.ratio(n, d) for n, d in zip(numerator, denominator, strict=True)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    print(json.dumps(run(quick=parser.parse_args().quick), indent=2))


if __name__ == "__main__":
    main()
