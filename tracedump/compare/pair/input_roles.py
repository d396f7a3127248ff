"""Module inputs of two different module trees, paired by what they hold, not by their place in
the call (docs/engines.md, "Inputs across two module trees").

Two implementations of one module rarely take the same arguments in the same order. vLLM's
decoder layer is called ``layer(positions, hidden_states, residual)``, HF's ``layer(hidden_states,
attention_mask=..., position_ids=..., position_embeddings=...)``: by path, vLLM's ``@in[0]`` (the
positions, integers ``[tokens]``) would meet HF's ``@in[0]`` (the hidden states, floats ``[batch,
seq, hidden]``), a false shape mismatch; vLLM's fused add + norm takes ``(x, residual)`` where
HF's norm takes their sum, so by path its ``@in[0]`` would meet another quantity of the same
shape, a false divergence. Here, for one call of two paired modules:

1. inputs passed by the same keyword on both sides (``@in[hidden_states]``) pair, when they hold
   the same :class:`Role`; and when the rest are one signature on both sides (the same paths,
   each holding the same role: two ports of one module class), they pair by path;
2. the rest pair by role: a role held by exactly one input on each side pairs those two
   (``positions`` with ``position_ids``: integers both; vLLM's ``hidden_states`` with HF's
   ``@in[0]`` where the layer has no residual yet);
3. a role held by several inputs of a side (vLLM's ``hidden_states`` and ``residual`` against
   HF's one stream) is ambiguous: none of them is compared, each is listed with the reason, and so
   is an input whose role the other call holds nowhere.

An input whose role is unknown (no shape or dtype known) pairs by its path, as before. No torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ...store.dtypes import BY_NAME
from ...store.format import Key
from ..load.sources import EntryMeta

INPUT_AMBIGUOUS = (
    "an input of one call that shares its kind and width with other inputs of that call (an "
    "engine's (hidden_states, residual) beside the other side's one stream): inputs pair by what "
    "they hold, and these do not say which is which, so none is compared (the module's output is)"
)
INPUT_ALONE = (
    "an input whose kind and width (integer ids or positions, float activations of that last dim) "
    "no input of the counterpart module's call holds: inputs pair by what they hold, not by their "
    "place in the call"
)
INPUT_OTHER_KIND = (
    "an input passed by the same keyword as the other side's, holding another kind or width: "
    "inputs pair by what they hold, not by their name alone"
)


@dataclass(frozen=True)
class Role:
    """What an input holds, as far as its metadata tells: its kind (``float``, ``int``, ``bool``,
    ``complex``) and, for a float of two dims or more, its last dim (the hidden width; token rows
    are laid out ``[tokens]`` by an engine and ``[batch, seq]`` by HF, so only the last dim is
    compared). Integers are ids or positions whatever their shape."""

    kind: str
    width: int | None

    def describe(self) -> str:
        if self.kind in ("int", "bool"):
            return "integer ids or positions" if self.kind == "int" else "a boolean mask"
        return f"{self.kind} [.., {self.width}]" if self.width is not None else f"{self.kind} (1-d)"


def input_role(meta: EntryMeta | None) -> Role | None:
    """An input's role from its entry's metadata; None when its shape or dtype is unknown."""
    if meta is None or meta.shape is None or meta.dtype is None or meta.dtype not in BY_NAME:
        return None
    kind = BY_NAME[meta.dtype].kind
    if kind in ("int", "bool"):
        return Role(kind, None)
    return Role(kind, meta.shape[-1] if len(meta.shape) >= 2 else None)


def is_input(name: str) -> bool:
    try:
        return Key.parse(name).input
    except ValueError:
        return False


def _keyword(path: str) -> bool:
    """Whether an input path starts with a keyword (``[hidden_states]``), not a position (``[0]``)."""
    first = path[1:].partition("]")[0] if path.startswith("[") else ""
    return bool(first) and not first.isdigit()


@dataclass
class InputPairing:
    """One call's inputs: the pairs (A's name, B's name) and each side's inputs left, with why."""

    pairs: list[tuple[str, str]]
    left_a: list[tuple[str, str]]
    left_b: list[tuple[str, str]]


def pair_inputs(
    names_a: list[str],
    names_b: list[str],
    roles_a: Mapping[str, Role | None],
    roles_b: Mapping[str, Role | None],
) -> InputPairing:
    """Pair the inputs of one call of two paired modules (the module docstring's three steps);
    names in each side's order, pairs in A's."""
    path_a = {n: Key.parse(n).path for n in names_a}
    path_b = {n: Key.parse(n).path for n in names_b}
    by_path_b = {p: n for n, p in path_b.items()}
    out = InputPairing([], [], [])
    free_a, free_b = list(names_a), list(names_b)
    for a in names_a:  # 1. the same keyword, or a role unknown: by path
        b = by_path_b.get(path_a[a])
        if b is None or not (_keyword(path_a[a]) or roles_a.get(a) is None or roles_b.get(b) is None):
            continue
        free_a.remove(a)
        free_b.remove(b)
        role_a, role_b = roles_a.get(a), roles_b.get(b)
        if role_a is not None and role_b is not None and role_a != role_b:
            out.left_a.append((a, INPUT_OTHER_KIND))
            out.left_b.append((b, INPUT_OTHER_KIND))
        else:
            out.pairs.append((a, b))
    for a in [n for n in free_a if roles_a.get(n) is None]:
        free_a.remove(a)
        out.left_a.append((a, ""))  # no role, no input of its path: a plain leftover
    for b in [n for n in free_b if roles_b.get(n) is None]:
        free_b.remove(b)
        out.left_b.append((b, ""))
    if free_a and _same_signature(free_a, free_b, path_a, path_b, roles_a, roles_b):
        out.pairs += [(a, by_path_b[path_a[a]]) for a in free_a]  # one signature: by path, as named
        free_a, free_b = [], []
    holders_a, holders_b = _holders(free_a, roles_a), _holders(free_b, roles_b)
    for role, mine in holders_a.items():  # 2. and 3.: by role
        theirs = holders_b.pop(role, [])
        if len(mine) == 1 and len(theirs) == 1:
            out.pairs.append((mine[0], theirs[0]))
            continue
        reason = INPUT_AMBIGUOUS if theirs else INPUT_ALONE
        out.left_a += [(a, reason) for a in mine]
        out.left_b += [(b, reason) for b in theirs]
    out.left_b += [(b, INPUT_ALONE) for names in holders_b.values() for b in names]
    order = {n: i for i, n in enumerate(names_a)}
    out.pairs.sort(key=lambda pair: order[pair[0]])
    return out


def _same_signature(
    free_a: list[str],
    free_b: list[str],
    path_a: Mapping[str, str],
    path_b: Mapping[str, str],
    roles_a: Mapping[str, Role | None],
    roles_b: Mapping[str, Role | None],
) -> bool:
    """Whether the two calls' remaining inputs are one signature: the same paths, each holding the
    same role on both sides (two ports of one module class, a fused norm's ``(x, residual)`` on
    both). Their places then say which is which, where their roles alone could not."""
    signature_a = {path_a[a]: roles_a.get(a) for a in free_a}
    signature_b = {path_b[b]: roles_b.get(b) for b in free_b}
    return signature_a == signature_b


def _holders(names: list[str], roles: Mapping[str, Role | None]) -> dict[Role, list[str]]:
    """Role -> the inputs holding it, in order (inputs of no known role left out)."""
    out: dict[Role, list[str]] = {}
    for name in names:
        role = roles.get(name)
        if role is not None:
            out.setdefault(role, []).append(name)
    return out
