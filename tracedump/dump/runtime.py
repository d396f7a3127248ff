"""The only process-wide state of the dump side, created by the first ``attach()``.

Before it exists, nothing of tracedump's is registered anywhere (the off path never creates it).
It holds the open dumpers (the targets of module-level ``record()``), one ``os.register_at_fork``
guard for the whole process, and the process's own warn-once keys; each dumper keeps its own
:class:`Warner`, so a warning of one dumper never silences another's.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any, Protocol


class TracedumpWarning(UserWarning):
    """Category of every warning tracedump emits, so a host can filter or escalate them at once."""


COMPILED_WARNING = (
    "tracedump: torch.compile is compiling {what}; a compiled graph runs no hooks, so its calls "
    "are not dumped and their passes will be missing. Skip compiling while dumping: "
    "tracedump.resolve_compile(), TORCHDYNAMO_DISABLE=1, or `tracedump run --no-compile`."
)


class Warner:
    """Warn loudly, once per key: a warning repeated per hook would drown the host's logs."""

    def __init__(self) -> None:
        self._seen: set[str] = set()

    def __call__(self, key: str, message: str) -> None:
        if key in self._seen:
            return
        self._seen.add(key)
        try:
            warnings.warn(message, TracedumpWarning, stacklevel=3)
        except Exception:  # the host runs with warnings as errors: report anyway, never raise into it
            print(f"{TracedumpWarning.__name__}: {message}", file=sys.stderr)

    @contextlib.contextmanager
    def fresh(self) -> Iterator[None]:
        """Within the block, warn as if nothing had warned yet; after it, the keys remembered
        before are back (those of the block forgotten). For tests that expect a warning the
        process may already have given, and a long-running host that wants one job's warnings
        shown again in the next: the registry is otherwise never reset."""
        kept, self._seen = self._seen, set()
        try:
            yield
        finally:
            self._seen = kept


class Attached(Protocol):
    """What the runtime needs of an open dumper."""

    def record(self, tag: str, tensor: Any, once: bool = False) -> None: ...
    def record_step(self, tag: str, tensor: Any) -> None: ...
    def owns_pass_on_this_thread(self) -> bool: ...
    def quiesce_for_fork(self) -> None: ...
    def note_compiled(self) -> None: ...


# The open dumpers, oldest first. A module-level list so that ``tracedump.record()`` with none open
# costs one truthiness check; only :class:`Runtime` changes it.
open_dumpers: list[Attached] = []


class Runtime:
    """Open dumpers and fork handling, for the whole process."""

    def __init__(self) -> None:
        self.dumpers = open_dumpers
        self.warn = Warner()
        self._child_callbacks: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        if hasattr(os, "register_at_fork"):  # once per process: callbacks can never be unregistered
            os.register_at_fork(before=self._before_fork, after_in_child=self._after_fork_in_child)

    def add(self, dumper: Attached) -> None:
        with self._lock:
            self.dumpers.append(dumper)

    def remove(self, dumper: Attached) -> None:
        with self._lock:
            if dumper in self.dumpers:
                self.dumpers.remove(dumper)

    def record_target(self) -> Attached | None:
        """The dumper whose pass this thread is running, else the one attached last."""
        dumpers = self.dumpers
        if len(dumpers) > 1:
            for dumper in reversed(dumpers):
                if dumper.owns_pass_on_this_thread():
                    return dumper
        return dumpers[-1] if dumpers else None

    def note_compiled(self) -> None:
        """Dynamo is compiling a forward with tracedump's hooks in it: every open dumper warns once
        and marks its manifest; with none yet (``tracedump run`` before its first root), one
        warning says what will happen."""
        if not self.dumpers:
            self.warn("compiled_without_dumper", COMPILED_WARNING.format(what="a module forward"))
        for dumper in list(self.dumpers):
            dumper.note_compiled()

    def on_fork_in_child(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` in every forked child (``tracedump run``'s global hooks start afresh there)."""
        self._child_callbacks.append(callback)

    def _before_fork(self) -> None:
        """A fork copies only the forking thread: a writer thread caught mid-import or mid-write would
        leave the child a half-imported module or a held lock. Let every writer go idle first."""
        for dumper in list(self.dumpers):
            try:
                dumper.quiesce_for_fork()
            except Exception as e:  # never raise into os.fork(); say what went wrong
                self.warn(f"fork_{type(e).__name__}", f"tracedump: flushing before fork failed: {e!r}")

    def _after_fork_in_child(self) -> None:
        for callback in self._child_callbacks:
            try:
                callback()
            except Exception as e:
                self.warn(f"fork_child_{type(e).__name__}", f"tracedump: after fork: {e!r}")


_instance: Runtime | None = None
_creating = threading.Lock()


def runtime() -> Runtime:
    """The process's runtime, created on first use (by ``attach()``, never by the off path)."""
    global _instance
    if _instance is None:
        with _creating:
            if _instance is None:
                _instance = Runtime()
    return _instance


def existing() -> Runtime | None:
    """The runtime if one was created (none on the off path)."""
    return _instance


def warn_once(key: str, message: str) -> None:
    """A process-wide warning not tied to one dumper (a compiled model, a CUDA-graph request)."""
    runtime().warn(key, message)
