"""Atomic files: the one temp-file-and-rename writer of every file tracedump writes.

Pass files, the manifest (:mod:`tracedump.dump.writer`), ``control.json`` and each run's
``control.state`` (:mod:`tracedump.dump.control`) all go through :func:`atomic_path`, so they share its
guarantees: a reader never sees a half-written file under the final name, the file is ``0600``
(activations derived from prompts are user data; an order file must be writable by its owner
only), and a failed write (a full disk) leaves no temp file behind. ``diff``'s outputs (``--json``,
``--html``, ``--plot``) go through :func:`write_output`: atomic too, but with the mode the user's
umask gives, as any file their shell makes (a report is meant to be shared). ``stats.jsonl``, which
grows all run long, is appended to under a partial name and put in place by :func:`move_into_place`.
Nothing else in tracedump renames, or makes temp files: a test scans for it. No torch here: the
CLI's ``arm``/``disarm`` use it too.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

_PRIVATE = 0o600
_SHARED = 0o666  # before the umask, as open(path, "w") creates a file


@contextlib.contextmanager
def atomic_path(final: Path, *, private: bool = True) -> Iterator[Path]:
    """A temp path beside ``final``, renamed onto it only when the block succeeds.

    A crash mid-write leaves a dot-file, never a truncated file under the final name; an exception
    (a full disk, Ctrl-C) removes the temp file. Files are 0600, or with ``private=False`` what the
    umask makes of 0666 (a user-facing output, as ``open(path, "w")`` would create it).
    """
    tmp = _new_temp(final, _PRIVATE if private else _SHARED)
    try:
        yield tmp
        if private:  # the block may have recreated the file by name: the mode is set again
            os.chmod(tmp, _PRIVATE)
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _new_temp(final: Path, mode: int) -> Path:
    """An empty file of ``mode`` (less the umask) under a fresh dot-name beside ``final``; created
    exclusively, so two writers of one file never share a temp file."""
    while True:
        tmp = final.with_name(f".{final.name}.{secrets.token_hex(4)}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), mode)
        except FileExistsError:
            continue
        os.close(fd)
        return tmp


def write_text_atomic(path: Path, text: str) -> None:
    """``path`` holds ``text`` (0600), or, on any failure, is as it was and no temp file is left."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_json_atomic(path: Path, data: Any) -> None:
    """``path`` holds ``data`` as indented JSON (0600, the manifest's layout), or is as it was."""
    write_text_atomic(path, json.dumps(data, indent=2, default=str) + "\n")


def write_output(path: str | Path, data: str | bytes, *, keep_mode: bool = False) -> Path:
    """Write a user's output file (``diff --json/--html/--plot``) atomically; returns where it landed.

    Missing parent dirs are made. A target that is a device, a FIFO or a link to one
    (``/dev/stdout``) is written into, never renamed over (root would replace the device node with a
    file); a link to a file is followed, so the output lands where it points and the link stays. A
    new file gets the umask's mode; with ``keep_mode`` a file that is replaced keeps its mode (as
    writing into it did)."""
    path = Path(path)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    try:
        mode: int | None = os.stat(path).st_mode
    except OSError:  # no such file yet (or a dangling link: followed below)
        mode = None
    if mode is not None and not stat.S_ISREG(mode):
        with open(path, "wb") as out:  # a failure (ENOSPC of /dev/full) is raised
            out.write(raw)
        return path
    if path.is_symlink():
        path = Path(os.path.realpath(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path, private=False) as tmp:
        tmp.write_bytes(raw)
        if keep_mode and mode is not None:
            os.chmod(tmp, stat.S_IMODE(mode))
    return path


def open_for_append(path: Path) -> TextIO:
    """``path`` opened to append text (created 0600): a partial file that grows all run, such as
    ``stats.jsonl.partial``, put in place at the end by :func:`move_into_place`."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, _PRIVATE)
    return os.fdopen(fd, "a")


def move_into_place(partial: Path, final: Path) -> None:
    """Rename a finished ``partial`` onto ``final`` (``stats.jsonl.partial`` at close; a run dir onto
    the empty dir just claimed for it): the one rename outside :func:`atomic_path`."""
    os.replace(partial, final)


def probe_writable(directory: Path) -> None:
    """Raise the ``OSError`` that writing a file into ``directory`` would (no permission, a full
    disk, a name too long), leaving nothing behind."""
    with tempfile.TemporaryFile(dir=directory):
        pass


def scratch_dir(prefix: str) -> Path:
    """A fresh private (0700) directory under the system's temp dir, for a caller to remove."""
    return Path(tempfile.mkdtemp(prefix=prefix))
