"""Atomic files: the one temp-file-and-rename writer of every file tracedump writes.

Pass files, the manifest (:mod:`tracedump.dump.writer`), ``control.json`` and each run's
``control.state`` (:mod:`tracedump.dump.control`) all go through :func:`atomic_path`, so they share its
guarantees: a reader never sees a half-written file under the final name, the file is ``0600``
(activations derived from prompts are user data; an order file must be writable by its owner
only), and a failed write (a full disk) leaves no temp file behind. No torch here: the CLI's
``arm``/``disarm`` use it too.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_path(final: Path) -> Iterator[Path]:
    """A temp path beside ``final``, renamed onto it only when the block succeeds.

    A crash mid-write leaves a dot-file, never a truncated file under the final name; an exception
    (a full disk, Ctrl-C) removes the temp file. Files are 0600.
    """
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o600)
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_text_atomic(path: Path, text: str) -> None:
    """``path`` holds ``text`` (0600), or, on any failure, is as it was and no temp file is left."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)
