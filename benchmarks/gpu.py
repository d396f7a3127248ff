"""GPU benchmark: the benchmark model on CUDA in bf16. Skips cleanly (exit 0) without CUDA.

Self-contained on purpose (tracedump, torch and transformers only), so it can be copied to a lent GPU
machine and run as ``python benchmarks/gpu.py [--quick] [--out gpu.json]``. It prints one JSON:

* ``untouched`` / ``full`` / ``naive`` / ``last_row`` / ``stats``: step times (forward + device sync,
  so queued kernels and copies are counted), interleaved, medians; ``full`` also end-to-end until
  its pass is on disk. Naive = per hook a blocking ``.detach().cpu()``, ``torch.save`` at pass end.
* ``d2h``: bytes/s the dumper achieves (pass bytes / added step time) vs a plain ``copy_`` of the
  same bytes into pinned memory, as one buffer and as the same tensors one by one.
* ``sync_check``: ``torch.cuda.set_sync_debug_mode`` around a dumped forward (``"warn"``: syncs
  counted; ``"error"``: the first one raises), as shipped (tracedump lifts the mode around its own
  copies, by design) and with that escape disabled, which shows the copies themselves never
  synchronise; errors the dumper swallowed are counted. The untouched model is the reference (the
  model may sync by itself) and the naive baseline the contrast. ``no_sync_per_hook`` sums it up.
* ``cuda_graph``: ``TRACEDUMP_DUMP_COMPILED=1`` inside a CUDA graph: a small fp32 model
  compiled with inductor, warmed up, captured by hand into one ``torch.cuda.CUDAGraph`` and replayed
  with each new input copied into the static one; its dump against an eager dump of the same inputs,
  ``tracedump diff``'s exit code (0: every replay dumped what eager computes, within rounding) and
  ``ok`` (exit 0, one pass per call and replay, no error in the manifest).
  ``--cuda-graph-only`` runs this check alone (a short device script).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few rounds: a smoke run")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    parser.add_argument("--cuda-graph-only", action="store_true", help="only the COMPILED + CUDA graph check")
    parser.add_argument("--cpu-dry-run", action="store_true", help=argparse.SUPPRESS)  # tests the logic
    args = parser.parse_args(argv)
    if args.cpu_dry_run:
        global DEVICE
        DEVICE = "cpu"
        result = run(quick=True, tokens=min(args.tokens, 32))
        result["cuda_graph"] = cuda_graph_check()  # skipped: the check's logic is tested with fakes
    elif not torch.cuda.is_available():
        result: dict[str, Any] = {"skipped": "no CUDA device: torch.cuda.is_available() is False"}
        print("gpu.py: skipped, no CUDA device", file=sys.stderr)
    elif args.cuda_graph_only:
        result = {"cuda_graph": cuda_graph_check()}
    else:
        result = run(quick=args.quick, tokens=args.tokens)
        result["cuda_graph"] = cuda_graph_check()
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


# ---------------------------------------------------------------------------------------------- model


DEVICE = "cuda"


def sync() -> None:
    """Wait for the device; a no-op in the CPU dry run, which only exercises this script's logic."""
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def build_model(tokens: int) -> tuple[nn.Module, torch.Tensor]:
    """The CPU benchmark's Llama config, bf16 on the GPU; seeded random weights, no download."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=512,
        num_hidden_layers=8,
        intermediate_size=1376,
        num_attention_heads=8,
        num_key_value_heads=8,
        vocab_size=8000,
        max_position_embeddings=max(512, tokens),
        use_cache=False,
    )
    model = LlamaForCausalLM(config).to(device=DEVICE, dtype=torch.bfloat16).eval()
    ids = torch.randint(0, config.vocab_size, (1, tokens), device=DEVICE)
    return model, ids


def forward(model: nn.Module, ids: torch.Tensor) -> Any:
    return model(input_ids=ids, use_cache=False)


def synced(fn: Callable[[], Any]) -> float:
    """Seconds from a drained device to ``fn``'s work finished on it."""
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


# ---------------------------------------------------------------------------------------------- naive


