"""``TRACEDUMP_DUMP_COMPILED=1``: a model compiled with ``torch.compile`` (inductor, CPU) dumps the
values its compiled code computed, under the names of its eager run, with no graph break.

The inductor tests compile tiny HF models (2-3 layers, fp32); each compile is a few CPU-seconds.
A bug that exists only in the compiled program is planted as an inductor post-grad pass that scales
one node of layer 2's MLP by 1.05, and must be named at layer 2.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import make_tiny_llama, read_passes

import tracedump
from tracedump.cli import main
from tracedump.dump import taps
from tracedump.dump.hooks import flatten_inputs, flatten_tensors

pytest.importorskip("transformers")

IDS = torch.tensor([[3, 14, 15, 9, 26, 5, 7]])


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


def make_tiny_qwen3(layers: int = 3) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config).eval()


BUILDERS = {"llama": lambda: make_tiny_llama(layers=3), "qwen3": make_tiny_qwen3}


SCALED: list[str] = []  # the graphs scale_layer2_mlp changed


def scale_layer2_mlp(graph: torch.fx.Graph) -> None:
    """An inductor post-grad pass: layer 2's activation (the node the tap of
    ``model.layers.2.mlp.act_fn`` reads) feeds the rest of the MLP scaled by 1.05. The tap still
    reads the unscaled value, so the first tensor to diverge is the MLP's down projection."""
    marker = f"{taps.FIELD}model.layers.2.mlp.act_fn{taps.FIELD}"
    for node in list(graph.nodes):
        args = list(node.args)
        if not any(isinstance(a, str) and marker in a for a in args):
            continue
        (source,) = next(a for a in args if isinstance(a, (list, tuple)))
        with graph.inserting_after(source):
            scaled = graph.call_function(torch.ops.aten.mul.Tensor, (source, 1.05))
        scaled.meta.update(source.meta)
        keep = {node, scaled}  # the tap reads the value the eager run computes; the rest the scaled one
        source.replace_all_uses_with(scaled, delete_user_cb=lambda user, keep=keep: user not in keep)
        SCALED.append(source.name)
        return  # a graph without that tap (the root's open / close taps) is left as it is


def dump(
    path: Path, family: str, compiled: bool, post_pass: Any = None, **compile_options: Any
) -> tuple[Path, Any]:
    model = BUILDERS[family]()
    dumper = tracedump.attach(model, {"dir": path, "compiled": compiled})
    assert dumper is not None
    run = torch.compile(model, **compile_options) if compiled else model
    patch = {"post_grad_custom_post_pass": post_pass, "fx_graph_cache": False}
    with torch._inductor.config.patch(patch), torch.no_grad():
        run(IDS)
        run(IDS)
    taps_run = dumper.taps.target.taps if dumper.taps is not None else 0
    dumper.close()
    return dumper.run_dir, taps_run


def diff(tmp_path: Path, a: Path, b: Path) -> tuple[int, dict]:
    report = tmp_path / "report.json"
    status = main(["diff", str(a), str(b), "--json", str(report), "--no-progress"])
    return status, json.loads(report.read_text())


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_compiled_model_dumps_the_eager_names_with_no_graph_break(tmp_path: Path, family: str) -> None:
    """``fullgraph=True, dynamic=True`` (a root looping over its layers): every tap's key is a
    constant of the trace, so Dynamo neither breaks the graph nor refuses it."""
    compiled, taps_run = dump(tmp_path / "compiled", family, compiled=True, fullgraph=True, dynamic=True)
    breaks = dict(torch._dynamo.utils.counters["graph_break"])
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    eager, _ = dump(tmp_path / "eager", family, compiled=False)
    assert breaks == {}
    assert graphs >= 1 and taps_run > 0  # taps run only inside compiled code: it ran compiled
    passes_c, passes_e = read_passes(compiled), read_passes(eager)
    assert sorted(passes_c) == sorted(passes_e) == [0, 1]
    assert list(passes_c[0]) == list(passes_e[0])  # the same names, in the same order
    status, report = diff(tmp_path, compiled, eager)
    assert status == 0, report["summary"]["first_divergence"]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_bug_only_in_the_compiled_program_is_named_at_layer_2(tmp_path: Path, family: str) -> None:
    SCALED.clear()
    compiled, _ = dump(tmp_path / "compiled", family, compiled=True, post_pass=scale_layer2_mlp)
    assert len(SCALED) == 1  # the premise: the pass changed one node of the compiled program
    eager, _ = dump(tmp_path / "eager", family, compiled=False)
    status, report = diff(tmp_path, compiled, eager)
    assert status == 1
    first = report["summary"]["first_divergence"]["name"]
    assert first.startswith("model.layers.2."), first


