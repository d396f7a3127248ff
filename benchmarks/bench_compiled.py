"""What ``COMPILED=1`` costs a ``torch.compile``d model (inductor, CPU), beside what a full eager
dump costs the eager model.

Every figure on identical weights, interleaved round by round in one process (medians of
per-round ratios): the eager model untouched and with a full eager dump; the compiled model
untouched (the floor of every compiled figure), with a full ``COMPILED=1`` dump, an armable
server never armed (``CONTROL=1``) and a dump whose ``STEPS`` select none of these steps (both
run the tap-free graph: ``compiled_taps_idle_ratio``, ``compiled_unselected_ratio``); and the dumped model's
tapped graph with its target gone (``compiled_taps_noop_ratio``: the taps called, returning at
once). Each compiled copy is an instance of a class of its own, so Dynamo keeps their graphs
apart. Each dumped step waits for its pass to be on disk (``flush``), so the writer's work is not
hidden; ``*_host_ratio`` is the step as the host sees it (the flush not timed). Compile time (the
first call) is reported apart.

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


def _own_class(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` as an instance of a subclass of its own: Dynamo guards each compiled frame on the
    type of ``self``, so copies of one model compiled side by side keep their graphs apart (a deep
    copy of the same class may run another copy's graph: docs/compiled.md)."""
    model.__class__ = type(f"Bench{type(model).__name__}{id(model)}", (type(model),), {})
    return model


def _run(quick: bool) -> dict[str, Any]:
    rounds = 3 if quick else 10
    base = common.build_model(SPEC).eval()
    ids = common.make_inputs(SPEC)
    names = ("eager", "eager_dump", "compiled", "compiled_dump", "compiled_armable", "compiled_unselected")
    models = {name: _own_class(copy.deepcopy(base)) for name in names}
    with tempfile.TemporaryDirectory(prefix="td-bench-compiled-") as root:
        dumpers = {
            "eager_dump": tracedump.attach(models["eager_dump"], {"dir": f"{root}/eager"}),
            "compiled_dump": tracedump.attach(
                models["compiled_dump"], {"dir": f"{root}/compiled", "compiled": True}
            ),
            # An armable server, never armed (CONTROL=1), and a dump whose STEPS select none of
            # these steps: both run the tap-free graph.
            "compiled_armable": tracedump.attach(
                models["compiled_armable"], {"dir": f"{root}/armable", "compiled": True, "control": True}
            ),
            "compiled_unselected": tracedump.attach(
                models["compiled_unselected"],
                {"dir": f"{root}/unselected", "compiled": True, "steps": "1000000000"},
            ),
        }
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        calls = {name: models[name] for name in ("eager", "eager_dump")}
        compile_s: dict[str, float] = {}
        with torch.inference_mode():
            for name in ("compiled", "compiled_dump", "compiled_armable", "compiled_unselected"):
                calls[name] = torch.compile(models[name])
                compile_s[name] = _timed_step(calls[name], dumpers.get(name), ids)
            target = dumpers["compiled_dump"].taps.target
            # The taps in the graph with no target (the op called, returning at once): the graph
            # traced with taps, then the target gone. What a tap that is a no-op until armed costs.
            target.unregister()  # its LIVE entry gone: the tapped graph, each tap finding no target
            compile_s["compiled_taps_noop"] = _timed_step(calls["compiled_dump"], None, ids)
            target.register()
            taps_before = target.taps
            times: dict[str, list[float]] = {name: [] for name in (*names, "compiled_taps_noop")}
            host: dict[str, list[float]] = {"eager_dump": [], "compiled_dump": []}
            for _ in range(rounds + 1):  # every figure interleaved, round by round, one process
                for name in names:
                    # an idle step has nothing to write: it is timed as the host runs it, no flush
                    flushed = dumpers.get(name) if name in ("eager_dump", "compiled_dump") else None
                    times[name].append(_timed_step(calls[name], flushed, ids))
                for name in host:
                    host[name].append(_host_step(calls[name], dumpers[name], ids))
                target.unregister()
                times["compiled_taps_noop"].append(_timed_step(calls["compiled_dump"], None, ids))
                target.register()
            taps_run = target.taps - taps_before
        times = {name: values[1:] for name, values in times.items()}  # the first round warms up
        host = {name: values[1:] for name, values in host.items()}
        breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
        idle_taps = sum(
            dumpers[name].taps.target.taps for name in ("compiled_armable", "compiled_unselected")
        )
        for dumper in dumpers.values():
            if dumper is not None:
                dumper.close()
    med = {name: common.median(values) for name, values in times.items()}
    ratios = {
        "eager_dump_ratio": _paired(times["eager_dump"], times["eager"]),
        "compiled_dump_ratio": _paired(times["compiled_dump"], times["compiled"]),
        "compiled_dump_vs_eager_dump": _paired(times["compiled_dump"], times["eager_dump"]),
        # The step as the host sees it (the writer left to work beside the next step).
        "eager_dump_host_ratio": _paired(host["eager_dump"], times["eager"]),
        "compiled_dump_host_ratio": _paired(host["compiled_dump"], times["compiled"]),
        # Idle, two ways, each against the untouched compiled graph of the same round: the
        # tap-free graph a guard switches to (an armable server never armed: CONTROL=1), and the
        # tapped graph whose op returns at once (what a tap that is a no-op until armed costs).
        "compiled_taps_idle_ratio": _paired(times["compiled_armable"], times["compiled"]),
        "compiled_unselected_ratio": _paired(times["compiled_unselected"], times["compiled"]),
        "compiled_taps_noop_ratio": _paired(times["compiled_taps_noop"], times["compiled"]),
    }
    return {
        "model": f"llama hidden={SPEC.hidden} layers={SPEC.layers} tokens={SPEC.tokens}",
        "rounds": rounds,
        "step_ms": {name: value * 1e3 for name, value in med.items()},
        "host_step_ms": {name: common.median(values) * 1e3 for name, values in host.items()},
        "compile_s": compile_s,
        "graph_breaks": breaks,
        # the premise of each figure: the dumped model ran its taps every round and only then, the
        # idle ones never (their graph is the tap-free one)
        "taps_per_dumped_step": taps_run / (2 * (rounds + 1)),
        "idle_taps": idle_taps,
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
