"""A small but real generation engine with tracedump wired in, the way an inference engine would.

It exists to show (and to let the tests prove) that an engine's own machinery does not spoil a dump:
the dump of a real request stays comparable, tensor for tensor, with a batch-1 reference run of the
same model (plain ``attach()`` plus one ``model(prompt_ids)`` call).

What the engine does at start-up, in the order a vLLM/SGLang engine does it:

1. builds an HF ``transformers`` Llama from a tiny config with a fixed seed (random weights, no
   download);
2. calls ``tracedump.attach(model, config.dump)`` once: ``EngineConfig.dump`` is a
   :class:`tracedump.DumpConfig` field, and ``TRACEDUMP_DUMP_*`` env vars overlay it;
3. resolves its ``use_cuda_graph`` flag with ``tracedump.resolve_cuda_graph()`` (graph replay fires
   no hooks, so graphs are off while dumping);
4. runs a dummy *profile* forward of ``max_model_len`` tokens inside ``tracedump.profiling()``: it
   is never captured and takes no pass index;
5. runs *warm-up* batches (``warmup_batch_sizes`` sequences of one token each, the shapes a graph
   capture would record) after ``dumper.set_rows(batch)``: the token gate (other token count) or
   the row gate (more rows than ``MAX_ROWS``) refuses them, so they write nothing and take no index.

Then :meth:`Engine.generate` serves a request: one prefill step and one decode step per further
token, each inside ``dumper.step()`` and so one pass file each (pass 0 = prefill, pass n = the
n-th decode step). Decode steps feed one token per step through the HF KV cache. The greedy sampler
records the sampler's logits with ``record("logits", ..., once=True)`` (only the prefill's are
kept), the top-1/top-2 margin with ``record_step("margin", ...)`` (``margin_<n>`` lands in pass
n) and the chosen ids with ``record("token_ids", ...)`` (int64, stored as-is).

Run it: ``TRACEDUMP_DUMP_DIR=/tmp/d TRACEDUMP_DUMP_TOKENS=6 TRACEDUMP_DUMP_TOKEN_DIM=1 python
examples/engine.py --prompt-len 6``. Importing this module has no side effects.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import sys
from collections.abc import Sequence
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

import tracedump


class ModelConfig(BaseModel):
    """Shape of the tiny Llama. Weights are random from ``seed``, so two engines agree bit for bit."""

    model_config = ConfigDict(extra="forbid")

    vocab_size: int = 64
    hidden_size: int = 32
    intermediate_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 64
    seed: int = 0


class EngineConfig(BaseModel):
    """The engine's own config. ``dump`` embeds tracedump's settings; env vars overlay them."""

    model_config = ConfigDict(extra="forbid")

    model: ModelConfig = Field(default_factory=ModelConfig)
    device: str = "cpu"
    use_cuda_graph: bool = False
    max_model_len: int = Field(32, description="Tokens of the dummy profile forward (vLLM's profile run).")
    warmup_batch_sizes: tuple[int, ...] = Field(
        (4, 2), description="Batch sizes warmed up with one token per sequence, like graph capture sizes."
    )
    dump: tracedump.DumpConfig = Field(default_factory=tracedump.DumpConfig)
    dump_env_prefix: str = "TRACEDUMP_"


def build_model(config: ModelConfig) -> nn.Module:
    """The HF Llama with random weights from ``config.seed``: the same config gives the same model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_config = LlamaConfig(**config.model_dump(exclude={"seed"}))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = LlamaForCausalLM(hf_config)
    return model.eval()


class GreedySampler:
    """Picks the top-1 token and records what a comparison needs, without holding the dumper.

    It uses the module-level ``tracedump.record*`` functions, which go to the active dumper and are
    a cheap no-op when there is none, the way code deep inside an engine would call them.
    """

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        last = logits[:, -1, :].float()
        top2 = last.topk(2, dim=-1)
        next_tokens = top2.indices[:, 0]
        tracedump.record("logits", last, once=True)  # only the prefill's logits are kept
        tracedump.record_step("margin", top2.values[:, 0] - top2.values[:, 1])
        tracedump.record("token_ids", next_tokens)  # int64, stored as-is
        return next_tokens


