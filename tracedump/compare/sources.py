"""Load stage: turn a path (dump dir, run dir, pass file) into the runs and passes to compare.

Nothing here reads tensor data. A :class:`PassView` knows each entry's name, shape and dtype (from
the safetensors header, or from ``stats.jsonl``) and hands out values only when the executor asks.

Run selection per side, per root label (``manifest.json`` "root"; several roots in one process get
``rank0_pid123``, ``rank0_pid123-2``):

- with ``--unshard`` and several ranks: every rank, sorted;
- else ``--rank R`` when the side has several ranks (a side with one rank uses it), else rank 0
  (or the lowest rank).
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from ..loader import DumpReadError, PassFile, Run, open_dump, open_pass
from ..writer import MANIFEST
from .options import DiffOptions, UsageError
from .reader import SafetensorsMap, Stored, stored_from_torch
from .stats import infer_dtype

Kind = Literal["tensor", "stats"]
_PASS_NAME = re.compile(r"^pass(\d+)(?:\.part\d+)?\.safetensors$")


@dataclass(frozen=True)
class EntryMeta:
    """What is known of one entry without reading it."""

    kind: Kind
    shape: tuple[int, ...] | None
    dtype: str | None


def stats_key(record: dict[str, Any]) -> str:
    """The full-mode name of a stats record: ``{"module": m, "tensor": "in[0]", "call": 2}`` is
    ``m@in[0]::call2``, so stats and full dumps align by the same names."""
    label = str(record.get("tensor", "out"))
    suffix = "@in" + label[2:] if label.startswith("in") else label[3:]
    call = int(record.get("call", 0) or 0)
    return f"{record['module']}{suffix}" + (f"::call{call}" if call else "")


def last_row_shape(shape: tuple[int, ...], token_dim: int) -> tuple[int, ...]:
    """The shape ``reduce.last_row`` gives: the token dim cut to its last index (kept, size 1)."""
    if len(shape) < 2:
        return shape
    dim = token_dim if len(shape) > token_dim else 0
    return shape if shape[dim] == 0 else (*shape[:dim], 1, *shape[dim + 1 :])


class PassView:
    """One pass of one run: entries in capture order; values read lazily, one at a time.

    ``last_row_dim`` set means: present every tensor as ``last_row`` would have stored it, so a full
    dump lines up with a ``last_row`` dump of the same model.
    """

    def __init__(
        self,
        index: int,
        rank: int,
        tensors: PassFile | dict[str, torch.Tensor] | None,
        stats: list[dict[str, Any]] | None = None,
        last_row_dim: int | None = None,
    ) -> None:
        self.index = index
        self.rank = rank
        self.last_row_dim = last_row_dim
        self._maps: dict[str, SafetensorsMap] = {}
        self._dict: dict[str, torch.Tensor] = {}
        self._stats: dict[str, dict[str, Any]] = {}
        self.entries: dict[str, EntryMeta] = {}
        if isinstance(tensors, PassFile):
            self._index_pass_file(tensors)
        elif tensors is not None:
            self._dict = dict(tensors)
            for name, tensor in self._dict.items():
                self._add(name, "tensor", tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."))
        for record in stats or []:
            name = stats_key(record)
            self._stats[name] = record
            shape = tuple(record["shape"]) if isinstance(record.get("shape"), list) else None
            self._add(name, "stats", shape, infer_dtype(record))

    def _index_pass_file(self, pass_file: PassFile) -> None:
        try:
            maps = [SafetensorsMap(path) for path in pass_file.files]
        except (OSError, ValueError, struct.error) as e:
            raise DumpReadError(
                f"{pass_file.files[0]}: unreadable pass file ({type(e).__name__}: {e})"
            ) from e
        for name in pass_file.names:
            owner = next(m for m in maps if name in m)
            self._maps[name] = owner
            shape, dtype = owner.info(name)
            self._add(name, "tensor", shape, dtype)

    def _add(self, name: str, kind: Kind, shape: tuple[int, ...] | None, dtype: str | None) -> None:
        if shape is not None and self.last_row_dim is not None and kind == "tensor":
            shape = last_row_shape(shape, self.last_row_dim)
        self.entries[name] = EntryMeta(kind, shape, dtype)

    def array(self, name: str) -> Stored:
        """The tensor's values (a zero-copy view when it comes from a pass file)."""
        stored = self._maps[name].array(name) if name in self._maps else stored_from_torch(self._dict[name])
        return self._cut_last_row(stored) if self.last_row_dim is not None else stored

    def _cut_last_row(self, stored: Stored) -> Stored:
        array = stored.array
        if array.ndim < 2:
            return stored
        dim = self.last_row_dim if array.ndim > (self.last_row_dim or 0) else 0
        if array.shape[dim] == 0:
            return stored
        index = [slice(None)] * array.ndim
        index[dim] = slice(array.shape[dim] - 1, array.shape[dim])
        return Stored(array[tuple(index)], stored.dtype)

    def stats(self, name: str) -> dict[str, Any]:
        return self._stats[name]

    def close(self) -> None:
        for reader in set(self._maps.values()):
            reader.close()


