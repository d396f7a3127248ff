"""Reading dumps back: ``load_pass`` for one file, ``open_dump`` for lazy access to a whole dump.

Pass files are memory-mapped (safetensors ``safe_open``): reading one tensor of a multi-GB pass
touches only that tensor's bytes. Capture order comes from the file's metadata; part files of a
pass too large for the memory cap are reassembled transparently.
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from .writer import MANIFEST, ORDER_KEY, RECORDS_FILE, STATS_FILE, STATS_PARTIAL

_PASS_RE = re.compile(r"^pass(\d+)(?:\.part(\d+))?\.safetensors$")
_RUN_RE = re.compile(r"^rank(\d+)_pid(\d+)(?:-(\d+))?$")
_SAFETENSORS_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "U16": "uint16",
    "U32": "uint32",
    "U64": "uint64",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "C64": "complex64",
}


class DumpReadError(ValueError):
    """A path is not a readable dump, run dir or pass file."""


@dataclass(frozen=True)
class TensorInfo:
    """Shape and dtype of a stored tensor, known without reading its data."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        n = 1
        for size in self.shape:
            n *= size
        return n


def _order_from_metadata(metadata: dict[str, str] | None, keys: list[str]) -> list[str]:
    order = json.loads(metadata[ORDER_KEY]) if metadata and ORDER_KEY in metadata else None
    if order is None or set(order) != set(keys):
        return list(keys)
    return order


class PassFile:
    """One pass: its files (one, or several parts), names in capture order, lazy tensor access."""

    def __init__(self, index: int, files: list[Path]) -> None:
        self.index = index
        self.files = files
        self._handles: list[Any] = []
        self._where: dict[str, int] = {}
        self._names: list[str] = []
        for position, path in enumerate(files):
            handle = safe_open(str(path), framework="pt")
            names = _order_from_metadata(handle.metadata(), list(handle.keys()))
            self._handles.append(handle)
            for name in names:
                self._where[name] = position
            self._names.extend(names)

    @property
    def names(self) -> list[str]:
        """Tensor names in capture order."""
        return list(self._names)

    @property
    def metadata(self) -> dict[str, str]:
        return dict(self._handles[0].metadata() or {}) if self._handles else {}

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def __len__(self) -> int:
        return len(self._names)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __getitem__(self, name: str) -> torch.Tensor:
        """Read one tensor (memory-mapped: only its bytes are touched)."""
        return self._handles[self._where[name]].get_tensor(name)

    def info(self, name: str) -> TensorInfo:
        sliced = self._handles[self._where[name]].get_slice(name)
        raw = sliced.get_dtype()
        return TensorInfo(tuple(sliced.get_shape()), _SAFETENSORS_DTYPES.get(raw, raw.lower()))

    def load(self) -> dict[str, torch.Tensor]:
        return {name: self[name] for name in self._names}

    @property
    def nbytes(self) -> int:
        return sum(path.stat().st_size for path in self.files)

    def __repr__(self) -> str:
        return f"PassFile({self.index}, tensors={len(self)}, files={[p.name for p in self.files]})"


def _group_pass_files(run_dir: Path) -> dict[int, list[Path]]:
    groups: dict[int, list[tuple[int, Path]]] = {}
    for path in run_dir.iterdir():
        match = _PASS_RE.match(path.name)
        if match:
            part = int(match.group(2)) if match.group(2) is not None else 0
            groups.setdefault(int(match.group(1)), []).append((part, path))
    return {index: [p for _, p in sorted(parts)] for index, parts in sorted(groups.items())}


