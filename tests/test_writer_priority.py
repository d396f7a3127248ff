"""The writer thread yields the CPU to the host's threads: a nice value of its own (Linux), and no
writing while a forward that takes every core runs, unless the host waits on it."""

from __future__ import annotations

import contextlib
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
import tracedump.dump.sinks
import tracedump.dump.writer
from tracedump.dump.writer import Writer


@dataclass
class _Probe:
    """A writer job that only runs ``call`` on the writer thread."""

    call: Callable[[], None]
    nbytes: int = 0
    index: int = -1

    def run(self, writer: tracedump.dump.writer.Writer) -> None:
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

    assert seen == [max(tracedump.dump.writer.WRITER_NICE, host)]
    assert _nice() == host


# ------------------------------------------------------------------ holding back while a forward runs


@pytest.fixture
def every_core_busy(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host whose forward takes every core: one usable core (torch has at least one thread) and
    no CUDA in use, whatever earlier tests initialised."""
    monkeypatch.setattr(tracedump.dump.sinks, "usable_cpus", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Set when the writer thread reaches a chunk while a pass is open and no host thread waits
    on it: from then on it holds back (with MAX_HOLD_BACK_S patched long, until released)."""
    reached = threading.Event()
    original = Writer.wait_for_idle_host

    def noting(self: Writer) -> None:
        if self.host_is_busy and not self.host_waiting:
            reached.set()
        original(self)

    monkeypatch.setattr(Writer, "wait_for_idle_host", noting)
    return reached


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


def _attached() -> tuple[tracedump.Dumper, torch.nn.Module]:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    dumper = tracedump.attach(model)
    assert dumper is not None
    return dumper, model


def test_while_a_forward_takes_every_core_the_writer_writes_after_it(
    dump_dir: Path, every_core_busy: None, held: threading.Event, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tracedump.dump.writer, "MAX_HOLD_BACK_S", 600.0)
    dumper, model = _attached()
    during: list[list[str]] = []

    def look() -> None:
        assert held.wait(30), "the writer never held back for the open pass"
        during.append(_written(dumper.run_dir))

    _two_passes_with_the_first_queued_while_the_second_runs(dumper, model, look)
    dumper.flush()

    assert during == [[]]  # pass 0 was not written while pass 1 ran
    assert _written(dumper.run_dir) == ["pass00000.safetensors", "pass00001.safetensors"]
    dumper.close()


def test_a_forward_with_a_spare_cpu_or_on_an_accelerator_is_written_beside(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    told: list[bool] = []
    writer = type("W", (), {"host_busy": staticmethod(told.append)})()
    rundir = type("RunDir", (), {"writer": writer, "failure": None})()

    def sink_with(cores: int) -> tracedump.dump.sinks.FileSink:
        return tracedump.dump.sinks.FileSink(rundir, None, 1 << 20, cores=cores)  # type: ignore[arg-type]

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)

    sink_with(torch.get_num_threads() + 1).host_busy(True)  # a free CPU (an SMT sibling, say)
    sink = sink_with(torch.get_num_threads())
    assert sink.off_cpu is False
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # the forward runs on the GPU
    sink.host_busy(True)
    sink.host_busy(False)  # the end of a pass always reaches the writer
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    sink.host_busy(True)  # every CPU taken, nothing on an accelerator: hold back
    sink.off_cpu = True  # a capture came from an accelerator (MPS, XPU, ...)
    sink.host_busy(True)

    assert told == [False, True]


@pytest.mark.parametrize("wait", ["flush", "cap"])
def test_a_host_that_waits_on_the_writer_is_never_held_back(
    dump_dir: Path,
    every_core_busy: None,
    held: threading.Event,
    monkeypatch: pytest.MonkeyPatch,
    wait: str,
) -> None:
    monkeypatch.setattr(
        tracedump.dump.writer, "MAX_HOLD_BACK_S", 600.0
    )  # only the host's wait can release it
    if wait == "cap":  # one pass (two [2, 4] float32 outputs) fits; pass 1's first capture waits
        monkeypatch.setenv("TRACEDUMP_DUMP_MAX_PENDING_BYTES", "64")
    dumper, model = _attached()
    during: list[list[str]] = []

    def wait_on_the_writer() -> None:
        assert held.wait(30), "the writer never held back for the open pass"
        if wait == "flush":
            dumper.flush()
            during.append(_written(dumper.run_dir))
        # "cap": the forward that follows waits for room, with the writer already held

    done = threading.Thread(
        target=_two_passes_with_the_first_queued_while_the_second_runs,
        args=(dumper, model, wait_on_the_writer),
        daemon=True,
    )
    done.start()
    done.join(timeout=60)

    assert not done.is_alive(), "the host waited on a writer that held back for it: a deadlock"
    assert during == ([["pass00000.safetensors"]] if wait == "flush" else [])
    dumper.close()
    assert _written(dumper.run_dir)[:1] == ["pass00000.safetensors"]


def test_a_queued_pass_waits_at_most_max_hold_back_s(
    dump_dir: Path, every_core_busy: None, held: threading.Event, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A host that never pauses (here: one long pass) still gets its earlier passes written."""
    monkeypatch.setattr(tracedump.dump.writer, "MAX_HOLD_BACK_S", 0.05)
    dumper, model = _attached()
    during: list[list[str]] = []

    def a_long_forward() -> None:
        deadline = time.monotonic() + 30
        while not _written(dumper.run_dir) and time.monotonic() < deadline:
            time.sleep(0.01)
        during.append(_written(dumper.run_dir))

    _two_passes_with_the_first_queued_while_the_second_runs(dumper, model, a_long_forward)
    dumper.close()

    assert held.is_set() and during == [["pass00000.safetensors"]]


class _Boom(Exception):
    pass


def _raising_forward(model: torch.nn.Module) -> None:
    with contextlib.suppress(_Boom):
        model(torch.ones(2, 4), boom=True)


@pytest.mark.parametrize(
    "ending", ["root forward", "error in the forward", "error in step()", "warm-up", "close"]
)
def test_every_end_of_a_pass_releases_the_writer(
    dump_dir: Path, every_core_busy: None, monkeypatch: pytest.MonkeyPatch, ending: str
) -> None:
    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, boom: bool = False) -> torch.Tensor:
            y = self.linear(x)
            if boom:
                raise _Boom
            return y

    if ending == "warm-up":
        monkeypatch.setenv("TRACEDUMP_DUMP_TOKENS", "100")  # a 2-row input is refused: warm-up
    model = Model()
    dumper = tracedump.attach(model)
    assert dumper is not None
    writer = dumper.rundir.writer
    seen: list[bool] = []
    original = writer.host_busy
    monkeypatch.setattr(writer, "host_busy", lambda busy: (seen.append(busy), original(busy)))

    if ending in ("root forward", "warm-up"):
        model(torch.ones(2, 4))
    elif ending == "error in the forward":
        _raising_forward(model)
    elif ending == "error in step()":
        with contextlib.suppress(_Boom), dumper.step():
            model(torch.ones(2, 4))
            raise _Boom
    else:
        with dumper.step():
            model(torch.ones(2, 4))
            dumper.close()

    if ending == "warm-up":
        assert dumper.skipped["token_gate"] == 1 and dumper.pass_index == 0  # it was one
    dumper.close()
    assert seen[:1] == [True] and writer.host_is_busy is False


def test_once_a_pass_waited_too_long_the_writer_catches_up_before_holding_back_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A host that never pauses: the writer gives up holding back for the whole backlog (at nice 19
    it would otherwise fall further behind with every pass), and holds back again once caught up."""
    monkeypatch.setattr(tracedump.dump.writer, "MAX_HOLD_BACK_S", 0.05)
    writer = Writer(tmp_path, 1 << 30, {}, lambda message: None)
    writer.host_busy(True)  # a forward that takes every core, from here on
    released: dict[str, threading.Event] = {name: threading.Event() for name in "ABC"}

    def holding(name: str) -> Callable[[], None]:
        def run() -> None:
            writer.wait_for_idle_host()
            if name == "A":  # from now on only the catching-up rule can let B through
                monkeypatch.setattr(tracedump.dump.writer, "MAX_HOLD_BACK_S", 600.0)
            released[name].set()

        return run

    gate = threading.Event()
    writer.submit(_Probe(lambda: gate.wait(30)))  # type: ignore[arg-type]
    writer.submit(_Probe(holding("A")))  # type: ignore[arg-type]
    writer.submit(_Probe(holding("B")))  # type: ignore[arg-type]  # queued behind A: the backlog
    gate.set()
    assert released["A"].wait(30) and released["B"].wait(30)  # A waited 0.05 s, B not at all

    writer.flush()  # the backlog is written: the next pass is held back again
    writer.submit(_Probe(holding("C")))  # type: ignore[arg-type]
    held_back = not released["C"].wait(0.2)
    writer.host_busy(False)
    assert held_back and released["C"].wait(30)
    writer.close()


def test_the_host_wakes_the_writer_only_for_what_it_waits_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pass closing wakes a writer that holds back for an idle host, a submit one that waits for
    work; neither wakes it otherwise (a thread woken for nothing still costs the host a context
    switch and a GIL hand-off, once per step: docs/performance.md). Every job is still written."""
    monkeypatch.setattr(tracedump.dump.writer, "MAX_HOLD_BACK_S", 600.0)
    notified: list[str] = []
    made: list[Writer] = []

    class CountingCondition(threading.Condition):
        def notify_all(self) -> None:
            if made and self is made[0]._cond:  # the thread's own start uses one too
                notified.append(str(made[0]._writer_waits))
            super().notify_all()

    with monkeypatch.context() as patched:
        patched.setattr(threading, "Condition", CountingCondition)
        writer = Writer(tmp_path, 1 << 30, {}, lambda message: None)
    made.append(writer)
    ran: list[str] = []

    def waits_for(what: str) -> None:
        deadline = time.monotonic() + 30
        while writer._writer_waits != what and time.monotonic() < deadline:
            time.sleep(0.001)
        assert writer._writer_waits == what

    def held(name: str) -> Callable[[], None]:
        return lambda: (writer.wait_for_idle_host(), ran.append(name))  # type: ignore[func-returns-value]

    waits_for("work")
    writer.host_busy(True)
    writer.host_busy(False)  # the writer waits for work, not for the host: not woken
    assert notified == []
    writer.host_busy(True)
    writer.submit(_Probe(held("A")))  # type: ignore[arg-type]  # it waits for work: woken
    waits_for("host")  # ... and holds A back while the host is busy
    writer.submit(_Probe(held("B")))  # type: ignore[arg-type]  # holding back: not woken
    assert notified == ["work"] and ran == []
    writer.host_busy(False)  # the host is idle: the writer holding back is woken
    writer.flush()
    assert notified[:2] == ["work", "host"] and ran == ["A", "B"]
    writer.close()
