"""The on-disk format of a dump, in one place: every name, key and record a writer and a reader share
(docs/file-format.md is the same contract in prose). Imports nothing heavy (no torch, no numpy):
``tracedump ls``/``show`` and the loader's header parsing start without them.

Version rule: :data:`FORMAT_VERSION` is ``MAJOR[.MINOR]``. A minor change only adds (a metadata key,
a manifest key, a stats field), so a reader ignores what it does not know; a change that breaks
readers bumps the major, and a reader refuses a major outside :data:`READABLE_MAJORS` rather than
misread it. Manifests written before the version was one string hold the int 1: major 1.
"""

from __future__ import annotations

import json
import math
import re
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypedDict

from .._version import __version__
from ..errors import FormatVersionError

# ------------------------------------------------------------------ version

FORMAT_VERSION = "1.1"  # written in the manifest ("format") and in every pass file (FORMAT_KEY)
READABLE_MAJORS = frozenset({1})
_VERSION_TEXT = re.compile(r"(\d+)(?:\.\d+)*")


_MAJOR_DIGITS = 9  # a major of more digits is no version any tracedump wrote: unknown, never int()'d
_SHOWN = 40  # characters of a bad version quoted in a message


def format_major(version: object) -> int | None:
    """``"1"``, ``"1.2"`` and the int ``1`` are major 1; None when the value is no version at all.
    A major of more than nine digits (``"1" * 5001``) is -1, a major no tracedump reads: converting
    it could exceed Python's integer conversion limit."""
    if type(version) is int:
        return version
    if not isinstance(version, str) or len(version) > 10_000:
        return None
    match = _VERSION_TEXT.fullmatch(version)
    if match is None:
        return None
    return int(match.group(1)) if len(match.group(1)) <= _MAJOR_DIGITS else -1


def _shown(version: object) -> str:
    text = repr(version)
    return text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."


def check_format(version: object, where: object) -> None:
    """Refuse a format this tracedump cannot read, naming ``where``. No version at all passes: a
    safetensors file from elsewhere, or a manifest written by hand, carries none."""
    if version is None:
        return
    major = format_major(version)
    if major is None:
        raise FormatVersionError(f"{where}: format version {_shown(version)} is not a version")
    if major not in READABLE_MAJORS:
        readable = ", ".join(str(m) for m in sorted(READABLE_MAJORS))
        said = f"major {_shown(major)}" if major >= 0 else "an unknown major"
        raise FormatVersionError(
            f"{where}: written in tracedump format {_shown(version)} ({said}); tracedump "
            f"{__version__} reads format major {readable} only. Read it with the tracedump that wrote it."
        )


# ------------------------------------------------------------------ file and folder names

MANIFEST = "manifest.json"
RECORDS_FILE = "records.safetensors"  # record() calls made outside every pass
STATS_FILE = "stats.jsonl"
STATS_PARTIAL = "stats.jsonl.partial"  # stats.jsonl while the process runs
PASS_FILE_RE = re.compile(r"^pass(\d+)(?:\.part(\d+))?\.safetensors$")
RUN_DIR_RE = re.compile(r"^rank(\d+)_pid(\d+)(?:-(\d+))?$")


def pass_file_name(index: int, part: int | None = None) -> str:
    return f"pass{index:05d}.safetensors" if part is None else f"pass{index:05d}.part{part}.safetensors"


def parse_pass_file_name(name: str) -> tuple[int, int | None] | None:
    """``pass00003.part1.safetensors`` -> ``(3, 1)`` (part None for a whole pass); None for other names."""
    match = PASS_FILE_RE.match(name)
    return None if match is None else (int(match[1]), None if match[2] is None else int(match[2]))


def run_dir_name(rank: int, pid: int, serial: int = 1) -> str:
    """``rank0_pid7``; ``rank0_pid7-2`` for the second dumper of that process, and so on."""
    return f"rank{rank}_pid{pid}" + (f"-{serial}" if serial > 1 else "")


def parse_run_dir_name(name: str) -> tuple[int, int, int] | None:
    """``rank0_pid7-2`` -> ``(rank, pid, serial) = (0, 7, 2)``; None for a name that is no run dir's."""
    match = RUN_DIR_RE.match(name)
    return None if match is None else (int(match[1]), int(match[2]), int(match[3] or 1))


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

