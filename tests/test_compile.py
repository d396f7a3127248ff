"""torch.compile: compile is turned off while dumping, and a compiled module is never hooked blindly.

Dynamo ignores hooks added to a module it has already compiled, and traces (and breaks on) a copy
inside a hook it compiles. So: ``resolve_compile()`` says "don't compile" while dumping;
``attach()`` on an ``OptimizedModule`` hooks the original module and warns; and the hooks stay out
of any graph Dynamo traces, so a compiled forward still runs, unchanged, and captures nothing.
``backend="eager"`` keeps Dynamo in the loop without a C++ compiler.
"""

from __future__ import annotations

import argparse
import os
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_llama, tracedump_warnings
from torch import nn

import tracedump
import tracedump.dump.cuda
from tracedump import TracedumpWarning
from tracedump.config.settings import load_settings
from tracedump.launch.auto import AutoAttach
from tracedump.launch.command import child_env

pytest.importorskip("transformers")

IDS = torch.arange(7).reshape(1, 7)


@pytest.fixture(autouse=True)
def fresh_process_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for key in [k for k in os.environ if k.startswith("TRACEDUMP_")]:
        monkeypatch.delenv(key)
    with tracedump.dump.runtime.runtime().warn.fresh():
        yield
        torch._dynamo.reset()


def test_resolve_compile_turns_compile_off_with_one_warning_while_dumping(tmp_path: Path) -> None:
    dumper = tracedump.attach(nn.Linear(2, 2), {"dir": tmp_path})
    assert dumper is not None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        decisions = [tracedump.resolve_compile(True, dumper) for _ in range(3)]
    dumper.close()
    assert decisions == [False, False, False]
    (message,) = tracedump_warnings(caught)
    assert "torch.compile disabled because dumping is on" in message


def test_resolve_compile_keeps_the_engine_choice_when_dumping_is_off() -> None:
    dumper = tracedump.attach(nn.Linear(2, 2))  # no dump dir: None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tracedump.resolve_compile(True, dumper) is True
        assert tracedump.resolve_compile(False, dumper) is False


def test_attach_on_a_compiled_module_warns_and_hooks_the_original_module(tmp_path: Path) -> None:
    model = make_tiny_llama()
    compiled = torch.compile(model, backend="eager")
    assert type(compiled).__name__ == "OptimizedModule"
    with pytest.warns(TracedumpWarning, match="hooks go on the original module"):
        dumper = tracedump.attach(compiled, {"dir": tmp_path / "compiled"})
    assert dumper is not None
    assert dumper.model_class.endswith("LlamaForCausalLM")
    assert dict(dumper.modules)["model.layers.1.mlp.down_proj"] is model.model.layers[1].mlp.down_proj
    with torch.no_grad():
        compiled._orig_mod(IDS)
    dumper.close()

    twin = make_tiny_llama()
    reference = tracedump.attach(twin, {"dir": tmp_path / "eager"})
    assert reference is not None
    with torch.no_grad():
        twin(IDS)
    reference.close()
    (got,) = tracedump.open_dump(tmp_path / "compiled").runs
    (want,) = tracedump.open_dump(tmp_path / "eager").runs
    assert got.passes[0].names == want.passes[0].names
    assert got.manifest["root"] == "LlamaForCausalLM"
    torch.testing.assert_close(got.passes[0]["lm_head"], want.passes[0]["lm_head"])


def test_a_compiled_forward_with_a_dumper_attached_runs_unchanged_and_captures_nothing(
    tmp_path: Path,
) -> None:
    model = make_tiny_llama()
    with torch.no_grad():
        eager_logits = model(IDS).logits
    compiled = torch.compile(model, backend="eager")
    with pytest.warns(TracedumpWarning):
        dumper = tracedump.attach(compiled, {"dir": tmp_path})
    assert dumper is not None
    with torch.no_grad(), pytest.warns(TracedumpWarning, match="compiling the dumped LlamaForCausalLM"):
        outputs = [compiled(IDS).logits for _ in range(2)]
    dumper.close()
    assert all(torch.equal(logits, eager_logits) for logits in outputs)
    (run,) = tracedump.open_dump(tmp_path).runs
    assert run.manifest["passes"]["count"] == 0  # the compiled graph runs no hook: nothing, honestly
    assert run.manifest["skipped"] == {}  # and no copy was attempted inside the graph
    assert "compiled" in run.manifest["anomalies"]  # but the manifest says why


def test_under_tracedump_run_a_compiled_root_keeps_running_and_the_warning_names_no_compile(
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.ones(3, 4)
    expected = net(x)
    auto = AutoAttach(load_settings({"dir": tmp_path}))
    auto.register()
    try:
        compiled = torch.compile(net, backend="eager")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = compiled(x)
    finally:
        auto.remove()
    assert torch.equal(got, expected)
    assert list(auto.roots) == ["Sequential"]  # labelled by the original module's class
    messages = tracedump_warnings(caught)
    assert any("the root Sequential is torch.compile'd" in m for m in messages)
    assert all("--no-compile" in m for m in messages)  # and the compiled call's own warning too


def test_run_no_compile_exports_torchdynamo_disable() -> None:
    fields = dict.fromkeys(
        ("dir", "filter", "filter_fn", "modules", "mode", "steps", "tokens", "token_dim", "max_rows"), None
    )
    args = argparse.Namespace(**fields, stats=None, max_pending_bytes=None, inputs=None, no_compile=True)
    assert child_env({}, args)["TORCHDYNAMO_DISABLE"] == "1"
