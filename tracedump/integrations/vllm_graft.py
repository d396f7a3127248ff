"""vLLM grafted from an HF reference: how each of vLLM's modules takes HF's recorded inputs.

With ``TRACEDUMP_DUMP_GRAFT_FROM`` set, the plugin hands the dumper one
:class:`~tracedump.dump.graft_feed.InputFeed` per vLLM module whose call is not HF's
(:func:`graft_feeds`, through the public ``Dumper.set_graft_feeds``):

- a decoder layer, ``layer(positions, hidden_states, residual)``: ``hidden_states`` takes HF's
  layer input (the whole residual stream), ``residual`` (when the call passes one: every layer
  but the first) is replaced by zeros, ``positions`` stays the engine's own. The layer's first
  fused add + norm then computes ``stream + 0``: the stream, once, exactly, on the layer's own
  code path; its output ``(hidden, residual)`` is compared as ``hidden + residual`` (the
  derived bridge), so each layer's own error against HF is judged;
- a fused add + norm, ``norm(x, residual)`` (leaf level): ``x`` takes HF's norm input (the
  stream), ``residual`` zeros; its outputs are then ``norm(stream)`` and the stream itself
  (compared with HF's norm input), never the residual counted twice;
- the leaves whose inputs HF has no module for are refused, with the reason
  (:func:`~.vllm_compat.graft_refusal`: the attention op, rotary embeddings, ``*AndMul``
  activations, fused experts): each call runs on its own inputs and is listed as not grafted.

Every vLLM internal relied on is in :mod:`.vllm_compat`.
"""

from __future__ import annotations

from torch import nn

from ..dump.graft_feed import InputFeed
from ..dump.selection import display_name
from . import vllm_compat

HF_HIDDEN = ("[0]", "[hidden_states]")  # where HF's decoder layer and norm take the stream


def decoder_layer_feed(params: tuple[str, ...]) -> InputFeed:
    """A vLLM decoder layer fed HF's layer input: the stream as ``hidden_states``, no residual."""
    return InputFeed(
        params=params,
        take={"hidden_states": HF_HIDDEN},
        zero=frozenset({"residual"}),
        what="vLLM decoder layer: hidden_states <- the reference's layer input (the residual stream), "
        "residual <- 0, positions its own",
    )


def fused_add_norm_feed(params: tuple[str, ...]) -> InputFeed:
    """A vLLM fused add + norm fed HF's norm input: the stream as ``x``, the residual zeros."""
    first = params[0]
    return InputFeed(
        params=params,
        take={first: ("[0]", f"[{first}]", "[hidden_states]")},
        zero=frozenset({params[1]}),
        what=f"vLLM fused add + norm: {first} <- the reference's norm input (the residual stream), "
        f"{params[1]} <- 0 (added once)",
    )


def graft_feeds(model: nn.Module) -> dict[str, InputFeed]:
    """Every module of ``model`` (by its name in keys) whose call is not its HF counterpart's:
    how it is fed, or why it is refused."""
    feeds: dict[str, InputFeed] = {}
    for name, module in model.named_modules():
        layer = vllm_compat.decoder_layer_params(module)
        norm = vllm_compat.fused_add_norm_params(module) if layer is None else None
        refusal = vllm_compat.graft_refusal(module) if layer is None and norm is None else None
        if layer is not None:
            feeds[display_name(name)] = decoder_layer_feed(layer)
        elif norm is not None:
            feeds[display_name(name)] = fused_add_norm_feed(norm)
        elif refusal is not None:
            feeds[display_name(name)] = InputFeed(refuse=refusal)
    return feeds
