"""Calibrate ``tracedump diff``'s verdict: detection and false alarms over model families and bugs.

Builds tiny models of sixteen families (:data:`FAMILIES`) from configs (random weights, nothing
downloaded): a Llama (GQA, rotary), GPT2 (learned positions, LayerNorm), three MoE (Mixtral, whose
router weights come out of an fp32 softmax; Qwen2-MoE with a shared expert; OLMoE), T5
(encoder-decoder, ``wo`` kept in fp32 inside bf16 as HF does), a diffusers UNet run as a 25-step
DDIM loop (one pass per step), the rounding-order families, and families the verdict was
never tuned on: Phi3 (fused ``qkv_proj`` and ``gate_up_proj``), Bart (a second encoder-decoder) and
Gemma2 with every kind of bug. Each family is dumped

- clean, in fp32 and bf16, with eager and sdpa attention where the family has both;
- with one planted bug in one middle layer, in fp32 and bf16 (see :attr:`Family.bugs`);

and every case of :func:`cases` is compared with default flags (``--baseline`` where the case
says so), in every setting of :data:`SETTINGS` (ISA caps, seeds), each in a child process. Every
row carries its ratio to its allowance (:func:`ratios`) and whether it meets the margin goals
(clean <= 0.5x, bug >= 2x). The tables it prints (and writes as JSON with ``--out``) are the ones
in ``docs/comparator.md``; ``tests/test_compare_verdict.py`` runs a slice of it.

Run: ``python benchmarks/calibrate.py [--families llama,gpt2] [--settings native,capped]
[--out calibration.json] [--markdown]`` (``make calibrate``: all of them, about half a minute to
one minute a setting on one core). ``--merge A.json B.json ...`` makes one table of slices run one
at a time. Dumps go to a temp dir that is deleted at the end.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tracedump
from benchmarks import common

# Weights 5x HF's default init (0.02): attention logits of a few units, as in trained models, so
# position and scale bugs show in the attention weights instead of averaging out over a flat softmax.
INIT = 0.1
SEED = 0  # added to every family's weight seed (``--seed``): another draw of the same models
Inputs = Callable[[nn.Module], None]  # runs the model (one or several forwards) under no_grad
# The settings `make calibrate` runs, each in a process of its own (the env must be set before
# torch loads): this CPU as it is, its ISA capped to what an AVX2-only x86-64 has (ATen's kernels
# by ATEN_CPU_CAPABILITY, oneDNN's bf16 matmuls by ONEDNN_MAX_CPU_ISA: each changes the bits of a
# bf16 matmul here, measured), and other weights.
SETTINGS: dict[str, tuple[dict[str, str], int]] = {
    "native": ({}, 0),
    "capped": ({"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "AVX2"}, 0),
    "avx2": ({"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}, 0),
    "seed1": ({}, 1),
    "capped-seed2": ({"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "AVX2"}, 2),
}
# Every setting by default (native, the AVX2 caps, ATen's portable kernels, other seeds);
# avx2 gave the same bits as capped on the Intel Xeon of the first table, not on every CPU.
DEFAULT_SETTINGS = ("native", "capped", "avx2", "seed1", "capped-seed2")


# ----------------------------------------------------------------------------------- bugs


def _scale_output(module: nn.Module, factor: float) -> None:
    """The module's output (or the first element of its tuple) times ``factor``."""
    original = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        if isinstance(out, tuple):
            return (out[0] * factor, *out[1:])
        return out * factor

    module.forward = forward  # type: ignore[method-assign]


def _set_eps(module: nn.Module, eps: float) -> None:
    for attr in ("variance_epsilon", "eps"):
        if hasattr(module, attr):
            setattr(module, attr, eps)
            return
    raise AttributeError(f"{type(module).__name__} has no eps")


def _shift_rotary(attention: nn.Module, rotary: nn.Module) -> None:
    """Query positions off by one in this attention module only (keys keep theirs): the classic
    port bug. Shifting queries and keys together would change nothing, rotary being relative."""
    modeling = sys.modules[type(attention).__module__]
    original, apply = attention.forward, modeling.apply_rotary_pos_emb

    def forward(hidden_states: torch.Tensor, position_embeddings: Any, *args: Any, **kwargs: Any) -> Any:
        positions = torch.arange(1, hidden_states.shape[1] + 1, device=hidden_states.device)[None]
        shifted = rotary(hidden_states, positions)

        def apply_shifted(q: torch.Tensor, k: torch.Tensor, cos: Any, sin: Any, *rest: Any, **kw: Any) -> Any:
            return apply(q, k, *shifted, *rest, **kw)[0], apply(q, k, cos, sin, *rest, **kw)[1]

        modeling.apply_rotary_pos_emb = apply_shifted
        try:
            return original(hidden_states, position_embeddings, *args, **kwargs)
        finally:
            modeling.apply_rotary_pos_emb = apply

    attention.forward = forward  # type: ignore[method-assign]


def _scale_attention(attention: nn.Module, factor: float) -> None:
    attention.scaling = attention.scaling * factor


def _rope_theta(attention: nn.Module, rotary: nn.Module, factor: float = 2.0) -> None:
    """Rotary's base (``rope_theta``) x ``factor`` in this attention module only (a port that reads
    another config key): every rotated dim i of d turns at ``base^(-2i/d)`` x ``factor^(-2i/d)``.
    The layer's queries and keys both get the wrong angles; positions are those of one prefill."""
    wrong = copy.deepcopy(rotary)
    with torch.no_grad():
        inv_freq = wrong.inv_freq.float()
        dim = 2 * inv_freq.numel()
        exponent = torch.arange(0, dim, 2, dtype=torch.float32) / dim
        wrong.inv_freq.copy_((inv_freq / factor**exponent).to(wrong.inv_freq.dtype))
    original = attention.forward

    def forward(hidden_states: torch.Tensor, position_embeddings: Any, *args: Any, **kwargs: Any) -> Any:
        positions = torch.arange(hidden_states.shape[1], device=hidden_states.device)[None]
        return original(hidden_states, wrong(hidden_states, positions), *args, **kwargs)

    attention.forward = forward  # type: ignore[method-assign]


