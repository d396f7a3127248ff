"""What vLLM computes outside every module's output, recorded while dumping (the vLLM plugin,
dumping on only): each fused-MoE router's top-k, and the head's logits before the
``LogitsProcessor``'s soft cap and scale.

**Routing.** vLLM's fused MoE chooses each token's experts outside every module's forward: its
runner hands the gate's logits to a router object (``select_experts``), whose ``(topk_weights,
topk_ids)`` go straight into the experts kernel. No hook sees them, so the routing HF's router
returns as tensors (``gate[1]``, ``gate[2]``) had no engine counterpart. :func:`record_routing`
wraps each router's ``select_experts`` on the instance and records, with the public
``Dumper.record``, what the engine itself computed, under the name of the MoE block:

- ``<block>.routing[logits]``: the router logits the router was handed (the scores, so that a
  near-tie flip can be told from a routing change: docs/comparator.md);
- ``<block>.routing[topk_weights]`` and ``<block>.routing[topk_ids]``: the chosen experts and
  their weights, each row ordered by weight, largest first (ties by expert id). A top-k is a set:
  the CPU router's ``torch.topk(sorted=False)`` and HF's sorted one hold the same experts in
  other orders, and the kernel does not depend on it. The engine's own tensors are untouched.

A kernel that routes inside itself (a monolithic one) never calls ``select_experts``: nothing is
recorded and HF's top-k stays listed with the reason (``compare/pair/correspondence.py``).

**Logits.** vLLM's ``LogitsProcessor`` output is the head's output after its soft cap (Gemma2's
``final_logit_softcapping``) and scale (Granite's ``logits_scaling``), which HF applies in its
``ForCausalLM.forward`` after its ``lm_head`` module, in no module. :func:`record_head_logits`
records the head's output before them as ``<logits processor>[raw]``: the tensor HF's head
module returns, in every family (a tied head that vLLM computes with its embedding included).

Every vLLM internal used is in :mod:`.vllm_compat`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from ..store.correspondence import RAW_LOGITS, ROUTING_PATHS, routing_name
from . import vllm_compat

_MARK = "_tracedump_record"


def routing_tag(runner: str, what: str) -> str:
    """The record tag of one routing tensor of the MoE runner ``runner``: under its block (the
    runner's parent), so that the block's tensors are those a routing flip covers."""
    return routing_name(runner.rpartition(".")[0], what)


def canonical_topk(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, ids)`` with each row ordered by weight, largest first, ties by expert id: new
    tensors, the engine's are not changed."""
    by_id = torch.argsort(ids, dim=-1, stable=True)
    weights, ids = weights.gather(-1, by_id), ids.gather(-1, by_id)
    order = torch.argsort(weights, dim=-1, descending=True, stable=True)
    return weights.gather(-1, order), ids.gather(-1, order)


def record_routing(model: Any, dumper: Any) -> int:
    """Wrap the ``select_experts`` of each fused-MoE router of ``model`` so that every call records
    its routing into ``dumper``'s open pass; the number of routers wrapped."""
    count = 0
    for runner, router in vllm_compat.moe_routers(model):

        def routing(args: tuple[Any, ...], kwargs: dict[str, Any], result: Any, runner: str = runner) -> None:
            logits, weights, ids = vllm_compat.select_experts_call(args, kwargs, result)
            if (
                isinstance(weights, torch.Tensor)
                and isinstance(ids, torch.Tensor)
                and weights.shape == ids.shape
            ):
                weights, ids = canonical_topk(weights, ids)
            for what, tensor in zip(ROUTING_PATHS, (logits, weights, ids), strict=True):
                if isinstance(tensor, torch.Tensor):
                    dumper.record(routing_tag(runner, what), tensor)

        count += _wrap(router, vllm_compat.SELECT_EXPERTS, routing, runner, dumper)
    return count


def record_head_logits(model: Any, dumper: Any) -> int:
    """Wrap each ``LogitsProcessor``'s head computation so that every call records the head's
    logits (before soft cap and scale) as ``<processor>[raw]``; the number wrapped."""
    count = 0
    for name, processor in vllm_compat.logits_processors(model):

        def head(args: tuple[Any, ...], kwargs: dict[str, Any], result: Any, name: str = name) -> None:
            if isinstance(result, torch.Tensor):  # None on a tensor-parallel rank the gather skipped
                dumper.record(f"{name}{RAW_LOGITS}", result)

        count += _wrap(processor, vllm_compat.HEAD_LOGITS, head, name, dumper)
    return count


def _wrap(owner: Any, method: str, record: Callable[..., None], where: str, dumper: Any) -> int:
    """Replace ``owner.method`` (on the instance) by a call of the original that hands its
    arguments and result to ``record``; the original's result is returned unchanged, and a
    failure to record is never raised into the engine: it goes to the public
    ``Dumper.report_error`` (warned once, counted in the manifest's ``errors``, so a dump that
    lacks its routing says why). 1 when wrapped."""
    original = getattr(owner, method, None)
    if not callable(original) or getattr(original, _MARK, False):
        return 0

    @functools.wraps(original)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        if torch.compiler.is_compiling():
            # traced into a compiled model (COMPILED=1): the record is Python the graph cannot
            # hold (vLLM compiles with fullgraph, where it would fail the engine's start), so
            # the compiled program carries no routing record (docs/engines.md)
            return result
        try:
            record(args, kwargs, result)
        except Exception as e:  # a diagnostic: never break the engine's forward
            _report(dumper, f"vllm record {method} in {where}", e)
        return result

    setattr(wrapped, _MARK, True)
    setattr(owner, method, wrapped)
    return 1


def _report(dumper: Any, where: str, error: Exception) -> None:
    """A record failure into the dump's errors; a dumper whose report itself fails (closed,
    broken) only warns once: the engine's forward goes on either way."""
    try:
        dumper.report_error(where, error)
    except Exception as e:
        from ..dump.runtime import warn_once

        warn_once(f"vllm-record:{where}", f"tracedump: cannot record {where} ({error!r}; report: {e!r})")