def load_pass(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a pass file, ordered as captured.

    Accepts a ``.safetensors`` pass (or any of its part files, or the name of a pass stored only as
    parts) and ``.pt`` files holding ``{name: tensor}`` (loaded with ``weights_only=True``).
    """
    path = Path(path)
    if path.suffix == ".pt":
        data = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(data, dict) or not all(isinstance(v, torch.Tensor) for v in data.values()):
            raise DumpReadError(f"{path}: expected a dict of tensors, got {type(data).__name__}")
        return dict(data)
    return open_pass(path).load()


def open_pass(path: str | Path) -> PassFile:
    """A lazy :class:`PassFile` for a pass path (parts reassembled)."""
    path = Path(path)
    match = _PASS_RE.match(path.name)
    if match and path.parent.is_dir():
        files = _group_pass_files(path.parent).get(int(match.group(1)))
        if files:
            return PassFile(int(match.group(1)), files)
    if not path.is_file():
        raise DumpReadError(f"{path}: no such pass file")
    try:
        return PassFile(-1, [path])
    except Exception as e:
        raise DumpReadError(f"{path}: not a readable safetensors file ({e})") from e


@dataclass
class Run:
    """One process's dump: ``rank<R>_pid<P>/`` with its passes, manifest and stats."""

    path: Path
    rank: int
    pid: int
    manifest: dict[str, Any] = field(default_factory=dict)

    @cached_property
    def passes(self) -> dict[int, PassFile]:
        return {index: PassFile(index, files) for index, files in _group_pass_files(self.path).items()}

    @property
    def records(self) -> PassFile | None:
        """Records made outside every pass (``records.safetensors``), if any."""
        path = self.path / RECORDS_FILE
        return PassFile(-1, [path]) if path.is_file() else None

    @property
    def complete(self) -> bool:
        return bool(self.manifest.get("complete"))

    def stats(self) -> list[dict[str, Any]]:
        """Stats-mode records (one per tensor), from ``stats.jsonl`` or a crashed run's partial file."""
        path = self.path / STATS_FILE
        if not path.is_file():
            path = self.path / STATS_PARTIAL
        if not path.is_file():
            return []
        records = []
        for number, line in enumerate(path.read_text().splitlines(), 1):
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                warnings.warn(
                    f"{path}:{number}: torn line skipped (the run did not close cleanly)", stacklevel=2
                )
        return records

    @property
    def name(self) -> str:
        return self.path.name


@dataclass
class Dump:
    """A dump directory: one :class:`Run` per process (rank, pid)."""

    path: Path
    runs: list[Run]

    def run(self, rank: int | None = None) -> Run:
        """The run of ``rank`` (the only run when rank is None and there is one)."""
        if rank is None:
            if len(self.runs) == 1:
                return self.runs[0]
            ranks = sorted({r.rank for r in self.runs})
            if len(ranks) == 1 or 0 in ranks:
                return next(r for r in self.runs if r.rank == (0 if 0 in ranks else ranks[0]))
        for run in self.runs:
            if run.rank == rank:
                return run
        raise DumpReadError(f"{self.path}: no run for rank {rank}; runs: {[r.name for r in self.runs]}")

    def by_rank(self) -> dict[int, list[Run]]:
        groups: dict[int, list[Run]] = {}
        for run in self.runs:
            groups.setdefault(run.rank, []).append(run)
        return groups


def _read_run(path: Path) -> Run:
    manifest: dict[str, Any] = {}
    if (path / MANIFEST).is_file():
        try:
            manifest = json.loads((path / MANIFEST).read_text())
        except json.JSONDecodeError as e:
            raise DumpReadError(f"{path / MANIFEST}: not valid JSON ({e})") from e
    match = _RUN_RE.match(path.name)
    rank = int(manifest.get("rank", match.group(1) if match else 0))
    pid = int(manifest.get("pid", match.group(2) if match else 0))
    return Run(path, rank, pid, manifest)


def _is_run_dir(path: Path) -> bool:
    return (path / MANIFEST).is_file() or any(_PASS_RE.match(p.name) for p in path.iterdir())


def open_dump(path: str | Path) -> Dump:
    """Open a dump dir (``<dir>/rank*_pid*/``) or a single run dir, lazily."""
    path = Path(path)
    if not path.is_dir():
        raise DumpReadError(f"{path}: not a directory")
    if _is_run_dir(path):
        return Dump(path, [_read_run(path)])
    runs = [_read_run(p) for p in sorted(path.iterdir()) if p.is_dir() and _RUN_RE.match(p.name)]
    if not runs:
        runs = [_read_run(p) for p in sorted(path.iterdir()) if p.is_dir() and _is_run_dir(p)]
    if not runs:
        raise DumpReadError(f"{path}: no tracedump runs here (expected rank<R>_pid<P>/ folders)")
    runs.sort(key=lambda r: (r.rank, r.pid, r.name))
    return Dump(path, runs)
