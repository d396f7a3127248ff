"""A bridge's rule file, read and checked into the pairing table (:mod:`.table`: a
:class:`~.table.Bridge` of :class:`~.table.Rule` rows whose names are :class:`~.table.Template` s;
the format is in :mod:`.matcher`'s docstring and docs/engines.md).

Apart from :mod:`.matcher`, which applies the rows to two sides' names, because ``--bridge FILE``
is read while the options are parsed (:func:`..options.parse_options`: a bad rule file fails before
any dump is read), and the options must not import the sides the bridge matches.
"""

from __future__ import annotations

import re
import sys
from importlib import resources
from pathlib import Path
from typing import Any

from ...errors import BridgeError
from ...store.jsonio import LimitError, check_depth, loads, read_limited
from .table import OPS, Bridge, Rule, Template

__all__ = ["OPS", "Bridge", "Rule", "Template", "builtin_bridges", "load_bridge", "parse_bridge"]

MAX_DIM = 64  # split/concat dims and unwrap indices beyond this are refused when the file is read
_RULE_KEYS = frozenset({"op", "side", "match", "a", "b", "dim", "index", "reason", "id"})
_HEADER_KEYS = frozenset({"name", "description", "a", "b", "architectures", "align"})
BUILTIN_FOLDER = "bridges"  # tracedump/bridges/*.toml, shipped as package data (pyproject.toml)


def _fail(where: str, message: str) -> BridgeError:
    return BridgeError(f"--bridge {where}: {message}")


MAX_RULE_FILE_BYTES = 1 << 20  # a rule file is a few KB; a larger one is refused, not cut
MAX_RULE_FILE_DEPTH = 8  # [bridge] and [[rule]] tables hold strings and lists of strings


def _read(path: Path) -> dict[str, Any]:
    """A rule file's contents: a regular file (a FIFO is not waited on, ``/dev/zero`` not read),
    at most :data:`MAX_RULE_FILE_BYTES`, UTF-8, at most :data:`MAX_RULE_FILE_DEPTH` levels deep."""
    try:
        raw = read_limited(path, MAX_RULE_FILE_BYTES)
    except OSError as e:
        raise _fail(str(path), f"cannot read it ({e.strerror or e})") from e
    except LimitError as e:
        raise _fail(str(path), str(e)) from e
    try:
        text = raw.decode()
    except UnicodeDecodeError as e:
        raise _fail(str(path), f"not UTF-8 text (byte {e.start}: {e.reason})") from e
    kind = "JSON" if path.suffix.lower() == ".json" else "TOML"
    try:
        data = loads(text) if kind == "JSON" else _toml().loads(text)
        check_depth(data, MAX_RULE_FILE_DEPTH)
    except RecursionError as e:  # TOML nested thousands deep (JSON's is a LimitError)
        raise _fail(str(path), f"not valid {kind}: nested more than {MAX_RULE_FILE_DEPTH} levels deep") from e
    except LimitError as e:
        raise _fail(str(path), f"not valid {kind}: {e}") from e
    except ValueError as e:  # json.JSONDecodeError and tomllib.TOMLDecodeError both are
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise _fail(str(path), f"not valid {kind}: {first}") from e
    if not isinstance(data, dict):
        raise _fail(str(path), "expected a table with [bridge] and [[rule]] entries")
    return data


def _toml() -> Any:
    if sys.version_info >= (3, 11):
        import tomllib

        return tomllib
    try:
        import tomli
    except ImportError as e:  # pragma: no cover - Python 3.10 without tomli
        raise BridgeError("--bridge: TOML rule files need Python 3.11 or the tomli package") from e
    return tomli


