"""``--baseline C`` with ``--align tokens`` (what a bf16 vLLM run against an fp32 HF reference
needs): C, a rerun of the reference, is read by sequence; each pair is judged by its own noise
err(C, B) on the same positions, also for a bridge rule's derived side. Tiny HF Llamas."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import make_tiny_llama

import tracedump
from tracedump.compare import compare

PROMPTS = [[1, 5, 9, 23, 44, 7], [1, 7, 3, 12]]
PRODUCT = """
[[rule]]
op = "product"
match = 'model\\.layers\\.(\\d+)\\.mlp\\.down_proj@in\\[0\\]'
b = ["model.layers.{1}.mlp.act_fn", "model.layers.{1}.mlp.up_proj"]
"""


def dump(out: Path, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch, scale: float = 1.0) -> Path:
    """The tiny Llama in ``dtype`` (layer 1's MLP output x ``scale``), one pass per prompt with its
    batch layout, inputs of down_proj dumped too (the rule's A side)."""
    model = make_tiny_llama(layers=3).to(dtype)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(scale)
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(out))
    monkeypatch.setenv("TRACEDUMP_DUMP_INPUTS", "1")
    monkeypatch.setenv("TRACEDUMP_DUMP_FILTER", r"layers\.")  # not embed_tokens@in: [1, seq] reads as 1 row
    dumper = tracedump.attach(model)
    assert dumper is not None
    with torch.no_grad():
        for seq, ids in enumerate(PROMPTS):
            with dumper.step():
                dumper.set_batch(seq_ids=[seq] * len(ids), input_ids=ids)
                model(torch.tensor([ids]))
    dumper.close()
    for name in ("TRACEDUMP_DUMP_DIR", "TRACEDUMP_DUMP_INPUTS", "TRACEDUMP_DUMP_FILTER"):
        monkeypatch.delenv(name)
    return out


@pytest.fixture
def runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    rules = tmp_path / "rules.toml"
    rules.write_text(PRODUCT)
    return {
        "fp32": dump(tmp_path / "fp32", torch.float32, monkeypatch),
        "bf16": dump(tmp_path / "bf16", torch.bfloat16, monkeypatch),
        "bf16_bug": dump(tmp_path / "bf16_bug", torch.bfloat16, monkeypatch, scale=1.05),
        "rules": rules,
    }


def test_a_bf16_run_against_fp32_is_judged_by_the_baseline_noise_per_sequence(runs: dict[str, Path]) -> None:
    report = compare(runs["bf16"], runs["fp32"], align="tokens", baseline=runs["bf16"], bridge=runs["rules"])
    measured = [r for r in report.results if r.metrics is not None]
    assert measured and all(r.basis == "baseline" for r in measured)
    assert all(r.noise is not None and r.noise > 0 for r in measured)  # bf16 against fp32: real noise
    assert report.exit_code == 0
    derived = [r for r in measured if r.bridge is not None]  # C's act_fn * up_proj, as B's
    assert derived and all(r.name_b.endswith("mlp.up_proj") for r in derived)


def test_the_bug_is_named_past_the_bf16_noise(runs: dict[str, Path]) -> None:
    report = compare(runs["bf16_bug"], runs["fp32"], align="tokens", baseline=runs["bf16"])
    assert report.exit_code == 1
    first = report.alignment[0]["first"]  # type: ignore[index]
    assert first["name"].startswith("model.layers.1.mlp"), first
    before = [r for r in report.results if r.name.startswith("model.layers.0.")]
    assert before and all(r.status == "ok" for r in before)
