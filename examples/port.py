"""An independent port of the reference Llama, written the way an engine author writes one.

Nothing here is shared with ``transformers`` except the weights: the module tree has its own names
(``blocks.{i}.attn.qkv`` rather than ``model.layers.{i}.self_attn.q_proj``), q/k/v and gate/up are
fused into single matmuls, and RMSNorm and rotary are re-implemented. That is what makes comparing
a port with its reference hard by hand, and what ``tracedump diff --map`` is for.

The port takes a per-layer rotary base (as models that mix local and global attention layers do).
``bug_layer`` plants a realistic slip: that one layer gets the wrong base (the long-context base
500000 instead of the config's 10000). Position 0 is unaffected by any base and later positions
only a little, so the logits still look plausible; tracedump names the layer.

Run as an engine would, with dumping switched on by env vars only::

    TRACEDUMP_DUMP_DIR=/tmp/port python examples/port.py --bug-layer 2
"""

from __future__ import annotations

import argparse
import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from reference import DTYPES, build_reference, prompt_ids
from torch import nn

import tracedump

WRONG_ROPE_BASE = 500_000.0


@dataclass(frozen=True)
class PortConfig:
    """The port's own config: what an engine reads from a checkpoint's config.json."""

    vocab: int
    dim: int
    ffn_dim: int
    layers: int
    heads: int
    kv_heads: int
    norm_eps: float
    rope_bases: tuple[float, ...]

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    @classmethod
    def from_hf(cls, hf_config: object, bug_layer: int | None = None) -> PortConfig:
        """Translate a HF ``LlamaConfig``; ``bug_layer`` gets the wrong rotary base."""
        layers = hf_config.num_hidden_layers
        if bug_layer is not None and not 0 <= bug_layer < layers:
            raise ValueError(f"bug_layer must be in 0..{layers - 1}, got {bug_layer}")
        base = float(hf_config.rope_parameters["rope_theta"])
        bases = tuple(WRONG_ROPE_BASE if i == bug_layer else base for i in range(layers))
        return cls(
            vocab=hf_config.vocab_size,
            dim=hf_config.hidden_size,
            ffn_dim=hf_config.intermediate_size,
            layers=layers,
            heads=hf_config.num_attention_heads,
            kv_heads=hf_config.num_key_value_heads,
            norm_eps=hf_config.rms_norm_eps,
            rope_bases=bases,
        )


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in fp32 whatever the activation dtype (as checkpoints expect)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + self.eps)
        return self.scale * normed.to(x.dtype)


