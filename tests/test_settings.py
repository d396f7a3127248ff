"""Settings: env > config > defaults, a custom prefix, and bad values named at attach()."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from pydantic import BaseModel

import tracedump
from tracedump.config.settings import load_settings


def test_defaults_when_only_the_dir_is_set(monkeypatch, tmp_path):
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path))
    settings = tracedump.DumpSettings()
    assert settings.dir == tmp_path
    assert settings.filter is None and settings.filter_fn is None
    assert settings.modules == "leaves" and settings.mode == "full"
    assert settings.max_pending_bytes == 4 << 30


def test_env_overlays_an_explicit_config_field_by_field(monkeypatch, tmp_path):
    config = tracedump.DumpConfig(dir=tmp_path / "from_config", modules="all", filter=[r"layers\.0\."])
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path / "from_env"))
    settings = load_settings(config)
    assert settings.dir == tmp_path / "from_env"
    assert settings.modules == "all"
    assert settings.filter == [r"layers\.0\."]


def test_config_beats_defaults(tmp_path):
    settings = load_settings(tracedump.DumpConfig(dir=tmp_path, mode="last_row"))
    assert settings.mode == "last_row" and settings.modules == "leaves"


def test_an_engine_config_can_embed_dump_config_as_a_field(monkeypatch, tmp_path, tiny_llama, prompt_ids):
    class EngineConfig(BaseModel):
        dump: tracedump.DumpConfig = tracedump.DumpConfig()

    engine = EngineConfig.model_validate({"dump": {"dir": str(tmp_path / "cfg"), "filter": ["lm_head"]}})
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path / "env"))
    dumper = tracedump.attach(tiny_llama, engine.dump)
    with torch.no_grad():
        tiny_llama(prompt_ids)
    dumper.close()
    assert dumper.run_dir.parent == tmp_path / "env"
    assert [n for n, _ in dumper.modules] == ["lm_head"]
    assert not (tmp_path / "cfg").exists()


def test_a_custom_prefix_reads_its_own_variables_only(monkeypatch, tmp_path, tiny_llama):
    monkeypatch.setenv("PHYAI_DEBUG_TENSOR_DUMP_DIR", str(tmp_path / "phyai"))
    monkeypatch.setenv("PHYAI_DEBUG_TENSOR_DUMP_FILTER", "lm_head")
    assert tracedump.attach(tiny_llama) is None
    dumper = tracedump.attach(tiny_llama, env_prefix="PHYAI_DEBUG_TENSOR_")
    dumper.close()
    assert dumper.run_dir.parent == tmp_path / "phyai"
    assert [n for n, _ in dumper.modules] == ["lm_head"]


def test_filter_accepts_a_bare_pattern_or_a_json_array(monkeypatch, tmp_path):
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path))
    monkeypatch.setenv("TRACEDUMP_DUMP_FILTER", r"layers\.0\.")
    assert tracedump.DumpSettings().filter == [r"layers\.0\."]
    monkeypatch.setenv("TRACEDUMP_DUMP_FILTER", '["q_proj$", "^lm_head$"]')
    assert tracedump.DumpSettings().filter == ["q_proj$", "^lm_head$"]


def test_filter_selects_by_re_search_on_the_full_dotted_name(monkeypatch, tmp_path, tiny_llama):
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path))
    monkeypatch.setenv("TRACEDUMP_DUMP_FILTER", '["layers\\\\.1\\\\.mlp", "^lm_head$"]')
    dumper = tracedump.attach(tiny_llama)
    dumper.close()
    assert [n for n, _ in dumper.modules] == [
        "model.layers.1.mlp.gate_proj",
        "model.layers.1.mlp.up_proj",
        "model.layers.1.mlp.down_proj",
        "model.layers.1.mlp.act_fn",
        "lm_head",
    ]


def test_filter_fn_from_a_file_path_chooses_modules(monkeypatch, tmp_path, tiny_llama):
    predicate = tmp_path / "pick.py"
    predicate.write_text("def only_norms(name, module):\n    return name.endswith('norm')\n")
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path / "d"))
    monkeypatch.setenv("TRACEDUMP_DUMP_FILTER_FN", f"{predicate}:only_norms")
    dumper = tracedump.attach(tiny_llama)
    dumper.close()
    assert [n for n, _ in dumper.modules] == [
        "model.layers.0.input_layernorm",
        "model.layers.0.post_attention_layernorm",
        "model.layers.1.input_layernorm",
        "model.layers.1.post_attention_layernorm",
        "model.norm",
    ]


def test_filter_fn_from_a_module_path(monkeypatch, tmp_path, tiny_llama):
    package = tmp_path / "pkg_td"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "select.py").write_text("def heads(name, module):\n    return name == 'lm_head'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path / "d"))
    monkeypatch.setenv("TRACEDUMP_DUMP_FILTER_FN", "pkg_td.select:heads")
    dumper = tracedump.attach(tiny_llama)
    dumper.close()
    assert [n for n, _ in dumper.modules] == ["lm_head"]


def test_a_filter_that_selects_nothing_warns_with_real_names(monkeypatch, tmp_path, tiny_llama):
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path))
    monkeypatch.setenv("TRACEDUMP_DUMP_FILTER", "no_such_module")
    with pytest.warns(tracedump.TracedumpWarning, match=r"selects no module.*model\.embed_tokens"):
        dumper = tracedump.attach(tiny_llama)
    dumper.close()
    assert dumper.modules == []


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("FILTER", "layers.(0", "invalid regex"),
        ("FILTER", '["ok", "bad(("]', "invalid regex"),
        ("FILTER", '["unterminated', "malformed JSON array"),
        ("FILTER_FN", "no_such_package_xyz.mod:func", "cannot import module"),
        ("FILTER_FN", "/no/such/file.py:func", "does not exist"),
        ("FILTER_FN", "os.path:no_such_function", "has no attribute"),
        ("FILTER_FN", "os:sep", "not callable"),
        ("FILTER_FN", "just_a_name", "expected 'pkg.module:func'"),
        ("MODULES", "some", "leaves"),
        ("MODE", "everything", "full"),
        ("INPUTS", "maybe", "1/true/yes/on"),
        ("MAX_PENDING_BYTES", "lots", "byte count"),
    ],
)
def test_bad_values_fail_at_attach_naming_the_variable_and_the_value(
    monkeypatch, tmp_path, tiny_llama, variable, value, message
):
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path / "dump"))
    monkeypatch.setenv(f"TRACEDUMP_DUMP_{variable}", value)
    with pytest.raises(tracedump.ConfigError) as caught:
        tracedump.attach(tiny_llama)
    text = str(caught.value)
    assert f"TRACEDUMP_DUMP_{variable}={value!r}" in text
    assert message in text
    assert not (tmp_path / "dump").exists()
    assert not any(m._forward_hooks for m in tiny_llama.modules())


def test_filter_and_filter_fn_together_are_refused(monkeypatch, tmp_path, tiny_llama):
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path))
    monkeypatch.setenv("TRACEDUMP_DUMP_FILTER", "lm_head")
    monkeypatch.setenv("TRACEDUMP_DUMP_FILTER_FN", "os.path:isabs")
    with pytest.raises(tracedump.ConfigError, match=r"TRACEDUMP_DUMP_FILTER.*TRACEDUMP_DUMP_FILTER_FN"):
        tracedump.attach(tiny_llama)


def test_bad_config_values_name_the_config_field(tmp_path, tiny_llama):
    with pytest.raises(tracedump.ConfigError, match=r"DumpConfig\.filter"):
        tracedump.attach(tiny_llama, {"dir": str(tmp_path), "filter": ["(("]})


def test_a_dump_dir_that_cannot_be_created_fails_at_attach(monkeypatch, tmp_path, tiny_llama):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(blocker / "dump"))
    with pytest.raises(tracedump.ConfigError, match=r"TRACEDUMP_DUMP_DIR=.*cannot create or write"):
        tracedump.attach(tiny_llama)
    assert not any(m._forward_hooks for m in tiny_llama.modules())


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write into a read-only directory")
def test_a_dump_dir_that_is_not_writable_fails_at_attach(monkeypatch, tmp_path, tiny_llama):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(locked))
    with pytest.raises(tracedump.ConfigError, match="TRACEDUMP_DUMP_DIR"):
        tracedump.attach(tiny_llama)


def test_a_read_only_filesystem_dir_fails_at_attach_even_as_root(monkeypatch, tiny_llama):
    target = Path("/proc/tracedump-cannot-write-here")
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(target))
    with pytest.raises(tracedump.ConfigError, match="cannot create or write"):
        tracedump.attach(tiny_llama)


@pytest.mark.parametrize("text", ["1", "true", "YES", "on"])
def test_booleans_accept_exactly_the_documented_true_words(monkeypatch, tmp_path, text):
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path))
    monkeypatch.setenv("TRACEDUMP_DUMP_INPUTS", text)
    assert tracedump.DumpSettings().inputs is True


@pytest.mark.parametrize("text", ["0", "false", "No", "off"])
def test_booleans_accept_exactly_the_documented_false_words(monkeypatch, tmp_path, text):
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path))
    monkeypatch.setenv("TRACEDUMP_DUMP_INPUTS", text)
    assert tracedump.DumpSettings().inputs is False


def test_settings_are_read_once_at_attach(monkeypatch, tmp_path, tiny_llama, prompt_ids):
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path))
    monkeypatch.setenv("TRACEDUMP_DUMP_FILTER", "lm_head")
    dumper = tracedump.attach(tiny_llama)
    monkeypatch.setenv("TRACEDUMP_DUMP_FILTER", "embed_tokens")
    monkeypatch.setenv("TRACEDUMP_DUMP_MODE", "stats")
    with torch.no_grad():
        tiny_llama(prompt_ids)
    dumper.close()
    assert list(tracedump.load_pass(dumper.run_dir / "pass00000.safetensors")) == ["lm_head"]


def test_a_misspelt_env_var_is_refused_rather_than_ignored(monkeypatch, tmp_path, tiny_llama):
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path))
    monkeypatch.setenv("TRACEDUMP_DUMP_FILTERS", "lm_head")
    with pytest.raises(tracedump.ConfigError, match=r"unknown setting\(s\): TRACEDUMP_DUMP_FILTERS;.*FILTER"):
        tracedump.attach(tiny_llama)


def test_a_misspelt_config_key_is_refused_rather_than_ignored(tmp_path, tiny_llama):
    with pytest.raises(tracedump.ConfigError, match=r"DumpConfig\.mdoe"):
        tracedump.attach(tiny_llama, {"dir": str(tmp_path), "mdoe": "stats"})


def test_an_empty_env_var_means_unset_and_keeps_the_config_value(monkeypatch, tmp_path):
    monkeypatch.setenv("TRACEDUMP_DUMP_FILTER", "")
    monkeypatch.setenv("TRACEDUMP_DUMP_MAX_ROWS", "")
    settings = load_settings(tracedump.DumpConfig(dir=tmp_path, filter=["lm_head"], max_rows=1))
    assert settings.filter == ["lm_head"] and settings.max_rows == 1


@pytest.mark.parametrize("name", ["TRACEDUMP_DUMP_INPUTS", "TRACEDUMP_DUMP_CONTROL"])
@pytest.mark.parametrize("text", ["t", "y", "2", "enabled"])
def test_every_boolean_refuses_words_outside_the_documented_ones(monkeypatch, tmp_path, name, text):
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path))
    monkeypatch.setenv(name, text)
    with pytest.raises(tracedump.ConfigError, match=name):
        tracedump.config.settings.load_settings()
