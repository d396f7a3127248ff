"""A real, small, full filesystem for the hostile tests (a tmpfs of 64 KiB, mounted as root)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def full_filesystem(where: Path, keep_free: int = 0) -> Iterator[Path]:
    """``where`` as a 64 KiB tmpfs filled up to ``keep_free`` bytes; skips the test, saying why,
    where mounting is not possible (not root, no mount(8), a container without CAP_SYS_ADMIN)."""
    where.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("a real full filesystem needs root and mount(8) (tmpfs); the injected failure covers it")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k,mode=0700", "tmpfs", str(where)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        with contextlib.suppress(OSError), open(where / "ballast", "wb") as ballast:
            while True:
                ballast.write(b"\0" * 1024)
                ballast.flush()
        if keep_free:
            os.truncate(where / "ballast", max(0, os.path.getsize(where / "ballast") - keep_free))
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)
