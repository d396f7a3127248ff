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
from dataclasses import dataclass, replace

import numpy as np

from ...store.format import Key
from ..load.reader import Stored, widen

TIE_FACTOR = 4.0  # a flip whose top-k margin is within this many x the scores' RMS noise is a tie


def module_of(name: str) -> str:
    """The module a tensor name belongs to: ``a.gate[2]::call1`` -> ``a.gate``."""
    return Key.parse(name).module


@dataclass(frozen=True, kw_only=True)
class Flip:
    """Tokens a router sent elsewhere, and whether it was a near-tie."""

    router: str
    block: str
    tokens: int
    flipped: tuple[int, ...]
    margins: tuple[float, ...]
    noise: float
    inherited: tuple[int, ...] = ()  # flipped tokens that an earlier router of the pass flipped already

    @property
    def near_tie(self) -> bool:
        return all(m <= TIE_FACTOR * self.noise for m in self.margins)

    def covers(self, name: str) -> bool:
        """A tensor of this MoE block after the router (the block output included): compared on the
        tokens that kept their experts, or not at all when its rows are not tokens."""
        module = module_of(name)
        return module != self.router and (module == self.block or module.startswith(self.block + "."))

    def message(self) -> str:
        if self.flipped and not self.margins:
            return (
                f"router {self.router}: {len(self.flipped)} of {self.tokens} tokens routed differently, "
                f"all of them flipped by an earlier router or downstream of its near-tie flip "
                f"(tokens {_short(self.flipped)}): not a divergence"
            )
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
            "inherited": list(self.inherited),
        }


def _short(values: tuple[int, ...]) -> str:
    return ",".join(map(str, values[:8])) + (" ..." if len(values) > 8 else "")


def is_router_indices(shape: tuple[int, ...] | None, dtype_a: str | None, dtype_b: str | None) -> bool:
    integers = all(d is not None and d.startswith(("int", "uint")) for d in (dtype_a, dtype_b))
    return integers and shape is not None and len(shape) == 2 and 0 < shape[1] < 64


def detect(
    router: str,
    indices: tuple[Stored, Stored],
    scores: tuple[Stored, Stored] | None,
    upstream: frozenset[int] = frozenset(),
) -> Flip | None:
    """The flip of one router, or None when its indices agree (or cannot be judged: no scores).

    Indices that hold the same experts in another order (a near-tie between two chosen experts)
    are a flip of no token: the experts' own tensors no longer line up (they gather tokens by
    top-k slot), the block's output still does. ``upstream``: tokens an earlier router of the
    pass flipped at a near-tie. They carry another expert's answer here, so their routing is no
    evidence: they are left out of the noise and the margins (``inherited`` when they flip again)."""
    raw_a, raw_b = (s.array.astype(np.int64) for s in indices)
    if raw_a.shape != raw_b.shape or raw_a.ndim != 2 or np.array_equal(raw_a, raw_b):
        return None
    index_a, index_b = np.sort(raw_a, axis=1), np.sort(raw_b, axis=1)
    rows = np.nonzero((index_a != index_b).any(axis=1))[0]
    block = router.rpartition(".")[0] or router
    tokens, k = index_a.shape
    if rows.size == 0:
        return Flip(router=router, block=block, tokens=tokens, flipped=(), margins=(), noise=0.0)
    inherited = tuple(int(r) for r in rows if int(r) in upstream)
    new = np.array([r for r in rows if int(r) not in upstream], dtype=np.int64)
    if new.size == 0:
        return Flip(
            router=router,
            block=block,
            tokens=tokens,
            flipped=tuple(int(r) for r in rows),
            margins=(),
            noise=0.0,
            inherited=inherited,
        )
    if scores is None:
        return None
    score_a, score_b = (widen(s.array, s.dtype).reshape(tokens, -1) for s in scores)  # whole: small
    if score_b.shape[1] <= k:
        return None
    clean = np.ones(tokens, dtype=bool)
    clean[list(upstream & set(range(tokens)))] = False
    noise = math.sqrt(float(np.mean((score_a[clean].astype(np.float64) - score_b[clean]) ** 2)))
    ranked = -np.sort(-score_b[new].astype(np.float64), axis=1)
    margins = ranked[:, k - 1] - ranked[:, k]
    return Flip(
        router=router,
        block=block,
        tokens=tokens,
        flipped=tuple(int(r) for r in rows),
        margins=tuple(margins),
        noise=noise,
        inherited=inherited,
    )


def flipped_before(flips: list[Flip], tokens: int) -> frozenset[int]:
    """Every token the near-tie flips so far in this pass sent elsewhere, among ``tokens``."""
    return frozenset(t for f in flips if f.near_tie and f.tokens == tokens for t in f.flipped)


