"""Settings: what to dump, read once at ``attach()``.

Every field can come from three places. Precedence is **env > explicit config > defaults**, so an
operator can overlay an env var on a config that the engine built itself, without a code change.
The env name of a field is ``<prefix>DUMP_<FIELD>`` (``TRACEDUMP_DUMP_DIR`` for the default prefix;
an engine picks its own prefix, e.g. ``PHYAI_DEBUG_TENSOR_`` gives ``PHYAI_DEBUG_TENSOR_DUMP_DIR``).

Parsing lives in validators, never in scattered ``os.getenv`` calls, and a bad value fails at
``attach()`` with a :class:`ConfigError` that names the env var (or config field) and the value.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

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


def load_callable(spec: str) -> Callable[..., Any]:
    """Import ``"pkg.module:func"`` or ``"/path/file.py:func"`` and return the callable."""
    module_part, sep, attr = spec.rpartition(":")
    if not sep or not module_part or not attr:
        raise ValueError("expected 'pkg.module:func' or '/path/file.py:func'")
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
# The fields, defined once and shared by DumpConfig (code) and DumpSettings (env overlay).


class _DumpFields(BaseModel):
    """Field definitions and validators. The descriptions feed the generated settings reference."""

    dir: Path | None = Field(None, description="Output directory; setting it (non-empty) turns dumping on.")
    filter: Annotated[list[str] | None, NoDecode] = Field(
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
    steps: str | None = Field(
        None,
        description="Pass indices to keep, e.g. `0,3,10-20`; empty = all. Numbering continues "
        "over skipped passes.",
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
    stats: Annotated[list[str], NoDecode] = Field(
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
    def _check_callable(cls, value: Any) -> str | None:
        if value is None:
            return None
        load_callable(str(value).strip())
        return str(value).strip()

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
    def _parse_steps(cls, value: Any) -> str | None:
        if value is None:
            return None
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)
        elif not isinstance(value, str):
            value = ",".join(str(v) for v in value)
        StepSelection.parse(value)
        return value.strip() or None

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
        does: one rule, rather than unset for some fields and an error for others."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if not (isinstance(v, str) and not v.strip())}
        return data

    @model_validator(mode="after")
    def _filter_xor_filter_fn(self) -> _DumpFields:
        if self.filter is not None and self.filter_fn is not None:
            raise ValueError("FILTER and FILTER_FN are mutually exclusive: set one of them")
        return self

    @property
    def enabled(self) -> bool:
        return self.dir is not None

    @property
    def step_selection(self) -> StepSelection:
        return StepSelection.parse(self.steps)


class DumpConfig(_DumpFields):
    """The dump settings as a plain pydantic model, for an engine to embed in its own config.

    Only the fields set explicitly take part in the merge, so env vars still overlay the rest::

        class EngineConfig(BaseModel):
            dump: tracedump.DumpConfig = tracedump.DumpConfig()

        tracedump.attach(model, engine_config.dump)
    """

    model_config = ConfigDict(extra="forbid")


class DumpSettings(BaseSettings, _DumpFields):
    """The settings in effect: env > explicit config > defaults, validated once.

    ``DumpSettings()`` reads ``TRACEDUMP_DUMP_*``; :func:`load_settings` picks another prefix and
    turns validation errors into a :class:`ConfigError` that names the env var.
    """

    # An empty env var means "unset": it neither clears a config value nor lifts a gate.
    model_config = SettingsConfigDict(
        env_prefix=DEFAULT_ENV_PREFIX + "DUMP_", extra="ignore", case_sensitive=False, env_ignore_empty=True
    )

    @classmethod
    def settings_customise_sources(
        cls, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings
    ):  # type: ignore[no-untyped-def]
        """Env first: an operator's env var overlays whatever config the engine passed in.

        A whitespace-only env value means unset, like an empty one, for every field."""
        env_vars = getattr(env_settings, "env_vars", None)
        if isinstance(env_vars, dict):
            env_settings.env_vars = {k: v for k, v in env_vars.items() if v is None or v.strip()}
        return (env_settings, init_settings)

    def summary(self) -> dict[str, Any]:
        """JSON-safe view of the settings in effect, for the manifest."""
        return json.loads(self.model_dump_json())


def env_name(field: str, env_prefix: str = DEFAULT_ENV_PREFIX) -> str:
    """The env var that sets ``field``: ``env_name("dir") == "TRACEDUMP_DUMP_DIR"``."""
    return f"{env_prefix}DUMP_{field.upper()}"


def _env_value(field: str, env_prefix: str) -> str | None:
    """The env var's value as pydantic-settings reads it: any case, and empty meaning unset."""
    wanted = env_name(field, env_prefix).lower()
    return next((v for k, v in os.environ.items() if k.lower() == wanted and v.strip()), None)


