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
