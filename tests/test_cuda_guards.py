"""CUDA guards on a CPU-only host: graph refusal, capture-time skip, sync escape hatch.

This host has no GPU, so the CUDA side is faked where it must be: ``torch.cuda`` probes are
monkeypatched (they are looked up at call time), and "device" tensors are a wrapper subclass that
reports a non-CPU device and copies from a CPU tensor inside. What this cannot show: a real
``torch.cuda.graph`` capture, a real pinned ``non_blocking`` copy with its event, and a real
``set_sync_debug_mode("error")`` refusing a sync.
"""

from __future__ import annotations

import contextlib
import textwrap
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import tracedump_warnings
from torch import nn

import tracedump
import tracedump.dump.cuda
import tracedump.dump.sinks
from tracedump.dump.cuda import copy_to_host, stream_is_capturing

pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("fresh_warn_once")


class FakeDeviceTensor(torch.Tensor):
    """A tensor that says it lives on a non-CPU device; its data is a CPU tensor inside.

    Only what ``copy_to_host`` needs is supported: ``detach`` and being the source of ``copy_``.
    ``fail_copy`` makes the copy raise, to test clean-up.
    """

    inner: torch.Tensor
    fail_copy: bool

    @staticmethod
    def __new__(cls, inner: torch.Tensor, device: str = "xpu", fail_copy: bool = False) -> FakeDeviceTensor:
        fake = torch.Tensor._make_wrapper_subclass(
            cls, inner.shape, dtype=inner.dtype, device=torch.device(device)
        )
        fake.inner = inner
        fake.fail_copy = fail_copy
        return fake

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten.detach.default:
            source = args[0]
            return FakeDeviceTensor(source.inner, source.device.type, source.fail_copy)
        if func is torch.ops.aten.copy_.default and isinstance(args[1], FakeDeviceTensor):
            if args[1].fail_copy:
                raise RuntimeError("device copy failed")
            return args[0].copy_(args[1].inner)
        raise NotImplementedError(f"FakeDeviceTensor does not support {func}")


