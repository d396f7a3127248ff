"""A test-only vLLM plugin that plants a bug in the model, inside vLLM's worker.

``TRACEDUMP_TEST_BUG="model.layers.2.mlp.down_proj.weight*1.05"`` scales that parameter once vLLM
has loaded the weights, before it processes them for its kernels (so layer 2's MLP output is
x1.05); several specs are separated by ``;``.
``TRACEDUMP_TEST_CRASH="model.layers.1.mlp:3"`` makes that module's forward raise at its third call
of fewer than 16 token rows (an engine step that crashes mid-forward).
``scale_layer2_mlp``: an inductor post-grad pass that plants a bug of the compiled program only.
Unset, it does nothing. The conftest puts this folder (with its ``.dist-info``) on ``PYTHONPATH``
of the engine subprocesses only; it is never installed.
"""

from __future__ import annotations

import functools
import os

ENV = "TRACEDUMP_TEST_BUG"
CRASH_ENV = "TRACEDUMP_TEST_CRASH"


def _specs(text: str) -> list[tuple[str, float]]:
    out = []
    for spec in filter(None, (s.strip() for s in text.split(";"))):
        name, _, factor = spec.partition("*")
        out.append((name.strip(), float(factor)))
    return out


def _crash_spec(text: str) -> tuple[str, int] | None:
    """``module:N``: that module's forward raises at its Nth call of fewer than 16 token rows
    (engine steps of a few requests; the profile and warm-up runs use more rows)."""
    if not text:
        return None
    name, _, count = text.rpartition(":")
    return name, int(count)


def _plant_crash(model, spec: tuple[str, int]) -> None:
    name, wanted = spec
    module = dict(model.named_modules())[name]
    calls = [0]

    def crash(_module, args):
        rows = args[0].shape[0] if args and hasattr(args[0], "shape") and args[0].dim() else 0
        if rows < 16:
            calls[0] += 1
            if calls[0] == wanted:
                raise RuntimeError(f"{CRASH_ENV}: {name} raised at its call {wanted}")

    module.register_forward_pre_hook(crash)
    print(f"tracedump_vllm_testbug: {name} will raise at its call {wanted}", flush=True)


def register() -> None:
    text = os.environ.get(ENV, "").strip()
    crash = _crash_spec(os.environ.get(CRASH_ENV, "").strip())
    if not text and crash is None:
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
        if specs:
            print(f"tracedump_vllm_testbug: planted {specs}", flush=True)
        if crash is not None:
            _plant_crash(model, crash)
        return original(model, *args, **kwargs)

    process_weights_after_loading._testbug = True
    base_loader.process_weights_after_loading = process_weights_after_loading


SCALED_MODULE = ".layers.2.mlp.act_fn"  # the module path (under the compiled model) the pass changes


def scale_layer2_mlp(graph) -> None:
    """An inductor post-grad pass (planted with ``offline.py --compiled --post-grad-pass
    tracedump_vllm_testbug.scale_layer2_mlp``, i.e. vLLM's ``compilation_config.inductor_passes``):
    the output of layer 2's activation (the last aten op traced from ``*.layers.2.mlp.act_fn``,
    found by the ``nn_module_stack`` Dynamo keeps on each node, not by tracedump's taps) is scaled
    by 1.05 for every user, tracedump's tap included. A bug of the compiled program only: the eager
    engine never runs this graph. Prints the node it changed (the test's premise)."""
    import torch

    nodes = [
        node
        for node in graph.nodes
        if node.op == "call_function"
        and isinstance(node.target, torch._ops.OpOverload)
        and _module_path(node).endswith(SCALED_MODULE)
    ]
    if not nodes:
        return
    source = nodes[-1]
    with graph.inserting_after(source):
        scaled = graph.call_function(torch.ops.aten.mul.Tensor, (source, 1.05))
    scaled.meta.update(source.meta)
    source.replace_all_uses_with(scaled, delete_user_cb=lambda user: user is not scaled)
    print(f"tracedump_vllm_testbug: post-grad pass scaled {source.name} ({source.target}) x1.05", flush=True)


def _module_path(node) -> str:
    """The innermost module a node was traced from (Dynamo's ``L['self'].layers.2.mlp.act_fn``)."""
    stack = node.meta.get("nn_module_stack") or {}
    return str(list(stack.values())[-1][0]) if stack else ""
