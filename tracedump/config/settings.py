"""The settings in effect: what to dump, read once at ``attach()``, from **env > explicit config >
defaults**, so an operator can overlay an env var on a config that the engine built itself. A
field's env var is ``<prefix>DUMP_<FIELD>`` (``TRACEDUMP_DUMP_DIR``; an engine may pick its own prefix).

The parts live beside this module: the fields (:mod:`.fields`), their value parsers
(:mod:`.parsing`), the env and config sources and each value's origin (:mod:`.sources`), and the
import of user code (:mod:`.usercode`). Here they are put together: each value is parsed once into
its typed field; :meth:`DumpSettings.origin` says where it came from, and a bad value is a
:class:`ConfigError` naming that place and the value. User code (``FILTER_FN``, ``SYNC_ESCAPE``) is
imported by :meth:`DumpSettings.resolve_callables` only, at ``attach()``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, PrivateAttr, ValidationError, ValidatorFunctionWrapHandler, model_validator
from pydantic_core import PydanticCustomError
from pydantic_settings import BaseSettings, SettingsConfigDict

from ..errors import ConfigError
from .fields import DumpFields
from .reference import written_into_reference
from .sources import FILTER_CHOICE, ConfigSource, EnvSource, Origin, origin_of
from .switch import DEFAULT_ENV_PREFIX
from .usercode import UserCallables, load_callable


class DumpConfig(DumpFields):
    """The dump settings as a plain pydantic model, for an engine to embed in its own config
    (``dump: tracedump.DumpConfig = tracedump.DumpConfig()``, then ``attach(model, config.dump)``).
    Only the fields set explicitly take part in the merge, so env vars still overlay the rest."""


class DumpSettings(BaseSettings, DumpFields):
    """The settings in effect, validated once. ``DumpSettings()`` reads ``TRACEDUMP_DUMP_*``;
    :func:`load_settings` picks another prefix and raises :class:`ConfigError`."""

    # case_sensitive: a config key in another case ({"MODE": ...}) is unknown, not ``mode``
    model_config = SettingsConfigDict(env_prefix=DEFAULT_ENV_PREFIX + "DUMP_", case_sensitive=True)
    _origins: dict[str, Origin] = PrivateAttr(default_factory=dict)
    _callables: UserCallables | None = PrivateAttr(None)

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, **_):  # type: ignore[no-untyped-def, override]
        """Env first, then the config: the order is the precedence. Nothing else (.env files,
        secrets dirs) is read."""
        env = EnvSource(settings_cls, env_settings.env_prefix)
        return (env, ConfigSource(settings_cls, init_settings, env))

    @model_validator(mode="wrap")
    @classmethod
    def _validate_with_origins(cls, data: Any, handler: ValidatorFunctionWrapHandler) -> DumpSettings:
        """Note where each value came from before the validators turn it into a plain value, and
        name that place (env var or config field, and the value as given) in every error."""
        if not isinstance(data, dict):
            return handler(data)
        origins = {field: origin_of(field, data.get(field, "")) for field in cls.model_fields}
        try:
            settings = handler(data)
        except ValidationError as e:
            said = [item for item in e.errors() if item["type"] == "bad_setting"]
            if said:  # a validation of the same model inside this one (model_validate) already said where
                raise PydanticCustomError("bad_setting", "{message}", said[0].get("ctx") or {}) from e
            lines = []
            for item in e.errors():
                fields = [str(item["loc"][0])] if item["loc"] else FILTER_CHOICE  # else: FILTER vs FILTER_FN
                where = " / ".join(str(origins.get(field, field)) for field in fields)
                lines.append(f"{where}: {item['msg'].removeprefix('Value error, ')}")
            message = "tracedump: bad setting\n  " + "\n  ".join(lines)
            raise PydanticCustomError("bad_setting", "{message}", {"message": message}) from e
        settings._origins = origins
        return settings

    @property
    def origins(self) -> dict[str, Origin]:
        """Where each field's value came from (env: which variable, what text; config; default)."""
        return {field: self._origins.get(field) or origin_of(field, "") for field in type(self).model_fields}

    def origin(self, field: str) -> Origin:
        """:attr:`origins` of one field; KeyError for a name that is no field."""
        return self.origins[field]

    def describe(self, field: str) -> str:
        """``TRACEDUMP_DUMP_DIR='/x'`` when the env var set it, else ``DumpConfig.dir='/x'``: errors
        say where a value came from, so the person reading them knows what to change."""
        if (origin := self.origin(field)).kind == "env":
            return str(origin)
        return f"DumpConfig.{field}={self.model_dump(mode='json', include={field})[field]!r}"

    def resolve_callables(self) -> UserCallables:
        """Import ``FILTER_FN`` and ``SYNC_ESCAPE``, once per settings object (``attach()`` calls it,
        before the first hook). A failure is a :class:`ConfigError` naming where the spec came from."""
        if self._callables is None:
            resolved: dict[str, Any] = {}
            for field in ("filter_fn", "sync_escape"):
                spec = getattr(self, field)
                try:
                    resolved[field] = load_callable(spec) if spec is not None else None
                except ValueError as e:
                    raise ConfigError(f"tracedump: bad setting\n  {self.describe(field)}: {e}") from e
            self._callables = UserCallables(**resolved)
        return self._callables

    def summary(self) -> dict[str, Any]:
        """JSON-safe view of the settings in effect, for the manifest."""
        return self.model_dump(mode="json")


