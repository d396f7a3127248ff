"""Settings: what to dump, read once at ``attach()``, from **env > explicit config > defaults**, so an
operator can overlay an env var on a config that the engine built itself. A field's env var is
``<prefix>DUMP_<FIELD>`` (``TRACEDUMP_DUMP_DIR``; an engine may pick its own prefix).

:class:`EnvSource` is the only reader of the environment (:func:`is_enabled`, the off path, looks up
one variable by the same rules); :class:`ConfigSource` takes the engine's config. Each value is
parsed once into its typed field; :meth:`DumpSettings.origin` says where it came from, and a bad
value is a :class:`ConfigError` naming that place and the value. User code (``FILTER_FN``,
``SYNC_ESCAPE``) is imported by :meth:`DumpSettings.resolve_callables` only, at ``attach()``.
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
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    PrivateAttr,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WithJsonSchema,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from ..errors import ConfigError
from ..store.format import NUMERIC_STAT_NAMES

DEFAULT_ENV_PREFIX = "TRACEDUMP_"
STAT_NAMES = (*NUMERIC_STAT_NAMES, "shape", "dtype")
DEFAULT_STATS = ("abs_mean", "sum", "max", "shape")
FILTER_CHOICE = ("filter", "filter_fn")  # one choice: a source that sets either replaces both
_BYTE_UNITS = {"": 1, "b": 1} | {u + s: 1024**i for i, u in enumerate("kmgt", 1) for s in ("", "b", "ib")}
_BOOLS = dict.fromkeys(("1", "true", "yes", "on"), True) | dict.fromkeys(("0", "false", "no", "off"), False)


# The validators: each raises ValueError meant for a person. A blank value is unset, never parsed.


def parse_bool(value: Any) -> bool:
    """Exactly 1/true/yes/on or 0/false/no/off, so that ``X=false`` can never mean on."""
    key = str(int(value)) if isinstance(value, int) else str(value).strip().lower()
    if key not in _BOOLS:
        raise ValueError("expected one of 1/true/yes/on or 0/false/no/off")
    return _BOOLS[key]


def parse_filter(value: Any) -> list[str] | None:
    """A JSON array of regexes, or one bare pattern. Every pattern is compiled here, once."""
    if isinstance(value, str):
        try:
            value = json.loads(value.strip()) if value.strip().startswith("[") else [value]
        except json.JSONDecodeError as e:
            raise ValueError(f"malformed JSON array of regexes ({e.msg} at char {e.pos})") from e
        except RecursionError:  # '[' * 100000: nested deeper than the decoder goes
            raise ValueError("malformed JSON array of regexes (nested too deep)") from None
    if value is None:
        return None
    if not isinstance(value, Iterable):
        raise ValueError("expected a regex or a list of regexes")
    patterns = list(value)
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise ValueError(f"expected regex strings, got {pattern!r}")
        try:
            re.compile(pattern)
        except (re.error, RecursionError, OverflowError) as e:  # '[' * 100000 recurses in the parser
            shown = pattern if len(pattern) <= 80 else pattern[:80] + f"... ({len(pattern)} chars)"
            raise ValueError(f"invalid regex {shown!r}: {type(e).__name__}: {e}") from None
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
    if size > 1 << 63:
        raise ValueError(f"{size} bytes is more than any machine holds (at most {1 << 63}, 8 EiB)")
    return size


def parse_dir(value: Any) -> Path | None:
    """The dump dir as an absolute path, fixed now: a host (or forked worker) that later calls
    ``os.chdir()`` must keep writing where the run began. Surrounding spaces are a quoting slip;
    ``~user`` must expand; the name must be valid UTF-8, since it goes into the manifest."""
    if value is None:
        return None
    text = os.fspath(value) if isinstance(value, os.PathLike) else value
    if not isinstance(text, str):
        raise ValueError(f"expected a path, got {type(value).__name__}")
    text = text.strip()
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError("the path is not valid UTF-8 (it could not be written to the manifest)") from e
    expanded = os.path.expanduser(text)
    if expanded.startswith("~"):
        raise ValueError(f"cannot expand {text.split(os.sep)[0]!r}: no such user")
    path = Path(os.path.abspath(expanded))
    try:
        if path.exists() and not path.is_dir():
            raise ValueError("exists and is not a directory")
    except OSError as e:  # a component longer than the filesystem allows (ENAMETOOLONG), a loop
        raise ValueError(f"cannot be a directory: {e.strerror or e}") from None
    return path


def _positive_int(value: Any) -> int | None:
    if isinstance(value, str) and re.fullmatch(r"\s*[0-9]{1,18}\s*", value):
        value = int(value)  # ASCII digits only: int() alone would also take '٣'
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError("expected a positive integer")
    return value


def _token_dim(value: Any) -> int:
    if str(value).strip() not in ("0", "1"):
        raise ValueError("expected 0 ([tokens, hidden]) or 1 ([batch, seq, hidden])")
    return int(str(value).strip())


def _callable_spec(value: Any) -> str | None:
    """``pkg.module:func`` or ``/path/file.py:func``, its shape only: importing it runs user code,
    which waits for ``attach()`` (:func:`load_callable`)."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError(f"expected a 'pkg.module:func' string, not {type(value).__name__}")
    module_part, _, attr = value.strip().rpartition(":")
    if not (module_part and attr):
        raise ValueError("expected 'pkg.module:func' or '/path/file.py:func'")
    return value.strip()


