"""The profiling suspend: ``tracedump.profiling()`` switches every dumper off for a block.

Why a module of its own: it is the one piece of per-thread state on the dump side (a ContextVar),
read by the recorder's hot path and set by host code (an engine's dummy profile forward), and it
has nothing to do with the gates, which judge one tensor at a time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

__all__ = ["SUSPENSION", "globally_suspended", "profiling"]

# Per thread (and per asyncio task): a profile run on one thread must not suspend another's forward.
# The open profiling() blocks; the recorder's hot path reads it directly (``SUSPENSION.get()``, no
# Python frame: docs/performance.md).
SUSPENSION: ContextVar[int] = ContextVar("tracedump_suspension", default=0)


@contextlib.contextmanager
def profiling() -> Iterator[None]:
    """Suspend every dumper for the block: nothing is captured and no pass index is used.

    Wrap an engine's dummy profile forward in it. Works whether or not a dumper exists.
    """
    token = SUSPENSION.set(SUSPENSION.get() + 1)
    try:
        yield
    finally:
        SUSPENSION.reset(token)


def globally_suspended() -> bool:
    """Whether this thread (or task) is inside a :func:`profiling` block."""
    return SUSPENSION.get() > 0
