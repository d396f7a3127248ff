"""The offline program with vLLM's engine and worker in this one process, so a test can look at
what tracedump left in the process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one worker.

    python inprocess.py MODEL --report report.json [--unknown-internals]

Writes the generated ids, every module hook found on any ``nn.Module`` alive after generation,
torch's global hook dicts, and which tracedump modules were imported.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path

from engine_setup import hide_runners, small_engine

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_load_state_dict_pre_hooks",
)


def hooks_left() -> dict[str, object]:
    import torch
    from torch.nn.modules import module as torch_module

    gc.unfreeze()  # vLLM gc.freeze()s its start-up objects, which hides them from get_objects()
    modules = [o for o in gc.get_objects() if isinstance(o, torch.nn.Module)]
    hooked = sorted({type(m).__name__ for m in modules if any(getattr(m, d, None) for d in _HOOK_DICTS)})
    global_dicts = {
        name: len(getattr(torch_module, name))
        for name in dir(torch_module)
        if name.startswith("_global_") and isinstance(getattr(torch_module, name), dict)
    }
    return {"modules": len(modules), "hooked": hooked, "global": global_dicts}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--report", type=Path, required=True)
    parser.add_argument("--unknown-internals", action="store_true")
    args = parser.parse_args()
    if args.unknown_internals:
        hide_runners()
    from vllm import SamplingParams

    llm = small_engine(args.model)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": [1, 10, 17, 24, 31]}], params, use_tqdm=False)
    report = {
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "hooks": hooks_left(),
        "tracedump_modules": sorted(m for m in sys.modules if m.startswith("tracedump")),
        "runtime_exists": _runtime_exists(),
    }
    args.report.write_text(json.dumps(report))
    print(json.dumps(report))


def _runtime_exists() -> bool:
    runtime = sys.modules.get("tracedump.dump.runtime")
    return runtime is not None and runtime.existing() is not None


if __name__ == "__main__":
    main()