def load_settings(
    config: DumpConfig | DumpFields | dict[str, Any] | None = None, env_prefix: str = DEFAULT_ENV_PREFIX
) -> DumpSettings:
    """Read the settings once: env > ``config`` > defaults. Raises :class:`ConfigError`. Imports no
    user code; :meth:`DumpSettings.resolve_callables` does."""
    if isinstance(config, BaseModel):  # only the fields it set explicitly take part
        config = {
            name: getattr(config, name) for name in config.model_fields_set & DumpFields.model_fields.keys()
        }
    elif not isinstance(config, (dict, type(None))):
        raise ConfigError(
            f"config must be a tracedump.DumpConfig, a dict or None, not {type(config).__name__}"
        )
    try:
        return DumpSettings(**(config or {}), _env_prefix=env_prefix + "DUMP_")
    except ValidationError as e:
        raise _config_error(e) from e


def settings_of_call(values: dict[str, Any]) -> DumpSettings:
    """The settings a script's own call spells out (``graft()``, ``Capture.save()``), with no env
    read: a bad value raises :class:`ConfigError` naming the field, as ``load_settings`` does."""
    try:
        return DumpSettings.model_validate(values)
    except ValidationError as e:
        raise _config_error(e) from e


def _config_error(error: ValidationError) -> ConfigError:
    messages = [item["msg"] for item in error.errors() if item["type"] == "bad_setting"]
    return ConfigError("\n".join(messages) or str(error))


def check_combination(settings: DumpSettings) -> None:
    """Settings each valid alone that cannot go together (raises :class:`ConfigError`): checked by
    ``attach()`` and by ``tracedump run`` before it starts COMMAND.

    ``CONTROL`` numbers passes by engine step and arms windows of them; ``STEPS`` would select
    fixed ones, so an armed window outside them would dump nothing and never end: refused. A
    ``DIR`` inside the dump that ``GRAFT_FROM`` reads would add a run to the reference: refused."""
    if settings.dir is not None and settings.graft_from is not None:
        inside = written_into_reference(settings.dir, settings.graft_from)
        if inside is not None:
            both = f"{settings.describe('dir')} with {settings.describe('graft_from')}"
            raise ConfigError(
                f"tracedump: bad setting\n  {both}: "
                f"the dump would be written into the reference it reads ({inside} is inside that dump): "
                "a grafted run never writes into its reference. Choose a DIR outside it"
            )
    if settings.control and settings.steps is not None:
        raise ConfigError(
            f"tracedump: bad setting\n  {settings.describe('steps')} with {settings.describe('control')}: "
            "STEPS cannot be combined with CONTROL (an armed window outside STEPS would dump nothing "
            "and never end); unset STEPS and choose the steps with `tracedump arm DIR --steps N`"
        )
