"""Settings: what to dump, read once at ``attach()``.

Every field can come from three places. Precedence is **env > explicit config > defaults**, so an
operator can overlay an env var on a config that the engine built itself, without a code change.
The env name of a field is ``<prefix>DUMP_<FIELD>`` (``TRACEDUMP_DUMP_DIR`` for the default prefix;
an engine picks its own prefix, e.g. ``PHYAI_DEBUG_TENSOR_`` gives ``PHYAI_DEBUG_TENSOR_DUMP_DIR``).

One place reads each thing:

- :class:`EnvSource` is the only reader of the environment for settings (exact upper-case names,
  blank = unset, any other ``<prefix>DUMP_*`` spelling refused); :func:`is_enabled`, the off path,
  looks up one variable by the same name and the same blank rule.
- :class:`ConfigSource` takes the engine's explicit config; the order of the two sources is the
  precedence, and ``FILTER``/``FILTER_FN`` count as one choice there.
- The validators parse each value once into its typed field (``steps`` is a
  :class:`StepSelection`); every settings object records where each value came from
  (:meth:`DumpSettings.origin`: env, config or default), and errors name that place.
- User code (``FILTER_FN``, ``SYNC_ESCAPE``) is imported by :meth:`DumpSettings.resolve_callables`,
  which ``attach()`` calls, never by building a :class:`DumpConfig` or :class:`DumpSettings`.

A bad value fails at ``attach()`` with a :class:`ConfigError` that names the env var (or config
field) and the value.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import sys
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    PrivateAttr,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

DEFAULT_ENV_PREFIX = "TRACEDUMP_"
STAT_NAMES = (
    "abs_mean",
    "sum",
    "min",
    "max",
    "mean",
    "std",
    "l2",
    "nan_count",
    "inf_count",
    "shape",
    "dtype",
)
DEFAULT_STATS = ("abs_mean", "sum", "max", "shape")
DEFAULT_MAX_PENDING_BYTES = 4 << 30
_MAX_BYTE_SIZE = 1 << 63
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_BYTE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 1 << 30,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tb": 1 << 40,
    "tib": 1 << 40,
}


class ConfigError(ValueError):
    """A setting has a bad value. The message names the env var (or config field) and the value."""


# ---------------------------------------------------------------------------------------------
# Parsers shared by the validators. Each raises ValueError with a message meant for a person.


def parse_bool(value: Any) -> bool:
    """Accept exactly 1/true/yes/on and 0/false/no/off, so that ``X=false`` can never mean on."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError("expected one of 1/true/yes/on or 0/false/no/off")


def parse_filter(value: Any) -> list[str] | None:
    """A JSON array of regexes, or one bare pattern. Every pattern is compiled here, once."""
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip()
        if not text:
            return None
        if text.startswith("["):
            try:
                value = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"malformed JSON array of regexes ({e.msg} at char {e.pos})") from e
        else:
            value = [value]
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise ValueError("expected a regex or a list of regexes")
    patterns = list(value)
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise ValueError(f"expected regex strings, got {pattern!r}")
        try:
            re.compile(pattern)
        except re.error as e:
            raise ValueError(f"invalid regex {pattern!r}: {e}") from e
    return patterns


def parse_byte_size(value: Any) -> int:
    """An int of bytes, or a size like ``512MiB`` / ``4G`` (binary units)."""
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    else:
        match = re.fullmatch(r"\s*([0-9]{1,20}(?:\.[0-9]{1,20})?)\s*([a-zA-Z]*)\s*", str(value))
        if not match or match.group(2).lower() not in _BYTE_UNITS:
            raise ValueError("expected a byte count such as 1073741824, 512MiB or 4G")
        size = int(float(match.group(1)) * _BYTE_UNITS[match.group(2).lower()])
    if size <= 0:
        raise ValueError("must be a positive number of bytes")
    if size > _MAX_BYTE_SIZE:
        raise ValueError(f"{size} bytes is more than any machine holds (at most {_MAX_BYTE_SIZE}, 8 EiB)")
    return size


