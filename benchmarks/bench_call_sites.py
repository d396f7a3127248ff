"""What naming shared modules by their caller and reading an HF forward's batch layout cost the host.

* **call sites**: a vLLM-shaped decoder whose layers share one rotary embedding (as ``get_rope``
  hands out), dumped with ``MODULES=leaves``: the step with call sites (the rotary's hook walks up
  the stack to the calling attention) against the same dump with them turned off (every call
  named ``...rotary_emb::callN`` as before), both against the untouched model; plus the cost of
  naming one call in a real forward (no copies), and of the walk when no site runs (fallback).
* **HF layout**: :class:`tracedump.dump.hf_layout.HFBatchLayout` once per outermost root forward,
  for a prefill ``[1, 256]`` and a batched decode step ``[8, 1]`` with a 512-column mask, when the
  pass keeps it (``wanted``: builds the JSON) and when it does not (bookkeeping only).

Run alone: ``python benchmarks/bench_call_sites.py [--quick]`` prints the JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import tracedump
import tracedump.dump.dumper as tracedump_dumper
from tracedump.dump.hf_layout import HFBatchLayout

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import common


class Rotary(nn.Module):
    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, ...]:
        angle = positions[:, None].float() * 1e-2
        cos, sin = angle.cos(), angle.sin()
        return q * cos - k * sin, k * cos + q * sin


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, rotary: Rotary) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.ModuleList(nn.Linear(hidden, hidden, bias=False) for _ in range(3))
        self.o_proj = nn.Linear(hidden, hidden, bias=False)
        self.rotary_emb = rotary  # one object, registered under every layer, as vLLM's

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (proj(x) for proj in self.qkv)
        q, k = self.rotary_emb(positions, q, k)
        tokens, hidden = x.shape
        q, k, v = (t.view(tokens, self.heads, -1).transpose(0, 1) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(0, 1).reshape(tokens, hidden))


class Layer(nn.Module):
    def __init__(self, hidden: int, heads: int, rotary: Rotary) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(hidden)
        self.self_attn = Attention(hidden, heads, rotary)
        self.post_attention_layernorm = nn.RMSNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden, bias=False)
        self.act = nn.SiLU()
        self.down = nn.Linear(4 * hidden, hidden, bias=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x))
        return x + self.down(self.act(self.up(self.post_attention_layernorm(x))))


class SharedRotaryDecoder(nn.Module):
    def __init__(self, hidden: int, layers: int, heads: int, vocab: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        rotary = Rotary()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(Layer(hidden, heads, rotary) for _ in range(layers))
        self.norm = nn.RMSNorm(hidden)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[0])
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(positions, x)
        return self.norm(x)


def _dumped(model: nn.Module, directory: Path, sites: bool) -> tuple[nn.Module, Any]:
    """A copy of ``model`` with its own dumper; ``sites=False`` names shared calls as before."""
    import copy

    copied = copy.deepcopy(model)
    original = tracedump_dumper.shared_names
    if not sites:
        tracedump_dumper.shared_names = lambda names, selected: {}  # type: ignore[assignment]
    try:
        dumper = tracedump.attach(copied, {"dir": str(directory), "modules": "leaves"})
    finally:
        tracedump_dumper.shared_names = original  # type: ignore[assignment]
    return copied, dumper


def run_call_sites(quick: bool) -> dict[str, Any]:
    hidden, layers, tokens = (64, 2, 16) if quick else (512, 8, 128)
    model = SharedRotaryDecoder(hidden, layers, heads=8, vocab=1000).eval()
    ids = torch.randint(0, 1000, (tokens,))
    rounds = 2 if quick else 15
    with common.scratch_dir() as directory:
        with_sites, dumper_on = _dumped(model, directory / "sites", sites=True)
        without, dumper_off = _dumped(model, directory / "plain", sites=False)
        assert dumper_on is not None and dumper_off is not None
        assert dumper_on.hooks.sites is not None and dumper_off.hooks.sites is None

        def step(target: nn.Module, dumper: Any) -> dict[str, float]:
            def once() -> None:
                with torch.no_grad():
                    target(ids)
                if dumper is not None:
                    dumper.flush()
                    common.remove_files(dumper.run_dir)

            return {"step": common.timed(once)}

        samples = common.interleave(
            {
                "untouched": lambda: step(model, None),
                "sites": lambda: step(with_sites, dumper_on),
                "no_sites": lambda: step(without, dumper_off),
            },
            rounds,
        )
        sites = dumper_on.hooks.sites
        hooked = next(iter(dumper_on.shared))
        # no site running (a call from the root): the walk goes the whole way up, then falls back
        fallback_ns = common.per_call_seconds(lambda: sites.name_for(hooked), calls=20_000) * 1e9
        dumper_on.close()
        dumper_off.close()
    step_of = {name: keys["step"] for name, keys in samples.items()}
    small = SharedRotaryDecoder(64, 8, heads=8, vocab=1000).eval()  # a forward of ~1 ms: µs show
    naming_us = _naming_us_per_call(small, ids[:8], rounds=20 if quick else 300)
    return {
        "model": {"hidden": hidden, "layers": layers, "tokens": tokens, "shared_calls_per_step": layers},
        "rounds": rounds,
        "untouched_ms": common.median(step_of["untouched"]) * 1e3,
        "sites_vs_no_sites": common.paired_ratio(step_of["sites"], step_of["no_sites"]),
        "sites_vs_untouched": common.paired_ratio(step_of["sites"], step_of["untouched"]),
        "no_sites_vs_untouched": common.paired_ratio(step_of["no_sites"], step_of["untouched"]),
        "naming_us_per_shared_call": naming_us,
        "fallback_lookup_ns": fallback_ns,
    }


class _Nothing:
    """A recorder that keeps nothing: the hooks' own cost, without copies."""

    def on_module_tensors(self, name: str, value: Any, *, is_input: bool) -> None:
        return None


