"""``correspondence.json``: which checkpoint tensors a run's parameters hold (docs/file-format.md).

Written once per run dir, at ``attach()`` (every dumped model: its parameters) and, for an engine
that loads the checkpoint itself (the vLLM plugin), again after the load with what each parameter
was filled from. Read by the comparator (:mod:`tracedump.compare.pair.correspondence`) to pair two
module trees with no rule file. Plain JSON, no torch.

A reader cannot trust the file (a dump may come from another machine, a damaged disk or a hand):
it is read like a manifest, bounded and non-blocking (:func:`~tracedump.store.jsonio.read_limited`),
and validated by one typed model, one class per part of the record (:class:`ParameterEntry`,
:class:`SourceEntry`, :class:`LoadEntry`, :class:`TensorParallel`), so a wrong value is one
:class:`~tracedump.errors.DumpReadError` naming the file and the field (``diff`` exits 2), never an
internal error in the pairing. A field added to a part is added to its class here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from ..errors import DumpReadError
from . import fsio
from .jsonio import read_json_file, validated

CORRESPONDENCE_FILE = "correspondence.json"
CORRESPONDENCE_VERSION = 1
# What an engine computes outside its module outputs, recorded beside them (the vLLM plugin:
# integrations/vllm_records.py): each fused-MoE block's routing, in the order HF's routers return
# theirs, and the head's logits before the logits processor's soft cap and scale.
RAW_LOGITS = "[raw]"  # <logits processor>[raw]
ROUTING_PATHS = ("logits", "topk_weights", "topk_ids")


def routing_name(block: str, what: str) -> str:
    """``<block>.routing[<what>]``: the tensor name of one routing tensor of a MoE block."""
    return f"{block}.routing[{what}]" if block else f"routing[{what}]"


@dataclass(frozen=True, kw_only=True)
class Load:
    """One ``weight_loader`` call: ``source`` (a checkpoint tensor) filled ``region`` of ``param``.

    ``rows``: ``[[param_row, source_row, count], ...]`` along the region's first dim after the
    leading size-1 dims (an expert's index); ``cols``: the slice of the source's second dim (a
    row-parallel shard), None for all of it. ``rows`` None: the values are no plain copy."""

    param: str
    source: str
    shard: str | None = None
    expert: int | None = None
    region: list[list[int]] | None = None
    rows: list[list[int]] | None = None
    cols: list[int] | None = None

    def as_json(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}

    @property
    def module(self) -> str:
        return self.param.rpartition(".")[0]


@dataclass(frozen=True, kw_only=True)
class Correspondence:
    """A run's record: its parameters; for an engine-loaded run, the checkpoint tensors it read
    (``sources``: shape, dtype, fingerprint) and each load; its tensor-parallel rank."""

    parameters: dict[str, dict[str, Any]]
    sources: dict[str, dict[str, Any]] = field(default_factory=dict)
    loads: list[Load] = field(default_factory=list)
    tp_rank: int = 0
    tp_size: int = 1
    failures: list[str] = field(default_factory=list)  # loads not recorded, and why

    def as_json(self) -> dict[str, Any]:
        return {
            "version": CORRESPONDENCE_VERSION,
            "parameters": self.parameters,
            "sources": self.sources,
            "loads": [load.as_json() for load in self.loads],
            "tensor_parallel": {"rank": self.tp_rank, "size": self.tp_size},
            "failures": self.failures,
        }

    @classmethod
    def from_json(cls, data: Any) -> Correspondence:
        """The record of parsed JSON, validated (:func:`parse_correspondence`)."""
        return parse_correspondence(data, CORRESPONDENCE_FILE)


FINGERPRINT_RTOL = 1e-2  # a checkpoint tensor loaded in another dtype (bf16 from fp32) still matches


def fingerprints_match(a: list[float], b: list[float]) -> bool:
    """Whether two fingerprints are one tensor's, allowing the rounding of a dtype change."""
    return (
        bool(a)
        and len(a) == len(b)
        and all(abs(x - y) <= FINGERPRINT_RTOL * max(abs(x), abs(y), 1e-6) for x, y in zip(a, b, strict=True))
    )


def shared_tail(a: str, b: str) -> int:
    """How many trailing dotted components two names share: the tie-break that picks, among
    checkpoint tensors of equal values (a tied head, a copied norm), the one named like the
    parameter (``lm_head.weight`` for ``lm_head.weight``, not ``model.embed_tokens.weight``)."""
    count = 0
    for x, y in zip(reversed(a.split(".")), reversed(b.split(".")), strict=False):
        if x != y:
            break
        count += 1
    return count


def write_correspondence(run_dir: Path, record: Correspondence) -> None:
    """Write (or rewrite) the run dir's ``correspondence.json``, atomically; compact (one entry
    per parameter and per load: a large model has thousands)."""
    data = record.as_json()
    lines = ["{"]
    for i, (key, value) in enumerate(data.items()):
        end = "," if i < len(data) - 1 else ""
        if isinstance(value, dict) and value and key in ("parameters", "sources"):
            inner = ",\n".join(f"  {json.dumps(k)}: {_compact(v)}" for k, v in value.items())
            lines.append(f"{json.dumps(key)}: {{\n{inner}\n}}{end}")
        elif isinstance(value, list) and value:
            inner = ",\n".join(f"  {_compact(v)}" for v in value)
            lines.append(f"{json.dumps(key)}: [\n{inner}\n]{end}")
        else:
            lines.append(f"{json.dumps(key)}: {_compact(value)}{end}")
    fsio.write_text_atomic(Path(run_dir) / CORRESPONDENCE_FILE, "\n".join(lines) + "\n}\n")


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), default=str)


