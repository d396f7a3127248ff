"""The on-disk format of a dump, in one place: every name, key and record a writer and a reader share.

- the format version (:data:`FORMAT_VERSION`) and the check every reader makes
  (:func:`check_format`): a major version this tracedump does not know is refused, clearly;
- file and folder names: pass and part files, ``records.safetensors``, ``stats.jsonl``,
  ``manifest.json``, run dirs ``rank<R>_pid<P>[-N]`` (a name and its regex side by side);
- the safetensors ``__metadata__`` keys of a pass file (:func:`pass_metadata`);
- tensor keys, ``module[path]::callN`` and ``module@in[path]::callN`` (:class:`Key`);
- ``stats.jsonl`` records (:data:`StatsRecord`) and ``manifest.json`` (:class:`Manifest`).

docs/file-format.md describes the same contract in prose. This module imports nothing heavy (no
torch, no numpy): ``tracedump ls``/``show`` and the loader's header parsing start without them.

Version rule: :data:`FORMAT_VERSION` is a string ``MAJOR[.MINOR]``. A minor change only adds
(a metadata key, a manifest key, a stats field) and leaves every existing name and meaning as it
was, so a reader ignores what it does not know. A change that breaks readers bumps the major, and
a reader refuses a major outside :data:`READABLE_MAJORS` with :class:`FormatVersionError` rather
than misreading it. Dumps written before the version was one string hold ``"format": 1`` (an int)
in the manifest; that reads as major 1.
"""

from __future__ import annotations

import json
import math
import re
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, TypedDict, Union

from ._version import __version__

# ------------------------------------------------------------------ version

FORMAT_VERSION = "1"  # written in the manifest ("format") and in every pass file (FORMAT_KEY)
READABLE_MAJORS = frozenset({1})
_VERSION_TEXT = re.compile(r"(\d+)(?:\.\d+)*")


class DumpReadError(ValueError):
    """A path is not a readable dump, run dir or pass file."""


class FormatVersionError(DumpReadError):
    """A file was written in a format version whose major this tracedump cannot read."""


def format_major(version: object) -> int | None:
    """The major of a written version: ``"1"``, ``"1.2"`` and the int ``1`` are 1; None when the
    value is no version at all."""
    if isinstance(version, int) and not isinstance(version, bool):
        return version
    if isinstance(version, str):
        match = _VERSION_TEXT.fullmatch(version)
        return int(match.group(1)) if match else None
    return None


def check_format(version: object, where: object) -> None:
    """Refuse a format this tracedump cannot read; ``where`` (a path) names the file in the error.

    ``None`` (no version written) passes: a safetensors file not made by tracedump carries none, and
    neither does a manifest written by hand for a dump made by other means."""
    if version is None:
        return
    major = format_major(version)
    if major is None:
        raise FormatVersionError(f"{where}: format version {version!r} is not a version")
    if major not in READABLE_MAJORS:
        readable = ", ".join(str(m) for m in sorted(READABLE_MAJORS))
        raise FormatVersionError(
            f"{where}: written in tracedump format {version!r} (major {major}); tracedump "
            f"{__version__} reads format major {readable} only. Read it with the tracedump that wrote it."
        )


# ------------------------------------------------------------------ file and folder names

MANIFEST = "manifest.json"
RECORDS_FILE = "records.safetensors"  # record() calls made outside every pass
STATS_FILE = "stats.jsonl"
STATS_PARTIAL = "stats.jsonl.partial"  # stats.jsonl while the process runs
PASS_FILE_RE = re.compile(r"^pass(\d+)(?:\.part(\d+))?\.safetensors$")
RUN_DIR_RE = re.compile(r"^rank(\d+)_pid(\d+)(?:-(\d+))?$")


class PassFileName(NamedTuple):
    index: int
    part: int | None  # None: the whole pass in one file


class RunDirName(NamedTuple):
    rank: int
    pid: int
    serial: int  # 1 for rank<R>_pid<P>, N for the N-th dumper of the process (rank<R>_pid<P>-N)


def pass_file_name(index: int, part: int | None = None) -> str:
    """``pass00003.safetensors``, or ``pass00003.part1.safetensors`` for a pass split into parts."""
    return f"pass{index:05d}.safetensors" if part is None else f"pass{index:05d}.part{part}.safetensors"


