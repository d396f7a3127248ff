"""Reading dumps back: ``load_pass`` for one file, ``open_dump`` for lazy access to a whole dump.

Nothing is opened before it is needed: listing a dump of 3000 passes stats file names only, a
pass's safetensors header (names, shapes, dtypes, capture order) is read on first use, and a file
is memory-mapped (safetensors ``safe_open``) only when a tensor is read, so reading one tensor of a
multi-GB pass touches only that tensor's bytes and a long dump never holds thousands of maps.
Importing this module does not import torch: ``tracedump ls`` and ``show`` never need it.
:func:`read_header` is the one parser of the header; the comparator maps files from it too. Part
files of a pass too large for the memory cap are reassembled transparently. Names, keys and the
version check come from :mod:`tracedump.store.format`: a manifest or pass file written in a format major
this tracedump cannot read raises :class:`~tracedump.errors.FormatVersionError`, a DumpReadError.
"""

from __future__ import annotations

import contextlib
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import DumpReadError
from .format import (
    MANIFEST,
    PASS_FILE_RE,
    RECORDS_FILE,
    STATS_FILE,
    STATS_PARTIAL,
    Key,
    Manifest,
    parse_pass_file_name,
    parse_run_dir_name,
)
from .format import (
    SEQ_KEY as SEQ_KEY,  # kept name: callers import it from here
)
from .header import (  # kept names: the header was parsed here before store/header.py
    MAX_HEADER as MAX_HEADER,
)
from .header import (
    SafetensorsHeader,
    TensorInfo,
    read_header,
)
from .header import (
    StoredTensor as StoredTensor,
)
from .header import open_regular as _open_regular
from .header import unreadable as _unreadable
from .manifest import ManifestModel, read_manifest_file
from .manifest import read_manifest as read_manifest  # kept name
from .sequences import Batch, RowCut, SeqId, Sequence, batches, sequence_rows, sequences
from .stats import read_stats

if TYPE_CHECKING:  # torch is imported where tensors are made, so listing a dump never imports it
    import torch


class PassFile:
    """One pass: its files (one, or several parts), names in capture order, lazy tensor access.

    Creating one touches no file: headers are read on first use (names, info, ...), and a file is
    memory-mapped only when one of its tensors is read.
    """

    def __init__(self, index: int, files: list[Path]) -> None:
        self.index = index
        self.files = files
        self._handles: dict[int, Any] = {}

    @cached_property
    def headers(self) -> list[SafetensorsHeader]:
        """The header of each file, in part order (raises DumpReadError for an unreadable file)."""
        return [read_header(path) for path in self.files]

    @cached_property
    def _where(self) -> dict[str, int]:
        return {name: position for position, header in enumerate(self.headers) for name in header.tensors}

    @property
    def names(self) -> list[str]:
        """Tensor names in capture order."""
        return [name for header in self.headers for name in header.tensors]

    @property
    def metadata(self) -> dict[str, str]:
        return dict(self.headers[0].metadata) if self.files else {}

    @property
    def seq(self) -> dict[str, int] | None:
        """Each tensor's capture sequence number (stats-mode pass files), None when not recorded."""
        parts = [header.seq for header in self.headers]
        if not parts or any(part is None for part in parts):
            return None
        return {name: number for part in parts if part is not None for name, number in part.items()}

    def header_of(self, name: str) -> SafetensorsHeader:
        """The header of the file that holds ``name``."""
        return self.headers[self._where[name]]

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def __len__(self) -> int:
        return len(self._where)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __getitem__(self, name: str) -> torch.Tensor:
        """Read one tensor (memory-mapped: only its bytes are touched)."""
        position = self._where[name]
        try:
            return self._handle(position).get_tensor(name)
        except Exception as e:  # safetensors' own error type, for a file changed since its header was read
            raise _unreadable(self.files[position], f"{type(e).__name__}: {e}") from e

    def _handle(self, position: int) -> Any:
        if position not in self._handles:
            from safetensors import safe_open

            path = self.files[position]
            try:
                self._handles[position] = safe_open(str(path), framework="pt")
            except OSError as e:
                raise DumpReadError(f"{path}: cannot read ({e.strerror or e})") from e
            except Exception as e:  # SafetensorError: not a safetensors file after all
                raise _unreadable(path, f"{type(e).__name__}: {e}") from e
        return self._handles[position]

    def info(self, name: str) -> TensorInfo:
        return self.header_of(name).tensors[name].info

    def load(self) -> dict[str, torch.Tensor]:
        return {name: self[name] for name in self.names}

    def close(self) -> None:
        """Drop the memory maps (tensors already read keep their own memory)."""
        self._handles.clear()

    @property
    def nbytes(self) -> int:
        return sum(path.stat().st_size for path in self.files)

    def __repr__(self) -> str:
        return f"PassFile({self.index}, files={[p.name for p in self.files]})"


