"""The writer thread yields the CPU to the host's threads (a nice value of its own, on Linux)."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import tracedump
import tracedump.writer


@dataclass
class _Probe:
    """A writer job that only runs ``call`` on the writer thread."""

    call: Callable[[], None]
    nbytes: int = 0
    index: int = -1

    def run(self, writer: tracedump.writer.Writer) -> None:
        self.call()


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")
def test_the_writer_runs_at_the_lowest_priority_and_the_host_keeps_its_own(dump_dir: Path) -> None:
    host = _nice()
    dumper = tracedump.attach(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    assert dumper is not None
    seen: list[int] = []

    dumper.rundir.writer.submit(_Probe(lambda: seen.append(_nice())))  # type: ignore[arg-type]
    dumper.close()

    assert seen == [max(tracedump.writer.WRITER_NICE, host)]
    assert _nice() == host
