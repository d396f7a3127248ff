"""Smoke test of the benchmarks: they import, and the off benchmark runs and asserts no hooks.

Runs the off phase on the plain-torch mini model (no transformers import) with a few rounds, so it
stays well under ten seconds; it checks the report's shape, never a timing.
"""

from __future__ import annotations

import math
import types
from pathlib import Path

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
