"""``tracedump run``: dumping programs that never import tracedump, their workers, and the off path.

Subprocess tests run real programs under the bootstrap; the root-finding logic itself is also
exercised in-process through :class:`tracedump.launch.auto.AutoAttach`, which is what the bootstrap
installs. Each subprocess importing torch costs seconds, so every one of them checks several things.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_llama
from torch import nn

import tracedump
import tracedump.dump.cuda
from tracedump.cli import main
from tracedump.config.settings import load_settings
from tracedump.launch.auto import AutoAttach
from tracedump.launch.command import BOOTSTRAP_DIR, DEFAULT_DIR, child_env

pytest.importorskip("transformers")

LLAMA_CONFIG = (
    "vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, "
    "num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64"
)

# A program that has never heard of tracedump: build a tiny Llama, run two forwards.
LLAMA_PROGRAM = f"""
import torch
import transformers

torch.manual_seed(0)
model = transformers.LlamaForCausalLM(transformers.LlamaConfig({LLAMA_CONFIG})).eval()
with torch.no_grad():
    for _ in range(2):
        model(torch.arange(7).reshape(1, 7))
"""

# A parent that runs its model once, then 2 forked workers that reuse it and 2 spawned workers that
# each run three roots (an Encoder and two distinct Sequentials).
WORKERS_PROGRAM = """
import json
import multiprocessing
import os

import torch
from torch import nn


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return torch.tanh(self.proj(x))


def make_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))


SHARED = None


def forked_worker():
    SHARED(torch.ones(3, 4))
    SHARED(torch.ones(3, 4))


def spawned_worker():
    encoder, first, second = Encoder(), make_net(), make_net()
    x = torch.ones(3, 4)
    first(encoder(x))
    second(x)
    first(x)


