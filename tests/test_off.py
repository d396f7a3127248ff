"""Off means off: without a dump dir, attach() leaves no trace anywhere (the CI guard)."""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import threading

import torch
import torch.nn.modules.module as torch_module

import tracedump

_GLOBAL_HOOK_DICTS = (
    "_global_forward_hooks",
    "_global_forward_hooks_always_called",
    "_global_forward_pre_hooks",
    "_global_backward_hooks",
    "_global_backward_pre_hooks",
    "_global_module_registration_hooks",
    "_global_parameter_registration_hooks",
    "_global_buffer_registration_hooks",
)
_MODULE_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def assert_no_hooks_anywhere(model: torch.nn.Module) -> None:
    for name in _GLOBAL_HOOK_DICTS:
        assert not getattr(torch_module, name, {}), name
    for module_name, module in model.named_modules():
        for attr in _MODULE_HOOK_DICTS:
            assert not getattr(module, attr, {}), f"{module_name or 'root'}.{attr}"


def test_attach_without_dump_dir_returns_none_and_registers_nothing(
    tiny_llama, prompt_ids, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    threads_before = set(threading.enumerate())
    atexit_before = atexit._ncallbacks()

    assert tracedump.attach(tiny_llama) is None
    with torch.no_grad():
        tiny_llama(prompt_ids)

    assert_no_hooks_anywhere(tiny_llama)
    assert set(threading.enumerate()) == threads_before
    assert atexit._ncallbacks() == atexit_before
    assert list(tmp_path.iterdir()) == []


def test_empty_dump_dir_is_off(tiny_llama, monkeypatch):
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", "")
    assert tracedump.attach(tiny_llama) is None
    assert_no_hooks_anywhere(tiny_llama)


def test_off_with_a_config_that_names_no_dir(tiny_llama):
    assert tracedump.attach(tiny_llama, tracedump.DumpConfig(filter=["lm_head"])) is None
    assert_no_hooks_anywhere(tiny_llama)


def test_no_hooks_remain_after_an_on_run_is_closed(tiny_llama, prompt_ids, tmp_path, monkeypatch):
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path))
    dumper = tracedump.attach(tiny_llama)
    with torch.no_grad():
        tiny_llama(prompt_ids)
    dumper.close()
    assert_no_hooks_anywhere(tiny_llama)


def test_module_level_record_and_profiling_are_noops_without_a_dumper(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with tracedump.profiling():
        tracedump.record("x", torch.ones(2))
        tracedump.record_step("margin", torch.ones(1))
    assert list(tmp_path.iterdir()) == []


def test_importing_tracedump_stays_light_and_does_nothing():
    code = (
        "import sys, threading, torch.nn.modules.module as m\n"
        "before = set(sys.modules)\n"
        "import tracedump\n"
        "new = set(sys.modules) - before\n"
        "heavy = sorted(n for n in new if n.split('.')[0] in ('rich', 'matplotlib', 'transformers'))\n"
        "assert not heavy, heavy\n"
        "assert threading.active_count() == 1\n"
        "assert not m._global_forward_hooks and not m._global_forward_pre_hooks\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRACEDUMP_")}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