def test_compiled_without_a_dump_dir_attaches_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRACEDUMP_DUMP_COMPILED", "1")
    model = make_tiny_llama()
    assert tracedump.attach(model) is None
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())


def test_resolve_compile_keeps_compile_on_with_compiled(tmp_path: Path) -> None:
    dumper = tracedump.attach(torch.nn.Linear(2, 2), {"dir": tmp_path, "compiled": True})
    assert dumper is not None
    assert tracedump.resolve_compile(True, dumper) is True
    dumper.close()


def test_eager_calls_of_a_compiled_dumper_dump_as_before_and_run_no_tap(tmp_path: Path) -> None:
    model = make_tiny_llama()
    dumper = tracedump.attach(model, {"dir": tmp_path / "c", "compiled": True})
    assert dumper is not None
    with torch.no_grad():
        model(IDS)
    assert dumper.taps.target.taps == 0
    dumper.close()
    assert "model.layers.1.mlp.down_proj" in read_passes(dumper.run_dir)[0]
    assert taps.TapTarget  # the target is unregistered at close
    assert dumper.taps.target.serial not in taps._TARGETS


# ------------------------------------------------------------------ the tap's parts alone


class _Recorded:
    def __init__(self) -> None:
        self.captures: list[tuple[str, list[tuple[str, torch.Tensor]], bool]] = []

    def capture(self, name: str, value: Any, is_input: bool) -> None:
        leaves = flatten_inputs(*value) if is_input else list(flatten_tensors(value))
        self.captures.append((name, leaves, is_input))


def _target(seen: _Recorded) -> taps.TapTarget:
    return taps.TapTarget(seen.capture, lambda a, k: None, lambda: None, lambda w, e: None)


def test_a_tap_rebuilds_the_leaves_the_eager_hook_would_have_named() -> None:
    seen = _Recorded()
    target = _target(seen)
    a, b, c = torch.ones(1), torch.zeros(1), torch.full((1,), 2.0)
    output = (a, {"k": b, "j": [c]})
    leaves = list(flatten_tensors(output))
    target.run([t for _, t in leaves], taps._key(target.serial, "out", "m.x", [p for p, _ in leaves]))
    inputs = flatten_inputs((a,), {"mask": b})
    target.run([t for _, t in inputs], taps._key(target.serial, "in", "m.x", [p for p, _ in inputs]))
    target.run([a], taps._key(target.serial, "out", "m.y", [""]))
    (out_name, out_leaves, _), (_, in_leaves, is_input), (_, single, _) = seen.captures
    assert out_name == "m.x" and [p for p, _ in out_leaves] == ["[0]", "[1][k]", "[1][j][0]"]
    assert [p for p, _ in in_leaves] == ["@in[0]", "@in[mask]"] and is_input
    assert [p for p, _ in single] == [""] and single[0][1] is a


def test_a_tap_of_a_closed_dumper_does_nothing() -> None:
    seen = _Recorded()
    target = _target(seen)  # never registered: as after close
    taps.tap([torch.ones(1)], taps._key(target.serial, "out", "m", [""]))
    assert seen.captures == []