def parse_dir(value: Any) -> Path | None:
    """The dump dir as an absolute path, fixed now: a host that later calls ``os.chdir()`` (or a
    forked worker that does) must keep writing where the run began. Surrounding spaces are dropped
    (`` /x `` is a quoting slip, not a dir name); ``~user`` must expand; the name must be valid
    UTF-8, since it goes into the manifest."""
    if value is None:
        return None
    text = os.fspath(value) if isinstance(value, os.PathLike) else value
    if not isinstance(text, str):
        raise ValueError(f"expected a path, got {type(value).__name__}")
    text = text.strip()
    if not text:
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError("the path is not valid UTF-8 (it could not be written to the manifest)") from e
    expanded = os.path.expanduser(text)
    if expanded.startswith("~"):
        raise ValueError(f"cannot expand {text.split(os.sep)[0]!r}: no such user")
    path = Path(os.path.abspath(expanded))
    if path.exists() and not path.is_dir():
        raise ValueError("exists and is not a directory")
    return path


@dataclass(frozen=True)
class StepSelection:
    """Pass indices to keep, from ``"0,3,10-20"``. Empty means every pass."""

    ranges: tuple[tuple[int, int], ...] = ()

    def __contains__(self, index: int) -> bool:
        return not self.ranges or any(lo <= index <= hi for lo, hi in self.ranges)

    def __str__(self) -> str:
        """The selection as one would write it: ``0,3,10-20`` (the manifest keeps this text)."""
        return ",".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in self.ranges)

    @classmethod
    def parse(cls, text: str | None) -> StepSelection:
        if text is None or not str(text).strip():
            return cls()
        ranges = []
        for item in str(text).split(","):
            item = item.strip()
            if not item:
                continue
            match = re.fullmatch(r"([0-9]{1,18})(?:\s*-\s*([0-9]{1,18}))?", item)
            if not match:
                raise ValueError(
                    f"bad item {item!r}: expected N or LO-HI with non-negative integers, e.g. '0,3,10-20'"
                )
            lo = int(match.group(1))
            hi = int(match.group(2)) if match.group(2) is not None else lo
            if hi < lo:
                raise ValueError(f"bad range {item!r}: the end is before the start")
            ranges.append((lo, hi))
        return cls(tuple(ranges))


def split_callable_spec(spec: str) -> tuple[str, str]:
    """``"pkg.module:func"`` -> ``("pkg.module", "func")``: the spec's shape, checked without importing."""
    module_part, sep, attr = spec.strip().rpartition(":")
    if not sep or not module_part or not attr:
        raise ValueError("expected 'pkg.module:func' or '/path/file.py:func'")
    return module_part, attr


