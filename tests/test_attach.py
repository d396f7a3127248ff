"""attach() on real HF models: what lands in the pass files is what a plain forward hook sees."""

from __future__ import annotations

import dataclasses
import json
import os
import stat
from pathlib import Path

import pytest
import torch
from torch import nn

import tracedump
from tracedump.dump.hooks import flatten_tensors


def _reference_captures(model: nn.Module, names: list[str], run) -> list[dict[str, torch.Tensor]]:
    """Plain forward hooks that clone every tensor leaf; one dict per root forward."""
    passes: list[dict[str, torch.Tensor]] = []
    modules = dict(model.named_modules())
    counts: dict[str, int] = {}

    def open_pass(*_):
        passes.append({})
        counts.clear()

    def make_hook(name):
        def hook(_module, _args, output):
            call = counts.get(name, 0)
            counts[name] = call + 1
            for suffix, tensor in flatten_tensors(output):
                passes[-1][f"{name}{suffix}" + (f"::call{call}" if call else "")] = tensor.detach().clone()

        return hook

    handles = [model.register_forward_pre_hook(open_pass)]
    handles += [modules[n].register_forward_hook(make_hook(n)) for n in names]
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    return passes


def test_pass_file_holds_exactly_what_a_plain_forward_hook_sees(
    tiny_llama, prompt_ids, tmp_path, monkeypatch
):
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path))
    dumper = tracedump.attach(tiny_llama)
    with torch.no_grad():
        tiny_llama(prompt_ids)
    dumper.close()
    names = [name for name, _ in dumper.modules]
    expected = _reference_captures(tiny_llama, names, lambda: tiny_llama(prompt_ids))[0]

    stored = tracedump.load_pass(dumper.run_dir / "pass00000.safetensors")

    assert list(stored) == list(expected)
    for key, tensor in expected.items():
        assert torch.equal(stored[key], tensor), key


def test_leaves_are_selected_by_default_and_all_adds_containers(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path / "leaves"))
    leaves = tracedump.attach(tiny_llama)
    leaves.close()
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path / "all"))
    monkeypatch.setenv("TRACEDUMP_DUMP_MODULES", "all")
    every = tracedump.attach(tiny_llama)
    every.close()

    leaf_names = {n for n, _ in leaves.modules}
    all_names = {n for n, _ in every.modules}
    assert "model.layers.0.self_attn.q_proj" in leaf_names
    assert "model.layers.0" not in leaf_names
    assert {"model.layers.0", "model.layers.0.self_attn", "model"} <= all_names
    assert leaf_names < all_names
    assert "" not in all_names and "root" not in all_names


def test_generate_of_k_tokens_writes_k_passes(tiny_llama, prompt_ids, tmp_path, monkeypatch):
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path))
    monkeypatch.setenv("TRACEDUMP_DUMP_FILTER", r"^model\.norm$")
    dumper = tracedump.attach(tiny_llama)
    with torch.no_grad():
        tiny_llama.generate(prompt_ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    dumper.close()

    files = sorted(p.name for p in dumper.run_dir.glob("pass*.safetensors"))
    assert files == [f"pass{i:05d}.safetensors" for i in range(4)]
    shapes = [tracedump.load_pass(dumper.run_dir / f)["model.norm"].shape for f in files]
    assert shapes == [(1, 6, 32), (1, 1, 32), (1, 1, 32), (1, 1, 32)]  # prefill, then one token a step


def test_a_module_called_twice_gets_call_suffixes(tmp_path, monkeypatch):
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.shared = nn.Linear(4, 4)

        def forward(self, x):
            return self.shared(self.shared(x))

    model = Twice()
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path))
    dumper = tracedump.attach(model)
    x = torch.randn(2, 4)
    model(x)
    dumper.close()

    stored = tracedump.load_pass(dumper.run_dir / "pass00000.safetensors")
    assert list(stored) == ["shared", "shared::call1"]
    assert torch.equal(stored["shared"], model.shared(x).detach())
    assert torch.equal(stored["shared::call1"], model(x).detach())


