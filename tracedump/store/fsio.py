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
import errno
import json
import os
import secrets
import stat
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO, TypeVar

_PRIVATE = 0o600
_SHARED = 0o666  # before the umask, as open(path, "w") creates a file
# The errors of a write that found no room: a full disk, a quota used up.
NO_ROOM = frozenset({errno.ENOSPC, errno.EDQUOT})
_BLOCK = 4096
_T = TypeVar("_T")


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


def json_text(data: Any) -> str:
    """``data`` as the manifest's layout writes it: indented JSON, one newline at the end."""
    return json.dumps(data, indent=2, default=str) + "\n"


def write_json_atomic(path: Path, data: Any) -> None:
    """``path`` holds ``data`` as indented JSON (0600, the manifest's layout), or is as it was."""
    write_text_atomic(path, json_text(data))


def _file_size_limit() -> int:
    """The largest file this process may write (``RLIMIT_FSIZE``): a file grown past it gets the
    process a SIGXFSZ, which kills it unless it is ignored, so a reserve never asks for more."""
    try:
        import resource
    except ImportError:  # not on this platform
        return sys.maxsize
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return sys.maxsize if soft == resource.RLIM_INFINITY else soft


class SpaceReserve:
    """Disk space held, as a file of allocated blocks, for a file that must still be written once
    the disk is full: the manifest, whose last version says why a dump is incomplete and what it
    lost.

    Why: an atomic write needs room for a whole new copy beside the old one. On a disk filled by the
    dump itself or by anything else, every later manifest write failed, so the manifest kept an
    early version (``complete: false`` and no reason, nothing skipped, no pass). The reserve is a
    dot-file of ``0600`` beside it whose blocks are allocated (``posix_fallocate``; zeros written
    where a filesystem has no such call); :meth:`spend` gives them back just before the write that
    needs them and holds them again after. Held only by the process that made it (a forked child
    never frees its parent's).
    """

    def __init__(self, path: Path) -> None:
        flags = (
            os.O_RDWR | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
        )
        self.path = path
        self.held = 0  # bytes allocated now
        self._pid = os.getpid()
        self._largest = _file_size_limit() // _BLOCK * _BLOCK
        self._fd: int | None = os.open(path, flags, _PRIVATE)

    def hold(self, size: int) -> None:
        """Hold at least ``size`` bytes (rounded up to a block; never fewer than now). Raises the
        ``OSError`` of a disk without that much room, holding what it held before."""
        size = min(-(-size // _BLOCK) * _BLOCK, self._largest)
        if self._fd is None or size <= self.held or os.getpid() != self._pid:
            return
        allocate = getattr(os, "posix_fallocate", None)  # not on macOS or Windows
        try:
            if allocate is None:
                raise OSError(errno.EOPNOTSUPP, "no posix_fallocate here")
            allocate(self._fd, 0, size)
        except OSError as e:
            if e.errno in NO_ROOM:
                os.ftruncate(self._fd, self.held)  # a filesystem may keep part of a failed allocation
                raise
            self._fill(self._fd, size)  # no fallocate on this filesystem (EOPNOTSUPP, EINVAL)
        self.held = size

    def _fill(self, fd: int, size: int) -> None:
        """Real blocks up to ``size``, zeros written and synced (a delayed allocation is none);
        on a failure the file is cut back to what it held."""
        zeros = bytes(_BLOCK)
        try:
            for offset in range(self.held, size, _BLOCK):
                os.pwrite(fd, zeros, offset)
            os.fsync(fd)
        except OSError:
            os.ftruncate(fd, self.held)
            raise

    def spend(self, write: Callable[[], _T], keep: int) -> _T:
        """``write()``; if it finds no room, run it again on the reserve's blocks, then hold
        ``keep`` bytes again (or as much of it as the disk still has). Raises what the second
        try raises."""
        try:
            return write()
        except OSError as e:
            if e.errno not in NO_ROOM or self._fd is None or not self.held or os.getpid() != self._pid:
                raise
        os.ftruncate(self._fd, 0)
        self.held = 0
        try:
            return write()
        finally:
            self.hold_what_fits(keep)

    def hold_what_fits(self, size: int) -> int:
        """Hold ``size`` bytes, else the largest of its halves down to one block that the disk (or
        a file size limit, ``EFBIG``) allows; never raises. Returns the bytes held."""
        while size >= _BLOCK:
            try:
                self.hold(size)
                break
            except OSError:
                size //= 2
        return self.held

    def remove(self) -> None:
        """Give the space back for good and remove the file (at close; a killed process leaves it)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        with contextlib.suppress(OSError):
            os.close(fd)
        if os.getpid() == self._pid:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
        self.held = 0


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
