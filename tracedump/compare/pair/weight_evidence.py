"""What the recorded weights say of a pair made by name or by a hand rule: a module of one name
holding another module's values, B's values scaled or transposed (:func:`weight_findings`, on the
row), and the pairs the weights or the load record prove that a ``--map`` rule is checked against
(:func:`weight_pairs`, :func:`map_contradiction`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...store.correspondence import Correspondence, fingerprints_match
from .holdings import plain_holdings
from .module_pairing import pair_modules
from .table import Bridge


def _firsts(record: Correspondence) -> dict[str, Mapping[str, Any]]:
    """Each parameter's own entry (a shared one's fingerprint is its first holder's)."""
    params = record.parameters
    return {name: params.get(str(meta.get("same_as")), meta) if "same_as" in meta else meta
            for name, meta in params.items()}  # fmt: skip


def weight_findings(a: Correspondence, b: Correspondence) -> dict[str, str]:
    """Module (of one name on both sides) -> what its recorded weights say against B's where they
    are not B's of that name: it holds another module's values (a loader that filled layer 1 from
    layer 2), B's scaled, B's transposed, or values of B's shape that B holds nowhere. Compared by
    fingerprint (:func:`~tracedump.store.correspondence.fingerprints_match`, which allows a dtype
    change); only for two runs that load no checkpoint themselves (an engine's load is its record)."""
    if a.loads or b.loads:
        return {}
    mine, theirs = _firsts(a), _firsts(b)
    by_print: dict[tuple[int, ...], list[tuple[str, list[float]]]] = {}
    for name, meta in theirs.items():
        by_print.setdefault(tuple(meta.get("shape") or ()), []).append(
            (name, list(meta.get("fingerprint") or []))
        )
    out: dict[str, str] = {}
    for param in mine.keys() & theirs.keys():
        finding = _weight_finding(param, mine[param], theirs[param], by_print)
        if finding is not None:
            module = param.rpartition(".")[0]
            out[module] = f"{out[module]}; {finding}" if module in out else finding
    return out


def _weight_finding(
    param: str,
    mine: Mapping[str, Any],
    theirs: Mapping[str, Any],
    by_print: Mapping[tuple[int, ...], list[tuple[str, list[float]]]],
) -> str | None:
    leaf = param.rpartition(".")[2]
    shape_a, shape_b = list(mine.get("shape") or []), list(theirs.get("shape") or [])
    if shape_a != shape_b:
        turned = len(shape_a) == 2 and shape_a == shape_b[::-1]
        return f"weights: {leaf} {shape_a} is B's {shape_b}" + (" transposed" if turned else "")
    fa, fb = list(mine.get("fingerprint") or []), list(theirs.get("fingerprint") or [])
    if not fa or not fb or fingerprints_match(fa, fb):
        return None
    holders = [n for n, f in by_print.get(tuple(shape_a), []) if n != param and fingerprints_match(fa, f)]
    if len(holders) == 1:
        holder = holders[0]
        named = holder.rpartition(".")[0] if holder.rpartition(".")[2] == leaf else holder
        return f"weights: holds {named}'s values"
    if holders:
        return f"weights: holds values {len(holders)} tensors of B hold ({', '.join(holders[:3])}, ...)"
    ratios = [x / y for x, y in zip(fa, fb, strict=True) if abs(y) > 1e-12]
    if ratios and len(ratios) == len(fa) and max(ratios) - min(ratios) <= 1e-3 * max(abs(r) for r in ratios):
        return f"weights: {leaf} is B's x{sum(ratios) / len(ratios):.4g}"
    return f"weights: {leaf} differs from B's (same shape)"


def weight_pairs(a: Correspondence, b: Correspondence, derived: Bridge | None = None) -> dict[str, str]:
    """A's module -> B's, for the modules whose parameters (or whose subtree's) hold values one
    module of B holds (unique fingerprints only): the evidence a ``--map`` rule is checked against.
    Where a side recorded its load, the load record is that evidence: the pairs the table derived
    from it proves (``derived``, :attr:`.table.Bridge.proven`; none from a rule file)."""
    if a.loads or b.loads:
        return derived.proven_pairs if derived is not None else {}
    sources = {name: meta for name, meta in b.parameters.items() if "same_as" not in meta}
    pairing = pair_modules(plain_holdings(a, sources), plain_holdings(b, sources))
    return {**pairing.leaves, **pairing.containers}


def map_contradiction(
    module_a: str, module_b: str, held: str, *, loaded: bool = False, rule: str = "--map"
) -> str:
    """The note on a pair a hand rule made against the recorded weights (``loaded``: against the
    checkpoint tensors a side's load record says the two modules hold); ``rule`` names it
    (``--map``, or a ``--bridge`` file's rule)."""
    if loaded:
        return (
            f"{rule} pairs {module_a} with {module_b}, but the load record says A's {module_a} holds "
            f"the checkpoint tensors of B's {held}: the rule contradicts the recorded load"
        )
    return (
        f"{rule} pairs {module_a} with {module_b}, but its weights are {held}'s: "
        "the rule contradicts the recorded weights"
    )
