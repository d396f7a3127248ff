"""The CPUs this process may run on: what the writer's hold-back and the diff's threads size to.

Torch-free and numpy-free, so the comparator and the dump side share it without importing each
other."""

from __future__ import annotations

import os


def usable_cpus() -> int:
    """CPUs in this process's affinity mask where the OS has one (an engine or ``taskset`` may
    have narrowed it), else every CPU."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1
