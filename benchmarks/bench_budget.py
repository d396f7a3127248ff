"""Where a dumped step's time goes: the capture taken apart, one layer at a time.

A decode-shaped step (an HF Llama, 3 layers, 256 wide, 8 rows of one token: the shape of the vLLM
benchmark's decode steps) with ``MODULES=all`` in full mode, against the untouched model, in six
variants that each add one layer of the capture, interleaved round by round in one process:

* ``dispatch``: a no-op forward hook on every selected module (and the root's two pass hooks):
  torch's hooked call path, which a module without hooks skips;
* ``record``: tracedump's hooks and recorder (gates, names, selection, the pass), each copy
  replaced by the tensor itself and each closed pass dropped;
* ``copy``: the same with the copies made (the closed pass still dropped);
* ``queue``: the pass queued to the writer thread, which writes nothing (its loop, its lock);
* ``full``: the writer writes each pass file (one file per step: create, write, rename).

The difference between two neighbours is what that layer costs per step; divided by the captures
of a step, per capture. A sample is the median step of a block of steps (robust to the other jobs
on a shared machine), ratios are paired by round. No profiler runs during the timing: the figures
are the host's own. ``--profile`` adds a cProfile of the full variant (call counts, and per-call
costs as the profiler sees them, inflated by its own per-call overhead).

    python benchmarks/bench_budget.py [--quick] [--profile]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import cProfile
import io
import json
import pstats
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import common

LAYERS = ("dispatch", "record", "copy", "queue", "full")


def build(layers: int = 3) -> tuple[nn.Module, torch.Tensor]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=256,
        num_hidden_layers=layers,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=8000,
        max_position_embeddings=512,
        use_cache=False,
    )
    ids = torch.randint(0, 8000, (8, 1), generator=torch.Generator().manual_seed(1))
    return LlamaForCausalLM(config).eval(), ids


class _Nothing:
    """A writer job that writes nothing: the queue's and the writer loop's cost alone."""

    def __init__(self, job: Any) -> None:
        self.nbytes = job.nbytes
        self.index = getattr(job, "index", -1)
        self.part = getattr(job, "part", None)
        self.records: list[Any] = []

    def run(self, writer: Any) -> None:
        return None


def _dumped(model: nn.Module, directory: Path, layer: str) -> tuple[nn.Module, Any]:
    """A copy of ``model`` dumped up to ``layer`` (see the module docstring)."""
    import tracedump

    twin = copy.deepcopy(model)
    if layer == "dispatch":
        from tracedump.config.settings import load_settings
        from tracedump.dump.selection import select_modules  # the modules attach() would hook

        chosen = select_modules(twin, load_settings({"dir": str(directory), "modules": "all"}))
        for _, module in chosen:
            module.register_forward_hook(lambda m, a, o: None)
        twin.register_forward_pre_hook(lambda m, a: None, prepend=True)
        twin.register_forward_hook(lambda m, a, o: None, always_call=True)
        return twin, None
    dumper = tracedump.attach(twin, {"dir": str(directory), "modules": "all"})
    assert dumper is not None
    sink = dumper.sink
    if layer == "record":
        sink.copy = lambda tensor, pooled=True: (tensor, None)  # type: ignore[method-assign]
    if layer in ("record", "copy"):
        sink.submit = lambda job: None  # type: ignore[method-assign]
    if layer == "queue":
        writer_submit = dumper.rundir.writer.submit
        sink.submit = lambda job: writer_submit(_Nothing(job))  # type: ignore[method-assign]
    return twin, dumper


def _block(model: nn.Module, ids: torch.Tensor, steps: int, dumper: Any, directory: Path) -> float:
    """The median of ``steps`` steps back to back (the writer works beside them, as in an engine)."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        with torch.inference_mode():
            model(input_ids=ids, use_cache=False)
        times.append(time.perf_counter() - start)
    if dumper is not None:
        dumper.flush()  # untimed: each block starts with an empty queue
        common.remove_files(directory)
    return common.median(times)


