"""Compare one pair of arrays, in chunks, without ever holding a float64 copy of either.

Why chunks of fp32 rather than one float64 pass: a float64 copy of a 4 GB bf16 tensor is 16 GB, and
on CPUs numpy on cache-sized chunks is several times faster than torch on whole tensors (no thread
start-up per op, no temporaries; docs/performance.md has the measurements). Precision stays where it matters:

- ``a - b`` of two fp32 numbers is exact or nearly so (Sterbenz), so the error terms are accurate
  even when the error is 1e-12 of the values;
- each chunk's sums come from one pass of C over it (``kernel.c``: fp32 lanes flushed to float64
  every 2048 elements) or, where that extension was not built, from BLAS dots (fp32, relative
  error ~1e-7..1e-6 on a 256K chunk); they are added up in float64, in chunk order: a 1e-6
  relative error *on a metric* never moves a verdict;
- ``1 - cosine`` is computed as ``(Σd² - (|a|-|b|)²) / (2|a||b|)`` with
  ``|a|-|b| = (Σa² - Σb²) / (|a|+|b|)``, so near cosine = 1 it is as accurate as Σd² itself rather
  than lost in ``1 - Σab/(|a||b|)`` (its floor is ~1e-13, from the fp32 sums of squares);
- a chunk whose fp32 sums are not finite (NaN/Inf, or squares that overflow) or underflow (values
  below ~1e-15) is redone in float64 with explicit masks.

Definitions (a = run under test, b = reference, d = a - b, over positions finite on both sides):
``rel_diff = Σd² / Σ(a² + b²)`` (= ``1 - 2Σab / Σ(a² + b²)``, robust for near-zero tensors),
``cosine = Σab / (|a||b|)``, ``sqnr_db = 10 log10(Σb² / Σd²)``.
"""

from __future__ import annotations

import concurrent.futures
import functools
import math
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from ...store.dtypes import WIDER_THAN_FLOAT32
from ...util.cpus import usable_cpus
from ..load.reader import GatheredRows, Stored, widen
from .rows import RowSums, finite_rows, per_token_from_rows, token_rel_diff

try:  # the one-pass C sums (kernel.c); optional at install, the numpy path is the fallback
    from ...util import kernel
except ImportError:  # pragma: no cover - exercised where the extension was not built
    kernel = None

CHUNK = 1 << 18  # elements: 1 MiB of fp32: a chunk and its temporaries stay in L2 + L3
_ROW = 1 << 10  # Σ|d| as a matrix-vector product of the chunk's rows with a ones vector this long
_MIN_ROW = 32  # shorter rows are summed by per_token_rel_diff, not by the metrics' pass
_PARALLEL_CHUNKS = 8  # tensors of at least this many chunks are split across worker threads
_MAX_WORKERS = 4  # the arithmetic is memory-bound: more threads than this buy nothing
_UNDERFLOW = 1e-30  # fp32 squares below this lose digits: redo the chunk in float64
# What _work_dtype does, in words, for the summary line and the docs.
WORK_DTYPE_RULE = "in float32 (float64 when either side is float64 or a 32/64-bit integer)"


@dataclass(frozen=True, kw_only=True)
class TensorMetrics:
    """Everything measured on one pair. ``argmax`` is the flat index of the largest |a - b|."""

    numel: int
    max_abs: float
    mean_abs: float
    rel_diff: float
    cosine: float
    one_minus_cosine: float
    sqnr_db: float
    max_abs_b: float
    argmax: int | None
    a_at_argmax: float | None
    b_at_argmax: float | None
    nan_a: int
    nan_b: int
    inf_a: int
    inf_b: int
    nonfinite_mismatch: int  # positions where the NaN/Inf pattern of a and b differs


class _Sums:
    """One thread's counts and largest |d| over the chunks it took. The float sums are not here:
    each chunk's go to its own row of a table (:func:`_compare`), added up in chunk order at the
    end, so the result does not depend on which thread took which chunk."""

    def __init__(self) -> None:
        self.count = 0
        self.max_abs = -1.0
        self.max_abs_b = 0.0
        self.argmax: int | None = None  # flat index of the largest |d|, and a and b there
        self.a_at: float | None = None
        self.b_at: float | None = None
        self.nan_a = self.nan_b = self.inf_a = self.inf_b = self.mismatch = 0


