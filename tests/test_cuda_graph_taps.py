"""``COMPILED=1`` taps inside CUDA graphs, on CPU with a fake graph class (no GPU here).

:class:`FakeGraph` has ``torch.cuda.CUDAGraph``'s shape: between ``capture_begin`` and
``capture_end`` the current stream "is capturing" (``torch.cuda.is_current_stream_capturing``
answers True) and every Python-level ``Tensor.copy_`` is recorded, as a real capture records the
copy kernel a tap queues into its buffer; ``replay`` runs ``kernels`` (the model's work on its
static tensors, in place) and then those copies again, as the GPU would. The replay watch
(:mod:`tracedump.dump.replays`) wraps the class's ``capture_end`` and ``replay`` while a
``COMPILED`` dumper is open.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from conftest import make_tiny_llama, read_passes, tracedump_warnings

import tracedump
from tracedump.dump import replays, taps
from tracedump.dump.hooks import flatten_inputs, flatten_tensors

_ABSENT = object()


class FakeGraph:
    """``torch.cuda.CUDAGraph`` on CPU: a capture records the Python-level copies made during it;
    a replay reruns ``kernels`` and then those copies."""

    capturing: ClassVar[FakeGraph | None] = None
    captures = 0

    def __init__(self, kernels: Callable[[], None] = lambda: None, recopy: bool = True) -> None:
        self.kernels = kernels
        self.recopy = recopy
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.saved: Any = _ABSENT

    def capture_begin(self) -> None:
        FakeGraph.capturing = self  # one probe for every fake class
        self.copies = []
        self.saved = torch.Tensor.__dict__.get("copy_", _ABSENT)
        shipped = torch.Tensor.copy_

        def copy_(dst: torch.Tensor, src: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            self.copies.append((dst, src))
            return shipped(dst, src, *args, **kwargs)

        torch.Tensor.copy_ = copy_  # type: ignore[method-assign]

    def capture_end(self) -> None:
        if self.saved is _ABSENT:
            del torch.Tensor.copy_
        else:
            torch.Tensor.copy_ = self.saved  # type: ignore[method-assign]
        FakeGraph.capturing = None
        type(self).captures += 1

    def replay(self) -> None:
        self.kernels()
        for dst, src in self.copies if self.recopy else ():
            dst.copy_(src)

    def capture(self, program: Callable[[], Any]) -> Any:
        self.capture_begin()
        try:
            return program()
        finally:
            self.capture_end()


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[FakeGraph]]:
    """``torch.cuda.CUDAGraph`` is a fresh fake class; the stream probe answers the fake capture."""

    class Graph(FakeGraph):
        pass

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: FakeGraph.capturing is not None)
    yield Graph
    assert replays.watched_class() is None  # every test closes its dumpers: nothing left patched


def _key(target: taps.TapTarget, kind: str, name: str, leaves: list[tuple[str, torch.Tensor]]) -> str:
    return taps._key(target.serial, kind, name, [p for p, _ in leaves])


def _tap(target: taps.TapTarget, kind: str, name: str, leaves: list[tuple[str, torch.Tensor]]) -> None:
    """What a ``tracedump::tap`` node of the compiled program does at run time."""
    taps.tap([t for _, t in leaves], _key(target, kind, name, leaves))


def _attrs(cls: type) -> dict[str, Any]:
    return {name: cls.__dict__.get(name, _ABSENT) for name in ("capture_begin", "capture_end", "replay")}


# ------------------------------------------------------------------ through a dumper


def _compiled_dumper(path: Path, model: torch.nn.Module, **config: Any) -> Any:
    dumper = tracedump.attach(model, {"dir": path, "compiled": True, **config})
    assert dumper is not None and dumper.taps is not None
    return dumper


def test_three_replays_give_three_passes_each_with_its_replays_values(
    tmp_path: Path, fake_cuda: type[FakeGraph]
) -> None:
    """A graphed root (open, an input, an output, close, all captured into one graph): nothing is
    dumped at capture; each replay is one pass whose tensors are that replay's values."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 3))
    dumper = _compiled_dumper(tmp_path, model, inputs=True)
    target = dumper.taps.target
    assert replays.watched_class() is fake_cuda
    x, y = torch.zeros(3), torch.zeros(3)  # the graph's static input and output

    def program() -> None:  # the compiled root's taps, as its graph runs them
        _tap(target, "open", "", [("0", x)])
        _tap(target, "in", "0", flatten_inputs((x,), {}))
        torch.mul(x, 2.0, out=y)
        _tap(target, "out", "0", [("", y)])
        _tap(target, "close", "", [])

    graph = fake_cuda(kernels=lambda: torch.mul(x, 2.0, out=y))
    graph.capture(program)
    assert not list(dumper.run_dir.glob("pass*"))  # nothing at capture
    assert target.summary() == {"taps": 0, "cuda_graphs": 1, "graph_tap_bytes": 3 * 12, "idle_graph_steps": 0}
    values = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([-1.0, 0.5, 4.0]), torch.tensor([7.0, 8.0, 9.0])]
    for value in values:
        x.copy_(value)  # new input into the static one, as an engine does
        graph.replay()
    dumper.close()
    passes = read_passes(dumper.run_dir)
    assert sorted(passes) == [0, 1, 2]
    for index, value in enumerate(values):
        assert torch.equal(passes[index]["0@in[0]"], value)
        assert torch.equal(passes[index]["0"], value * 2)
    manifest = json.loads((dumper.run_dir / "manifest.json").read_text())
    assert manifest["compiled"] == {"taps": 6, "cuda_graphs": 1, "graph_tap_bytes": 36, "idle_graph_steps": 0}
    assert manifest["complete"] is True and manifest["errors"] == []
    assert tracedump.open_dump(tmp_path).run().manifest["compiled"]["taps"] == 6  # the typed reader


