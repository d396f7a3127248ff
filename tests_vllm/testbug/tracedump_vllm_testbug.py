"""A test-only vLLM plugin that plants a bug in the model, inside vLLM's worker.

``TRACEDUMP_TEST_BUG="model.layers.2.mlp.down_proj.weight*1.05"`` scales that parameter right after
vLLM loads the weights (so layer 2's MLP output is x1.05); several specs are separated by ``;``.
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
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    if getattr(BaseModelLoader.load_model, "_testbug", False):
        return
    original = BaseModelLoader.load_model

    @functools.wraps(original)
    def load_model(self, *args, **kwargs):
        import torch

        model = original(self, *args, **kwargs)
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, factor in specs:
                if name not in params:
                    raise KeyError(f"{ENV}: no parameter {name!r}; some: {sorted(params)[:8]}")
                params[name].mul_(factor)
        print(f"tracedump_vllm_testbug: planted {specs}", flush=True)
        return model

    load_model._testbug = True
    BaseModelLoader.load_model = load_model
