"""The comparator's C kernel (tracedump/util/kernel.c): built where it can be, and giving what
the numpy path gives.

Every arithmetic test of test_compare_metrics.py runs on both paths already; these check the
kernel itself: its sums against float64, its exact maxima, its rows, its argument checks, and the
whole metrics of the two paths side by side on data shaped to catch a lane or block bug (lengths
around its 16 lanes and 2048-element blocks, rows that do not divide a chunk, the largest error
in a vector loop's tail).
"""

from __future__ import annotations

import shutil
import sysconfig

import numpy as np
import pytest

from tracedump.compare.load.reader import Stored
from tracedump.compare.measure import metrics

kernel = metrics.kernel


def _compiler() -> str | None:
    command = (sysconfig.get_config_var("CC") or "cc").split()
    return shutil.which(command[0]) if command else None


def test_the_kernel_is_built_where_a_c_compiler_is() -> None:
    """The extension is optional at install (no compiler: numpy path, same results, slower). Where
    a compiler is, a missing kernel means the build broke and the diff silently got 1.5x slower."""
    if _compiler() is None:
        pytest.skip("no C compiler here: the numpy path is the comparator's arithmetic")
    assert kernel is not None, "tracedump.util.kernel did not build: see `pip install -e . -v`"


needs_kernel = pytest.mark.skipif(kernel is None, reason="the C kernel was not built here")


def _pair(n: int, seed: int, scale: float = 1e-3) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    a = rng.standard_normal(n).astype(np.float32)
    b = (a + scale * rng.standard_normal(n) * rng.random(n) * 10).astype(np.float32)
    return a, b


def _float64_sums(a: np.ndarray, b: np.ndarray) -> tuple[float, ...]:
    x, y = a.astype(np.float64), b.astype(np.float64)
    d = a - b  # in fp32, as the kernel and numpy both take it (exact or nearly: Sterbenz)
    d64 = d.astype(np.float64)
    return (
        float(d64 @ d64),
        float(x @ x),
        float(y @ y),
        float(np.abs(d64).sum()),
        float(np.abs(d).max()),
        float(np.abs(b).max()),
    )


@needs_kernel
@pytest.mark.parametrize("n", [1, 15, 16, 17, 2047, 2048, 2049, 4111, 262144, 262144 + 7])
def test_sums_match_float64_and_the_maxima_are_exact(n: int) -> None:
    a, b = _pair(n, seed=n)
    got = kernel.sums(a, b)
    want = _float64_sums(a, b)
    assert got[:4] == pytest.approx(want[:4], rel=2e-6)  # fp32 lanes flushed to float64 per block
    assert got[4:] == want[4:]


@needs_kernel
def test_the_largest_values_in_the_tail_after_the_vector_loop_count() -> None:
    a, b = _pair(16 * 9 + 5, seed=1)
    a[-2], b[-2] = 3.0, -4.0
    a[-1] = b[-1] = 9.25
    assert kernel.sums(a, b)[4:] == (7.0, 9.25)


@needs_kernel
@pytest.mark.parametrize("row_len", [32, 33, 1000, 1024, 4097])
def test_row_sums_match_float64(row_len: int) -> None:
    rows = 7
    a, b = _pair(rows * row_len, seed=row_len)
    row_dd, row_norm = np.full(rows, np.nan), np.full(rows, np.nan)
    got = kernel.sums(a, b, row_len, row_dd, row_norm)
    x, y = a.astype(np.float64).reshape(rows, -1), b.astype(np.float64).reshape(rows, -1)
    d = (a - b).astype(np.float64).reshape(rows, -1)
    assert np.allclose(row_dd, (d * d).sum(1), rtol=2e-6, atol=0)
    assert np.allclose(row_norm, (x * x + y * y).sum(1), rtol=2e-6, atol=0)
    assert got[:4] == pytest.approx(_float64_sums(a, b)[:4], rel=2e-6)
    assert got[0] == pytest.approx(row_dd.sum(), rel=1e-12)  # the chunk is the sum of its rows


@needs_kernel
def test_nan_and_inf_show_in_the_sums_for_the_careful_path() -> None:
    """The kernel does not mask them: the caller sees a non-finite sum and redoes the chunk."""
    for bad in (np.nan, np.inf, -np.inf):
        a, b = _pair(100, seed=2)
        a[40] = bad
        assert not np.isfinite(sum(kernel.sums(a, b)[:3]))


@needs_kernel
def test_the_kernel_reads_read_only_memory() -> None:
    """The diff passes slices of read-only memory maps of the dump files."""
    a, b = _pair(5000, seed=3)
    ro_a, ro_b = np.frombuffer(a.tobytes(), np.float32), np.frombuffer(b.tobytes(), np.float32)
    assert not ro_a.flags.writeable
    assert kernel.sums(ro_a, ro_b) == kernel.sums(a, b)


@needs_kernel
def test_bad_arguments_are_errors_not_wrong_sums() -> None:
    a, b = _pair(64, seed=4)
    rows = np.zeros(2)
    with pytest.raises(TypeError, match="'f'"):
        kernel.sums(a.astype(np.float64), b)
    with pytest.raises(ValueError, match="differ in length"):
        kernel.sums(a, b[:-1])
    with pytest.raises(ValueError, match="does not divide"):
        kernel.sums(a, b, 30, rows, rows)
    with pytest.raises(ValueError, match="must hold 2 rows"):
        kernel.sums(a, b, 32, np.empty(3), np.empty(3))
    with pytest.raises(TypeError, match="'d'"):
        kernel.sums(a, b, 32, rows.astype(np.float32), rows)
    with pytest.raises(ValueError):  # not contiguous: numpy refuses the buffer
        kernel.sums(a[::2], b[::2])
    with pytest.raises(ValueError, match=">= 0"):
        kernel.sums(a, b, -1, rows, rows)
    with pytest.raises(ValueError, match="aligned"):
        kernel.sums(*_unaligned(a, b))


