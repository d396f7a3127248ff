"""The writer thread yields the CPU to the host's threads: a nice value of its own (Linux), and no
writing while a forward that takes every core runs, unless the host waits on it."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import tracedump
import tracedump.sinks
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


# ------------------------------------------------------------------ holding back while a forward runs


@pytest.fixture
def every_core_busy(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host whose forward takes every core: one usable core, and torch has at least one thread."""
    monkeypatch.setattr(tracedump.sinks, "_usable_cores", lambda: 1)


def _held_writer(dumper: tracedump.Dumper) -> threading.Event:
    """Keep the writer thread busy with a probe until the returned event is set, so a pass can be
    queued while the next one opens (no race with the writer taking it first)."""
    gate = threading.Event()
    dumper.rundir.writer.submit(_Probe(lambda: gate.wait(30)))  # type: ignore[arg-type]
    return gate


def _written(run_dir: Path) -> list[str]:
    return sorted(p.name for p in run_dir.glob("pass*.safetensors"))


def _two_passes_with_the_first_queued_while_the_second_runs(
    dumper: tracedump.Dumper, model: torch.nn.Module, inside: Callable[[], None]
) -> None:
    gate = _held_writer(dumper)
    with dumper.step():
        model(torch.ones(2, 4))
    with dumper.step():
        gate.set()  # the writer takes pass 0 now, while pass 1 is open
        inside()
        model(torch.ones(2, 4))


def test_while_a_forward_takes_every_core_the_writer_writes_after_it(
    dump_dir: Path, every_core_busy: None
) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    dumper = tracedump.attach(model)
    assert dumper is not None
    during: list[list[str]] = []

    def look() -> None:
        time.sleep(0.3)  # well inside MAX_HOLD_BACK_S: the writer may only be waiting
        during.append(_written(dumper.run_dir))

    _two_passes_with_the_first_queued_while_the_second_runs(dumper, model, look)
    dumper.flush()

    assert tracedump.writer.MAX_HOLD_BACK_S >= 1.0
    assert during == [[]]  # pass 0 was not written while pass 1 ran
    assert _written(dumper.run_dir) == ["pass00000.safetensors", "pass00001.safetensors"]
    dumper.close()


def test_a_forward_with_a_spare_core_or_on_the_gpu_is_written_beside(
    dump_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    told: list[bool] = []
    sink = tracedump.sinks.FileSink.__new__(tracedump.sinks.FileSink)
    sink._rundir = type("RunDir", (), {"writer": type("W", (), {"host_busy": staticmethod(told.append)})})()  # type: ignore[assignment]

    sink._cores = torch.get_num_threads() + 1  # a spare core
    sink.host_busy(True)
    sink._cores = torch.get_num_threads()
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # the forward runs on the GPU
    sink.host_busy(True)
    sink.host_busy(False)  # the end of a pass always reaches the writer
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    sink.host_busy(True)

    assert told == [False, True]


@pytest.mark.parametrize("wait", ["flush", "cap"])
def test_a_host_that_waits_on_the_writer_is_never_held_back(
    dump_dir: Path, every_core_busy: None, monkeypatch: pytest.MonkeyPatch, wait: str
) -> None:
    monkeypatch.setattr(tracedump.writer, "MAX_HOLD_BACK_S", 600.0)  # only the host's wait can release it
    if wait == "cap":
        monkeypatch.setenv("TRACEDUMP_DUMP_MAX_PENDING_BYTES", "64")  # each capture waits for the writer
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    dumper = tracedump.attach(model)
    assert dumper is not None
    during: list[list[str]] = []

    def wait_on_the_writer() -> None:
        if wait == "flush":
            dumper.flush()
        during.append(_written(dumper.run_dir))

    done = threading.Thread(
        target=_two_passes_with_the_first_queued_while_the_second_runs,
        args=(dumper, model, wait_on_the_writer),
        daemon=True,
    )
    done.start()
    done.join(timeout=60)

    assert not done.is_alive(), "the host waited on a writer that held back for it: a deadlock"
    if wait == "flush":
        assert during == [["pass00000.safetensors"]]
    dumper.close()
    assert _written(dumper.run_dir)[:1] == ["pass00000.safetensors"]


def test_the_writer_holds_back_for_one_pass_at_most_max_hold_back_s(
    dump_dir: Path, every_core_busy: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tracedump.writer, "MAX_HOLD_BACK_S", 0.05)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    dumper = tracedump.attach(model)
    assert dumper is not None
    during: list[list[str]] = []

    def a_long_forward() -> None:
        deadline = time.monotonic() + 30
        while not _written(dumper.run_dir) and time.monotonic() < deadline:
            time.sleep(0.01)
        during.append(_written(dumper.run_dir))

    _two_passes_with_the_first_queued_while_the_second_runs(dumper, model, a_long_forward)
    dumper.close()

    assert during == [["pass00000.safetensors"]]