@dataclass
class RunSource:
    """A run (or a lone pass file) of one side, with what decides how its entries read."""

    name: str
    rank: int
    mode: str  # full | last_row | stats
    token_dim: int
    run: Run | None = None
    pass_file: Path | None = None
    _stats_by_pass: dict[int, list[dict[str, Any]]] | None = field(default=None, repr=False)

    @property
    def is_pass_file(self) -> bool:
        return self.pass_file is not None

    def pass_indices(self) -> list[int]:
        if self.pass_file is not None:
            return [_pass_file_index(self.pass_file)]
        assert self.run is not None
        try:
            passes = self.run.passes
        except Exception as e:  # safetensors' own error type: a truncated or foreign file
            raise DumpReadError(
                f"{self.run.path}: a pass file is unreadable ({type(e).__name__}: {e})"
            ) from e
        return sorted(set(passes) | set(self._stats()))

    def _stats(self) -> dict[int, list[dict[str, Any]]]:
        if self._stats_by_pass is None:
            self._stats_by_pass = {}
            if self.run is not None and self.mode == "stats":
                for record in self.run.stats():
                    self._stats_by_pass.setdefault(int(record.get("pass", 0)), []).append(record)
        return self._stats_by_pass

    def open_pass(self, index: int, last_row_dim: int | None) -> PassView:
        if self.pass_file is not None:
            return PassView(index, self.rank, _open_pass_file(self.pass_file), None, last_row_dim)
        assert self.run is not None
        return PassView(index, self.rank, self.run.passes.get(index), self._stats().get(index), last_row_dim)


@dataclass
class RootGroup:
    """The runs of one root label on one side: one run, or every rank when unsharding."""

    label: str
    runs: list[RunSource]

    @property
    def mode(self) -> str:
        return self.runs[0].mode

    @property
    def token_dim(self) -> int:
        return self.runs[0].token_dim

    def pass_indices(self) -> list[int]:
        return self.runs[0].pass_indices()

    @property
    def is_pass_file(self) -> bool:
        return self.runs[0].is_pass_file


@dataclass
class Side:
    """One side of the diff: A (under test) or B (reference)."""

    which: str  # "A" or "B"
    path: Path
    groups: list[RootGroup]

    def describe(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "roots": {
                g.label: {"runs": [r.name for r in g.runs], "ranks": [r.rank for r in g.runs], "mode": g.mode}
                for g in self.groups
            },
        }


def _pass_file_index(path: Path) -> int:
    """``pass00003.safetensors`` (or a part of it) is pass 3; any other file name is pass -1."""
    match = _PASS_NAME.match(path.name)
    return int(match.group(1)) if match else -1


