"""Load stage: turn a path (dump dir, run dir, pass file) into the runs and passes to compare.

Nothing here reads tensor data. A :class:`PassView` knows each entry's name, shape and dtype (from
the safetensors header, or from ``stats.jsonl``) and hands out values only when the executor asks.

Run selection per side, per root label (``manifest.json`` "root"; several roots in one process get
``rank0_pid123``, ``rank0_pid123-2``):

- with ``--unshard`` and several ranks: every rank, sorted;
- else ``--rank R`` when the side has several ranks (a side with one rank uses it), else rank 0
  (or the lowest rank);
- two runs of one rank and root (independent processes in one dir) are an error, the same rule as
  ``Dump.run()`` (:func:`tracedump.store.loader.runs_by_rank`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from ...errors import DumpReadError, UsageError
from ...store.format import MODE_KEY, STATS_FILE, STATS_PARTIAL, Key, dtype_name, is_shadow_key
from ...store.loader import (
    PassFile,
    Run,
    default_rank,
    load_pass,
    open_dump,
    open_pass,
    pass_index,
    read_manifest,
    runs_by_rank,
)
from ..judge.tolerance import pair_precision
from ..measure.stats import infer_dtype
from ..options import DiffOptions
from .reader import SafetensorsMap, Stored, stored_from_torch

if TYPE_CHECKING:  # torch is imported where a .pt file is read: a diff of pass files never needs it
    import torch

Kind = Literal["tensor", "stats"]


@dataclass(frozen=True)
class EntryMeta:
    """What is known of one entry without reading it."""

    kind: Kind
    shape: tuple[int, ...] | None
    dtype: str | None


def _in_capture_order(found: list[tuple[int | None, str, EntryMeta]]) -> dict[str, EntryMeta]:
    """Entries by capture sequence number when every one has it; else as found (pass file, then
    stats lines: dumps written before ``seq`` existed)."""
    if all(seq is not None for seq, _, _ in found):
        found = sorted(found, key=lambda item: item[0] or 0)
    return {name: meta for _, name, meta in found}


class PassView:
    """One pass of one run: entries in capture order; values read lazily, one at a time.

    In a stats-mode run a pass has two sources: ``stats.jsonl`` lines (module captures) and the
    pass file (``record()`` calls, stored whole). Their capture sequence numbers (``seq``) interleave
    them as they happened, so the first divergence is the first in time, not the first record.
    """

    def __init__(
        self,
        index: int,
        rank: int,
        tensors: PassFile | dict[str, torch.Tensor] | None,
        stats: list[dict[str, Any]] | None = None,
    ) -> None:
        self.index = index
        self.rank = rank
        self._maps: dict[str, SafetensorsMap] = {}
        self._dict: dict[str, torch.Tensor] = {}
        self._stats: dict[str, dict[str, Any]] = {}
        self.shadow: dict[str, EntryMeta] = {}  # shadow~KEY entries (dump/shadow.py), never paired
        found: list[tuple[int | None, str, EntryMeta]] = []
        if isinstance(tensors, PassFile):
            found.extend(self._index_pass_file(tensors))
        elif tensors is not None:
            self._dict = dict(tensors)
            found.extend(
                (None, name, EntryMeta("tensor", tuple(t.shape), dtype_name(t.dtype)))
                for name, t in self._dict.items()
            )
        for record in stats or []:
            name = Key.from_stats(record).format()  # its full-mode name: stats and full dumps align
            self._stats[name] = record
            shape = tuple(record["shape"]) if isinstance(record.get("shape"), list) else None
            found.append((record.get("seq"), name, EntryMeta("stats", shape, infer_dtype(record))))
        self.entries = _in_capture_order(found)

    def _index_pass_file(self, pass_file: PassFile) -> list[tuple[int | None, str, EntryMeta]]:
        maps = {id(header): SafetensorsMap(header) for header in pass_file.headers}
        seq = pass_file.seq or {}
        found: list[tuple[int | None, str, EntryMeta]] = []
        for name in pass_file.names:
            header = pass_file.header_of(name)
            self._maps[name] = maps[id(header)]
            info = header.tensors[name].info
            if is_shadow_key(name):  # a grafted run's fp32 shadow: read by compare/measure/shadow.py only
                self.shadow[name] = EntryMeta("tensor", info.shape, info.dtype)
                continue
            found.append((seq.get(name), name, EntryMeta("tensor", info.shape, info.dtype)))
        return found

    def array(self, name: str) -> Stored:
        """The tensor's values (a zero-copy view when it comes from a pass file)."""
        return self._maps[name].array(name) if name in self._maps else stored_from_torch(self._dict[name])

    def stats(self, name: str) -> dict[str, Any]:
        return self._stats[name]

    def close(self) -> None:
        for reader in set(self._maps.values()):
            reader.close()


