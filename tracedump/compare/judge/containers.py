"""Which upstream tensors can explain a container's own outputs: the call tree, read from the keys.

A module's output is recorded when it returns, so a container (``self_attn``, a decoder layer, a
MoE block) is recorded after all of its children, whatever it computed first. HF attention returns
``(o_proj's output, attention weights)``: the weights are computed from ``q`` and ``k``, *before*
``o_proj`` runs, yet recorded after it. The running error level would let ``o_proj``'s error,
computed later, "explain" the weights; on a CPU where a one-layer rotary bug moves ``o_proj`` by
less than one rounding (2e-5) and the weights by 17 roundings (7.7e-4), the bug passed.

The rule (:func:`anchors`): each result gets an **anchor**, the position whose running level (the
level *before* it) explains it.

- Anything but a container's second and later outputs: itself (the whole running level, as before).
  A container's first output leaf (``self_attn[0]``, a layer's hidden states) is its result,
  computed last, from its last child's output.
- A later output leaf of a container with recorded children (``self_attn[1]``, a router's logits
  beside the block's output, an SSM state) that is a **copy** of a child's output (the same
  shape and the very same measured error, a fingerprint no independent computation shares), e.g.
  a decoder layer passing on ``self_attn[1]`` or a norm's residual: that child's anchor.
- Any other later output leaf: the start of the container's **last child** (its first recorded
  tensor). Such an output is an intermediate the container exposes (weights, logits, a state): the
  last child (``o_proj``, the experts, ``out_proj``) consumes it or runs beside it, and its data
  never flows into it. What came before the container started, and its children before the last,
  still explain it.

The call tree is read from the keys in recording order (``format.Key``: module, ``@in``, path,
``::callN``): a container's call is the run of records just before its outputs whose modules are its
descendants (or its own inputs, recorded when it starts, or its earlier output leaves). A record of
anything else (another root, a ``record()`` tag) ends the walk, and a container whose children were
not dumped (``MODULES`` that skip them, ``--filter``) keeps the whole running level: the rule only
ever narrows what explains an output where the dump shows the children.
"""

from __future__ import annotations

from collections.abc import Sequence

from ...store.format import Key
from ..results import Measured


def _key(name: str) -> Key | None:
    try:
        return Key.parse(name)
    except ValueError:
        return None


def _fingerprint(result: Measured) -> tuple[object, ...] | None:
    """Identical for a tensor and its copy: shape and every measured figure (None if unmeasured or
    exactly equal, where a fingerprint would match every exact tensor of that shape)."""
    m = result.metrics
    if m is None or not result.evidence.plain or m.max_abs == 0:
        return None
    return (result.shape_a, result.dtype_a, m.rel_diff, m.max_abs, m.mean_abs, m.argmax, m.numel)


def _descends(module: str, container: str) -> bool:
    return module.startswith(container + ".")


def _call_start(keys: Sequence[Key | None], at: int) -> tuple[int, int | None, int]:
    """(first output leaf, last recorded descendant or None, start) of the call whose output
    ``keys[at]`` is: the walk back over the call's own records."""
    key = keys[at]
    assert key is not None
    first_output, last_child, start = at, None, at
    j = at - 1
    while j >= 0:
        other = keys[j]
        if other is None:
            break
        if other.module == key.module:
            if other.call != key.call:
                break
            start = j
            if other.input:  # recorded when the call started: nothing of it lies before
                break
            if last_child is None:
                first_output = j
        elif _descends(other.module, key.module):
            start = j
            if last_child is None:
                last_child = j
        else:
            break
        j -= 1
    return first_output, last_child, start


def anchors(results: Sequence[Measured]) -> list[int]:
    """For each result, the position (in ``results``) whose running level explains it; see the
    module doc. Positions are within the same root and pass (a walk stops at their edges)."""
    out = list(range(len(results)))
    segment: list[int] = []  # positions of the current (pass, root)
    keys: list[Key | None] = []
    current: tuple[int, tuple[str | None, str | None]] | None = None
    for position, result in enumerate(results):
        unit = (result.pass_index, result.scope)
        if unit != current:
            current, segment, keys = unit, [], []
        segment.append(position)
        keys.append(_key(result.name))
        here = len(keys) - 1
        key = keys[here]
        if key is None or key.input or here == 0:
            continue
        previous = keys[here - 1]
        later_leaf = previous is not None and previous.module == key.module and previous.call == key.call
        if not later_leaf or previous.input:
            continue  # a first output leaf: the whole running level
        first_output, last_child, start = _call_start(keys, here)
        if last_child is None or first_output == here:
            continue
        copied = _copied_child(results, segment, keys, range(last_child, start - 1, -1), result)
        if copied is not None:
            out[position] = out[segment[copied]]
            continue
        _, _, child_start = _call_start(keys, last_child)
        out[position] = segment[child_start]
    return out


def _copied_child(
    results: Sequence[Measured],
    segment: Sequence[int],
    keys: Sequence[Key | None],
    candidates: range,
    result: Measured,
) -> int | None:
    """The latest child output in ``candidates`` (segment positions) that ``result`` is a copy of."""
    mark = _fingerprint(result)
    if mark is None:
        return None
    for j in candidates:
        key = keys[j]
        if key is not None and not key.input and _fingerprint(results[segment[j]]) == mark:
            return j
    return None