def parse_pass_file_name(name: str) -> PassFileName | None:
    """``pass00003.part1.safetensors`` -> ``(3, 1)``; None for any other file name."""
    match = PASS_FILE_RE.match(name)
    if match is None:
        return None
    return PassFileName(int(match.group(1)), None if match.group(2) is None else int(match.group(2)))


def run_dir_name(rank: int, pid: int, serial: int = 1) -> str:
    """``rank0_pid7``; ``rank0_pid7-2`` for the second dumper of that process, and so on."""
    return f"rank{rank}_pid{pid}" + (f"-{serial}" if serial > 1 else "")


def parse_run_dir_name(name: str) -> RunDirName | None:
    """``rank0_pid7-2`` -> ``(0, 7, 2)``; None for a name that is no run dir's."""
    match = RUN_DIR_RE.match(name)
    if match is None:
        return None
    return RunDirName(int(match.group(1)), int(match.group(2)), int(match.group(3)) if match.group(3) else 1)


# ------------------------------------------------------------------ pass file metadata

FORMAT_KEY = "tracedump.format"
PASS_KEY = "tracedump.pass"
MODE_KEY = "tracedump.mode"
PART_KEY = "tracedump.part"
TRUNCATED_KEY = "tracedump.truncated"
ORDER_KEY = "tracedump.order"  # JSON list of the file's keys in capture order
BATCH_KEY = "tracedump.batch"  # Dumper.set_batch(): each token row's sequence, position, token id
SEQ_KEY = "tracedump.seq"  # stats mode: capture sequence numbers, a JSON list aligned with ORDER_KEY
METADATA_KEYS = (FORMAT_KEY, PASS_KEY, MODE_KEY, PART_KEY, SEQ_KEY, TRUNCATED_KEY, BATCH_KEY, ORDER_KEY)


def pass_metadata(
    index: int,
    mode: str,
    *,
    part: int | None = None,
    seqs: Iterable[int] | None = None,
    truncated: bool = False,
    batch: str | None = None,
) -> dict[str, str]:
    """A pass file's ``__metadata__``, all but :data:`ORDER_KEY` (added with the tensors)."""
    metadata = {FORMAT_KEY: FORMAT_VERSION, PASS_KEY: str(index), MODE_KEY: mode}
    if part is not None:
        metadata[PART_KEY] = str(part)
    if seqs is not None:
        metadata[SEQ_KEY] = json.dumps(list(seqs))
    if truncated:
        metadata[TRUNCATED_KEY] = "true"
    if batch is not None:
        metadata[BATCH_KEY] = batch
    return metadata


# ------------------------------------------------------------------ tensor keys

_KEY = re.compile(
    r"(?P<module>.+?)(?P<input>@in)?(?P<path>(?:\[[^\]]*\])*)(?:::call(?P<call>[1-9]\d*))?", re.S
)


@dataclass(frozen=True)
class Key:
    """A tensor's key in a pass file: ``module`` + ``@in`` for an input + ``path`` + ``::callN``.

    ``path`` is where the tensor sits in the module's output (or input): ``""`` for a bare tensor,
    ``[0]``, ``[1][a]``, ``[last_hidden_state]``; an input's path starts with its argument,
    ``[0]`` or ``[attention_mask]``. ``call`` is 0 for the first call of the module in its pass and
    N for the (N+1)-th (``::callN``). A ``record()`` tag is a key's ``module``.

    ``Key.parse(text).format() == text`` for every string. ``Key.parse(key.format()) == key`` for
    every key tracedump writes, as long as the module name (or tag) ends in no suffix of its own
    (``[...]``, ``@in``, ``::callN``) and no dict key on the path holds a ``]``: of a tag such as
    ``"scores[3]"``, ``parse`` reads ``[3]`` as a path, as the comparator always has.
    """

    module: str
    path: str = ""
    input: bool = False
    call: int = 0

    def format(self) -> str:
        call = f"::call{self.call}" if self.call else ""
        return f"{self.module}{'@in' if self.input else ''}{self.path}{call}"

    __str__ = format

    @classmethod
    def parse(cls, text: str) -> Key:
        """The key written as ``text`` (ValueError for the empty string)."""
        match = _KEY.fullmatch(text)
        if match is None:
            raise ValueError(f"not a tensor key: {text!r}")
        call = match.group("call")
        return cls(
            match.group("module"), match.group("path"), match.group("input") is not None, int(call or 0)
        )

    @property
    def tensor_label(self) -> str:
        """The ``tensor`` field of its stats record: ``out``/``in`` + ``path`` (``out[0]``, ``in[kw]``)."""
        return ("in" if self.input else "out") + self.path

    @classmethod
    def from_stats(cls, record: Mapping[str, Any]) -> Key:
        """The key a stats record stands for: ``{"module": m, "tensor": "in[0]", "call": 2}`` is
        ``m@in[0]::call2``, the name a full dump stores the same capture under."""
        label = str(record.get("tensor", "out"))
        is_input = label.startswith("in")
        return cls(
            str(record["module"]),
            label[2:] if is_input else label[3:],
            is_input,
            int(record.get("call", 0) or 0),
        )