@contextlib.contextmanager
def _variants(model: nn.Module, ids: torch.Tensor, scratch: Path, steps: int) -> Iterator[dict[str, Any]]:
    dumpers: list[Any] = []
    twins: list[nn.Module] = []
    variants: dict[str, Callable[[], dict[str, float]]] = {
        "untouched": lambda: {"step": _block(model, ids, steps, None, scratch)}
    }
    try:
        for layer in LAYERS:
            directory = scratch / layer
            twin, dumper = _dumped(model, directory, layer)
            dumpers.append(dumper)
            twins.append(twin)
            variants[layer] = lambda t=twin, d=dumper, p=directory: {"step": _block(t, ids, steps, d, p)}
        yield {"variants": variants, "dumpers": dumpers, "twins": twins}
    finally:
        with contextlib.redirect_stderr(io.StringIO()):
            for dumper in dumpers:
                if dumper is not None:
                    dumper.close()


def run(quick: bool = False, profile: bool = False) -> dict[str, Any]:
    model, ids = build(2 if quick else 3)
    rounds, steps = (3, 10) if quick else (11, 40)
    with (
        common.scratch_dir("tracedump-bench-budget-") as scratch,
        common.clean_env(),
        _variants(model, ids, Path(scratch), steps) as built,
    ):
        samples = common.interleave(built["variants"], rounds, warmup=1)
        captures = _captures_per_step(built["twins"][-1], ids, built["dumpers"][-1])
        profiled = _profile(built["variants"]["full"]) if profile else None
    base = samples["untouched"]["step"]
    result: dict[str, Any] = {
        "model": {"layers": 2 if quick else 3, "hidden": 256, "rows": 8, "modules": "all"},
        "rounds": rounds,
        "steps_per_sample": steps,
        "captures_per_step": captures,
        "untouched_step_us": 1e6 * common.median(base),
        "ratio": {layer: common.paired_ratio(samples[layer]["step"], base) for layer in LAYERS},
        "machine": common.machine_info(),
    }
    previous = base
    layer_us: dict[str, float] = {}
    for layer in LAYERS:  # what each layer adds, per step and per capture (paired by round)
        added = [a - b for a, b in zip(samples[layer]["step"], previous, strict=True)]
        layer_us[layer] = 1e6 * common.median(added)
        previous = samples[layer]["step"]
    result["added_us_per_step"] = layer_us
    result["added_us_per_capture"] = {k: v / captures for k, v in layer_us.items()}
    if profiled is not None:
        result["profile"] = profiled
    return result


def _captures_per_step(model: nn.Module, ids: torch.Tensor, dumper: Any) -> int:
    """The tensors one pass of the full variant holds (one more step, read back from its file)."""
    from tracedump import open_dump

    with torch.inference_mode():
        model(input_ids=ids, use_cache=False)
    dumper.flush()
    model_run = open_dump(dumper.run_dir).run()
    passes = model_run.passes
    return len(passes[max(passes)]) if passes else 0


def _profile(step: Callable[[], dict[str, float]]) -> list[dict[str, Any]]:
    """cProfile of a few blocks of the full variant: the host thread's functions by own time."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(3):
        step()
    profiler.disable()
    stats = pstats.Stats(profiler)
    rows = []
    for (filename, line, name), (_, calls, own, cumulative, _) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append(
            {
                "function": f"{Path(filename).name}:{line}({name})",
                "calls": calls,
                "own_us_per_call": 1e6 * own / calls if calls else 0.0,
                "cum_us_per_call": 1e6 * cumulative / calls if calls else 0.0,
                "own_s": own,
            }
        )
    rows.sort(key=lambda r: r["own_s"], reverse=True)
    return rows[:40]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 layers, 3 rounds: a smoke run")
    parser.add_argument("--profile", action="store_true", help="add a cProfile of the full variant")
    args = parser.parse_args(argv)
    print(json.dumps(run(quick=args.quick, profile=args.profile), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
