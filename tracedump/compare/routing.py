"""MoE routing flips: a near-tie in a router's top-k sends a token to another expert.

Between bf16 and fp32 runs (or two kernels) a router's scores differ by rounding, and a token whose
k-th and (k+1)-th experts score within that noise can pick the other one. Its expert calls then
hold other tokens (the per-expert tensors no longer line up) and its block output carries another
expert's answer: large errors that are no bug. A router is recognised by its output: an integer
``[tokens, k]`` tensor of expert indices beside a float ``[tokens, experts]`` tensor of scores in
the same module output (HF Mixtral/Qwen-MoE routers return ``(logits, weights, indices)``).

When the indices differ, each flipped token's **margin** is the gap between its k-th and
(k+1)-th score in the reference, against the router's **noise**: the RMS of A - B over all scores.
Every margin within :data:`TIE_FACTOR` x noise: a near-tie flip, reported (``routing_flip``), not a
divergence. A wider margin is a divergence: the routing itself changed. After a near-tie flip, the
tensors of that MoE block are compared on the tokens that kept their experts, per-expert tensors
that cannot line up are skipped (``routing``), and the whole error joins the running level.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..format import Key
from .reader import Stored

TIE_FACTOR = 4.0  # a flip whose top-k margin is within this many x the scores' RMS noise is a tie


def module_of(name: str) -> str:
    """The module a tensor name belongs to: ``a.gate[2]::call1`` -> ``a.gate``."""
    return Key.parse(name).module


def as_float(stored: Stored) -> np.ndarray:
    """The values as float32 (float64 kept), whole: routers and token rows are small."""
    raw = stored.array
    if stored.dtype == "bfloat16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    if stored.dtype.startswith("float8"):
        return stored.to_torch().float().numpy()
    return raw if raw.dtype == np.float64 else raw.astype(np.float32)


@dataclass(frozen=True)
class Flip:
    """Tokens a router sent elsewhere, and whether it was a near-tie."""

    router: str
    block: str
    tokens: int
    flipped: tuple[int, ...]
    margins: tuple[float, ...]
    noise: float

    @property
    def near_tie(self) -> bool:
        return all(m <= TIE_FACTOR * self.noise for m in self.margins)

    def covers(self, name: str) -> bool:
        """A tensor of this MoE block after the router (the block output included): compared on the
        tokens that kept their experts, or not at all when its rows are not tokens."""
        module = module_of(name)
        return module != self.router and (module == self.block or module.startswith(self.block + "."))

    def message(self) -> str:
        if not self.flipped:
            return (
                f"router {self.router}: the same experts in another top-k order for some of "
                f"{self.tokens} tokens (a near-tie between chosen experts): not a divergence"
            )
        widest = max(self.margins) if self.margins else 0.0
        verdict = (
            "near-tie, within the run's noise: not a divergence"
            if self.near_tie
            else f"margin beyond {TIE_FACTOR:g}x the noise: routing changed"
        )
        return (
            f"router {self.router}: {len(self.flipped)} of {self.tokens} tokens routed differently "
            f"(tokens {_short(self.flipped)}; top-k margin up to {widest:.3g} vs score noise "
            f"{self.noise:.3g}): {verdict}"
        )

    def to_json(self) -> dict[str, object]:
        return {
            "router": self.router,
            "block": self.block,
            "tokens": self.tokens,
            "flipped": list(self.flipped),
            "margins": [float(m) for m in self.margins],
            "noise": float(self.noise),
            "near_tie": self.near_tie,
        }


def _short(values: tuple[int, ...]) -> str:
    return ",".join(map(str, values[:8])) + (" ..." if len(values) > 8 else "")


def is_router_indices(shape: tuple[int, ...] | None, dtype_a: str | None, dtype_b: str | None) -> bool:
    integers = all(d is not None and d.startswith(("int", "uint")) for d in (dtype_a, dtype_b))
    return integers and shape is not None and len(shape) == 2 and 0 < shape[1] < 64


def detect(router: str, indices: tuple[Stored, Stored], scores: tuple[Stored, Stored] | None) -> Flip | None:
    """The flip of one router, or None when its indices agree (or cannot be judged: no scores).

    Indices that hold the same experts in another order (a near-tie between two chosen experts)
    are a flip of no token: the experts' own tensors no longer line up (they gather tokens by
    top-k slot), the block's output still does."""
    raw_a, raw_b = (s.array.astype(np.int64) for s in indices)
    if raw_a.shape != raw_b.shape or raw_a.ndim != 2 or np.array_equal(raw_a, raw_b):
        return None
    index_a, index_b = np.sort(raw_a, axis=1), np.sort(raw_b, axis=1)
    rows = np.nonzero((index_a != index_b).any(axis=1))[0]
    block = router.rpartition(".")[0] or router
    tokens, k = index_a.shape
    if rows.size == 0:
        return Flip(router, block, tokens, (), (), 0.0)
    if scores is None:
        return None
    score_a, score_b = (as_float(s).reshape(tokens, -1) for s in scores)
    if score_b.shape[1] <= k:
        return None
    noise = math.sqrt(float(np.mean((score_a.astype(np.float64) - score_b) ** 2)))
    ranked = -np.sort(-score_b[rows].astype(np.float64), axis=1)
    margins = ranked[:, k - 1] - ranked[:, k]
    return Flip(router, block, tokens, tuple(int(r) for r in rows), tuple(margins), noise)


def kept_rows(stored: Stored, flip: Flip) -> Stored | None:
    """The tensor without the flipped tokens' rows, when its rows are the router's tokens."""
    shape = stored.shape
    if len(shape) < 2 or math.prod(shape[:-1]) != flip.tokens:
        return None
    rows = stored.array.reshape(flip.tokens, shape[-1])
    keep = np.ones(flip.tokens, dtype=bool)
    keep[list(flip.flipped)] = False
    return Stored(np.ascontiguousarray(rows[keep]), stored.dtype)