def _unaligned(*arrays: np.ndarray) -> list[np.ndarray]:
    """Each array's floats at an odd address, as in a safetensors file from a tool that does not
    align its tensors' offsets (numpy reads them; C may not)."""
    views = []
    for array in arrays:
        raw = np.zeros(array.nbytes + 1, np.uint8)
        raw[1:] = array.view(np.uint8)
        views.append(np.frombuffer(raw.data, np.float32, offset=1))
    assert not any(v.flags.aligned for v in views)
    return views


def test_unaligned_floats_take_the_numpy_path(monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = _pair(3 * metrics.CHUNK + 5, seed=6)
    monkeypatch.setattr(metrics, "kernel", None)
    plain = metrics.compare_arrays(Stored(a, "float32"), Stored(b, "float32"), want_max_b=True)
    ua, ub = _unaligned(a, b)
    for path in (kernel, None):
        monkeypatch.setattr(metrics, "kernel", path)
        assert metrics.compare_arrays(Stored(ua, "float32"), Stored(ub, "float32"), want_max_b=True) == plain


def test_max_abs_b_is_measured_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = _pair(2 * metrics.CHUNK, seed=7)
    for path in (kernel, None):
        monkeypatch.setattr(metrics, "kernel", path)
        assert metrics.compare_arrays(Stored(a, "float32"), Stored(b, "float32")).max_abs_b == 0.0
        asked = metrics.compare_arrays(Stored(a, "float32"), Stored(b, "float32"), want_max_b=True)
        assert asked.max_abs_b == float(np.abs(b).max())


def _both_paths(a: Stored, b: Stored, monkeypatch: pytest.MonkeyPatch, by_row: bool) -> list[tuple]:
    results = []
    for path in (kernel, None):
        monkeypatch.setattr(metrics, "kernel", path)
        if by_row:
            m, rows = metrics.compare_by_row(a, b, want_max_b=True)
            assert rows is not None
            results.append((m, rows.dd.copy(), rows.norm.copy()))
        else:
            results.append((metrics.compare_arrays(a, b, want_max_b=True), None, None))
    return results


@needs_kernel
@pytest.mark.parametrize(
    ("shape", "dtype_b"),
    [
        ((3 * metrics.CHUNK + 77,), "float32"),
        ((2 * metrics.CHUNK,), "bfloat16"),  # a bf16 side widened into a buffer first
        ((900, 1100), "float32"),  # rows that do not divide a chunk
        ((4, 64, 2048), "bfloat16"),
    ],
)
def test_the_kernel_and_the_numpy_path_agree(
    monkeypatch: pytest.MonkeyPatch, shape: tuple[int, ...], dtype_b: str
) -> None:
    """The exact figures (largest error, where, values there, largest |b|, counts) equal; the sums
    within 1e-5 of float64, and for flat tensors as close as the numpy path's or closer (the
    kernel's fp32 lanes go to float64 every 2048 elements, a BLAS dot sums a whole chunk in fp32;
    with rows kept, both sum each row in fp32 and the rows in float64, so neither is ahead)."""
    n = int(np.prod(shape))
    a, b = _pair(n, seed=5)
    a[n // 3], b[n // 3] = 1.0, -4.0  # the largest error, exactly 5
    a[n - 3], b[n - 3] = -2.0, 3.0  # an equal one later: the first must win on both paths
    stored_a = Stored(a.reshape(shape), "float32")
    if dtype_b == "bfloat16":
        bits = (b.view(np.uint32) >> 16).astype(np.uint16)
        stored_b = Stored(bits.reshape(shape), "bfloat16")
        b = (bits.astype(np.uint32) << 16).view(np.float32)
    else:
        stored_b = Stored(b.reshape(shape), "float32")
    fused, plain = _both_paths(stored_a, stored_b, monkeypatch, by_row=len(shape) > 1)
    m, p = fused[0], plain[0]
    exact = ("numel", "max_abs", "argmax", "a_at_argmax", "b_at_argmax", "max_abs_b", "nan_a", "inf_b")
    assert [getattr(m, k) for k in exact] == [getattr(p, k) for k in exact]
    assert (m.argmax, m.max_abs) == (n // 3, 5.0)
    x, y = a.astype(np.float64), b.astype(np.float64)
    d = x - y
    truth = {
        "rel_diff": (d @ d) / (x @ x + y @ y),
        "mean_abs": np.abs(d).mean(),
        "one_minus_cosine": 1 - (x @ y) / np.sqrt((x @ x) * (y @ y)),
    }
    for name, value in truth.items():
        kernel_error = abs(getattr(m, name) / value - 1)
        assert kernel_error < 1e-5, name
        if len(shape) == 1:  # BLAS dots over whole chunks; kept rows are summed in float64 on both
            assert kernel_error <= abs(getattr(p, name) / value - 1) * 1.01 + 1e-9, name
    if fused[1] is not None:
        assert np.allclose(fused[1], plain[1], rtol=1e-5, atol=0)
        assert np.allclose(fused[2], plain[2], rtol=1e-5, atol=0)
