"""Every error tracedump raises on purpose, under one root, and the exit codes of its commands.

Why one root: a host that wraps ``attach()``, an engine plugin or a script around ``open_dump()``
can catch ``TracedumpError`` for "anything tracedump refused" without listing each module's
errors, and the CLI turns any of them into one line and the exit code the error carries. Each
error is also a ``ValueError``, as each was before the root existed, so an ``except ValueError``
written against an older tracedump still catches it.

Imports nothing: the off path and ``tracedump ls`` import this module without torch.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    """The exit codes of ``tracedump`` commands (docs/comparator.md, docs/run.md)."""

    OK = 0  # no divergence; a command that did its job
    DIVERGED = 1  # ``diff``: a first divergence was named (or the inputs differ)
    USAGE = 2  # the command line, a rule file or an input cannot be used
    NOT_EXECUTABLE = 126  # ``run``: COMMAND exists but cannot be executed (the shell's code)
    NOT_FOUND = 127  # ``run``: COMMAND was not found (the shell's code)


class TracedumpError(ValueError):
    """The root: tracedump refused a value, a file or a command line, and says which and why."""

    exit_code: ExitCode = ExitCode.USAGE


class ConfigError(TracedumpError):
    """A setting has a bad value. The message names the env var (or config field) and the value.
    Raised by ``attach()``, ``capture()``, ``graft()`` and ``tracedump run`` before anything runs."""


class UsageError(TracedumpError):
    """The command line cannot be honoured (bad option, nothing to compare)."""


class BridgeError(UsageError):
    """A rule file that cannot be used: one line naming the file and the rule."""


class DumpReadError(TracedumpError):
    """A path is not a readable dump, run dir or pass file."""


class LimitError(DumpReadError):
    """A file beyond what a reader accepts: no regular file (a FIFO, a device), larger than its
    cap, JSON nested too deep (the limits: docs/file-format.md). Readers re-raise it naming the
    file; a rule file's reader as a BridgeError."""


class FormatVersionError(DumpReadError):
    """A file was written in a format version whose major this tracedump cannot read."""


class SequenceError(TracedumpError):
    """Sequence metadata that cannot be lined up (names the pass and the sequence)."""


class OrderError(TracedumpError):
    """An arm/disarm order the CLI refuses, or a control file a dumper ignores (says why)."""


class GraftFeedRefused(TracedumpError):
    """A grafted module cannot take the reference's inputs as its integration describes them (the
    reason: the grafter lists the call as not grafted with it, never raised into a forward)."""


__all__ = [
    "BridgeError",
    "ConfigError",
    "DumpReadError",
    "ExitCode",
    "FormatVersionError",
    "GraftFeedRefused",
    "LimitError",
    "OrderError",
    "SequenceError",
    "TracedumpError",
    "UsageError",
]
