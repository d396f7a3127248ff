"""Stats in one sweep: each reduction once, the same numbers as numpy in float64."""

from __future__ import annotations

import math
import types
import warnings

import numpy as np
import pytest
import torch

from tracedump.store.reduce import NUMERIC_STATS, compute_stats

_SETS = [
    ["abs_mean", "sum", "max", "shape"],  # the default
    list(NUMERIC_STATS),
    ["min", "max"],
    ["mean", "sum", "dtype"],
    ["nan_count", "max", "inf_count"],
    ["shape"],
]


def _numpy(x: np.ndarray, name: str) -> float:
    with np.errstate(all="ignore"):
        if name == "nan_count":
            return float(np.isnan(x).sum())
        if name == "inf_count":
            return float(np.isinf(x).sum())
        if not x.size:
            return 0.0 if name in ("sum", "l2") else math.nan
        values = {
            "abs_mean": lambda: np.abs(x).mean(),
            "sum": x.sum,
            "min": x.min,
            "max": x.max,
            "mean": x.mean,
            "std": x.std,
            "l2": lambda: np.linalg.norm(x.ravel()),
        }
        return float(values[name]())


@pytest.mark.parametrize("names", _SETS)
@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(5, 7, generator=torch.Generator().manual_seed(1)),
        torch.randn(3, 64, generator=torch.Generator().manual_seed(2)).bfloat16(),
        torch.randn(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3)),
        torch.arange(-6, 18).reshape(4, 6),
        torch.tensor([1.0, float("nan"), float("inf"), -2.0]),
        torch.zeros(0, 3),
        torch.randn(6, 8)[:, ::2],  # not contiguous
    ],
    ids=["fp32", "bf16", "fp64", "int64", "nan_inf", "empty", "strided"],
)
def test_every_statistic_matches_numpy(tensor: torch.Tensor, names: list[str]) -> None:
    numeric, values, extras = compute_stats(tensor, names)

    assert numeric == [n for n in names if n in NUMERIC_STATS]
    assert values.dtype == torch.float64 and values.shape == (len(numeric),)
    reference = tensor.double().numpy()
    for name, value in zip(numeric, values.tolist(), strict=True):
        expected = _numpy(reference, name)
        if math.isnan(expected):
            assert math.isnan(value), name
        else:
            assert value == pytest.approx(expected, rel=1e-6, abs=1e-6), name
    assert extras.get("shape", list(tensor.shape)) == list(tensor.shape)


def test_counts_stay_exact_beside_float_statistics() -> None:
    nans = torch.full(((1 << 24) + 1,), float("nan"))  # 2**24 + 1 is no float32: rounding would show
    _, values, _ = compute_stats(nans, ["nan_count", "sum"])
    assert values[0].item() == (1 << 24) + 1


def test_the_source_tensor_is_left_untouched() -> None:
    x = torch.randn(4, 5)
    before = x.clone()
    compute_stats(x, list(NUMERIC_STATS))
    assert torch.equal(x, before)


def test_an_empty_tensor_warns_nothing_into_the_host_log() -> None:
    """An engine step with no tokens gives empty activations: every statistic is NaN or 0, and no
    torch UserWarning (std's "degrees of freedom") reaches the host's log."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, values, _ = compute_stats(torch.zeros(0, 8), list(NUMERIC_STATS))
    by_name = dict(zip(NUMERIC_STATS, values.tolist(), strict=True))
    assert math.isnan(by_name["std"]) and math.isnan(by_name["min"])
    assert by_name["nan_count"] == 0 and by_name["sum"] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_abs_sum_on_an_accelerator_is_one_fused_reduction(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    """Off the CPU, Σ|x| (``abs_mean``'s sum) is ``vector_norm(x, 1)`` in the accumulator dtype: |x|
    is never written out. Checked on a ``meta`` tensor (any non-CPU device takes that path) with a
    spy, and the fused kernel's value, run on the CPU, against the one the CPU path gives."""
    calls: list[tuple[torch.device, torch.dtype, torch.dtype | None]] = []
    real = torch.linalg.vector_norm

    def spy(x: torch.Tensor, ord: float = 2, *args: object, dtype: torch.dtype | None = None) -> torch.Tensor:
        calls.append((x.device, x.dtype, dtype))
        return real(x, ord, *args, dtype=dtype)

    monkeypatch.setattr(torch.linalg, "vector_norm", spy)
    _, out, _ = compute_stats(torch.empty(64, 32, dtype=dtype, device="meta"), ["abs_mean"])
    accumulator = torch.float64 if dtype == torch.float64 else torch.float32
    assert calls == [(torch.device("meta"), dtype, accumulator)]
    assert out.device.type == "meta" and out.dtype == torch.float64 and out.shape == (1,)
    x = torch.randn(256, 1376, generator=torch.Generator().manual_seed(4)).to(dtype)
    _, mean_on_cpu, _ = compute_stats(x, ["abs_mean"])
    on_cpu = mean_on_cpu.item() * x.numel()
    assert len(calls) == 1  # the CPU path makes |x| and sums it
    fused = real(x, 1, dtype=accumulator)
    assert fused.item() == pytest.approx(on_cpu, rel=1e-5)
    assert on_cpu == pytest.approx(x.double().abs().sum().item(), rel=1e-5)


# ------------------------------------------------------------------ the one-pass C sweep on the CPU

_DEFAULT = ["abs_mean", "sum", "max", "shape"]


def _torch_stats(x: torch.Tensor, names: list[str]) -> list[float]:
    """What torch's own kernels give: the path taken without the kernel (or for a NaN or Inf)."""
    from tracedump.store import reduce

    with reduce.use_kernel(False):
        return compute_stats(x, names)[1].tolist()


@pytest.mark.parametrize("names", [_DEFAULT, ["min", "max", "mean"], ["sum"]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_stats_come_from_one_sweep_with_the_numbers_torch_gives(
    names: list[str], dtype: torch.dtype
) -> None:
    """Sums, min and max of a CPU tensor from one pass of C (bf16 widened first): min and max
    exactly torch's, the sums torch's float32 sums to float32 rounding, every value numpy's."""
    from tracedump.store import reduce

    kernel = reduce.compiled_kernel()
    if kernel is None:
        pytest.skip("the C kernel was not built here: torch computes the stats (checked above)")
    calls: list[int] = []
    real = kernel.stats
    spy = types.SimpleNamespace(stats=lambda a: calls.append(a.size) or real(a))
    x = (torch.randn(257, 1001, generator=torch.Generator().manual_seed(6)) * 3 + 0.5).to(dtype)
    with reduce.use_kernel(spy):
        numeric, values, _ = compute_stats(x, names)
    assert calls == [x.numel()]  # one sweep, over the whole tensor
    expected = _torch_stats(x, names)
    reference = x.double().numpy()
    for name, value, torch_value in zip(numeric, values.tolist(), expected, strict=True):
        if name in ("min", "max"):
            assert value == torch_value, name  # exact
        else:
            assert value == pytest.approx(torch_value, rel=2e-6), name
            assert value == pytest.approx(_numpy(reference, name), rel=1e-6), name
            if name == "sum":  # rounded to float32, as torch's float32 sum returns it
                assert value == float(torch.tensor(value, dtype=torch.float32))


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), -float("inf")])
def test_a_nan_or_inf_gets_torch_s_answer_not_the_sweep_s(poison: float) -> None:
    x = torch.randn(100, 50, generator=torch.Generator().manual_seed(7))
    x[37, 11] = poison
    _, values, _ = compute_stats(x, ["min", "max", "sum", "abs_mean"])
    expected = _torch_stats(x, ["min", "max", "sum", "abs_mean"])
    assert [str(v) for v in values.tolist()] == [str(v) for v in expected]  # NaN is NaN, inf is inf


