"""What the engine scripts share: the small offline engine every vLLM test runs on this CPU, and
the switch that makes the plugin see a vLLM whose internals it does not know."""

from __future__ import annotations

from typing import Any


def hide_runners() -> None:
    """Another vLLM version, as far as the plugin can tell: no model runner it knows."""
    import tracedump.integrations.vllm_compat as compat

    compat.RUNNERS = (("vllm.v1.worker.no_such_runner", "GPUModelRunner"),)


def small_engine(model: str, **options: Any) -> Any:
    """vLLM's ``LLM`` as the tests run it: eager, a third of the memory, short contexts, seed 0
    (``options``: what a script varies, e.g. ``dtype``; ``enforce_eager=False`` compiles)."""
    from vllm import LLM

    options.setdefault("enforce_eager", True)
    return LLM(
        model=model,
        skip_tokenizer_init=True,
        gpu_memory_utilization=0.3,
        max_model_len=128,
        max_num_seqs=4,
        seed=0,
        **options,
    )
