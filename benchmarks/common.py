"""Shared pieces of the benchmarks: the model, interleaved timing, hook census, naive baseline, RSS.

Every figure the benchmarks report is a ratio of two things measured side by side in one process,
interleaved round by round, so that load from other processes on a small shared machine hits both
sides alike. Medians, never means: one descheduled round must not move the answer.
"""

from __future__ import annotations

import contextlib
import math
import os
import platform
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.modules.module as torch_module
from torch import nn
from torch.nn import functional as F

ENV_PREFIX = "TRACEDUMP_DUMP_"
MiB = 1 << 20


# ---------------------------------------------------------------------------------------------- model


@dataclass(frozen=True)
class ModelSpec:
    """The benchmark model: a Llama-shaped decoder, sized so a forward takes 50-200 ms on 2 CPU cores.

    ``kind="llama"`` builds HF ``LlamaForCausalLM`` from a config (realistic module tree and tuple
    outputs); ``kind="mini"`` is the same architecture in plain torch, for the smoke test and
    ``--quick``, because importing transformers alone takes several seconds on a loaded 2-core box.
    """

    kind: str = "llama"
    hidden: int = 512
    layers: int = 8
    intermediate: int = 1376
    heads: int = 8
    vocab: int = 8000
    tokens: int = 256
    seed: int = 0


FULL_SPEC = ModelSpec()
QUICK_SPEC = ModelSpec(kind="mini", hidden=256, layers=2, intermediate=688, heads=4, vocab=2000, tokens=64)


def build_model(spec: ModelSpec) -> nn.Module:
    """Seeded random weights, eval mode, no download."""
    torch.manual_seed(spec.seed)
    if spec.kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            hidden_size=spec.hidden,
            num_hidden_layers=spec.layers,
            intermediate_size=spec.intermediate,
            num_attention_heads=spec.heads,
            num_key_value_heads=spec.heads,
            vocab_size=spec.vocab,
            max_position_embeddings=max(512, spec.tokens),
            use_cache=False,
        )
        return LlamaForCausalLM(config).eval()
    if spec.kind == "mini":
        return MiniDecoder(spec).eval()
    raise ValueError(f"unknown model kind {spec.kind!r}")


def make_inputs(spec: ModelSpec) -> torch.Tensor:
    generator = torch.Generator().manual_seed(spec.seed + 1)
    return torch.randint(0, spec.vocab, (1, spec.tokens), generator=generator)


def forward(model: nn.Module, ids: torch.Tensor) -> Any:
    """One forward as an engine runs it: no KV cache (HF), no autograd."""
    if isinstance(model, MiniDecoder):
        return model(ids)
    return model(input_ids=ids, use_cache=False)


def param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def model_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters()) + sum(
        b.numel() * b.element_size() for b in model.buffers()
    )


def leaf_count(model: nn.Module) -> int:
    return sum(1 for m in model.modules() if next(iter(m.children()), None) is None)


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.v_proj = nn.Linear(hidden, hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape

        def split(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, self.heads, h // self.heads).transpose(1, 2)

        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, h))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden)
        self.self_attn = Attention(spec.hidden, spec.heads)
        self.post_attention_layernorm = RMSNorm(spec.hidden)
        self.mlp = MLP(spec.hidden, spec.intermediate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class MiniDecoder(nn.Module):
    """Llama's architecture without transformers: embedding, blocks (attention + SwiGLU MLP), head."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab, spec.hidden)
        self.layers = nn.ModuleList(Block(spec) for _ in range(spec.layers))
        self.norm = RMSNorm(spec.hidden)
        self.lm_head = nn.Linear(spec.hidden, spec.vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


# ---------------------------------------------------------------------------------------------- timing


def median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator > 0 else math.nan


def timed(fn: Callable[[], Any]) -> float:
    """Seconds one call of ``fn`` takes (wall clock: the host waits for all of it)."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def interleave(
    variants: dict[str, Callable[[], dict[str, float]]], rounds: int, warmup: int = 1
) -> dict[str, dict[str, list[float]]]:
    """Run every variant once per round, in an order rotated each round; samples per variant and key.

    A variant returns named durations in seconds (e.g. ``{"step": 0.12, "e2e": 0.3}``). Rotating the
    order means no variant always runs right after the same neighbour (cache, writer, allocator).
    Sample ``i`` of every variant comes from round ``i``, so :func:`paired_ratio` can pair them.
    """
    names = list(variants)
    for _ in range(warmup):
        for name in names:
            variants[name]()
    samples: dict[str, dict[str, list[float]]] = {name: {} for name in names}
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            for key, value in variants[name]().items():
                samples[name].setdefault(key, []).append(value)
    return samples


def paired_ratio(numerators: list[float], denominators: list[float]) -> float:
    """Median of per-round ratios: both sides of a pair ran seconds apart, under the same load."""
    return median([ratio(n, d) for n, d in zip(numerators, denominators, strict=True)])