def _graft_reference(value: Any) -> Path | None:
    """GRAFT_FROM: an existing dump dir or run dir (what is in it is checked at ``attach()``)."""
    path = parse_dir(value)
    if path is not None and not path.is_dir():
        raise ValueError("no such dump directory")
    return path


def _regex(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError(f"expected a regex string, not {type(value).__name__}")
    try:
        re.compile(value.strip())
    except re.error as e:
        raise ValueError(f"invalid regex {value.strip()!r}: {e}") from e
    return value.strip()


def _map_rules(value: Any) -> list[str] | None:
    """A JSON array of ``PATTERN=REPL`` rules, or one rule; each pattern compiled here, once."""
    if isinstance(value, str):
        text = value.strip()
        try:
            value = json.loads(text) if text.startswith("[") else [text]
        except json.JSONDecodeError as e:
            raise ValueError(f"malformed JSON array of rules ({e.msg} at char {e.pos})") from e
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not all(isinstance(rule, str) for rule in value):
        raise ValueError("expected a 'PATTERN=REPL' rule or a list of them")
    rules = list(value)
    for rule in rules:
        pattern, sep, _ = rule.rpartition("=")
        if not sep or not pattern:
            raise ValueError(f"expected 'PATTERN=REPL', got {rule!r}")
        _regex(pattern)
    return rules


def _parse_stats(value: Any) -> list[str]:
    if value is None:
        return list(DEFAULT_STATS)
    names = [s.strip() for s in value.split(",")] if isinstance(value, str) else value
    if not (isinstance(names, (list, tuple)) and all(isinstance(n, str) for n in names)):
        raise ValueError(f"expected a comma list or a list of names, not {value!r}")
    names = [n for n in names if n]
    unknown = [n for n in names if n not in STAT_NAMES]
    if unknown:
        raise ValueError(
            f"unknown statistic(s) {', '.join(map(repr, unknown))}; choose from {', '.join(STAT_NAMES)}"
        )
    return names or list(DEFAULT_STATS)


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
        ranges = []
        for item in ("" if text is None else str(text)).split(","):
            if not (item := item.strip()):
                continue
            match = re.fullmatch(r"([0-9]{1,18})(?:\s*-\s*([0-9]{1,18}))?", item)
            if not match:
                raise ValueError(
                    f"bad item {item!r}: expected N or LO-HI with non-negative integers, e.g. '0,3,10-20'"
                )
            lo, hi = int(match.group(1)), int(match.group(2) or match.group(1))
            if hi < lo:
                raise ValueError(f"bad range {item!r}: the end is before the start")
            ranges.append((lo, hi))
        return cls(tuple(ranges))


def _parse_steps(value: Any) -> StepSelection | None:
    """The text, an int, a list of ints, or a StepSelection, parsed once. Every pass is None."""
    if isinstance(value, Iterable) and not isinstance(value, str):
        value = ",".join(map(str, value))
    selection = value if isinstance(value, StepSelection) else StepSelection.parse(value)
    return selection if selection.ranges else None


def load_callable(spec: str) -> Callable[..., Any]:
    """Import a ``"pkg.module:func"`` or ``"/path/file.py:func"`` spec and return the callable."""
    module_part, _, attr = spec.rpartition(":")
    if module_part.endswith(".py"):
        module = _import_file(module_part)
    else:
        try:
            module = importlib.import_module(module_part)
        except (Exception, SystemExit) as e:  # a module that calls sys.exit() must not end the host
            raise ValueError(f"cannot import module {module_part!r}: {type(e).__name__}: {e}") from e
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{module_part!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{attr!r} in {module_part!r} is not callable (it is {type(obj).__name__})")
    return obj


@cache
def _import_file(path: str) -> Any:
    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"file {path!r} does not exist")
    module_name = f"_tracedump_user_{abs(hash(str(file.resolve())))}"
    spec = importlib.util.spec_from_file_location(module_name, file)  # never None for a .py file
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    except (Exception, SystemExit) as e:  # a file that calls sys.exit() must not end the host
        sys.modules.pop(module_name, None)
        raise ValueError(f"importing {path!r} failed: {type(e).__name__}: {e}") from e
    return module


def _blank(value: Any) -> bool:
    """Empty or whitespace-only: unset, in env and config alike (neither clears a value nor lifts a gate)."""
    text = os.fspath(value) if isinstance(value, os.PathLike) else value
    return isinstance(text, str) and not text.strip()


def env_name(field: str, env_prefix: str = DEFAULT_ENV_PREFIX) -> str:
    """The env var that sets ``field``: ``env_name("dir") == "TRACEDUMP_DUMP_DIR"``."""
    return f"{env_prefix}DUMP_{field.upper()}"


def is_enabled(config: Any = None, env_prefix: str | None = DEFAULT_ENV_PREFIX) -> bool:
    """Is dumping on, i.e. is ``DIR`` set? The off path's whole cost: one env lookup (the name
    :class:`EnvSource` reads) and one attribute read. ``env_prefix=None`` asks ``config`` alone."""
    if env_prefix is not None and (os.environ.get(env_name("dir", env_prefix)) or "").strip():
        return True
    value = config.get("dir") if isinstance(config, dict) else getattr(config, "dir", None)
    return value is not None and not _blank(value)


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


def _origin(field: str, value: Any) -> Origin:
    """Where ``field``'s merged value came from; pass ``""`` when no source set it."""
    if isinstance(value, EnvValue):
        return Origin("env", value.name, str(value))
    return Origin(
        "default" if _blank(value) else "config", f"DumpConfig.{field}", None if _blank(value) else value
    )


@dataclass(frozen=True)
class UserCallables:
    """``FILTER_FN`` and ``SYNC_ESCAPE`` imported: see :meth:`DumpSettings.resolve_callables`."""

    filter_fn: Callable[[str, Any], Any] | None = None
    sync_escape: Callable[[], AbstractContextManager[Any]] | None = None


_LOWER = BeforeValidator(lambda value: value.strip().lower() if isinstance(value, str) else value)


class _DumpFields(BaseModel):
    """The fields, shared by DumpConfig (code) and DumpSettings (env overlay). The descriptions feed
    the generated settings reference (tools/docs_gen.py). No validator imports user code."""

    model_config = ConfigDict(extra="forbid")

    dir: Annotated[Path | None, BeforeValidator(parse_dir)] = Field(
        None, description="Output directory; setting it (non-empty) turns dumping on."
    )
    filter: Annotated[list[str] | None, BeforeValidator(parse_filter)] = Field(
        None,
        description="A JSON array of regexes, or one bare pattern; `re.search` on the full dotted "
        "module name; any match selects. Mutually exclusive with FILTER_FN.",
    )
    filter_fn: Annotated[str | None, BeforeValidator(_callable_spec)] = Field(
        None,
        description="`pkg.module:func` or `/path/file.py:func`: a predicate `(name, module) -> bool` "
        "choosing the modules. Mutually exclusive with FILTER.",
    )
    modules: Annotated[Literal["leaves", "all"], _LOWER] = Field(
        "leaves", description="`leaves`: modules without children; `all`: every submodule (not the root)."
    )
    tokens: Annotated[int | None, BeforeValidator(_positive_int)] = Field(
        None,
        description="Token-count gate: capture a module output only when its token dimension has "
        "size N (the real prompt length); warm-up and profile batches with other sizes are skipped.",
    )
    token_dim: Annotated[Literal[0, 1], BeforeValidator(_token_dim)] = Field(
        0,
        description="Dimension holding tokens: `0` for flattened `[tokens, hidden]` (vLLM/SGLang), `1` "
        "for `[batch, seq, hidden]` (HF). Tensors with fewer dims are judged by their leading dim.",
    )
    max_rows: Annotated[int | None, BeforeValidator(_positive_int)] = Field(
        None,
        description="Row-count gate: while the rows last reported with `dumper.set_rows(n)` exceed "
        "N, nothing is captured.",
    )
    # Written (env, config, JSON, manifest) as text, held parsed.
    steps: Annotated[
        StepSelection | None,
        BeforeValidator(_parse_steps),
        PlainSerializer(str, when_used="unless-none"),
        WithJsonSchema({"anyOf": [{"type": "string", "examples": ["0,3,10-20"]}, {"type": "null"}]}),
    ] = Field(
        None,
        description="Pass indices to keep, e.g. `0,3,10-20`; empty = all. Numbering continues "
        "over skipped passes.",
    )
    sync_escape: Annotated[str | None, BeforeValidator(_callable_spec)] = Field(
        None,
        description="`pkg.mod:func`: a context-manager factory that lifts the engine's own sync "
        "guard around each device-to-host copy.",
    )
    mode: Annotated[Literal["full", "last_row", "stats"], _LOWER] = Field(
        "full",
        description="`full`: whole tensors; `last_row`: only the last index along the token "
        "dimension of tensors with >= 2 dims; `stats`: statistics only, in `stats.jsonl`.",
    )
    stats: Annotated[list[str], BeforeValidator(_parse_stats)] = Field(
        list(DEFAULT_STATS), description="For `stats` mode: comma list from " + ", ".join(STAT_NAMES) + "."
    )
    inputs: Annotated[bool, BeforeValidator(parse_bool)] = Field(
        False,
        description="`1` also captures each selected module's inputs, keyed `name@in[0]`, `name@in[kw]`.",
    )
    control: Annotated[bool, BeforeValidator(parse_bool)] = Field(
        False,
        description="`1` attaches disarmed (hooks in place, nothing captured) until `tracedump arm DIR` "
        "orders steps; `tracedump disarm DIR` ends them (see docs/operations.md).",
    )
    max_pending_bytes: Annotated[int, BeforeValidator(parse_byte_size)] = Field(
        4 << 30,
        description="Cap on host memory held by captures not yet on disk "
        "(bytes, or `512MiB`, `4G`); when reached the step waits for the writer (nothing is dropped).",
    )
    graft_from: Annotated[Path | None, BeforeValidator(_graft_reference)] = Field(
        None,
        description="A reference dump made with `INPUTS=1`: each grafted module runs on the "
        "reference's inputs for its pass and call, so `tracedump diff` judges its local error "
        "(docs/comparator.md). Off unless DIR is set too. With MODULES unset, every module is dumped.",
    )
    graft_level: Annotated[str | None, BeforeValidator(_regex)] = Field(
        None,
        description="With GRAFT_FROM: a regex (`re.search`) choosing the grafted modules, the "
        "outermost that match (`layers\\.\\d+$`: each decoder layer); unset: every captured leaf.",
    )
    graft_map: Annotated[list[str] | None, BeforeValidator(_map_rules)] = Field(
        None,
        description="With GRAFT_FROM: `PATTERN=REPL` rules (a JSON array, or one rule) that turn "
        "this model's module names into the reference's, as `tracedump diff --map`.",
    )

    @model_validator(mode="before")
    @classmethod
    def _blank_is_unset(cls, data: Any) -> Any:
        """A blank config value is unset (the default applies), as a blank env var is: one rule."""
        return {k: v for k, v in data.items() if not _blank(v)} if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _filter_xor_filter_fn(self) -> _DumpFields:
        if self.filter is not None and self.filter_fn is not None:
            raise ValueError("FILTER and FILTER_FN are mutually exclusive: set one of them")
        return self

    @model_validator(mode="after")
    def _grafted_runs_dump_every_module(self) -> _DumpFields:
        """With GRAFT_FROM and MODULES unset, every module is dumped (as ``tracedump.graft()``):
        a grafted level's output alone can hide a small bug inside it under bf16 rounding."""
        if self.graft_from is not None and "modules" not in self.model_fields_set:
            self.modules = "all"
        return self

    @property
    def enabled(self) -> bool:
        """Dumping is on: ``DIR`` is set (the rule of :func:`is_enabled`)."""
        return is_enabled(self, env_prefix=None)

    @property
    def step_selection(self) -> StepSelection:
        """The passes to keep; every pass when ``steps`` is unset."""
        return self.steps or StepSelection()


class DumpConfig(_DumpFields):
    """The dump settings as a plain pydantic model, for an engine to embed in its own config
    (``dump: tracedump.DumpConfig = tracedump.DumpConfig()``, then ``attach(model, config.dump)``).
    Only the fields set explicitly take part in the merge, so env vars still overlay the rest."""


class _Source(PydanticBaseSettingsSource):
    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # unused: __call__ gives every value at once


class EnvSource(_Source):
    """The one reader of the environment for settings: ``<prefix>DUMP_<FIELD>``, ``FIELD`` exactly
    upper-case, blank = unset. Any other name with the prefix in any case (``..._FILTERS``,
    ``tracedump_dump_mode``) goes to :attr:`unknown`, refused by :class:`ConfigSource`: a name in
    another case is never read, so it cannot silently win or lose against the upper-case one."""

    def __init__(self, settings_cls: type[BaseSettings], prefix: str) -> None:
        super().__init__(settings_cls)
        self.prefix = prefix  # with DUMP_: "TRACEDUMP_DUMP_"
        names = {prefix + field.upper(): field for field in settings_cls.model_fields}
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
            names = ", ".join(self.env.prefix + field.upper() for field in fields)
            raise ConfigError(
                f"tracedump: bad setting\n  unknown setting(s): {', '.join(sorted(unknown))}; known: {names}"
            )
        if any(field in self.env.values for field in FILTER_CHOICE):
            values = {key: value for key, value in values.items() if key not in FILTER_CHOICE}
        return values


class DumpSettings(BaseSettings, _DumpFields):
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
        origins = {field: _origin(field, data.get(field, "")) for field in cls.model_fields}
        try:
            settings = handler(data)
        except ValidationError as e:
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
        return {field: self._origins.get(field) or _origin(field, "") for field in type(self).model_fields}

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
    config: DumpConfig | _DumpFields | dict[str, Any] | None = None, env_prefix: str = DEFAULT_ENV_PREFIX
) -> DumpSettings:
    """Read the settings once: env > ``config`` > defaults. Raises :class:`ConfigError`. Imports no
    user code; :meth:`DumpSettings.resolve_callables` does."""
    if isinstance(config, BaseModel):  # only the fields it set explicitly take part
        config = {
            name: getattr(config, name) for name in config.model_fields_set & _DumpFields.model_fields.keys()
        }
    elif not isinstance(config, (dict, type(None))):
        raise ConfigError(
            f"config must be a tracedump.DumpConfig, a dict or None, not {type(config).__name__}"
        )
    try:
        return DumpSettings(**(config or {}), _env_prefix=env_prefix + "DUMP_")
    except ValidationError as e:
        messages = [item["msg"] for item in e.errors() if item["type"] == "bad_setting"]
        raise ConfigError("\n".join(messages) or str(e)) from e


def check_combination(settings: DumpSettings) -> None:
    """Settings each valid alone that cannot go together (raises :class:`ConfigError`): checked by
    ``attach()`` and by ``tracedump run`` before it starts COMMAND.

    ``CONTROL`` numbers passes by engine step and arms windows of them; ``STEPS`` would select
    fixed ones, so an armed window outside them would dump nothing and never end: refused."""
    if settings.control and settings.steps is not None:
        raise ConfigError(
            f"tracedump: bad setting\n  {settings.describe('steps')} with {settings.describe('control')}: "
            "STEPS cannot be combined with CONTROL (an armed window outside STEPS would dump nothing "
            "and never end); unset STEPS and choose the steps with `tracedump arm DIR --steps N`"
        )