def test_taps_inside_a_cuda_graph_capture_are_read_after_each_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA-graph path on CPU, with a fake capture: during capture a tap copies into buffers of
    its own (the copy is what the graph replays); after each replay the buffers are captured."""
    seen = _Recorded()
    target = _target(seen).register()
    try:
        x = torch.ones(3)
        monkeypatch.setattr(taps, "stream_is_capturing", lambda: True)
        taps.tap([x], taps._key(target.serial, "out", "m.lin", [""]))
        assert seen.captures == []  # nothing captured during the graph's capture
        graph = object()
        assert target.graph.captured(graph) == 1
        monkeypatch.setattr(taps, "stream_is_capturing", lambda: False)
        (_, _, _, (buffer,)) = target.graph.graphs[id(graph)][0]
        assert buffer is not x and buffer.data_ptr() != x.data_ptr()
        buffer.fill_(5.0)  # what a replay's copy kernel would write
        assert target.graph.replayed(graph) == 1
        ((name, ((_, value),), _),) = seen.captures
        assert name == "m.lin" and value.tolist() == [5.0, 5.0, 5.0]
    finally:
        target.unregister()


# ------------------------------------------------------------------ modes, shapes, shared modules, idle


class Rotary(torch.nn.Module):
    """One module held by every layer, as vLLM's rotary embedding is."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class Block(torch.nn.Module):
    def __init__(self, rotary: Rotary) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.rotary = rotary

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.rotary(self.proj(x))) + x


