"""What ``tracedump.capture()`` records: module names from ``outputs``, ``inputs``, a spec string and
filter regexes, combined into one ordered request.

Why a module of its own: this is plain parsing, with no hooks and no recorder. It is the part a user
gets wrong (a typo in a name, a stray bracket), so its errors are written here, checked without a
forward, and :func:`parse_spec` is usable on its own.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Literal, NamedTuple

from torch import nn

from ...errors import ConfigError
from ..selection import ROOT_NAME, candidate_modules, regex_predicate

__all__ = ["CaptureSpec", "Kind", "parse_spec", "requested_names"]

Kind = Literal["inputs", "outputs"]

SECTIONS: tuple[Kind, ...] = ("inputs", "outputs")
_SECTION_RE = re.compile(r"\s*([A-Za-z_]\w*)\s*\[([^\[\]]*)\]")


class CaptureSpec(NamedTuple):
    """The module names a spec string selects, in order of first mention, without duplicates."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


def _split_items(text: str) -> list[str]:
    """Split a ``|``-separated item list, dropping whitespace and empty items."""
    return [item.strip() for item in text.split("|") if item.strip()]


def parse_spec(spec: str) -> CaptureSpec:
    """Parse a capture spec string such as ``"inputs[a.b]|outputs[a.b|c.d]"``.

    Grammar: a ``|``-separated sequence of parts; a part is either ``inputs[NAMES]``,
    ``outputs[NAMES]`` or a bare module name (which means its output).  ``NAMES`` is itself
    ``|``-separated.  Sections are optional and may repeat; whitespace and empty items are dropped.
    Malformed text (unknown section, stray bracket) and a spec that selects nothing raise
    ``ValueError``.  Names are not checked against a model here; :func:`tracedump.capture` does that.
    """
    if not isinstance(spec, str):
        raise TypeError(f"spec must be a str, got {type(spec).__name__}")
    selected: dict[Kind, dict[str, None]] = {"inputs": {}, "outputs": {}}
    pos = 0
    while pos < len(spec):
        if spec[pos].isspace() or spec[pos] == "|":
            pos += 1
            continue
        section = _SECTION_RE.match(spec, pos)
        if section is not None:
            kind = section.group(1)
            if kind not in SECTIONS:
                raise ConfigError(f"unknown section {kind!r} in spec {spec!r}; expected one of {SECTIONS}")
            selected[kind].update(dict.fromkeys(_split_items(section.group(2))))
            pos = section.end()
            rest = spec[pos:].lstrip()
            if rest and not rest.startswith("|"):
                raise ConfigError(f"expected '|' after {section.group(0).strip()!r} in spec {spec!r}")
            continue
        end = spec.find("|", pos)
        end = len(spec) if end < 0 else end
        item = spec[pos:end].strip()
        if "[" in item or "]" in item:
            raise ConfigError(
                f"malformed part {item!r} in spec {spec!r}; expected inputs[...] or outputs[...]"
            )
        selected["outputs"][item] = None
        pos = end
    result = CaptureSpec(inputs=tuple(selected["inputs"]), outputs=tuple(selected["outputs"]))
    if not result.inputs and not result.outputs:
        raise ConfigError(f"spec {spec!r} selects nothing")
    return result


def _as_list(value: str | Iterable[str] | None) -> list[str]:
    """Accept one string or an iterable of strings (a bare string is one name, not its characters)."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    return list(value)


def _filter_matches(model: nn.Module, patterns: list[str]) -> list[str]:
    """Names of all (non-root) modules where any pattern ``re.search``-es the full dotted name: the
    candidates of ``MODULES=all``, narrowed as ``FILTER`` narrows them in ``attach()``."""
    try:
        chosen = regex_predicate(patterns)
    except re.error as err:
        raise ConfigError(f"invalid filter pattern {err.pattern!r}: {err}") from err
    matches = [name for name, module in candidate_modules(model, "all") if chosen(name, module)]
    matches = [name for name in matches if name != ROOT_NAME]
    if not matches:
        raise ConfigError(f"filter {patterns!r} matches no module of {type(model).__name__}")
    return matches


def requested_names(
    model: nn.Module,
    outputs: str | Iterable[str] | None,
    inputs: str | Iterable[str] | None,
    spec: str | None,
    filter: str | Iterable[str] | None,
) -> CaptureSpec:
    """The union of every source, in order of first mention: names given as ``outputs``/``inputs``,
    then those of ``spec``, then (outputs only) the modules ``filter`` matches. The names are not
    checked against ``model`` here (:class:`~tracedump.dump.capture.session.Capture` does that)."""
    output_names = _as_list(outputs)
    input_names = _as_list(inputs)
    if spec is not None:
        parsed = parse_spec(spec)
        output_names += parsed.outputs
        input_names += parsed.inputs
    if filter is not None:
        output_names += _filter_matches(model, _as_list(filter))
    return CaptureSpec(inputs=tuple(dict.fromkeys(input_names)), outputs=tuple(dict.fromkeys(output_names)))