@dataclasses.dataclass
class _Out:
    hidden: torch.Tensor
    note: str


class _Nested(nn.Module):
    def forward(self, x):
        return (x + 1, {"past": x * 2, "skip": None, "label": "text"}, [x - 1], _Out(x * 3, "n"))


def test_nested_outputs_are_flattened_with_indices_and_keys_and_call_suffix_last(tmp_path, monkeypatch):
    model = nn.Sequential(_Nested())
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path))
    dumper = tracedump.attach(model)
    x = torch.arange(4.0)
    with dumper.step():
        model(x)
        model(x)
    dumper.close()

    stored = tracedump.load_pass(dumper.run_dir / "pass00000.safetensors")
    assert list(stored) == [
        "0[0]",
        "0[1][past]",
        "0[2][0]",
        "0[3][hidden]",
        "0[0]::call1",
        "0[1][past]::call1",
        "0[2][0]::call1",
        "0[3][hidden]::call1",
    ]
    assert torch.equal(stored["0[1][past]"], x * 2)
    assert torch.equal(stored["0[3][hidden]::call1"], x * 3)


def test_hf_model_output_is_flattened_by_field_name(tmp_path, monkeypatch, tiny_llama, prompt_ids):
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path))
    monkeypatch.setenv("TRACEDUMP_DUMP_MODULES", "all")
    monkeypatch.setenv("TRACEDUMP_DUMP_FILTER", r"^model$")
    dumper = tracedump.attach(tiny_llama)
    with torch.no_grad():
        out = tiny_llama(prompt_ids, output_hidden_states=True)
    dumper.close()

    stored = tracedump.load_pass(dumper.run_dir / "pass00000.safetensors")
    assert "model[last_hidden_state]" in stored
    assert "model[hidden_states][2]" in stored
    assert torch.equal(stored["model[hidden_states][1]"], out.hidden_states[1])


def test_captures_are_copies_that_later_in_place_writes_cannot_touch(tmp_path, monkeypatch):
    class InPlaceAfter(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(3, 3)

        def forward(self, x):
            y = self.proj(x)
            y.mul_(0)  # an engine reusing its buffer right after the hook ran
            return y

    model = InPlaceAfter()
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path))
    dumper = tracedump.attach(model)
    x = torch.ones(2, 3)
    with torch.no_grad():
        expected = model.proj(x)
        model(x)
    dumper.close()

    assert torch.equal(tracedump.load_pass(dumper.run_dir / "pass00000.safetensors")["proj"], expected)


def test_outputs_of_the_model_are_unchanged_by_dumping(tiny_llama, prompt_ids, tmp_path, monkeypatch):
    with torch.no_grad():
        before = tiny_llama(prompt_ids).logits
        monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path))
        dumper = tracedump.attach(tiny_llama)
        during = tiny_llama(prompt_ids).logits
        dumper.close()
    assert torch.equal(before, during)


def test_step_context_makes_one_pass_of_several_forwards(tiny_llama, prompt_ids, tmp_path, monkeypatch):
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path))
    monkeypatch.setenv("TRACEDUMP_DUMP_FILTER", "lm_head")
    dumper = tracedump.attach(tiny_llama)
    with torch.no_grad(), dumper.step():
        tiny_llama(prompt_ids)
        tiny_llama(prompt_ids[:, :3])
    with torch.no_grad(), dumper.step():
        tiny_llama(prompt_ids)
    dumper.close()

    first = tracedump.load_pass(dumper.run_dir / "pass00000.safetensors")
    assert list(first) == ["lm_head", "lm_head::call1"]
    assert first["lm_head::call1"].shape == (1, 3, 64)
    assert list(tracedump.load_pass(dumper.run_dir / "pass00001.safetensors")) == ["lm_head"]


