"""Smoke test of the benchmarks: they import, and the off benchmark runs and asserts no hooks.

Runs the off phase on the plain-torch mini model (no transformers import) with a few rounds, so it
stays well under ten seconds; it checks the report's shape, never a timing.
"""

from __future__ import annotations

import math
import types
from pathlib import Path
from typing import Any

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    """The benchmark modules, imported from the repo root, with no dump env var in effect."""
    monkeypatch.syspath_prepend(str(REPO_ROOT))
    monkeypatch.delenv("TRACEDUMP_DUMP_DIR", raising=False)
    from benchmarks import bench_memory, bench_overhead, common, gpu, run_all

    return types.SimpleNamespace(
        common=common, overhead=bench_overhead, memory=bench_memory, gpu=gpu, run_all=run_all
    )


@pytest.fixture
def native(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """``benchmarks.native``, its C hooks built (skipped where no C compiler builds them: bench_vllm
    then leaves its native layers out)."""
    monkeypatch.syspath_prepend(str(REPO_ROOT))
    from benchmarks import native

    if native.load() is None:
        pytest.skip("no C compiler or Python headers here: bench_vllm leaves its native layers out")
    return native


def test_off_benchmark_reports_no_hooks(bench: types.SimpleNamespace) -> None:
    spec = bench.common.QUICK_SPEC
    model = bench.common.build_model(spec)
    with torch.inference_mode():
        result = bench.overhead.run_off(
            model, bench.common.make_inputs(spec), rounds=2, warmup=1, micro_calls=10_000
        )
    assert result["hooks_registered"] == 0
    assert result["threads_started"] == 0
    for key in ("forward_ratio", "attach_off_us", "record_noop_ns"):
        assert math.isfinite(result[key]) and result[key] > 0
    assert bench.common.hook_census(model).total == 0


def _floor_beside_a_dump(
    bench: types.SimpleNamespace,
    tmp_path: Path,
    keep: Any,
    config: dict[str, Any],
    on_step: Any = None,
    then: Any = None,
    written: Path | None = None,
) -> tuple[Any, Path]:
    """One step of a bench_overhead ``FloorModel`` and one dumped forward of the same model (the
    quick one) with ``config``: the floor and the dump's run dir."""
    import tracedump

    spec = bench.common.QUICK_SPEC
    model, ids = bench.common.build_model(spec), bench.common.make_inputs(spec)
    floor = bench.overhead.FloorModel(model, ids, keep, on_step=on_step, then=then, written=written)
    dumper = tracedump.attach(model, {"dir": str(tmp_path / "dump"), **config})
    assert dumper is not None
    with torch.inference_mode():
        timings = floor.step()
        bench.common.forward(model, ids)
    dumper.close()
    assert ("e2e" in timings) == (then is not None)  # the step until on disk: only where something is written
    if then is not None:
        assert timings["e2e"] > timings["step"]  # the write is timed after the forward, not instead of it
    return floor, dumper.run_dir


def _shapes_and_sums(tensors: Any) -> list[tuple[tuple[int, ...], str, float]]:
    return sorted((tuple(t.shape), str(t.dtype), t.double().sum().item()) for t in tensors)


def test_the_stats_floor_sweeps_what_a_stats_dump_records(
    bench: types.SimpleNamespace, tmp_path: Path
) -> None:
    """bench_overhead's floor of stats mode (FloorModel, sweeping) sweeps the tensors a stats dump
    records: as many, in the same order, with the same sums; else its ratio would not be that
    mode's floor."""
    import json
    import struct

    from tracedump.dump.reduce import compiled_kernel

    kernel = compiled_kernel()
    if kernel is None:
        pytest.skip("the C kernel is not built here: bench_overhead leaves the floor out")
    config = {"mode": "stats", "stats": "sum,min,max"}
    swept, run_dir = _floor_beside_a_dump(bench, tmp_path, bench.overhead.sweeping(kernel), config)
    records = [json.loads(line) for line in (run_dir / "stats.jsonl").read_text().splitlines()]
    as_f32 = struct.Struct("f")
    floor = [(as_f32.unpack(as_f32.pack(s))[0], lo, hi) for s, _, lo, hi in swept.kept]
    assert len(records) > 10
    assert floor == [(r["sum"], r["min"], r["max"]) for r in records]


def test_the_last_row_floor_copies_what_a_last_row_dump_keeps(
    bench: types.SimpleNamespace, tmp_path: Path
) -> None:
    """bench_overhead's floor of last_row mode (FloorModel, cutting) copies the rows a last_row
    dump keeps: as many tensors, the same shapes and values."""
    from tracedump import load_pass

    config = {"mode": "last_row", "token_dim": 1}
    floor, run_dir = _floor_beside_a_dump(bench, tmp_path, bench.overhead.cutting(1), config)
    assert len(floor.kept) > 10
    assert all(t.shape[1] == 1 for t in floor.kept if t.dim() > 1)
    assert _shapes_and_sums(floor.kept) == _shapes_and_sums(
        load_pass(run_dir / "pass00000.safetensors").values()
    )


def test_the_full_floor_copies_and_writes_what_a_full_dump_keeps(
    bench: types.SimpleNamespace, tmp_path: Path
) -> None:
    """bench_overhead's floor of full mode (FloorModel, WrittenCopies) copies every tensor a full
    dump keeps, into the same buffers step after step, and writes them as one file each step: the
    same tensors as the dump's pass file, so its ``e2e`` is that figure's floor until on disk."""
    from safetensors.torch import load_file

    from tracedump import load_pass

    warm = bench.overhead.WrittenCopies(tmp_path / "floor")
    written = warm.path
    files: list[dict[str, torch.Tensor]] = []

    def write_and_read_back() -> None:
        warm.write()
        files.append(load_file(written))

    floor, run_dir = _floor_beside_a_dump(
        bench, tmp_path, warm, {}, on_step=warm.start, then=write_and_read_back
    )
    assert warm.next == len(warm.buffers) > 10 and floor.kept == []
    dumped = _shapes_and_sums(load_pass(run_dir / "pass00000.safetensors").values())
    assert _shapes_and_sums(warm.buffers) == dumped
    assert [_shapes_and_sums(file.values()) for file in files] == [dumped]
    first = [buffer.data_ptr() for buffer in warm.buffers]
    floor.written = warm.directory  # emptied after each step, untimed, as a dump's run dir is
    with torch.inference_mode():
        floor.step()
    assert [buffer.data_ptr() for buffer in warm.buffers] == first  # memory already mapped
    assert [_shapes_and_sums(file.values()) for file in files] == [dumped, dumped]
    assert not written.exists()


def test_the_on_phase_reports_each_floor_beside_its_figure(
    bench: types.SimpleNamespace, tmp_path: Path
) -> None:
    """bench_overhead's on phase (quick) times each mode's floor in its rounds and reports it beside
    the figure it bounds, the full floor until on disk too; the floor's pass files are deleted."""
    import math

    spec = bench.common.QUICK_SPEC
    model, ids = bench.common.build_model(spec), bench.common.make_inputs(spec)
    with torch.inference_mode():
        result = bench.overhead.run_on(model, ids, tmp_path, bench.overhead.settings_for(True), True)
    floors = {
        "full.floor_ratio": result["full"]["floor_ratio"],
        "full.floor_ratio_e2e": result["full"]["floor_ratio_e2e"],
        "last_row.floor_ratio": result["last_row"]["floor_ratio"],
    }
    if bench.overhead.compiled_kernel() is not None:
        floors["stats.floor_ratio"] = result["stats"]["floor_ratio"]
    assert all(math.isfinite(ratio) and ratio > 0 for ratio in floors.values()), floors
    assert list((tmp_path / "floor").iterdir()) == []


def test_hook_census_sees_module_and_global_hooks(bench: types.SimpleNamespace) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    before = bench.common.hook_census(model)
    handle = model[0].register_full_backward_hook(lambda *args: None)
    with pytest.raises(AssertionError, match="_backward_hooks"):
        bench.common.assert_untouched(model, before)
    handle.remove()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *args: None)
    try:
        with pytest.raises(AssertionError, match="_global_forward_hooks"):
            bench.common.assert_untouched(model, before)
    finally:
        handle.remove()
    bench.common.assert_untouched(model, before)