def load_callable(spec: str) -> Callable[..., Any]:
    """Import ``"pkg.module:func"`` or ``"/path/file.py:func"`` and return the callable."""
    module_part, attr = split_callable_spec(spec)
    module = _import_file(module_part) if module_part.endswith(".py") else _import_module(module_part)
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{module_part!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{attr!r} in {module_part!r} is not callable (it is {type(obj).__name__})")
    return obj


def _import_module(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except (Exception, SystemExit) as e:  # a module that calls sys.exit() must not end the host
        raise ValueError(f"cannot import module {name!r}: {type(e).__name__}: {e}") from e


@cache
def _import_file(path: str) -> Any:
    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"file {path!r} does not exist")
    module_name = f"_tracedump_user_{abs(hash(str(file.resolve())))}"
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise ValueError(f"cannot load {path!r} as a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:  # a file that calls sys.exit() must not end the host
        sys.modules.pop(module_name, None)
        raise ValueError(f"importing {path!r} failed: {type(e).__name__}: {e}") from e
    return module


# ---------------------------------------------------------------------------------------------
# What "set" means, and where a value came from: one rule each, used by the sources, the off path
# and the error messages.

FILTER_CHOICE = ("filter", "filter_fn")  # one choice: a source that sets either replaces both


def is_set(value: Any) -> bool:
    """The one rule for "unset": None, or a blank value. It holds for env vars and config values
    alike, so a blank neither clears a value nor lifts a gate."""
    return value is not None and not _blank(value)


def _blank(value: Any) -> bool:
    """An empty or whitespace-only string (or path)."""
    text = os.fspath(value) if isinstance(value, os.PathLike) else value
    return isinstance(text, str) and not text.strip()


def env_name(field: str, env_prefix: str = DEFAULT_ENV_PREFIX) -> str:
    """The env var that sets ``field``: ``env_name("dir") == "TRACEDUMP_DUMP_DIR"``."""
    return f"{env_prefix}DUMP_{field.upper()}"


def is_enabled(config: Any = None, env_prefix: str | None = DEFAULT_ENV_PREFIX) -> bool:
    """Is dumping on, i.e. is ``DIR`` set? The off path's whole cost: one env lookup (the exact name
    :class:`EnvSource` reads) and one attribute read, no validation, no import.

    ``env_prefix=None`` asks ``config`` alone: that is :attr:`DumpSettings.enabled`, whose env was
    read when it was built."""
    if env_prefix is not None and is_set(os.environ.get(env_name("dir", env_prefix))):
        return True
    value = config.get("dir") if isinstance(config, dict) else getattr(config, "dir", None)
    return is_set(value)


class EnvValue(str):
    """A value read from the environment: the text as set, and the variable that set it. It keeps its
    name through pydantic-settings' merge of the sources, so DumpSettings can record its origin."""

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
        return f"{self.name} (default)" if self.kind == "default" else f"{self.name}={self.raw!r}"


def _origin(field: str, data: dict[str, Any]) -> Origin:
    """Where ``field`` came from, given the merged values of the sources (absent or blank: default)."""
    value = data.get(field)
    if field not in data or _blank(value):
        return Origin("default", f"DumpConfig.{field}")
    if isinstance(value, EnvValue):
        return Origin("env", value.name, str(value))
    return Origin("config", f"DumpConfig.{field}", value)


@dataclass(frozen=True)
class UserCallables:
    """``FILTER_FN`` and ``SYNC_ESCAPE`` imported: see :meth:`DumpSettings.resolve_callables`."""

    filter_fn: Callable[[str, Any], Any] | None = None
    sync_escape: Callable[[], AbstractContextManager[Any]] | None = None


def _steps_text(value: StepSelection | None) -> str | None:
    return None if value is None else str(value)


# ``steps`` is written (env, config, JSON, manifest) as text and held parsed, as a StepSelection.
_STEPS_SCHEMA = {"anyOf": [{"type": "string", "examples": ["0,3,10-20"]}, {"type": "null"}]}


# ---------------------------------------------------------------------------------------------
# The fields, defined once and shared by DumpConfig (code) and DumpSettings (env overlay).


class _DumpFields(BaseModel):
    """Field definitions and validators. The descriptions feed the generated settings reference.

    Validators parse and check; none imports user code (see :meth:`DumpSettings.resolve_callables`)."""

    dir: Path | None = Field(None, description="Output directory; setting it (non-empty) turns dumping on.")
    filter: list[str] | None = Field(
        None,
        description="A JSON array of regexes, or one bare pattern; `re.search` on the full dotted "
        "module name; any match selects. Mutually exclusive with FILTER_FN.",
    )
    filter_fn: str | None = Field(
        None,
        description="`pkg.module:func` or `/path/file.py:func`: a predicate `(name, module) -> bool` "
        "choosing the modules. Mutually exclusive with FILTER.",
    )
    modules: Literal["leaves", "all"] = Field(
        "leaves", description="`leaves`: modules without children; `all`: every submodule (not the root)."
    )
    tokens: int | None = Field(
        None,
        description="Token-count gate: capture a module output only when its token dimension has "
        "size N (the real prompt length); warm-up and profile batches with other sizes are skipped.",
    )
    token_dim: Literal[0, 1] = Field(
        0,
        description="Dimension holding tokens: `0` for flattened `[tokens, hidden]` (vLLM/SGLang), `1` "
        "for `[batch, seq, hidden]` (HF). Tensors with fewer dims are judged by their leading dim.",
    )
    max_rows: int | None = Field(
        None,
        description="Row-count gate: while the rows last reported with `dumper.set_rows(n)` exceed "
        "N, nothing is captured.",
    )
    steps: Annotated[StepSelection | None, PlainSerializer(_steps_text), WithJsonSchema(_STEPS_SCHEMA)] = (
        Field(
            None,
            description="Pass indices to keep, e.g. `0,3,10-20`; empty = all. Numbering continues "
            "over skipped passes.",
        )
    )
    sync_escape: str | None = Field(
        None,
        description="`pkg.mod:func`: a context-manager factory that lifts the engine's own sync "
        "guard around each device-to-host copy.",
    )
    mode: Literal["full", "last_row", "stats"] = Field(
        "full",
        description="`full`: whole tensors; `last_row`: only the last index along the token "
        "dimension of tensors with >= 2 dims; `stats`: statistics only, in `stats.jsonl`.",
    )
    stats: list[str] = Field(
        list(DEFAULT_STATS), description="For `stats` mode: comma list from " + ", ".join(STAT_NAMES) + "."
    )
    inputs: bool = Field(
        False,
        description="`1` also captures each selected module's inputs, keyed `name@in[0]`, `name@in[kw]`.",
    )
    control: bool = Field(
        False,
        description="`1` attaches disarmed (hooks in place, nothing captured) until `tracedump arm DIR` "
        "orders steps; `tracedump disarm DIR` ends them (see docs/operations.md).",
    )
    max_pending_bytes: int = Field(
        DEFAULT_MAX_PENDING_BYTES,
        description="Cap on host memory held by captures not yet on disk "
        "(bytes, or `512MiB`, `4G`); when reached the step waits for the writer (nothing is dropped).",
    )

    @field_validator("dir", mode="before")
    @classmethod
    def _parse_dir(cls, value: Any) -> Path | None:
        return parse_dir(value)

    @field_validator("filter", mode="before")
    @classmethod
    def _parse_filter(cls, value: Any) -> list[str] | None:
        return parse_filter(value)

    @field_validator("filter_fn", "sync_escape", mode="before")
    @classmethod
    def _check_callable_spec(cls, value: Any) -> str | None:
        """The spec's shape only: importing it runs user code, which waits for ``attach()``."""
        if value is None:
            return None
        if not isinstance(value, str):
            raise ValueError(f"expected a 'pkg.module:func' string, not {type(value).__name__}")
        split_callable_spec(value)
        return value.strip()

    @field_validator("tokens", "max_rows", mode="before")
    @classmethod
    def _positive_int(cls, value: Any) -> int | None:
        if value is None:
            return None
        if isinstance(value, int) and not isinstance(value, bool):
            number = value
        elif isinstance(value, str) and re.fullmatch(r"[0-9]{1,18}", value.strip()):
            number = int(value.strip())  # ASCII digits only: int() would also take '٣'
        else:
            raise ValueError("expected a positive integer")
        if number < 1:
            raise ValueError("expected a positive integer")
        return number

    @field_validator("token_dim", mode="before")
    @classmethod
    def _token_dim(cls, value: Any) -> int:
        text = str(value).strip()
        if text not in ("0", "1"):
            raise ValueError("expected 0 ([tokens, hidden]) or 1 ([batch, seq, hidden])")
        return int(text)

    @field_validator("modules", "mode", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        return value.strip().lower() if isinstance(value, str) else value

    @field_validator("steps", mode="before")
    @classmethod
    def _parse_steps(cls, value: Any) -> StepSelection | None:
        """Parsed here, once: the text, an int, a list of ints, or a StepSelection. All = None."""
        if value is None:
            return None
        if isinstance(value, StepSelection):
            selection = value
        else:
            if isinstance(value, int) and not isinstance(value, bool):
                value = str(value)
            elif not isinstance(value, str):
                if not isinstance(value, Iterable):
                    raise ValueError(f"expected text such as '0,3,10-20' or a list of ints, not {value!r}")
                value = ",".join(str(v) for v in value)
            selection = StepSelection.parse(value)
        return selection if selection.ranges else None

    @field_validator("stats", mode="before")
    @classmethod
    def _parse_stats(cls, value: Any) -> list[str]:
        if value is None:
            return list(DEFAULT_STATS)
        if isinstance(value, str):
            names = [s.strip() for s in value.split(",")]
        elif isinstance(value, (list, tuple)) and all(isinstance(n, str) for n in value):
            names = list(value)
        else:
            raise ValueError(f"expected a comma list or a list of names, not {value!r}")
        names = [n for n in names if n]
        unknown = [n for n in names if n not in STAT_NAMES]
        if unknown:
            raise ValueError(
                f"unknown statistic(s) {', '.join(map(repr, unknown))}; choose from {', '.join(STAT_NAMES)}"
            )
        return names or list(DEFAULT_STATS)

    @field_validator("inputs", mode="before")
    @classmethod
    def _parse_inputs(cls, value: Any) -> bool:
        return parse_bool(value)

    @field_validator("max_pending_bytes", mode="before")
    @classmethod
    def _parse_pending(cls, value: Any) -> int:
        return parse_byte_size(value)

    # Defined last, so pydantic runs it before the field's own parser ("before" validators run in
    # reverse order): a blank string in a config means unset, as an empty env var does.
    @model_validator(mode="before")
    @classmethod
    def _blank_is_unset(cls, data: Any) -> Any:
        """A blank string means unset for every field (the default applies), as a blank env var
        does: one rule (:func:`is_set`), rather than unset for some fields and an error for others."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if not _blank(v)}
        return data

    @model_validator(mode="after")
    def _filter_xor_filter_fn(self) -> _DumpFields:
        if self.filter is not None and self.filter_fn is not None:
            raise ValueError("FILTER and FILTER_FN are mutually exclusive: set one of them")
        return self

    @property
    def enabled(self) -> bool:
        """Dumping is on: ``DIR`` is set (the rule of :func:`is_enabled`)."""
        return is_enabled(self, env_prefix=None)

    @property
    def step_selection(self) -> StepSelection:
        """The passes to keep; every pass when ``steps`` is unset."""
        return self.steps if self.steps is not None else StepSelection()


class DumpConfig(_DumpFields):
    """The dump settings as a plain pydantic model, for an engine to embed in its own config.

    Only the fields set explicitly take part in the merge, so env vars still overlay the rest::

        class EngineConfig(BaseModel):
            dump: tracedump.DumpConfig = tracedump.DumpConfig()

        tracedump.attach(model, engine_config.dump)
    """

    model_config = ConfigDict(extra="forbid")


# ---------------------------------------------------------------------------------------------
# The two sources. Their order in DumpSettings.settings_customise_sources is the precedence.


class EnvSource(PydanticBaseSettingsSource):
    """The one reader of the environment for settings, and the one place that decides case.

    ``<prefix>DUMP_<FIELD>`` with ``FIELD`` exactly upper-case is read; a blank value is unset. Any
    other variable starting with ``<prefix>DUMP_`` in any case (a misspelt ``..._FILTERS``, a
    ``tracedump_dump_mode``) is kept in :attr:`unknown` and refused by :class:`ConfigSource`: a name
    in another case is never read, so it cannot silently win or lose against the upper-case one.
    Each value is an :class:`EnvValue`, which carries the variable's name."""

    def __init__(self, settings_cls: type[BaseSettings], prefix: str) -> None:
        super().__init__(settings_cls)
        self.prefix = prefix  # with DUMP_: "TRACEDUMP_DUMP_"
        names = {prefix + field.upper(): field for field in settings_cls.model_fields}
        self.values: dict[str, EnvValue] = {}
        self.unknown: list[str] = []
        for key, text in os.environ.items():
            if key in names:
                if is_set(text):
                    self.values[names[key]] = EnvValue(key, text)
            elif key.upper().startswith(prefix.upper()):
                field = key[len(prefix) :].lower()
                # names are exactly upper-case; say so when only the case is wrong
                hint = f" (names are upper-case: {prefix}{field.upper()})" if field in names.values() else ""
                self.unknown.append(key + hint)

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return self.values.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(self.values)


class ConfigSource(PydanticBaseSettingsSource):
    """The engine's explicit config (the ``DumpSettings(...)`` keywords), below the env.

    It refuses unknown names, its own and the env's, in one message: a misspelt setting would
    otherwise be ignored and the run would dump something else than asked, silently. And it yields
    the filter choice: an env var for either ``FILTER`` or ``FILTER_FN`` replaces a config filter
    of either kind, so the operator overlays a choice rather than colliding with the engine's."""

    def __init__(self, settings_cls: type[BaseSettings], init: PydanticBaseSettingsSource, env: EnvSource):
        super().__init__(settings_cls)
        self.init = init
        self.env = env

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        values = self.init()
        fields = self.settings_cls.model_fields
        unknown = [f"DumpConfig.{key}" for key in values if key not in fields] + self.env.unknown
        if unknown:
            names = ", ".join(self.env.prefix + field.upper() for field in fields)
            raise ConfigError(
                f"tracedump: bad setting\n  unknown setting(s): {', '.join(sorted(unknown))}; known: {names}"
            )
        if any(field in self.env.values for field in FILTER_CHOICE):
            values = {key: value for key, value in values.items() if key not in FILTER_CHOICE}
        return values


class DumpSettings(BaseSettings, _DumpFields):
    """The settings in effect: env > explicit config > defaults, validated once.

    ``DumpSettings()`` reads ``TRACEDUMP_DUMP_*``; :func:`load_settings` picks another prefix and
    turns validation errors into a :class:`ConfigError` that names the env var. Building one never
    imports user code: :meth:`resolve_callables` does, at ``attach()``.
    """

    model_config = SettingsConfigDict(
        env_prefix=DEFAULT_ENV_PREFIX + "DUMP_", extra="forbid", case_sensitive=True
    )
    _origins: dict[str, Origin] = PrivateAttr(default_factory=dict)
    _callables: UserCallables | None = PrivateAttr(None)

    @classmethod
    def settings_customise_sources(
        cls, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings
    ):  # type: ignore[no-untyped-def]
        """Env first, then the config: an operator's env var overlays the engine's choice. No other
        source (.env files, secrets dirs) is read."""
        env = EnvSource(settings_cls, env_settings.env_prefix)
        return (env, ConfigSource(settings_cls, init_settings, env))

    @model_validator(mode="wrap")
    @classmethod
    def _validate_with_origins(cls, data: Any, handler: ValidatorFunctionWrapHandler) -> DumpSettings:
        """Note where each value came from before the validators turn it into a plain value, and
        name that place (env var or config field, and the value as given) in every error."""
        if not isinstance(data, dict):
            return handler(data)
        origins = {field: _origin(field, data) for field in cls.model_fields}
        try:
            settings = handler(data)
        except ValidationError as e:
            raise PydanticCustomError("bad_setting", "{message}", {"message": _describe(e, origins)}) from e
        settings._origins = origins
        return settings

    def origin(self, field: str) -> Origin:
        """Where ``field``'s value came from: env (which variable, what text), config, or default."""
        if field not in type(self).model_fields:
            raise KeyError(field)
        return self._origins.get(field) or Origin("default", f"DumpConfig.{field}")

    @property
    def origins(self) -> dict[str, Origin]:
        """:meth:`origin` of every field, in field order."""
        return {field: self.origin(field) for field in type(self).model_fields}

    def describe(self, field: str) -> str:
        """``TRACEDUMP_DUMP_DIR='/x'`` when the env var set it, else ``DumpConfig.dir='/x'``: errors
        say where a value came from, so the person reading them knows what to change."""
        origin = self.origin(field)
        if origin.kind == "env":
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
        return json.loads(self.model_dump_json())


def load_settings(
    config: DumpConfig | _DumpFields | dict[str, Any] | None = None, env_prefix: str = DEFAULT_ENV_PREFIX
) -> DumpSettings:
    """Read the settings once: env > ``config`` > defaults. Raises :class:`ConfigError`.

    Imports no user code; call :meth:`DumpSettings.resolve_callables` for that."""
    explicit = _explicit_values(config)
    try:
        return DumpSettings(**explicit, _env_prefix=env_prefix + "DUMP_")
    except ValidationError as e:
        messages = [str(item["ctx"]["message"]) for item in e.errors() if item["type"] == "bad_setting"]
        raise ConfigError("\n".join(messages) or str(e)) from e


def _explicit_values(config: DumpConfig | _DumpFields | dict[str, Any] | None) -> dict[str, Any]:
    if config is None:
        return {}
    if isinstance(config, dict):
        return dict(config)
    if isinstance(config, BaseModel):
        return {
            name: getattr(config, name)
            for name in config.model_fields_set
            if name in _DumpFields.model_fields
        }
    raise ConfigError(f"config must be a tracedump.DumpConfig, a dict or None, not {type(config).__name__}")


def _describe(error: ValidationError, origins: dict[str, Origin]) -> str:
    """One line per error, each naming where the value came from (env var or config field) and the
    value as given there."""
    lines = []
    for item in error.errors():
        message = str(item.get("ctx", {}).get("error", "")) or item["msg"]
        message = message.removeprefix("Value error, ")
        fields = [str(item["loc"][0])] if item["loc"] else list(FILTER_CHOICE)  # else: FILTER vs FILTER_FN
        where = " / ".join(str(origins[field]) if field in origins else field for field in fields)
        lines.append(f"{where}: {message}")
    return "tracedump: bad setting\n  " + "\n  ".join(lines)
