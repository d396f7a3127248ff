"""What dumping costs the host, as ratios against the untouched model measured in the same process.

Two phases, each interleaved round by round (medians of per-round paired ratios):

* **off**: the engine-integrated step with ``attach()`` having returned ``None`` vs the bare model;
  plus the cost of ``attach()`` itself when off and of a no-op ``tracedump.record()``. Asserts that
  no hook of any kind was registered and no thread started.
* **on**: full / last_row / stats dumps, a naive synchronous baseline and each mode's floor (hooks
  that only copy into memory already mapped, then write those copies as one file; cut and copy the
  last row; or run the C sweep: ``FloorModel``), each on its own deep copy
  of the model (identical weights), against the untouched model. A dumped step reports ``step`` (the
  forward as the host sees it: hooks + copies; disk writes happen on the writer thread) and ``e2e``
  (the same step plus waiting for the writer to put it on disk, so background work is not hidden).
  A **burst** of back-to-back steps ending with a flush gives the steady-state cost: the writer's
  work overlaps the next forwards, or (a CPU forward on every core) waits for the flush.

Run alone: ``python benchmarks/bench_overhead.py [--quick]`` prints the JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

import tracedump
import tracedump.dump.dumper as tracedump_dumper
from tracedump.store.reduce import SweepKernel, compiled_kernel, last_row
from tracedump.store.stformat import write_file

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import common

Step = Callable[[], dict[str, float]]


def settings_for(quick: bool) -> dict[str, int]:
    """Rounds per phase. Full mode keeps the whole `make bench` well under five minutes."""
    if quick:
        return {
            "off_rounds": 4,
            "on_rounds": 3,
            "burst_rounds": 1,
            "burst_steps": 3,
            "warmup": 1,
            "cold_idle_s": 0,
        }
    return {
        "off_rounds": 20,
        "on_rounds": 12,
        "burst_rounds": 8,
        "burst_steps": 6,
        "warmup": 2,
        "cold_idle_s": 3,
    }


# ---------------------------------------------------------------------------------------------- off


def run_off(
    model: nn.Module, ids: torch.Tensor, rounds: int, warmup: int, micro_calls: int = 200_000
) -> dict[str, Any]:
    """The off path: attach() returns None, the step adds a context manager and a record() call.

    ``micro_calls`` back-to-back calls time one no-op ``record()`` (and ``attach()``, a hundredth
    as many: it reads the environment).
    """
    before = common.hook_census(model)
    if before.total:
        raise AssertionError(f"the benchmark model already has hooks: {before.as_dict()}")
    if tracedump_dumper.active_dumper() is not None:
        raise AssertionError("a dumper is still active: record() would not be the no-op path")
    with common.clean_env():
        dumper = tracedump.attach(model)
        if dumper is not None:
            raise AssertionError("attach() returned a dumper with no dump dir set")
        attach_s = common.per_call_seconds(lambda: tracedump.attach(model), calls=micro_calls // 100)
        after = common.assert_untouched(model, before)

    probe = torch.zeros(4)
    record_s = common.per_call_seconds(lambda: tracedump.record("logits", probe), calls=micro_calls)
    empty_call_s = common.per_call_seconds(lambda: _nothing("logits", probe), calls=micro_calls)

    def integration(out: Any) -> None:  # what the engine's step adds around its forward
        with dumper.step() if dumper is not None else contextlib.nullcontext():
            pass
        tracedump.record("logits", out if isinstance(out, torch.Tensor) else out.logits)

    def untouched() -> dict[str, float]:
        return {"step": common.timed(lambda: common.forward(model, ids))}

    def untouched_again() -> dict[str, float]:  # A/A: shows the noise floor of the comparison
        return untouched()

    def off() -> dict[str, float]:
        start = time.perf_counter()
        with dumper.step() if dumper is not None else contextlib.nullcontext():
            out = common.forward(model, ids)
        tracedump.record("logits", out if isinstance(out, torch.Tensor) else out.logits)
        return {"step": time.perf_counter() - start}

    variants = {"untouched": untouched, "off": off, "untouched_again": untouched_again}
    block = 3  # best of 3 per variant per round: interference only ever adds time
    samples = common.best_per_block(common.interleave(variants, rounds * block, warmup), block)
    outputs = common.forward(model, ids)
    integration_s = common.per_call_seconds(lambda: integration(outputs), calls=micro_calls // 10)
    final = common.assert_untouched(model, before)
    base = samples["untouched"]["step"]
    return {
        # Ratio of medians of the per-round bests: for a difference of ~1e-5 the per-round ratios
        # only carry the noise of two single runs; pooling first is the steadier estimator.
        "forward_ratio": common.ratio(common.median(samples["off"]["step"]), common.median(base)),
        "aa_ratio": common.ratio(common.median(samples["untouched_again"]["step"]), common.median(base)),
        "forward_ratio_paired": common.paired_ratio(samples["off"]["step"], base),
        "forward_ms": _ms(base),
        "off_forward_ms": _ms(samples["off"]["step"]),
        "attach_off_us": attach_s * 1e6,
        "record_noop_ns": record_s * 1e9,
        "empty_python_call_ns": empty_call_s * 1e9,
        "step_integration_ns": integration_s * 1e9,
        "step_integration_fraction": integration_s / common.median(base),
        "hooks_registered": after.total + final.total,
        "threads_started": len(set(final.threads) - set(before.threads)),
        "rounds": rounds,
        "best_of": block,
    }


def _nothing(tag: str, tensor: Any) -> None:
    """An empty function of record()'s signature: the floor a no-op call can reach."""


