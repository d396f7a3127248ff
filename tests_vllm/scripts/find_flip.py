"""The smallest scale of one weight that flips a greedy token of the first prompt, found with HF.

    python find_flip.py MODEL --weight model.layers.1.mlp.down_proj.weight [--prompts 5,3] [--max-tokens 4]

A bug "that changes the output" must change it: rather than hope a factor does, this tries factors
in order on the HF model (the same weights vLLM loads) and prints, as JSON, the first whose greedy
tokens of prompt 0 differ from the clean ones at a token that is fed back (not the last one):
``{"factor": 1.3, "clean": [...], "flipped": [...], "index": 1}``. The engine test then plants that
factor in vLLM and checks that vLLM's output flipped too before it reads the diff.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from offline import prompts

FACTORS = (1.05, 1.1, 1.2, 1.3, 1.5, 2.0, 3.0, 5.0, -1.0)


def greedy(model: torch.nn.Module, ids: list[int], new: int) -> list[int]:
    out = model.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        pad_token_id=0,
    )
    return out[0, len(ids) :].tolist()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--weight", required=True)
    parser.add_argument("--prompts", default="5,3")
    parser.add_argument("--max-tokens", type=int, default=4)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    ids = prompts([int(n) for n in args.prompts.split(",")])[0]
    weight = dict(model.named_parameters())[args.weight]
    original = weight.detach().clone()
    with torch.no_grad():
        clean = greedy(model, ids, args.max_tokens)
        for factor in FACTORS:
            weight.copy_(original * factor)
            flipped = greedy(model, ids, args.max_tokens)
            index = next((i for i, (x, y) in enumerate(zip(clean, flipped, strict=True)) if x != y), None)
            if index is not None and index < args.max_tokens - 1:  # fed back at a later position
                print(json.dumps({"factor": factor, "clean": clean, "flipped": flipped, "index": index}))
                return
    raise SystemExit(f"no factor of {FACTORS} flips a fed-back greedy token of prompt 0")


if __name__ == "__main__":
    main()