class NaiveDumper:
    """What peers do: per hook a blocking ``.detach().cpu()`` into a dict, ``torch.save`` at pass end."""

    def __init__(self, model: nn.Module, directory: Path) -> None:
        self.directory = directory
        self.captured: dict[str, torch.Tensor] = {}
        self.passes = 0
        leaves = [(n, m) for n, m in model.named_modules() if next(m.children(), None) is None]
        self.handles = [m.register_forward_hook(self._hook(n)) for n, m in leaves]
        self.handles.append(model.register_forward_hook(self._end_pass))

    def _hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            outputs = output if isinstance(output, (tuple, list)) else (output,)
            for i, tensor in enumerate(outputs):
                if isinstance(tensor, torch.Tensor):
                    self.captured[f"{name}[{i}]"] = tensor.detach().cpu()

        return hook

    def _end_pass(self, module: nn.Module, args: Any, output: Any) -> None:
        path = self.directory / f"naive{self.passes:05d}.pt"
        torch.save(self.captured, path)
        path.unlink()
        self.captured = {}
        self.passes += 1

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


# ---------------------------------------------------------------------------------------------- run


def run(quick: bool = False, tokens: int = 256) -> dict[str, Any]:
    import tracedump

    rounds, warmup = (5, 2) if quick else (20, 3)
    base, ids = build_model(tokens)
    with tempfile.TemporaryDirectory(prefix="tracedump-gpu-") as scratch, torch.inference_mode():
        root = Path(scratch)
        dumped = {
            mode: _attach(tracedump, copy.deepcopy(base), root / mode, mode)
            for mode in ("full", "last_row", "stats")
        }
        naive_model = copy.deepcopy(base)
        (root / "naive").mkdir()
        naive = NaiveDumper(naive_model, root / "naive")
        try:
            steps: dict[str, Callable[[], dict[str, float]]] = {
                "untouched": lambda: {"step": synced(lambda: forward(base, ids))},
                "naive": lambda: {"step": synced(lambda: forward(naive_model, ids))},
                **{mode: _dumped_step(model, dumper, ids) for mode, (model, dumper) in dumped.items()},
            }
            samples = _interleave(steps, rounds, warmup)
            full_model, full_dumper = dumped["full"]
            pass_tensors = _pass_tensors(full_model, full_dumper, ids)
            d2h = _d2h(samples, pass_tensors)
            sync = {
                "untouched": _sync_check(lambda: forward(base, ids), escape=True),
                "as_shipped": _sync_check(lambda: forward(full_model, ids), escape=True, dumper=full_dumper),
                "copies_checked": _sync_check(
                    lambda: forward(full_model, ids), escape=False, dumper=full_dumper
                ),
                "naive": _sync_check(lambda: forward(naive_model, ids), escape=True),
            }
            _flush(full_dumper)
        finally:
            naive.close()
            for _, dumper in dumped.values():
                with contextlib.redirect_stderr(io.StringIO()):
                    dumper.close()
    return _summary(samples, d2h, sync, tokens)


def _attach(tracedump: Any, model: nn.Module, directory: Path, mode: str) -> tuple[nn.Module, Any]:
    dumper = tracedump.attach(model, {"dir": str(directory), "mode": mode, "token_dim": 1})
    if dumper is None:
        raise RuntimeError("attach() returned None: is TRACEDUMP_DUMP_DIR set to an empty value?")
    return model, dumper


def _dumped_step(model: nn.Module, dumper: Any, ids: torch.Tensor) -> Callable[[], dict[str, float]]:
    def step() -> dict[str, float]:
        sync()
        start = time.perf_counter()
        forward(model, ids)
        sync()
        returned = time.perf_counter()
        _flush(dumper)
        done = time.perf_counter()
        for path in dumper.run_dir.glob("pass*.safetensors"):
            path.unlink()
        return {"step": returned - start, "e2e": done - start}

    return step


def _flush(dumper: Any) -> None:
    """Wait until every submitted pass is on disk: ``Dumper.flush()`` where it exists, else the writer's."""
    flush = getattr(dumper, "flush", None)
    (flush or dumper.rundir.writer.flush)()


def _interleave(
    steps: dict[str, Callable[[], dict[str, float]]], rounds: int, warmup: int
) -> dict[str, dict[str, list[float]]]:
    names = list(steps)
    for _ in range(warmup):
        for name in names:
            steps[name]()
    samples: dict[str, dict[str, list[float]]] = {name: {} for name in names}
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            for key, value in steps[name]().items():
                samples[name].setdefault(key, []).append(value)
    return samples