def test_targets_are_judged(bench: types.SimpleNamespace) -> None:
    verdicts = bench.run_all.judge(
        {
            "off": {"forward_ratio": 1.005, "hooks_registered": 0},
            "full": {"speedup_vs_naive": 1.2},
            "memory": {"within_cap": True},
        }
    )
    assert verdicts["off"]["met"] is True
    assert verdicts["full_vs_naive"]["met"] is False
    assert verdicts["stats"]["met"] is None  # not measured: neither met nor missed
    assert verdicts["memory"]["met"] is True


def test_gpu_script_skips_without_cuda(
    bench: types.SimpleNamespace, capsys: pytest.CaptureFixture[str]
) -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: gpu.py would run, not skip")
    assert bench.gpu.main([]) == 0
    assert '"skipped"' in capsys.readouterr().out


def test_the_align_benchmark_counts_only_what_the_align_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its memory figure is the align's own, not the process's (``make bench`` runs every benchmark
    in one process), and it names no divergence in dumps that differ only by rounding."""
    import tempfile

    monkeypatch.syspath_prepend(str(REPO_ROOT))
    from benchmarks import bench_align

    before = set(Path(tempfile.gettempdir()).glob("tracedump-bench-align-*"))
    ballast = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB this process holds before the align
    result = bench_align.run(quick=True)
    assert ballast.sum().item() == 64 << 20
    assert result["exit_code"] == 0 and result["compared"] == 4 * bench_align.SEQUENCES
    assert result["process_peak_anon_bytes"] >= result["peak_anon_bytes"] + (64 << 20)
    assert result["peak_anon_over_sequence_tensor"] == (
        result["peak_anon_bytes"] / result["largest_sequence_tensor_bytes"]
    )
    assert set(Path(tempfile.gettempdir()).glob("tracedump-bench-align-*")) == before


def test_the_engine_floor_from_bytes_is_the_passes_bytes_over_the_bandwidth(
    bench: types.SimpleNamespace, tmp_path: Path
) -> None:
    """bench_vllm's floor beside each engine figure (issue 35): the tensor bytes each pass file
    holds (parts summed, headers left out) / a copy bandwidth, over the untouched step."""
    from benchmarks import bench_vllm
    from tracedump.store.format import pass_file_name
    from tracedump.store.stformat import write_file

    run_dir = tmp_path / "rank0_pid1"
    run_dir.mkdir()
    write_file({"a": torch.zeros(1000, dtype=torch.float32)}, run_dir / pass_file_name(0, 1))
    write_file({"b": torch.zeros(500, dtype=torch.float64)}, run_dir / pass_file_name(0, 2))
    write_file({"d": torch.zeros(250, dtype=torch.float32)}, run_dir / pass_file_name(0, 10))  # after part 2
    for index in (1, 2, 3):
        write_file({"c": torch.zeros(250 * index, dtype=torch.float32)}, run_dir / pass_file_name(index))
    (run_dir / "manifest.json").write_text("{}")
    written = bench_vllm._pass_tensors(tmp_path)  # each pass's parts in their order: 1, 2, 10
    assert bench_vllm._pass_bytes(written) == {0: 9000, 1: 1000, 2: 2000, 3: 3000}
    assert bench_vllm._pass_keys(written) == {0: ["a", "b", "d"], 1: ["c"], 2: ["c"], 3: ["c"]}

    untouched = {"prefill": [0.004, 0.002, 0.003], "decode": [0.001, 0.001, 0.001], "s": [0.01, 0.01]}
    floor = bench_vllm._bytes_floor(
        {0: 8000, 1: 1000, 2: 2000, 3: 3000}, {"memcpy_GBps": 1e-3, "clone_GBps": 0.5e-3}, untouched
    )  # 1e-3 GB/s: a million bytes a second, so a byte costs a microsecond
    assert floor["pass_MB"] == {"prefill": 0.008, "decode": 0.002}
    assert floor["bytes_floor_ratio"] == pytest.approx({"decode": 3.0, "prefill": 1 + 8 / 3, "generate": 2.4})
    assert floor["bytes_floor_fresh_ratio"] == pytest.approx(
        {"decode": 5.0, "prefill": 1 + 16 / 3, "generate": 3.8}
    )
    assert bench_vllm._bytes_floor({1: 1000}, {"memcpy_GBps": 1.0, "clone_GBps": 1.0}, untouched) == {}

    rows = bench.run_all._floor_rows({"vllm": floor, "vllm_wide": {}})
    assert rows == [
        (
            "vllm floor from bytes: decode/prefill/generate, mapped|fresh",
            "3.000/3.667/2.400 | 5.000/6.333/3.800",
            "",
            "",
        )
    ]


def test_the_native_capture_hook_dumps_what_the_python_hooks_dump(
    native: types.ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bench_vllm's ``native`` layer measures tracedump's capture done in C: it is a measure of the
    same work only if it writes the same passes (keys, order, values), a flat tuple with a None
    (attention's ``(out, None)``) and a module called twice included."""
    import tracedump
    from tests.conftest import make_tiny_llama

    class Twice(torch.nn.Module):
        """One child (one name) called twice a forward: its second capture is ``::call1``."""

        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(self.inner(x))

    model = make_tiny_llama()
    model.model.layers[0].mlp.act_fn = Twice(model.model.layers[0].mlp.act_fn)
    monkeypatch.setenv("TRACEDUMP_DUMP_MODULES", "all")
    ids = torch.tensor([[3, 14, 15, 9, 26, 5]])

    def dump(variant: str) -> dict[int, dict[str, torch.Tensor]]:
        monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path / variant))
        dumper = tracedump.attach(model)
        handed_back: list[str] = []  # the native hooks' captures done by the recorder instead
        if variant == "native":
            assert native.swap_in_captures(dumper, model) > 10
            python_path = dumper.recorder.on_module_tensors

            def counted(name: str, value: object, *, is_input: bool) -> None:
                handed_back.append(name)
                python_path(name, value, is_input=is_input)

            monkeypatch.setattr(dumper.recorder, "on_module_tensors", counted)
        with torch.inference_mode():
            model(ids)
            model(ids[:, :3])
        dumper.close()
        assert set(handed_back) <= {"model"}, handed_back  # only HF's ModelOutput: not a flat tuple
        run = tracedump.open_dump(dumper.run_dir).run()
        return {index: pass_file.load() for index, pass_file in run.passes.items()}

    python, in_c = dump("python"), dump("native")
    assert list(python) == list(in_c) == [0, 1]
    for index, stored in python.items():
        assert list(in_c[index]) == list(stored)
        assert "model.layers.0.mlp.act_fn.inner::call1" in stored
        assert "model.layers.0.self_attn[0]" in stored  # (out, None): the tuple path
        for key, tensor in stored.items():
            assert torch.equal(in_c[index][key], tensor), key


