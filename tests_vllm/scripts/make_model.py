"""Save a tiny random HF model with save_pretrained (nothing downloaded): the engine tests' model.

    python make_model.py OUT [--arch ARCH] [--dtype float32|bfloat16] [--seed 0]

hidden 256, 4 heads of 64 (vLLM's CPU attention needs head_dim >= 64), 4 layers, vocab 512.
ARCH: llama, llama-tied (tied embeddings; Gemma's are tied too), qwen2, qwen3, mistral, phi3,
gemma, gemma2, mixtral, qwen3-moe (4 experts, 2 per token); with 2 layers: cohere (its decoder
layer returns ``(hidden, residual)`` with the residual already in ``hidden``), falcon (the new
decoder architecture: 2 KV heads, a fused ``query_key_value`` grouped per KV head, which vLLM
reorders into ``[q | k | v]`` on load), bloom (``query_key_value`` interleaved per head, reordered
too; its HF attention and MLP add the residual inside), qwen2-moe (4 experts, 2 per token, and a
shared expert). Norm weights are 1 +- 0.3 (random), so that a norm's weight is no constant and
every parameter's values tell it apart.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def build(out: Path, arch: str, dtype: str, seed: int) -> None:
    import transformers

    common = dict(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=64,
        vocab_size=512,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype=dtype,
    )
    gemma2 = dict(pad_token_id=0, sliding_window=64, tie_word_embeddings=True)
    mixtral = dict(num_local_experts=4, num_experts_per_tok=2)
    qwen3_moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256)
    two = dict(num_hidden_layers=2)
    cohere = dict(two, pad_token_id=0, tie_word_embeddings=True, layer_norm_eps=1e-5)
    bloom = dict(two, n_head=4, pad_token_id=0, tie_word_embeddings=True)
    falcon = dict(two, num_kv_heads=2, new_decoder_architecture=True, parallel_attn=True, bias=False,
                  alibi=False, pad_token_id=0, tie_word_embeddings=True)  # fmt: skip
    qwen2_moe = dict(two, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
                     shared_expert_intermediate_size=256)  # fmt: skip
    families = {
        "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
        "llama-tied": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True}),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
        "mistral": ("MistralConfig", "MistralForCausalLM", {}),
        "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}),
        "gemma": ("GemmaConfig", "GemmaForCausalLM", {"pad_token_id": 0, "tie_word_embeddings": True}),
        "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", gemma2),
        "mixtral": ("MixtralConfig", "MixtralForCausalLM", mixtral),
        "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", qwen3_moe),
        "cohere": ("CohereConfig", "CohereForCausalLM", cohere),
        "falcon": ("FalconConfig", "FalconForCausalLM", falcon),
        "bloom": ("BloomConfig", "BloomForCausalLM", bloom),
        "qwen2-moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", qwen2_moe),
    }  # fmt: skip
    if arch not in families:
        raise SystemExit(f"unknown --arch {arch!r}: {', '.join(families)}")
    config_name, class_name, extra = families[arch]
    settings = {**common, **extra}
    if arch in ("falcon", "bloom"):  # their head_dim is hidden / heads, a property
        settings.pop("head_dim")
    if arch == "cohere":  # vLLM's Cohere takes an rms_norm_eps in the config for RMSNorm: LayerNorm
        settings.pop("rms_norm_eps")
    config = getattr(transformers, config_name)(**settings)
    cls = getattr(transformers, class_name)
    torch.manual_seed(seed)
    model = cls(config).to(getattr(torch, dtype)).eval()
    with torch.no_grad():  # norms 1 +- 0.3 (Gemma's are stored as w, applied as 1 + w: 0 +- 0.3)
        for name, param in model.named_parameters():
            if (
                "norm" in name or name.endswith(("ln_f.weight", "ln_attn.weight", "ln_mlp.weight"))
            ) and param.dim() == 1:
                base = 0.0 if arch.startswith("gemma") else 1.0
                param.copy_(base + 0.3 * (2 * torch.rand_like(param) - 1))
    model.save_pretrained(out, safe_serialization=True)
    (out / "tracedump_model.json").write_text(json.dumps({"arch": arch, "dtype": dtype, "seed": seed}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--arch", default="llama")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    build(args.out, args.arch, args.dtype, args.seed)


if __name__ == "__main__":
    main()
