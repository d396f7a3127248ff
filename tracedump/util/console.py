"""The rich console every ``tracedump`` command prints with.

Its own module, free of torch and numpy, so that ``tracedump ls``/``show`` start at once.
"""

from __future__ import annotations

import functools
import re
import sys
from typing import Any

_WIDE = 240  # columns when stdout is not a terminal: names are never cut in logs and pipes
# What a terminal would obey rather than show: C0 and C1 controls, DEL, and the bidi overrides that
# reorder what is shown (trojan-source). rich escapes its markup, not these.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")
_CONTROL_BUT_NEWLINE = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _escaped(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: object, *, keep_newlines: bool = False) -> str:
    """``text`` with every control character shown as an escape (``\\x1b``), never sent raw: a
    tensor name or sequence id holding ``\\x1b[31m`` must not recolour (or rewrite) the terminal.
    ``keep_newlines``: for messages tracedump itself splits into lines."""
    return (_CONTROL_BUT_NEWLINE if keep_newlines else _CONTROL).sub(_escaped, str(text))


def console(stderr: bool = False) -> Any:
    """The rich console every ``tracedump`` command prints with (stdout, or stderr for ``--json -``).

    When the stream is not a terminal it is 240 columns wide, so long module names stay whole on
    one greppable line in logs and pipes; rich is imported here, on first output, not at import."""
    stream = sys.stderr if stderr else sys.stdout
    return _console_class()(file=stream, width=None if stream.isatty() else _WIDE, highlight=False)


@functools.cache
def _console_class() -> Any:
    """rich's ``Console`` with its broken-pipe handling given back to the command: rich's own
    ``on_broken_pipe`` raises ``SystemExit(1)``, and 1 is ``tracedump diff``'s "diverged"; the
    ``BrokenPipeError`` raised instead reaches ``cli.main()``, which decides the exit code."""
    from rich.console import Console

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            self.quiet = True
            raise BrokenPipeError("stdout closed before the output was written")

    return _Console