if __name__ == "__main__":
    torch.set_num_threads(1)
    SHARED = make_net()
    SHARED(torch.ones(3, 4))
    pids = {"parent": os.getpid()}
    for method, target in (("fork", forked_worker), ("spawn", spawned_worker)):
        context = multiprocessing.get_context(method)
        workers = [context.Process(target=target) for _ in range(2)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
            assert worker.exitcode == 0, worker.exitcode
        pids[method] = [worker.pid for worker in workers]
    print(json.dumps(pids))
"""

# Reports what the bootstrap did in a process: which sitecustomize ran, what got imported and hooked.
PROBE_PROGRAM = """
import importlib.util
import json
import os
import sys

importlib.util.find_spec("torch")  # libraries probe before they import (transformers does)
import torch
from torch import nn
from torch.nn.modules import module as torch_module

try:
    import command  # a module of the bootstrap folder: must not be importable
    shadowed = True
except ImportError:
    shadowed = False
nn.Linear(2, 2)(torch.ones(1, 2))
print(json.dumps({
    "user_sitecustomize_ran": os.environ.get("USER_SITECUSTOMIZE_RAN"),
    "sitecustomize": sys.modules["sitecustomize"].__file__,
    "bootstrap_on_sys_path": any("launch" in p and "tracedump" in p for p in sys.path),
    "shadowed": shadowed,
    "tracedump_modules": sorted(m for m in sys.modules if m.split(".")[0] == "tracedump"),
    "global_hooks": len(torch_module._global_forward_pre_hooks) + len(torch_module._global_forward_hooks),
    "meta_path": [repr(finder) for finder in sys.meta_path],
}))
"""


# ------------------------------------------------------------------------------------------ helpers


def program(tmp_path: Path, name: str, source: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return path


def env_without_tracedump(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRACEDUMP_")}
    env.pop("PYTHONPATH", None)
    env.update(extra)
    return env


@pytest.fixture(autouse=True)
def no_tracedump_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for key in [k for k in os.environ if k.startswith("TRACEDUMP_") or k in ("RANK", "WORLD_SIZE")]:
        monkeypatch.delenv(key)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    with tracedump.dump.runtime.runtime().warn.fresh():
        yield


@pytest.fixture
def auto(tmp_path: Path) -> Iterator[AutoAttach]:
    """The bootstrap's global hooks, registered in this process for one test."""
    hooks = AutoAttach(load_settings({"dir": tmp_path / "auto"}))
    hooks.register()
    try:
        yield hooks
    finally:
        hooks.remove()


def dumped_passes(dump_dir: Path) -> dict[str, dict[int, dict[str, torch.Tensor]]]:
    """run dir name -> pass index -> {key: tensor}, everything loaded."""
    return {
        run.name: {index: passfile.load() for index, passfile in run.passes.items()}
        for run in tracedump.open_dump(dump_dir).runs
    }


def explicit_llama_dump(dump_dir: Path, forwards: int = 2) -> dict[int, dict[str, torch.Tensor]]:
    """What an integrated engine gets: ``attach(model)`` and one pass per forward."""
    model = make_tiny_llama()
    dumper = tracedump.attach(model, {"dir": dump_dir})
    assert dumper is not None
    with torch.no_grad():
        for _ in range(forwards):
            model(torch.arange(7).reshape(1, 7))
    dumper.close()
    (runs,) = dumped_passes(dump_dir).values()
    return runs


def run_args(**overrides: object) -> argparse.Namespace:
    fields = dict.fromkeys(
        ("dir", "filter", "filter_fn", "modules", "mode", "steps", "tokens", "token_dim", "max_rows"), None
    )
    fields.update(stats=None, max_pending_bytes=None, inputs=None, no_compile=False)
    fields.update(overrides)
    return argparse.Namespace(**fields)


# ------------------------------------------------------------------------------- real programs


def test_a_program_that_never_imports_tracedump_is_dumped_with_the_keys_of_an_explicit_attach(
    tmp_path: Path,
) -> None:
    script = program(tmp_path, "llama.py", LLAMA_PROGRAM)
    dump_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "tracedump", "run", "--dir", str(dump_dir), "--", sys.executable, str(script)],
        env=env_without_tracedump(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    (run,) = tracedump.open_dump(dump_dir).runs
    assert re.fullmatch(r"rank0_pid\d+", run.name)
    assert run.manifest["root"] == "LlamaForCausalLM"
    assert run.manifest["complete"] is True
    assert run.framework == "transformers" and run.framework_version  # format 1.1
    assert run.module_classes["model.layers.0.self_attn.q_proj"] == "Linear"

    reference = explicit_llama_dump(tmp_path / "explicit")
    auto_passes = {index: passfile.load() for index, passfile in run.passes.items()}
    assert sorted(auto_passes) == sorted(reference) == [0, 1]  # the very first forward is pass 0
    for index, tensors in reference.items():
        assert list(auto_passes[index]) == list(tensors)  # same keys, in the same capture order
        for key, tensor in tensors.items():
            torch.testing.assert_close(auto_passes[index][key], tensor)
    assert f"{run.name}: root LlamaForCausalLM, rank 0/1, 2 passes" in result.stderr


def test_forked_and_spawned_workers_each_dump_into_their_own_pid_dir(tmp_path: Path) -> None:
    script = program(tmp_path, "workers.py", WORKERS_PROGRAM)
    stdout = tmp_path / "pids.json"
    dump_dir = tmp_path / "run"
    command = f"{sys.executable} {script} > {stdout}"
    status = main(["run", "--dir", str(dump_dir), "--", "sh", "-c", command])
    assert status == 0
    pids = json.loads(stdout.read_text())
    runs = {run.name: run for run in tracedump.open_dump(dump_dir).runs}

    expected = {f"rank0_pid{pids['parent']}": ("Sequential", [0])}
    for pid in pids["fork"]:  # the parent's dumper, re-bound to the child at its first pass
        expected[f"rank0_pid{pid}"] = ("Sequential", [0, 1])
    for pid in pids["spawn"]:  # three roots, kept apart, named by class and order of first call
        expected[f"rank0_pid{pid}"] = ("Encoder", [0])
        expected[f"rank0_pid{pid}-2"] = ("Sequential", [0, 1])
        expected[f"rank0_pid{pid}-3"] = ("Sequential#2", [0])
    assert {name: (run.manifest["root"], sorted(run.passes)) for name, run in runs.items()} == expected
    assert all(run.complete for run in runs.values())  # forked workers end in os._exit: flushed anyway
    assert set(runs[f"rank0_pid{pids['fork'][0]}"].passes[1].names) == {"0", "1", "2"}


def test_an_existing_sitecustomize_still_runs_and_the_bootstrap_leaves_no_trace_on_sys_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    user_site = tmp_path / "user_site"
    user_site.mkdir()
    (user_site / "sitecustomize.py").write_text("import os\nos.environ['USER_SITECUSTOMIZE_RAN'] = 'yes'\n")
    monkeypatch.setenv("PYTHONPATH", str(user_site))
    script = program(tmp_path, "probe.py", PROBE_PROGRAM)
    dump_dir = tmp_path / "run"

    status = main(["run", "--dir", str(dump_dir), "--", sys.executable, str(script)])

    assert status == 0
    report = json.loads(capfd.readouterr().out)
    assert report["user_sitecustomize_ran"] == "yes"
    assert report["sitecustomize"] == str(user_site / "sitecustomize.py")
    assert report["shadowed"] is False and report["bootstrap_on_sys_path"] is False
    assert report["global_hooks"] == 2  # one pre-hook, one forward hook: the root finder
    (run,) = tracedump.open_dump(dump_dir).runs
    assert run.manifest["root"] == "Linear"
    assert run.passes[0].names == ["root"]  # a lone leaf root: its first call is captured too


def test_without_the_dump_dir_the_bootstrap_imports_and_registers_nothing(tmp_path: Path) -> None:
    script = program(tmp_path, "probe.py", PROBE_PROGRAM)
    result = subprocess.run(
        [sys.executable, str(script)],
        env=env_without_tracedump(PYTHONPATH=str(BOOTSTRAP_DIR)),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["sitecustomize"] == str(BOOTSTRAP_DIR / "sitecustomize.py")  # it did run
    assert report["tracedump_modules"] == []
    assert report["global_hooks"] == 0
    assert not any("TorchImportWatcher" in finder for finder in report["meta_path"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["probe.py"]  # no dump dir was created


# ------------------------------------------------------------------------- exit status, settings


@pytest.mark.parametrize(
    ("code", "expected"),
    [("import sys; sys.exit(7)", 7), ("import os, signal; os.kill(os.getpid(), signal.SIGTERM)", 143)],
    ids=["exit-code", "signal"],
)
def test_the_exit_status_of_the_command_is_passed_through(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], code: str, expected: int
) -> None:
    status = main(["run", "--dir", str(tmp_path / "run"), "--", sys.executable, "-c", code])
    assert status == expected
    stderr = capfd.readouterr().err
    assert f"COMMAND exited with status {expected}" in stderr
    assert "nothing written" in stderr


def test_a_command_that_does_not_exist_exits_127(tmp_path: Path) -> None:
    assert main(["run", "--dir", str(tmp_path / "run"), "--", "no-such-command-tracedump"]) == 127


def test_a_bad_setting_exits_2_before_the_command_starts(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "started"
    argv = ["run", "--dir", str(tmp_path / "run"), "--mode", "bogus", "--"]
    status = main([*argv, sys.executable, "-c", f"open({str(marker)!r}, 'w')"])
    assert status == 2
    stderr = capfd.readouterr().err
    assert "TRACEDUMP_DUMP_MODE='bogus'" in stderr
    assert not marker.exists()


def test_the_flags_become_dump_env_vars_and_the_bootstrap_goes_first_on_pythonpath(tmp_path: Path) -> None:
    args = run_args(dir=str(tmp_path / "d"), filter=["layers\\.0\\.", "lm_head"], mode="stats", inputs=True)
    env = child_env(
        {"PYTHONPATH": f"{BOOTSTRAP_DIR}{os.pathsep}/opt/site", "TRACEDUMP_DUMP_FILTER_FN": "x:y"}, args
    )
    assert env["TRACEDUMP_DUMP_DIR"] == str((tmp_path / "d").resolve())
    assert json.loads(env["TRACEDUMP_DUMP_FILTER"]) == ["layers\\.0\\.", "lm_head"]
    assert "TRACEDUMP_DUMP_FILTER_FN" not in env  # a filter flag replaces an inherited filter
    assert env["TRACEDUMP_DUMP_MODE"] == "stats" and env["TRACEDUMP_DUMP_INPUTS"] == "1"
    assert env["PYTHONPATH"].split(os.pathsep) == [str(BOOTSTRAP_DIR), "/opt/site"]  # once, first
    assert "TORCHDYNAMO_DISABLE" not in env


def test_a_grafted_run_dumps_every_module_unless_told_otherwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--graft-from`` without ``--modules`` dumps every module, as ``tracedump.graft()`` does:
    read through the settings the child builds from the environment the launcher gives it."""
    ref = tmp_path / "ref"  # a reference grafting accepts: dumped with inputs
    model = nn.Linear(2, 2)
    with tracedump.attach(model, {"dir": str(ref), "inputs": True}), torch.no_grad():
        model(torch.ones(1, 2))

    def child_modules(parent: dict[str, str], args: argparse.Namespace) -> str:
        env = child_env(parent, args)
        for name in [n for n in os.environ if n.startswith("TRACEDUMP_")]:
            monkeypatch.delenv(name)
        for name, value in env.items():
            if name.startswith("TRACEDUMP_"):
                monkeypatch.setenv(name, value)
        return load_settings().modules

    assert child_modules({}, run_args(graft_from=str(ref))) == "all"
    assert child_modules({}, run_args(graft_from=str(ref), modules="leaves")) == "leaves"
    assert child_modules({"TRACEDUMP_DUMP_MODULES": "leaves"}, run_args(graft_from=str(ref))) == "leaves"
    assert child_modules({}, run_args()) == "leaves"
    assert "TRACEDUMP_DUMP_MODULES" not in child_env({}, run_args())


def test_the_dump_dir_defaults_to_the_env_var_then_to_tracedump_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert child_env({}, run_args())["TRACEDUMP_DUMP_DIR"] == str(tmp_path / DEFAULT_DIR)
    inherited = child_env({"TRACEDUMP_DUMP_DIR": "/data/dumps"}, run_args())
    assert inherited["TRACEDUMP_DUMP_DIR"] == "/data/dumps"


# ------------------------------------------------------------------ root finding, in this process


def test_auto_attach_dumps_a_single_root_exactly_as_an_explicit_attach(
    tmp_path: Path, auto: AutoAttach
) -> None:
    model = make_tiny_llama()
    with torch.no_grad():
        for _ in range(2):
            model(torch.arange(7).reshape(1, 7))
    auto.close_dumpers()
    (auto_passes,) = dumped_passes(tmp_path / "auto").values()
    reference = explicit_llama_dump(tmp_path / "explicit")
    assert {i: list(t) for i, t in auto_passes.items()} == {i: list(t) for i, t in reference.items()}
    for index, tensors in reference.items():
        for key, tensor in tensors.items():
            assert torch.equal(auto_passes[index][key], tensor), key


def test_several_roots_are_labelled_by_class_then_number_in_order_of_first_call(
    tmp_path: Path, auto: AutoAttach
) -> None:
    text_encoder, transformer, vae = (
        make_tiny_llama().model,
        nn.Sequential(nn.Linear(4, 4)),
        nn.Sequential(nn.ReLU()),
    )
    with torch.no_grad():
        text_encoder(torch.arange(5).reshape(1, 5))
        vae(torch.ones(2, 4))
        transformer(torch.ones(2, 4))
        vae(torch.ones(2, 4))
    auto.close_dumpers()
    assert list(auto.roots) == ["LlamaModel", "Sequential", "Sequential#2"]
    runs = {run.name: run for run in tracedump.open_dump(tmp_path / "auto").runs}
    base = f"rank0_pid{os.getpid()}"
    assert {name: (run.manifest["root"], len(run.passes)) for name, run in runs.items()} == {
        base: ("LlamaModel", 1),
        f"{base}-2": ("Sequential", 2),  # the vae: first called second
        f"{base}-3": ("Sequential#2", 1),
    }
    assert runs[f"{base}-2"].passes[0].names == ["0"]  # keys relative to its own root


def test_a_root_that_the_program_attached_itself_is_not_dumped_twice(
    tmp_path: Path, auto: AutoAttach
) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    dumper = tracedump.attach(model, {"dir": tmp_path / "auto"})
    assert dumper is not None
    model(torch.ones(1, 4))
    dumper.close()
    assert auto.roots == {"Sequential": None}
    (run,) = tracedump.open_dump(tmp_path / "auto").runs
    assert sorted(run.passes) == [0]


class _Interrupting(nn.Module):
    """A root whose forward is cut by a BaseException, which skips torch's always_call post-hooks."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)
        if float(x.sum()) < 0:
            raise KeyboardInterrupt
        return y


def test_a_root_forward_cut_by_ctrl_c_does_not_hide_later_roots(tmp_path: Path, auto: AutoAttach) -> None:
    interrupted, later = _Interrupting(), nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(KeyboardInterrupt):
        interrupted(-torch.ones(1, 2))
    later(torch.ones(1, 2))
    interrupted(torch.ones(1, 2))
    auto.close_dumpers()
    assert list(auto.roots) == ["_Interrupting", "Sequential"]
    runs = {run.manifest["root"]: run for run in tracedump.open_dump(tmp_path / "auto").runs}
    assert [p.names for p in runs["_Interrupting"].passes.values()] == [["inner"], ["inner"]]
    assert [p.names for p in runs["Sequential"].passes.values()] == [["0"]]