def _scale_skip(layer: nn.Module, factor: float) -> None:
    """The layer's skip path x ``factor``: its output plus ``(factor - 1)`` x its input, i.e. the
    residual stream it passes on scaled (a port that folds a scale into the wrong add). Wraps
    ``forward``, so a layer-level graft's inputs (set by a pre-hook) are the ones scaled."""
    original = layer.forward

    def forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        out = original(hidden_states, *args, **kwargs)
        extra = (factor - 1) * hidden_states
        if isinstance(out, tuple):
            return (out[0] + extra, *out[1:])
        return out + extra

    layer.forward = forward  # type: ignore[method-assign]


def _drop_softcap(attention: nn.Module) -> None:
    """Gemma2's attention-logit soft-capping forgotten in one layer (a port that reads no config)."""
    attention.attn_logit_softcapping = None


def _zero_bias(norm: nn.Module) -> None:
    """A LayerNorm's bias lost (a checkpoint key not loaded, left at its zero init)."""
    with torch.no_grad():
        norm.bias.zero_()


def _shift_dt(mixer: nn.Module, shift: float) -> None:
    """An SSM's dt bias off (dt = softplus(x W + b + shift)): every step's decay and input gate."""
    with torch.no_grad():
        mixer.dt_proj.bias.add_(shift)


def _scale_state_decay(mixer: nn.Module, factor: float) -> None:
    """An SSM's state decay A = -exp(A_log) scaled (a wrong A_log conversion)."""
    with torch.no_grad():
        mixer.A_log.add_(math.log(factor))


# ----------------------------------------------------------------------------------- families


@dataclass
class Family:
    """How to build, run and break one model family."""

    name: str
    build: Callable[[torch.dtype, str], nn.Module]  # (dtype, attention implementation)
    run: Inputs
    bugs: dict[str, Callable[[nn.Module], None]]
    layer: str  # regex of the module names the bugs live in (the expected first divergence)
    attentions: tuple[str, ...] = ("eager", "sdpa")
    baseline_bugs: tuple[str, ...] = ()  # bugs that bf16-vs-fp32 with --baseline must find
    extra: tuple[tuple[str, str, str, str | None], ...] = ()  # more cases: (a, b, expect, baseline)


def _random_norms(model: nn.Module, biases: bool = False) -> nn.Module:
    """Norm weights of 1 +- 0.2 (and biases of +-0.2 when ``biases``): with all-ones weights and
    zero biases some bugs (eps, scale, a wrong bias) hide in symmetry."""
    generator = torch.Generator().manual_seed(3 + SEED)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name.lower() or param.dim() != 1:
                continue
            if name.endswith("weight"):
                param.copy_(1 + 0.2 * torch.randn(param.shape, generator=generator))
            elif biases and name.endswith("bias"):
                param.copy_(0.2 * torch.randn(param.shape, generator=generator))
    return model


def _ids(count: int, vocab: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (1, count), generator=torch.Generator().manual_seed(seed))


def _lm_run(tokens: int, vocab: int) -> Inputs:
    ids = _ids(tokens, vocab)

    def run(model: nn.Module) -> None:
        model(input_ids=ids)

    return run


def llama_family() -> Family:
    from transformers import LlamaConfig, LlamaForCausalLM

    def build(dtype: torch.dtype, attention: str) -> nn.Module:
        config = LlamaConfig(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=6,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            initializer_range=INIT,
            attn_implementation=attention,
        )
        torch.manual_seed(SEED)
        return _random_norms(LlamaForCausalLM(config)).eval().to(dtype)

    layer = lambda m: m.model.layers[3]  # noqa: E731
    return Family(
        "llama",
        build,
        _lm_run(24, 128),
        {
            "rotary": lambda m: _shift_rotary(layer(m).self_attn, m.model.rotary_emb),
            "mlp_scale": lambda m: _scale_output(layer(m).mlp, 1.02),
            "softmax_scale": lambda m: _scale_attention(layer(m).self_attn, 1.05),
            "norm_eps": lambda m: _set_eps(layer(m).input_layernorm, 0.5),
        },
        r"\.layers\.3\.",
        baseline_bugs=("rotary", "norm_eps"),
    )


def gpt2_family() -> Family:
    from transformers import GPT2Config, GPT2LMHeadModel

    def build(dtype: torch.dtype, attention: str) -> nn.Module:
        config = GPT2Config(
            vocab_size=128,
            n_embd=64,
            n_layer=4,
            n_head=4,
            n_positions=64,
            initializer_range=INIT,
            attn_implementation=attention,
        )
        torch.manual_seed(SEED)
        return _random_norms(GPT2LMHeadModel(config)).eval().to(dtype)

    layer = lambda m: m.transformer.h[2]  # noqa: E731
    return Family(
        "gpt2",
        build,
        _lm_run(24, 128),
        {
            "mlp_scale": lambda m: _scale_output(layer(m).mlp, 1.02),
            "softmax_scale": lambda m: _scale_attention(layer(m).attn, 1.05),
            "norm_eps": lambda m: _set_eps(layer(m).ln_2, 1e-1),
        },
        r"\.h\.2\.",
        baseline_bugs=("norm_eps",),
    )


def mixtral_family() -> Family:
    from transformers import MixtralConfig, MixtralForCausalLM

    def build(dtype: torch.dtype, attention: str) -> nn.Module:
        config = MixtralConfig(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=64,
            initializer_range=INIT,
            attn_implementation=attention,
        )
        torch.manual_seed(SEED)
        return _random_norms(MixtralForCausalLM(config)).eval().to(dtype)

    layer = lambda m: m.model.layers[2]  # noqa: E731
    return Family(
        "mixtral",
        build,
        _lm_run(32, 128),
        {
            "rotary": lambda m: _shift_rotary(layer(m).self_attn, m.model.rotary_emb),
            "moe_scale": lambda m: _scale_output(layer(m).mlp, 1.02),
            "norm_eps": lambda m: _set_eps(layer(m).post_attention_layernorm, 0.1),
        },
        r"\.layers\.2\.",
        baseline_bugs=("rotary", "norm_eps"),
    )