INPUT_MARK = "@in"
"""What a module input's key says after the module's name (``name@in[0]``, ``name@in[kw]``): the
one spelling of it, for the keys, the hooks that flatten a call's inputs and the grafter."""

SHADOW_PREFIX = "shadow~"
"""A grafted run's fp32 shadow of the capture ``KEY`` is stored under ``shadow~KEY`` in the same
pass file (:mod:`tracedump.dump.shadow`); the comparator pairs it by ``KEY``, never by itself."""
SHADOW_NOISE_PREFIX = "shadow-noise~"
"""``shadow-noise~KEY``: float64 ``[draws, 2]``, per draw ``[rel_diff, 1 - cosine]`` of the shadow
of ``KEY`` with its weights moved within the run dtype's rounding, against the shadow (a dump of
the first shadow release holds one draw, ``[2]``): the logic check's allowance."""


def is_shadow_key(name: str) -> bool:
    """A shadow's entry (:data:`SHADOW_PREFIX`, :data:`SHADOW_NOISE_PREFIX`): not a capture of its own."""
    return name.startswith((SHADOW_PREFIX, SHADOW_NOISE_PREFIX))


_KEY = re.compile(
    rf"(?P<module>.+?)(?P<input>{re.escape(INPUT_MARK)})?"
    r"(?P<path>(?:\[[^\]]*\])*)(?:::call(?P<call>[1-9]\d*))?",
    re.S,
)


def key_text(module: str, path: str = "", input: bool = False, call: int = 0) -> str:
    """``Key(module, path, input, call).format()`` without building the Key: the recorder names
    every capture with it, on the host's hot path, where a frozen dataclass per capture costs more
    than the text."""
    text = f"{module}{INPUT_MARK}{path}" if input else f"{module}{path}"
    return f"{text}::call{call}" if call else text


@dataclass(frozen=True)
class Key:
    """A tensor's key in a pass file: ``module`` + ``@in`` for an input + ``path`` + ``::callN``.

    ``path`` is where the tensor sits in the module's output (or input, starting with its argument):
    ``""``, ``[0]``, ``[1][a]``, ``[attention_mask]``. ``call`` N is the (N+1)-th call of the module
    under ``module`` in its pass (0: no suffix). A module with several names (shared by several
    parents) is keyed by the name of the parent that called it (docs/file-format.md, "Shared
    modules named where they are called"). A ``record()`` tag is a key's ``module``.

    ``Key.parse(text).format() == text`` for every string; ``Key.parse(key.format()) == key`` unless
    the module name (or tag) ends in a suffix of its own or a dict key on the path holds a ``]``: of
    a tag such as ``"scores[3]"``, ``parse`` reads ``[3]`` as a path, as the comparator always has.
    """

    module: str
    path: str = ""
    input: bool = False
    call: int = 0

    def format(self) -> str:
        return key_text(self.module, self.path, self.input, self.call)

    __str__ = format

    @classmethod
    def parse(cls, text: str) -> Key:
        match = _KEY.fullmatch(text)
        if match is None:
            raise ValueError(f"not a tensor key: {text!r}")
        return cls(match["module"], match["path"], match["input"] is not None, int(match["call"] or 0))

    @property
    def tensor_label(self) -> str:
        """The ``tensor`` field of its stats record: ``out``/``in`` + ``path`` (``out[0]``, ``in[kw]``)."""
        return tensor_label(self.path, self.input)

    @classmethod
    def from_stats(cls, record: Mapping[str, Any]) -> Key:
        """The key a stats record stands for: the name a full dump stores the same capture under."""
        label = str(record.get("tensor", "out"))
        is_input = label.startswith("in")
        path = label[2:] if is_input else label[3:]
        return cls(str(record["module"]), path, is_input, int(record.get("call", 0) or 0))


# ------------------------------------------------------------------ stats.jsonl records

# The statistics that are numbers, in their canonical order; ``shape`` and ``dtype`` are the others.
NUMERIC_STAT_NAMES = ("abs_mean", "sum", "min", "max", "mean", "std", "l2", "nan_count", "inf_count")
COUNT_STAT_NAMES = frozenset({"nan_count", "inf_count"})  # written as integers

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
        **dict.fromkeys(NUMERIC_STAT_NAMES, float | int | str),
    },
    total=False,
)