# ------------------------------------------------------------------ the typed reader

MAX_CORRESPONDENCE_BYTES = 1 << 28  # 256 MiB, as a manifest: a large model's record is a few MB
MAX_INDEX = 2**63 - 1  # a row, a dim, a size
MAX_RANK = 2**31 - 1
MAX_DIMS = 64  # dims of a shape or a region
MAX_FINGERPRINT = 64  # values of a fingerprint (tracedump writes 8)

Index = Annotated[int, Field(ge=0, le=MAX_INDEX)]
Number = float | Literal["nan", "inf", "-inf"]  # NaN / Infinity / 1e400 are read as these strings
Shape = Annotated[list[Index], Field(max_length=MAX_DIMS)]
Fingerprint = Annotated[list[Number], Field(max_length=MAX_FINGERPRINT)]
Span = Annotated[list[Index], Field(min_length=2, max_length=2)]  # [start, stop]
RowRun = Annotated[list[Index], Field(min_length=3, max_length=3)]  # [param_row, source_row, count]


class _Part(BaseModel):
    """A part of the record: strictly typed fields, unknown keys let through (a minor version
    only adds), never used by the pairing."""

    model_config = ConfigDict(strict=True, extra="allow")


class ParameterEntry(_Part):
    """``parameters[name]``: one parameter of the dumped model (``dump/weights.py``)."""

    module: str | None = None
    shape: Shape | None = None
    dtype: str | None = None
    fingerprint: Fingerprint | None = None
    same_as: str | None = None  # a shared parameter: the first name that holds it


class SourceEntry(_Part):
    """``sources[name]``: one checkpoint tensor an engine's load read (``integrations/vllm_load.py``)."""

    shape: Shape | None = None
    dtype: str | None = None
    fingerprint: Fingerprint | None = None


class LoadEntry(_Part):
    """``loads[i]``: one ``weight_loader`` call (:class:`Load`)."""

    param: str
    source: str
    shard: str | None = None
    expert: Annotated[int, Field(ge=-MAX_RANK, le=MAX_RANK)] | None = None
    region: Annotated[list[Span], Field(max_length=MAX_DIMS)] | None = None
    rows: list[RowRun] | None = None
    cols: Span | None = None


class TensorParallel(_Part):
    """``tensor_parallel``: the worker's rank in its group of ``size``."""

    rank: Annotated[int, Field(ge=0, le=MAX_RANK)] = 0
    size: Annotated[int, Field(ge=1, le=MAX_RANK + 1)] = 1


class CorrespondenceFile(_Part):
    """``correspondence.json``, every part typed (docs/file-format.md has each one's meaning)."""

    version: Annotated[int, Field(ge=0, le=MAX_RANK)] | None = None
    parameters: dict[str, ParameterEntry] = {}
    sources: dict[str, SourceEntry] = {}
    loads: list[LoadEntry] = []
    tensor_parallel: TensorParallel = TensorParallel()
    failures: list[str] = []


_ADAPTER = TypeAdapter(CorrespondenceFile)
_LOAD_FIELDS = frozenset(f.name for f in fields(Load))


def _entry(part: _Part) -> dict[str, Any]:
    """A parameter's or source's entry as the pairing reads it: the keys written (None dropped),
    the fingerprint as floats (``"nan"`` read back as a float NaN)."""
    entry = part.model_dump(exclude_none=True)
    if "fingerprint" in entry:
        entry["fingerprint"] = [float(v) for v in entry["fingerprint"]]
    return entry


def parse_correspondence(data: Any, path: Path | str) -> Correspondence:
    """The record of parsed JSON ``data`` read from ``path``; a DumpReadError names the field."""
    if not isinstance(data, dict):
        raise DumpReadError(f"{path}: not a JSON object")
    model: CorrespondenceFile = validated(
        _ADAPTER.validate_python, data, lambda line: DumpReadError(f"{path}: {line}")
    )
    return Correspondence(
        parameters={name: _entry(entry) for name, entry in model.parameters.items()},
        sources={name: _entry(entry) for name, entry in model.sources.items()},
        loads=[
            Load(**{k: v for k, v in load.model_dump().items() if k in _LOAD_FIELDS}) for load in model.loads
        ],
        tp_rank=model.tensor_parallel.rank,
        tp_size=model.tensor_parallel.size,
        failures=list(model.failures),
    )


