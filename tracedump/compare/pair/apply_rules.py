"""One row of a pairing table applied to one name: the pairs it makes, the names it claims, or
why it cannot apply (a name it needs is not there). A rule file's row and a derived row apply the
same way (:mod:`.table`)."""

from __future__ import annotations

import re

from ...store.format import Key
from .expr import BridgedPair, Expr
from .table import Rule

_ELEMENT = re.compile(r"\[(\d+)\]")


def apply_unwrap(
    rule: Rule, name: str, have: dict[str, set[str]]
) -> tuple[list[str], list[str], list[BridgedPair]] | str | None:
    """``unwrap``: ``match`` is tried on the module part of a tuple element's key (``o_proj`` of
    ``o_proj[0]``); element ``index`` pairs with the counterpart module (``{0}`` by default) plus
    the rest of the path and call suffix, the other elements are skipped. None: no match."""
    try:
        key = Key.parse(name)
    except ValueError:
        return None
    element = _ELEMENT.match(key.path)
    found = rule.match.fullmatch(key.module) if element and not key.input else None
    if found is None or element is None:
        return None
    own = "a" if rule.side == "a" else "b"
    other = "b" if own == "a" else "a"
    if int(element.group(1)) != rule.index:
        return ([name], [], []) if own == "a" else ([], [name], [])  # another element: skipped
    module = rule.templates(other)[0].fill(found)
    if module is None:
        return f"{rule.title}: {rule.templates(other)[0].text!r} has no value for {key.module!r}"
    counterpart = Key(module, key.path[element.end() :], False, key.call).format()
    if counterpart not in have[other]:
        return f"{rule.title}: {other.upper()} has no {counterpart}"
    pair = _unwrap(rule, name, counterpart) if own == "a" else _unwrap(rule, counterpart, name)
    return ([name], [counterpart], [pair]) if own == "a" else ([counterpart], [name], [pair])


def apply_rule(
    rule: Rule, found: re.Match[str], have: dict[str, set[str]]
) -> tuple[list[str], list[str], list[BridgedPair]] | str:
    """The pairs one rule makes of one matched name, or why it cannot apply (a name it needs is
    not there)."""
    filled: dict[str, list[str]] = {}
    for side in ("a", "b"):
        names = []
        for template in rule.templates(side):
            name = template.fill(found)
            if name is None:
                return f"{rule.title}: {template.text!r} has no value for {found.group(0)!r}"
            if name not in have[side]:
                return f"{rule.title}: {side.upper()} has no {name}"
            names.append(name)
        filled[side] = names
    a, b = filled["a"], filled["b"]
    if rule.op == "skip":  # claims the name it lists; its other names are conditions, left free
        anchor = [found.group(0)]
        return (anchor, [], []) if rule.side == "a" else ([], anchor, [])
    how = rule.op if rule.op != "split" else f"split {rule.dim}"
    if rule.op == "unwrap":
        return a, b, [_unwrap(rule, a[0], b[0])]
    if rule.op == "rename":
        return a, b, [BridgedPair(a=Expr(names=(a[0],)), b=Expr(names=(b[0],)), how=how, rule=rule.title)]
    if rule.op == "split":
        return a, b, [BridgedPair(a=x, b=y, how=how, rule=rule.title) for x, y in _split_later(rule, a, b)]
    op = rule.op
    expr_a = Expr(names=tuple(a), op=op if len(a) > 1 else None, dim=rule.dim)
    expr_b = Expr(names=tuple(b), op=op if len(b) > 1 else None, dim=rule.dim)
    return a, b, [BridgedPair(a=expr_a, b=expr_b, how=how, rule=rule.title)]


def _unwrap(rule: Rule, a: str, b: str) -> BridgedPair:
    return BridgedPair(a=Expr(names=(a,)), b=Expr(names=(b,)), how=f"unwrap [{rule.index}]", rule=rule.title)


def _split_later(rule: Rule, a: list[str], b: list[str]) -> list[tuple[Expr, Expr]]:
    """Split pairs whose pieces are sized later, from the pieces' shapes (:func:`.expr.size_splits`):
    marked with an open piece ``(-1, k)``, k the piece's ordinal."""
    if len(a) == 1:
        return [
            (Expr(names=(a[0],), op="split", dim=rule.dim, piece=(-1, k)), Expr(names=(name,)))
            for k, name in enumerate(b)
        ]
    return [
        (Expr(names=(name,)), Expr(names=(b[0],), op="split", dim=rule.dim, piece=(-1, k)))
        for k, name in enumerate(a)
    ]
