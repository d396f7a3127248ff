"""The value parsers of the settings: each takes what a person wrote (an env var's text, or a value
in the engine's config) and returns the typed value, or raises ValueError with a message meant for
that person. :mod:`tracedump.config.fields` attaches one to each field; the error is then prefixed
with where the value came from (:mod:`tracedump.config.sources`).

Plain functions, no pydantic: they are the rules of the value syntax (docs/settings.md, "Value
syntax"), testable and readable apart from the models. None imports user code; a blank value never
reaches them (:func:`tracedump.config.switch.is_blank`: blank is unset, one rule for every field and source).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..store.format import NUMERIC_STAT_NAMES
from ..util.ranges import IndexRanges
from ..util.rules import split_rule
from .reference import check_graft_reference

STAT_NAMES = (*NUMERIC_STAT_NAMES, "shape", "dtype")
DEFAULT_STATS = ("abs_mean", "sum", "max", "shape")
_BYTE_UNITS = {"": 1, "b": 1} | {u + s: 1024**i for i, u in enumerate("kmgt", 1) for s in ("", "b", "ib")}
_BOOLS = dict.fromkeys(("1", "true", "yes", "on"), True) | dict.fromkeys(("0", "false", "no", "off"), False)


def normalise_choice(value: Any) -> Any:
    """A choice's text stripped and lower-cased (``' Stats '`` is ``stats``); other values as given."""
    return value.strip().lower() if isinstance(value, str) else value


def parse_bool(value: Any) -> bool:
    """Exactly 1/true/yes/on or 0/false/no/off, so that ``X=false`` can never mean on."""
    key = str(int(value)) if isinstance(value, int) else str(value).strip().lower()
    if key not in _BOOLS:
        raise ValueError("expected one of 1/true/yes/on or 0/false/no/off")
    return _BOOLS[key]


def _json_list(text: str, what: str) -> Any:
    """``text`` as JSON when it starts with ``[`` (else the one item ``[text]``); a message naming
    ``what`` for malformed text, and for text nested deeper than the decoder goes (``'[' * 100000``)."""
    text = text.strip()
    if not text.startswith("["):
        return [text]
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"malformed JSON array of {what} ({e.msg} at char {e.pos})") from None
    except RecursionError:
        raise ValueError(f"malformed JSON array of {what} (nested too deep)") from None


def compile_regex(pattern: str) -> re.Pattern[str]:
    """``re.compile``, with every way a pattern can fail to compile as one ``ValueError``: a syntax
    error, and a pattern nested deeper than the parser recurses (``'(' * 100000``)."""
    try:
        return re.compile(pattern)
    except (re.error, RecursionError, OverflowError) as e:
        shown = pattern if len(pattern) <= 80 else pattern[:80] + f"... ({len(pattern)} chars)"
        raise ValueError(f"invalid regex {shown!r}: {type(e).__name__}: {e}") from None


def parse_filter(value: Any) -> list[str] | None:
    """A JSON array of regexes, or one bare pattern. Every pattern is compiled here, once."""
    if isinstance(value, str):
        value = _json_list(value, "regexes") if value.strip().startswith("[") else [value]
    if value is None:
        return None
    if not isinstance(value, Iterable):
        raise ValueError("expected a regex or a list of regexes")
    patterns = list(value)
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise ValueError(f"expected regex strings, got {pattern!r}")
        compile_regex(pattern)
    return patterns


def parse_byte_size(value: Any) -> int:
    """An int of bytes, or a size like ``512MiB`` / ``4G`` (binary units)."""
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    else:
        match = re.fullmatch(r"\s*([0-9]{1,20}(?:\.[0-9]{1,20})?)\s*([a-zA-Z]*)\s*", str(value))
        if not match or match.group(2).lower() not in _BYTE_UNITS:
            raise ValueError("expected a byte count such as 1073741824, 512MiB or 4G")
        size = int(float(match.group(1)) * _BYTE_UNITS[match.group(2).lower()])
    if size <= 0:
        raise ValueError("must be a positive number of bytes")
    if size > 1 << 63:
        raise ValueError(f"{size} bytes is more than any machine holds (at most {1 << 63}, 8 EiB)")
    return size


