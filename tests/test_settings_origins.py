"""One settings source: where each value came from, one rule for "on", and user code imported at
``attach()`` only, never by building a DumpConfig or DumpSettings."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from unittest import mock

import pytest
import torch
from torch import nn

import tracedump
from tracedump.config.settings import load_settings
from tracedump.config.sources import Origin
from tracedump.config.switch import is_enabled
from tracedump.util.ranges import IndexRanges


class _Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(2, 2)
        self.b = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def _hook_count(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


# ------------------------------------------------------------------------------------- provenance


def test_each_field_reports_whether_env_config_or_default_set_it(monkeypatch, tmp_path):
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", f" {tmp_path} ")
    monkeypatch.setenv("TRACEDUMP_DUMP_MODE", "Stats")
    monkeypatch.setenv("TRACEDUMP_DUMP_TOKENS", "")  # empty: unset, so the config's value stays
    config = {"mode": "last_row", "filter": ["lm_head"], "tokens": 7, "stats": "  "}
    settings = load_settings(config)

    assert settings.origin("dir") == Origin("env", "TRACEDUMP_DUMP_DIR", f" {tmp_path} ")
    assert settings.origin("mode") == Origin("env", "TRACEDUMP_DUMP_MODE", "Stats")  # env beat config
    assert settings.origin("filter") == Origin("config", "DumpConfig.filter", ["lm_head"])
    assert settings.origin("tokens") == Origin("config", "DumpConfig.tokens", 7)
    assert settings.origin("stats").kind == "default"  # a blank config value is unset
    assert settings.origin("max_rows").kind == "default"
    assert {field: o.kind for field, o in settings.origins.items()} == {
        **dict.fromkeys(type(settings).model_fields, "default"),
        "dir": "env",
        "mode": "env",
        "filter": "config",
        "tokens": "config",
    }
    assert settings.describe("dir") == f"TRACEDUMP_DUMP_DIR={f' {tmp_path} '!r}"
    assert settings.describe("tokens") == "DumpConfig.tokens=7"
    assert (settings.mode, settings.tokens, settings.dir) == ("stats", 7, tmp_path)


def test_a_dump_config_instance_counts_only_its_explicit_fields_as_config(monkeypatch, tmp_path):
    settings = load_settings(tracedump.DumpConfig(dir=tmp_path, inputs=True))
    assert settings.origin("dir").kind == settings.origin("inputs").kind == "config"
    assert settings.origin("mode").kind == "default"  # DumpConfig's own default is not a choice


def test_an_env_filter_fn_replaces_a_config_filter_and_the_origins_say_so(monkeypatch, tmp_path):
    monkeypatch.setenv("TRACEDUMP_DUMP_FILTER_FN", "os.path:isabs")
    settings = load_settings({"dir": tmp_path, "filter": ["lm_head"]})
    assert settings.filter is None and settings.filter_fn == "os.path:isabs"
    assert settings.origin("filter").kind == "default"
    assert settings.origin("filter_fn") == Origin("env", "TRACEDUMP_DUMP_FILTER_FN", "os.path:isabs")


def test_a_custom_prefix_names_its_own_variable_as_the_origin(monkeypatch, tmp_path):
    monkeypatch.setenv("MYENGINE_DUMP_DIR", str(tmp_path))
    monkeypatch.setenv("TRACEDUMP_DUMP_MODE", "stats")  # another prefix's variable: not ours
    settings = load_settings(None, env_prefix="MYENGINE_")
    assert settings.origin("dir") == Origin("env", "MYENGINE_DUMP_DIR", str(tmp_path))
    assert settings.origin("mode").kind == "default" and settings.mode == "full"


def test_the_dumper_s_settings_keep_their_origins(monkeypatch, tmp_path):
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path))
    with tracedump.attach(_Two(), {"modules": "all"}) as dumper:
        assert dumper.settings.origin("dir").kind == "env"
        assert dumper.settings.origin("modules") == Origin("config", "DumpConfig.modules", "all")


def test_an_error_names_the_origin_of_each_bad_value_even_after_normalising(monkeypatch, tmp_path):
    monkeypatch.setenv("TRACEDUMP_DUMP_MODULES", " Some ")  # stripped and lowered before it fails
    with pytest.raises(tracedump.ConfigError) as caught:
        load_settings({"dir": tmp_path, "steps": "3-1"})
    text = str(caught.value)
    assert "TRACEDUMP_DUMP_MODULES=' Some ': " in text
    assert "DumpConfig.steps='3-1': bad range" in text


# ------------------------------------------------------------------------------------- typed fields


def test_steps_is_parsed_once_into_a_step_selection():
    config = tracedump.DumpConfig(steps=" 0, 3,10-20 ")
    assert config.steps == IndexRanges(((0, 0), (3, 3), (10, 20)))
    assert 15 in config.step_selection and 4 not in config.step_selection
    assert tracedump.DumpConfig(steps=[1, 2]).steps == IndexRanges(((1, 1), (2, 2)))
    assert tracedump.DumpConfig(steps=4).steps == IndexRanges(((4, 4),))
    assert tracedump.DumpConfig(steps=",").steps is None  # nothing selected: every pass
    assert 123 in tracedump.DumpConfig().step_selection


def test_the_manifest_writes_steps_as_text(tmp_path):
    settings = load_settings({"dir": tmp_path, "steps": "0, 3,10-20"})
    assert settings.summary()["steps"] == "0,3,10-20"
    assert load_settings({"dir": tmp_path}).summary()["steps"] is None


# ------------------------------------------------------------------------------------- on and off


@pytest.mark.parametrize("env_dir", [None, "", "   ", "/tmp/td-env"])
@pytest.mark.parametrize("config_dir", [None, "", "  ", "/tmp/td-config"])
def test_the_off_path_and_the_settings_agree_on_whether_dumping_is_on(monkeypatch, env_dir, config_dir):
    if env_dir is not None:
        monkeypatch.setenv("TRACEDUMP_DUMP_DIR", env_dir)
    config = {} if config_dir is None else {"dir": config_dir}
    assert is_enabled(config) == load_settings(config).enabled
    assert is_enabled(config) == bool((env_dir or "").strip() or (config_dir or "").strip())


class _CountingEnviron(Mapping[str, str]):
    """os.environ that counts every read."""

    def __init__(self, values: Mapping[str, str]) -> None:
        self._values = dict(values)
        self.reads: list[str] = []

    def __getitem__(self, key: str) -> str:
        self.reads.append(key)
        return self._values[key]

    def get(self, key, default=None):  # type: ignore[no-untyped-def, override]
        self.reads.append(key)
        return self._values.get(key, default)

    def __iter__(self) -> Iterator[str]:
        self.reads.append("<iter>")
        return iter(self._values)

    def __len__(self) -> int:
        self.reads.append("<len>")
        return len(self._values)


def test_off_attach_reads_one_env_variable_and_builds_no_settings(monkeypatch):
    import tracedump.dump.dumper

    model = _Two()
    environ = _CountingEnviron({k: v for k, v in os.environ.items() if not k.startswith("TRACEDUMP_")})

    def no_settings(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("the off path must not build settings")

    monkeypatch.setattr(tracedump.dump.dumper, "load_settings", no_settings)
    with mock.patch.object(os, "environ", environ):  # not monkeypatch: pytest writes os.environ
        result = tracedump.attach(model, tracedump.DumpConfig(mode="stats"))
    assert result is None
    assert environ.reads == ["TRACEDUMP_DUMP_DIR"]
    assert _hook_count(model) == 0


# ------------------------------------------------------------------------ user code runs at attach()

_NOISY = """\
import pathlib
with pathlib.Path({marker!r}).open("a") as f:
    f.write("imported\\n")