class Rotary(nn.Module):
    """Rotary position embedding in the "rotate half" layout, with this layer's own base."""

    def __init__(self, head_dim: int, base: float) -> None:
        super().__init__()
        self.base = base
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
        self.register_buffer("inv_freq", 1.0 / (base**exponents), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` of shape ``[batch, heads, seq, head_dim]`` by the angles of ``positions``."""
        angles = positions.float()[:, None] * self.inv_freq[None, :]
        cos = torch.cat((angles, angles), -1).cos().to(x.dtype)
        sin = torch.cat((angles, angles), -1).sin().to(x.dtype)
        first, second = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-second, first), -1) * sin


class Attention(nn.Module):
    """Causal grouped-query attention with one fused q/k/v projection."""

    def __init__(self, config: PortConfig, rope_base: float) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = config.heads, config.kv_heads, config.head_dim
        qkv_dim = (config.heads + 2 * config.kv_heads) * config.head_dim
        self.qkv = nn.Linear(config.dim, qkv_dim, bias=False)
        self.out = nn.Linear(config.heads * config.head_dim, config.dim, bias=False)
        self.rotary = Rotary(config.head_dim, rope_base)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q_dim, kv_dim = self.heads * self.head_dim, self.kv_heads * self.head_dim
        q, k, v = self.qkv(x).split((q_dim, kv_dim, kv_dim), dim=-1)
        q = q.view(batch, seq, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = self.rotary(q, positions), self.rotary(k, positions)
        context = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.out(context.transpose(1, 2).reshape(batch, seq, q_dim))


class MLP(nn.Module):
    """SwiGLU with one fused gate/up projection."""

    def __init__(self, config: PortConfig) -> None:
        super().__init__()
        self.gate_up = nn.Linear(config.dim, 2 * config.ffn_dim, bias=False)
        self.down = nn.Linear(config.ffn_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    """Pre-norm decoder block: ``x + attn(norm1(x))``, then ``x + mlp(norm2(x))``."""

    def __init__(self, config: PortConfig, rope_base: float) -> None:
        super().__init__()
        self.norm1 = RMSNorm(config.dim, config.norm_eps)
        self.attn = Attention(config, rope_base)
        self.norm2 = RMSNorm(config.dim, config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), positions)
        return x + self.mlp(self.norm2(x))


class PortLM(nn.Module):
    """The port: token ids ``[batch, seq]`` in, logits ``[batch, seq, vocab]`` out."""

    def __init__(self, config: PortConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab, config.dim)
        self.blocks = nn.ModuleList(Block(config, base) for base in config.rope_bases)
        self.final_norm = RMSNorm(config.dim, config.norm_eps)
        self.head = nn.Linear(config.dim, config.vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.tok_emb(ids)
        for block in self.blocks:
            x = block(x, positions)
        return self.head(self.final_norm(x))


@torch.no_grad()
def load_from_hf(port: PortLM, hf_model: nn.Module) -> PortLM:
    """Copy a HF Llama's weights into the port, fusing q/k/v and gate/up as the port expects."""
    hf = hf_model.model
    port.tok_emb.weight.copy_(hf.embed_tokens.weight)
    for block, layer in zip(port.blocks, hf.layers, strict=True):
        attn, mlp = layer.self_attn, layer.mlp
        block.norm1.scale.copy_(layer.input_layernorm.weight)
        block.norm2.scale.copy_(layer.post_attention_layernorm.weight)
        block.attn.qkv.weight.copy_(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
        block.attn.out.weight.copy_(attn.o_proj.weight)
        block.mlp.gate_up.weight.copy_(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
        block.mlp.down.weight.copy_(mlp.down_proj.weight)
    port.final_norm.scale.copy_(hf.norm.weight)
    port.head.weight.copy_(hf_model.lm_head.weight)
    return port


# The other planted slip (``--bug eps``): that layer's first norm with eps 3e-4 instead of the
# config's 1e-6, large enough to stand out of bf16 rounding noise, unlike the rotary one.
WRONG_NORM_EPS = 3e-4
# ``--bug mlp``: that layer's MLP output 2% too large (its down projection loaded scaled), a slip
# the size of bf16 noise that only a grafted run tells from rounding (examples/demo.py, step 4).
WRONG_MLP_SCALE = 1.02


def build_port(
    bug_layer: int | None = None, dtype: torch.dtype = torch.float32, bug: str = "rotary"
) -> PortLM:
    """The port holding the reference's weights (optionally with the planted bug), in ``dtype``."""
    reference = build_reference(torch.float32)
    port = PortLM(PortConfig.from_hf(reference.config, bug_layer if bug == "rotary" else None))
    if bug == "eps" and bug_layer is not None:
        port.blocks[bug_layer].norm1.eps = WRONG_NORM_EPS
    port = load_from_hf(port, reference)
    if bug == "mlp" and bug_layer is not None:
        with torch.no_grad():
            port.blocks[bug_layer].mlp.down.weight.mul_(WRONG_MLP_SCALE)
    return port.eval().to(dtype)


class PortEngine:
    """A minimal engine around the port, integrated with tracedump the way a real engine is:
    ``attach()`` once at start-up (env vars decide whether anything happens; unset, it costs one env
    lookup) and each step wrapped in ``dumper.step()``, so one step is one pass."""

    def __init__(self, model: PortLM) -> None:
        self.model = model
        self.dumper = tracedump.attach(model)  # None unless TRACEDUMP_DUMP_DIR is set

    def step(self, ids: torch.Tensor) -> torch.Tensor:
        with self.dumper.step() if self.dumper else contextlib.nullcontext(), torch.inference_mode():
            return self.model(ids)

    def close(self) -> None:
        if self.dumper is not None:
            self.dumper.close()


def main() -> None:
    parser = argparse.ArgumentParser(description="Run the port for one step (dumping: TRACEDUMP_DUMP_*).")
    parser.add_argument("--bug-layer", type=int, default=None, help="plant the rotary-base bug here")
    parser.add_argument(
        "--bug", choices=("rotary", "eps", "mlp"), default="rotary", help="which bug to plant"
    )
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    args = parser.parse_args()
    engine = PortEngine(build_port(args.bug_layer, DTYPES[args.dtype], args.bug))
    logits = engine.step(prompt_ids())
    engine.close()
    bug = f"bug in layer {args.bug_layer}" if args.bug_layer is not None else "no bug"
    print(f"port ({args.dtype}, {bug}): next token {int(logits[0, -1].argmax())}")


if __name__ == "__main__":
    main()