def _string_list(value: Any, where: str, key: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
        raise _fail(where, f"{key!r} must be a name or a list of names, got {value!r}")
    return tuple(value)


def _regex(text: Any, where: str, key: str) -> re.Pattern[str]:
    if not isinstance(text, str) or not text:
        raise _fail(where, f"{key!r} must be a regex, got {text!r}")
    try:
        return re.compile(text)
    except re.error as e:
        raise _fail(where, f"{key} {text!r}: invalid regex: {e}") from e


def _parse_rule(number: int, raw: Any, where: str) -> Rule:
    here = f"{where}: rule {number}"
    if not isinstance(raw, dict):
        raise _fail(here, "expected a table of keys")
    unknown = sorted(set(raw) - _RULE_KEYS)
    if unknown:
        raise _fail(here, f"unknown key {unknown[0]!r} (keys: {', '.join(sorted(_RULE_KEYS))})")
    op = raw.get("op")
    if op not in OPS:
        raise _fail(here, f"op {op!r}: choose {', '.join(OPS)}")
    side = raw.get("side", "a")
    if side not in ("a", "b"):
        raise _fail(here, f"side {side!r}: choose 'a' or 'b'")
    match = _regex(raw.get("match"), here, "match")
    other = "b" if side == "a" else "a"
    own = _string_list(raw.get(side, "{0}"), here, side)
    given = raw.get(other)
    if op == "skip":
        if given is not None:
            raise _fail(here, f"skip takes no {other!r}: it names what has no counterpart")
        theirs: tuple[str, ...] = ()
    elif op == "unwrap":
        theirs = _string_list(given if given is not None else "{0}", here, other)
    else:
        if given is None:
            raise _fail(here, f"{op} needs {other!r}: the counterpart's names")
        theirs = _string_list(given, here, other)
    counts = {side: len(own), other: len(theirs)}
    if op in ("rename", "unwrap") and (counts["a"] != 1 or counts["b"] != 1):
        raise _fail(here, f"{op} pairs one name with one name, got a: {counts['a']}, b: {counts['b']}")
    if op == "split" and sorted(counts.values())[0] != 1:
        raise _fail(here, "split cuts one tensor into the other side's pieces: one side must name one")
    if op == "split" and max(counts.values()) < 2:
        raise _fail(here, "split needs at least two pieces on the other side")
    dim, index = raw.get("dim", -1), raw.get("index", 0)
    for key, value in (("dim", dim), ("index", index)):
        if type(value) is not int:
            raise _fail(here, f"{key!r} must be an integer, got {value!r}")
        if abs(value) > MAX_DIM:  # no tensor has that many dims: a usage error, not an error row
            raise _fail(here, f"{key!r} must lie within -{MAX_DIM}..{MAX_DIM}, got {value}")
    reason = raw.get("reason", "")
    if not isinstance(reason, str) or (op == "skip" and not reason):
        raise _fail(here, "skip needs a 'reason': the report lists the skipped tensors by it")
    templates = {side: own, other: theirs}
    for name in (*own, *theirs):
        for group in Template(name).groups():
            if group > match.groups:
                raise _fail(here, f"{name!r} uses group {group}, but match has {match.groups}")
    return Rule(
        number=number,
        op=op,
        side=side,
        match=match,
        a=tuple(Template(t) for t in templates["a"]),
        b=tuple(Template(t) for t in templates["b"]),
        dim=dim,
        index=index,
        reason=reason,
        id=str(raw.get("id", "")),
    )


def parse_bridge(data: dict[str, Any], source: str) -> Bridge:
    """A bridge from a rule file's parsed contents (every error names ``source`` and the rule)."""
    header = data.get("bridge", {})
    if not isinstance(header, dict):
        raise _fail(source, "[bridge] must be a table")
    unknown = sorted(set(data) - {"bridge", "rule"}) or sorted(set(header) - _HEADER_KEYS)
    if unknown:
        raise _fail(source, f"unknown key {unknown[0]!r}")
    raw_rules = data.get("rule", [])
    if not isinstance(raw_rules, list) or not raw_rules:
        raise _fail(source, "no [[rule]] entries")
    architectures = header.get("architectures", [])
    architectures = [architectures] if isinstance(architectures, str) else architectures
    if not isinstance(architectures, list):
        raise _fail(source, "'architectures' must be a list of regexes")
    align = header.get("align")
    if align not in (None, "passes", "tokens"):
        raise _fail(source, f"align {align!r}: choose passes or tokens")
    for key in ("a", "b", "name", "description"):
        if key in header and not isinstance(header[key], str):
            raise _fail(source, f"[bridge] {key!r} must be a string")
    return Bridge(
        name=str(header.get("name") or Path(source).stem),
        source=source,
        a=header.get("a"),
        b=header.get("b"),
        architectures=tuple(_regex(p, source, "architectures") for p in architectures),
        align=align,
        rules=tuple(_parse_rule(i, raw, source) for i, raw in enumerate(raw_rules, 1)),
        description=str(header.get("description", "")),
    )


def load_bridge(path: str | Path) -> Bridge:
    """A user's rule file (``--bridge FILE``): TOML, or JSON when it ends in ``.json``."""
    path = Path(path)
    return parse_bridge(_read(path), str(path))


def builtin_bridges() -> list[Bridge]:
    """The bridges shipped in ``tracedump/bridges/*.toml``, in file name order."""
    found = []
    folder = resources.files("tracedump").joinpath(BUILTIN_FOLDER)  # package data, not a package
    for item in sorted(folder.iterdir(), key=lambda p: p.name):
        if item.name.endswith(".toml"):
            data = _toml().loads(item.read_text())
            found.append(parse_bridge(data, f"built-in {item.name}"))
    return found