def json_number(value: float, name: str = "") -> float | int | str:
    """NaN and infinities become the strings ``"nan"``, ``"inf"``, ``"-inf"``: strict JSON stays valid."""
    if name in COUNT_STAT_NAMES:
        return int(value)
    if math.isfinite(value):
        return value
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


def tensor_label(path: str, is_input: bool) -> str:
    """The ``tensor`` field of a stats record: ``out``/``in`` + ``path`` (``out[0]``, ``in[kw]``)."""
    return ("in" if is_input else "out") + path


def stats_record(key: Key, pass_index: int, seq: int, extras: Mapping[str, Any] | None = None) -> StatsRecord:
    """A record's fields but the numbers; ``extras`` holds ``shape`` and ``dtype``."""
    return capture_stats_record(key.module, key.path, key.input, key.call, pass_index, seq, extras)


def capture_stats_record(
    module: str,
    path: str,
    is_input: bool,
    call: int,
    pass_index: int,
    seq: int,
    extras: Mapping[str, Any] | None = None,
) -> StatsRecord:
    """:func:`stats_record` from a :class:`Key`'s fields, without building the Key: the recorder
    makes one per captured tensor in the host's forward, where a frozen dataclass costs more than
    the record (as :func:`key_text`)."""
    record: StatsRecord = {
        "module": module,
        "tensor": tensor_label(path, is_input),
        "pass": pass_index,
        "call": call,
        "seq": seq,
    }
    record.update(extras or {})  # type: ignore[typeddict-item]
    return record


def with_numbers(base: Mapping[str, Any], names: Iterable[str], values: Iterable[float]) -> StatsRecord:
    """``base`` (a :func:`stats_record`) completed with the numeric statistics, as written."""
    record = dict(base)
    record.update({name: json_number(value, name) for name, value in zip(names, values, strict=True)})
    return typing.cast(StatsRecord, record)


# ------------------------------------------------------------------ manifest.json


class PassesSummary(TypedDict):
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
    """``manifest.json``, key for key in the order the dumper writes it (docs/file-format.md has
    each key's meaning). ``end_time`` and ``records_file`` are written at close, ``control`` only
    with CONTROL=1, ``compiled`` only with COMPILED=1, ``manifest_error`` only after a failed
    manifest write; the rest at start."""

    format: str | int  # FORMAT_VERSION; the int 1 in dumps written before it was one string
    tracedump_version: str
    torch_version: str
    python_version: str
    settings: dict[str, Any]
    env_prefix: str
    model_class: str
    framework: str  # 1.1: the package the model's class comes from ("transformers", "vllm", "torch")
    framework_version: str | None  # 1.1: that package's version (None when it has none to give)
    root: str
    modules: list[str]
    module_classes: dict[str, str]  # 1.1: each captured module name (and shared alias) -> class qualname
    shared_modules: dict[str, list[str]]  # 1.1: a module with several names -> the names it is dumped under
    precision: dict[str, Any]
    attention: dict[str, Any]  # optional (older dumps lack it): {"causal", "causal_modules", "not_causal"}
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
    errors: list[ErrorEntry]
    anomalies: dict[str, str]
    passes: PassesSummary
    end_time: str
    records_file: str | None
    control: dict[str, Any]
    compiled: dict[str, int]  # only with COMPILED=1: taps, cuda_graphs, graph_tap_bytes, idle_graph_steps
    manifest_error: str


def last_row_dim(shape: tuple[int, ...], token_dim: int) -> int | None:
    """The dim ``last_row`` mode cuts to its last index in a tensor of ``shape``; None when it keeps
    the tensor whole (under 2 dims, or an empty token dim). The comparator cuts full dumps with it,
    so they line up with ``last_row`` dumps exactly as the dumper cut them; here, not in
    :mod:`tracedump.store.reduce`, because the comparator reads dumps without torch."""
    if len(shape) < 2:
        return None
    dim = token_dim if len(shape) > token_dim else 0
    return dim if shape[dim] > 0 else None


def dtype_name(dtype: object) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")
