"""The demo's port is faithful except for the planted bug, and the demo names the planted layer.

The port tests run in-process (a 4-layer model, milliseconds). The end-to-end test runs the demo
itself, as ``make demo`` does, in its fast configuration: real subprocesses, real env vars, real
dump files, the real ``tracedump diff`` command, with the bug moved to another layer than the
default so the answer cannot be hard-wired. ``--quick`` leaves out the two passing comparisons
(bug-free port, bf16) that ``make demo`` adds; the port's exactness is checked in-process above.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.fixture
def examples(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLES))


def _block_outputs(port: torch.nn.Module, ids: torch.Tensor) -> list[torch.Tensor]:
    x, positions = port.tok_emb(ids), torch.arange(ids.shape[1])
    outputs = []
    for block in port.blocks:
        x = block(x, positions)
        outputs.append(x)
    return outputs


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.usefixtures("examples")
def test_port_without_bug_matches_the_reference() -> None:
    from port import build_port
    from reference import build_reference, prompt_ids

    reference, port, ids = build_reference(), build_port(), prompt_ids()
    with torch.no_grad():
        expected, got = reference(ids).logits, port(ids)
    assert got.shape == expected.shape == (1, len(ids[0]), reference.config.vocab_size)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


@pytest.mark.usefixtures("examples")
def test_planted_bug_changes_that_layer_and_the_ones_after_it_only() -> None:
    from port import WRONG_ROPE_BASE, build_port
    from reference import build_reference, prompt_ids

    reference, ids = build_reference(), prompt_ids()
    port = build_port(bug_layer=2)
    assert [block.attn.rotary.base for block in port.blocks] == [10000.0, 10000.0, WRONG_ROPE_BASE, 10000.0]
    with torch.no_grad():
        hidden = reference(ids, output_hidden_states=True).hidden_states  # embeddings, then each layer
        blocks = _block_outputs(port, ids)
        logits_error = _relative(port(ids), reference(ids).logits)
    for layer in (0, 1):
        torch.testing.assert_close(blocks[layer], hidden[layer + 1], rtol=0, atol=1e-6)
    assert _relative(blocks[2], hidden[3]) > 1e-4  # far above fp32 noise (~1e-7)
    # Small enough to look plausible from the logits alone: the reason to compare layer by layer.
    assert 1e-4 < logits_error < 0.05


@pytest.mark.usefixtures("examples")
def test_bug_layer_out_of_range_is_refused() -> None:
    from port import build_port

    with pytest.raises(ValueError, match=r"bug_layer must be in 0\.\.3"):
        build_port(bug_layer=4)


def test_demo_names_the_planted_layer(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "demo.py"), "--out", str(out), "--bug-layer", "1", "--quick"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "first divergence: blocks.1.attn  (reference: model.layers.1.self_attn[0])" in done.stdout
    assert "the layer with the planted bug" in done.stdout

    report = json.loads((out / "port_vs_reference.json").read_text())
    assert "blocks.1.attn" in json.dumps(report)
    assert (out / "port_vs_reference.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (out / "report.html").read_text()
    assert "First divergence: <a href='#t-" in page and "<code>blocks.1.attn</code>" in page
    assert "<code>model.layers.1.self_attn[0]</code>" in page  # the reference's name, paired with no --map
    row = report["tensors"][report["summary"]["first_divergence"]["index"]]
    assert row["paired_by"] == "weights"  # the port loaded the reference's weights: they pair it
    assert f"Open the report in a browser: {out / 'report.html'}" in done.stdout
    manifests = [json.loads(p.read_text()) for p in sorted(out.glob("*/rank*_pid*/manifest.json"))]
    assert {m["root"] for m in manifests} == {"PortLM", "LlamaForCausalLM"}
    assert all(m["complete"] and m["passes"]["count"] == 1 for m in manifests)
    assert sorted(p.name for p in out.iterdir()) == [
        "logs",
        "port_buggy",
        "port_vs_reference.json",
        "port_vs_reference.png",
        "ref_fp32",
        "report.html",
    ]
