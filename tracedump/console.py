"""The rich console every ``tracedump`` command prints with.

Its own module, free of torch and numpy, so that ``tracedump ls``/``show`` start at once.
"""

from __future__ import annotations

import sys
from typing import Any

_WIDE = 240  # columns when stdout is not a terminal: names are never cut in logs and pipes


def console(stderr: bool = False) -> Any:
    """The rich console every ``tracedump`` command prints with (stdout, or stderr for ``--json -``).

    When the stream is not a terminal it is 240 columns wide, so long module names stay whole on
    one greppable line in logs and pipes; rich is imported here, on first output, not at import."""
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    return Console(file=stream, width=None if stream.isatty() else _WIDE, highlight=False)