def test_a_compiled_model_captured_into_a_graph_dumps_at_replay_what_it_dumps_uncaptured(
    tmp_path: Path, fake_cuda: type[FakeGraph]
) -> None:
    """A tiny HF Llama compiled with inductor: a warm-up call (pass 0, the taps run directly), then
    the same call captured into a (fake) graph and replayed once (pass 1, the taps' buffers): the
    same names in the same order, the same values, and no pass at capture. On CPU the capture ran
    the program and each tap's copy at its place in it, so the buffers already hold this input's
    values; the fake replay does not copy again (inductor reuses an intermediate's memory later in
    the program: a copy rerun after the whole program would read the reused memory, where a GPU
    replay runs each copy at its place in the stream)."""
    pytest.importorskip("transformers")
    torch._dynamo.reset()
    model = make_tiny_llama()
    dumper = _compiled_dumper(tmp_path, model)
    compiled = torch.compile(model)
    ids = torch.tensor([[3, 14, 15, 9, 26]])
    try:
        with torch.no_grad(), torch._inductor.config.patch({"fx_graph_cache": False}):
            compiled(ids)
            direct = dumper.taps.target.taps
            dumper.flush()
            graph = fake_cuda(recopy=False)
            graph.capture(lambda: compiled(ids))
            dumper.flush()
            assert sorted(p.name for p in dumper.run_dir.glob("pass*")) == ["pass00000.safetensors"]
            graph.replay()
    finally:
        dumper.close()
        torch._dynamo.reset()
    passes = read_passes(dumper.run_dir)
    assert sorted(passes) == [0, 1]
    assert list(passes[1]) == list(passes[0]) and "model.layers.1.mlp.down_proj" in passes[1]
    for key, tensor in passes[0].items():
        assert torch.equal(passes[1][key], tensor), key
    summary = json.loads((dumper.run_dir / "manifest.json").read_text())["compiled"]
    assert summary["cuda_graphs"] == 1 and summary["graph_tap_bytes"] > 0
    assert direct > 0 and summary["taps"] == 2 * direct  # the replay ran every tap the direct call ran


