"""One ``PATTERN=VALUE`` parser for the whole package: ``--map``, ``--unshard``, ``--rtol``, the
``GRAFT_MAP`` setting and ``tracedump.graft(maps=...)`` split a rule the same way, in
:mod:`tracedump.util.rules`, and say the same thing of a bad one."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tracedump.compare.options import NameMap, UnshardRule
from tracedump.config.parsing import parse_map_rules
from tracedump.dump.grafter import parse_graft_map
from tracedump.errors import ConfigError, UsageError
from tracedump.util.rules import check_replacement, split_rule

PACKAGE = Path(__file__).resolve().parent.parent / "tracedump"


@pytest.mark.parametrize(
    ("text", "pattern", "value"),
    [
        ("a=b", "a", "b"),
        (r"(?<=x)y=z", r"(?<=x)y", "z"),  # '=' inside the pattern: split on the last one
        ("^blocks\\.=model.layers.", "^blocks\\.", "model.layers."),
        ("a=", "a", ""),
    ],
)
def test_a_rule_splits_on_its_last_equals_sign(text: str, pattern: str, value: str) -> None:
    assert split_rule(text) == (pattern, value)
    assert parse_graft_map([text])[0][0].pattern == pattern
    assert NameMap.parse(text).pattern.pattern == pattern


@pytest.mark.parametrize("text", ["no-equals", "=value"])
def test_every_reader_refuses_a_rule_without_a_pattern_alike(text: str) -> None:
    with pytest.raises(ValueError, match="expected 'PATTERN=REPL'"):
        split_rule(text)
    with pytest.raises(ConfigError, match="expected 'PATTERN=REPL'"):
        parse_graft_map([text])
    with pytest.raises(ValueError, match="expected 'PATTERN=REPL'"):
        parse_map_rules([text])
    with pytest.raises(UsageError, match="expected 'PATTERN=VALUE'"):
        NameMap.parse(text)
    with pytest.raises(UsageError, match="expected 'PATTERN=VALUE'"):
        UnshardRule.parse(text)


def test_a_bad_replacement_is_refused_before_any_name_is_seen() -> None:
    with pytest.raises(ValueError, match="bad replacement"):
        check_replacement(re.compile("(a)(b)"), r"\3")
    with pytest.raises(ConfigError, match="bad replacement"):
        parse_graft_map([r"(a)(b)=\3"])
    with pytest.raises(UsageError, match="bad replacement"):
        NameMap.parse(r"(a)(b)=\3")


def test_no_module_splits_a_rule_on_its_own() -> None:
    """Only util/rules.py splits text at its last ``=``: every other reader calls it."""
    splitters = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "rules.py" and path.parent.name == "util":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "rpartition"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and node.args[0].value == "="
            ):
                splitters.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert splitters == []
