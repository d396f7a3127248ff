"""The verdict at the precision engines run: the calibration table, reproduced on real models.

Every case of ``benchmarks/calibrate.py`` for the Llama (the issue's table: rotary, MLP-scale,
softmax-scale and eps bugs in layer 3; fp32, bf16 vs bf16 with eager attention, bf16 vs fp32 with
``--baseline``), plus the families whose physics differ: Mixtral (an fp32 router whose top-k flips
at near-ties), T5 (``wo`` kept in fp32 inside bf16) and a 25-step diffusion loop in bf16 vs fp32.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.calibrate import FAMILIES, Case, Family, cases, dump_variant, judge_case, variants_needed
from tracedump.compare import compare
from tracedump.compare.verdict import GROWTH, rounding_floor


def _dump_family(root: Path, family: Family, wanted: list[Case]) -> dict[str, Path]:
    return {v: dump_variant(copy.copy(family), v, root / v) for v in variants_needed(wanted)}


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Family, dict[str, Path]]:
    family = FAMILIES["llama"]()
    return family, _dump_family(tmp_path_factory.mktemp("llama"), family, cases(family))


@pytest.mark.parametrize(
    "case", cases(FAMILIES["llama"]()), ids=lambda c: f"{c.label}:{c.expect}".replace(" ", "_")
)
def test_the_llama_table_holds(llama: tuple[Family, dict[str, Path]], case: Case) -> None:
    family, dumps = llama
    outcome = judge_case(case, family, dumps)
    if case.expect == "clean":
        assert outcome.exit_code == 0, outcome.first
    elif case.expect == "detect":
        assert outcome.exit_code == 1 and outcome.first is not None
        assert ".layers.3." in outcome.first  # a module of the planted layer
        assert outcome.error is not None and outcome.threshold is not None
        assert outcome.error > outcome.threshold


def test_bf16_mlp_bug_is_found_after_exact_zeros_below_the_old_bf16_threshold(
    llama: tuple[Family, dict[str, Path]],
) -> None:
    _, dumps = llama
    report = compare(dumps["bf16-eager+mlp_scale"], dumps["bf16-eager"])
    first = report.first_divergence
    assert first is not None and first.name == "model.layers.3.mlp"
    assert all(r.error == 0 for r in report.results[: first.index] if r.error is not None)
    assert first.error < 1e-2  # the fixed bf16 default would have passed it
    assert first.threshold == pytest.approx(rounding_floor("bfloat16", 64))  # a few bf16 roundings


def test_a_kernel_change_in_bf16_stays_within_what_upstream_explains(
    llama: tuple[Family, dict[str, Path]],
) -> None:
    _, dumps = llama
    report = compare(dumps["bf16-eager"], dumps["bf16"])
    measured = [r for r in report.results if r.error]
    assert report.exit_code == 0 and measured  # the kernels do differ
    assert measured[0].error < rounding_floor("bfloat16", 64)  # a first difference of rounding size
    assert all(r.basis == "upstream" and r.error <= r.threshold for r in measured)


def test_baseline_reports_each_error_as_times_the_measured_noise(
    llama: tuple[Family, dict[str, Path]], tmp_path: Path
) -> None:
    _, dumps = llama
    out = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, "-m", "tracedump", "diff", str(dumps["bf16+rotary"]), str(dumps["fp32"]),
         "--baseline", str(dumps["bf16"]), "--json", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    report = json.loads(out.read_text())
    first = report["tensors"][report["summary"]["first_divergence"]["index"]]
    assert first["basis"] == "baseline" and ".layers.3.self_attn" in first["name"]
    assert first["x_noise"] > 10 and first["noise"] > 0
    before = report["tensors"][: first["index"]]
    assert all(row["x_noise"] == pytest.approx(1.0) for row in before if row["noise"])  # same bf16 code
    assert "x noise" in done.stdout and report["settings"]["baseline"] == str(dumps["bf16"])


def test_fp32_islands_in_a_bf16_run_are_judged_at_bf16(tmp_path: Path) -> None:
    family = FAMILIES["t5"]()
    dumps = _dump_family(tmp_path, family, [Case("t5", "bf16", "fp32", "clean")])
    report = compare(dumps["bf16"], dumps["fp32"])
    islands = [r for r in report.results if r.dtype_a == "float32" and r.error]
    assert islands and all(r.tolerance.precision == "bfloat16" for r in islands)
    assert report.exit_code == 0
    strict = compare(dumps["bf16"], dumps["fp32"], rtol="DenseReluDense\\.wo=1e-8")
    assert strict.exit_code == 1 and strict.first_divergence is not None
    assert strict.first_divergence.name.endswith("DenseReluDense.wo")


def test_a_near_tie_routing_flip_is_reported_not_flagged(tmp_path: Path) -> None:
    family = FAMILIES["mixtral"]()
    dumps = _dump_family(tmp_path, family, [Case("mixtral", "bf16-eager", "bf16", "clean")])
    report = compare(dumps["bf16-eager"], dumps["bf16"])
    assert report.exit_code == 0
    assert report.flips and all(flip.near_tie for flip in report.flips)
    flip = report.flips[0]
    assert flip.router.endswith("mlp.gate") and 0 < len(flip.flipped) < flip.tokens
    statuses = {r.status for r in report.results if flip.covers(r.name)}
    assert statuses <= {"routing_flip", "routing", "ok"} and "routing_flip" in statuses
    summary = report.summary()
    assert summary["routing_flips"][0]["near_tie"] is True


def test_a_diffusion_loop_in_bf16_passes_while_its_error_grows_over_steps(tmp_path: Path) -> None:
    family = FAMILIES["unet"]()
    dumps = _dump_family(tmp_path, family, [Case("unet", "bf16", "fp32", "clean")])
    report = compare(dumps["bf16"], dumps["fp32"])
    assert report.exit_code == 0 and len(report.summary()["passes"]) == 25
    first_pass = max(r.error for r in report.results if r.pass_index == 0 and r.error is not None)
    last_pass = max(r.error for r in report.results if r.pass_index == 24 and r.error is not None)
    assert last_pass > GROWTH * first_pass  # carried over the steps, not a bug


def test_per_token_error_names_the_position_a_bug_starts(tmp_path: Path) -> None:
    """A bug that only touches tokens from position 10 on shows as that pattern per token."""
    import tracedump
    from tests.conftest import make_tiny_llama

    model = make_tiny_llama(layers=2)
    ids = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(0))

    def dump(out: Path, bug: bool) -> Path:
        twin = copy.deepcopy(model)
        if bug:
            twin.model.layers[1].mlp.register_forward_hook(
                lambda m, i, o: torch.cat([o[:, :10], o[:, 10:] * 1.01], 1)
            )
        dumper = tracedump.attach(twin, {"dir": str(out), "modules": "all"})
        assert dumper is not None
        with torch.no_grad():
            twin(input_ids=ids)
        dumper.close()
        return out

    import tracedump.compare.execute

    separate: list[tuple[int, ...]] = []  # tensors measured per token in a pass of their own
    original = tracedump.compare.execute.per_token_rel_diff

    def spy(a, b, dim, rows=None):  # type: ignore[no-untyped-def]
        if rows is None:
            separate.append(a.shape)
        return original(a, b, dim, rows)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tracedump.compare.execute, "per_token_rel_diff", spy)
        report = compare(dump(tmp_path / "bug", True), dump(tmp_path / "ref", False))
    assert all(shape[-1] < 32 for shape in separate)  # the hidden-size ones came with the metrics
    first = report.first_divergence
    assert first is not None and first.name == "model.layers.1.mlp"
    assert first.per_token is not None and len(first.per_token) == 16 and first.token_dim == 1
    assert all(v == 0 for v in first.per_token[:10]) and all(v > 0 for v in first.per_token[10:])
    row = report.to_json()["tensors"][first.index]
    assert row["per_token"]["worst"] >= 10 and len(row["per_token"]["rel_diff"]) == 16


def test_per_name_rules_first_match_wins_and_unused_rules_warn(
    llama: tuple[Family, dict[str, Path]], capsys: pytest.CaptureFixture[str]
) -> None:
    from tracedump.cli import main

    _, dumps = llama
    code = main(
        ["diff", str(dumps["bf16-eager+mlp_scale"]), str(dumps["bf16-eager"]),
         "--rtol", r"layers\.3\.mlp$=1e-3", "--rtol", r"layers\.3\.mlp=0", "--rtol", "nomatch=1"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0  # the 2% bug is 2e-4 < 1e-3, and the first rule matched layers.3.mlp
    assert "--rtol nomatch=1 matched no tensor name" in out
    assert main(["diff", str(dumps["bf16"]), str(dumps["bf16"]), "--rtol", "x=abc"]) == 2


def test_an_order_only_swap_of_chosen_experts_is_no_divergence(tmp_path: Path) -> None:
    """OLMoE eager vs sdpa in bf16: some tokens keep their two experts in swapped top-k order."""
    family = FAMILIES["olmoe"]()
    dumps = _dump_family(tmp_path, family, [Case("olmoe", "bf16-eager", "bf16", "clean")])
    report = compare(dumps["bf16-eager"], dumps["bf16"])
    assert report.exit_code == 0
    assert any(not flip.flipped for flip in report.flips)  # same experts, another order
    assert not [r for r in report.results if r.status == "diverged"]


def test_a_routing_flip_upstream_does_not_hide_a_later_bug_under_baseline(tmp_path: Path) -> None:
    """Qwen2-MoE: bf16 flips routing in layer 1; the eps bug in layer 2 is still found (the flip's
    allowance stays under the ceiling and within its pass)."""
    family = FAMILIES["qwen2moe"]()
    wanted = [Case("qwen2moe", "bf16+norm_eps", "fp32", "detect", baseline="bf16")]
    dumps = _dump_family(tmp_path, family, wanted)
    report = compare(dumps["bf16+norm_eps"], dumps["fp32"], baseline=dumps["bf16"])
    first = report.first_divergence
    assert report.flips and first is not None and first.name == "model.layers.2.post_attention_layernorm"
    assert first.threshold is not None and first.threshold <= first.tolerance.rtol  # under the ceiling


def test_baseline_pairs_with_b_by_b_pass_when_a_is_a_pass_file_of_another_index(
    llama: tuple[Family, dict[str, Path]], tmp_path: Path
) -> None:
    import shutil

    _, dumps = llama
    source = next((dumps["bf16+rotary"]).glob("rank*/pass00000.safetensors"))
    renamed = tmp_path / "pass00003.safetensors"
    shutil.copy(source, renamed)
    report = compare(renamed, dumps["fp32"], passes="0", baseline=dumps["bf16"])
    first = report.first_divergence
    assert first is not None and first.basis == "baseline" and ".layers.3." in first.name
    assert all(r.noise is not None for r in report.results if r.metrics is not None and r.kind == "tensor")
