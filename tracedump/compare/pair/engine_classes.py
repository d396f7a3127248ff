"""Module classes and names as the derived pairing reads them: the engine-wide kinds of weightless
module (never one per family), and the small name helpers every derivation module uses."""

from __future__ import annotations

import re

IDENTITY = re.compile(r"Dropout\d?d?|Identity")

# Weightless modules, engine-wide (never per family): class name regexes (searched in the bare
# class name) and what they are compared with.
ENGINE_CLASSES: dict[str, str] = {
    "act_and_mul": r"AndMul$",
    "attention": r"^(Attention|MLAAttention|EncoderOnlyAttention)$",
    "rotary": r"Rotary|RoPE|Rope",
    "logits": r"^LogitsProcessor$",
    "norm": r"Norm",
    "embedding": r"Embedding|LMHead",
    "scaled": r"Scaled",  # an embedding that multiplies by a scale inside itself (HF's Gemma)
}


def bare(qualname: str) -> str:
    """``vllm.model_executor.layers.linear.QKVParallelLinear`` -> ``QKVParallelLinear``."""
    return qualname.rsplit(".", 1)[-1]


def is_kind(kind: str, qualname: str | None) -> bool:
    """Whether a module's class is of one of :data:`ENGINE_CLASSES`' kinds."""
    return bool(qualname) and re.search(ENGINE_CLASSES[kind], bare(qualname or "")) is not None


def parent(name: str) -> str:
    """``model.layers.0.mlp`` -> ``model.layers.0``; the root's parent is the root (``""``)."""
    return name.rpartition(".")[0]


def ancestors(name: str) -> list[str]:
    """``a.b.c`` -> ``["a.b", "a", ""]``: every module above, nearest first, the root last."""
    out = []
    while name:
        name = parent(name)
        out.append(name)
    return out


def under(name: str, top: str) -> bool:
    """Whether ``name`` is ``top`` or below it (everything is below the root ``""``)."""
    return not top or name == top or name.startswith(top + ".")