def _pass_tensors(model: nn.Module, dumper: Any, ids: torch.Tensor) -> list[torch.Tensor]:
    """The device tensors one full pass captures, collected by a probe on the same leaves."""
    captured: list[torch.Tensor] = []

    def probe(module: nn.Module, args: Any, output: Any) -> None:
        for tensor in output if isinstance(output, (tuple, list)) else (output,):
            if isinstance(tensor, torch.Tensor):
                captured.append(tensor.detach().clone())

    handles = [m.register_forward_hook(probe) for _, m in dumper.modules]
    try:
        forward(model, ids)
        _flush(dumper)
    finally:
        for handle in handles:
            handle.remove()
    return captured


def _d2h(samples: dict[str, dict[str, list[float]]], tensors: list[torch.Tensor]) -> dict[str, float]:
    """Dumper bytes/s vs pinned ``copy_`` of the same bytes, as one buffer and tensor by tensor."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    pin = DEVICE == "cuda"
    flat = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
    flat_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    hosts = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for t in tensors]

    def one_buffer() -> None:
        flat_host.copy_(flat, non_blocking=True)

    def per_tensor() -> None:
        for host, tensor in zip(hosts, tensors, strict=True):
            host.copy_(tensor, non_blocking=True)

    for fn in (one_buffer, per_tensor):
        synced(fn)
    plain = statistics.median(synced(one_buffer) for _ in range(10))
    chunked = statistics.median(synced(per_tensor) for _ in range(10))
    added = statistics.median(
        f - u for f, u in zip(samples["full"]["step"], samples["untouched"]["step"], strict=True)
    )
    return {
        "pass_MB": nbytes / 1e6,
        "tensors": len(tensors),
        "added_ms": added * 1e3,
        "dumper_GBps": nbytes / added / 1e9 if added > 0 else float("inf"),
        "pinned_copy_GBps": nbytes / plain / 1e9,
        "pinned_copy_per_tensor_GBps": nbytes / chunked / 1e9,
    }


def _sync_check(fn: Callable[[], Any], *, escape: bool, dumper: Any = None) -> dict[str, Any]:
    """Syncs during one forward: counted in ``"warn"`` mode, then ``"error"`` mode around a second one.

    ``escape=False`` disables tracedump's ``allow_sync()``, so its own copies are checked too. A
    dumper reports a failing capture instead of raising into the forward, so the errors it swallowed
    are counted as well. Compare with the untouched model: the model itself may sync.
    """
    import tracedump.dump.cuda as tracedump_cuda

    if DEVICE != "cuda":
        return {"sync_warnings": None, "raised": "not checked: CPU dry run", "errors_swallowed": None,
                "writer_failure": None}  # fmt: skip
    errors_before = dumper.skipped["errors"] if dumper is not None else 0
    with _no_allow_sync(tracedump_cuda) if not escape else contextlib.nullcontext():
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                fn()
            finally:
                torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        raised = None
        torch.cuda.set_sync_debug_mode("error")
        try:
            fn()
        except RuntimeError as e:
            raised = str(e).splitlines()[0]
        finally:
            torch.cuda.set_sync_debug_mode(0)
            torch.cuda.synchronize()
    return {
        "sync_warnings": sum("synchroniz" in str(w.message) for w in caught),
        "raised": raised,
        "errors_swallowed": (dumper.skipped["errors"] - errors_before) if dumper is not None else 0,
        "writer_failure": dumper.failure if dumper is not None else None,  # a sync in the writer thread
    }


@contextlib.contextmanager
def _no_allow_sync(module: Any) -> Iterator[None]:
    """Replace tracedump's sync escape with a no-op, so its copies run under the debug mode too."""
    original = module.allow_sync
    module.allow_sync = contextlib.nullcontext
    try:
        yield
    finally:
        module.allow_sync = original


def _no_added_sync(sync: dict[str, Any]) -> bool | None:
    """True when a dumped forward syncs exactly as often as the untouched one and swallowed nothing."""
    base = sync["untouched"]
    if base["sync_warnings"] is None:
        return None
    return all(
        sync[k]["sync_warnings"] == base["sync_warnings"]
        and sync[k]["errors_swallowed"] == 0
        and sync[k]["writer_failure"] is None
        and (sync[k]["raised"] is None) == (base["raised"] is None)
        for k in ("as_shipped", "copies_checked")
    )