def test_a_pass_that_captured_nothing_writes_no_file(tiny_llama, prompt_ids, tmp_path, monkeypatch):
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path))
    monkeypatch.setenv("TRACEDUMP_DUMP_FILTER", "lm_head")
    dumper = tracedump.attach(tiny_llama)
    with dumper.step():
        pass
    with torch.no_grad(), dumper.step():
        tiny_llama(prompt_ids)
    dumper.close()
    assert sorted(p.name for p in dumper.run_dir.glob("pass*")) == ["pass00001.safetensors"]


def test_run_dir_is_rank_and_pid_and_private_to_the_owner(tiny_llama, prompt_ids, tmp_path, monkeypatch):
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path / "dump"))
    monkeypatch.setenv("RANK", "3")
    dumper = tracedump.attach(tiny_llama)
    with torch.no_grad():
        tiny_llama(prompt_ids)
    dumper.close()

    assert dumper.run_dir == tmp_path / "dump" / f"rank3_pid{os.getpid()}"
    assert stat.S_IMODE(dumper.run_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "dump").stat().st_mode) == 0o700
    for path in dumper.run_dir.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert not [p for p in dumper.run_dir.iterdir() if p.name.startswith(".")]


def test_manifest_describes_the_run(tiny_llama, prompt_ids, tmp_path, monkeypatch):
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path))
    dumper = tracedump.attach(tiny_llama)
    with torch.no_grad():
        tiny_llama(prompt_ids)
        tiny_llama(prompt_ids)
    dumper.close()

    manifest = json.loads((dumper.run_dir / "manifest.json").read_text())
    assert manifest["tracedump_version"] == tracedump.__version__
    assert manifest["torch_version"] == torch.__version__
    assert manifest["model_class"].endswith("LlamaForCausalLM")
    assert manifest["modules"] == [n for n, _ in dumper.modules]
    assert manifest["pid"] == os.getpid() and manifest["rank"] == 0 and manifest["world_size"] == 1
    assert manifest["settings"]["dir"] == str(tmp_path) and manifest["settings"]["mode"] == "full"
    assert manifest["passes"]["count"] == 2 and manifest["passes"]["indices"] == [0, 1]
    on_disk = sum(p.stat().st_size for p in dumper.run_dir.glob("pass*.safetensors"))
    assert manifest["passes"]["bytes"] == on_disk
    assert manifest["complete"] is True and "start_time" in manifest


def test_manifest_is_incomplete_until_close(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path))
    dumper = tracedump.attach(tiny_llama)
    assert json.loads((dumper.run_dir / "manifest.json").read_text())["complete"] is False
    dumper.close()
    assert json.loads((dumper.run_dir / "manifest.json").read_text())["complete"] is True


def test_close_removes_every_hook_and_is_idempotent(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path))
    dumper = tracedump.attach(tiny_llama)
    assert any(m._forward_hooks for m in tiny_llama.modules())
    dumper.close()
    dumper.close()
    for module in tiny_llama.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks


def test_a_second_dumper_in_one_process_gets_its_own_run_dir(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path))
    first = tracedump.attach(tiny_llama)
    second = tracedump.attach(nn.Linear(2, 2))
    first.close()
    second.close()
    assert first.run_dir != second.run_dir
    assert second.run_dir.name == f"{first.run_dir.name}-2"


def test_everything_captured_is_flushed_at_interpreter_exit(tmp_path):
    import subprocess
    import sys

    script = (
        "import torch, tracedump\n"
        "m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())\n"
        "d = tracedump.attach(m)\n"
        "for _ in range(3): m(torch.ones(1, 4))\n"
        "print(d.run_dir)\n"  # no close(): the atexit handler must flush
    )
    env = {**os.environ, "TRACEDUMP_DUMP_DIR": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    )
    run_dir = Path(result.stdout.strip())
    assert sorted(p.name for p in run_dir.glob("pass*")) == [f"pass{i:05d}.safetensors" for i in range(3)]
    assert json.loads((run_dir / "manifest.json").read_text())["complete"] is True
    assert "3 passes" in result.stderr