def test_the_native_keeper_clones_every_output_tensor(native: types.ModuleType) -> None:
    kept: list[torch.Tensor] = []
    hook = native.keeper(kept)
    out = torch.arange(6.0).reshape(2, 3).t()  # not contiguous: the clone is
    hook(None, (), out)
    hook(None, (), (out, None, 1, out[0]))
    hook(None, (), [out])  # a list: not a hook output the keeper walks
    assert [k.shape for k in kept] == [(3, 2), (3, 2), (2,)]
    assert all(k.is_contiguous() and torch.equal(k, o) for k, o in zip(kept, (out, out, out[0]), strict=True))
    assert kept[0].data_ptr() != out.data_ptr()
    with pytest.raises(TypeError):
        hook(None, out)


def test_the_native_capture_keeps_the_accounts_the_recorder_keeps(
    native: types.ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Beyond the pass files: after each output the C hook leaves the open pass as the recorder's
    own hook does (the calls counted, the bytes and captures it holds, the memory cap consulted),
    and the recorder counts the same skips, for the shapes the plain path takes and for those it
    hands over. The cap (512 KiB) is below the last capture alone, so that capture spills the pass
    whatever the writer has done meanwhile."""
    hooks = native.load()
    import tracedump
    from tracedump.dump.hooks import OutputHook

    outputs = [
        torch.ones(4, 8),
        (torch.ones(2, 3), None),  # a fused op's (out, None)
        (None,),  # nothing to keep: no call counted
        (),
        tuple(torch.full((2,), float(i)) for i in range(16)),  # the last index path, [15]
        torch.ones(4, 8),  # a later call: ::call3
        torch.ones(3, 2).t(),  # not contiguous: copied dense
        torch.ones(3, requires_grad=True),  # the sink's copy, detached
        (torch.ones(2), torch.zeros(2, dtype=torch.complex128)),  # not storable: the recorder's walk
        [torch.ones(2)],  # a list: the recorder's walk
        torch.zeros(160 << 10),  # 640 KiB: the sink's pooled copy, over the cap
    ]
    monkeypatch.setenv("TRACEDUMP_DUMP_MAX_PENDING_BYTES", "512KiB")

    def run(variant: str) -> tuple[list[object], dict[str, int], dict[int, dict[str, torch.Tensor]]]:
        monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path / variant))
        dumper = tracedump.attach(torch.nn.Linear(2, 2))
        recorder = dumper.recorder
        hook = (
            hooks.Capture("m", recorder, dumper.rundir) if variant == "native" else OutputHook(recorder, "m")
        )
        made_room: list[int] = []
        make_room = recorder._make_room

        def spy(current: object) -> None:
            made_room.append(current.nbytes)  # type: ignore[attr-defined]
            make_room(current)

        monkeypatch.setattr(recorder, "_make_room", spy)
        seen: list[object] = []
        with dumper.step():
            current = recorder.current
            for output in outputs:
                hook(None, (), output)
                keys = [(key, copy.requires_grad) for key, copy, _ in current.entries]  # copies detached
                seen.append((dict(current.calls), current.nbytes, current.kept, keys, list(made_room)))
        with pytest.warns(tracedump.TracedumpWarning, match="unsupported_tensor"):
            dumper.close()  # the complex tensor, counted and said
        run_files = tracedump.open_dump(dumper.run_dir).run()
        return seen, dict(recorder.skipped), {i: p.load() for i, p in run_files.passes.items()}

    (python, python_skips, python_passes), (in_c, c_skips, c_passes) = run("python"), run("native")
    assert in_c == python
    assert c_skips == python_skips and python_skips.get("unsupported_tensor") == 1
    elements = 32 + 6 + 16 * 2 + 32 + 6 + 3 + 2 + 2 + (160 << 10)  # the complex tensor is skipped
    assert python[-1][4] == [elements * 4]  # the cap consulted once: the last capture spills
    assert python[3][0] == {"m": 2}  # (None,) and () counted no call
    assert ("m[15]::call2", False) in python[4][3] and ("m::call3", False) in python[5][3]  # [15]; a 4th call
    assert list(c_passes) == list(python_passes) == [0]
    assert list(c_passes[0]) == list(python_passes[0])
    for key, tensor in python_passes[0].items():
        assert torch.equal(c_passes[0][key], tensor), key


def test_a_failure_in_the_native_capture_is_reported_never_raised(
    native: types.ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As the recorder's own hot path: a failure inside the C hook (here the sink's room) goes to
    the recorder's report and the forward goes on."""
    hooks = native.load()
    import tracedump

    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path))
    dumper = tracedump.attach(torch.nn.Linear(2, 2))
    reported: list[tuple[str, BaseException]] = []
    monkeypatch.setattr(dumper.recorder, "report", lambda where, error: reported.append((where, error)))

    def no_room() -> int:
        raise RuntimeError("no room")

    monkeypatch.setattr(dumper.sink, "room", no_room)
    hook = hooks.Capture("m", dumper.recorder, dumper.rundir)
    with dumper.step():
        assert hook(None, (), torch.ones(2)) is None
    dumper.close()
    assert [(where, str(error)) for where, error in reported] == [("m", "no room")]


def test_without_a_c_compiler_the_native_layers_are_left_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Where no C compiler is found, or the build fails, ``load()`` says why and gives None (and
    leaves no build directory behind): bench_vllm then runs its other layers only."""
    monkeypatch.syspath_prepend(str(REPO_ROOT))
    import shutil
    import tempfile

    from benchmarks import native

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(native, "_compiler", lambda: None)
    native.load.cache_clear()
    try:
        assert native.load() is None
        assert "no C compiler" in capsys.readouterr().err
        monkeypatch.setattr(native, "_compiler", lambda: [shutil.which("false") or "false"])
        native.load.cache_clear()
        assert native.load() is None
        assert "the build failed" in capsys.readouterr().err
        assert list(tmp_path.iterdir()) == []
    finally:
        native.load.cache_clear()