def test_the_last_dumper_closed_restores_the_exact_attributes(
    tmp_path: Path, fake_cuda: type[FakeGraph]
) -> None:
    class Inherits(fake_cuda):  # type: ignore[misc,valid-type]
        pass  # capture_end and replay inherited: restored by deleting the wrappers

    for cls in (fake_cuda, Inherits):
        before = _attrs(cls)
        one = _compiled_dumper(tmp_path / cls.__name__ / "a", torch.nn.Linear(2, 2))
        if cls is Inherits:  # installed already on fake_cuda by the first attach: re-install on Inherits
            one.close()
            replays.watch(one.taps.target, Inherits)
            assert replays.watched_class() is Inherits
            replays.unwatch(one.taps.target)
            assert _attrs(Inherits) == before and "replay" not in Inherits.__dict__
            continue
        two = _compiled_dumper(tmp_path / "b", torch.nn.Linear(2, 2))
        patched = _attrs(cls)
        assert patched["replay"] is not before["replay"]
        assert patched["capture_end"] is not before["capture_end"]
        assert patched["capture_begin"] is before["capture_begin"]
        one.close()
        assert _attrs(cls) == patched  # one COMPILED dumper still open
        two.close()
        after = _attrs(cls)
        assert all(after[name] is before[name] for name in before)
        assert replays.watched_class() is None


def test_off_and_eager_dumpers_patch_nothing_compiled_patches_torchs_class_and_puts_it_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real ``torch.cuda.CUDAGraph`` (on a CPU-only torch, a placeholder class): untouched with
    the dump off and by an eager dumper; wrapped while a ``COMPILED`` one is open, then restored."""
    cls = torch.cuda.CUDAGraph
    before = {name: cls.__dict__[name] for name in ("capture_end", "replay")}
    monkeypatch.setenv("TRACEDUMP_DUMP_COMPILED", "1")
    assert tracedump.attach(torch.nn.Linear(2, 2)) is None  # no dump dir: off
    assert replays.watched_class() is None
    monkeypatch.delenv("TRACEDUMP_DUMP_COMPILED")
    eager = tracedump.attach(torch.nn.Linear(2, 2), {"dir": tmp_path / "eager"})
    assert eager is not None and replays.watched_class() is None
    assert all(cls.__dict__[name] is value for name, value in before.items())
    compiled = _compiled_dumper(tmp_path / "compiled", torch.nn.Linear(2, 2))
    assert replays.watched_class() is cls and cls.__dict__["replay"] is not before["replay"]
    compiled.close()
    eager.close()
    assert all(cls.__dict__[name] is value for name, value in before.items())
    assert replays.watched_class() is None


def test_graph_buffers_are_counted_warned_once_and_let_go_with_their_graph(
    tmp_path: Path, fake_cuda: type[FakeGraph], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each graph holds its own buffers (an engine captures one graph per batch size): their bytes
    are summed into the manifest at each capture, one warning when they pass the limit, and a
    graph collected (or captured again) lets its buffers go."""
    monkeypatch.setattr(taps, "GRAPH_TAP_WARN_BYTES", 100)
    dumper = _compiled_dumper(tmp_path, torch.nn.Linear(2, 2))
    target = dumper.taps.target
    static = torch.zeros(16)  # 64 bytes per graph's buffer
    graphs = [fake_cuda() for _ in range(3)]
    said: list[list[str]] = []
    try:
        for graph in graphs:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                graph.capture(lambda: _tap(target, "out", "x", [("", static)]))
            said.append(tracedump_warnings(caught))
            # in the manifest at each capture; on disk with its next due write (once a second)
            assert dumper.rundir.manifest["compiled"]["graph_tap_bytes"] == 64 * len(said)
        assert said[0] == [] and said[2] == []
        (message,) = said[1]
        assert "2 graphs" in message and "TRACEDUMP_DUMP_FILTER" in message
        held = {"taps": 0, "cuda_graphs": 3, "graph_tap_bytes": 192, "idle_graph_steps": 0}
        assert target.summary() == held
        del graphs[0], graph  # an engine drops a graph: its buffers go with it
        gc.collect()
        held = {"taps": 0, "cuda_graphs": 2, "graph_tap_bytes": 128, "idle_graph_steps": 0}
        assert target.summary() == held
        graphs[0].capture(lambda: None)  # captured again, with no tap: it holds nothing now
        assert target.summary()["graph_tap_bytes"] == 64
    finally:
        dumper.close()
    assert json.loads((dumper.run_dir / "manifest.json").read_text())["compiled"]["graph_tap_bytes"] == 64


# ------------------------------------------------------------------ the target alone