def qwen2_moe_family() -> Family:
    """Eight experts, top-2, plus a shared expert: routing flips are common at 48 tokens."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    def build(dtype: torch.dtype, attention: str) -> nn.Module:
        config = Qwen2MoeConfig(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=96,
            moe_intermediate_size=48,
            shared_expert_intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_experts=8,
            num_experts_per_tok=2,
            max_position_embeddings=64,
            initializer_range=INIT,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            attn_implementation=attention,
        )
        torch.manual_seed(SEED)
        return _random_norms(Qwen2MoeForCausalLM(config)).eval().to(dtype)

    return _moe_family("qwen2moe", build)


def olmoe_family() -> Family:
    """Eight experts, top-2, no shared expert: eager vs sdpa swaps the order of chosen experts."""
    from transformers import OlmoeConfig, OlmoeForCausalLM

    def build(dtype: torch.dtype, attention: str) -> nn.Module:
        config = OlmoeConfig(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=48,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_experts=8,
            num_experts_per_tok=2,
            max_position_embeddings=64,
            initializer_range=INIT,
            attn_implementation=attention,
        )
        torch.manual_seed(SEED)
        return _random_norms(OlmoeForCausalLM(config)).eval().to(dtype)

    return _moe_family("olmoe", build)


def _moe_family(name: str, build: Callable[[torch.dtype, str], nn.Module]) -> Family:
    """An 8-expert MoE: its block scaled, and a norm's eps, in layer 2; 48 tokens so routing flips."""
    layer = lambda m: m.model.layers[2]  # noqa: E731
    return Family(
        name,
        build,
        _lm_run(48, 128),
        {
            "moe_scale": lambda m: _scale_output(layer(m).mlp, 1.02),
            "norm_eps": lambda m: _set_eps(layer(m).post_attention_layernorm, 0.5),
        },
        r"\.layers\.2\.",
        baseline_bugs=("norm_eps",),
    )


def t5_family() -> Family:
    from transformers import T5Config, T5ForConditionalGeneration

    def build(dtype: torch.dtype, attention: str) -> nn.Module:
        config = T5Config(
            vocab_size=128,
            d_model=64,
            d_kv=16,
            d_ff=128,
            num_layers=3,
            num_decoder_layers=3,
            num_heads=4,
            decoder_start_token_id=0,
        )
        torch.manual_seed(SEED)
        model = _random_norms(T5ForConditionalGeneration(config)).eval().to(dtype)
        for name, module in model.named_modules():  # HF keeps `wo` in fp32 (_keep_in_fp32_modules)
            if name.endswith("DenseReluDense.wo"):
                module.float()
        return model

    ids, labels = _ids(20, 128), _ids(12, 128, seed=2)

    def run(model: nn.Module) -> None:
        model(input_ids=ids, decoder_input_ids=labels)

    layer = lambda m: m.decoder.block[1]  # noqa: E731
    return Family(
        "t5",
        build,
        run,
        {
            "ff_scale": lambda m: _scale_output(layer(m).layer[2].DenseReluDense, 1.02),
            "norm_eps": lambda m: _set_eps(layer(m).layer[0].layer_norm, 0.5),
        },
        r"decoder\.block\.1\.",
        attentions=("eager",),
        baseline_bugs=("norm_eps",),
    )


def unet_family(steps: int = 25) -> Family:
    from diffusers import DDIMScheduler, UNet2DModel

    def build(dtype: torch.dtype, attention: str) -> nn.Module:
        torch.manual_seed(SEED)
        model = UNet2DModel(
            sample_size=16,
            in_channels=3,
            out_channels=3,
            block_out_channels=(32, 64),
            down_block_types=("DownBlock2D", "AttnDownBlock2D"),
            up_block_types=("AttnUpBlock2D", "UpBlock2D"),
            layers_per_block=1,
            norm_num_groups=8,
            attention_head_dim=16,
        )
        return _random_norms(model).eval().to(dtype)

    def run(model: nn.Module) -> None:
        dtype = next(model.parameters()).dtype
        scheduler = DDIMScheduler(num_train_timesteps=1000)
        scheduler.set_timesteps(steps)
        sample = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(4)).to(dtype)
        for t in scheduler.timesteps:
            noise = model(sample, t).sample
            sample = scheduler.step(noise, t, sample).prev_sample

    block = lambda m: m.mid_block  # noqa: E731
    return Family(
        "unet",
        build,
        run,
        {
            "resnet_scale": lambda m: _scale_output(block(m).resnets[0], 1.02),
            "norm_eps": lambda m: _set_eps(block(m).resnets[0].norm1, 1e-1),
        },
        r"^mid_block\.",
        attentions=("default",),
        baseline_bugs=("norm_eps",),
    )


def _value_bias(model: nn.Module, beta: float) -> nn.Module:
    """Every layer's v_proj bias a fixed vector of scale ``beta``, q/k/o biases zero: values share a
    component across tokens, so the attention output (o_proj) moves little when the weights move.
    The case this family is for: a rotary bug then shows in the attention weights (15 roundings) while o_proj
    moves by less than one rounding, and o_proj is recorded first."""
    generator = torch.Generator().manual_seed(5 + SEED)
    with torch.no_grad():
        for layer in model.model.layers:
            attention = layer.self_attn
            for proj in (attention.q_proj, attention.k_proj, attention.o_proj):
                if proj.bias is not None:
                    proj.bias.zero_()
            attention.v_proj.bias.copy_(beta * torch.randn(attention.v_proj.bias.shape, generator=generator))
    return model