def _open_pass_file(path: Path) -> PassFile | dict[str, torch.Tensor]:
    if path.suffix == ".pt":
        from ..loader import load_pass

        return load_pass(path)
    return open_pass(path)


def _manifest_beside(path: Path) -> dict[str, Any]:
    manifest = path.parent / MANIFEST
    if manifest.is_file():
        try:
            return json.loads(manifest.read_text())
        except json.JSONDecodeError:
            return {}
    return {}


def _mode_of(manifest: dict[str, Any], run: Run | None) -> tuple[str, int]:
    settings = manifest.get("settings") or {}
    mode = settings.get("mode")
    if mode is None and run is not None:
        has_stats = any((run.path / f).is_file() for f in ("stats.jsonl", "stats.jsonl.partial"))
        mode = "stats" if has_stats and not run.passes else "full"
    return str(mode or "full"), int(settings.get("token_dim", 0) or 0)


def _pass_file_side(which: str, path: Path) -> Side:
    manifest = _manifest_beside(path)
    mode, token_dim = _mode_of(manifest, None)
    if mode == "stats":
        mode = "full"  # a pass file holds whole tensors even in a stats-mode run (records)
    if path.suffix != ".pt":
        try:
            metadata = SafetensorsMap(path).metadata if path.is_file() else {}
        except Exception as e:
            raise DumpReadError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})") from e
        mode = metadata.get("tracedump.mode", mode) if metadata.get("tracedump.mode") != "records" else mode
    source = RunSource(path.name, int(manifest.get("rank", 0)), mode, token_dim, pass_file=path)
    label = str(manifest.get("root") or "")
    return Side(which, path, [RootGroup(label, [source])])


def _run_source(run: Run) -> RunSource:
    mode, token_dim = _mode_of(run.manifest, run)
    return RunSource(run.name, run.rank, mode, token_dim, run=run)


def open_side(which: str, path: Path, options: DiffOptions) -> Side:
    """Resolve one command-line path into the runs to compare (raises DumpReadError / UsageError)."""
    if not path.exists():
        raise DumpReadError(f"{path}: no such file or directory")
    if path.is_file() or (not path.is_dir() and path.name.endswith(".safetensors")):
        return _pass_file_side(which, path)
    dump = open_dump(path)
    by_label: dict[str, list[Run]] = {}
    for run in sorted(dump.runs, key=lambda r: (r.rank, r.pid, _serial(r.name))):
        label = str(run.manifest.get("root") or run.manifest.get("model_class") or "")
        by_label.setdefault(label, []).append(run)
    groups = [
        RootGroup(label, _pick_ranks(which, path, label, runs, options)) for label, runs in by_label.items()
    ]
    return Side(which, path, groups)


def _serial(name: str) -> int:
    head, sep, tail = name.rpartition("-")
    return int(tail) if sep and tail.isdigit() and "_pid" in head else 1


def _pick_ranks(which: str, path: Path, label: str, runs: list[Run], options: DiffOptions) -> list[RunSource]:
    by_rank: dict[int, list[Run]] = {}
    for run in runs:
        by_rank.setdefault(run.rank, []).append(run)
    duplicated = {rank: [r.name for r in rs] for rank, rs in by_rank.items() if len(rs) > 1}
    if duplicated:
        rank, names = next(iter(duplicated.items()))
        raise UsageError(
            f"{which} {path}: several runs of rank {rank} for root {label!r}: {', '.join(names)}; "
            f"pass one run dir instead, e.g. {path / names[0]}"
        )
    ranks = sorted(by_rank)
    if options.unshard and len(ranks) > 1:
        chosen = ranks
    elif options.rank is not None and len(ranks) > 1:
        if options.rank not in by_rank:
            raise UsageError(f"{which} {path}: no run of rank {options.rank} (ranks: {ranks})")
        chosen = [options.rank]
    else:
        chosen = [0 if 0 in by_rank else ranks[0]]
    return [_run_source(by_rank[rank][0]) for rank in chosen]