def parse_dir(value: Any) -> Path | None:
    """The dump dir as an absolute path, fixed now: a host (or forked worker) that later calls
    ``os.chdir()`` must keep writing where the run began. Surrounding spaces are a quoting slip;
    ``~user`` must expand; the name must be valid UTF-8, since it goes into the manifest."""
    if value is None:
        return None
    text = os.fspath(value) if isinstance(value, os.PathLike) else value
    if not isinstance(text, str):
        raise ValueError(f"expected a path, got {type(value).__name__}")
    text = text.strip()
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError("the path is not valid UTF-8 (it could not be written to the manifest)") from e
    expanded = os.path.expanduser(text)
    if expanded.startswith("~"):
        raise ValueError(f"cannot expand {text.split(os.sep)[0]!r}: no such user")
    path = Path(os.path.abspath(expanded))
    try:
        if path.exists() and not path.is_dir():
            raise ValueError("exists and is not a directory")
    except OSError as e:  # a component longer than the filesystem allows (ENAMETOOLONG), a loop
        raise ValueError(f"cannot be a directory: {e.strerror or e}") from None
    return path


def parse_positive_int(value: Any) -> int | None:
    """TOKENS, MAX_ROWS: a positive int, or its text in ASCII digits."""
    if isinstance(value, str) and re.fullmatch(r"\s*[0-9]{1,18}\s*", value):
        value = int(value)  # ASCII digits only: int() alone would also take '٣'
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError("expected a positive integer")
    return value


def parse_token_dim(value: Any) -> int:
    """TOKEN_DIM: 0 or 1, the two layouts an engine hands its modules."""
    if str(value).strip() not in ("0", "1"):
        raise ValueError("expected 0 ([tokens, hidden]) or 1 ([batch, seq, hidden])")
    return int(str(value).strip())


def parse_callable_spec(value: Any) -> str | None:
    """``pkg.module:func`` or ``/path/file.py:func``, its shape only: importing it runs user code,
    which waits for ``attach()`` (:func:`tracedump.config.usercode.load_callable`)."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError(f"expected a 'pkg.module:func' string, not {type(value).__name__}")
    module_part, _, attr = value.strip().rpartition(":")
    if not (module_part and attr):
        raise ValueError("expected 'pkg.module:func' or '/path/file.py:func'")
    return value.strip()


def parse_graft_reference(value: Any) -> Path | None:
    """GRAFT_FROM: an existing dump dir or run dir that holds what grafting needs (:mod:`.reference`)."""
    path = parse_dir(value)
    if path is not None and not path.is_dir():
        raise ValueError("no such dump directory")
    if path is not None:
        check_graft_reference(path)
    return path


def parse_regex(value: Any) -> str | None:
    """GRAFT_LEVEL: one regex, compiled here so that a typo fails before the run."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError(f"expected a regex string, not {type(value).__name__}")
    compile_regex(value.strip())
    return value.strip()


def parse_map_rules(value: Any) -> list[str] | None:
    """A JSON array of ``PATTERN=REPL`` rules, or one rule; each pattern compiled here, once."""
    if isinstance(value, str):
        value = _json_list(value, "rules")
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not all(isinstance(rule, str) for rule in value):
        raise ValueError("expected a 'PATTERN=REPL' rule or a list of them")
    parsed = list(value)
    for rule in parsed:
        try:
            pattern, _ = split_rule(rule)
        except ValueError as e:
            raise ValueError(f"{e}, got {rule!r}") from None
        parse_regex(pattern)
    return parsed


def parse_stats(value: Any) -> list[str]:
    """STATS: a comma list (or a list) of statistic names; none given means the defaults."""
    if value is None:
        return list(DEFAULT_STATS)
    names = [s.strip() for s in value.split(",")] if isinstance(value, str) else value
    if not (isinstance(names, (list, tuple)) and all(isinstance(n, str) for n in names)):
        raise ValueError(f"expected a comma list or a list of names, not {value!r}")
    names = [n for n in names if n]
    unknown = [n for n in names if n not in STAT_NAMES]
    if unknown:
        raise ValueError(
            f"unknown statistic(s) {', '.join(map(repr, unknown))}; choose from {', '.join(STAT_NAMES)}"
        )
    return names or list(DEFAULT_STATS)


def parse_steps(value: Any) -> IndexRanges | None:
    """STEPS: the text, an int, a list of ints, or an IndexRanges, parsed once. Every pass is None."""
    if isinstance(value, Iterable) and not isinstance(value, str):
        value = ",".join(map(str, value))
    selection = value if isinstance(value, IndexRanges) else IndexRanges.parse(value)
    return selection if selection.ranges else None