def downstream_of(flips: list[Flip], shape: tuple[int, ...]) -> Flip | None:
    """The near-tie flips earlier in this pass whose tokens this tensor's rows hold, as one flip of
    all their flipped tokens (None when there are none, or its rows are not those tokens).

    Downstream of a near-tie flip, the flipped tokens carry another expert's answer in every later
    tensor: the ceiling must not judge that answer, so later tensors are compared on the tokens
    every router routed alike (:func:`kept_rows`), as the block's own tensors are."""
    for tokens in dict.fromkeys(f.tokens for f in flips if f.near_tie and f.flipped):
        flipped = flipped_before(flips, tokens)
        if len(flipped) < tokens and _token_dims(shape, tokens) is not None:
            routers = ", ".join(dict.fromkeys(f.router for f in flips if f.tokens == tokens and f.flipped))
            first = next(f for f in flips if f.tokens == tokens)
            return Flip(
                router=routers,
                block=first.block,
                tokens=tokens,
                flipped=tuple(sorted(flipped)),
                margins=(),
                noise=first.noise,
            )
    return None


def merged(flip: Flip, flips: list[Flip]) -> Flip:
    """``flip`` with the tokens earlier near-tie flips of the pass sent elsewhere added."""
    earlier = flipped_before([f for f in flips if f is not flip], flip.tokens)
    if earlier <= set(flip.flipped):
        return flip
    return replace(flip, flipped=tuple(sorted(earlier | set(flip.flipped))), margins=())


def _token_dims(shape: tuple[int, ...], tokens: int) -> tuple[str, tuple[int, ...]] | None:
    """Where a tensor holds the router's ``tokens``: ``("lead", (d,))`` when its dims up to d
    flatten to them (``[tokens, hidden]``, ``[batch, seq, hidden]``, ``[1, seq, heads, dim]``), else
    ``("each", dims)`` for one sequence laid out otherwise: its inner dims of that size (attention
    weights ``[1, heads, q, k]``: the flipped queries, and the keys of that square). A last dim
    alone is features (an expert's intermediate size may equal the token count): never a token dim."""
    lead = 1
    for d, size in enumerate(shape[:-1]):
        lead *= size
        if lead == tokens:
            return "lead", (d,)
        if lead > tokens:
            break
    if len(shape) < 3 or shape[0] != 1:
        return None
    dims = [d for d in range(1, len(shape) - 1) if shape[d] == tokens]
    if dims and dims[-1] == len(shape) - 2 and shape[-1] == tokens:
        dims.append(len(shape) - 1)  # a [q, k] square: the keys too (a last dim alone is features)
    return ("each", tuple(dims)) if dims else None


def kept_rows(stored: Stored, flip: Flip, keep: np.ndarray | None = None) -> Stored | None:
    """The tensor without the flipped tokens, when it holds the router's tokens (see
    :func:`_token_dims`); None when it does not (per-expert tensors, whose rows are its tokens).
    ``keep``: the tokens to keep instead (a bool mask over the router's tokens)."""
    where = _token_dims(stored.shape, flip.tokens)
    if where is None:
        return None
    if keep is None:
        keep = np.ones(flip.tokens, dtype=bool)
        keep[list(flip.flipped)] = False
    how, dims = where
    if how == "lead":
        rows = stored.array.reshape(flip.tokens, -1)
        return Stored(np.ascontiguousarray(rows[keep]), stored.dtype)
    array = stored.array
    for d in dims:
        array = np.compress(keep, array, axis=d)
    return Stored(np.ascontiguousarray(array), stored.dtype)


def unaffected_tokens(flip: Flip, sequence: int | None, causal: bool | None) -> tuple[np.ndarray | None, str]:
    """The router's tokens that provably carry none of ``flip``'s consequence in a tensor after
    the flipped block, and why only those.

    A flipped token's new value reaches every token that attends to it in a later layer. Under a
    causal mask (both runs' attentions declare it: the manifest's ``attention``) a token attends
    only to positions up to its own, so the positions before the first flipped one of each sequence
    (``sequence`` tokens long, the router's tokens being whole sequences laid end to end) are
    untouched; anything else may have received it. None (nothing provable) when the mask is not
    known causal, or the sequences' length is not known."""
    if causal is not True:
        why = "a bidirectional attention" if causal is False else "attention masks not known causal"
        return None, f"{why}: every token may have attended to a flipped one"
    if not sequence or flip.tokens % sequence:
        return None, "the sequences' layout is not known: every token may have attended to a flipped one"
    first = np.full(flip.tokens // sequence, sequence)
    for t in flip.flipped:
        first[t // sequence] = min(first[t // sequence], t % sequence)
    positions = np.arange(flip.tokens)
    keep = (positions % sequence) < first[positions // sequence]
    return keep, "causal attention: the positions before each sequence's first flipped token"
