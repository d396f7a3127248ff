"""A test-only vLLM plugin that plants a bug in the model, inside vLLM's worker.

``TRACEDUMP_TEST_BUG="model.layers.2.mlp.down_proj.weight*1.05"`` scales that parameter once vLLM
has loaded the weights, before it processes them for its kernels (so layer 2's MLP output is
x1.05); several specs are separated by ``;``.
Unset, it does nothing. The conftest puts this folder (with its ``.dist-info``) on ``PYTHONPATH``
of the engine subprocesses only; it is never installed.
"""

from __future__ import annotations

import functools
import os

ENV = "TRACEDUMP_TEST_BUG"


def _specs(text: str) -> list[tuple[str, float]]:
    out = []
    for spec in filter(None, (s.strip() for s in text.split(";"))):
        name, _, factor = spec.partition("*")
        out.append((name.strip(), float(factor)))
    return out


def register() -> None:
    text = os.environ.get(ENV, "").strip()
    if not text:
        return
    specs = _specs(text)
    from vllm.model_executor.model_loader import base_loader

    original = base_loader.process_weights_after_loading
    if getattr(original, "_testbug", False):
        return

    # Scaled before the weights are processed into the kernel's format (the CPU build packs
    # them): a change made after loading would not reach the kernels.
    @functools.wraps(original)
    def process_weights_after_loading(model, *args, **kwargs):
        import torch

        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, factor in specs:
                if name not in params:
                    raise KeyError(f"{ENV}: no parameter {name!r}; some: {sorted(params)[:8]}")
                params[name].mul_(factor)
        print(f"tracedump_vllm_testbug: planted {specs}", flush=True)
        return original(model, *args, **kwargs)

    process_weights_after_loading._testbug = True
    base_loader.process_weights_after_loading = process_weights_after_loading
