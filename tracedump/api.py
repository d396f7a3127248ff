"""Module-level entry points that work whether or not a dumper is attached.

``tracedump.record()`` in engine code costs one call and a list check when no dumper is active, so it can stay
in the code permanently.
"""

from __future__ import annotations

from typing import Any

from .dumper import active_dumper
from .gates import profiling

__all__ = ["profiling", "record", "record_step"]


def record(tag: str, tensor: Any, once: bool = False) -> None:
    """Record ``tensor`` under ``tag`` in the active dumper; a no-op when none is active."""
    dumper = active_dumper()
    if dumper is not None:
        dumper.record(tag, tensor, once)


def record_step(tag: str, tensor: Any) -> None:
    """``tag_<n>`` per call in the active dumper; a no-op when none is active."""
    dumper = active_dumper()
    if dumper is not None:
        dumper.record_step(tag, tensor)