class _Seen:
    """A target's callbacks, each call kept in order."""

    def __init__(self, fail_capture: bool = False) -> None:
        self.events: list[tuple[Any, ...]] = []
        self.reports: list[tuple[str, Exception]] = []
        self.fail_capture = fail_capture

    def capture(self, name: str, value: Any, is_input: bool) -> None:
        if self.fail_capture:
            raise RuntimeError("recorder broke")
        leaves = flatten_inputs(*value) if is_input else list(flatten_tensors(value))
        self.events.append(("capture", name, [(p, t.clone()) for p, t in leaves]))

    def open_pass(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.events.append(("open", [a.clone() for a in args], {k: v.clone() for k, v in kwargs.items()}))

    def close_pass(self) -> None:
        self.events.append(("close",))

    def report(self, where: str, error: Exception) -> None:
        self.reports.append((where, error))

    def target(self) -> taps.TapTarget:
        return taps.TapTarget(self.capture, self.open_pass, self.close_pass, self.report).register()


@pytest.fixture
def watched(fake_cuda: type[FakeGraph]) -> Iterator[Callable[[_Seen], taps.TapTarget]]:
    made: list[taps.TapTarget] = []

    def make(seen: _Seen) -> taps.TapTarget:
        target = seen.target()
        replays.watch(target, fake_cuda)
        made.append(target)
        return target

    yield make
    for target in made:
        target.unregister()
        replays.unwatch(target)


def test_open_and_close_inside_a_graph_run_at_each_replay_with_its_arguments(
    fake_cuda: type[FakeGraph], watched: Callable[[_Seen], taps.TapTarget]
) -> None:
    seen = _Seen()
    target = watched(seen)
    ids, mask = torch.zeros(2, dtype=torch.long), torch.ones(2)
    graph = fake_cuda()

    def program() -> None:
        _tap(target, "open", "", [("0", ids), ("attention_mask", mask)])
        _tap(target, "out", "m", [("[0]", ids), ("[1]", mask)])
        _tap(target, "close", "", [])

    graph.capture(program)
    assert seen.events == []  # the pass edges too wait for a replay
    for step in range(2):
        ids.fill_(step + 5)
        graph.replay()
    opens = [e for e in seen.events if e[0] == "open"]
    assert [e[0] for e in seen.events] == ["open", "capture", "close"] * 2
    assert [o[1][0].tolist() for o in opens] == [[5, 5], [6, 6]]
    assert all(set(o[2]) == {"attention_mask"} for o in opens)
    (_, name, leaves) = seen.events[4]
    assert name == "m" and [p for p, _ in leaves] == ["[0]", "[1]"] and leaves[0][1].tolist() == [6, 6]


def test_two_graphs_replayed_in_turn_keep_the_capture_order(
    fake_cuda: type[FakeGraph], watched: Callable[[_Seen], taps.TapTarget]
) -> None:
    """Piecewise graphs: an engine captures several graphs per step and replays them in turn;
    each replay hands over its own graph's taps, so a step's captures come in the program's order."""
    seen = _Seen()
    target = watched(seen)
    x, h, out = torch.zeros(2), torch.zeros(2), torch.zeros(2)
    first = fake_cuda(kernels=lambda: torch.add(x, 1.0, out=h))
    second = fake_cuda(kernels=lambda: torch.mul(h, 10.0, out=out))

    def piece_one() -> None:
        torch.add(x, 1.0, out=h)
        _tap(target, "out", "a", [("", x)])
        _tap(target, "out", "b", [("", h)])

    def piece_two() -> None:
        torch.mul(h, 10.0, out=out)
        _tap(target, "out", "c", [("", out)])

    first.capture(piece_one)
    second.capture(piece_two)
    for step in range(3):
        x.fill_(float(step))
        first.replay()
        second.replay()
    names = [e[1] for e in seen.events]
    assert names == ["a", "b", "c"] * 3
    values = [e[2][0][1][0].item() for e in seen.events]
    assert values == [0.0, 1.0, 10.0, 1.0, 2.0, 20.0, 2.0, 3.0, 30.0]
    assert target.summary()["cuda_graphs"] == 2 and target.taps == 9


def test_a_failing_recorder_during_replay_is_reported_never_raised(
    fake_cuda: type[FakeGraph], watched: Callable[[_Seen], taps.TapTarget]
) -> None:
    seen = _Seen(fail_capture=True)
    target = watched(seen)
    x = torch.ones(2)
    graph = fake_cuda()
    graph.capture(lambda: _tap(target, "out", "m", [("", x)]))
    graph.replay()  # the recorder raises inside: the host's replay goes on
    graph.replay()
    assert [(where, str(e)) for where, e in seen.reports] == [("CUDA graph replay", "recorder broke")] * 2


def test_the_graphs_own_errors_pass_through_and_a_failed_capture_keeps_no_tap(
    fake_cuda: type[FakeGraph], watched: Callable[[_Seen], taps.TapTarget]
) -> None:
    seen = _Seen()
    target = watched(seen)

    class Broken(RuntimeError):
        pass

    def failing_end(graph: FakeGraph) -> None:
        FakeGraph.capture_end(graph)
        raise Broken("capture invalidated")

    def failing_replay(graph: FakeGraph) -> None:
        raise Broken("replay failed")

    graph = fake_cuda()
    graph.capture_begin()
    _tap(target, "out", "m", [("", torch.ones(1))])
    assert len(target.graph.pending) == 1
    with pytest.raises(Broken, match="capture invalidated"):
        replays._capture_end(failing_end)(graph)  # the watch's wrapper around a failing capture_end
    assert target.graph.pending == [] and target.summary()["cuda_graphs"] == 0
    with pytest.raises(Broken, match="replay failed"):
        replays._replay(failing_replay)(graph)
    assert seen.reports == [] and seen.events == []


def test_a_tap_outside_a_capture_runs_at_once_as_before(watched: Callable[[_Seen], taps.TapTarget]) -> None:
    seen = _Seen()
    target = watched(seen)
    _tap(target, "open", "", [("0", torch.ones(1))])
    _tap(target, "out", "m", [("", torch.ones(1))])
    _tap(target, "close", "", [])
    assert [e[0] for e in seen.events] == ["open", "capture", "close"]
    assert target.summary() == {"taps": 1, "cuda_graphs": 0, "graph_tap_bytes": 0, "idle_graph_steps": 0}


def test_resolve_cuda_graph_keeps_graphs_on_with_compiled_only(tmp_path: Path) -> None:
    compiled = _compiled_dumper(tmp_path / "c", torch.nn.Linear(2, 2))
    eager = tracedump.attach(torch.nn.Linear(2, 2), {"dir": tmp_path / "e"})
    try:
        assert tracedump.resolve_cuda_graph(True, compiled) is True
        assert tracedump.resolve_cuda_graph(False, compiled) is False
        with pytest.warns(tracedump.TracedumpWarning, match="TRACEDUMP_DUMP_COMPILED=1"):
            from tracedump.dump.runtime import runtime

            with runtime().warn.fresh():
                assert tracedump.resolve_cuda_graph(True, eager) is False
    finally:
        compiled.close()
        eager.close()


def test_the_gpu_scripts_cuda_graph_check_runs_its_steps_on_cpu_with_fakes(
    fake_cuda: type[FakeGraph], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``benchmarks/gpu.py``'s check (warm-up on a side stream, a capture by ``torch.cuda.graph``,
    three replays, an eager dump, ``tracedump diff``) on CPU: streams, ``torch.cuda.graph`` and the
    graph class faked. A fake replay cannot recompute the compiled program, so every input is the
    same one: this checks the script's steps (passes, manifest, diff), not the GPU's values."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
    from benchmarks import gpu

    class Stream:
        def wait_stream(self, other: object) -> None:
            pass

    class Graph(fake_cuda):  # type: ignore[misc,valid-type]
        def __init__(self) -> None:
            super().__init__(recopy=False)

    @contextlib.contextmanager
    def graph(cuda_graph: FakeGraph) -> Iterator[None]:
        cuda_graph.capture_begin()
        try:
            yield
        finally:
            cuda_graph.capture_end()

    same = torch.randn(8, 64)
    monkeypatch.setattr(gpu, "DEVICE", "cpu")
    monkeypatch.setattr(gpu, "_cuda_graph_inputs", lambda count: [same.clone() for _ in range(count)])
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    with torch._inductor.config.patch({"fx_graph_cache": False}):
        result = gpu._cuda_graph_check(3)
    assert result["ok"] is True and result["exit_code"] == 0, result
    assert result["passes"] == result["expected_passes"] == [0, 1, 2, 3], result
    assert result["compiled"]["cuda_graphs"] == 1 and result["compiled"]["graph_tap_bytes"] > 0
    assert result["errors"] == [] and Graph.captures == 1


def test_a_graphs_buffers_live_as_long_as_the_graph_not_as_its_dumper(fake_cuda: type[FakeGraph]) -> None:
    """The graph's copy kernels write into the buffers at every replay, so they outlive a closed
    dumper (freed, that memory could go to a later capture in the same pool); the graph does not
    keep the dumper's objects alive, and once the graph is collected the buffers go."""
    import weakref

    seen = _Seen()
    target = seen.target()
    replays.watch(target, fake_cuda)
    graph = fake_cuda()
    ones = torch.ones(4)
    key = _key(target, "out", "m", [("", ones)])
    graph.capture(lambda: taps.tap([ones], key))
    graph.copies.clear()  # the fake's own record of the copy: a real graph holds no tensor object
    buffer = weakref.ref(target.graph.graphs[id(graph)][0][3][0])
    graph_taps = weakref.ref(target.graph)
    target.unregister()
    replays.unwatch(target)  # the dumper closed
    del target, seen
    gc.collect()
    assert graph_taps() is None  # nothing of the closed dumper kept alive by the graph
    assert buffer() is not None  # but the buffer its kernels write into is
    graph.replay()  # replays after close: nothing to run, nothing raised
    del graph
    gc.collect()
    assert buffer() is None


# ------------------------------------------------------------------ the watch beside other wrappers


def _outer_wrapper(cls: type, name: str, calls: list[str]) -> Any:
    """What another library does after tracedump: wrap the method it finds, keeping it."""
    inner = getattr(cls, name)

    @functools.wraps(inner)  # copies the function's attributes, as such wrappers do
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(name)
        return inner(self, *args, **kwargs)

    setattr(cls, name, wrapper)
    return inner


def test_unwatch_keeps_a_wrapper_put_on_after_tracedump_and_replays_run_each_tap_once(
    fake_cuda: type[FakeGraph],
) -> None:
    target = _Seen().target()
    replayed: list[object] = []
    target.graph.replayed = replayed.append  # type: ignore[method-assign]
    before = _attrs(fake_cuda)
    replays.watch(target, fake_cuda)
    calls: list[str] = []
    under = _outer_wrapper(fake_cuda, "replay", calls)  # theirs, over ours
    graph = fake_cuda()
    graph.replay()
    assert calls == ["replay"] and replayed == [graph]
    replays.unwatch(target)
    theirs = fake_cuda.__dict__["replay"]
    assert theirs is not before["replay"] and theirs.__wrapped__ is under  # theirs kept, ours under it
    assert _attrs(fake_cuda)["capture_end"] is before["capture_end"]  # ours alone there: removed
    graph.replay()
    assert calls == ["replay"] * 2 and replayed == [graph]  # ours calls through: no tap runs
    replays.watch(target, fake_cuda)  # a later COMPILED dumper: one active layer, over theirs
    graph.replay()
    assert calls == ["replay"] * 3 and replayed == [graph] * 2
    replays.unwatch(target)
    assert fake_cuda.__dict__["replay"] is theirs
    fake_cuda.replay = under  # type: ignore[method-assign]  # they take their layer off: ours, dormant
    replays.watch(target, fake_cuda)
    assert fake_cuda.__dict__["replay"] is under  # switched on again, no second layer
    graph.replay()
    assert replayed == [graph] * 3
    replays.unwatch(target)
    target.unregister()
    after = _attrs(fake_cuda)
    assert all(after[name] is before[name] for name in before)
    assert replays.watched_class() is None


def test_a_failed_attach_leaves_no_replay_watch(
    tmp_path: Path, fake_cuda: type[FakeGraph], monkeypatch: pytest.MonkeyPatch
) -> None:
    """attach() failing after the watch was installed (here: joining the process's dumpers) takes
    the watch off again, with every hook."""
    from tracedump.dump.runtime import runtime

    before = _attrs(fake_cuda)

    def refuse(self: Any, dumper: Any) -> None:
        raise RuntimeError("no room")

    monkeypatch.setattr(type(runtime()), "add", refuse)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match="no room"):
        tracedump.attach(model, {"dir": tmp_path, "compiled": True})
    assert replays.watched_class() is None and _attrs(fake_cuda) == before
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert not taps._TARGETS
