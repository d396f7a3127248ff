"""An offline vLLM program that knows nothing of tracedump: batched prompts, greedy.

    python offline.py MODEL [--prompts 5,3] [--max-tokens 4] [--out result.json] [--tp 2]

Prompts are token ids (``skip_tokenizer_init``): prompt i of length n is ``[1, 10+i, 11+i, ...]``.
Writes the generated ids to ``--out`` (JSON) so a test can check the engine ran.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from engine_setup import hide_runners, small_engine


def prompts(lengths: list[int]) -> list[list[int]]:
    return [[1] + [10 + i + k * 7 for k in range(n - 1)] for i, n in enumerate(lengths)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--prompts", default="5,3")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="engine and worker in this process: every prompt is queued before the first step, so "
        "the prompts are prefilled together (multiprocess, the second may arrive a step later)",
    )
    parser.add_argument("--dummy-batch", action="store_true", help="a dummy run (as DP does) first")
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel size (CPU: mp backend)")
    parser.add_argument("--unknown-internals", action="store_true", help="test: hide the runner")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if args.in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if args.unknown_internals:
        hide_runners()
    from vllm import SamplingParams

    parallel = {}
    if args.tp > 1:  # on CPU: one worker process per rank, one OpenMP thread each on its own core
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(map(str, range(args.tp))))
        parallel = {"tensor_parallel_size": args.tp, "distributed_executor_backend": "mp"}
    llm = small_engine(args.model, dtype=args.dtype, **parallel)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, detokenize=False)
    if args.dummy_batch:
        llm.collective_rpc("execute_dummy_batch")
    inputs = [{"prompt_token_ids": p} for p in prompts([int(n) for n in args.prompts.split(",")])]
    outputs = llm.generate(inputs, params, use_tqdm=False)
    result = {
        "prompts": [o.prompt_token_ids for o in outputs],
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
    }
    if args.out:
        args.out.write_text(json.dumps(result))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
