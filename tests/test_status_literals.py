"""A pair's status is written once, in ``compare/judge/status.py``, and set by one function.

Copies of the status strings in the table, the page, the plot and the executor drifted apart
before (a status set in one place and not known to another), and a string literal hides where a
status is decided. So the package's source is scanned: outside the enum's module no string equal
to a :class:`Status` value is used as a status (compared with anything named for a status or a
kind, ``status``, ``problem_status``, ``kind``, assigned to one, passed as such a keyword, or as the
key of a lookup table of statuses: a pair's kind is a :class:`~tracedump.compare.pair.kinds.PairKind`),
and only the judge constructs a judged record.
"""

from __future__ import annotations

import ast
from pathlib import Path

import tracedump
from tracedump.compare.judge.status import Status

PACKAGE = Path(tracedump.__file__).resolve().parent
ENUM_MODULE = PACKAGE / "compare" / "judge" / "status.py"
VALUES = frozenset(status.value for status in Status)


def _literals(node: ast.AST) -> list[str]:
    """The status strings written in ``node`` (a conditional, a tuple of them included)."""
    return [
        n.value
        for n in ast.walk(node)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in VALUES
    ]


def _holds_status(name: str | None) -> bool:
    """A name that holds a status or a pair's kind: ``status``, ``problem_status``, ``kind``,
    ``pair_kind`` (a kind of pair whose value is a status string is a status in disguise)."""
    return name is not None and any(word in name.lower() for word in ("status", "kind"))


def _is_status(node: ast.AST) -> bool:
    """``x.status``, ``status``, ``row["status"]``, ``row.get("status")``; any name holding *status*
    or *kind* likewise (``entry.problem_status``, ``kind``, ``row["kind"]``)."""
    if isinstance(node, ast.Attribute):
        return _holds_status(node.attr)
    if isinstance(node, ast.Name):
        return _holds_status(node.id)
    if isinstance(node, ast.Subscript):
        key = node.slice
        return isinstance(key, ast.Constant) and isinstance(key.value, str) and _holds_status(key.value)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
        key = node.args[0] if node.args else None
        return isinstance(key, ast.Constant) and isinstance(key.value, str) and _holds_status(key.value)
    return False


def offenders(source: str, where: str = "<source>") -> list[str]:
    """Every place in ``source`` where a status string is used as a status."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        hits: list[str] = []
        if isinstance(node, ast.keyword) and _holds_status(node.arg):
            hits = _literals(node.value)
        elif isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(_is_status(o) for o in operands):
                hits = [v for o in operands if not _is_status(o) for v in _literals(o)]
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if node.value is not None and any(_is_status(t) for t in targets):
                hits = _literals(node.value)
        elif isinstance(node, ast.Dict):
            keys = [k for k in node.keys if isinstance(k, ast.Constant) and k.value in VALUES]
            if len(keys) >= 2 and all(isinstance(v, ast.Constant) for v in node.values):
                hits = [k.value for k in keys]  # a lookup table by status (colours, words)
        if hits:
            found.append(f"{where}:{getattr(node, 'lineno', '?')}: {sorted(set(hits))}")
    return found


def test_no_status_literal_outside_the_enum() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path != ENUM_MODULE:
            found += offenders(path.read_text(), str(path.relative_to(PACKAGE)))
    assert found == []


def test_the_scan_finds_each_kind_of_use() -> None:
    """The test above can fail: each way of using a status string is caught, and a mere word is not."""
    assert offenders('if r.status == "diverged": pass')
    assert offenders('if row["status"] in ("ok", "routing_flip"): pass')
    assert offenders('x = replace(r, status="ok" if good else "diverged")')
    assert offenders('status = "measured"') == []  # "measured" is no status at all
    assert offenders('status = "error"')
    assert offenders('COLOURS = {"ok": "blue", "diverged": "red"}')
    assert offenders('summary = {"ok": count(), "diverged": count()}') == []  # JSON keys, counted
    assert offenders('print("diverged")') == []
    # a status string passed or kept under any name holding a status or a kind
    assert offenders('SideEntry(name=n, problem="x", problem_status="rank_mismatch")')
    assert offenders('replace(planned, kind="not_comparable", message=m)')
    assert offenders('PairPlan(kind=entry.problem_status or "error")')
    assert offenders('kind = "stats" if s else "shape_mismatch"')
    assert offenders('pair_kind = "extra_op"')
    assert offenders('if entry.problem_status == "error": pass')
    assert offenders('if row.get("kind") in ("ok", "diverged"): pass')
    assert offenders('kind = "tensor" if t else "stats"') == []  # kinds that are no status
    assert offenders('kind = "JSON"') == []


def test_only_the_judge_builds_a_judged_record() -> None:
    """``TensorResult(...)`` with a status is built by ``settle`` (the judge's verdict applied) only."""
    builders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "TensorResult"
            ):
                builders.append(str(path.relative_to(PACKAGE)))
    assert builders == ["compare/judge/judge.py"]