def _work_dtype(dtype_a: str, dtype_b: str) -> type:
    return np.float64 if {dtype_a, dtype_b} & WIDER_THAN_FLOAT32 else np.float32


class _Buffers:
    """One thread's scratch space, one chunk long: widened inputs, |a - b|, and a row of ones."""

    def __init__(self, work: type) -> None:
        self.a = np.empty(CHUNK, work)
        self.b = np.empty(CHUNK, work)
        self.d = np.empty(CHUNK, work)
        self.ones = np.ones(_ROW, work)
        self.rows = np.empty(CHUNK // _ROW, work)  # Σ|d| of each row of the chunk
        self.square = np.empty(CHUNK, work)  # squares, for the row sums (compare_by_row)


_THREAD = threading.local()  # each thread's scratch buffers


def _buffers(work: type) -> _Buffers:
    """This thread's buffers for ``work``, allocated once: fresh pages cost page faults per tensor."""
    key = f"buffers_{np.dtype(work).name}"
    buffers = getattr(_THREAD, key, None)
    if buffers is None or buffers.d.shape[0] != CHUNK:
        buffers = _Buffers(work)
        setattr(_THREAD, key, buffers)
    return buffers


_chosen_workers: int | None = None  # set by set_workers(); None: as many as the CPUs allow


def set_workers(count: int | None = None) -> None:
    """Split each large tensor over ``count`` threads (the calling thread is one of them) from the
    next tensor on; None, the default, goes back to every core this process may run on, at most 4.

    Why a function: the thread count is otherwise read from the CPUs once, when the first large
    tensor makes the pool, so a host that shares its cores, or a test that runs the threaded path
    on any machine (or the one-thread path on a large one), says how many here. The pool made for
    the previous count is dropped, not shut down: a diff running in another thread keeps the pool
    it holds, and its idle threads exit once nothing refers to it."""
    global _chosen_workers
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
        raise ValueError(f"set_workers: expected a positive number of threads or None, got {count!r}")
    _chosen_workers = count
    _pool.cache_clear()


@functools.cache
def _pool() -> concurrent.futures.ThreadPoolExecutor | None:
    """Worker threads for large tensors (numpy and BLAS release the GIL); made on first use."""
    workers = _workers()
    if workers < 2:
        return None
    return concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="tracedump-diff")


def _workers() -> int:
    """Threads per large tensor: :func:`set_workers`' count, else every core this process may run
    on, at most 4.

    Each worker reads its own share of the mapped files (its page faults are its reads) and
    computes on it, so reading and computing overlap across the cores. Counting the load average
    out of it (it once used only the "idle" cores) left one thread on any shared machine, which
    ``bench_diff`` measured far slower than the raw read (docs/performance.md)."""
    if _chosen_workers is not None:
        return _chosen_workers
    return max(1, min(_MAX_WORKERS, usable_cpus()))


class _Claims:
    """Chunk numbers handed out one at a time, to whichever thread asks next.

    Why not a fixed split (the first half of the chunks to one thread, the rest to another): the
    threads rarely run at the same speed (another process, a page-cache miss, a busy sibling
    core), and at each tensor's end the faster one waited for the slower one. Claiming chunk by
    chunk leaves at most one chunk's work of waiting, and the slowest diffs gained the most
    (docs/performance.md). A lock rather than a bare shared iterator, so that this holds without the GIL
    too (free-threaded builds)."""

    def __init__(self, count: int) -> None:
        self._next = 0
        self._count = count
        self._lock = threading.Lock()

    def __iter__(self) -> Iterator[int]:
        while True:
            with self._lock:
                index = self._next
                if index >= self._count:
                    return
                self._next = index + 1
            yield index

    def stop(self) -> None:
        """No more chunks for anyone: the other threads finish the chunk they have, then return."""
        with self._lock:
            self._next = self._count


