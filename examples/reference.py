"""The reference model of the demo: a Hugging Face Llama from a small config, random weights, fixed seed.

This script never imports tracedump. That is the point: ``tracedump run -- python examples/reference.py``
dumps it without a single line of tracedump code in it, the way one dumps a reference one does not own.

Both sides of the demo build their weights from :func:`build_reference`, so the port and the
reference hold the same numbers without any file passing between them, and no download is needed.

    python examples/reference.py [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM

SEED = 0
# Fixed token ids: a "prompt" of 12 tokens, enough positions for rotary differences to show.
PROMPT = (1, 17, 204, 33, 95, 411, 7, 250, 68, 129, 3, 300)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def reference_config() -> LlamaConfig:
    """A small Llama: big enough to have every part a real one has (GQA, rotary, SwiGLU), fast on a CPU."""
    return LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
    )


def build_reference(dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """The reference with the demo's fixed random weights (built in fp32, then cast, so every dtype
    starts from the same numbers)."""
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(reference_config()).eval()
    return model.to(dtype)


def prompt_ids() -> torch.Tensor:
    """The demo's prompt as a ``[1, seq]`` batch."""
    return torch.tensor([PROMPT])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    args = parser.parse_args()
    model = build_reference(DTYPES[args.dtype])
    with torch.inference_mode():
        logits = model(prompt_ids()).logits
    print(f"reference ({args.dtype}): next token {int(logits[0, -1].argmax())}")


if __name__ == "__main__":
    main()
