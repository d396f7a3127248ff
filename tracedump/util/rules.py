"""``PATTERN=VALUE`` rules, split and checked in one place for every option that takes them.

``tracedump diff --map`` / ``--unshard`` / ``--rtol``, the dump side's ``GRAFT_MAP`` setting and
``tracedump.graft(maps=...)`` all spell a rule the same way, so one split decides what a rule is:
on the **last** ``=``. The pattern may hold ``=`` (lookarounds such as ``(?=...)``,
``(?<=...)``); the value may not, which costs nothing because module names never contain ``=``.
Each caller turns the ``ValueError`` into its own error (a usage error, a configuration error
naming the env var), keeping one wording of what is wrong.
"""

from __future__ import annotations

import re

__all__ = ["check_replacement", "split_rule"]


def split_rule(text: str) -> tuple[str, str]:
    """``(pattern, value)`` of ``PATTERN=VALUE``, split on the last ``=``; a rule without ``=``
    or with an empty pattern raises ``ValueError``."""
    pattern, sep, value = text.rpartition("=")
    if not sep or not pattern:
        raise ValueError("expected 'PATTERN=REPL'")
    return pattern, value


def check_replacement(pattern: re.Pattern[str], replacement: str) -> None:
    """Raise ``ValueError`` now for a replacement ``re.sub`` would refuse later (``\\3`` with two
    groups, a bad escape): ``re`` checks the template even when nothing matches."""
    try:
        pattern.sub(replacement, "")
    except (re.error, IndexError) as e:
        raise ValueError(f"bad replacement: {e}") from e
