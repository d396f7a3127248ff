"""The comparator's arithmetic, checked against plain float64 torch formulas, and its rules.

Metrics (on both arithmetic paths: the C kernel and numpy): rel_diff, cosine, max_abs and its
location, NaN/Inf handling, exact bf16 widening, chunk boundaries; tolerances by dtype; option
parsing; the "largest growth" finding; stats dtype guesses.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from tracedump.compare.judge.tolerance import REL_DIFF_DEFAULTS, Tolerance, less_precise, resolve
from tracedump.compare.judge.verdict import GROWTH_FLOOR, conclude, largest_growth
from tracedump.compare.load.reader import stored_from_torch
from tracedump.compare.measure import metrics
from tracedump.compare.measure.metrics import CHUNK, compare_arrays
from tracedump.compare.measure.stats import compare_stats, infer_dtype
from tracedump.compare.options import NameMap, UnshardRule, parse_passes
from tracedump.compare.pair.plan import Plan
from tracedump.compare.results import DiffReport, TensorResult
from tracedump.errors import ExitCode, UsageError


@pytest.fixture(autouse=True, params=["kernel", "numpy"])
def arithmetic(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test here twice: with the C kernel's one-pass sums, and with the numpy path that runs
    where the kernel was not built (test_compare_kernel.py checks that it was, given a compiler)."""
    if request.param == "numpy":
        monkeypatch.setattr(metrics, "kernel", None)
    elif metrics.kernel is None:
        pytest.skip("the C kernel was not built here")
    return str(request.param)