def read_correspondence(run_dir: Path) -> Correspondence | None:
    """The run dir's record, or None when it has none (a dump written before it existed: the diff
    falls back to rule files). A file that is there but cannot be read (not a regular file, over
    :data:`MAX_CORRESPONDENCE_BYTES`, not JSON, a field of the wrong type) is a DumpReadError
    naming the file and the field: the pairing never guesses from half a record."""
    path = Path(run_dir) / CORRESPONDENCE_FILE
    if not (path.exists() or path.is_symlink()):
        return None
    return parse_correspondence(read_json_file(path, MAX_CORRESPONDENCE_BYTES), path)


# ------------------------------------------------------------------ counterparts (grafting)


def _held(record: Correspondence, sources: dict[str, dict[str, Any]]) -> dict[str, set[str]]:
    """Module -> the checkpoint tensors its own parameters hold: from the recorded loads, else
    (a run that did not record one) each parameter's own name when it is a checkpoint tensor's,
    else the tensor of its shape and fingerprint among ``sources``."""
    held: dict[str, set[str]] = {}
    if record.loads:
        for load in record.loads:
            held.setdefault(load.module, set()).add(load.source)
        for name, meta in record.parameters.items():  # a tied parameter: held under each name
            first = meta.get("same_as")
            for load in record.loads if first else ():
                if load.param == first:
                    held.setdefault(name.rpartition(".")[0], set()).add(load.source)
        return held
    firsts = {name: meta for name, meta in record.parameters.items() if "same_as" not in meta}
    for name, meta in record.parameters.items():
        own = firsts.get(meta.get("same_as", name), meta)
        shape = list(own.get("shape") or [])
        if name in sources and list(sources[name].get("shape") or []) == shape:
            source: str | None = name
        else:
            found = [
                s
                for s, m in sources.items()
                if list(m.get("shape") or []) == shape
                and fingerprints_match(list(own.get("fingerprint") or []), list(m.get("fingerprint") or []))
            ]
            source = max(found, key=lambda s: shared_tail(s, name)) if found else None
        if source is not None:
            held.setdefault(name.rpartition(".")[0], set()).add(source)
    return held


def _subtrees(held: dict[str, set[str]]) -> dict[str, frozenset[str]]:
    out: dict[str, set[str]] = {}
    for module, sources in held.items():
        name = module
        while True:
            out.setdefault(name, set()).update(sources)
            if not name:
                break
            name = name.rpartition(".")[0]
    return {name: frozenset(s) for name, s in out.items()}


def module_counterparts(engine: Correspondence, reference: Correspondence) -> dict[str, str]:
    """Each module of an engine that recorded its load -> the reference's module that computes the
    same thing, for grafting (whose recorded inputs it takes; ``""`` is the root):

    - the reference module whose subtree holds exactly the same checkpoint tensors (a decoder
      layer, an attention or MLP block, a norm, a projection): of several (nested modules
      holding one set), the one of the same name, else outermost with outermost;
    - a leaf filled from several checkpoint tensors stacked along its rows (vLLM's ``qkv_proj``,
      ``gate_up_proj``), each held alone by one reference leaf: the holder of its first rows.
      Stacked rows of one weight multiply one input, so each holder took the input it takes.

    Modules with no such counterpart are left out. Only the correspondence: no tensor is read."""
    mine = _held(engine, engine.sources)
    theirs = _held(reference, engine.sources)
    tree_mine, tree_theirs = _subtrees(mine), _subtrees(theirs)
    by_set: dict[frozenset[str], list[str]] = {}
    for module, sources in tree_theirs.items():
        if sources:
            by_set.setdefault(sources, []).append(module)
    alone = {next(iter(s)): m for m, s in theirs.items() if len(s) == 1}
    first_rows: dict[str, tuple[int, str]] = {}
    experts = {load.module for load in engine.loads if load.expert is not None}
    for load in engine.loads:
        if load.module in experts:
            continue  # fused experts: stacked per expert, not along one input's rows
        start = load.region[0][0] if load.region else 0
        if load.module not in first_rows or start < first_rows[load.module][0]:
            first_rows[load.module] = (start, load.source)
    out: dict[str, str] = {}
    depth = {s: sorted(ms, key=lambda m: (m.count("."), m)) for s, ms in by_set.items()}
    for module, sources in sorted(tree_mine.items(), key=lambda item: (item[0].count("."), item[0])):
        same = depth.get(sources, [])
        if same:  # nested modules holding one set pair outermost with outermost
            out[module] = module if module in same else same[0]
            same.remove(out[module])
        elif module in mine and len(sources) > 1 and all(s in alone for s in sources):
            holders = {alone[s] for s in sources}
            if len(holders) == len(sources) and module in first_rows:
                out[module] = alone[first_rows[module][1]]
    return out