@dataclass(frozen=True, kw_only=True)
class _Pair:
    """One comparison's inputs as the chunk loop reads them."""

    pieces: list[tuple[int, np.ndarray, np.ndarray]]  # per chunk: its first element, A's and B's values
    dtype_a: str
    dtype_b: str
    work: type
    want_max_b: bool
    chunk: int  # elements per chunk: CHUNK, or whole rows when ``rows`` is kept
    row_len: int = 0
    rows: RowSums | None = None
    ones: np.ndarray | None = None  # a row of ones (row sums as a matrix-vector product)


def compare_arrays(a: Stored, b: Stored, *, want_max_b: bool = False) -> TensorMetrics:
    """Metrics of ``a`` against ``b`` (same number of elements; shapes were checked by the plan)."""
    return _compare(a, b, want_max_b, by_row=False)[0]


def compare_by_row(a: Stored, b: Stored, *, want_max_b: bool = False) -> tuple[TensorMetrics, RowSums | None]:
    """:func:`compare_arrays` plus each row's sums (rows of ``a``'s last dim), from the same pass.

    Why: per-token error was a second widened pass over every tensor, which made a diff of real
    ``[tokens, hidden]`` activations several times slower than the metrics alone. The row sums come
    from the chunks the metrics read, at a fraction of the separate pass's cost (docs/performance.md).
    None for fewer than 2 dims (no row holds a token's values), and when a row is longer than a
    chunk or too short for a matrix-vector product per chunk to pay (``[tokens, 1]`` scales, top-1
    router outputs): :func:`per_token_rel_diff` then measures them in a pass of their own, as
    before."""
    shape = a.shape
    row_len = shape[-1] if len(shape) >= 2 else 0
    if not _MIN_ROW <= row_len <= CHUNK or math.prod(shape) == 0:
        return compare_arrays(a, b, want_max_b=want_max_b), None
    return _compare(a, b, want_max_b, by_row=True)