def _naming_us_per_call(model: nn.Module, ids: torch.Tensor, rounds: int) -> float:
    """Microseconds naming one call of the shared rotary by its caller adds, in a real forward: the
    rotary hooked by a :class:`SharedOutputHook` (walks to the calling attention) against a plain
    :class:`OutputHook`, both handing to a recorder that keeps nothing; the best forward of each
    over interleaved rounds (another process only ever adds time), divided by the calls."""
    from tracedump.dump.hooks import CallSites, OutputHook, SharedOutputHook
    from tracedump.dump.selection import every_name, shared_names

    names = every_name(model)
    name, rotary = next((n, m) for n, m in names.items() if n.endswith("rotary_emb"))
    sites = CallSites(model, names, shared_names(names, [(name, rotary)]))
    hooks = {"plain": OutputHook(_Nothing(), name), "named": SharedOutputHook(_Nothing(), name, sites)}  # type: ignore[arg-type]
    best = dict.fromkeys(hooks, float("inf"))
    with torch.no_grad():
        for _ in range(rounds):
            for label, hook in hooks.items():
                handle = rotary.register_forward_hook(hook)
                best[label] = min(best[label], common.timed(lambda: model(ids)))
                handle.remove()
    calls = sum(1 for m in model.modules() if getattr(m, "rotary_emb", None) is rotary)
    return (best["named"] - best["plain"]) * 1e6 / calls


def run_hf_layout(quick: bool) -> dict[str, Any]:
    calls = 200 if quick else 20_000
    ones, ids = torch.ones, torch.randint
    prefill = {"input_ids": ids(0, 1000, (1, 256)), "attention_mask": ones(1, 256, dtype=torch.long)}
    decode = {"input_ids": ids(0, 1000, (8, 1)), "attention_mask": ones(8, 512, dtype=torch.long)}
    out: dict[str, Any] = {}
    for label, kwargs in (("prefill_1x256", prefill), ("decode_8x1_past511", decode)):
        for wanted in (True, False):
            layout = HFBatchLayout()
            seconds = common.per_call_seconds(lambda: layout.observe((), kwargs, wanted), calls=calls)  # noqa: B023
            out[f"{label}_{'kept' if wanted else 'bookkeeping'}_us"] = seconds * 1e6
    return out


def run(quick: bool = False) -> dict[str, Any]:
    """Both parts, as ``main`` prints them."""
    with common.clean_env():
        return {"call_sites": run_call_sites(quick), "hf_layout": run_hf_layout(quick)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(json.dumps(run(args.quick), indent=2))


if __name__ == "__main__":
    main()
