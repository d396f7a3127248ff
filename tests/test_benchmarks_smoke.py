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

    from tracedump.store.reduce import compiled_kernel

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
    """bench_vllm's floor beside each engine figure: the tensor bytes each pass file
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