def reference(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    """The textbook formulas in float64 (on finite tensors)."""
    x, y = a.double().flatten(), b.double().flatten()
    d = x - y
    return {
        "rel_diff": float(1 - 2 * (x * y).sum() / (x * x + y * y).sum()),
        "rel_diff_direct": float((d * d).sum() / (x * x + y * y).sum()),
        "cosine": float((x * y).sum() / (x.norm() * y.norm())),
        "max_abs": float(d.abs().max()),
        "mean_abs": float(d.abs().mean()),
        "argmax": int(d.abs().argmax()),
        "sqnr_db": float(10 * torch.log10((y * y).sum() / (d * d).sum())),
    }


def metrics_of(a: torch.Tensor, b: torch.Tensor):  # type: ignore[no-untyped-def]
    return compare_arrays(stored_from_torch(a), stored_from_torch(b), want_max_b=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_metrics_match_float64_formulas(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(3, 1000, generator=generator)
    b = (a + 1e-2 * torch.randn(3, 1000, generator=generator)).to(dtype)
    a = a.to(dtype)
    m, ref = metrics_of(a, b), reference(a, b)
    assert m.rel_diff == pytest.approx(ref["rel_diff"], rel=1e-4)
    assert m.cosine == pytest.approx(ref["cosine"], rel=1e-9)
    assert m.max_abs == ref["max_abs"] and m.argmax == ref["argmax"]
    assert m.mean_abs == pytest.approx(ref["mean_abs"], rel=1e-5)
    assert m.sqnr_db == pytest.approx(ref["sqnr_db"], rel=1e-4)
    assert m.a_at_argmax == float(a.flatten()[ref["argmax"]]) and m.b_at_argmax == float(
        b.flatten()[ref["argmax"]]
    )
    assert m.max_abs_b == float(b.double().abs().max())


def test_tiny_errors_keep_their_digits() -> None:
    """1e-12-level differences are exactly where 1 - 2Σxy/Σ(x²+y²) would cancel to noise."""
    generator = torch.Generator().manual_seed(1)
    a = torch.randn(100_000, generator=generator, dtype=torch.float64)
    b = a * (1 + 1e-7 * torch.randn(100_000, generator=generator, dtype=torch.float64))
    m, ref = metrics_of(a, b), reference(a, b)
    assert m.rel_diff == pytest.approx(ref["rel_diff_direct"], rel=1e-6)
    assert 4e-15 < m.rel_diff < 6e-15
    assert m.one_minus_cosine == pytest.approx(m.rel_diff, rel=0.05)  # unbiased noise: 1-cos ≈ rel_diff


def test_identical_and_zero_tensors() -> None:
    a = torch.randn(50)
    same = metrics_of(a, a.clone())
    assert (same.rel_diff, same.max_abs, same.cosine, same.sqnr_db) == (0.0, 0.0, 1.0, math.inf)
    zeros = metrics_of(torch.zeros(10), torch.zeros(10))
    assert (zeros.rel_diff, zeros.cosine) == (0.0, 1.0)
    one_sided = metrics_of(torch.zeros(10), torch.ones(10))
    assert one_sided.rel_diff == 1.0 and one_sided.cosine == 0.0 and one_sided.sqnr_db == 0.0


def test_a_scale_error_moves_rel_diff_but_not_cosine() -> None:
    a = torch.randn(1000, generator=torch.Generator().manual_seed(2))
    m = metrics_of(a * 1.01, a)
    assert m.rel_diff == pytest.approx(0.01**2 / (1 + 1.01**2), rel=1e-3)
    assert m.one_minus_cosine < 1e-6 * m.rel_diff  # zero, up to fp32 rounding of the error terms


@pytest.fixture
def use_threads() -> Iterator[Callable[[int], None]]:
    """``use_threads(n)``: the diff splits large tensors over ``n`` threads, as on a machine with
    ``n`` usable CPUs (a fresh worker pool of that size); the default again after the test."""
    yield metrics.set_workers
    metrics.set_workers(None)


@pytest.mark.parametrize("count", [0, -1, 1.5, True, "4"])
def test_set_workers_takes_a_positive_count_or_none(count: object) -> None:
    with pytest.raises(ValueError, match="set_workers"):
        metrics.set_workers(count)  # type: ignore[arg-type]


def test_chunks_do_not_change_the_answer() -> None:
    """A tensor over several chunks, with its largest error in the last chunk."""
    generator = torch.Generator().manual_seed(3)
    n = 2 * CHUNK + 123
    a = torch.randn(n, generator=generator)
    b = a + 1e-4 * torch.randn(n, generator=generator)
    b[-5] += 1.0
    m, ref = metrics_of(a, b), reference(a, b)
    assert m.argmax == n - 5 == ref["argmax"]
    assert m.rel_diff == pytest.approx(ref["rel_diff_direct"], rel=1e-5)
    assert m.numel == n


@pytest.mark.parametrize("nan", [False, True])  # the winning chunk on the fast or the careful path
@pytest.mark.parametrize("extra", [0, 123])  # Σ|d| by rows of ones, and the ragged last chunk
def test_split_across_threads_the_largest_error_is_found_where_it_is(
    use_threads: Callable[[int], None], extra: int, nan: bool
) -> None:
    """Chunks claimed by four threads (the calling thread is one); the largest error is tied by an
    element three chunks later: the first wins, whichever thread took either chunk."""
    use_threads(4)
    generator = torch.Generator().manual_seed(5)
    n = 10 * CHUNK + extra
    a = torch.randn(n, generator=generator)
    b = a + 1e-4 * torch.randn(n, generator=generator)
    where, tie = 4 * CHUNK + 11, 7 * CHUNK + 5
    a[where], b[where] = 0.0, 3.0
    a[tie], b[tie] = 1.0, 4.0  # the same |d|, exactly
    if nan:
        a[where - 1] = float("nan")  # the chunk takes the careful float64 path
    m = metrics_of(a, b)
    finite = ~a.isnan()
    ref = reference(a[finite], b[finite])
    assert m.argmax == where and m.max_abs == ref["max_abs"] == 3.0
    assert (m.a_at_argmax, m.b_at_argmax) == (0.0, 3.0)
    assert m.mean_abs == pytest.approx(ref["mean_abs"], rel=1e-5)
    assert m.rel_diff == pytest.approx(ref["rel_diff_direct"], rel=1e-5)
    assert m.nan_a == int(nan) and m.numel == n


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        ((10 * CHUNK + 123,), torch.float32),
        ((10 * CHUNK + 123,), torch.float64),  # float64 chunk sums: their order shows in the total
        ((2400, 1100), torch.float32),  # rows kept
    ],
)
def test_threads_do_not_change_a_single_bit(
    use_threads: Callable[[int], None], shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    """Which thread claims which chunk is chance; the figures must not be: each chunk's sums are
    added in chunk order, so one thread and four give equal floats, not close ones."""
    generator = torch.Generator().manual_seed(11)
    a = torch.randn(shape, generator=generator, dtype=dtype)
    b = (
        a
        + 1e-3
        * torch.randn(shape, generator=generator, dtype=dtype)
        * torch.rand(shape, generator=generator, dtype=dtype)
        * 100
    )
    sa, sb = stored_from_torch(a), stored_from_torch(b)
    results = []
    for cpus in (1, 4, 4):
        use_threads(cpus)
        m, rows = metrics.compare_by_row(sa, sb)
        results.append((m, None if rows is None else (rows.dd.tolist(), rows.norm.tolist())))
    assert results[0] == results[1] == results[2]
    assert (results[0][1] is None) == (len(shape) == 1)


def test_merge_keeps_the_lowest_index_among_equal_maxima() -> None:
    """Two threads' parts, the one holding the later position merged first."""
    later, earlier = metrics._Sums(), metrics._Sums()
    for part, index, count in ((later, 900, 3), (earlier, 40, 5)):
        part.max_abs, part.argmax, part.a_at, part.b_at, part.count = 2.0, index, 0.0, 2.0, count
    merged = metrics._merge([later, earlier])
    assert (merged.max_abs, merged.argmax, merged.count) == (2.0, 40, 8)
    merged = metrics._merge([earlier, later])
    assert merged.argmax == 40


@pytest.mark.parametrize("failing", ["calling thread", "worker"])
def test_an_error_in_any_thread_stops_every_thread_claiming(
    monkeypatch: pytest.MonkeyPatch, use_threads: Callable[[int], None], failing: str
) -> None:
    """The other threads finish the chunk they hold and claim no other: an error (or Ctrl-C) must
    not leave them reading the rest of a large tensor after the comparison has failed, and the
    error reaches the caller."""
    use_threads(4)
    stopped = threading.Event()
    calls: list[str] = []
    lock = threading.Lock()
    real = metrics._fast_chunk

    class Claims(metrics._Claims):
        def stop(self) -> None:
            super().stop()
            stopped.set()

    def fast_chunk(*args: object) -> object:
        main = threading.current_thread() is threading.main_thread()
        with lock:
            fails = main if failing == "calling thread" else not main and "failed" not in calls
            calls.append("failed" if fails else threading.current_thread().name)
        if fails:
            raise RuntimeError("planted")
        stopped.wait(120)  # hold each thread in its chunk until the claims are stopped (no race)
        return real(*args)

    monkeypatch.setattr(metrics, "_Claims", Claims)
    monkeypatch.setattr(metrics, "_fast_chunk", fast_chunk)
    n = 64 * CHUNK
    sa, sb = (stored_from_torch(torch.zeros(n)) for _ in range(2))
    with pytest.raises(RuntimeError, match="planted"):
        compare_arrays(sa, sb)
    assert stopped.is_set()
    assert calls.count("failed") == 1
    assert len(calls) <= 4  # the failed chunk, and at most one held by each other thread, of 64


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        ((1, 40, 3000), torch.float32),  # one chunk, the careful path (it holds the NaN)
        ((3, 700, 1024), torch.bfloat16),  # split over threads
        ((2, 1200, 1100), torch.float32),  # rows that do not divide CHUNK: chunks of whole rows
        ((300, 1024), torch.float32),
    ],
)
def test_per_token_error_comes_from_the_metrics_own_pass(
    use_threads: Callable[[int], None], shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    """Row sums kept by the chunk loop (split over threads for the 2M-element case, a NaN row on
    the careful path) give the per-token figures and metrics a separate pass would."""
    use_threads(4)
    generator = torch.Generator().manual_seed(7)
    a = torch.randn(shape, generator=generator)
    b = (a + 1e-3 * torch.randn(shape, generator=generator)).to(dtype)
    a = a.to(dtype)
    a.view(-1)[5 * shape[-1] + 3] = float("nan")
    sa, sb = stored_from_torch(a), stored_from_torch(b)
    m, rows = metrics.compare_by_row(sa, sb)
    assert rows is not None
    x, y = a.double().reshape(-1, shape[-1]), b.double().reshape(-1, shape[-1])
    both = x.isfinite() & y.isfinite()
    xz, yz = torch.where(both, x, 0.0), torch.where(both, y, 0.0)
    assert np.allclose(rows.dd, ((xz - yz) ** 2).sum(1).numpy(), rtol=1e-5, atol=0)
    assert np.allclose(rows.norm, (xz**2 + yz**2).sum(1).numpy(), rtol=1e-5, atol=0)
    whole = compare_arrays(sa, sb)
    assert (m.argmax, m.max_abs, m.nan_a) == (whole.argmax, whole.max_abs, 1)
    assert m.rel_diff == pytest.approx(whole.rel_diff, rel=1e-5)  # fp32 sums in another order
    assert m.mean_abs == pytest.approx(whole.mean_abs, rel=1e-6)
    dim = len(shape) - 2
    expected = metrics.per_token_rel_diff(sa, sb, dim)
    assert metrics.per_token_rel_diff(sa, sb, dim, rows) == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("row", [CHUNK + 8, 1])
def test_rows_too_long_or_too_short_for_the_metrics_pass_are_measured_apart(tmp_path: Path, row: int) -> None:
    """Rows longer than a chunk, or too short to pay for a product per chunk (``[tokens, 1]``):
    no row sums from the metrics' pass, and the per-token figures still come, from their own pass."""
    from tracedump.compare import compare
    from tracedump.dump.writer import save_tensors_atomic
    from tracedump.store.format import pass_file_name

    tokens = 3 if row > 1 else 5000
    a = torch.randn(tokens, row, generator=torch.Generator().manual_seed(1))
    b = a.clone()
    b[-1] += 0.5  # only the last token is off
    m, rows = metrics.compare_by_row(stored_from_torch(b), stored_from_torch(a))
    assert rows is None and m.max_abs == pytest.approx(0.5)
    for side, tensor in (("a", b), ("b", a)):
        run_dir = tmp_path / side / "rank0_pid1"
        run_dir.mkdir(parents=True)
        save_tensors_atomic(run_dir / pass_file_name(0), {"x": tensor}, {"tracedump.mode": "full"})
        (run_dir / "manifest.json").write_text(
            '{"rank": 0, "pid": 1, "root": "T", "settings": {"mode": "full"}}'
        )
    (result,) = compare(tmp_path / "a", tmp_path / "b").results
    assert result.token_dim == 0 and result.per_token is not None and len(result.per_token) == tokens
    assert all(v == 0 for v in result.per_token[:-1]) and result.per_token[-1] > 0


def test_nan_and_inf_are_counted_and_only_mismatches_diverge() -> None:
    a = torch.randn(100)
    b = a.clone()
    a[3] = b[3] = float("nan")  # NaN on both sides: agreed
    a[5] = b[5] = float("inf")  # same Inf on both sides: agreed
    b[7] = float("nan")  # NaN on one side only: a mismatch
    a[9] = float("-inf")  # -Inf against a number: a mismatch
    m = metrics_of(a, b)
    assert (m.nan_a, m.nan_b, m.inf_a, m.inf_b) == (1, 2, 2, 1)
    assert m.nonfinite_mismatch == 2
    assert m.max_abs == 0.0 and m.rel_diff == 0.0  # finite positions agree exactly


def test_values_too_small_for_fp32_squares_are_redone_in_float64() -> None:
    a = torch.randn(1000, generator=torch.Generator().manual_seed(4)) * 1e-22
    m = metrics_of(a * (1 + 1e-3), a)
    assert m.rel_diff == pytest.approx(1e-6 / (1 + 1.001**2), rel=1e-3)


def test_huge_values_do_not_overflow() -> None:
    a = torch.full((10,), 3e30)
    m = metrics_of(a * (1 + 1e-6), a)
    assert math.isfinite(m.rel_diff) and m.rel_diff == pytest.approx(1e-12 / 2, rel=1e-2)
    assert m.nonfinite_mismatch == 0


def test_integers_compare_exactly() -> None:
    a = torch.arange(20)
    b = a.clone()
    b[11] = 99
    m = metrics_of(a, b)
    assert m.max_abs == 88 and m.argmax == 11
    tolerance = resolve("rel_diff", "int64", "int64", rtol=0.5, atol=100)
    assert tolerance.metric == "exact" and tolerance.rtol == 0 and tolerance.atol == 0


def test_bf16_widening_is_exact() -> None:
    a = torch.randn(1000).bfloat16()
    same = compare_arrays(stored_from_torch(a), stored_from_torch(a.float()))
    assert same.max_abs == 0 and same.rel_diff == 0


def test_fp8_tensors_compare_after_widening() -> None:
    a = torch.randn(256, generator=torch.Generator().manual_seed(5))
    m = compare_arrays(stored_from_torch(a.to(torch.float8_e4m3fn)), stored_from_torch(a))
    assert 1e-4 < m.rel_diff < 1e-3  # one e4m3 rounding: ~3.5e-4


# ------------------------------------------------------------------------------------------ tolerances


def test_the_less_precise_dtype_sets_the_default() -> None:
    assert less_precise("bfloat16", "float32") == "bfloat16"
    assert less_precise("float64", "float16") == "float16"
    assert less_precise("int64", "float32") == "float32"
    assert less_precise(None, "float32") == "float32"  # a stats record without dtype trusts the other side
    assert resolve("rel_diff", "bfloat16", "float32", None, None) == Tolerance(
        metric="rel_diff", rtol=1e-2, atol=0.0, source="bfloat16 default", precision="bfloat16"
    )
    assert resolve("rel_diff", "float32", "float32", None, None).rtol == REL_DIFF_DEFAULTS["float32"] == 1e-8


def test_user_tolerances_override_each_default_separately() -> None:
    assert resolve("rel_diff", "bfloat16", "float32", 1e-6, None).rtol == 1e-6
    only_atol = resolve("max_abs", "float32", "float32", None, 0.5)
    assert (only_atol.rtol, only_atol.atol) == (1.3e-6, 0.5)
    assert only_atol.source == "--atol, float32 default rtol"


def test_defaults_are_ordered_by_precision() -> None:
    order = ["float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"]
    values = [REL_DIFF_DEFAULTS[d] for d in order]
    assert values == sorted(values)


# ------------------------------------------------------------------------------------------ options


def test_map_rules_split_at_the_last_equals_sign() -> None:
    rule = NameMap.parse(r"^model\.layers\.(\d+)\.self_attn=transformer.h.\1.attn")
    assert rule.apply("model.layers.12.self_attn.q_proj") == "transformer.h.12.attn.q_proj"
    lookahead = NameMap.parse(r"layers(?=\.\d)=h")
    assert lookahead.apply("model.layers.3.mlp") == "model.h.3.mlp"
    with pytest.raises(UsageError, match="expected 'PATTERN=VALUE'"):
        NameMap.parse("no_equals_sign")


def test_unshard_rules_parse_cat_and_sum() -> None:
    cat = UnshardRule.parse(r"q_proj|k_proj=cat:-1")
    assert (cat.op, cat.dim, cat.matches("model.layers.0.self_attn.k_proj")) == ("cat", -1, True)
    assert UnshardRule.parse("down_proj=SUM").op == "sum"
    with pytest.raises(UsageError):
        UnshardRule.parse("x=cat")
    with pytest.raises(UsageError, match="invalid regex"):
        UnshardRule.parse("(x=sum")


def test_pass_selection_accepts_lists_and_ranges() -> None:
    assert parse_passes("3").as_json() == [3]
    assert parse_passes("0,2,5-7").as_json() == [0, 2, 5, 6, 7]
    assert str(parse_passes("5-7,0,6,2")) == "0,2,5-7"  # merged ranges, never expanded
    assert parse_passes(None) is None
    with pytest.raises(UsageError):
        parse_passes("x")


# ------------------------------------------------------------------------------------------ findings


def _result(index: int, error: float | None, pass_index: int = 0) -> TensorResult:
    tolerance = Tolerance(metric="rel_diff", rtol=1e-2, atol=0.0, source="bfloat16 default")
    return TensorResult(
        index=index,
        pass_index=pass_index,
        root=None,
        name=f"t{index}",
        name_b=f"t{index}",
        kind="tensor",
        shape_a=(4,),
        shape_b=(4,),
        dtype_a="bfloat16",
        dtype_b="float32",
        status="ok",
        tolerance=tolerance,
        metric="rel_diff",
        error=error,
        threshold=1e-2,
    )


def test_growth_is_the_first_tenfold_jump_over_the_running_max() -> None:
    errors = [1e-6, 3e-6, 2e-6, 2.5e-5, 4e-5, 9e-4]
    growth = largest_growth([_result(i, e) for i, e in enumerate(errors)])
    assert growth is not None and growth.result.index == 5  # 2.5e-5 is 8.3x of 3e-6: not a jump
    assert growth.previous_max == 4e-5 and growth.ratio == pytest.approx(22.5)


def test_growth_ignores_rounding_dust_and_restarts_each_pass() -> None:
    dust = [_result(0, 0.0), _result(1, 1e-14), _result(2, 5e-6)]
    assert largest_growth(dust) is None  # below the floor nothing sets the running max
    assert GROWTH_FLOOR == 1e-12
    passes = [_result(0, 1e-3, 0), _result(1, 1e-6, 1), _result(2, 2e-6, 1)]
    assert largest_growth(passes) is None  # pass 1 starts over; 1e-6 -> 2e-6 is no jump


def test_the_findings_are_the_verdicts_and_a_report_is_read_only_once_concluded() -> None:
    results = [replace(_result(0, 1e-6), status="ok"), replace(_result(1, 5e-2), status="diverged")]
    plan = Plan(units=(), pairs=(), only_in_a=(), only_in_b=(), passes_only_in_a=(), passes_only_in_b=())
    report = DiffReport(a={"path": "a"}, b={"path": "b"}, settings={}, plan=plan, results=results)
    with pytest.raises(RuntimeError, match="conclude"):
        _ = report.exit_code
    findings = conclude(report)
    assert report.first_divergence is results[1] and report.exit_code == ExitCode.DIVERGED
    assert findings.largest_growth is not None and findings.first_in_time is None
    report.inputs_differ = [{"sequence": 0}]
    conclude(report)  # inputs that differ: no module is to blame, and the diff still fails
    assert report.first_divergence is None and report.exit_code == ExitCode.DIVERGED


# ------------------------------------------------------------------------------------------ stats


def test_stats_dtype_is_guessed_from_element_values() -> None:
    values = torch.randn(100, generator=torch.Generator().manual_seed(6))
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        tensor = values.to(dtype)
        record = {"max": float(tensor.max()), "min": float(tensor.min())}
        assert infer_dtype(record) == str(dtype).removeprefix("torch.")
    assert infer_dtype({"abs_mean": 0.3}) is None
    assert infer_dtype({"dtype": "float16", "max": 0.1}) == "float16"


def test_stats_dtype_test_is_torchs_own_round_trip_without_torch() -> None:
    """The numpy exactness test behind the guess agrees with torch's float64 -> dtype -> float64
    round trip at the edges: subnormals, the largest finite values, overflow, halfway cases."""
    from tracedump.compare.measure.stats import _representable

    edges = [0.0, -0.0, 1.0, 1 + 2**-7, 1 + 2**-8, 1 + 2**-10, 1 + 2**-11, 1 + 2**-23, 1 + 2**-24, 0.1]
    edges += [2.0**-133, 2.0**-149, 2.0**-150, 2.0**-24, 2.0**-25, 65504.0, 65520.0, 3.3895313892515355e38]
    edges += [3.4028234663852886e38, 3.5e38, 1e300, 5e-324]
    values = [sign * v for v in edges for sign in (1, -1)]
    values += torch.randn(200, generator=torch.Generator().manual_seed(9)).double().mul(1e3).tolist()
    for name in ("bfloat16", "float16", "float32"):
        dtype = getattr(torch, name)
        for v in values:
            expected = float(torch.tensor(v, dtype=torch.float64).to(dtype).double()) == v
            assert _representable(v, name) == expected, (name, v)


def test_an_fp8_dtype_this_torch_lacks_is_an_error_not_bytes_as_numbers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A dump from a newer torch may hold an fp8 dtype this one does not have: its bytes are no
    numbers here, and comparing them as such would report a bogus error."""
    from tracedump.compare.load.reader import Stored

    monkeypatch.delattr(torch, "float8_e5m2")
    raw = np.arange(16, dtype=np.uint8)
    with pytest.raises(ValueError, match="no float8_e5m2"):
        compare_arrays(Stored(raw, "float8_e5m2"), Stored(raw, "float8_e5m2"))


def test_stats_of_centred_tensors_are_judged_against_their_magnitude() -> None:
    """A sum of ±values is near zero; its error is measured against abs_mean * numel, not the sum."""
    error, deltas = compare_stats(
        {"sum": 1e-3, "abs_mean": 0.8}, {"sum": -2e-3, "abs_mean": 0.8}, numel=1000, atol=0.0
    )
    assert deltas["sum"].rel_err == pytest.approx(3e-3 / 800)
    assert error == deltas["sum"].rel_err
    _, counts = compare_stats({"nan_count": 1.0}, {"nan_count": 0.0}, None, 0.0)
    assert counts["nan_count"].rel_err == math.inf


def test_numpy_storage_of_bf16_keeps_the_bits() -> None:
    tensor = torch.tensor([1.5, -2.0, 3.140625], dtype=torch.bfloat16)
    stored = stored_from_torch(tensor)
    assert stored.dtype == "bfloat16" and stored.array.dtype == np.uint16
    assert torch.equal(stored.to_torch(), tensor)
    assert re.fullmatch(r"bfloat16", stored.dtype)


@pytest.mark.parametrize("row", [CHUNK + 8, 1024])  # the separate pass, and the metrics' own
def test_per_token_sums_beyond_float32_range_are_redone_in_float64(row: int) -> None:
    """Values ~1e20: their squares overflow float32, so those rows are summed again in float64
    (the separate pass once stored those sums back in float32: NaN per token)."""
    a = torch.full((3, row), 1e20)
    b = a * (1 + 1e-3)
    sa, sb = stored_from_torch(a), stored_from_torch(b)
    _, rows = metrics.compare_by_row(sa, sb)
    expected = (1e-3) ** 2 / (1 + (1 + 1e-3) ** 2)
    assert metrics.per_token_rel_diff(sa, sb, 0, rows) == pytest.approx((expected,) * 3, rel=1e-3)