def best_per_block(
    samples: dict[str, dict[str, list[float]]], block: int
) -> dict[str, dict[str, list[float]]]:
    """The minimum of each run of ``block`` consecutive rounds, per variant and key.

    For costs far below the noise (the off path), the best of a few back-to-back tries per round is
    the stable estimator: another process can only ever add time to a run, never remove it.
    """
    return {
        name: {
            key: [min(v[i : i + block]) for i in range(0, len(v) - block + 1, block)]
            for key, v in keys.items()
        }
        for name, keys in samples.items()
    }


def per_call_seconds(fn: Callable[[], Any], calls: int, repeats: int = 5) -> float:
    """Median over ``repeats`` of the mean time of ``calls`` back-to-back calls: for tiny costs."""
    results = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        results.append((time.perf_counter() - start) / calls)
    return median(results)


# ---------------------------------------------------------------------------------------------- hooks


@dataclass
class HookCensus:
    """Every hook dict torch keeps, per module and process-wide, and the live threads."""

    module_hooks: dict[str, int]
    global_hooks: dict[str, int]
    threads: list[str]

    @property
    def total(self) -> int:
        return sum(self.module_hooks.values()) + sum(self.global_hooks.values())

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "total": self.total}


def hook_census(model: nn.Module) -> HookCensus:
    """Count hooks of every kind: any ``*hooks*`` dict on any module, and torch's global hook dicts."""
    module_hooks: dict[str, int] = {}
    for module in model.modules():
        for attr, value in vars(module).items():
            if "hook" in attr and isinstance(value, dict) and attr != "_is_full_backward_hook":
                module_hooks[attr] = module_hooks.get(attr, 0) + len(value)
    global_hooks = {
        name: len(value)
        for name, value in vars(torch_module).items()
        if name.startswith("_global_") and name.endswith("hooks") and isinstance(value, dict)
    }
    threads = sorted(t.name for t in threading.enumerate())
    return HookCensus(module_hooks, global_hooks, threads)


def assert_untouched(model: nn.Module, before: HookCensus) -> HookCensus:
    """Fail loudly if the off path left anything behind: a hook of any kind or a new thread."""
    after = hook_census(model)
    hooked = {k: v for k, v in {**after.module_hooks, **after.global_hooks}.items() if v}
    if hooked:
        raise AssertionError(f"tracedump off path: hooks registered: {hooked}")
    new_threads = sorted(set(after.threads) - set(before.threads))
    if new_threads:
        raise AssertionError(f"tracedump off path: threads started: {new_threads}")
    return after


# ---------------------------------------------------------------------------------------------- env


@contextlib.contextmanager
def clean_env() -> Iterator[None]:
    """No ``TRACEDUMP_DUMP_*`` variable during the block: benchmarks pass their settings as config,
    and an operator's env var (which wins over config) must not change what is measured."""
    saved = {k: v for k, v in os.environ.items() if k.upper().startswith(ENV_PREFIX)}
    for key in saved:
        del os.environ[key]
    try:
        yield
    finally:
        os.environ.update(saved)


@contextlib.contextmanager
def scratch_dir(prefix: str = "tracedump-bench-") -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def remove_files(directory: Path, pattern: str = "*.safetensors") -> None:
    """Delete written pass files between rounds so a long benchmark does not fill the disk."""
    for path in directory.rglob(pattern):
        with contextlib.suppress(OSError):
            path.unlink()


# ---------------------------------------------------------------------------------------------- naive


class NaiveDumper:
    """What peers do: per hook ``out.detach().cpu()`` into a dict, ``torch.save`` at the pass end.

    Synchronous on purpose. On CPU ``.cpu()`` returns the same storage (no copy), so here the
    baseline is "keep references + pickle the dict to disk in the forward's thread"; on a GPU it is a
    blocking device-to-host copy per hook.
    """

    def __init__(self, model: nn.Module, directory: Path) -> None:
        self.directory = directory
        self.captured: dict[str, torch.Tensor] = {}
        self.passes = 0
        self.handles = [
            module.register_forward_hook(self._hook(name or "root"))
            for name, module in model.named_modules()
            if next(iter(module.children()), None) is None
        ]
        self.handles.append(model.register_forward_hook(self._end_pass))

    def _hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            for suffix, tensor in _tensor_leaves(output):
                self.captured[name + suffix] = tensor.detach().cpu()

        return hook

    def _end_pass(self, module: nn.Module, args: Any, output: Any) -> None:
        torch.save(self.captured, self.directory / f"naive{self.passes:05d}.pt")
        self.captured = {}
        self.passes += 1

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def _tensor_leaves(value: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        yield prefix, value
    elif isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            yield from _tensor_leaves(item, f"{prefix}[{i}]")


# ---------------------------------------------------------------------------------------------- machine


def machine_info() -> dict[str, Any]:
    return {
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "load_avg_1m_at_start": os.getloadavg()[0],
    }


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def proc_status_kib(field: str) -> int | None:
    """A ``/proc/self/status`` field in KiB (``VmRSS``, ``VmHWM``); None off Linux."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return None


def reset_peak_rss() -> bool:
    """Reset ``VmHWM`` to the current RSS (Linux >= 4.0); False where the kernel refuses."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True