def llama_weights_family() -> Family:
    """A 6-layer Llama (GQA, eager attention) where the rotary bug shows only in the attention weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def build(dtype: torch.dtype, attention: str) -> nn.Module:
        config = LlamaConfig(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=6,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            initializer_range=0.04,
            attention_bias=True,
            attn_implementation=attention,
        )
        torch.manual_seed(SEED)
        return _value_bias(_random_norms(LlamaForCausalLM(config)), 0.15).eval().to(dtype)

    layer = lambda m: m.model.layers[3]  # noqa: E731
    return Family(
        "llama-weights",
        build,
        _lm_run(24, 128),
        {"rotary": lambda m: _shift_rotary(layer(m).self_attn, m.model.rotary_emb)},
        r"\.layers\.3\.",
    )


def qwen2_family() -> Family:
    """A 5-layer Qwen2 (q/k/v biases, GQA): the rotary bug, as in the Llama above."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    def build(dtype: torch.dtype, attention: str) -> nn.Module:
        config = Qwen2Config(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=5,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            initializer_range=0.04,
            attn_implementation=attention,
        )
        torch.manual_seed(SEED)
        return _value_bias(_random_norms(Qwen2ForCausalLM(config)), 0.15).eval().to(dtype)

    layer = lambda m: m.model.layers[3]  # noqa: E731
    return Family(
        "qwen2",
        build,
        _lm_run(24, 128),
        {
            "rotary": lambda m: _shift_rotary(layer(m).self_attn, m.model.rotary_emb),
            "mlp_scale": lambda m: _scale_output(layer(m).mlp, 1.02),
        },
        r"\.layers\.3\.",
    )


