"""Module-level entry points that work whether or not a dumper is attached.

``tracedump.record()`` in engine code costs one list check when no dumper is open, so it can stay
in the code permanently. It goes to the dumper whose pass the calling thread runs, else to the one
attached last. (``tracedump.profiling()`` is :func:`tracedump.dump.suspend.profiling`.)
"""

from __future__ import annotations

from typing import Any

from .dump.runtime import open_dumpers, runtime

__all__ = ["record", "record_step"]


def record(tag: str, tensor: Any, once: bool = False) -> None:
    """Record ``tensor`` under ``tag`` in the active dumper; a no-op when none is active."""
    if open_dumpers:
        target = runtime().record_target()
        if target is not None:
            target.record(tag, tensor, once)


def record_step(tag: str, tensor: Any) -> None:
    """``tag_<n>`` per call in the active dumper; a no-op when none is active."""
    if open_dumpers:
        target = runtime().record_target()
        if target is not None:
            target.record_step(tag, tensor)
