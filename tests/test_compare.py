"""``tracedump diff`` end to end on dumps of real HF models (tiny configs, random weights).

The dumps are made once per module with ``attach()``, exactly as an engine would; the command runs
as a real subprocess where its exit code or output is the point, and in process (``cli.main``)
where the JSON report is.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_llama
from safetensors.torch import save_file
from torch import nn

import tracedump
from tracedump.cli import main
from tracedump.compare import compare

PROMPTS = [torch.tensor([[3, 14, 15, 9, 26, 5, 35]]), torch.tensor([[8, 9, 7, 9, 3]])]
PERTURBED = "model.layers.1.mlp.up_proj"  # captured after gate_proj and act_fn of the same layer


@contextlib.contextmanager
def _no_env() -> Iterator[None]:
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.upper().startswith("TRACEDUMP_")}
    try:
        yield
    finally:
        os.environ.update(saved)


def dump(model: nn.Module, out: Path, prompts: list[torch.Tensor] = PROMPTS, **settings: object) -> Path:
    """One pass per prompt, through ``attach()``; returns the dump dir."""
    with _no_env():
        dumper = tracedump.attach(model, {"dir": str(out), **settings})
    assert dumper is not None
    with torch.no_grad():
        for ids in prompts:
            model(ids)
    dumper.close()
    return out


def perturb(model: nn.Module, parameter: str, scale: float = 1e-3) -> nn.Module:
    """A copy whose ``parameter`` is scaled by (1 + scale * noise): a bug of RMS relative size ``scale``."""
    twin = copy.deepcopy(model)
    weight = dict(twin.named_parameters())[parameter]
    noise = torch.randn(weight.shape, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        weight.mul_(1 + scale * noise)
    return twin


class GPT2Names(nn.Module):
    """The same Llama under GPT-2 style names (``transformer.h.N.attn.q_proj``): a reference whose
    module tree differs from the port's. It shares the Llama's leaf modules and runs its forward."""

    def __init__(self, llama: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "_llama", llama)  # not a submodule: only the new names are seen
        self.transformer = nn.Module()
        self.transformer.wte = llama.model.embed_tokens
        self.transformer.rotary = llama.model.rotary_emb
        self.transformer.h = nn.ModuleList()
        for layer in llama.model.layers:
            block = nn.Module()
            block.ln_1, block.attn = layer.input_layernorm, layer.self_attn
            block.ln_2, block.mlp = layer.post_attention_layernorm, layer.mlp
            self.transformer.h.append(block)
        self.transformer.ln_f = llama.model.norm
        self.lm_head = llama.lm_head

    def forward(self, ids: torch.Tensor) -> object:
        return self._llama(ids)


GPT2_MAPS = [
    r"^model\.layers\.(\d+)\.self_attn=transformer.h.\1.attn",
    r"^model\.layers\.(\d+)\.mlp=transformer.h.\1.mlp",
    r"^model\.layers\.(\d+)\.input_layernorm=transformer.h.\1.ln_1",
    r"^model\.layers\.(\d+)\.post_attention_layernorm=transformer.h.\1.ln_2",
    r"^model\.embed_tokens=transformer.wte",
    r"^model\.rotary_emb=transformer.rotary",
    r"^model\.norm=transformer.ln_f",
]


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("compare")
    reference = make_tiny_llama()
    return {
        "ref": dump(reference, root / "ref"),
        "same": dump(make_tiny_llama(), root / "same"),
        "bug": dump(perturb(reference, PERTURBED + ".weight"), root / "bug"),
        "gpt2": dump(GPT2Names(reference), root / "gpt2"),
        "stats": dump(
            reference, root / "stats", mode="stats", stats=["abs_mean", "sum", "max", "min", "shape"]
        ),
        "stats_bug": dump(
            perturb(reference, PERTURBED + ".weight"),
            root / "stats_bug",
            mode="stats",
            stats=["abs_mean", "max"],
        ),
        "last_row": dump(reference, root / "last_row", mode="last_row", token_dim=1),
        "layer1_inputs": dump(reference, root / "layer1_inputs", filter=r"layers\.1\.", inputs=True),
    }


def run_cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("TRACEDUMP_")}
    command = [sys.executable, "-m", "tracedump", "diff", *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)


def diff_json(tmp_path: Path, *args: str | Path) -> tuple[int, dict]:
    report = tmp_path / "report.json"
    status = main(["diff", *map(str, args), "--json", str(report), "--no-progress"])
    return status, json.loads(report.read_text())


def only_run(dump_dir: Path) -> Path:
    (run,) = [p for p in dump_dir.iterdir() if p.is_dir()]
    return run


# ------------------------------------------------------------------------------------------ verdicts


def test_identical_runs_exit_0_and_say_so(dumps: dict[str, Path]) -> None:
    result = run_cli(dumps["same"], dumps["ref"])
    assert result.returncode == 0, result.stderr
    assert "compared 50 tensors in 2 passes: 0 diverged" in result.stdout
    assert "no divergence" in result.stdout


def test_a_perturbed_weight_is_named_as_the_first_divergence(dumps: dict[str, Path]) -> None:
    result = run_cli(dumps["bug"], dumps["ref"], "--json", "-")
    assert result.returncode == 1, result.stderr
    summary = json.loads(result.stdout)["summary"]  # with --json -, stdout is the JSON document alone
    assert summary["first_divergence"]["name"] == PERTURBED
    assert summary["first_divergence"]["pass"] == 0
    assert summary["exit_code"] == 1
    assert f"first divergence: pass 0 {PERTURBED}:" in result.stderr  # the human summary moved to stderr


def test_every_tensor_before_the_perturbed_module_is_ok(dumps: dict[str, Path]) -> None:
    report = compare(dumps["bug"], dumps["ref"], passes="0")
    names = [r.name for r in report.results]
    first = names.index(PERTURBED)
    assert {r.status for r in report.results[:first]} == {"ok"}
    assert all(r.metrics.max_abs == 0 for r in report.results[:first])
    assert report.results[first].status == "diverged"
    assert 1e-7 < report.results[first].metrics.rel_diff < 3e-6  # a 1e-3 RMS bug: rel_diff ~5e-7


def test_usage_errors_exit_2_with_a_message(dumps: dict[str, Path]) -> None:
    bad_regex = run_cli(dumps["bug"], dumps["ref"], "--map", "model.(layers=x")
    assert bad_regex.returncode == 2
    assert "--map" in bad_regex.stderr and "invalid regex" in bad_regex.stderr


def test_in_process_usage_errors_exit_2(
    dumps: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = str(dumps["bug"]), str(dumps["ref"])
    assert main(["diff", str(tmp_path / "nowhere"), b]) == 2
    assert "nowhere" in capsys.readouterr().err
    assert main(["diff", a, b, "--pass", "7"]) == 2
    assert "--pass 7: not in both dumps" in capsys.readouterr().err
    assert main(["diff", a, b, "--unshard", "x=split:0"]) == 2
    assert "cat:DIM" in capsys.readouterr().err
    assert main(["diff", a, b, "--filter", "no_such_module"]) == 2
    assert "nothing to compare" in capsys.readouterr().err
    assert main(["diff", a, b, "--map", r"(\w+)=\2"]) == 2
    assert "bad replacement" in capsys.readouterr().err


def test_an_unreadable_pass_file_exits_2_naming_it(
    dumps: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(dumps["ref"], broken)
    victim = only_run(broken) / "pass00001.safetensors"
    whole = victim.read_bytes()
    for cut in (100, len(whole) - 8):  # inside the header; inside the last tensor's data
        victim.write_bytes(whole[:cut])
        assert main(["diff", str(broken), str(dumps["ref"])]) == 2
        assert f"{victim}: not a readable safetensors file" in capsys.readouterr().err
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a safetensors file at all")
    assert main(["diff", str(garbage), str(dumps["ref"])]) == 2
    assert "not a readable safetensors file" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ alignment


def test_map_makes_a_renamed_port_comparable(dumps: dict[str, Path], tmp_path: Path) -> None:
    maps = [arg for rule in GPT2_MAPS for arg in ("--map", rule)]
    status, report = diff_json(tmp_path, dumps["same"], dumps["gpt2"], *maps)
    assert status == 0
    assert report["summary"]["compared"] == 50
    assert report["only_in_a"] == [] and report["only_in_b"] == []
    row = next(t for t in report["tensors"] if t["name"] == "model.layers.1.self_attn.o_proj")
    assert row["name_b"] == "transformer.h.1.attn.o_proj" and row["max_abs"] == 0


def test_map_names_the_divergence_under_both_names(dumps: dict[str, Path], tmp_path: Path) -> None:
    maps = [arg for rule in GPT2_MAPS for arg in ("--map", rule)]
    status, report = diff_json(tmp_path, dumps["bug"], dumps["gpt2"], *maps)
    first = report["summary"]["first_divergence"]
    assert status == 1
    assert (first["name"], first["name_b"]) == (PERTURBED, "transformer.h.1.mlp.up_proj")


def test_names_on_one_side_only_are_listed(dumps: dict[str, Path], tmp_path: Path) -> None:
    status, report = diff_json(tmp_path, dumps["layer1_inputs"], dumps["ref"], "--pass", "0")
    only_a = {item["name"] for item in report["only_in_a"]}
    only_b = {item["name"] for item in report["only_in_b"]}
    assert status == 0  # every name both sides have agrees
    assert "model.layers.1.self_attn.q_proj@in[0]" in only_a
    assert all("@in" in name for name in only_a)
    assert {"model.embed_tokens", "model.norm", "lm_head", "model.layers.0.mlp.down_proj"} <= only_b
    assert not any("layers.1." in name for name in only_b)
    assert report["summary"]["only_in_a"] == len(report["only_in_a"]) > 0


def test_shapes_that_differ_only_by_size_one_dims_still_compare(
    dumps: dict[str, Path], tmp_path: Path
) -> None:
    reference = only_run(dumps["ref"]) / "pass00000.safetensors"
    squeezed = {
        name: tensor.squeeze(0).contiguous() for name, tensor in tracedump.load_pass(reference).items()
    }
    save_file(squeezed, str(tmp_path / "pass00000.safetensors"))
    status, report = diff_json(tmp_path, tmp_path / "pass00000.safetensors", reference)
    row = next(t for t in report["tensors"] if t["name"] == "model.embed_tokens")
    assert status == 0 and report["summary"]["compared"] == 25
    assert row["shape_a"] == [7, 32] and row["shape_b"] == [1, 7, 32] and row["max_abs"] == 0


def test_shape_mismatches_are_reported_and_fail(dumps: dict[str, Path], tmp_path: Path) -> None:
    reference = only_run(dumps["ref"]) / "pass00000.safetensors"
    tensors = tracedump.load_pass(reference)
    tensors["model.layers.0.self_attn.k_proj"] = tensors["model.layers.0.self_attn.k_proj"][
        ..., :8
    ].contiguous()
    save_file(tensors, str(tmp_path / "pass00000.safetensors"))
    status, report = diff_json(tmp_path, tmp_path / "pass00000.safetensors", reference)
    row = next(t for t in report["tensors"] if t["name"] == "model.layers.0.self_attn.k_proj")
    assert status == 1
    assert row["status"] == "shape_mismatch" and row["shape_a"] == [1, 7, 8] and row["shape_b"] == [1, 7, 16]
    assert report["summary"]["shape_mismatch"] == 1 and report["summary"]["diverged"] == 0


def test_a_pass_file_pairs_with_the_same_pass_of_a_dump(dumps: dict[str, Path]) -> None:
    pass_file = only_run(dumps["bug"]) / "pass00001.safetensors"
    report = compare(pass_file, dumps["ref"])
    assert [u.pass_a for u in report.plan.units] == [1]
    assert report.first_divergence is not None and report.first_divergence.name == PERTURBED
    assert report.results[0].shape_a == (1, 5, 32)  # the 5-token prompt of pass 1


def test_filter_and_pass_restrict_what_is_compared(dumps: dict[str, Path]) -> None:
    report = compare(dumps["bug"], dumps["ref"], passes="1", filter=r"layers\.0\.mlp")
    assert [r.name for r in report.results] == [
        "model.layers.0.mlp.gate_proj",
        "model.layers.0.mlp.act_fn",
        "model.layers.0.mlp.up_proj",
        "model.layers.0.mlp.down_proj",
    ]
    assert {r.pass_index for r in report.results} == {1} and report.exit_code == 0


# ------------------------------------------------------------------------------------------ modes


def test_stats_dumps_compare_and_find_the_perturbed_module(dumps: dict[str, Path], tmp_path: Path) -> None:
    status, report = diff_json(tmp_path, dumps["stats_bug"], dumps["stats"])
    first = report["summary"]["first_divergence"]
    assert status == 1
    assert first["name"] == PERTURBED and first["metric"] == "stats"
    row = report["tensors"][first["index"]]
    assert set(row["stats"]) == {"abs_mean", "max"}  # the statistics both dumps recorded
    assert row["stats"]["max"]["rel_err"] > row["tolerance"] == pytest.approx(1e-5)


def test_identical_stats_dumps_agree(dumps: dict[str, Path]) -> None:
    report = compare(dumps["stats"], dumps["stats"])
    assert report.exit_code == 0 and report.compared == 50
    assert all(r.kind == "stats" and r.error == 0 for r in report.results)


def test_a_stats_dump_compares_with_a_full_dump_by_recomputing_its_stats(dumps: dict[str, Path]) -> None:
    clean = compare(dumps["stats"], dumps["ref"])
    assert clean.exit_code == 0 and clean.compared == 50
    assert max(r.error for r in clean.results) < 1e-12  # same numbers, same reductions
    buggy = compare(dumps["bug"], dumps["stats"])
    assert buggy.first_divergence is not None and buggy.first_divergence.name == PERTURBED


def test_last_row_dumps_compare_with_full_dumps(dumps: dict[str, Path]) -> None:
    for a, b in (("last_row", "ref"), ("ref", "last_row")):
        report = compare(dumps[a], dumps[b])
        assert report.exit_code == 0 and report.compared == 50
        assert report.results[0].shape_a == (1, 1, 32) == report.results[0].shape_b


def test_metric_choice_changes_what_is_judged(dumps: dict[str, Path]) -> None:
    cosine = compare(dumps["bug"], dumps["ref"], metric="cosine", passes="0")
    first = cosine.first_divergence
    assert first is not None and first.name == PERTURBED
    assert first.error == pytest.approx(first.metrics.one_minus_cosine)
    loose = compare(dumps["bug"], dumps["ref"], metric="max_abs", passes="0", atol=1e-3)
    assert loose.exit_code == 0
    row = loose.results[0]  # normwise allclose: max|a-b| <= atol + rtol * max|b|, rtol the fp32 default
    assert row.threshold == pytest.approx(1e-3 + 1.3e-6 * row.metrics.max_abs_b)
    tight = compare(dumps["bug"], dumps["ref"], metric="max_abs", passes="0", rtol=0, atol=1e-9)
    assert tight.first_divergence is not None and tight.first_divergence.name == PERTURBED


# ------------------------------------------------------------------------------------------ outputs


def test_json_report_schema(dumps: dict[str, Path], tmp_path: Path) -> None:
    status, report = diff_json(tmp_path, dumps["bug"], dumps["ref"])
    assert status == 1
    assert {"a", "b", "settings", "summary", "tensors", "only_in_a", "only_in_b"} <= set(report)
    assert report["a"] == str(dumps["bug"]) and report["b"] == str(dumps["ref"])
    assert {"metric", "rtol", "atol", "defaults"} <= set(report["settings"])
    assert report["settings"]["metric"] == "rel_diff" and report["settings"]["rtol"] is None
    summary = report["summary"]
    assert {
        "compared",
        "diverged",
        "only_in_a",
        "only_in_b",
        "shape_mismatch",
        "first_divergence",
        "largest_growth",
        "exit_code",
    } <= set(summary)
    assert summary["compared"] == len(report["tensors"]) == 50
    row = report["tensors"][summary["first_divergence"]["index"]]
    expected = {"pass", "name", "name_b", "shape_a", "shape_b", "dtype_a", "dtype_b", "status", "tolerance"}
    expected |= {
        "max_abs",
        "mean_abs",
        "rel_diff",
        "cosine",
        "sqnr_db",
        "argmax",
        "nan_a",
        "nan_b",
        "inf_a",
        "inf_b",
    }
    assert expected <= set(row)
    assert row["status"] == "diverged" and row["dtype_a"] == "float32" and row["basis"] == "upstream"
    assert (
        0 < row["tolerance"] < row["rtol"] == 1e-8
    )  # from exact zeros: a few fp32 roundings, under the ceiling
    assert len(row["argmax"]) == 3 and all(
        0 <= i < s for i, s in zip(row["argmax"], row["shape_a"], strict=True)
    )
    assert row["nan_a"] == row["inf_b"] == 0 and row["rel_diff"] > 1e-8 and 0 < row["cosine"] < 1
    identical = report["tensors"][0]
    assert identical["sqnr_db"] == "inf" and identical["max_abs"] == 0  # strict JSON: no Infinity


def test_plot_file_is_written(dumps: dict[str, Path], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    target = tmp_path / "plots" / "errors.png"
    assert main(["diff", str(dumps["bug"]), str(dumps["ref"]), "--plot", str(target), "--no-progress"]) == 1
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and target.stat().st_size > 10_000


def test_plot_without_matplotlib_fails_fast_with_the_install_hint(
    dumps: dict[str, Path], tmp_path: Path
) -> None:
    blocker = tmp_path / "site"
    (blocker / "matplotlib").mkdir(parents=True)
    (blocker / "matplotlib" / "__init__.py").write_text("raise ImportError('matplotlib is blocked')\n")
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("TRACEDUMP_")}
    env["PYTHONPATH"] = str(blocker)
    command = [
        sys.executable,
        "-m",
        "tracedump",
        "diff",
        str(dumps["bug"]),
        str(dumps["ref"]),
        "--plot",
        "x.png",
    ]
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert result.returncode == 2
    assert "tracedump[plot]" in result.stderr and not (tmp_path / "x.png").exists()


# ------------------------------------------------------------------------------------------ benchmark


def test_the_diff_benchmark_runs_quick_and_cleans_up(monkeypatch: pytest.MonkeyPatch) -> None:
    import tempfile

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
    from benchmarks import bench_diff
    from tracedump.compare.measure import metrics

    before = set(Path(tempfile.gettempdir()).glob("tracedump-bench-diff-*"))
    result = bench_diff.run(quick=True)
    assert result["first_divergence"] == "model.layers.1.t3" and result["exit_code"] == 1
    assert result["dump_bytes"][0] > 64 << 20 and result["tensors_per_dump"] == 8
    assert result["raw_read_GBps"] > 0 and result["diff_GBps"] > 0 and result["ratio"] > 0
    assert result["numpy_path_first_divergence"] == "model.layers.1.t3" and result["numpy_path_ratio"] > 0
    assert result["kernel"] is (metrics.kernel is not None)
    assert set(Path(tempfile.gettempdir()).glob("tracedump-bench-diff-*")) == before