def test_a_hook_failure_is_reported_once_and_never_raised_into_forward(
    tmp_path, monkeypatch, tiny_llama, prompt_ids
):
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path))
    dumper = tracedump.attach(tiny_llama)

    def broken(*_args, **_kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(dumper.sink, "copy", broken)
    with torch.no_grad(), pytest.warns(tracedump.TracedumpWarning, match="boom") as caught:
        expected = tiny_llama(prompt_ids).logits
        again = tiny_llama(prompt_ids).logits
    with pytest.warns(tracedump.TracedumpWarning, match=r"captures lost: \{'errors': \d+\}"):
        dumper.close()
    assert torch.equal(expected, again)
    assert len([w for w in caught if "boom" in str(w.message)]) == 1
    assert dumper.skipped["errors"] > 1
    assert json.loads((dumper.run_dir / "manifest.json").read_text())["skipped"]["errors"] > 1


def test_a_forward_cut_by_a_base_exception_still_ends_its_pass(tmp_path, monkeypatch):
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path))
    dumper = tracedump.attach(model)
    with tracedump.capture(model, outputs=["0"], early_exit=True) as cap:
        assert cap.run(torch.ones(1, 2)) is None  # cut by capture's early exit (a BaseException)
    model(torch.ones(1, 2))
    model(torch.ones(1, 2))
    dumper.close()
    run = tracedump.open_dump(tmp_path).runs[0]
    # capture()'s hooks came after attach(), so the dump's hooks run behind them (it records what
    # the caller received): the early exit left pass 0 empty, and the manifest says it was cut short.
    assert {i: p.names for i, p in run.passes.items()} == {1: ["0", "1", "2"], 2: ["0", "1", "2"]}
    assert run.manifest["truncated_passes"] == [0]


def test_a_failure_report_never_raises_even_when_warnings_are_errors(tmp_path, monkeypatch, capfd):
    import warnings

    model = nn.Sequential(nn.Linear(2, 2))
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path))
    with tracedump.dump.runtime.runtime().warn.fresh():
        dumper = tracedump.attach(model)
        monkeypatch.setattr(dumper.sink, "copy", lambda *a, **k: 1 / 0)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out = model(torch.ones(1, 2))
            dumper.close()
    assert out.shape == (1, 2)
    assert "capture failed at 0: ZeroDivisionError" in capfd.readouterr().err


def test_a_root_that_is_itself_a_leaf_has_its_inputs_and_output_in_the_pass(tmp_path, monkeypatch):
    model = nn.Linear(3, 2)
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path))
    monkeypatch.setenv("TRACEDUMP_DUMP_INPUTS", "1")
    dumper = tracedump.attach(model)
    x = torch.ones(1, 3)
    model(x)
    dumper.close()
    stored = tracedump.load_pass(dumper.run_dir / "pass00000.safetensors")
    assert list(stored) == ["root@in[0]", "root"]
    assert torch.equal(stored["root@in[0]"], x)
    assert dumper.skipped["outside_pass"] == 0


def test_a_run_dir_made_by_another_process_with_the_same_pid_is_never_shared(tmp_path, monkeypatch):
    taken = tmp_path / f"rank0_pid{os.getpid()}"  # e.g. a container on another host, same shared disk
    taken.mkdir()
    (taken / "pass00000.safetensors").write_bytes(b"theirs")
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path))
    model = nn.Linear(2, 2)
    dumper = tracedump.attach(model)
    model(torch.ones(1, 2))
    dumper.close()
    assert dumper.run_dir.name == f"rank0_pid{os.getpid()}-2"
    assert (taken / "pass00000.safetensors").read_bytes() == b"theirs"