print("user module imported")
{body}
"""
_RAISES = "raise RuntimeError('boom at import')"
_PICKS = """\
import contextlib

def pick(name, module):
    return name == "b"

def guard():
    return contextlib.nullcontext()
"""


def _noisy_module(directory: Path, name: str, body: str) -> Path:
    marker = directory / f"{name}.imported"
    (directory / f"{name}.py").write_text(_NOISY.format(marker=str(marker), body=body))
    return marker


def _build_everything_but_attach(tmp_path: Path) -> None:
    """Every way to build settings, none of which may import the user's module."""
    tracedump.DumpSettings()
    load_settings()
    config = tracedump.DumpConfig(
        dir=tmp_path / "cfg", filter_fn=os.environ["TRACEDUMP_DUMP_FILTER_FN"], sync_escape="noisy_td:guard"
    )
    load_settings(config)
    load_settings(config.model_dump(exclude_unset=True))


@pytest.mark.parametrize("form", ["file", "module"])
def test_building_settings_does_not_import_filter_fn_and_attach_does_once(
    monkeypatch, tmp_path, capsys, form
):
    marker = _noisy_module(tmp_path, "noisy_td", _PICKS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "noisy_td", raising=False)
    spec = f"{tmp_path / 'noisy_td.py'}:pick" if form == "file" else "noisy_td:pick"
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path / "dump"))
    monkeypatch.setenv("TRACEDUMP_DUMP_FILTER_FN", spec)
    monkeypatch.setenv("TRACEDUMP_DUMP_SYNC_ESCAPE", "noisy_td:guard")

    _build_everything_but_attach(tmp_path)
    assert not marker.exists()
    assert "noisy_td" not in sys.modules
    assert capsys.readouterr().out == ""

    settings = load_settings()
    callables = settings.resolve_callables()
    assert settings.resolve_callables() is callables  # resolved once per settings object
    assert callables.filter_fn is not None and callables.filter_fn("b", None) is True
    assert "user module imported" in capsys.readouterr().out

    with tracedump.attach(_Two()) as dumper:
        assert [name for name, _ in dumper.modules] == ["b"]
    assert marker.read_text().count("imported") == (2 if form == "file" else 1)  # once per file/module