@dataclass(kw_only=True)
class RunSource:
    """A run (or a lone pass file) of one side, with what decides how its entries read."""

    name: str
    rank: int
    mode: str  # full | last_row | stats
    token_dim: int
    run: Run | None = None
    pass_file: Path | None = None
    declared_precision: str | None = None  # from the manifest's "precision" (parameters, TF32)
    facts: dict[str, Any] = field(default_factory=dict)  # the manifest's versions and settings

    @property
    def is_pass_file(self) -> bool:
        return self.pass_file is not None

    def pass_indices(self) -> list[int]:
        if self.pass_file is not None:
            index = pass_index(self.pass_file)
            return [-1 if index is None else index]
        assert self.run is not None
        return sorted(set(self.run.passes) | set(self._stats))

    @cached_property
    def _stats(self) -> dict[int, list[dict[str, Any]]]:
        by_pass: dict[int, list[dict[str, Any]]] = {}
        if self.run is not None and self.mode == "stats":
            for record in self.run.stats():
                by_pass.setdefault(record["pass"], []).append(record)
        return by_pass

    def open_pass(self, index: int) -> PassView:
        """The pass's entries (headers and stats lines are read now; tensor data when asked)."""
        if self.pass_file is not None:
            path = self.pass_file
            return PassView(index, self.rank, load_pass(path) if path.suffix == ".pt" else open_pass(path))
        assert self.run is not None
        return PassView(index, self.rank, self.run.passes.get(index), self._stats.get(index))


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

    @property
    def declared_precision(self) -> str | None:
        return self.runs[0].declared_precision

    def pass_indices(self) -> list[int]:
        """The passes of any of its ranks: a pass some rank lacks is compared, and each of its
        tensors is a ``rank_mismatch`` naming the ranks without it, never dropped."""
        return sorted({index for run in self.runs for index in run.pass_indices()})

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
                g.label: {
                    "runs": [r.name for r in g.runs],
                    "ranks": [r.rank for r in g.runs],
                    "mode": g.mode,
                    "manifest": g.runs[0].facts,
                }
                for g in self.groups
            },
        }


def _mode_of(manifest: dict[str, Any], run: Run | None) -> tuple[str, int]:
    settings = manifest.get("settings")
    settings = settings if isinstance(settings, dict) else {}
    mode = settings.get("mode")
    if mode is None and run is not None:
        has_stats = any((run.path / name).is_file() for name in (STATS_FILE, STATS_PARTIAL))
        mode = "stats" if has_stats and not run.passes else "full"
    token_dim = settings.get("token_dim")
    return str(mode or "full"), token_dim if isinstance(token_dim, int) else 0


def declared_precision(manifest: dict[str, Any]) -> str | None:
    """The least precise float the manifest's ``precision`` declares: its parameters' dtypes, and
    ``tfloat32`` for an fp32 run whose CUDA matmuls were allowed TF32."""
    precision = manifest.get("precision")
    if not isinstance(precision, dict):
        return None
    parameters = precision.get("parameters")
    dtypes = [d for d in parameters if isinstance(d, str)] if isinstance(parameters, dict) else []
    if precision.get("tf32"):
        dtypes.append("tfloat32")
    return pair_precision(*dtypes) if dtypes else None


_BULKY_MANIFEST_KEYS = frozenset({"modules", "passes"})  # long lists, said elsewhere (ls, the plan)
_MANIFEST_VALUE_CHARS = 2000


def manifest_facts(manifest: Any) -> dict[str, Any]:
    """What the report says about a run: every manifest field (versions, settings, precision,
    model class, and whatever later versions add) but the module and pass lists; a value whose JSON
    is longer than 2000 characters is cut, so a report of a big dump stays small."""
    import json

    facts: dict[str, Any] = {}
    for key, value in manifest.items() if isinstance(manifest, dict) else ():
        if key in _BULKY_MANIFEST_KEYS:
            continue
        text = json.dumps(value, default=str)
        facts[str(key)] = (
            value if len(text) <= _MANIFEST_VALUE_CHARS else text[:_MANIFEST_VALUE_CHARS] + "..."
        )
    return facts