# ---------------------------------------------------------------------------------------------- on


class DumpedModel:
    """A deep copy of the model with its own dumper, and the steps the benchmark times on it."""

    def __init__(self, model: nn.Module, ids: torch.Tensor, config: dict[str, Any]) -> None:
        self.model = copy.deepcopy(model)
        self.ids = ids
        self.dir = Path(config["dir"])
        dumper = tracedump.attach(self.model, config)
        if dumper is None:
            raise AssertionError(f"attach() returned None for {config}")
        self.dumper = dumper

    def flush(self) -> None:
        """Wait until every submitted pass is on disk (the writer's own flush; no public one yet)."""
        flush = getattr(self.dumper, "flush", None)
        (flush or self.dumper.rundir.writer.flush)()

    def step(self) -> dict[str, float]:
        start = time.perf_counter()
        common.forward(self.model, self.ids)
        returned = time.perf_counter()
        self.flush()
        done = time.perf_counter()
        common.remove_files(self.dir)  # outside the timed region
        return {"step": returned - start, "e2e": done - start}

    def burst(self, steps: int) -> float:
        """Back-to-back steps, then wait for the disk: seconds per step in steady state.

        The previous burst's files are deleted just before, untimed (see :func:`_bursts`)."""
        common.remove_files(self.dir)
        start = time.perf_counter()
        for _ in range(steps):
            common.forward(self.model, self.ids)
        self.flush()
        return (time.perf_counter() - start) / steps

    def sample_pass(self) -> dict[str, torch.Tensor]:
        """One dumped pass read back from disk (for the sizes of what a pass captures)."""
        common.forward(self.model, self.ids)
        self.flush()
        newest = max(self.dir.rglob("pass*.safetensors"), key=lambda p: p.stat().st_mtime)
        tensors = load_file(str(newest))
        common.remove_files(self.dir)
        return tensors

    def close(self) -> None:
        with contextlib.redirect_stderr(io.StringIO()):  # the one-line summary per dumper is not a result
            self.dumper.close()


class NaiveModel:
    """A deep copy of the model with the naive synchronous dumper of :mod:`common`."""

    def __init__(self, model: nn.Module, ids: torch.Tensor, directory: Path) -> None:
        self.model = copy.deepcopy(model)
        self.ids = ids
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.naive = common.NaiveDumper(self.model, directory)

    def step(self) -> dict[str, float]:
        seconds = common.timed(lambda: common.forward(self.model, self.ids))
        common.remove_files(self.dir, "*.pt")
        return {"step": seconds, "e2e": seconds}

    def burst(self, steps: int) -> float:
        common.remove_files(self.dir, "*.pt")  # untimed, just before (see _bursts)
        start = time.perf_counter()
        for _ in range(steps):
            common.forward(self.model, self.ids)
        return (time.perf_counter() - start) / steps

    def close(self) -> None:
        self.naive.close()