class Engine:
    """Start-up (attach, profile run, warm-up) in ``__init__``; requests via :meth:`generate`."""

    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self.device = torch.device(self.config.device)
        self.model = build_model(self.config.model).to(self.device)
        self.dumper = tracedump.attach(self.model, self.config.dump, env_prefix=self.config.dump_env_prefix)
        self.use_cuda_graph = self._resolve_cuda_graph()
        self.sampler = GreedySampler()
        self._cache_kwarg = _cache_kwarg_name(self.model)
        self.profile_run()
        self.warm_up()

    # ------------------------------------------------------------------ start-up

    def _resolve_cuda_graph(self) -> bool:
        """Graphs only when asked, not dumping, and on CUDA (this engine captures none on CPU)."""
        wanted = tracedump.resolve_cuda_graph(self.config.use_cuda_graph, self.dumper)
        return wanted and self.device.type == "cuda"

    @torch.inference_mode()
    def profile_run(self) -> None:
        """The dummy forward that sizes memory: suspended, so it leaves no file and no pass index."""
        dummy = torch.zeros(1, self.config.max_model_len, dtype=torch.long, device=self.device)
        with tracedump.profiling():
            self.model(input_ids=dummy, use_cache=False)

    @torch.inference_mode()
    def warm_up(self) -> None:
        """One-token-per-sequence batches, as graph capture would run; the gates refuse them."""
        for batch in self.config.warmup_batch_sizes:
            self._set_rows(batch)
            dummy = torch.zeros(batch, 1, dtype=torch.long, device=self.device)
            with self._step():
                self.model(input_ids=dummy, use_cache=False)
        self._set_rows(None)

    # ------------------------------------------------------------------ serving

    @torch.inference_mode()
    def generate(self, prompt_ids: torch.Tensor | Sequence[int], max_new_tokens: int) -> torch.Tensor:
        """Greedy generation: a prefill step, then one decode step per further token.

        ``prompt_ids`` is one prompt (1-D) or equal-length prompts (2-D). Returns the new token ids,
        ``[batch, max_new_tokens]``.
        """
        ids = _as_batch(prompt_ids).to(self.device)
        self._set_rows(ids.shape[0])
        generated: list[torch.Tensor] = []
        cache: Any = None
        step_input = ids
        for _ in range(max_new_tokens):
            with self._step():
                output = self.model(input_ids=step_input, use_cache=True, **{self._cache_kwarg: cache})
                next_tokens = self.sampler(output.logits)
            cache = _cache_of(output)
            generated.append(next_tokens)
            step_input = next_tokens[:, None]
        return torch.stack(generated, dim=1) if generated else ids.new_empty(ids.shape[0], 0)

    def close(self) -> None:
        """Flush the dump and remove the hooks (also done at interpreter exit)."""
        if self.dumper is not None:
            self.dumper.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ helpers

    def _step(self) -> contextlib.AbstractContextManager[Any]:
        """One engine step = one pass; nothing at all when dumping is off."""
        return self.dumper.step() if self.dumper is not None else contextlib.nullcontext()

    def _set_rows(self, rows: int | None) -> None:
        if self.dumper is not None:
            self.dumper.set_rows(rows)


def _as_batch(prompt_ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
    ids = torch.as_tensor(prompt_ids, dtype=torch.long)
    if ids.dim() == 1:
        ids = ids[None, :]
    if ids.dim() != 2 or ids.shape[1] == 0:
        raise ValueError(f"expected a non-empty prompt [seq] or [batch, seq], got shape {list(ids.shape)}")
    return ids


def _cache_kwarg_name(model: nn.Module) -> str:
    """``cache`` in transformers 5.x, ``past_key_values`` before: the KV cache argument's name."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _cache_of(output: Any) -> Any:
    cache = output.get("cache") if hasattr(output, "get") else None
    return cache if cache is not None else output.past_key_values


def main(argv: Sequence[str] | None = None) -> int:
    """``python examples/engine.py``: start the engine, serve one prompt, say where the dump went."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-len", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=4)
    parser.add_argument("--use-cuda-graph", action="store_true")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    config = EngineConfig(use_cuda_graph=args.use_cuda_graph, device=args.device)
    prompt = torch.arange(args.prompt_len) % config.model.vocab_size
    with Engine(config) as engine:
        tokens = engine.generate(prompt, args.max_new_tokens)
        print(f"generated: {tokens[0].tolist()}")
        print(f"cuda graphs: {'on' if engine.use_cuda_graph else 'off'}")
        where = engine.dumper.run_dir if engine.dumper is not None else None
    print(f"dump: {where}" if where else "dump: off (set TRACEDUMP_DUMP_DIR to turn it on)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
