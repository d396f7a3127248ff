"""Every use of a CPython private API that must not import torch, in one module.

Why: ``--filter``'s cost check (:func:`tracedump.dump.control.check_filter`) reads a pattern as
``re`` itself does, through the stdlib's private regex parser. It runs in ``tracedump arm``, which
never imports torch (most of a 2 s start-up), so it cannot live in
:mod:`tracedump.dump.torch_compat` with the other private APIs; here it is one named function,
whose docstring says what it relies on, checked by ``tests/test_torch_compat.py``. Run against
CPython 3.11 (``re._parser``); 3.10's ``sre_parse`` was only read.
"""

from __future__ import annotations

from typing import Any


def parsed_regex(pattern: str) -> Any:
    """``pattern`` as the stdlib's own regex parser reads it (``re._parser.parse(pattern).data``;
    ``sre_parse`` before 3.11): the one authority on how ``re`` reads a pattern, and the only place
    its repeats and groups can be seen. A sequence of ``(opcode, argument)`` items, each opcode's
    ``str`` its name; the arguments ``--filter``'s cost check reads: ``MAX_REPEAT`` / ``MIN_REPEAT``
    / ``POSSESSIVE_REPEAT``: ``(low, high, items)`` (``high`` ``MAXREPEAT`` when open-ended);
    ``BRANCH``: ``(None, [items, ...])``; ``SUBPATTERN`` / ``ASSERT`` / ``ASSERT_NOT``: the group's
    items last; ``ATOMIC_GROUP``: its items. Raises ``re.error`` for a pattern ``re`` refuses."""
    import importlib

    try:
        parser = importlib.import_module("re._parser")
    except ImportError:
        parser = importlib.import_module("sre_parse")
    return parser.parse(pattern).data