@pytest.mark.parametrize("form", ["file", "module"])
def test_attach_with_a_filter_fn_that_raises_on_import_fails_fast_naming_the_variable_and_value(
    monkeypatch, tmp_path, form
):
    marker = _noisy_module(tmp_path, "noisy_td", _RAISES)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "noisy_td", raising=False)
    spec = f"{tmp_path / 'noisy_td.py'}:pick" if form == "file" else "noisy_td:pick"
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path / "dump"))
    monkeypatch.setenv("TRACEDUMP_DUMP_FILTER_FN", spec)

    settings = load_settings()  # building them is fine: nothing imported yet
    assert settings.filter_fn == spec and not marker.exists()

    model = _Two()
    with pytest.raises(tracedump.ConfigError) as caught:
        tracedump.attach(model)
    text = str(caught.value)
    assert f"TRACEDUMP_DUMP_FILTER_FN={spec!r}" in text
    assert "RuntimeError: boom at import" in text
    assert marker.exists()  # attach() is where it was imported
    assert _hook_count(model) == 0
    assert not (tmp_path / "dump").exists()


def test_attach_names_the_config_field_when_the_bad_filter_fn_came_from_the_config(tmp_path):
    with pytest.raises(
        tracedump.ConfigError, match=r"DumpConfig\.filter_fn='no_such_module_td:pick': cannot"
    ):
        tracedump.attach(_Two(), {"dir": str(tmp_path / "d"), "filter_fn": "no_such_module_td:pick"})
    assert not (tmp_path / "d").exists()


def test_a_filter_fn_of_the_wrong_shape_fails_when_settings_are_built(monkeypatch):
    monkeypatch.setenv("TRACEDUMP_DUMP_FILTER_FN", "not_a_spec")
    with pytest.raises(tracedump.ConfigError, match=r"TRACEDUMP_DUMP_FILTER_FN='not_a_spec': expected 'pkg"):
        load_settings()


def test_a_bad_sync_escape_env_var_fails_attach_even_when_the_argument_overrides_it(monkeypatch, tmp_path):
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path / "dump"))
    monkeypatch.setenv("TRACEDUMP_DUMP_FILTER", "^b$")  # no FILTER_FN to import either
    monkeypatch.setenv("TRACEDUMP_DUMP_SYNC_ESCAPE", "no_such_module_td:guard")
    model = _Two()
    with pytest.raises(tracedump.ConfigError, match=r"TRACEDUMP_DUMP_SYNC_ESCAPE='no_such_module_td:guard'"):
        tracedump.attach(model, sync_escape=contextlib.nullcontext)
    assert _hook_count(model) == 0 and not (tmp_path / "dump").exists()