def describe_source(field: str, value: Any, env_prefix: str = DEFAULT_ENV_PREFIX) -> str:
    """``TRACEDUMP_DUMP_DIR='/x'`` when the env var set it, else ``DumpConfig.dir='/x'``: errors say
    where a value came from, so the person reading them knows what to change."""
    env_value = _env_value(field, env_prefix)
    if env_value is not None:
        return f"{env_name(field, env_prefix)}={env_value!r}"
    return f"DumpConfig.{field}={value!r}"


def dump_dir_requested(config: Any, env_prefix: str = DEFAULT_ENV_PREFIX) -> bool:
    """The off-path check: one env lookup and one attribute read, no validation, no import."""
    env_value = os.environ.get(env_name("dir", env_prefix), "")
    if env_value.strip():
        return True
    value = config.get("dir") if isinstance(config, dict) else getattr(config, "dir", None)
    return value is not None and bool(str(value).strip())


def load_settings(
    config: DumpConfig | _DumpFields | dict[str, Any] | None = None, env_prefix: str = DEFAULT_ENV_PREFIX
) -> DumpSettings:
    """Read the settings once: env > ``config`` > defaults. Raises :class:`ConfigError`."""
    explicit = _explicit_values(config)
    _reject_unknown_names(explicit, env_prefix)
    # An env var for either filter kind replaces the config's filter of either kind: the operator
    # overlays a choice, rather than colliding with the engine's default.
    if _env_value("filter", env_prefix) or _env_value("filter_fn", env_prefix):
        explicit.pop("filter", None)
        explicit.pop("filter_fn", None)
    try:
        return DumpSettings(**explicit, _env_prefix=env_prefix + "DUMP_")
    except ValidationError as e:
        raise ConfigError(_describe(e, env_prefix, explicit)) from e


def _reject_unknown_names(explicit: dict[str, Any], env_prefix: str) -> None:
    """A misspelt setting (``TRACEDUMP_DUMP_FILTERS``, ``{"mdoe": ...}``) would otherwise be ignored
    and the run would dump something else than asked, silently."""
    known = set(_DumpFields.model_fields)
    prefix = (env_prefix + "DUMP_").upper()
    exact = {env_name(field, env_prefix): field for field in known}
    unknown = [f"DumpConfig.{key}" for key in explicit if key not in known]
    for key in os.environ:
        if key.upper().startswith(prefix) and key not in exact:
            field = key[len(prefix) :].lower()
            # A name in another case would otherwise be read or ignored depending on the order of
            # os.environ: names are exactly upper-case, and any other spelling is refused.
            hint = f" (names are upper-case: {env_name(field, env_prefix)})" if field in known else ""
            unknown.append(key + hint)
    if unknown:
        names = ", ".join(env_name(field, env_prefix) for field in _DumpFields.model_fields)
        raise ConfigError(
            f"tracedump: bad setting\n  unknown setting(s): {', '.join(sorted(unknown))}; known: {names}"
        )


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


def _describe(error: ValidationError, env_prefix: str, explicit: dict[str, Any]) -> str:
    lines = []
    for item in error.errors():
        field = str(item["loc"][0]) if item["loc"] else ""
        message = str(item.get("ctx", {}).get("error", "")) or item["msg"]
        message = message.removeprefix("Value error, ")
        if not field:  # a model-level rule (filter vs filter_fn)
            lines.append(f"{env_name('filter', env_prefix)} / {env_name('filter_fn', env_prefix)}: {message}")
            continue
        lines.append(
            f"{describe_source(field, explicit.get(field, item.get('input')), env_prefix)}: {message}"
        )
    return "tracedump: bad setting\n  " + "\n  ".join(lines)
