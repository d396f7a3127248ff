"""What each dump mode writes, checked value by value against a plain-hook reference.

The reference is a set of ordinary ``register_forward_hook`` / ``register_forward_pre_hook`` hooks
that clone what they see: if tracedump's files ever disagree with them, tracedump changed a number
on the way to disk. Stats are checked against numpy, which shares none of tracedump's code.
"""

from __future__ import annotations

import contextlib
import json
import math
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import make_tiny_llama
from torch import nn

import tracedump
import tracedump.dump.sinks
from tracedump import ConfigError, TracedumpWarning, load_pass, open_dump

ALL_STATS = ("abs_mean", "sum", "min", "max", "mean", "std", "l2", "nan_count", "inf_count", "shape", "dtype")
NUMERIC_STATS = ALL_STATS[:9]
RECORD_KEYS = {"module", "tensor", "pass", "call", "seq"}


# ---------------------------------------------------------------------------------------------
# The plain-hook reference


def _leaves(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, module) for name, module in model.named_modules() if not list(module.children())]


def _flatten(value: Any, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors of a (nested) tuple/list, named as the file format's keys: ``name``, ``name[0]``."""
    if isinstance(value, torch.Tensor):
        yield prefix, value
    elif isinstance(value, (tuple, list)):
        for index, item in enumerate(value):
            yield from _flatten(item, f"{prefix}[{index}]")


@contextlib.contextmanager
def reference_outputs(modules: list[tuple[str, nn.Module]]) -> Iterator[list[dict[str, torch.Tensor]]]:
    """One dict per root forward (call ``passes.append({})`` first) of cloned module outputs; the
    N-th repeat call of a module in one forward gets ``::callN``, as in the file format's key scheme."""
    passes: list[dict[str, torch.Tensor]] = []
    handles = []
    for name, module in modules:

        def hook(_module: nn.Module, _args: Any, output: Any, name: str = name) -> None:
            leaves = list(_flatten(output, name))
            if not leaves:
                return
            calls = sum(key.split("::")[0] == leaves[0][0] for key in passes[-1])
            suffix = f"::call{calls}" if calls else ""
            for key, tensor in leaves:
                passes[-1][key + suffix] = tensor.detach().clone()

        handles.append(module.register_forward_hook(hook))
    try:
        yield passes
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def reference_inputs(modules: list[tuple[str, nn.Module]]) -> Iterator[dict[str, torch.Tensor]]:
    """Cloned inputs of one forward, keyed ``name@in[i]`` / ``name@in[kw]``, taken before the module runs."""
    seen: dict[str, torch.Tensor] = {}
    handles = []
    for name, module in modules:

        def pre_hook(_module: nn.Module, args: tuple, kwargs: dict, name: str = name) -> None:
            for index, arg in enumerate(args):
                for key, tensor in _flatten(arg, f"{name}@in[{index}]"):
                    seen[key] = tensor.detach().clone()
            for kw, arg in kwargs.items():
                for key, tensor in _flatten(arg, f"{name}@in[{kw}]"):
                    seen[key] = tensor.detach().clone()

        handles.append(module.register_forward_pre_hook(pre_hook, with_kwargs=True))
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def run_passes(
    model: nn.Module, batches: list[torch.Tensor], modules: list[tuple[str, nn.Module]], **kwargs: Any
) -> tuple[tracedump.Dumper, list[dict[str, torch.Tensor]]]:
    """Attach (settings from the env), run one root forward per batch, close; return the reference."""
    dumper = tracedump.attach(model)
    assert dumper is not None
    with reference_outputs(modules) as reference, torch.no_grad():
        for batch in batches:
            reference.append({})
            model(batch, **kwargs)
    dumper.close()
    return dumper, reference


def _modules_passed_to(monkeypatch: pytest.MonkeyPatch, method: str) -> list[str]:
    """The module names a ``Recorder`` method (``_copy_leaves``, ``_keep_stats``: which path a
    capture took) is called with from now on, in order; the method still does its work."""
    from tracedump.dump.recorder import Recorder

    called: list[str] = []
    original = getattr(Recorder, method)

    def spied(self: Any, current: Any, name: str, *args: Any, **kwargs: Any) -> None:
        called.append(name)
        original(self, current, name, *args, **kwargs)

    monkeypatch.setattr(Recorder, method, spied)
    return called


def assert_same_tensors(stored: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(stored) == sorted(expected)
    for key, tensor in expected.items():
        assert stored[key].dtype == tensor.dtype, key
        assert torch.equal(stored[key], tensor), key


def read_stats(run_dir: Path) -> list[dict[str, Any]]:
    """``stats.jsonl`` parsed as *strict* JSON: a bare NaN/Infinity token fails the test."""

    def reject(token: str) -> None:
        raise AssertionError(f"non-standard JSON constant {token} in stats.jsonl")

    return [
        json.loads(line, parse_constant=reject) for line in (run_dir / "stats.jsonl").read_text().splitlines()
    ]


# ---------------------------------------------------------------------------------------------
# Toy modules with outputs of known shape and content


class TokenMajorModel(nn.Module):
    """An engine-style model on flattened ``[tokens, hidden]``: 2-D, 3-D, 1-D and tuple outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.act = nn.GELU()
        self.split = SplitHeads()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        heads, norms = self.split(self.act(self.proj(x)))
        return heads.flatten(1) + norms[:, None]


class SplitHeads(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.view(x.shape[0], 2, 4), x.sum(-1)


class Poison(nn.Module):
    """Three tensors: one with NaN and both infinities, one with only +inf, one with only -inf."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mixed, pos, neg = x.clone(), x.clone(), x.clone()
        mixed[0, 0], mixed[1, 1], mixed[2, 2] = float("nan"), float("inf"), float("-inf")
        pos[0, 3] = float("inf")
        neg[1, 4] = float("-inf")
        return mixed, pos, neg


class ArgMax(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.argmax(-1)


class ToBFloat16(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.bfloat16)


class StatsZoo(nn.Module):
    """Outputs covering every stats case: float32, NaN/Inf, int64, bfloat16, a repeated call."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(8, 6)
        self.poison = Poison()
        self.argmax = ArgMax()
        self.low = ToBFloat16()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.dense(x)
        self.poison(h)
        self.argmax(h)
        self.low(h)
        self.low(h * 2)  # second call of the same module in one pass: call 1
        return h


class StatsZooTwice(StatsZoo):
    """The zoo, then its float32 module once more: a second call the C sweep takes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.dense(x)


class InPlaceDoubler(nn.Module):
    """Overwrites its input: an input capture must hold the value from *before* the forward."""

    def forward(
        self, x: torch.Tensor, *, scale: torch.Tensor, note: str = "", skip: Any = None
    ) -> torch.Tensor:
        return x.mul_(2) * scale


class InputsModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.doubler = InPlaceDoubler()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.doubler(x.clone(), scale=torch.full((4,), 0.5), note="text", skip=None))


# ---------------------------------------------------------------------------------------------
# full


def test_full_mode_files_equal_plain_hook_outputs_value_by_value_for_every_pass(dump_dir: Path) -> None:
    model = make_tiny_llama()
    batches = [torch.tensor([[3, 14, 15, 9, 26, 5]]), torch.tensor([[7, 1, 2, 8]]), torch.tensor([[1, 2, 3]])]

    dumper, reference = run_passes(model, batches, _leaves(model))

    run = open_dump(dump_dir).runs[0]
    assert sorted(run.passes) == [0, 1, 2]
    for index, expected in enumerate(reference):
        assert_same_tensors(load_pass(dumper.run_dir / f"pass{index:05d}.safetensors"), expected)
        assert run.passes[index].metadata["tracedump.mode"] == "full"
    assert "model.rotary_emb[0]" in reference[0] and "lm_head" in reference[0]


def test_full_mode_keys_follow_capture_order_and_repeat_calls_get_a_call_suffix(
    dump_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRACEDUMP_DUMP_FILTER", "^(dense|low)$")
    model = StatsZoo()
    _, reference = run_passes(model, [torch.randn(5, 8)], [("low", model.low), ("dense", model.dense)])

    stored = open_dump(dump_dir).runs[0].passes[0]
    assert stored.names == ["dense", "low", "low::call1"]
    assert torch.equal(stored["low::call1"], (stored["dense"] * 2).to(torch.bfloat16))
    assert torch.equal(stored["dense"], reference[0]["dense"])


# ---------------------------------------------------------------------------------------------
# last_row


def test_last_row_with_token_dim_0_keeps_the_final_token_of_flattened_tensors(
    dump_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRACEDUMP_DUMP_MODE", "last_row")
    torch.manual_seed(0)
    model = TokenMajorModel().eval()

    dumper, reference = run_passes(model, [torch.randn(5, 8), torch.randn(3, 8)], _leaves(model))

    for index, expected in enumerate(reference):
        stored = load_pass(dumper.run_dir / f"pass{index:05d}.safetensors")
        assert sorted(stored) == ["act", "proj", "split[0]", "split[1]"]
        assert stored["proj"].shape == (1, 8) and stored["split[0]"].shape == (1, 2, 4)
        for key in ("proj", "act", "split[0]"):
            assert torch.equal(stored[key], expected[key][-1:]), key
        assert torch.equal(stored["split[1]"], expected["split[1]"]), "a 1-D tensor is kept whole"
    assert open_dump(dump_dir).runs[0].passes[0].metadata["tracedump.mode"] == "last_row"


def test_last_row_with_token_dim_1_keeps_the_final_position_of_hf_batch_seq_hidden(
    dump_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRACEDUMP_DUMP_MODE", "last_row")
    monkeypatch.setenv("TRACEDUMP_DUMP_TOKEN_DIM", "1")
    model = make_tiny_llama()
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(3))

    dumper, reference = run_passes(model, [ids], _leaves(model))

    stored = load_pass(dumper.run_dir / "pass00000.safetensors")
    assert sorted(stored) == sorted(reference[0])
    for key, full in reference[0].items():
        assert stored[key].shape == (*full.shape[:1], 1, *full.shape[2:]), key
        assert torch.equal(stored[key], full[:, -1:]), key
    assert stored["lm_head"].shape == (2, 1, 64)


def test_last_row_plain_path_keeps_what_the_general_path_keeps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """last_row takes the recorder's plain path (Recorder._copy_leaves with a token dim) where no
    gate or filter applies: the same keys, tensors and dtypes as the general path, a tuple's
    tensors, int64 and bfloat16 outputs and a second call of a module included."""
    monkeypatch.setenv("TRACEDUMP_DUMP_MODE", "last_row")
    plain_calls = _modules_passed_to(monkeypatch, "_copy_leaves")
    stored = {}
    for path in ("plain", "general"):
        monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path / path))
        torch.manual_seed(0)
        model = StatsZooTwice()
        dumper = tracedump.attach(model)
        assert dumper is not None
        if path == "general":
            dumper.recorder._gateless = False  # as when a gate is set: every capture takes the general path
        plain_calls.clear()
        with torch.no_grad():
            model(torch.randn(5, 8))
        dumper.close()
        stored[path] = load_pass(dumper.run_dir / "pass00000.safetensors")
        assert bool(plain_calls) == (path == "plain")
    assert sorted(stored["plain"]) == sorted(stored["general"])
    assert {"dense", "dense::call1", "poison[2]", "argmax", "low::call1"} <= set(stored["plain"])
    assert_same_tensors(stored["plain"], stored["general"])
    assert stored["plain"]["dense::call1"].shape == (1, 6)


def test_last_row_also_narrows_captured_inputs(dump_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRACEDUMP_DUMP_MODE", "last_row")
    monkeypatch.setenv("TRACEDUMP_DUMP_INPUTS", "1")
    torch.manual_seed(0)
    model = TokenMajorModel().eval()
    x = torch.randn(5, 8)

    dumper = tracedump.attach(model)
    with torch.no_grad():
        model(x)
    dumper.close()

    stored = load_pass(dumper.run_dir / "pass00000.safetensors")
    assert torch.equal(stored["proj@in[0]"], x[-1:])
    assert stored["split@in[0]"].shape == (1, 8)


# ---------------------------------------------------------------------------------------------
# stats


def _numpy_stats(tensor: torch.Tensor) -> dict[str, Any]:
    """The reference statistics, in float64 numpy (population std, like numpy's default)."""
    x = tensor.detach().to(torch.float64).numpy() if tensor.is_floating_point() else tensor.numpy()
    with np.errstate(invalid="ignore", over="ignore"):
        return {
            "abs_mean": float(np.abs(x).mean()),
            "sum": float(x.sum()),
            "min": float(x.min()),
            "max": float(x.max()),
            "mean": float(x.mean()),
            "std": float(x.astype(np.float64).std()),
            "l2": float(np.linalg.norm(x.ravel().astype(np.float64))),
            "nan_count": int(np.isnan(x).sum()) if x.dtype.kind == "f" else 0,
            "inf_count": int(np.isinf(x).sum()) if x.dtype.kind == "f" else 0,
            "shape": list(tensor.shape),
            "dtype": str(tensor.dtype).removeprefix("torch."),
        }


def _assert_stat(actual: Any, expected: Any, where: str) -> None:
    if isinstance(expected, list | str):
        assert actual == expected, where
    elif math.isnan(expected):
        assert actual == "nan", where
    elif math.isinf(expected):
        assert actual == ("inf" if expected > 0 else "-inf"), where
    else:
        # float32 tensors are reduced in float32 (only the scalar is widened), hence rel 1e-6
        assert isinstance(actual, int | float) and actual == pytest.approx(expected, rel=1e-6, abs=1e-6), (
            where
        )


def test_stats_mode_matches_numpy_for_every_statistic_including_nan_inf_int_and_bfloat16(
    dump_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRACEDUMP_DUMP_MODE", "stats")
    monkeypatch.setenv("TRACEDUMP_DUMP_STATS", ",".join(ALL_STATS))
    torch.manual_seed(0)
    model = StatsZoo().eval()

    dumper, reference = run_passes(model, [torch.randn(5, 8), torch.randn(4, 8)], _leaves(model))

    records = read_stats(dumper.run_dir)
    expected_tensors = {
        ("dense", "out", 0): "dense",
        ("poison", "out[0]", 0): "poison[0]",
        ("poison", "out[1]", 0): "poison[1]",
        ("poison", "out[2]", 0): "poison[2]",
        ("argmax", "out", 0): "argmax",
        ("low", "out", 0): "low",
        ("low", "out", 1): "low::call1",
    }
    assert len(records) == 2 * len(expected_tensors)
    for record in records:
        assert set(record) == RECORD_KEYS | set(ALL_STATS)
        key = (record["module"], record["tensor"], record["call"])
        assert key in expected_tensors
        tensor = reference[record["pass"]][expected_tensors[key]]
        for name, value in _numpy_stats(tensor).items():
            _assert_stat(record[name], value, f"{key} pass {record['pass']} {name}")
    by_key = {(r["module"], r["tensor"], r["pass"], r["call"]): r for r in records}
    assert by_key[("poison", "out[0]", 0, 0)]["nan_count"] == 1
    assert by_key[("poison", "out[0]", 0, 0)]["inf_count"] == 2
    assert by_key[("poison", "out[1]", 1, 0)]["max"] == "inf"
    assert by_key[("poison", "out[2]", 1, 0)]["min"] == "-inf"
    assert by_key[("argmax", "out", 0, 0)]["dtype"] == "int64"
    assert by_key[("low", "out", 0, 0)]["dtype"] == "bfloat16"
    assert by_key[("low", "out", 0, 1)]["sum"] == pytest.approx(
        2 * by_key[("low", "out", 0, 0)]["sum"], rel=1e-2
    )


def test_stats_mode_default_statistics_on_a_llama_match_numpy(
    dump_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRACEDUMP_DUMP_MODE", "stats")
    model = make_tiny_llama()

    dumper, reference = run_passes(model, [torch.tensor([[3, 14, 15, 9, 26, 5]])], _leaves(model))

    records = read_stats(dumper.run_dir)
    assert len(records) == len(reference[0])
    for record in records:
        assert set(record) == RECORD_KEYS | {"abs_mean", "sum", "max", "shape"}
        key = record["module"] + record["tensor"].removeprefix("out")
        expected = _numpy_stats(reference[0][key])
        for name in ("abs_mean", "sum", "max", "shape"):
            _assert_stat(record[name], expected[name], f"{key} {name}")
    assert open_dump(dump_dir).runs[0].stats() == records


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_stats_mode_plain_sweep_path_writes_what_the_general_path_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, grad: bool
) -> None:
    """Statistics the C sweep makes whole take the recorder's plain path (Recorder._sweep_leaves:
    raw sums kept, the record made by the writer thread). Its stats.jsonl is the general path's,
    byte for byte, and it hands that path only what the sweep cannot take: NaN and Inf, int64,
    bfloat16. With grad enabled the outputs require grad, which the sweep reads detached. Where
    the C kernel was not built, a numpy stand-in sweeps: the paths are the same either way."""
    from tracedump.dump import recorder as recorder_module
    from tracedump.store import reduce

    class NumpySums:
        def stats(self, a: np.ndarray) -> tuple[float, ...]:
            x = a.astype(np.float64)
            return (float(x.sum()), float(np.abs(x).sum()), float(x.min()), float(x.max()))

    monkeypatch.setenv("TRACEDUMP_DUMP_MODE", "stats")
    monkeypatch.setenv("TRACEDUMP_DUMP_STATS", "abs_mean,sum,min,max,mean,shape,dtype")
    general = _modules_passed_to(monkeypatch, "_keep_stats")
    written, taken = {}, {}
    kernel = reduce.compiled_kernel() or NumpySums()
    for path in ("plain", "general"):
        if path == "general":
            monkeypatch.setattr(recorder_module, "sweep_plan", lambda names: None)
        monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path / path))
        general.clear()
        torch.manual_seed(0)
        model = StatsZooTwice()
        dumper = tracedump.attach(model)
        assert dumper is not None
        with reduce.use_kernel(kernel), torch.set_grad_enabled(grad):
            for batch in (torch.randn(5, 8), torch.randn(4, 8)):
                model(batch)
        dumper.close()
        written[path] = (dumper.run_dir / "stats.jsonl").read_text()
        taken[path] = sorted(set(general))
    assert written["plain"] == written["general"]
    assert len(written["plain"].splitlines()) == 16
    assert '"module": "dense", "tensor": "out", "pass": 1, "call": 1' in written["plain"]
    assert taken["plain"] == ["argmax", "low", "poison"]
    assert taken["general"] == ["argmax", "dense", "low", "poison"]


class _TwoIdentities(nn.Module):
    """Two leaves whose outputs the test knows: ``a`` is the input, ``b`` twice it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Identity(), nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x) * 2)


def _stats_run(dump_dir: Path, kernel: Any, batches: list[torch.Tensor]) -> tuple[list[dict[str, Any]], Any]:
    from tracedump.store import reduce

    model = _TwoIdentities()
    dumper = tracedump.attach(model, {"dir": str(dump_dir), "mode": "stats", "stats": "sum,max"})
    assert dumper is not None
    with reduce.use_kernel(kernel), torch.no_grad():
        for batch in batches:
            model(batch)
    dumper.close()
    stats = dumper.run_dir / "stats.jsonl"
    records = read_stats(dumper.run_dir) if stats.exists() else []
    return records, json.loads((dumper.run_dir / "manifest.json").read_text())


def test_stats_mode_keeps_a_stand_in_kernel_s_sums_as_they_were_at_the_capture(dump_dir: Path) -> None:
    """The plain stats path keeps the sweep's raw sums for the writer thread: a kernel stand-in
    that hands back the same list each call (refilled) must not change sums already captured."""

    class Refilled:
        def __init__(self) -> None:
            self.sums = [0.0] * 4

        def stats(self, a: np.ndarray) -> list[float]:
            self.sums[:] = [float(a.sum()), float(np.abs(a).sum()), float(a.min()), float(a.max())]
            return self.sums

    records, _ = _stats_run(dump_dir, Refilled(), [torch.ones(4), torch.full((4,), 3.0)])
    assert [(r["pass"], r["module"], r["sum"], r["max"]) for r in records] == [
        (0, "a", 4.0, 1.0),
        (0, "b", 8.0, 2.0),
        (1, "a", 12.0, 3.0),
        (1, "b", 24.0, 6.0),
    ]


def test_stats_mode_reports_a_malformed_kernel_result_at_its_capture_and_goes_on(dump_dir: Path) -> None:
    """A kernel stand-in returning three values fails that capture, in the forward: it is counted
    and reported there, the other captures are written, and the writer (so the dump) goes on."""

    class ShortForTwos:
        def stats(self, a: np.ndarray) -> tuple[float, ...]:
            sums = (float(a.sum()), float(np.abs(a).sum()), float(a.min()), float(a.max()))
            return sums[:3] if a.max() == 2.0 else sums

    with pytest.warns(TracedumpWarning) as caught:
        records, manifest = _stats_run(dump_dir, ShortForTwos(), [torch.ones(4), torch.ones(4)])
    assert any("capture failed at b: ValueError: a stats kernel returned 3" in str(w.message) for w in caught)
    assert [(r["pass"], r["module"], r["sum"]) for r in records] == [(0, "a", 4.0), (1, "a", 4.0)]
    assert manifest["skipped"].get("errors") == 2 and "after_failure" not in manifest["skipped"]
    assert [(e["where"], e["type"], e["count"]) for e in manifest["errors"]] == [("b", "ValueError", 2)]
    assert manifest["complete"] is True


def test_stats_mode_sweeps_a_tensor_with_a_nan_once(dump_dir: Path) -> None:
    """A tensor the sweep refuses after reading it (a NaN, an Inf) gets torch's reductions, not a
    second sweep: NaN hunts are where stats dumps run."""
    from tracedump.store import reduce

    kernel = reduce.compiled_kernel()
    if kernel is None:
        pytest.skip("the C kernel was not built here")
    swept: list[int] = []

    class Counted:
        def stats(self, a: np.ndarray) -> Any:
            swept.append(a.size)
            return kernel.stats(a)

    records, _ = _stats_run(dump_dir, Counted(), [torch.tensor([1.0, math.nan, 2.0])])
    assert swept == [3, 3]  # a, then b: one sweep each
    assert [r["sum"] for r in records] == ["nan", "nan"]


def test_stats_mode_writes_no_pass_files_and_records_go_whole_into_the_pass_file(
    dump_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRACEDUMP_DUMP_MODE", "stats")
    model = make_tiny_llama()

    dumper = tracedump.attach(model)
    with torch.no_grad():
        model(torch.tensor([[3, 14, 15, 9, 26, 5]]))  # pass 0: outputs only
        with dumper.step():  # pass 1: plus an explicit record
            logits = model(torch.tensor([[3, 14, 15]])).logits
            dumper.record("logits", logits)
    dumper.close()

    files = sorted(p.name for p in dumper.run_dir.iterdir())
    assert files == ["correspondence.json", "manifest.json", "pass00001.safetensors", "stats.jsonl"]
    record_file = load_pass(dumper.run_dir / "pass00001.safetensors")
    assert list(record_file) == ["logits"]
    assert torch.equal(record_file["logits"], logits)
    assert {r["pass"] for r in read_stats(dumper.run_dir)} == {0, 1}


def test_stats_mode_moves_only_the_scalars_to_the_host_never_a_whole_tensor(
    dump_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRACEDUMP_DUMP_MODE", "stats")
    monkeypatch.setenv("TRACEDUMP_DUMP_STATS", ",".join(ALL_STATS))
    copied: list[int] = []
    original = tracedump.dump.sinks.FileSink.copy

    def counting_copy(sink: Any, tensor: torch.Tensor, **kwargs: Any) -> Any:
        copied.append(tensor.numel())
        return original(sink, tensor, **kwargs)

    monkeypatch.setattr(tracedump.dump.sinks.FileSink, "copy", counting_copy)
    model = make_tiny_llama()

    dumper, _ = run_passes(model, [torch.tensor([[3, 14, 15, 9, 26, 5]])], _leaves(model))

    # On the CPU the statistics are made on the host (the C sweep's floats, or torch's fresh
    # vector): no copy at all, of a tensor or of its scalars (on a device, only the scalars'
    # vector is copied: Recorder._keep_stats).
    assert copied == []
    records = read_stats(dumper.run_dir)
    assert len(records) == 25
    assert all(set(NUMERIC_STATS) <= set(record) for record in records)


def test_stats_mode_labels_inputs_in_0_and_in_kw(dump_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRACEDUMP_DUMP_MODE", "stats")
    monkeypatch.setenv("TRACEDUMP_DUMP_INPUTS", "1")
    monkeypatch.setenv("TRACEDUMP_DUMP_STATS", "sum,shape")
    model = InputsModel()
    x = torch.arange(8.0).reshape(2, 4)

    dumper, _ = run_passes(model, [x], _leaves(model))

    labels = [(r["module"], r["tensor"]) for r in read_stats(dumper.run_dir)]
    assert labels == [
        ("doubler", "in[0]"),
        ("doubler", "in[scale]"),
        ("doubler", "out"),
        ("proj", "in[0]"),
        ("proj", "out"),
    ]
    first = read_stats(dumper.run_dir)[0]
    assert first["sum"] == 28.0 and first["shape"] == [2, 4]


def test_stats_jsonl_is_partial_while_running_and_renamed_at_close(
    dump_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRACEDUMP_DUMP_MODE", "stats")
    model = make_tiny_llama()
    dumper = tracedump.attach(model)
    with torch.no_grad():
        model(torch.tensor([[3, 14, 15]]))
    dumper.rundir.writer.flush()

    assert (dumper.run_dir / "stats.jsonl.partial").is_file()
    assert not (dumper.run_dir / "stats.jsonl").exists()
    dumper.close()
    assert not (dumper.run_dir / "stats.jsonl.partial").exists()
    assert len(read_stats(dumper.run_dir)) == 25


@pytest.mark.parametrize("bad", ["abs_mean,median", "Sum", "l1"])
def test_an_unknown_stat_name_fails_at_attach_naming_the_env_var_and_the_value(
    dump_dir: Path, monkeypatch: pytest.MonkeyPatch, bad: str
) -> None:
    monkeypatch.setenv("TRACEDUMP_DUMP_MODE", "stats")
    monkeypatch.setenv("TRACEDUMP_DUMP_STATS", bad)

    with pytest.raises(ConfigError) as caught:
        tracedump.attach(make_tiny_llama(layers=1))

    message = str(caught.value)
    assert "TRACEDUMP_DUMP_STATS" in message
    assert repr(bad.split(",")[-1]) in message
    assert not dump_dir.exists()


def test_an_unknown_mode_fails_at_attach_naming_the_env_var(
    dump_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRACEDUMP_DUMP_MODE", "summary")

    with pytest.raises(ConfigError, match="TRACEDUMP_DUMP_MODE='summary'"):
        tracedump.attach(make_tiny_llama(layers=1))


# ---------------------------------------------------------------------------------------------
# inputs


def test_inputs_capture_positional_and_keyword_tensors_of_hf_decoder_layers(
    dump_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRACEDUMP_DUMP_INPUTS", "1")
    monkeypatch.setenv("TRACEDUMP_DUMP_MODULES", "all")
    monkeypatch.setenv("TRACEDUMP_DUMP_FILTER", r'["layers\\.0$", "layers\\.0\\.self_attn\\.q_proj$"]')
    model = make_tiny_llama()
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(5))
    mask = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]])
    selected = [
        (n, m) for n, m in model.named_modules() if n in ("model.layers.0", "model.layers.0.self_attn.q_proj")
    ]

    dumper = tracedump.attach(model)
    with reference_inputs(selected) as inputs, reference_outputs(selected) as outputs, torch.no_grad():
        outputs.append({})
        model(ids, attention_mask=mask)
    dumper.close()

    stored = open_dump(dump_dir).runs[0].passes[0]
    assert stored.names == [
        "model.layers.0@in[0]",
        "model.layers.0@in[attention_mask]",
        "model.layers.0@in[position_embeddings][0]",
        "model.layers.0@in[position_embeddings][1]",
        "model.layers.0@in[position_ids]",
        "model.layers.0.self_attn.q_proj@in[0]",
        "model.layers.0.self_attn.q_proj",
        "model.layers.0",
    ]
    assert_same_tensors(stored.load(), {**inputs, **outputs[0]})


def test_inputs_are_copied_before_the_module_runs_and_non_tensors_are_skipped(
    dump_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRACEDUMP_DUMP_INPUTS", "1")
    model = InputsModel()
    x = torch.arange(8.0).reshape(2, 4)

    _, reference = run_passes(model, [x], _leaves(model))

    stored = open_dump(dump_dir).runs[0].passes[0]
    assert stored.names == ["doubler@in[0]", "doubler@in[scale]", "doubler", "proj@in[0]", "proj"]
    assert torch.equal(stored["doubler@in[0]"], x), "the in-place doubling must not reach the input capture"
    assert torch.equal(stored["doubler@in[scale]"], torch.full((4,), 0.5))
    assert torch.equal(stored["doubler"], reference[0]["doubler"])
    assert torch.equal(stored["proj@in[0]"], x)  # doubled, then halved by scale


@pytest.mark.parametrize("value", ["0", "false", "off"])
def test_inputs_off_captures_outputs_only(
    dump_dir: Path, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("TRACEDUMP_DUMP_INPUTS", value)
    model = InputsModel()

    run_passes(model, [torch.ones(2, 4)], _leaves(model))

    assert open_dump(dump_dir).runs[0].passes[0].names == ["doubler", "proj"]


def test_an_unparseable_inputs_value_fails_at_attach_naming_the_env_var(
    dump_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRACEDUMP_DUMP_INPUTS", "maybe")

    with pytest.raises(ConfigError, match="TRACEDUMP_DUMP_INPUTS='maybe'"):
        tracedump.attach(InputsModel())
    assert not dump_dir.exists()


def test_modes_leave_the_model_outputs_untouched(dump_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ids = torch.tensor([[3, 14, 15, 9, 26, 5]])
    model = make_tiny_llama()
    with torch.no_grad():
        expected = model(ids).logits
    for mode in ("full", "last_row", "stats"):
        monkeypatch.setenv("TRACEDUMP_DUMP_MODE", mode)
        monkeypatch.setenv("TRACEDUMP_DUMP_INPUTS", "1")
        dumper = tracedump.attach(model)
        with torch.no_grad():
            logits = model(ids).logits
        dumper.close()
        assert torch.equal(logits, expected), mode
        assert dumper.failure is None and not dumper.skipped, mode


def test_a_healthy_stats_run_with_nan_and_inf_emits_no_tracedump_warning(
    dump_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRACEDUMP_DUMP_MODE", "stats")
    monkeypatch.setenv("TRACEDUMP_DUMP_STATS", ",".join(ALL_STATS))
    model = StatsZoo()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dumper, _ = run_passes(model, [torch.randn(5, 8)], _leaves(model))

    assert [str(w.message) for w in caught if issubclass(w.category, TracedumpWarning)] == []
    assert dumper.failure is None
    assert open_dump(dump_dir).runs[0].complete


def test_stats_lines_and_whole_records_share_one_capture_order(dump_dir, monkeypatch):
    monkeypatch.setenv("TRACEDUMP_DUMP_MODE", "stats")
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    dumper = tracedump.attach(model)
    with dumper.step():
        model(torch.ones(1, 2))
        dumper.record("between", torch.ones(3))
        model(torch.ones(1, 2))
    dumper.close()

    lines = [json.loads(line) for line in (dumper.run_dir / "stats.jsonl").read_text().splitlines()]
    assert [(r["module"], r["call"], r["seq"]) for r in lines] == [
        ("0", 0, 0),
        ("1", 0, 1),
        ("0", 1, 3),
        ("1", 1, 4),
    ]
    pass_file = tracedump.open_dump(dumper.run_dir).runs[0].passes[0]
    assert pass_file.names == ["between"]
    assert json.loads(pass_file.metadata["tracedump.seq"]) == [2]