class DeviceEmitter(nn.Module):
    """A leaf whose output is a 'device' tensor, as every output is on a GPU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return FakeDeviceTensor(x * 2)


class DeviceModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emit = DeviceEmitter()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.emit(x)


class FakeSyncDebugMode:
    """Stands in for ``torch.cuda.get/set_sync_debug_mode``; remembers every set."""

    def __init__(self, mode: int) -> None:
        self.mode = mode
        self.sets: list[int] = []

    def get(self) -> int:
        return self.mode

    def set(self, mode: int | str) -> None:
        self.mode = {"default": 0, "warn": 1, "error": 2}.get(mode, mode) if isinstance(mode, str) else mode
        self.sets.append(self.mode)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> FakeSyncDebugMode:
        monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", self.get)
        monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", self.set)
        return self


class EscapeLog:
    """A sync-escape factory that logs when it is entered and what sync mode it saw then."""

    def __init__(self, sync: FakeSyncDebugMode | None = None) -> None:
        self.sync = sync
        self.events: list[tuple[str, int | None]] = []

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        self.events.append(("enter", self.sync.mode if self.sync else None))
        try:
            yield
        finally:
            self.events.append(("exit", self.sync.mode if self.sync else None))


# --------------------------------------------------------------------------- resolve_cuda_graph


def test_resolve_cuda_graph_refuses_graphs_with_one_warning_while_dumping(
    llama: nn.Module, tmp_path: Path
) -> None:
    with tracedump.attach(llama, tracedump.DumpConfig(dir=tmp_path)) as dumper:
        with pytest.warns(tracedump.TracedumpWarning, match="CUDA graphs disabled"):
            assert tracedump.resolve_cuda_graph(True, dumper) is False
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert tracedump.resolve_cuda_graph(True, dumper) is False  # warned already
            assert tracedump.resolve_cuda_graph(False, dumper) is False
    assert tracedump_warnings(caught) == []


@pytest.mark.parametrize("requested", [True, False])
def test_resolve_cuda_graph_without_a_dumper_returns_the_request_silently(requested: bool) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert tracedump.resolve_cuda_graph(requested, None) is requested
    assert tracedump_warnings(caught) == []


# --------------------------------------------------------------------------- capture-time skip


def test_stream_is_capturing_is_false_on_a_cpu_only_build() -> None:
    assert stream_is_capturing() is False
    assert not torch.cuda.is_initialized()


def test_hooks_firing_during_graph_capture_copy_nothing_and_warn_once(
    llama: nn.Module, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.inference_mode():
        expected = llama(ids).logits
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    copies: list[torch.Tensor] = []
    real_copy = tracedump.dump.sinks.FileSink.copy

    def spy(sink: Any, tensor: torch.Tensor, **kwargs: Any) -> Any:
        copies.append(tensor)
        return real_copy(sink, tensor, **kwargs)

    monkeypatch.setattr(tracedump.dump.sinks.FileSink, "copy", spy)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tracedump.attach(llama, tracedump.DumpConfig(dir=tmp_path)) as dumper, torch.inference_mode():
            with dumper.step():
                first = llama(ids).logits
            with dumper.step():
                second = llama(ids).logits
    assert torch.equal(first, expected) and torch.equal(second, expected)  # the capture is untouched
    assert copies == []
    assert not list(dumper.run_dir.glob("pass*"))
    assert dumper.skipped["graph_capture"] == 2 * len(dumper.modules)
    capture_warnings = [m for m in tracedump_warnings(caught) if "graph capture" in m]
    assert len(capture_warnings) == 1


def test_capture_resumes_once_the_stream_stops_capturing(
    llama: nn.Module, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    capturing = {"now": True}
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing["now"])
    config = tracedump.DumpConfig(dir=tmp_path, filter=["lm_head"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tracedump.attach(llama, config) as dumper, torch.inference_mode():
            llama(torch.tensor([[1, 2]]))  # captured into a graph: skipped
            capturing["now"] = False
            eager = llama(torch.tensor([[1, 2, 3]])).logits  # eager again: captured
    messages = tracedump_warnings(caught)
    assert len([m for m in messages if "during CUDA graph capture" in m]) == 1
    assert len([m for m in messages if "captures lost: {'graph_capture': 1}" in m]) == 1  # said at close
    passes = tracedump.open_dump(dumper.run_dir).run().passes
    assert list(passes) == [1]
    assert torch.equal(passes[1]["lm_head"], eager)


# --------------------------------------------------------------------------- allow_sync


def test_allow_sync_lifts_sync_debug_mode_and_restores_it(monkeypatch: pytest.MonkeyPatch) -> None:
    sync = FakeSyncDebugMode(2).install(monkeypatch)
    with tracedump.allow_sync():
        assert sync.mode == 0
    assert sync.mode == 2
    assert sync.sets == [0, 2]


def test_allow_sync_restores_the_mode_when_the_body_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    sync = FakeSyncDebugMode(1).install(monkeypatch)
    with pytest.raises(RuntimeError, match="boom"), tracedump.allow_sync():
        raise RuntimeError("boom")
    assert sync.mode == 1
    assert sync.sets == [0, 1]


def test_allow_sync_leaves_a_mode_that_is_already_off_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    sync = FakeSyncDebugMode(0).install(monkeypatch)
    with tracedump.allow_sync():
        pass
    assert sync.sets == []


def test_allow_sync_on_a_cpu_only_build_neither_fails_nor_initialises_cuda() -> None:
    with tracedump.allow_sync():
        value = torch.ones(2).sum().item()
    assert value == 2.0
    assert not torch.cuda.is_initialized()


# --------------------------------------------------------------------------- device copies


def test_device_copy_runs_inside_allow_sync_and_the_escape(monkeypatch: pytest.MonkeyPatch) -> None:
    sync = FakeSyncDebugMode(2).install(monkeypatch)
    escape = EscapeLog(sync)
    inner = torch.arange(6.0).reshape(2, 3)
    host, event = copy_to_host(FakeDeviceTensor(inner), escape)
    assert host.device.type == "cpu" and torch.equal(host, inner)
    assert event is None  # events only for CUDA devices
    assert escape.events == [("enter", 0), ("exit", 0)]  # sync mode lifted around the escape
    assert sync.mode == 2 and sync.sets == [0, 2]


def test_failed_device_copy_still_restores_sync_mode_and_exits_the_escape(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sync = FakeSyncDebugMode(2).install(monkeypatch)
    escape = EscapeLog(sync)
    with pytest.raises(RuntimeError, match="device copy failed"):
        copy_to_host(FakeDeviceTensor(torch.ones(3), fail_copy=True), escape)
    assert escape.events == [("enter", 0), ("exit", 0)]
    assert sync.mode == 2 and sync.sets == [0, 2]


def test_cpu_copy_is_a_plain_clone_without_escape_or_sync_mode_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sync = FakeSyncDebugMode(2).install(monkeypatch)
    escape = EscapeLog(sync)
    source = torch.arange(4.0)
    host, event = copy_to_host(source, escape)
    source.add_(1)  # a later in-place write must not reach the copy
    assert torch.equal(host, torch.arange(4.0)) and event is None
    assert escape.events == [] and sync.sets == []


def test_attach_sync_escape_wraps_every_device_copy_of_a_hook(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sync = FakeSyncDebugMode(2).install(monkeypatch)
    escape = EscapeLog(sync)
    model = DeviceModel()
    x = torch.arange(3.0)
    with tracedump.attach(model, tracedump.DumpConfig(dir=tmp_path), sync_escape=escape) as dumper:
        model(x)
        dumper.record("device_record", FakeDeviceTensor(x + 1))  # records copy through it too
    passes = tracedump.open_dump(dumper.run_dir).run().passes
    records = tracedump.open_dump(dumper.run_dir).run().records
    assert torch.equal(passes[0]["emit"], x * 2)
    assert records is not None and torch.equal(records["device_record"], x + 1)
    assert escape.events == [("enter", 0), ("exit", 0)] * 2
    assert sync.mode == 2


def _write_escape_module(directory: Path, module_name: str, log: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{module_name}.py").write_text(
        textwrap.dedent(
            f"""
            import contextlib
            from pathlib import Path

            LOG = Path({str(log)!r})

            @contextlib.contextmanager
            def engine_sync_guard_off():
                with LOG.open("a") as f:
                    f.write("enter\\n")
                yield
                with LOG.open("a") as f:
                    f.write("exit\\n")
            """
        )
    )


@pytest.mark.parametrize("form", ["module", "file"])
def test_sync_escape_env_var_loads_the_factory_from_a_module_or_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, form: str
) -> None:
    log = tmp_path / "escape.log"
    module_name = f"engine_sync_{form}"
    _write_escape_module(tmp_path / "src", module_name, log)
    if form == "module":
        monkeypatch.syspath_prepend(str(tmp_path / "src"))
        spec = f"{module_name}:engine_sync_guard_off"
    else:
        spec = f"{tmp_path / 'src' / module_name}.py:engine_sync_guard_off"
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path / "dump"))
    monkeypatch.setenv("TRACEDUMP_DUMP_SYNC_ESCAPE", spec)
    model = DeviceModel()
    with tracedump.attach(model) as dumper:
        model(torch.ones(2))
    assert dumper.settings.sync_escape == spec
    assert log.read_text().split() == ["enter", "exit"]


def test_explicit_sync_escape_argument_wins_over_the_env_var(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "escape.log"
    _write_escape_module(tmp_path / "src", "engine_sync_loser", log)
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path / "dump"))
    monkeypatch.setenv(
        "TRACEDUMP_DUMP_SYNC_ESCAPE", f"{tmp_path / 'src' / 'engine_sync_loser.py'}:engine_sync_guard_off"
    )
    escape = EscapeLog()
    model = DeviceModel()
    with tracedump.attach(model, sync_escape=escape):
        model(torch.ones(2))
    assert escape.events == [("enter", None), ("exit", None)]
    assert not log.exists()


@pytest.mark.parametrize(
    "spec",
    [
        "no_such_module_for_tracedump:guard",
        "os.path:no_such_function",
        "not a spec",
        "/no/such/file.py:guard",
    ],
)
def test_bad_sync_escape_fails_at_attach_naming_the_env_var(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spec: str
) -> None:
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path))
    monkeypatch.setenv("TRACEDUMP_DUMP_SYNC_ESCAPE", spec)
    with pytest.raises(tracedump.ConfigError, match=f"TRACEDUMP_DUMP_SYNC_ESCAPE={spec!r}"):
        tracedump.attach(DeviceModel())


# --------------------------------------------------------------------------- no CUDA initialisation


def test_dumping_a_cpu_model_never_initialises_cuda(llama: nn.Module, tmp_path: Path) -> None:
    config = tracedump.DumpConfig(dir=tmp_path, mode="full", inputs=True)
    with tracedump.attach(llama, config) as dumper, torch.inference_mode():
        with dumper.step():
            llama(torch.tensor([[3, 1, 4]]))
            dumper.record("ids", torch.tensor([3, 1, 4]))
        tracedump.resolve_cuda_graph(False, dumper)
    assert (dumper.run_dir / "pass00000.safetensors").is_file()
    assert not torch.cuda.is_initialized()