def pass_index(path: Path) -> int | None:
    """``pass00003.safetensors`` (or a part of it) is pass 3; None for any other file name."""
    name = parse_pass_file_name(path.name)
    return name[0] if name else None


def _listing(path: Path) -> list[Path]:
    try:
        return sorted(path.iterdir())
    except OSError as e:
        raise DumpReadError(f"{path}: cannot list ({e.strerror or e})") from e


def _group_pass_files(run_dir: Path) -> dict[int, list[Path]]:
    groups: dict[int, list[tuple[int, Path]]] = {}
    for path in _listing(run_dir):
        name = parse_pass_file_name(path.name)
        if name:
            groups.setdefault(name[0], []).append((name[1] or 0, path))
    return {index: [p for _, p in sorted(parts)] for index, parts in sorted(groups.items())}


def load_pass(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a pass file, ordered as captured.

    Accepts a ``.safetensors`` pass (or any of its part files, or the name of a pass stored only as
    parts) and ``.pt`` files holding ``{name: tensor}`` (loaded with ``weights_only=True``).
    """
    path = Path(path)
    if path.suffix != ".pt":
        return open_pass(path).load()
    import torch

    _open_regular(path).close()  # a FIFO would block torch.load
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # unpickling refused (weights_only), truncated zip, not a .pt at all
        raise DumpReadError(f"{path}: not a loadable dict of tensors ({type(e).__name__}: {e})") from e
    if not isinstance(data, dict) or not all(isinstance(v, torch.Tensor) for v in data.values()):
        raise DumpReadError(f"{path}: expected a dict of tensors, got {type(data).__name__}")
    return dict(data)


def open_pass(path: str | Path) -> PassFile:
    """A :class:`PassFile` for a pass path (parts reassembled). Its headers are read now, so an
    unreadable file fails here, with its name."""
    path = Path(path)
    index = pass_index(path)
    files = _group_pass_files(path.parent).get(index) if index is not None and path.parent.is_dir() else None
    if not files:
        if not path.is_file():
            raise DumpReadError(f"{path}: no such pass file")
        files = [path]
    pass_file = PassFile(-1 if index is None else index, files)
    pass_file.headers  # noqa: B018 - fail now, not at the first tensor
    return pass_file


@dataclass(kw_only=True)
class Run:
    """One process's dump: ``rank<R>_pid<P>/`` with its passes, manifest and stats."""

    path: Path
    rank: int
    pid: int
    manifest: Manifest = field(default_factory=Manifest)  # as written; its types vouched for by `info`
    info: ManifestModel = field(default_factory=ManifestModel)  # the same manifest, typed

    @cached_property
    def passes(self) -> dict[int, PassFile]:
        """Every pass, by index; lazy (no file is opened until a pass is used)."""
        return {index: PassFile(index, files) for index, files in _group_pass_files(self.path).items()}

    @property
    def records(self) -> PassFile | None:
        """Records made outside every pass (``records.safetensors``), if any."""
        path = self.path / RECORDS_FILE
        return PassFile(-1, [path]) if path.is_file() else None

    @property
    def complete(self) -> bool:
        return bool(self.manifest.get("complete"))

    @property
    def disk_bytes(self) -> int:
        """Bytes of this run's data files as they are on disk (pass and part files, records,
        ``stats.jsonl``), whatever the manifest last said."""
        total = 0
        for path in _listing(self.path):
            if PASS_FILE_RE.match(path.name) or path.name in (RECORDS_FILE, STATS_FILE, STATS_PARTIAL):
                with contextlib.suppress(OSError):
                    info = path.stat()
                    total += info.st_size if stat.S_ISREG(info.st_mode) else 0
        return total

    @property
    def root(self) -> str:
        """The label of the model this run dumped (manifest "root"), "" when unknown."""
        return str(self.manifest.get("root") or self.manifest.get("model_class") or "")

    @property
    def framework(self) -> str:
        """The package the model's class came from (manifest ``framework``: ``"transformers"``,
        ``"vllm"``, ``"torch"``); ``""`` for a dump written before format 1.1."""
        value = self.manifest.get("framework")
        return value if isinstance(value, str) else ""

    @property
    def framework_version(self) -> str | None:
        """That package's version (manifest ``framework_version``); None when unknown."""
        value = self.manifest.get("framework_version")
        return value if isinstance(value, str) else None

    @property
    def module_classes(self) -> dict[str, str]:
        """Each captured module name (and each name a shared module was dumped under) -> the
        ``__qualname__`` of its class (manifest ``module_classes``); ``{}`` before format 1.1."""
        value = self.manifest.get("module_classes")
        if not isinstance(value, dict):
            return {}
        return {str(k): v for k, v in value.items() if isinstance(v, str)}

    def module_class(self, key: str) -> str | None:
        """The class of the module a tensor key names (``model.layers.0.mlp[0]::call1`` ->
        ``"LlamaMLP"``), None when the manifest does not say."""
        try:
            module = Key.parse(key).module
        except ValueError:
            return None
        return self.module_classes.get(module)

    @property
    def serial(self) -> int:
        """2, 3, ... for the second, third root of one process (``rank0_pid7-2``); 1 otherwise."""
        name = parse_run_dir_name(self.path.name)
        return name[2] if name else 1

    def stats(self) -> list[dict[str, Any]]:
        """Stats-mode records (one per tensor), from ``stats.jsonl`` or a crashed run's partial file.

        A torn last line (a crash mid-write) is skipped with a warning; any other line that is not a
        stats record raises DumpReadError naming ``file:line``."""
        for name in (STATS_FILE, STATS_PARTIAL):
            if (self.path / name).is_file():
                return read_stats(self.path / name)
        return []

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def token_dim(self) -> int:
        settings = self.manifest.get("settings")
        value = settings.get("token_dim") if isinstance(settings, dict) else None
        return value if isinstance(value, int) else 0

    def batches(self) -> dict[int, Batch]:
        """Each pass's rows as (sequence, position) (see :mod:`tracedump.store.sequences`)."""
        passes = self.passes
        return batches(
            list(passes),
            lambda index: passes[index].metadata,
            lambda index: [passes[index].info(name).shape for name in passes[index].names],
        )

    def sequences(self) -> dict[SeqId, Sequence]:
        """Every sequence of the run with the pass and row of each of its positions."""
        return sequences(self.batches())

    def sequence(self, seq_id: SeqId) -> dict[str, torch.Tensor]:
        """One sequence's tensors, name by name: its rows gathered over the passes in position
        order, ``[positions, ...]`` (the token dim first, other size-1 dims dropped, as ``diff
        --align tokens`` compares them). Names whose rows cannot be found in every pass that holds
        the sequence (no token dim, another per-token shape) are left out."""
        import torch

        found = self.batches()
        sequence = sequences(found).get(seq_id)
        if sequence is None:
            raise KeyError(f"{self.path}: no sequence {seq_id!r} (sequences: {list(sequences(found))})")
        first = self.passes[sequence.rows[sequence.positions[0]][0]]  # a sequence holds a position
        gathered = {name: self._sequence_rows(name, sequence, found) for name in first.names}
        return {name: torch.cat(rows) for name, rows in gathered.items() if not isinstance(rows, str)}

    def _sequence_rows(
        self, name: str, sequence: Sequence, found: dict[int, Batch]
    ) -> list[torch.Tensor] | str:
        """The rows of ``name`` a sequence occupies, one tensor per pass (or why there are none)."""
        import torch

        def shape_in(index: int) -> tuple[int, ...] | str:
            held = self.passes[index]
            return held.info(name).shape if name in held else f"not in pass {index}"

        def take(cut: RowCut) -> torch.Tensor:
            # a [batch, seq] grid's two dims merged into one of rows
            tensor = self.passes[cut.pass_index][name].reshape(cut.shape)
            return tensor.index_select(cut.dim, torch.tensor(cut.rows)).movedim(cut.dim, 0)

        return sequence_rows(
            sequence, sequence.positions, found, shape_in, take, self.token_dim, sampled=False
        )


def group_by_rank(runs: Iterable[Run]) -> dict[int, list[Run]]:
    """The runs of each rank, ranks in order of first appearance, runs in their order."""
    groups: dict[int, list[Run]] = {}
    for run in runs:
        groups.setdefault(run.rank, []).append(run)
    return groups


def runs_by_rank(runs: Iterable[Run], where: str) -> dict[int, Run]:
    """The runs of one root, by rank. Two runs of one rank and root are two independent processes
    dumped into one dir: which one is meant cannot be guessed, so that raises DumpReadError."""
    by_rank = group_by_rank(runs)
    for rank, same in sorted(by_rank.items()):
        if len(same) > 1:
            root = f" for root {same[0].root!r}" if same[0].root else ""
            raise DumpReadError(
                f"{where}: several runs of rank {rank}{root}: {', '.join(r.name for r in same)}; "
                f"pass one run dir instead, e.g. {same[0].path}"
            )
    return {rank: same[0] for rank, same in sorted(by_rank.items())}


def default_rank(ranks: Iterable[int]) -> int:
    """The rank used when none is asked for: 0, else the lowest."""
    present = set(ranks)
    return 0 if 0 in present else min(present)


@dataclass
class Dump:
    """A dump directory: one :class:`Run` per process (rank, pid) and root."""

    path: Path
    runs: list[Run]

    def run(self, rank: int | None = None, root: str | None = None) -> Run:
        """The run of ``rank`` (default: 0, else the lowest) of ``root`` (default: the first root).

        Several roots of one process (``rank0_pid7``, ``rank0_pid7-2``) are told apart by ``root``;
        several runs of one rank and root (independent processes in one dir) raise DumpReadError
        listing them, as ``tracedump diff`` does."""
        roots = list(dict.fromkeys(r.root for r in self.runs))
        if root is not None and root not in roots:
            raise DumpReadError(f"{self.path}: no run of root {root!r}; roots: {roots}")
        chosen = roots[0] if root is None else root
        by_rank = runs_by_rank((r for r in self.runs if r.root == chosen), str(self.path))
        wanted = default_rank(by_rank) if rank is None else rank
        if wanted not in by_rank:
            raise DumpReadError(f"{self.path}: no run for rank {rank}; runs: {[r.name for r in self.runs]}")
        return by_rank[wanted]

    def by_rank(self) -> dict[int, list[Run]]:
        """Every run (all roots) by rank."""
        return group_by_rank(self.runs)


def _read_run(path: Path) -> Run:
    """A run dir's :class:`Run`: its manifest read and validated (a wrong type is a DumpReadError
    naming the file and the field); rank and pid from the manifest, else from the dir's name."""
    rank, pid, _ = parse_run_dir_name(path.name) or (0, 0, 1)
    if not (path / MANIFEST).is_file():
        return Run(path=path, rank=rank, pid=pid)
    manifest, model = read_manifest_file(path / MANIFEST)
    rank = rank if model.rank is None else model.rank
    pid = pid if model.pid is None else model.pid
    return Run(path=path, rank=rank, pid=pid, manifest=manifest, info=model)  # type: ignore[arg-type]


def _is_run_dir(path: Path) -> bool:
    return (path / MANIFEST).is_file() or any(PASS_FILE_RE.match(p.name) for p in _listing(path))


def open_dump(path: str | Path) -> Dump:
    """Open a dump dir (``<dir>/rank*_pid*/``) or a single run dir, lazily."""
    path = Path(path)
    if not path.is_dir():
        raise DumpReadError(f"{path}: not a directory")
    if _is_run_dir(path):
        return Dump(path, [_read_run(path)])
    children = [p for p in _listing(path) if p.is_dir()]
    runs = [_read_run(p) for p in children if parse_run_dir_name(p.name)]
    if not runs:
        runs = [_read_run(p) for p in children if _is_run_dir(p)]
    if not runs:
        raise DumpReadError(f"{path}: no tracedump runs here (expected rank<R>_pid<P>/ folders)")
    runs.sort(key=lambda r: (r.rank, r.pid, r.serial, r.name))
    return Dump(path, runs)