class FloorModel:
    """A deep copy of the model whose leaves' hooks only do a mode's least work on each output
    tensor (one level of tuple) and hold the result: nothing named, counted or written. The least
    a dump in that mode by forward hooks costs on this machine, measured beside it."""

    def __init__(
        self,
        model: nn.Module,
        ids: torch.Tensor,
        keep: Callable[[torch.Tensor], Any],
        on_step: Callable[[], None] | None = None,
        then: Callable[[], None] | None = None,
        written: Path | None = None,
    ) -> None:
        self.model = copy.deepcopy(model)
        self.ids = ids
        self.keep = keep  # what it holds of one tensor; None: nothing
        self.on_step = on_step  # called before each step's forward, untimed
        self.then = then  # called after it, timed as ``e2e`` (the step until its bytes are on disk)
        self.written = written  # where ``then`` writes: emptied after each step, untimed, as DumpedModel's
        self.kept: list[Any] = []
        for module in self.model.modules():
            if not list(module.children()):
                module.register_forward_hook(self._keep)

    def _keep(self, module: nn.Module, args: Any, output: Any) -> None:
        for tensor in output if type(output) is tuple else (output,):
            if type(tensor) is torch.Tensor and (kept := self.keep(tensor)) is not None:
                self.kept.append(kept)

    def step(self) -> dict[str, float]:
        self.kept.clear()
        if self.on_step is not None:
            self.on_step()
        start = time.perf_counter()
        common.forward(self.model, self.ids)
        returned = time.perf_counter()
        if self.then is None:
            return {"step": returned - start}
        self.then()
        done = time.perf_counter()
        if self.written is not None:
            common.remove_files(self.written)
        return {"step": returned - start, "e2e": done - start}