class Shared(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        rotary = Rotary()
        self.layers = torch.nn.ModuleList([Block(rotary) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


ROTARY_NAMES = [f"layers.{i}.rotary" for i in range(3)]


def _inputs(rows: int) -> torch.Tensor:
    return torch.linspace(-1, 1, rows * 8).reshape(rows, 8)


def _run_shared(path: Path, compile_options: dict[str, Any] | None, mark: bool = False, **config: Any) -> Any:
    """Three steps of the shared-module model (4, 6, 4 rows), compiled or not; the dumper, closed."""
    model = Shared()
    dumper = tracedump.attach(model, {"dir": path, "compiled": compile_options is not None, **config})
    assert dumper is not None
    run = torch.compile(model, **compile_options) if compile_options is not None else model
    with torch.no_grad():
        for rows in (4, 6, 4):
            x = _inputs(rows)
            if mark:
                torch._dynamo.mark_dynamic(x, 0)
            run(x)
    dumper.close()
    return dumper


@pytest.mark.parametrize(
    "options",
    [
        {"fullgraph": True, "dynamic": True},
        {"fullgraph": True, "mark_dynamic": True},
        {"fullgraph": True, "dynamic": True, "mode": "reduce-overhead"},
        {"fullgraph": True, "dynamic": True, "mode": "max-autotune-no-cudagraphs"},
    ],
    ids=["dynamic", "mark_dynamic", "reduce-overhead", "max-autotune-no-cudagraphs"],
)
def test_every_cpu_mode_taps_with_no_graph_break_and_names_a_shared_module_by_its_caller(
    tmp_path: Path, options: dict[str, Any]
) -> None:
    options = dict(options)
    mark = options.pop("mark_dynamic", False)
    compiled = _run_shared(tmp_path / "c", options, mark=mark)
    assert dict(torch._dynamo.utils.counters["graph_break"]) == {}
    assert compiled.taps.target.taps > 0
    eager = _run_shared(tmp_path / "e", None)
    passes_c, passes_e = read_passes(compiled.run_dir), read_passes(eager.run_dir)
    assert sorted(passes_c) == [0, 1, 2]
    for index in passes_c:
        assert list(passes_c[index]) == list(passes_e[index])
        assert [n for n in passes_c[index] if "rotary" in n] == ROTARY_NAMES  # the caller's name
    status, report = diff(tmp_path, compiled.run_dir, eager.run_dir)
    assert status == 0, report["summary"]["first_divergence"]


def _graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def test_an_unselected_step_runs_the_tap_free_graph_and_switching_compiles_once(tmp_path: Path) -> None:
    """STEPS=1,3 over five steps: steps 0, 2 and 4 run the graph traced without module taps (no
    tap runs), 1 and 3 the tapped one; each is compiled once, then both are reused."""
    model = Shared()
    dumper = tracedump.attach(model, {"dir": tmp_path, "compiled": True, "steps": "1,3"})
    assert dumper is not None
    run = torch.compile(model, fullgraph=True)
    seen = []
    with torch.no_grad():
        for _ in range(5):
            run(_inputs(4))
            seen.append((dumper.taps.target.taps, _graphs()))
    dumper.close()
    per_step = 6  # 3 projections + 3 rotary calls
    assert [t for t, _ in seen] == [0, per_step, per_step, 2 * per_step, 2 * per_step]
    graphs = [g for _, g in seen]
    assert graphs[1] == graphs[0] + 1 and graphs[1:] == [graphs[1]] * 4  # one recompile, then none
    assert sorted(read_passes(dumper.run_dir)) == [1, 3]


def test_a_wanted_step_that_ran_the_tap_free_graph_is_counted_and_reported(tmp_path: Path) -> None:
    """The pass edges traced into the model's own frame (a compiled function calling the model):
    a step the dumper comes to want only once that frame's guard was checked runs without module
    taps. It is counted (``compiled.idle_graph_steps``) and reported, never silent."""
    model = Shared()
    dumper = tracedump.attach(model, {"dir": tmp_path, "compiled": True})
    assert dumper is not None
    run = torch.compile(lambda x: model(x), fullgraph=True)
    target = dumper.taps.target
    target.wanted = lambda: False  # the premise: every guard check sees an idle dumper
    taps.refresh()
    with pytest.warns(UserWarning, match="COMPILED idle graph"), torch.no_grad():
        run(_inputs(4))
    dumper.close()
    manifest = json.loads((dumper.run_dir / "manifest.json").read_text())
    assert target.taps == 0 and manifest["compiled"]["idle_graph_steps"] == 1
    assert any("COMPILED idle graph" in str(e) for e in manifest["errors"])


def test_the_compiled_pass_edges_ride_on_the_eager_pass_hooks(tmp_path: Path) -> None:
    """An idle step runs the root's hooks only (its graph has no tap): a ``COMPILED`` dumper puts
    its ``open`` and ``close`` taps inside the eager pass hooks rather than beside them, so its
    root carries exactly the hooks an eager dumper's does, and its dump is unchanged."""

    def root_hooks(config: dict[str, Any]) -> tuple[int, int]:
        model = Shared()
        dumper = tracedump.attach(model, {"dir": tmp_path / str(len(config)), **config})
        assert dumper is not None
        counts = (len(model._forward_pre_hooks), len(model._forward_hooks))
        dumper.close()
        return counts

    assert root_hooks({"compiled": True}) == root_hooks({})
    assert root_hooks({"compiled": True, "control": True}) == root_hooks({"control": True})


def test_arming_and_disarming_a_compiled_server_compile_once_each_way(tmp_path: Path) -> None:
    """CONTROL=1: idle steps run the tap-free graph; an armed window the tapped one, compiled at
    the first arming; disarmed, the tap-free one again; armed again, no compile at all."""
    from tracedump.cli import main as cli

    model = Shared()
    dumper = tracedump.attach(model, {"dir": tmp_path, "compiled": True, "control": True})
    assert dumper is not None and dumper.recorder.control is not None
    run = torch.compile(model, fullgraph=True)

    def step() -> None:
        with dumper.step(), torch.no_grad():
            run(_inputs(4))

    def until(event: str) -> None:
        history = dumper.recorder.control.history  # type: ignore[union-attr]
        for _ in range(20_000):
            if history and any(e["event"] == event and e["id"] == history[-1]["id"] for e in history):
                return
            step()
        raise AssertionError(f"never {event}: {history}")

    try:
        step()
        idle_graphs = _graphs()
        step()
        assert (_graphs(), dumper.taps.target.taps) == (idle_graphs, 0)  # idle: no tap, no compile
        assert cli(["arm", str(tmp_path), "--steps", "2"]) == 0
        until("done")
        armed_graphs = _graphs()
        per_step = 12  # 6 outputs and, since an order may ask for inputs (--inputs), 6 inputs
        assert armed_graphs == idle_graphs + 1 and dumper.taps.target.taps == 2 * per_step
        for _ in range(3):
            step()
        assert (_graphs(), dumper.taps.target.taps) == (armed_graphs, 2 * per_step)  # idle again
        assert cli(["arm", str(tmp_path), "--steps", "2"]) == 0
        for _ in range(20_000):  # until the second window ran (its order joins the history late)
            if dumper.taps.target.taps >= 4 * per_step:
                break
            step()
        for _ in range(3):
            step()
        assert (_graphs(), dumper.taps.target.taps) == (armed_graphs, 4 * per_step)  # armed again
    finally:
        dumper.close()
    assert len(list(dumper.run_dir.glob("pass*.safetensors"))) == 4