def _pass_file_side(which: str, path: Path) -> Side:
    manifest = read_manifest(path.parent) if path.parent.is_dir() else {}
    mode, token_dim = _mode_of(manifest, None)
    if path.suffix != ".pt":
        mode = open_pass(path).metadata.get(MODE_KEY, mode)
    if mode in ("stats", "records"):
        mode = "full"  # a pass file holds whole tensors even in a stats-mode run (records)
    source = RunSource(
        name=path.name,
        rank=int(manifest.get("rank", 0)),
        mode=mode,
        token_dim=token_dim,
        pass_file=path,
        declared_precision=declared_precision(manifest),
        facts=manifest_facts(manifest),
    )
    label = str(manifest.get("root") or "")
    return Side(which, path, [RootGroup(label, [source])])


def _run_source(run: Run) -> RunSource:
    mode, token_dim = _mode_of(run.manifest, run)
    return RunSource(
        name=run.name,
        rank=run.rank,
        mode=mode,
        token_dim=token_dim,
        run=run,
        declared_precision=declared_precision(run.manifest),
        facts=manifest_facts(run.manifest),
    )


def open_side(which: str, path: Path, options: DiffOptions) -> Side:
    """Resolve one command-line path into the runs to compare (raises DumpReadError / UsageError)."""
    if not path.exists():
        raise DumpReadError(f"{path}: no such file or directory")
    if path.is_file() or (not path.is_dir() and path.name.endswith(".safetensors")):
        return _pass_file_side(which, path)
    dump = open_dump(path)
    by_label: dict[str, list[Run]] = {}
    for run in dump.runs:
        by_label.setdefault(run.root, []).append(run)
    groups = [
        RootGroup(label, _pick_ranks(f"{which} {path}", runs, options)) for label, runs in by_label.items()
    ]
    return Side(which, path, groups)


def _pick_ranks(where: str, runs: list[Run], options: DiffOptions) -> list[RunSource]:
    by_rank = runs_by_rank(runs, where)
    ranks = sorted(by_rank)
    if options.unshard and len(ranks) > 1:
        _check_world(where, {rank: by_rank[rank] for rank in ranks})
        chosen = ranks
    elif options.rank is not None and len(ranks) > 1:
        if options.rank not in by_rank:
            raise UsageError(f"{where}: no run of rank {options.rank} (ranks: {ranks})")
        chosen = [options.rank]
    else:
        chosen = [default_rank(ranks)]
    return [_run_source(by_rank[rank]) for rank in chosen]


def _check_world(where: str, by_rank: dict[int, Run]) -> None:
    """``--unshard`` joins every rank of one run: the ranks found must be those of its world size
    (a missing rank under a ``sum`` rule would be a wrong value reported as a divergence)."""
    sizes = {json.dumps(run.manifest.get("world_size")) for run in by_rank.values()} - {"null"}
    if len(sizes) > 1:
        raise UsageError(
            f"{where}: --unshard: the ranks' manifests disagree on world_size: {', '.join(sorted(sizes))}"
        )
    world = json.loads(next(iter(sizes))) if sizes else None
    if world is not None and (isinstance(world, bool) or not isinstance(world, int) or world < 1):
        raise UsageError(f"{where}: --unshard: world_size {sizes.pop()} in the manifests is not a rank count")
    # without a world_size (an older or hand-made dump) the ranks must still be 0..N-1: a gap is a lost rank
    known = world is not None
    world = world if known else max(by_rank) + 1
    missing = sorted(set(range(world)) - set(by_rank))
    extra = sorted(set(by_rank) - set(range(world)))
    if missing or extra:
        found = f"ranks {sorted(by_rank)} of world_size {world}" if known else f"ranks {sorted(by_rank)}"
        what = "; ".join(
            part
            for part in (
                f"missing rank(s) {missing}" if missing else "",
                f"rank(s) {extra} beyond it" if extra else "",
            )
            if part
        )
        raise UsageError(f"{where}: --unshard needs every rank of the run: {found}: {what}")
