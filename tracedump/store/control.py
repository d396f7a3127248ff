"""A run's heartbeat, ``control.state``, as one typed model, and its bounded reader.

A dumper started with ``TRACEDUMP_DUMP_CONTROL=1`` rewrites ``<run dir>/control.state`` while it
runs (``dump/control.py``); ``tracedump ls`` shows its state. The file is read the way ``arm`` reads
it: never followed through a link, never waited on (a FIFO under its name would block ``ls``
forever), a regular file of at most :data:`MAX_STATE_BYTES` (a link to ``/dev/zero`` would fill
memory), every field typed. A heartbeat that fails any of these is no engine's: ``ls`` passes it
over and shows the manifest's own ``control`` record. (The order file ``control.json`` is typed by
``dump/control.py`` ``Order.from_json``, the manifest's ``control`` record by
:class:`tracedump.store.manifest.ControlRecord`.)
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from .jsonio import loads, validated
from .manifest import Number

STATE_FILE = "control.state"
MAX_STATE_BYTES = 1 << 16  # as for the order file: a heartbeat is about 200 bytes


class Heartbeat(BaseModel):
    """``control.state``: the step a process reached, when, at which rate, armed or not."""

    model_config = ConfigDict(strict=True, extra="allow")

    step: int = Field(ge=0)
    time: Number
    rate: Number | None = None
    state: str
    armed_until: int | None = None
    pid: int | None = None
    host: str | None = None


_ADAPTER = TypeAdapter(Heartbeat)


class _Refused(Exception):
    pass


def read_state_bytes(path: Path) -> bytes:
    """A heartbeat's bytes: a regular file, not a link, at most :data:`MAX_STATE_BYTES` (OSError
    otherwise). ``ls`` and ``arm`` both read it here: a FIFO would block them, a link to
    ``/dev/zero`` fill their memory; no engine writes either."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path}: not a regular file")
        data = handle.read(MAX_STATE_BYTES + 1)
    if len(data) > MAX_STATE_BYTES:
        raise OSError(f"{path}: larger than {MAX_STATE_BYTES} bytes")
    return data


def read_heartbeat(run_dir: Path) -> Heartbeat | None:
    """The run's heartbeat, or None when there is none an engine could have written (missing, a
    link, a FIFO, a device, too large, not JSON, a field of the wrong type)."""
    try:
        data = loads(read_state_bytes(run_dir / STATE_FILE))
        return validated(_ADAPTER.validate_python, data, _Refused)
    except (OSError, ValueError, _Refused):
        return None