# ------------------------------------------------------------------ stats.jsonl records

# The statistics that are numbers, in their canonical order; ``shape`` and ``dtype`` are the others.
NUMERIC_STAT_NAMES = ("abs_mean", "sum", "min", "max", "mean", "std", "l2", "nan_count", "inf_count")
COUNT_STAT_NAMES = frozenset({"nan_count", "inf_count"})  # written as integers
NONFINITE_SPELLINGS = frozenset({"nan", "inf", "-inf"})  # how a record spells non-finite numbers

StatNumber = float | int | str
# One line of stats.jsonl. ``pass`` is a keyword, hence the functional form.
StatsRecord = TypedDict(
    "StatsRecord",
    {
        "module": str,
        "tensor": str,
        "pass": int,
        "call": int,
        "seq": int,
        "shape": list[int],
        "dtype": str,
        **dict.fromkeys(NUMERIC_STAT_NAMES, StatNumber),
    },
    total=False,
)


def json_number(value: float, name: str = "") -> float | int | str:
    """NaN and infinities become the strings ``"nan"``, ``"inf"``, ``"-inf"``: strict JSON stays valid.
    Counts are written as integers."""
    if name in COUNT_STAT_NAMES:
        return int(value)
    if math.isfinite(value):
        return value
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


def stats_record(key: Key, pass_index: int, seq: int, extras: Mapping[str, Any] | None = None) -> StatsRecord:
    """A record's fields but the numbers: which capture (``key``), where in its pass, and the
    non-numeric statistics (``shape``, ``dtype``) in ``extras``."""
    record: StatsRecord = {
        "module": key.module,
        "tensor": key.tensor_label,
        "pass": pass_index,
        "call": key.call,
        "seq": seq,
    }
    record.update(extras or {})  # type: ignore[typeddict-item]
    return record


def with_numbers(base: Mapping[str, Any], names: Iterable[str], values: Iterable[float]) -> StatsRecord:
    """``base`` (a :func:`stats_record`) completed with the numeric statistics, as written."""
    record = dict(base)
    record.update({name: json_number(value, name) for name, value in zip(names, values, strict=True)})
    return typing.cast(StatsRecord, record)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    if isinstance(value, str):
        return value in NONFINITE_SPELLINGS
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def stats_record_problem(record: Any) -> str | None:
    """Why a parsed ``stats.jsonl`` line is not a stats record; None when it is one. Fields a reader
    does not know are let through (a minor version may add some)."""
    if not isinstance(record, dict):
        return "not a JSON object"
    if not isinstance(record.get("module"), str):
        return 'no "module" name'
    if not _is_int(record.get("pass")):
        return 'no integer "pass"'
    for key, check in (("call", _is_int), ("seq", _is_int), ("tensor", lambda v: isinstance(v, str))):
        if key in record and not check(record[key]):
            return f"{key!r} is {record[key]!r}"
    shape = record.get("shape")
    if shape is not None and not (isinstance(shape, list) and all(_is_int(s) for s in shape)):
        return f"'shape' is {shape!r}"
    for name in NUMERIC_STAT_NAMES:
        value = record.get(name)
        if value is not None and not _is_number(value):
            return f"{name!r} is {value!r}"
    return None


# ------------------------------------------------------------------ manifest.json