def _compare(a: Stored, b: Stored, want_max_b: bool, *, by_row: bool) -> tuple[TensorMetrics, RowSums | None]:
    parts_a, parts_b = _flat_parts(a), _flat_parts(b)
    total, total_b = sum(p.shape[0] for p in parts_a), sum(p.shape[0] for p in parts_b)
    if total != total_b:
        raise ValueError(f"element counts differ: {total} vs {total_b}")
    row_len = a.shape[-1] if by_row else 0
    rows = RowSums(np.empty(total // row_len), np.empty(total // row_len)) if by_row else None
    chunk = row_len * (CHUNK // row_len) if by_row else CHUNK
    work = _work_dtype(a.dtype, b.dtype)
    ones = np.ones(row_len, work) if by_row else None
    pieces = _pieces(parts_a, parts_b, chunk, total)
    pair = _Pair(
        pieces=pieces,
        dtype_a=a.dtype,
        dtype_b=b.dtype,
        work=work,
        want_max_b=want_max_b,
        chunk=chunk,
        row_len=row_len,
        rows=rows,
        ones=ones,
    )
    chunks = len(pieces)
    table = np.empty((chunks, 4))  # each chunk's Σd², Σa², Σb², Σ|d|, in chunk order
    workers = _workers() if chunks >= _PARALLEL_CHUNKS else 1
    pool = _pool() if workers > 1 else None
    if pool is None:
        sums = _sum_chunks(pair, range(chunks), table)
    else:  # the calling thread claims chunks too: one hand-off fewer, no idle core
        claims = _Claims(chunks)
        others: list[concurrent.futures.Future[_Sums]] = []
        try:
            others += [pool.submit(_claimed_sums, pair, claims, table) for _ in range(workers - 1)]
            first = _claimed_sums(pair, claims, table)
        except BaseException:  # an error (or Ctrl-C): the workers finish the chunk they hold
            claims.stop()
            raise
        finally:
            concurrent.futures.wait(others)
        sums = _merge([first, *(future.result() for future in others)])
    dd, aa, bb, abs_d = (float(column) for column in table.sum(axis=0))
    return _finish(sums, dd, aa, bb, abs_d, total), rows


def _flat_parts(stored: Stored) -> list[np.ndarray]:
    """``stored``'s values as flat arrays in order, none empty: one, or each part of rows gathered
    from several places and not joined (:class:`~..load.reader.GatheredRows`: read where they lie)."""
    unjoined = stored.unjoined() if isinstance(stored, GatheredRows) else None
    flats = (np.ascontiguousarray(p).reshape(-1) for p in ([stored.array] if unjoined is None else unjoined))
    return [flat for flat in flats if flat.shape[0]]


def _pieces(
    parts_a: list[np.ndarray], parts_b: list[np.ndarray], chunk: int, total: int
) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """The chunks of a comparison, on the grid of the joined array (``[k * chunk, (k + 1) *
    chunk)``), so the sums are those of the join bit for bit: each chunk is a view of the part that
    holds it, and a chunk that straddles a part's edge is joined from its slices (a copy of one
    chunk at most, per edge)."""
    return [
        (
            start,
            _span(parts_a, start, min(chunk, total - start)),
            _span(parts_b, start, min(chunk, total - start)),
        )
        for start in range(0, total, chunk)
    ]


def _span(parts: list[np.ndarray], start: int, size: int) -> np.ndarray:
    """Elements ``[start, start + size)`` of the parts laid end to end."""
    slices = []
    offset = 0
    for part in parts:
        end = offset + part.shape[0]
        if end > start and offset < start + size:
            slices.append(part[max(start - offset, 0) : min(start + size - offset, part.shape[0])])
        if end >= start + size:
            break
        offset = end
    return slices[0] if len(slices) == 1 else np.concatenate(slices)


def _claimed_sums(pair: _Pair, claims: _Claims, table: np.ndarray) -> _Sums:
    """:func:`_sum_chunks` over shared claims: an error in any thread stops them for every thread,
    so none reads on through a tensor whose comparison has already failed."""
    try:
        return _sum_chunks(pair, claims, table)
    except BaseException:
        claims.stop()
        raise


def _sum_chunks(pair: _Pair, claims: Iterable[int], table: np.ndarray) -> _Sums:
    """The chunks this thread claims: their float sums into ``table``, the rest into its _Sums."""
    buffers = _buffers(pair.work)
    sums = _Sums()
    with np.errstate(all="ignore"):  # overflow and NaN are detected and handled, not warned about
        for index in claims:
            start, raw_a, raw_b = pair.pieces[index]
            x = widen(raw_a, pair.dtype_a, pair.work, buffers.a[: raw_a.shape[0]])
            y = widen(raw_b, pair.dtype_b, pair.work, buffers.b[: raw_b.shape[0]])
            chunk_sums = _fast_chunk(x, y, start, sums, buffers, pair)
            table[index] = chunk_sums if chunk_sums is not None else _careful_chunk(x, y, start, sums, pair)
    return sums


_COUNTS = ("count", "nan_a", "nan_b", "inf_a", "inf_b", "mismatch")


def _merge(parts: list[_Sums]) -> _Sums:
    """The threads' counts added up, and the largest |d| with the lowest index among equals (each
    thread's chunks come in increasing order, but which thread took the earliest is chance)."""
    total = _Sums()
    for part in parts:
        for name in _COUNTS:
            setattr(total, name, getattr(total, name) + getattr(part, name))
        total.max_abs_b = max(total.max_abs_b, part.max_abs_b)
        if part.max_abs > total.max_abs or (
            part.max_abs == total.max_abs and _earlier(part.argmax, total.argmax)
        ):
            total.max_abs, total.argmax, total.a_at, total.b_at = (
                part.max_abs,
                part.argmax,
                part.a_at,
                part.b_at,
            )
    return total


def _earlier(index: int | None, other: int | None) -> bool:
    return index is not None and (other is None or index < other)


def _note_max(
    sums: _Sums,
    chunk_max: float,
    start: int,
    abs_d: np.ndarray,
    x: np.ndarray,
    y: np.ndarray,
    positions: np.ndarray | None = None,
) -> None:
    """Keep the largest |d| so far and where it is (its first element), found only when it grows.
    ``positions``: where in the chunk each of ``abs_d``'s elements is (the careful path's subset)."""
    if chunk_max > sums.max_abs:  # callers on the hot path check first, to save the call
        offset = int(np.argmax(abs_d))
        sums.max_abs, sums.a_at, sums.b_at = chunk_max, float(x[offset]), float(y[offset])
        sums.argmax = start + (offset if positions is None else int(positions[offset]))


def _abs_sum(abs_d: np.ndarray, buffers: _Buffers) -> float:
    """Σ|d| as a BLAS matrix-vector product with a short row of ones: a third faster than a dot
    with a chunk-long ones vector (which competes with the chunk for the cache) and twice as fast
    as numpy's pairwise ``sum``."""
    size = abs_d.shape[0]
    if size % _ROW:
        return float(np.add.reduce(abs_d))
    rows = buffers.rows[: size // _ROW]
    np.dot(abs_d.reshape(-1, _ROW), buffers.ones, out=rows)
    return float(np.add.reduce(rows))


_ChunkSums = tuple[float, float, float, float]  # Σd², Σa², Σb², Σ|d| of one chunk
# ... and max |d|, max |b| (0 unless asked for), and |d| where it is already in scratch (or None)
_RawSums = tuple[float, float, float, float, float, float, np.ndarray | None]


def _fast_chunk(
    x: np.ndarray, y: np.ndarray, start: int, sums: _Sums, buffers: _Buffers, pair: _Pair
) -> _ChunkSums | None:
    """fp32 (or float64) sums of one chunk; None when the chunk needs the careful path: a sum that
    is not finite (NaN/Inf in the chunk, or squares that overflow), or fp32 squares that underflow.

    The sums come from the C kernel where it was built (:func:`_kernel_sums`), else from numpy
    (:func:`_numpy_sums`); whichever gave them, they are judged here, by the same rules. Where the
    largest |d| is gets looked up only in a chunk that raises the running maximum."""
    if kernel is not None and x.dtype == np.float32 and x.flags.aligned and y.flags.aligned:
        dd, aa, bb, abs_sum, chunk_max, max_b, abs_d = _kernel_sums(x, y, start, pair)
    else:
        dd, aa, bb, abs_sum, chunk_max, max_b, abs_d = _numpy_sums(x, y, start, buffers, pair)
    if not math.isfinite(dd + aa + bb):  # squares: NaN or +Inf in any of them shows in the sum
        return None
    if x.dtype == np.float32 and abs_sum > 0 and (aa + bb) < _UNDERFLOW:
        return None
    size = x.shape[0]
    sums.count += size
    if chunk_max > sums.max_abs:
        if abs_d is None:  # the same exact |x - y| values as the sums saw, so the same first index
            abs_d = np.abs(np.subtract(x, y, out=buffers.d[:size]), out=buffers.d[:size])
        _note_max(sums, chunk_max, start, abs_d, x, y)
    if pair.want_max_b:
        sums.max_abs_b = max(sums.max_abs_b, max_b)
    return dd, aa, bb, abs_sum


def _kernel_sums(x: np.ndarray, y: np.ndarray, start: int, pair: _Pair) -> _RawSums:
    """One pass of C over the chunk (``kernel.c``; fp32, 4-byte aligned), the rows' sums into
    ``pair.rows`` when they are kept. |d| is not kept."""
    assert kernel is not None
    if pair.rows is None:
        return (*kernel.sums(x, y), None)
    first, count = start // pair.row_len, x.shape[0] // pair.row_len
    row_dd, row_norm = pair.rows.dd[first : first + count], pair.rows.norm[first : first + count]
    return (*kernel.sums(x, y, pair.row_len, row_dd, row_norm), None)


def _numpy_sums(x: np.ndarray, y: np.ndarray, start: int, buffers: _Buffers, pair: _Pair) -> _RawSums:
    """Seven passes over the cache-resident chunk: |d| = |x - y| (two), three BLAS dots (d·d, x·x,
    y·y; row by row when the rows are kept), Σ|d| (:func:`_abs_sum`), max |d|. |d| stays in
    scratch for the caller's look-up of the largest one."""
    size = x.shape[0]
    d = np.subtract(x, y, out=buffers.d[:size])
    np.abs(d, out=d)
    if pair.rows is None:
        dd, aa, bb = float(np.dot(d, d)), float(np.dot(x, x)), float(np.dot(y, y))
    else:
        dd, aa, bb = _row_sums(d, x, y, start, buffers, pair)
    chunk_max = float(np.maximum.reduce(d))  # the ufunc itself: ndarray.max() adds a Python wrapper
    max_b = max(abs(float(y.max())), abs(float(y.min()))) if pair.want_max_b else 0.0
    return dd, aa, bb, _abs_sum(d, buffers), chunk_max, max_b, d


def _row_squares(v: np.ndarray, buffers: _Buffers, ones: np.ndarray) -> np.ndarray:
    """Σv² of each row: the squares into scratch, then one BLAS matrix-vector product with a row
    of ones. A row-wise dot (batched ``matmul``, ``vecdot``) is as fast on one thread but holds
    the GIL over its short outer loop (one call per row), so the diff's threads ran one at a time."""
    square = np.multiply(v, v, out=buffers.square[: v.shape[0]])
    return np.dot(square.reshape(-1, ones.shape[0]), ones)


def _row_sums(
    d: np.ndarray, x: np.ndarray, y: np.ndarray, start: int, buffers: _Buffers, pair: _Pair
) -> tuple[float, float, float]:
    """The chunk's Σd², Σa², Σb² from its rows' sums, which are kept (``pair.rows``)."""
    rows, ones = pair.rows, pair.ones
    assert rows is not None and ones is not None
    row_dd, row_aa, row_bb = (_row_squares(v, buffers, ones) for v in (d, x, y))
    first = start // pair.row_len
    rows.dd[first : first + row_dd.shape[0]] = row_dd
    np.add(row_aa, row_bb, out=rows.norm[first : first + row_dd.shape[0]], dtype=np.float64)
    return tuple(float(np.add.reduce(r, dtype=np.float64)) for r in (row_dd, row_aa, row_bb))  # type: ignore[return-value]


def _careful_chunk(x: np.ndarray, y: np.ndarray, start: int, sums: _Sums, pair: _Pair) -> _ChunkSums:
    """float64 with explicit NaN/Inf masks: metrics over positions finite on both sides."""
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    finite_a, finite_b = np.isfinite(x64), np.isfinite(y64)
    sums.nan_a += int(np.isnan(x64).sum())
    sums.nan_b += int(np.isnan(y64).sum())
    sums.inf_a += int(np.isinf(x64).sum())
    sums.inf_b += int(np.isinf(y64).sum())
    both = finite_a & finite_b
    not_both = ~both
    if not_both.any():
        same = (x64[not_both] == y64[not_both]) | (np.isnan(x64[not_both]) & np.isnan(y64[not_both]))
        sums.mismatch += int((~same).sum())
    xf, yf = x64[both], y64[both]
    d = xf - yf
    abs_d = np.abs(d)
    sums.count += int(xf.shape[0])
    if abs_d.size:  # NaN/Inf positions are not a location: the largest among the finite ones
        _note_max(sums, float(abs_d.max()), start, abs_d, xf, yf, positions=np.flatnonzero(both))
    if pair.want_max_b and yf.size:
        sums.max_abs_b = max(sums.max_abs_b, float(np.abs(yf).max()))
    if pair.rows is not None:
        _careful_rows(x64, y64, both, start, pair)
    return float(np.dot(d, d)), float(np.dot(xf, xf)), float(np.dot(yf, yf)), float(abs_d.sum())


def _careful_rows(x64: np.ndarray, y64: np.ndarray, both: np.ndarray, start: int, pair: _Pair) -> None:
    """The rows' sums over their positions finite on both sides, in float64."""
    rows, length = pair.rows, pair.row_len
    assert rows is not None
    shape = (x64.shape[0] // length, length)
    first = start // length
    rows.dd[first : first + shape[0]], rows.norm[first : first + shape[0]] = finite_rows(
        x64.reshape(shape), y64.reshape(shape), both.reshape(shape)
    )


def _sqnr_db(signal: float, noise: float) -> float:
    """Signal (the reference) to error power, in dB: +inf for identical tensors."""
    if noise == 0:
        return math.inf
    return 10 * math.log10(signal / noise) if signal > 0 else -math.inf


def _finish(sums: _Sums, dd: float, aa: float, bb: float, abs_d: float, total: int) -> TensorMetrics:
    """The metrics from the chunks' summed Σd², Σa², Σb², Σ|d| and the threads' merged counts."""
    denominator = aa + bb
    rel_diff = dd / denominator if denominator > 0 else (0.0 if dd == 0 else 1.0)
    norm_a, norm_b = math.sqrt(aa), math.sqrt(bb)
    if norm_a == 0 or norm_b == 0:
        cosine = 1.0 if norm_a == norm_b else 0.0
        one_minus = 1.0 - cosine
    else:
        norm_gap = (aa - bb) / (norm_a + norm_b)  # |a| - |b|, without cancellation
        one_minus = min(max((dd - norm_gap * norm_gap) / (2 * norm_a * norm_b), 0.0), 2.0)
        cosine = 1.0 - one_minus
    sqnr = _sqnr_db(bb, dd)
    return TensorMetrics(
        numel=total,
        max_abs=max(sums.max_abs, 0.0),
        mean_abs=abs_d / sums.count if sums.count else 0.0,
        rel_diff=rel_diff,
        cosine=cosine,
        one_minus_cosine=one_minus,
        sqnr_db=sqnr,
        max_abs_b=sums.max_abs_b,
        argmax=sums.argmax,
        a_at_argmax=sums.a_at,
        b_at_argmax=sums.b_at,
        nan_a=sums.nan_a,
        nan_b=sums.nan_b,
        inf_a=sums.inf_a,
        inf_b=sums.inf_b,
        nonfinite_mismatch=sums.mismatch,
    )


def per_token_of(
    a: Stored, b: Stored, metrics: TensorMetrics, dim: int, rows: RowSums | None
) -> tuple[float, ...]:
    """rel_diff per token position along ``dim`` of a pair already measured (``metrics``): zeros
    when the pair is equal, else :func:`per_token_rel_diff` from the rows' sums of the metrics'
    own pass (``rows``, from :func:`compare_by_row`), or measured again where those were not kept."""
    tokens = a.shape[dim]
    if metrics.rel_diff == 0 and metrics.nonfinite_mismatch == 0:
        return (0.0,) * tokens
    return per_token_rel_diff(a, b, dim, rows)


def per_token_rel_diff(a: Stored, b: Stored, dim: int, rows: RowSums | None = None) -> tuple[float, ...]:
    """rel_diff of each index along ``dim`` (the token positions): from ``rows``, the row sums
    :func:`compare_by_row` kept, where there are some; else a slab of tokens at a time.

    Position bugs (rotary, masks, KV cache, padding) show as a pattern over tokens that one number
    per tensor hides. Row sums are fp32 dots (float64 for wide dtypes): a per-token figure is for
    reading, not judging, so fp32's 1e-7 relative error on it is immaterial; rows holding NaN/Inf
    are redone over their finite positions in float64."""
    if rows is not None:
        return per_token_from_rows(rows, a.shape, dim)
    tokens = a.shape[dim]
    moved_a, moved_b = np.moveaxis(a.array, dim, 0), np.moveaxis(b.array, dim, 0)
    per_row = max(1, math.prod(a.shape) // max(tokens, 1))
    step = max(1, CHUNK // per_row)
    dd, norm = np.empty(tokens), np.empty(tokens)
    with np.errstate(all="ignore"):
        for start in range(0, tokens, step):
            x = widen(moved_a[start : start + step], a.dtype).reshape(-1, per_row)
            y = widen(moved_b[start : start + step], b.dtype).reshape(-1, per_row)
            d = x - y
            # float64 for the rows redone below: their sums can exceed float32 (values ~1e20)
            rows_dd = np.einsum("ij,ij->i", d, d).astype(np.float64)
            rows_norm = (np.einsum("ij,ij->i", x, x) + np.einsum("ij,ij->i", y, y)).astype(np.float64)
            bad = ~(np.isfinite(rows_dd) & np.isfinite(rows_norm))
            if bad.any():
                rows_dd[bad], rows_norm[bad] = finite_rows(x[bad], y[bad])
            dd[start : start + len(rows_dd)] = rows_dd
            norm[start : start + len(rows_dd)] = rows_norm
    return token_rel_diff(dd, norm)
