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


def prompts(lengths: list[int], shared: int = 0) -> list[list[int]]:
    """Prompt i of length n: ``[1, 10+i, 17+i, ...]``; with ``shared``, every prompt's first
    ``shared`` tokens are prompt 0's (a common prefix, for prefix caching)."""
    made = [[1] + [10 + i + k * 7 for k in range(n - 1)] for i, n in enumerate(lengths)]
    return [made[0][:shared] + p[shared:] if i else p for i, p in enumerate(made)]


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
    parser.add_argument("--shared-prefix", type=int, default=0, help="share prompt 0's first N tokens")
    parser.add_argument("--n", type=int, default=1, help="parallel sampling: N children per prompt")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--block-size", type=int, help="KV cache block size")
    parser.add_argument("--blocks", type=int, help="num_gpu_blocks_override: few blocks force preemption")
    parser.add_argument("--prefix-caching", action="store_true")
    parser.add_argument("--chunk", type=int, help="max_num_batched_tokens: prefills chunked to N tokens")
    parser.add_argument("--sequential", action="store_true", help="one generate() per prompt, in order")
    parser.add_argument(
        "--compiled", action="store_true", help="vLLM's compilation on (no enforce_eager; CPU: inductor)"
    )
    parser.add_argument(
        "--post-grad-pass",
        help="with --compiled: the qualified name of an inductor post-grad pass, planted through "
        "vLLM's compilation_config.inductor_passes (e.g. tracedump_vllm_testbug.scale_layer2_mlp)",
    )
    parser.add_argument("--allow-crash", action="store_true", help="an engine error ends the run, exit 0")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if args.in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if args.unknown_internals:
        hide_runners()
    from vllm import SamplingParams

    options: dict[str, object] = {"dtype": args.dtype}
    if args.block_size:
        options["block_size"] = args.block_size
    if args.blocks:
        options["num_gpu_blocks_override"] = args.blocks
    if args.prefix_caching:
        options["enable_prefix_caching"] = True
    if args.chunk:
        options.update(enable_chunked_prefill=True, max_num_batched_tokens=args.chunk)
    if args.compiled:
        options["enforce_eager"] = False
        if args.post_grad_pass:
            passes = {"post_grad_custom_post_pass": args.post_grad_pass}
            options["compilation_config"] = {"inductor_passes": passes}
    if args.tp > 1:  # on CPU: one worker process per rank, one OpenMP thread each on its own core
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(map(str, range(args.tp))))
        options.update(tensor_parallel_size=args.tp, distributed_executor_backend="mp")
    llm = small_engine(args.model, **options)
    params = SamplingParams(
        temperature=args.temperature,
        n=args.n,
        seed=0 if args.temperature else None,
        max_tokens=args.max_tokens,
        ignore_eos=True,
        detokenize=False,
    )
    if args.dummy_batch:
        llm.collective_rpc("execute_dummy_batch")
    lengths = [int(n) for n in args.prompts.split(",")]
    inputs = [{"prompt_token_ids": p} for p in prompts(lengths, args.shared_prefix)]
    batches = [[i] for i in inputs] if args.sequential else [inputs]
    outputs = []
    try:
        for batch in batches:
            outputs += llm.generate(batch, params, use_tqdm=False)
    except Exception as e:
        if not args.allow_crash:
            raise
        result = {"error": f"{type(e).__name__}: {e}"}
        if args.out:
            args.out.write_text(json.dumps(result))
        print(json.dumps(result), flush=True)
        return  # in-process, the dump is closed at exit (the engine is dead)
    result = {
        "prompts": [o.prompt_token_ids for o in outputs],
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "children": [[list(c.token_ids) for c in o.outputs] for o in outputs],
    }
    if args.out:
        args.out.write_text(json.dumps(result))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