def test_stats_the_sweep_cannot_give_still_come_from_torch() -> None:
    from tracedump.store import reduce

    refuse = types.SimpleNamespace(
        stats=lambda a: pytest.fail("std, l2, counts and float64 take torch's path")
    )
    with reduce.use_kernel(refuse):
        compute_stats(torch.randn(64, 64), ["std", "sum"])
        compute_stats(torch.randn(64, 64, dtype=torch.float64), _DEFAULT)
        compute_stats(torch.randn(64, 64)[:, ::2], _DEFAULT)  # not contiguous


@pytest.mark.parametrize("names", [_DEFAULT, ["min", "max", "mean"], ["sum", "abs_mean"]])
def test_the_sweep_s_numbers_are_the_bits_torch_s_ops_made_of_them(names: list[str]) -> None:
    """The sweep's sums are rounded, widened and scaled in Python floats: the same IEEE steps as
    ``torch.tensor(values, float32)[picks].to(float64) * scale``, which they replaced."""
    from tracedump.store import reduce

    kernel = reduce.compiled_kernel()
    if kernel is None:
        pytest.skip("the C kernel was not built here")
    recipe = reduce._recipe(tuple(n for n in names if n in reduce._STAT_OF))
    assert recipe.sweep is not None
    for seed in range(5):
        x = torch.randn(97, 131, generator=torch.Generator().manual_seed(seed)) * 10 ** (seed - 2)
        raw = kernel.stats(x.view(-1).numpy())
        scale = torch.tensor([1.0 / x.numel() if mean else 1.0 for mean in recipe.means], dtype=torch.float64)
        before = torch.tensor(raw, dtype=torch.float32)[list(recipe.sweep)].to(torch.float64) * scale
        assert compute_stats(x, names)[1].tolist() == before.tolist()


def test_sums_past_float32_s_range_get_torch_s_answer() -> None:
    x = torch.full((4, 8), 3e38)  # Σ|x| in float64 is past float32's largest value
    _, values, _ = compute_stats(x, ["sum", "abs_mean", "max"])
    assert [str(v) for v in values.tolist()] == [str(v) for v in _torch_stats(x, ["sum", "abs_mean", "max"])]


def test_the_recorder_s_stats_are_floats_from_the_sweep_and_tensors_from_torch() -> None:
    """stats_values (the recorder's) keeps the sweep's numbers as Python floats, no torch op after
    the sweep; they are compute_stats' values bit for bit. What torch computes stays its tensor."""
    from tracedump.store import reduce

    names = ["abs_mean", "sum", "max", "shape"]
    x = torch.randn(64, 48, generator=torch.Generator().manual_seed(3))
    numeric, values, extras = reduce.stats_values(x, names)
    expected = compute_stats(x, names)[1]
    if reduce.compiled_kernel() is not None:
        assert isinstance(values, list) and all(type(v) is float for v in values)
        assert values == expected.tolist()
    assert numeric == ["abs_mean", "sum", "max"] and extras == {"shape": [64, 48]}
    with_nan = x.clone()
    with_nan[0, 0] = math.nan  # the sweep hands a NaN to torch's reductions
    _, from_torch, _ = reduce.stats_values(with_nan, names)
    assert isinstance(from_torch, torch.Tensor) and from_torch.dtype == torch.float64
    assert math.isnan(from_torch[0].item())
    assert reduce.stats_values(x, ["shape"])[1] == []