def _summary(
    samples: dict[str, dict[str, list[float]]], d2h: dict[str, float], sync: dict[str, Any], tokens: int
) -> dict[str, Any]:
    base = samples["untouched"]["step"]

    def ratio(name: str, key: str = "step") -> float:
        return statistics.median(v / b for v, b in zip(samples[name][key], base, strict=True))

    def ms(name: str, key: str = "step") -> float:
        return statistics.median(samples[name][key]) * 1e3

    return {
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (dry run)",
        "torch_version": torch.__version__,
        "dtype": "bfloat16",
        "tokens": tokens,
        "untouched_ms": ms("untouched"),
        "full": {
            "ratio_vs_untouched": ratio("full"),
            "ratio_e2e_vs_untouched": ratio("full", "e2e"),
            "speedup_vs_naive": statistics.median(
                n / f for n, f in zip(samples["naive"]["step"], samples["full"]["step"], strict=True)
            ),
            "step_ms": ms("full"),
            "e2e_ms": ms("full", "e2e"),
            "naive_step_ms": ms("naive"),
        },
        "last_row": {"ratio": ratio("last_row"), "step_ms": ms("last_row")},
        "stats": {"ratio": ratio("stats"), "step_ms": ms("stats")},
        "d2h": d2h,
        "sync_check": sync,
        "no_sync_per_hook": _no_added_sync(sync),
    }


# ---------------------------------------------------------------------------------------------- CUDA graph


def cuda_graph_check(steps: int = 3) -> dict[str, Any]:
    """``COMPILED=1`` taps replayed by a CUDA graph, against an eager dump of the same inputs.

    The compiled model is warmed up on a side stream (it compiles there, and that call's taps run
    directly: pass 0), captured once into a ``torch.cuda.CUDAGraph`` (the taps copy into buffers of
    the graph: no pass), then replayed ``steps`` times with a new input copied into the static one
    (each replay one pass, :mod:`tracedump.dump.replays`). The eager model dumps the same
    ``steps + 1`` inputs. ``exit_code`` is ``tracedump diff GRAPH EAGER``'s; a failure of the check
    itself is returned as ``error`` so the rest of the JSON still prints."""
    if DEVICE != "cuda":
        return {"skipped": "needs CUDA (not run in the CPU dry run)"}
    try:
        return _cuda_graph_check(steps)
    except Exception as e:  # one check failing must not lose the figures of the others
        return {"error": f"{type(e).__name__}: {e}"}


def _cuda_graph_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64), nn.LayerNorm(64), nn.Linear(64, 64)
    ).to(device=DEVICE, dtype=torch.float32)


def _cuda_graph_inputs(count: int) -> list[torch.Tensor]:
    return [torch.randn(8, 64, device=DEVICE) for _ in range(count)]


def _cuda_graph_check(steps: int) -> dict[str, Any]:
    import tracedump
    from tracedump.cli import main as cli

    torch._dynamo.reset()
    eager, graphed = _cuda_graph_model(), _cuda_graph_model()
    inputs = _cuda_graph_inputs(steps + 1)
    with tempfile.TemporaryDirectory(prefix="tracedump-gpu-graph-") as scratch, torch.no_grad():
        root = Path(scratch)
        eager_dumper = tracedump.attach(eager, {"dir": str(root / "eager")})
        dumper = tracedump.attach(graphed, {"dir": str(root / "graph"), "compiled": True})
        if eager_dumper is None or dumper is None:
            raise RuntimeError("attach() returned None")
        for x in inputs:
            eager(x)
        eager_dumper.close()
        compiled = torch.compile(graphed)
        static = inputs[0].clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            compiled(static)  # compiles; its taps run directly (pass 0)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            compiled(static)
        for x in inputs[1:]:
            static.copy_(x)
            graph.replay()
        torch.cuda.synchronize()
        dumper.close()
        report = root / "report.json"
        with contextlib.redirect_stdout(io.StringIO()):
            status = cli(
                [
                    "diff",
                    str(dumper.run_dir),
                    str(eager_dumper.run_dir),
                    "--json",
                    str(report),
                    "--no-progress",
                ]
            )
        manifest = json.loads((dumper.run_dir / "manifest.json").read_text())
        summary = json.loads(report.read_text()).get("summary", {}) if report.exists() else {}
        torch._dynamo.reset()
        passes = manifest.get("passes", {}).get("indices")
        return {
            "ok": status == 0 and passes == list(range(steps + 1)) and not manifest.get("errors"),
            "exit_code": status,
            "passes": passes,
            "expected_passes": list(range(steps + 1)),
            "compiled": manifest.get("compiled"),
            "errors": manifest.get("errors"),
            "first_divergence": summary.get("first_divergence"),
        }


if __name__ == "__main__":
    sys.exit(main())
