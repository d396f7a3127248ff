"""Where the settings come from: **env > explicit config > defaults**, and where each value came from.

:class:`EnvSource` is the one reader of the environment (:func:`.switch.is_enabled`, the off path, looks
up one variable by the same rules); :class:`ConfigSource` takes the engine's config. Both plug into
pydantic-settings' source API, which merges them in that order. :class:`Origin` records where a
value came from, so that an error names the variable or config field to change.

Why :class:`EnvSource` reads ``os.environ`` itself rather than configuring pydantic-settings' own
``EnvSettingsSource``: configured fully (``case_sensitive=False``, ``env_prefix``,
``enable_decoding=False``, then blank values dropped, each value wrapped in :class:`EnvValue` and
the environment scanned again for unknown names) it passes every settings test, but it is no
shorter, and it cannot give the rule itself:

- *exactly upper-case names*: case-sensitive, it looks up the field name as written
  (``TRACEDUMP_DUMP_dir``); case-insensitive, it reads ``tracedump_dump_mode`` as MODE, and the
  rule would rest on the scan below refusing what the library had read. Upper-case aliases
  (``validation_alias="DIR"``, prefixed through ``env_prefix_target``) would also become keys
  that ``DumpConfig`` accepts (``DumpConfig(DIR=...)``);
- *blank is unset*: ``env_ignore_empty`` drops ``""`` but not ``"   "``;
- *unknown names refused*: it ignores a prefixed variable that is no field (``..._FILTERS``);
- *the origin*: it returns plain strings, which lose the variable's name in the merge.

So the scan of ``os.environ`` that the last two need anyway does the reading too (about 15 lines).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Literal

from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

from ..errors import ConfigError
from .switch import is_blank

FILTER_CHOICE = ("filter", "filter_fn")  # one choice: a source that sets either replaces both


class EnvValue(str):
    """An env var's text that keeps the variable's name through pydantic-settings' merge of the
    sources, so that DumpSettings can record its origin."""

    name: str

    def __new__(cls, name: str, text: str) -> EnvValue:
        value = super().__new__(cls, text)
        value.name = name
        return value


@dataclass(frozen=True)
class Origin:
    """Where a setting's value came from: ``env`` (``name`` is the variable, ``raw`` its text),
    ``config`` (``name`` is ``DumpConfig.<field>``, ``raw`` the value given) or ``default``."""

    kind: Literal["env", "config", "default"]
    name: str
    raw: Any = None

    def __str__(self) -> str:
        if self.kind == "default":
            return f"{self.name} (default)"
        shown = repr(self.raw)  # a 100 kB value would bury the message: its start says enough
        shown = shown if len(shown) <= 200 else f"{shown[:200]}... ({len(shown)} chars)"
        return f"{self.name}={shown}"


def origin_of(field: str, value: Any) -> Origin:
    """Where ``field``'s merged value came from; pass ``""`` when no source set it."""
    if isinstance(value, EnvValue):
        return Origin("env", value.name, str(value))
    return Origin(
        "default" if is_blank(value) else "config", f"DumpConfig.{field}", None if is_blank(value) else value
    )


class _Source(PydanticBaseSettingsSource):
    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # unused: __call__ gives every value at once


class EnvSource(_Source):
    """The one reader of the environment for settings: ``<prefix>DUMP_<FIELD>``, ``FIELD`` exactly
    upper-case, blank = unset. Any other name with the prefix in any case (``..._FILTERS``,
    ``tracedump_dump_mode``) goes to :attr:`unknown`, refused by :class:`ConfigSource`: a name in
    another case is never read, so it cannot silently win or lose against the upper-case one.
    (Why not pydantic-settings' ``EnvSettingsSource``: the module docstring.)"""

    def __init__(self, settings_cls: type[BaseSettings], prefix: str) -> None:
        super().__init__(settings_cls)
        self.names = names = {prefix + field.upper(): field for field in settings_cls.model_fields}
        self.values: dict[str, EnvValue] = {}
        self.unknown: list[str] = []
        for key, text in os.environ.items():
            if key in names:
                if text.strip():
                    self.values[names[key]] = EnvValue(key, text)
            elif key.upper().startswith(prefix.upper()):
                field = key[len(prefix) :].lower()
                hint = f" (names are upper-case: {prefix}{field.upper()})" if field in names.values() else ""
                self.unknown.append(key + hint)

    def __call__(self) -> dict[str, Any]:
        return dict(self.values)


class ConfigSource(_Source):
    """The engine's explicit config (the ``DumpSettings(...)`` keywords), below the env. It refuses
    unknown names, its own and the env's: a misspelt setting would otherwise be ignored, silently.
    An env var for ``FILTER`` or ``FILTER_FN`` replaces a config filter of either kind, so the
    operator overlays a choice rather than colliding with the engine's."""

    def __init__(self, settings_cls: type[BaseSettings], init: PydanticBaseSettingsSource, env: EnvSource):
        super().__init__(settings_cls)
        self.init, self.env = init, env

    def __call__(self) -> dict[str, Any]:
        values = self.init()
        fields = self.settings_cls.model_fields
        unknown = [f"DumpConfig.{key}" for key in values if key not in fields] + self.env.unknown
        if unknown:
            raise ConfigError(
                f"tracedump: bad setting\n  unknown setting(s): {', '.join(sorted(unknown))}; "
                f"known: {', '.join(self.env.names)}"
            )
        if any(field in self.env.values for field in FILTER_CHOICE):
            values = {key: value for key, value in values.items() if key not in FILTER_CHOICE}
        return values