class WarmCopies:
    """Full mode's least work: each output copied into memory already mapped, the buffer the same
    capture used the step before, as a dump whose writer recycles its buffers copies in steady
    state (its captures of 512 KiB and more; the rest are clones). Holds nothing: the buffers are
    overwritten each step."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []
        self.next = 0  # this step's captures so far

    def start(self) -> None:
        """A new step: its captures reuse the buffers from the first."""
        self.next = 0

    def __call__(self, tensor: torch.Tensor) -> None:
        if self.next == len(self.buffers):
            self.buffers.append(torch.empty(0))
        buffer = self.buffers[self.next]
        if buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = self.buffers[self.next] = torch.empty_like(tensor, memory_format=torch.contiguous_format)
        buffer.copy_(tensor)
        self.next += 1


class WrittenCopies(WarmCopies):
    """Full mode's least work until the pass is on disk: :class:`WarmCopies`, then this step's
    buffers written as one file the way the writer thread writes a pass (``write_file``: the
    header, then the buffers straight to ``os.writev``), in series, as a step waits for its own
    write. Its ``FloorModel`` deletes the file right after the step, untimed, as
    ``DumpedModel.step`` deletes its passes, so both write into page cache freed as long before."""

    def __init__(self, directory: Path) -> None:
        super().__init__()
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory  # its ``FloorModel``'s ``written``
        self.path = directory / "pass.safetensors"

    def write(self) -> None:
        tensors = {str(index): buffer for index, buffer in enumerate(self.buffers[: self.next])}
        write_file(tensors, self.path, {"tracedump.mode": "full"})


def sweeping(kernel: SweepKernel) -> Callable[[torch.Tensor], Any]:
    """Stats mode's least work: tracedump's C sweep of a contiguous float32 tensor (its four sums)."""

    def sweep(tensor: torch.Tensor) -> Sequence[float] | None:
        if tensor.dtype is torch.float32 and tensor.is_contiguous():
            return kernel.stats(tensor.numpy())
        return None

    return sweep


def cutting(token_dim: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """last_row mode's least work: a copy of the tensor's last row along ``token_dim``."""

    def cut(tensor: torch.Tensor) -> torch.Tensor:
        return last_row(tensor, token_dim).clone()

    return cut


def run_on(
    model: nn.Module, ids: torch.Tensor, workdir: Path, rounds: dict[str, int], quick: bool
) -> dict[str, Any]:
    """Full, last_row, stats and naive against the untouched model, and memcpy, interleaved."""
    token_dim = 1  # both benchmark models produce [batch, seq, hidden]
    with common.clean_env():
        full = DumpedModel(model, ids, {"dir": str(workdir / "full")})
        last_row = DumpedModel(model, ids, {"dir": str(workdir / "last_row"), "mode": "last_row",
                                            "token_dim": token_dim})  # fmt: skip
        stats = DumpedModel(model, ids, {"dir": str(workdir / "stats"), "mode": "stats"})
    naive = NaiveModel(model, ids, workdir / "naive")
    try:
        copies = PassCopies(full.sample_pass(), workdir / "copies")
        variants: dict[str, Step] = {
            "untouched": lambda: {"step": common.timed(lambda: common.forward(model, ids))},
            "full": full.step,
            "naive": naive.step,
            "last_row": last_row.step,
            "stats": stats.step,
            "copies": copies.step,
        }
        warm = WrittenCopies(workdir / "floor")
        variants["full_floor"] = FloorModel(
            model, ids, warm, on_step=warm.start, then=warm.write, written=warm.directory
        ).step
        variants["last_row_floor"] = FloorModel(model, ids, cutting(token_dim)).step
        kernel = compiled_kernel()
        if kernel is not None:  # without the compiled kernel stats dumps use torch's reductions
            variants["stats_floor"] = FloorModel(model, ids, sweeping(kernel)).step
        samples = common.interleave(variants, rounds["on_rounds"], rounds["warmup"])
        burst = _bursts(model, ids, full, naive, rounds["burst_rounds"], rounds["burst_steps"])
        page_cache = page_cache_rates(
            copies.named, workdir / "page-cache", rounds["burst_steps"], rounds["cold_idle_s"]
        )
    finally:
        for closable in (full, last_row, stats, naive):
            closable.close()
    return _summarise_on(samples, burst, copies.nbytes, full) | {"page_cache": page_cache}


class PassCopies:
    """Plain copies of one pass's bytes, timed in the same rounds as the dumps.

    ``memcpy``: one ``copy_`` of all the bytes into a reused buffer: the machine's copy bandwidth.
    ``clone``: ``clone()`` of the pass's tensors one by one (fresh memory each time, like a
    capture): the least any dumper that keeps a private copy must spend in the forward.
    ``write``: the pass written as one file the way the writer thread writes it
    (``tracedump.store.stformat.write_file``: header, then the buffers straight to ``os.writev``): one
    copy per byte, the kernel's into the page cache. ``save_file``: the same file through
    safetensors' ``save_file``, the writer it replaced. Both files are deleted untimed.
    """

    def __init__(self, tensors: dict[str, torch.Tensor], directory: Path) -> None:
        self.tensors = list(tensors.values())
        self.named = tensors
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.nbytes = sum(t.numel() * t.element_size() for t in self.tensors)
        self.source = torch.ones(max(1, self.nbytes // 4), dtype=torch.float32)
        self.target = torch.zeros_like(self.source)

    def step(self) -> dict[str, float]:
        path = self.directory / "pass.safetensors"
        write = common.timed(lambda: write_file(self.named, path, {"tracedump.mode": "full"}))
        path.unlink()
        save = common.timed(lambda: save_file(self.named, str(path), {"tracedump.mode": "full"}))
        path.unlink()
        return {
            "memcpy": common.timed(lambda: self.target.copy_(self.source)),
            "clone": common.timed(
                lambda: [t.clone(memory_format=torch.contiguous_format) for t in self.tensors]
            ),
            "write": write,
            "save_file": save,
        }


def page_cache_rates(
    tensors: dict[str, torch.Tensor], directory: Path, passes: int, idle_s: float
) -> dict[str, float]:
    """A burst's files written twice as the writer writes them: into memory freed a moment before
    (*warm*), then into memory left free for ``idle_s`` (*cold*).

    Why: on a VM whose hypervisor takes back free guest memory (virtio-balloon free page reporting,
    as on the machine these figures come from), memory free for about 2 s goes back to the host and
    the next touch of each page faults into it: writing a burst's page cache into such memory ran
    at 0.5-1.2 GB/s here, against 8 GB/s warm. A steady-state burst that needs more fresh pages than
    recently freed ones pays that, whatever writes them; these two figures show how much."""
    directory.mkdir(parents=True, exist_ok=True)
    nbytes = passes * sum(t.numel() * t.element_size() for t in tensors.values())

    def write_all() -> float:
        start = time.perf_counter()
        for index in range(passes):
            write_file(tensors, directory / f"pass{index}.safetensors", {"tracedump.mode": "full"})
        return time.perf_counter() - start

    write_all()
    common.remove_files(directory)
    warm = write_all()
    common.remove_files(directory)
    time.sleep(idle_s)
    cold = write_all()
    common.remove_files(directory)
    return {"warm_GBps": nbytes / warm / 1e9, "cold_GBps": nbytes / cold / 1e9, "burst_MB": nbytes / 1e6}


def _bursts(
    model: nn.Module, ids: torch.Tensor, full: DumpedModel, naive: NaiveModel, rounds: int, steps: int
) -> dict[str, list[float]]:
    """Back-to-back steps of untouched, full and naive, interleaved, after one warm-up round.

    Each dumping variant deletes its previous burst's files just before its next (untimed): their
    pages, freed a moment before, are what the new files reuse, as on a machine whose page cache is
    full and recycles its pages. Deleted right after a burst instead, they sat free through the
    other variants' bursts and went back to this VM's hypervisor (see :func:`page_cache_rates`), so
    the next burst faulted in fresh memory at 0.5-1.2 GB/s: a figure of the VM, not of the dumper.
    """

    def untouched() -> float:
        start = time.perf_counter()
        for _ in range(steps):
            common.forward(model, ids)
        return (time.perf_counter() - start) / steps

    runs: dict[str, Callable[[], float]] = {
        "untouched": untouched,
        "full": lambda: full.burst(steps),
        "naive": lambda: naive.burst(steps),
    }
    samples = common.interleave({k: (lambda f=f: {"step": f()}) for k, f in runs.items()}, rounds, 1)
    return {k: v["step"] for k, v in samples.items()}


def _summarise_on(
    samples: dict[str, dict[str, list[float]]],
    burst: dict[str, list[float]],
    pass_bytes: int,
    full: DumpedModel,
) -> dict[str, Any]:
    base = samples["untouched"]["step"]
    full_step, naive_step = samples["full"]["step"], samples["naive"]["step"]
    memcpy, clone, write = (samples["copies"][k] for k in ("memcpy", "clone", "write"))
    added = [f - u for f, u in zip(full_step, base, strict=True)]
    added_s = common.median(added)
    ideal = [u + c for u, c in zip(base, clone, strict=True)]  # a dumper whose only cost is the copy

    def steady(name: str) -> float:  # few long samples: pool them, a paired ratio of 3-5 is fragile
        return common.ratio(common.median(burst[name]), common.median(burst["untouched"]))

    result: dict[str, Any] = {
        "forward_ms": _ms(base),
        "full": {
            "ratio_vs_untouched": common.paired_ratio(full_step, base),
            "ratio_e2e_vs_untouched": common.paired_ratio(samples["full"]["e2e"], base),
            "ratio_steady_vs_untouched": steady("full"),
            "speedup_vs_naive": common.paired_ratio(naive_step, full_step),
            "speedup_vs_naive_e2e": common.paired_ratio(naive_step, samples["full"]["e2e"]),
            "speedup_vs_naive_steady": common.ratio(
                common.median(burst["naive"]), common.median(burst["full"])
            ),
            # The ceiling for speedup_vs_naive on this machine, model and disk: naive vs a dumper whose
            # only host cost is cloning the pass (its disk writes free and invisible).
            "speedup_vs_naive_ideal": common.paired_ratio(naive_step, ideal),
            "naive_ratio_vs_untouched": common.paired_ratio(naive_step, base),
            "naive_steady_ratio_vs_untouched": steady("naive"),
            "step_ms": _ms(full_step),
            "e2e_ms": _ms(samples["full"]["e2e"]),
            "naive_step_ms": _ms(naive_step),
            "steady_samples_ms": {k: [round(v * 1e3, 1) for v in vs] for k, vs in burst.items()},
            "pass_MB": pass_bytes / 1e6,
            "added_ms": added_s * 1e3,
            "capture_GBps": pass_bytes / added_s / 1e9 if added_s > 0 else float("inf"),
            "memcpy_GBps": pass_bytes / common.median(memcpy) / 1e9,
            "clone_GBps": pass_bytes / common.median(clone) / 1e9,
            "throughput_vs_memcpy": common.paired_ratio(memcpy, added),
            "throughput_vs_clone": common.paired_ratio(clone, added),
            # The writer: one copy per byte (the kernel's, into the page cache) after the capture's
            # one, so a pass costs two copies per byte until it is on disk, against memcpy's one.
            "copies_per_byte": 2,
            "write_GBps": pass_bytes / common.median(write) / 1e9,
            "save_file_GBps": pass_bytes / common.median(samples["copies"]["save_file"]) / 1e9,
            "write_speedup_vs_save_file": common.paired_ratio(samples["copies"]["save_file"], write),
            "write_cost_in_memcpys": common.paired_ratio(write, memcpy),
            "leaves_hooked": len(full.dumper.modules),
        },
    }
    for mode in ("last_row", "stats"):
        result[mode] = {
            "ratio": common.paired_ratio(samples[mode]["step"], base),
            "ratio_e2e": common.paired_ratio(samples[mode]["e2e"], base),
            "step_ms": _ms(samples[mode]["step"]),
        }
    for mode in ("full", "last_row", "stats"):  # each mode's floor here: hooks doing only its least work
        if f"{mode}_floor" in samples:
            result[mode]["floor_ratio"] = common.paired_ratio(samples[f"{mode}_floor"]["step"], base)
    if "e2e" in samples.get("full_floor", {}):  # until on disk: the copies, then one write of them
        result["full"]["floor_ratio_e2e"] = common.paired_ratio(samples["full_floor"]["e2e"], base)
    return result


def _ms(values: list[float]) -> float:
    return common.median(values) * 1e3


# ---------------------------------------------------------------------------------------------- entry


def run(
    quick: bool = False, spec: common.ModelSpec | None = None, workdir: Path | None = None
) -> dict[str, Any]:
    """Both phases on one model; returns the ``model``/``off``/``full``/``last_row``/``stats`` sections."""
    spec = spec or (common.QUICK_SPEC if quick else common.FULL_SPEC)
    rounds = settings_for(quick)
    model = common.build_model(spec)
    ids = common.make_inputs(spec)
    with torch.inference_mode():
        off = run_off(model, ids, rounds["off_rounds"], rounds["warmup"], 20_000 if quick else 200_000)
        with common.scratch_dir() if workdir is None else contextlib.nullcontext(workdir) as scratch:
            on = run_on(model, ids, Path(scratch), rounds, quick)
    model_info = {
        **{k: v for k, v in vars(spec).items() if k != "seed"},
        "params": common.param_count(model),
        "model_MB": common.model_bytes(model) / 1e6,
        "leaves": common.leaf_count(model),
        "forward_ms": on.pop("forward_ms"),
        "dtype": "float32",
    }
    return {"model": model_info, "off": off, **on}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, few rounds: a smoke run")
    args = parser.parse_args(argv)
    print(json.dumps(run(quick=args.quick), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