class PassesSummary(TypedDict):
    """The manifest's ``passes``."""

    count: int  # passes with files
    bytes: int  # bytes written (tensor files plus stats lines)
    files: int  # write jobs completed
    indices: list[int]  # sorted pass indices


class ErrorEntry(TypedDict):
    """One entry of the manifest's ``errors``: each distinct (where, type) of run-time error once."""

    where: str  # the module, ``record('tag')``, ``pass N`` or ``writer``
    type: str  # the exception's class name
    message: str  # its first message
    count: int  # how often it happened


class Manifest(TypedDict, total=False):
    """``manifest.json``, key for key as the dumper writes it (docs/file-format.md has each key's
    meaning). :data:`MANIFEST_AT_START` are written when the dumper starts; ``end_time`` and
    ``records_file`` at close, ``control`` only with CONTROL=1, ``manifest_error`` only after a
    failed manifest write."""

    format: str | int  # FORMAT_VERSION; the int 1 in dumps written before it was one string
    tracedump_version: str
    torch_version: str
    python_version: str
    settings: dict[str, Any]
    env_prefix: str
    model_class: str
    root: str
    modules: list[str]
    precision: dict[str, Any]
    pid: int
    rank: int
    world_size: int
    hostname: str
    argv: list[str]
    start_time: str
    complete: bool
    incomplete_reason: str | None
    skipped: dict[str, int]
    truncated_passes: list[int]
    errors: list[dict[str, Any]]  # ErrorEntry each
    anomalies: dict[str, str]
    passes: PassesSummary
    end_time: str
    records_file: str | None
    control: dict[str, Any]
    manifest_error: str


MANIFEST_KEYS = tuple(Manifest.__annotations__)
MANIFEST_AT_START = frozenset(MANIFEST_KEYS) - {"end_time", "records_file", "control", "manifest_error"}


def check_manifest(data: Any, where: object) -> Manifest:
    """A parsed ``manifest.json`` as a :class:`Manifest`: a JSON object in a readable format version
    (:func:`check_format`; DumpReadError otherwise). Nothing else is required of it, so manifests of
    older writers, lacking later keys, still read; :func:`manifest_problems` checks every key."""
    if not isinstance(data, dict):
        raise DumpReadError(f"{where}: not a JSON object")
    check_format(data.get("format"), where)
    return typing.cast(Manifest, data)


def manifest_problems(data: Any, *, closed: bool = False) -> list[str]:
    """Each way ``data`` is not a manifest as this version writes one: a key missing (those written
    at start; with ``closed``, also those written at close), a key it does not know, a value of
    another type. [] for a valid manifest."""
    if not isinstance(data, dict):
        return ["not a JSON object"]
    required = MANIFEST_AT_START | ({"end_time", "records_file"} if closed else set())
    problems = [f"'{key}' missing" for key in MANIFEST_KEYS if key in required and key not in data]
    problems += _typed_dict_problems(data, Manifest, "")
    return problems


def _typed_dict_problems(data: dict[str, Any], schema: Any, prefix: str) -> list[str]:
    hints = typing.get_type_hints(schema)
    problems = [f"unknown key '{prefix}{key}'" for key in data if key not in hints]
    for key, hint in hints.items():
        if key not in data:
            if key in schema.__required_keys__:
                problems.append(f"'{prefix}{key}' missing")
            continue
        if typing.is_typeddict(hint):
            if isinstance(data[key], dict):
                problems += _typed_dict_problems(data[key], hint, f"{prefix}{key}.")
                continue
        elif _conforms(data[key], hint):
            continue
        problems.append(f"'{prefix}{key}' is {data[key]!r}, not {_hint_name(hint)}")
    return problems


def _conforms(value: Any, hint: Any) -> bool:
    """Whether a JSON value fits a type hint of the manifest's (no more than those need)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    if origin in (Union, types.UnionType):
        return any(_conforms(value, arg) for arg in args)
    if origin is list:
        return isinstance(value, list) and all(_conforms(item, args[0]) for item in value)
    if origin is dict:
        return isinstance(value, dict) and all(
            isinstance(k, str) and _conforms(v, args[1]) for k, v in value.items()
        )
    if hint is int:
        return _is_int(value)
    if hint is float:
        return _is_number(value) and not isinstance(value, str)
    return isinstance(value, hint)


def _hint_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def dtype_name(dtype: object) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")