def qwen3_family() -> Family:
    """Qwen3: RMSNorm on each head's q and k before rotary. Bugs: q-norm eps, rotary."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    def build(dtype: torch.dtype, attention: str) -> nn.Module:
        config = Qwen3Config(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=64,
            initializer_range=INIT,
            attn_implementation=attention,
        )
        torch.manual_seed(SEED)
        return _random_norms(Qwen3ForCausalLM(config)).eval().to(dtype)

    layer = lambda m: m.model.layers[2]  # noqa: E731
    return Family(
        "qwen3",
        build,
        _lm_run(24, 128),
        {
            "qk_norm_eps": lambda m: _set_eps(layer(m).self_attn.q_norm, 0.3),
            "rotary": lambda m: _shift_rotary(layer(m).self_attn, m.model.rotary_emb),
        },
        r"\.layers\.2\.",
        baseline_bugs=("qk_norm_eps", "rotary"),
    )


def gemma2_family() -> Family:
    """Gemma2: sliding-window and global layers alternating, attention logits soft-capped (eager
    only: sdpa has no soft-cap), four RMSNorms a layer that scale by ``1 + w``, embeddings x
    sqrt(hidden). Bugs in layer 1 (a global one: in a sliding layer of 8 positions rope theta x 2
    moves the attention by under one bf16 rounding): the soft-cap dropped, rope theta x 2, the MLP
    branch x 1.02 (after its post-norm: before it, the norm undoes a scale), the input norm's eps
    (3: a third of its input's mean square, 8.5, the embeddings being x 8), the attention scale x
    1.05."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    def build(dtype: torch.dtype, attention: str) -> nn.Module:
        config = Gemma2Config(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=64,
            sliding_window=8,
            attn_logit_softcapping=2.0,
            initializer_range=INIT,
            attn_implementation="eager",
        )
        torch.manual_seed(SEED)
        return _random_norms(Gemma2ForCausalLM(config)).eval().to(dtype)

    layer = lambda m: m.model.layers[1]  # noqa: E731
    return Family(
        "gemma2",
        build,
        _lm_run(24, 128),
        {
            "softcap_dropped": lambda m: _drop_softcap(layer(m).self_attn),
            "rope_theta": lambda m: _rope_theta(layer(m).self_attn, m.model.rotary_emb),
            "mlp_scale": lambda m: _scale_output(layer(m).post_feedforward_layernorm, 1.02),
            "norm_eps": lambda m: _set_eps(layer(m).input_layernorm, 3.0),
            "softmax_scale": lambda m: _scale_attention(layer(m).self_attn, 1.05),
        },
        r"\.layers\.1\.",
        attentions=("eager",),
        baseline_bugs=("softcap_dropped", "rope_theta", "norm_eps"),
    )


def phi3_family() -> Family:
    """Phi3: q, k and v one fused ``qkv_proj``, gate and up one fused ``gate_up_proj`` (HF's own
    layout), rotary, GQA. Bugs in layer 2: rope theta x 2, the layer's skip path x 1.05 (a
    "residual x 1.05"), the MLP x 1.02, the post-attention norm's eps, the softmax scale x 1.05."""
    from transformers import Phi3Config, Phi3ForCausalLM

    def build(dtype: torch.dtype, attention: str) -> nn.Module:
        config = Phi3Config(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            original_max_position_embeddings=64,
            initializer_range=INIT,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            attn_implementation=attention,
        )
        torch.manual_seed(SEED)
        return _random_norms(Phi3ForCausalLM(config)).eval().to(dtype)

    layer = lambda m: m.model.layers[2]  # noqa: E731
    return Family(
        "phi3",
        build,
        _lm_run(24, 128),
        {
            "rope_theta": lambda m: _rope_theta(layer(m).self_attn, m.model.rotary_emb),
            "residual": lambda m: _scale_skip(layer(m), 1.05),
            "mlp_scale": lambda m: _scale_output(layer(m).mlp, 1.02),
            "norm_eps": lambda m: _set_eps(layer(m).post_attention_layernorm, 0.5),
            "softmax_scale": lambda m: _scale_attention(layer(m).self_attn, 1.05),
        },
        r"\.layers\.2\.",
        baseline_bugs=("norm_eps",),
    )


def bart_family() -> Family:
    """Bart: a second encoder-decoder (after T5), learned positions, post-LN LayerNorms with biases
    (random here), cross-attention, eager and sdpa. Bugs in decoder layer 1: ``fc2`` x 1.02 (inside
    a leaf: a graft at leaf level sees it), the cross-attention's softmax scale x 1.05, the
    cross-attention norm's eps."""
    from transformers import BartConfig, BartForConditionalGeneration

    def build(dtype: torch.dtype, attention: str) -> nn.Module:
        config = BartConfig(
            vocab_size=128,
            d_model=64,
            encoder_layers=3,
            decoder_layers=3,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=128,
            decoder_ffn_dim=128,
            max_position_embeddings=64,
            init_std=INIT,
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=2,
            decoder_start_token_id=2,
            attn_implementation=attention,
        )
        torch.manual_seed(SEED)
        model = BartForConditionalGeneration(config)
        return _random_norms(model, biases=True).eval().to(dtype)

    ids, labels = _ids(20, 128), _ids(12, 128, seed=2)

    def run(model: nn.Module) -> None:
        model(input_ids=ids, decoder_input_ids=labels)

    layer = lambda m: m.model.decoder.layers[1]  # noqa: E731
    return Family(
        "bart",
        build,
        run,
        {
            "fc2_scale": lambda m: _scale_output(layer(m).fc2, 1.02),
            "softmax_scale": lambda m: _scale_attention(layer(m).encoder_attn, 1.05),
            "norm_eps": lambda m: _set_eps(layer(m).encoder_attn_layer_norm, 0.5),
        },
        r"decoder\.layers\.1\.",
        baseline_bugs=("norm_eps",),
    )


def bert_family() -> Family:
    """BERT: an encoder, post-LN, LayerNorms with biases (random here, so a lost one shows)."""
    from transformers import BertConfig, BertModel

    def build(dtype: torch.dtype, attention: str) -> nn.Module:
        config = BertConfig(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            max_position_embeddings=64,
            initializer_range=INIT,
            attn_implementation=attention,
        )
        torch.manual_seed(SEED)
        return _random_norms(BertModel(config, add_pooling_layer=False), biases=True).eval().to(dtype)

    layer = lambda m: m.encoder.layer[2]  # noqa: E731
    return Family(
        "bert",
        build,
        _lm_run(24, 128),
        {
            "ln_bias": lambda m: _zero_bias(layer(m).attention.output.LayerNorm),
            "mlp_scale": lambda m: _scale_output(layer(m).intermediate, 1.02),
        },
        r"encoder\.layer\.2\.",
        baseline_bugs=("ln_bias",),
    )


def mamba_family() -> Family:
    """Mamba: a selective SSM, no attention (the sequential scan of transformers' CPU path)."""
    from transformers import MambaConfig, MambaForCausalLM

    def build(dtype: torch.dtype, attention: str) -> nn.Module:
        config = MambaConfig(
            vocab_size=128,
            hidden_size=64,
            state_size=8,
            num_hidden_layers=4,
            expand=2,
            conv_kernel=4,
            time_step_rank=8,
            initializer_range=INIT,
        )
        torch.manual_seed(SEED)
        return _random_norms(MambaForCausalLM(config)).eval().to(dtype)

    layer = lambda m: m.backbone.layers[2]  # noqa: E731
    return Family(
        "mamba",
        build,
        _lm_run(24, 128),
        {
            "dt_bias": lambda m: _shift_dt(layer(m).mixer, 3.0),
            "state_decay": lambda m: _scale_state_decay(layer(m).mixer, 4.0),
        },
        r"\.layers\.2\.",
        attentions=("default",),
        baseline_bugs=("dt_bias",),
    )


# The tied experts' down-projections x 3 and x -3 (both x 3 moves the layer's output too little).
TIE_DOWN_SCALE = 3.0


def qwen3_moe_tie_family() -> Family:
    """A constructed near-tie: Qwen3-MoE, 4 experts, top-2; in layer 1's router expert 1's
    row is expert 0's x (1 + 2^-12), so the two tie exactly in bf16 and not in fp32, and their
    down-projections are scaled (:data:`TIE_DOWN_SCALE`) so that a flip matters. bf16 against fp32
    must pass (the flipped tokens are a near-tie), with and without --baseline; a bug downstream
    (layer 2) must still be found."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    def build(dtype: torch.dtype, attention: str) -> nn.Module:
        config = Qwen3MoeConfig(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=96,
            moe_intermediate_size=48,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=64,
            initializer_range=INIT,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            attn_implementation=attention,
        )
        torch.manual_seed(SEED)
        model = _random_norms(Qwen3MoeForCausalLM(config)).eval()
        tie_experts(model.model.layers[1].mlp)
        return model.to(dtype)

    layer = lambda m: m.model.layers[2]  # noqa: E731
    return Family(
        "qwen3moe-tie",
        build,
        _lm_run(48, 128),
        {"norm_eps": lambda m: _set_eps(layer(m).post_attention_layernorm, 0.5)},
        r"\.layers\.2\.",
        baseline_bugs=("norm_eps",),
        extra=(("bf16", "fp32", "clean", "bf16"), ("bf16-eager", "fp32", "clean", "bf16")),
    )


def tie_experts(block: nn.Module, first: int = 0, second: int = 1, factor: float = TIE_DOWN_SCALE) -> None:
    """In an fp32 Qwen3-MoE block: router row ``first`` rounded to bf16 and row ``second`` = it x
    (1 + 2^-12), a tie in bf16 (2^-12 is below half a bf16 ulp), not in fp32; the experts'
    down-projections x ``factor`` and x ``-factor``, so that a token flipped between them moves
    past the bf16 ceiling on every CPU (with both x 3, 2 flipped tokens of 48 moved
    the layer's output by 0.009 under the ISA caps)."""
    with torch.no_grad():
        row = block.gate.weight[first].bfloat16().float()  # bf16-exact, so x (1 + 2^-12) rounds back
        block.gate.weight[first] = row
        block.gate.weight[second] = row * (1 + 2.0**-12)
        block.experts.down_proj[first] *= factor
        block.experts.down_proj[second] *= -factor  # opposite signs: a flip swaps +-3 x an answer


FAMILIES: dict[str, Callable[[], Family]] = {
    "llama": llama_family,
    "gpt2": gpt2_family,
    "mixtral": mixtral_family,
    "qwen2moe": qwen2_moe_family,
    "olmoe": olmoe_family,
    "t5": t5_family,
    "unet": unet_family,
    "llama-weights": llama_weights_family,
    "qwen2": qwen2_family,
    "qwen3": qwen3_family,
    "gemma2": gemma2_family,
    "phi3": phi3_family,
    "bart": bart_family,
    "bert": bert_family,
    "mamba": mamba_family,
    "qwen3moe-tie": qwen3_moe_tie_family,
}


# ----------------------------------------------------------------------------------- dumping


def dump_variant(family: Family, variant: str, out: Path) -> Path:
    """Dump one variant: ``<dtype>[-<attention>][+<bug>]``, e.g. ``bf16-eager+rotary``."""
    spec, _, bug = variant.partition("+")
    dtype_name, _, attention = spec.partition("-")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    model = family.build(dtype, attention or family.attentions[-1])
    if bug:
        family.bugs[bug](model)
    with common.clean_env():
        dumper = tracedump.attach(model, {"dir": str(out), "modules": "all"})
    assert dumper is not None
    with torch.no_grad():
        family.run(model)
    dumper.close()
    return out


# ----------------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class Case:
    """One comparison and what it must give: exit 0 (``clean``) or exit 1 naming ``family.layer``."""

    family: str
    a: str
    b: str
    expect: str  # "clean" | "detect" | "welcome" (detection welcome, not required)
    baseline: str | None = None

    @property
    def label(self) -> str:
        return f"{self.a} vs {self.b}" + (f" (baseline {self.baseline})" if self.baseline else "")


WELCOME = {
    ("bf16", "softmax_scale"),
    ("bf16", "state_decay"),  # A x 4 moves a random Mamba's mixer by 2.5e-5 in fp32: under one bf16 rounding
    ("baseline", "mlp_scale"),
    ("baseline", "moe_scale"),
}


def cases(family: Family) -> list[Case]:
    """The clean pairs that must pass and the bug pairs that must be found, for one family."""
    attention = family.attentions[-1]
    out = [Case(family.name, "bf16", "fp32", "clean")]
    if len(family.attentions) > 1:
        other = family.attentions[0]
        out += [
            Case(family.name, f"fp32-{other}", "fp32", "clean"),
            Case(family.name, f"bf16-{other}", "bf16", "clean"),
        ]
    for bug in family.bugs:
        out.append(Case(family.name, f"fp32+{bug}", "fp32", "detect"))
        eager = f"bf16-{family.attentions[0]}"  # eager attention: its weights are dumped too
        welcome = ("bf16", bug) in WELCOME
        out.append(Case(family.name, f"{eager}+{bug}", eager, "welcome" if welcome else "detect"))
        required = bug in family.baseline_bugs
        out.append(
            Case(family.name, f"bf16+{bug}", "fp32", "detect" if required else "welcome", baseline="bf16")
        )
    del attention
    out += [Case(family.name, a, b, expect, baseline) for a, b, expect, baseline in family.extra]
    return out


# The margins asked of every row: a clean case at most half its allowance anywhere, a bug
# at least twice its allowance somewhere in the planted layer. "(welcome)" rows have no goal.
CLEAN_GOAL = 0.5
BUG_GOAL = 2.0
JUDGED = ("ok", "diverged", "routing_flip")  # statuses whose error was judged against a threshold


def ratios(results: Any, inside: Callable[[str], bool]) -> tuple[float, float]:
    """(largest error / threshold of the judged tensors outside ``inside``, the same inside it).

    A clean case's ratio is the larger of the two (its worst tensor anywhere); a bug's is the one
    inside the planted layer (its clearest tensor: with the allowance twice as wide, the bug would
    still be found there as long as nothing before it came nearer than half). Not judged, routing
    and shape rows have no threshold and do not count; neither does a fixed threshold of 0."""
    worst = {False: 0.0, True: 0.0}
    for result in results:
        if str(result.status) not in JUDGED or result.error is None or not result.threshold:
            continue
        ratio = float(result.error) / float(result.threshold)
        if math.isfinite(ratio):
            key = inside(result.name)
            worst[key] = max(worst[key], ratio)
    return worst[False], worst[True]


def goal_met(expect: str, ratio: float | None) -> bool | None:
    """Whether a row meets its margin goal (None: a "(welcome)" row, no goal)."""
    if expect == "clean":
        return ratio is not None and ratio <= CLEAN_GOAL
    if expect == "detect":
        return ratio is not None and ratio >= BUG_GOAL
    return None


@dataclass
class Outcome:
    case: Case
    exit_code: int
    first: str | None
    error: float | None
    threshold: float | None
    passed: bool
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    ratio: float | None = None  # clean: worst error / threshold; bug: clearest in the planted layer

    def row(self) -> dict[str, Any]:
        return {
            "family": self.case.family,
            "case": self.case.label,
            "expect": self.case.expect,
            "exit": self.exit_code,
            "first_divergence": self.first,
            "error": self.error,
            "threshold": self.threshold,
            "passed": self.passed,
            "ratio": self.ratio,
            "goal_met": goal_met(self.case.expect, self.ratio),
        }


def in_planted(layer: str, name: str) -> bool:
    """``name`` lies in the planted layer (``layer``: a regex ending in ``\\.``), the layer's own
    output included (``model.layers.2``, ``model.layers.2[1]``, ``model.layers.2@in[0]``: a bug in
    its skip path shows first there)."""
    return bool(re.search(layer, name) or re.search(layer, re.sub(r"[\[@:].*$", "", name) + "."))


def judge_case(case: Case, family: Family, dumps: dict[str, Path]) -> Outcome:
    from tracedump.compare import compare

    baseline = dumps[case.baseline] if case.baseline else None
    report = compare(dumps[case.a], dumps[case.b], baseline=baseline)
    first = report.first_divergence
    name = first.name if first else None
    in_layer = bool(name and in_planted(family.layer, name))
    if case.expect == "clean":
        passed = report.exit_code == 0
    elif case.expect == "detect":
        passed = report.exit_code == 1 and in_layer
    else:
        passed = True
    outside, inside = ratios(report.results, lambda n: in_planted(family.layer, n))
    return Outcome(
        case,
        report.exit_code,
        name,
        first.error if first else None,
        first.threshold if first else None,
        passed,
        "found" if in_layer else "",
        ratio=max(outside, inside) if case.expect == "clean" else inside,
    )


def variants_needed(family_cases: list[Case]) -> list[str]:
    needed: list[str] = []
    for case in family_cases:
        for v in (case.a, case.b, case.baseline):
            if v and v not in needed:
                needed.append(v)
    return needed


def calibrate(names: list[str], root: Path, log: Callable[[str], None] = print) -> list[Outcome]:
    outcomes: list[Outcome] = []
    for name in names:
        family = FAMILIES[name]()
        family_cases = cases(family)
        dumps: dict[str, Path] = {}
        started = time.perf_counter()
        for variant in variants_needed(family_cases):
            dumps[variant] = dump_variant(copy.copy(family), variant, root / name / variant)
        log(f"{name}: {len(dumps)} dumps in {time.perf_counter() - started:.1f} s")
        for case in family_cases:
            outcome = judge_case(case, family, dumps)
            outcomes.append(outcome)
            mark = "ok " if outcome.passed else "BAD"
            log(
                f"  {mark} {case.label:42s} expect {case.expect:7s} exit {outcome.exit_code} "
                f"first {outcome.first} ({_g(outcome.error)} > {_g(outcome.threshold)}) "
                f"ratio {_x(outcome.ratio)}"
            )
    return outcomes


def _g(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def _x(ratio: float | None) -> str:
    """A ratio to the allowance as the tables print it: 0.123x, 1.96x (not rounded up to a goal
    it missed), 3e+08x."""
    if ratio is None:
        return "-"
    return f"{ratio:.3g}x" if ratio < 1000 else f"{ratio:.0e}x"


def markdown(outcomes: list[Outcome]) -> str:
    lines = [
        "| family | case | must | exit | first divergence | error / threshold | ratio | held |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for o in outcomes:
        must = {"clean": "exit 0", "detect": "exit 1 in layer", "welcome": "(welcome)"}[o.case.expect]
        at_first = f"{_g(o.error)} / {_g(o.threshold)}" if o.first else "-"
        label = o.extra.get("label", o.case.label)
        met = goal_met(o.case.expect, o.ratio)
        ratio = _x(o.ratio) + (" **(goal missed)**" if met is False else "")
        lines.append(
            f"| {o.case.family} | {label} | {must} | {o.exit_code} | {o.first or '-'} | {at_first} "
            f"| {ratio} | {'yes' if o.passed else 'NO'} |"
        )
    return "\n".join(lines)


def cpu_name() -> str:
    """This CPU's model name, as lscpu reports it (for the docs' table: where it was measured)."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        text = ""
    for line in text.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def run_setting(
    name: str,
    families: list[str],
    log: Callable[[str], None] = print,
    *,
    script: str = __file__,
    label: str = "setting",
) -> dict[str, Any]:
    """One setting of :data:`SETTINGS`, in a child process whose env holds its ISA caps: ``script``
    run with ``--one`` (this file, or calibrate_graft.py, which takes the same arguments)."""
    env_vars, seed = SETTINGS[name]
    with tempfile.TemporaryDirectory(prefix=f"tracedump-{Path(script).stem}-") as scratch:
        out = Path(scratch) / "rows.json"
        command = [sys.executable, script, "--one", "--families", ",".join(families)]
        command += ["--seed", str(seed), "--out", str(out)]
        started = time.perf_counter()
        done = subprocess.run(command, env={**os.environ, **env_vars}, capture_output=True, text=True)
        seconds = time.perf_counter() - started
        log(f"{label} {name} ({_describe_env(env_vars, seed)}): {seconds:.0f} s")
        if done.returncode not in (0, 1) or not out.exists():
            raise RuntimeError(f"setting {name} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
        data = json.loads(out.read_text())
    return {"env": env_vars, "seed": seed, "seconds": round(seconds, 1), **data}


def _describe_env(env_vars: dict[str, str], seed: int) -> str:
    parts = [f"{k}={v}" for k, v in env_vars.items()] or ["no caps"]
    return ", ".join(parts) + f", model seed {seed}"


# What each expectation requires, as the tables print it ("invisible": a grafted row whose bug
# lies between leaves, calibrate_graft.py).
MUST = {"clean": "exit 0", "detect": "exit 1 in layer", "welcome": "(welcome)", "invisible": "(not visible)"}


def settings_markdown(results: dict[str, dict[str, Any]]) -> str:
    """One table, a column per setting: each case's exit code, first divergence and ratio to its
    allowance there, and whether the row meets the margin goals in every setting."""
    names = list(results)
    lines = [
        "| family | case | must | " + " | ".join(names) + " | margin goal |",
        "|---|---|---|" + "---|" * len(names) + "---|",
    ]
    keyed = {name: {(r["family"], r["case"]): r for r in results[name]["rows"]} for name in names}
    for key in _row_keys(results):
        row = next(keyed[name][key] for name in names if key in keyed[name])
        must = MUST[row["expect"]]
        cells, present = [], []
        for name in names:
            other = keyed[name].get(key)
            if other is None:
                cells.append("not run")
                continue
            present.append((name, other))
            where = f" `{other['first_divergence']}`" if other["first_divergence"] else ""
            ratio = f" {_x(other.get('ratio'))}"
            cells.append(f"{other['exit']}{where}{ratio}" + ("" if other["passed"] else " **NO**"))
        goal = _goal_cell(row["expect"], [r for _, r in present], [n for n, _ in present])
        lines.append(f"| {row['family']} | {row['case']} | {must} | " + " | ".join(cells) + f" | {goal} |")
    lines.append("")
    lines.append("| setting | what | CPU capability | as expected | margins met | minutes |")
    lines.append("|---|---|---|---|---|---|")
    for name in names:
        data = results[name]
        held = sum(1 for r in data["rows"] if r["passed"])
        goals = [r.get("goal_met") for r in data["rows"] if r.get("goal_met") is not None]
        what = _describe_env(data["env"], data["seed"])
        minutes = f"{data['seconds'] / 60:.1f}" if data.get("seconds") is not None else "-"
        lines.append(
            f"| {name} | {what} | {data['capability']} | {held} of {len(data['rows'])} "
            f"| {sum(goals)} of {len(goals)} | {minutes} |"
        )
    return "\n".join(lines)


def _row_keys(results: dict[str, dict[str, Any]]) -> list[tuple[str, str]]:
    """Every (family, case) of any setting, in the order they were run (a setting whose slice was
    not run shows "not run" in its column, instead of shifting the rows)."""
    keys: dict[tuple[str, str], None] = {}
    for data in results.values():
        for row in data["rows"]:
            keys.setdefault((row["family"], row["case"]), None)
    return list(keys)


def _goal_cell(expect: str, rows: list[dict[str, Any]], names: list[str]) -> str:
    """ "met", "-" (a welcome row) or which settings missed it, with their ratios."""
    if expect not in ("clean", "detect"):
        return f"- {MUST[expect]}"
    pairs = zip(names, rows, strict=True)
    missed = [f"{name} {_x(r.get('ratio'))}" for name, r in pairs if not r.get("goal_met")]
    goal = f"<= {CLEAN_GOAL}x" if expect == "clean" else f">= {BUG_GOAL}x"
    return "met" if not missed else f"**missed** ({goal}): " + ", ".join(missed)


def summary_markdown(results: dict[str, dict[str, Any]]) -> str:
    """Per family and setting: the largest clean ratio, the smallest required bug's ratio (welcome
    rows aside), and how many rows missed the margin goals."""
    names = list(results)
    lines = [
        "| family | " + " | ".join(f"{n}: clean max / bug min" for n in names) + " | rows missing a goal |",
        "|---|" + "---|" * len(names) + "---|",
    ]
    families = list(dict.fromkeys(family for family, _ in _row_keys(results)))
    for family in families:
        cells, missing = [], 0
        for name in names:
            rows = [r for r in results[name]["rows"] if r["family"] == family]
            clean = [r.get("ratio") or 0.0 for r in rows if r["expect"] == "clean"]
            bugs = [r.get("ratio") or 0.0 for r in rows if r["expect"] == "detect"]
            missing += sum(1 for r in rows if r.get("goal_met") is False)
            cells.append(f"{_x(max(clean, default=None))} / {_x(min(bugs, default=None))}")
        lines.append(f"| {family} | " + " | ".join(cells) + f" | {missing or '-'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--settings", default=",".join(DEFAULT_SETTINGS), help=f"of {', '.join(SETTINGS)}")
    parser.add_argument("--out", type=Path, help="write the outcomes as JSON")
    parser.add_argument("--markdown", action="store_true", help="print the docs tables")
    parser.add_argument("--keep", type=Path, help="keep the dumps in this dir (default: a temp dir)")
    parser.add_argument("--one", action="store_true", help="run in this process, as the env is (no settings)")
    parser.add_argument("--seed", type=int, default=0, help="with --one: added to every family's weight seed")
    parser.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        help="instead of running: merge these --out files (slices of families or settings) into one",
    )
    args = parser.parse_args(argv)
    names = [n for n in args.families.split(",") if n]
    if args.one:
        return _main_one(names, args)
    if args.merge:
        results = merge_settings(args.merge)
        settings = list(results)
    else:
        settings = [n for n in args.settings.split(",") if n]
        unknown = [n for n in settings if n not in SETTINGS]
        if unknown:
            parser.error(f"unknown setting(s) {', '.join(unknown)}; known: {', '.join(SETTINGS)}")
        results = {name: run_setting_safely(name, names) for name in settings}
    if args.markdown:
        first = results[settings[0]]
        print(markdown([_outcome_of(r) for r in first["rows"]]))
        print()
        print(settings_markdown(results))
        print()
        print(summary_markdown(results))
    if args.out:
        document = {
            "cpu": cpu_name(),
            "torch": torch.__version__,
            "transformers": _version("transformers"),
            "settings": results,
        }
        args.out.write_text(json.dumps(document, indent=1) + "\n")
    failed = {name: sum(1 for r in data["rows"] if not r["passed"]) for name, data in results.items()}
    for name, data in results.items():
        print(f"{name}: {len(data['rows']) - failed[name]} of {len(data['rows'])} as expected")
        for error in data.get("errors", []):
            print(f"{name}: FAILED TO RUN: {error.splitlines()[0]}")
    return 1 if any(failed.values()) or any(data.get("errors") for data in results.values()) else 0


def run_setting_safely(name: str, families: list[str]) -> dict[str, Any]:
    """:func:`run_setting`, a setting that could not run recorded (``errors``) instead of losing
    the settings that did."""
    try:
        return run_setting(name, families)
    except (RuntimeError, OSError, json.JSONDecodeError) as exc:
        return failed_setting(name, exc)


def failed_setting(name: str, exc: Exception) -> dict[str, Any]:
    """A setting whose child process failed, as a result with no rows and the error."""
    print(f"setting {name} failed: {exc}", file=sys.stderr)
    env_vars, seed = SETTINGS[name]
    return {"env": env_vars, "seed": seed, "capability": "-", "rows": [], "errors": [str(exc)]}


def merge_settings(paths: list[Path]) -> dict[str, dict[str, Any]]:
    """The settings of several ``--out`` documents as one: the rows of a setting met in several
    files (slices of families, run one at a time) concatenated in the files' order, their
    seconds added up. So a long calibration can run in slices and still make one table."""
    merged: dict[str, dict[str, Any]] = {}
    for path in paths:
        for name, data in json.loads(Path(path).read_text())["settings"].items():
            into = merged.get(name)
            if into is None:
                merged[name] = {**data, "rows": list(data["rows"]), "errors": list(data.get("errors", []))}
                continue
            into["rows"] += data["rows"]
            into["errors"] += data.get("errors", [])
            if into.get("seconds") is not None and data.get("seconds") is not None:
                into["seconds"] = round(into["seconds"] + data["seconds"], 1)
    return merged


def _main_one(names: list[str], args: argparse.Namespace) -> int:
    global SEED
    SEED = args.seed
    torch.set_num_threads(1)
    root = args.keep or Path(tempfile.mkdtemp(prefix="tracedump-calibrate-"))
    try:
        outcomes = calibrate(names, root)
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    if args.markdown:
        print(markdown(outcomes))
    if args.out:
        document = {
            "capability": torch.backends.cpu.get_cpu_capability(),
            "rows": [o.row() for o in outcomes],
        }
        args.out.write_text(json.dumps(document, indent=1) + "\n")
    failed = [o for o in outcomes if not o.passed]
    print(f"{len(outcomes) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


def _outcome_of(row: dict[str, Any]) -> Outcome:
    case = Case(row["family"], "", "", row["expect"])
    outcome = Outcome(
        case,
        row["exit"],
        row["first_divergence"],
        row["error"],
        row["threshold"],
        row["passed"],
        ratio=row.get("ratio"),
    )
    outcome.extra["label"] = row["case"]
    return outcome


def _version(package: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(package)
    except Exception:
        return None


if __name__ == "__main__":
    raise SystemExit(main())
