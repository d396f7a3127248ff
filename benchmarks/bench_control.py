"""What an engine pays for being armable: ``CONTROL=1`` attached and disarmed, against untouched.

One bench model runs the same forward inside ``step()``, interleaved round by round: untouched,
and attached for the round with ``CONTROL=1`` and never armed (no capture hook
registered until an order arms a step, only the root's pass hooks; the order file stat-ed once
per step; a heartbeat twice a second). Reported: the step ratio (target <= 1.01), the hooks on
the model while idle, and the cost of a capture hook's call while disarmed and of a step boundary
in ns, measured directly so they are not lost in the forward's noise. Then one armed window of 3
steps, for the cost while armed, as the host sees it.

Run alone: ``python benchmarks/bench_control.py [--quick]`` prints the JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import common

TARGET_IDLE = 1.01


def _stepper(model: torch.nn.Module, ids: torch.Tensor, dumper: Any) -> Any:
    def run() -> dict[str, float]:
        start = time.perf_counter()
        with dumper.step() if dumper is not None else contextlib.nullcontext(), torch.no_grad():
            common.forward(model, ids)
        return {"step": time.perf_counter() - start}

    return run


def _best_step(model: torch.nn.Module, ids: torch.Tensor, dumper: Any) -> dict[str, float]:
    """The fastest of a few steps back to back: another process only ever adds time to a step."""
    step = _stepper(model, ids, dumper)
    return {"step": min(step()["step"] for _ in range(STEPS_PER_ROUND))}


def _per_call_ns(dumper: Any) -> dict[str, float]:
    """A disarmed output hook's cost, and a step boundary's (stat of the order file included)."""
    from tracedump.dump.hooks import OutputHook

    hook = OutputHook(dumper.recorder, "probe")
    tensor = torch.ones(2)
    hook_s = common.per_call_seconds(lambda: hook(None, (), tensor), calls=20_000)  # type: ignore[arg-type]

    def boundary() -> None:
        with dumper.step():
            pass

    boundary_s = common.per_call_seconds(boundary, calls=2_000)
    return {"hook_ns": hook_s * 1e9, "step_boundary_ns": boundary_s * 1e9}


STEPS_PER_ROUND = 3


def run(quick: bool = False, rounds: int | None = None) -> dict[str, Any]:
    import tracedump
    from tracedump.dump.control import Order, write_order

    spec = common.QUICK_SPEC if quick else common.FULL_SPEC
    rounds = rounds or (5 if quick else 15)
    model = common.build_model(spec)
    ids = common.make_inputs(spec)
    with common.scratch_dir("tracedump-bench-control-") as scratch, common.clean_env():
        attached = iter(range(10**6))

        def idle() -> dict[str, float]:
            # The same model object as the untouched rounds, attached for this round only (outside
            # the timing), and the best of a few steps: what is measured is ~0.01% of a step, and
            # a paired ratio of 15 single steps moves by +-1% even for one object against itself
            # (an A/A of a deep copy against its original: 0.99-1.02x here).
            dumper = tracedump.attach(model, {"dir": str(scratch / f"r{next(attached)}"), "control": True})
            assert dumper is not None
            try:
                return _best_step(model, ids, dumper)
            finally:
                dumper.close()

        samples = common.interleave({"untouched": lambda: _best_step(model, ids, None), "idle": idle}, rounds)
        idle_ratio = common.paired_ratio(samples["idle"]["step"], samples["untouched"]["step"])
        dumper = tracedump.attach(model, {"dir": str(scratch / "armed"), "control": True})
        assert dumper is not None
        direct = _per_call_ns(dumper)
        hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
        write_order(scratch / "armed", Order(id=1, action="arm", start_step=0, steps=3))
        armed = [_stepper(model, ids, dumper)()["step"] for _ in range(3)]
        dumper.close()
        passes = len(list((scratch / "armed").glob("rank*/pass*.safetensors")))
    base = common.median(samples["untouched"]["step"])
    return {
        "rounds": rounds,
        "model": spec.kind,
        "untouched_step_s": base,
        "idle_ratio": idle_ratio,
        "idle_target": TARGET_IDLE,
        "idle_met": idle_ratio <= TARGET_IDLE,
        "hooks": hooks,
        "hook_ns": direct["hook_ns"],
        "step_boundary_ns": direct["step_boundary_ns"],
        "armed_ratio": common.median(armed) / base,
        "armed_passes": passes,
        "machine": common.machine_info(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the small model, 5 rounds (a smoke test)")
    args = parser.parse_args()
    print(json.dumps(run(quick=args.quick), indent=2))


if __name__ == "__main__":
    main()
