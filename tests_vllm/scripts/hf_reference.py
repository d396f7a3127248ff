"""The HF transformers reference of offline.py: the same prompts, greedy, dumped by ``tracedump run``.

    python hf_reference.py MODEL [--prompts 5,3] [--max-tokens 4] [--batch] [--first-token N] [--attn eager]

One ``generate`` per prompt (a prefill pass, then one pass per token), or with ``--batch`` one
left-padded batched ``generate`` (the batch layout comes from its input_ids / attention_mask).
``--first-token N`` feeds N instead of the first prompt's first token (BOS): inputs that differ by
one token.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from offline import prompts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--prompts", default="5,3")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", action="store_true")
    parser.add_argument("--first-token", type=int)
    parser.add_argument("--shared-prefix", type=int, default=0)
    parser.add_argument("--attn", default="eager", help="attn_implementation (eager: Gemma2's soft-cap)")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        args.model, dtype=getattr(torch, args.dtype), attn_implementation=args.attn
    ).eval()
    ids = prompts([int(n) for n in args.prompts.split(",")], args.shared_prefix)
    if args.first_token is not None:
        ids[0] = [args.first_token, *ids[0][1:]]
    common = dict(max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens, do_sample=False)
    tokens = []
    with torch.no_grad():
        if args.batch:
            width = max(map(len, ids))
            input_ids = torch.tensor([[0] * (width - len(p)) + p for p in ids])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ids])
            out = model.generate(input_ids=input_ids, attention_mask=mask, pad_token_id=0, **common)
            tokens = [row[width:].tolist() for row in out]
        else:
            for p in ids:
                out = model.generate(
                    torch.tensor([p]),
                    attention_mask=torch.ones(1, len(p), dtype=torch.long),
                    pad_token_id=0,
                    **common,
                )
                tokens.append(out[0, len(p) :].tolist())
    print(json.dumps({"prompts": ids, "tokens": tokens}))


if __name__ == "__main__":
    main()
