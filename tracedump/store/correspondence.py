"""``correspondence.json``: which checkpoint tensors a run's parameters hold (docs/file-format.md).

Written once per run dir, at ``attach()`` (every dumped model: its parameters) and, for an engine
that loads the checkpoint itself (the vLLM plugin), again after the load with what each parameter
was filled from. Read by the comparator (:mod:`tracedump.compare.correspondence`) to pair two
module trees with no rule file. Plain JSON, no torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import fsio

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
    def from_json(cls, data: dict[str, Any]) -> Correspondence:
        tp = data.get("tensor_parallel") or {}
        return cls(
            parameters=dict(data.get("parameters") or {}),
            sources=dict(data.get("sources") or {}),
            loads=[Load(**raw) for raw in data.get("loads") or []],
            tp_rank=int(tp.get("rank", 0)),
            tp_size=int(tp.get("size", 1)),
            failures=[str(f) for f in data.get("failures") or []],
        )


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


def read_correspondence(run_dir: Path) -> Correspondence | None:
    """The run dir's record, or None when it has none (a dump written before it existed) or it
    cannot be read (then the diff falls back to rule files)."""
    path = Path(run_dir) / CORRESPONDENCE_FILE
    try:
        data = json.loads(path.read_text())
        return Correspondence.from_json(data) if isinstance(data, dict) else None
    except (OSError, ValueError, TypeError):
        return None


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
