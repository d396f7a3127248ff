"""Save a tiny random HF model with save_pretrained (nothing downloaded): the engine tests' model.

    python make_model.py OUT [--arch llama|qwen2] [--dtype float32|bfloat16] [--seed 0]

hidden 256, 4 heads of 64 (vLLM's CPU attention needs head_dim >= 64), 4 layers, vocab 512.
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
    if arch == "llama":
        config = transformers.LlamaConfig(**common)
        cls = transformers.LlamaForCausalLM
    elif arch == "qwen2":
        config = transformers.Qwen2Config(**common)
        cls = transformers.Qwen2ForCausalLM
    else:
        raise SystemExit(f"unknown --arch {arch!r}: llama or qwen2")
    torch.manual_seed(seed)
    model = cls(config).to(getattr(torch, dtype)).eval()
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
