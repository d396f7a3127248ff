"""What each side's manifest and records say of its model, read once per diff: framework, root
class, each module's class, its ``correspondence.json`` (every rank's), the order its modules ran
in, and the run whose values the conventions are measured on."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...store.correspondence import Correspondence, read_correspondence
from ...store.format import Key
from ..load.sources import RunSource, Side
from .conventions import SideValues, side_values


@dataclass(frozen=True, kw_only=True)
class SideInfo:
    """What a side's manifest says of its model: framework, root class, each module's class."""

    framework: str
    root: str
    classes: Mapping[str, str]
    integration: str = ""  # the engine integration that dumped it (manifest "integration": "vllm")
    record: Correspondence | None = None  # its correspondence.json (rank 0's), if it wrote one
    ranks: tuple[Correspondence, ...] = ()  # every rank's, in rank order (tensor parallelism)
    ran: Mapping[str, int] = field(default_factory=dict)  # module -> place of its first output
    run_dir: Path | None = None  # the run dir the record is from: its values measure conventions
    grafted: bool = False  # its modules ran on the reference's inputs: no run of its own to read
    stats: bool = False  # a stats dump: statistics of each tensor, no values to read conventions from


def _framework(manifest: Mapping[str, Any]) -> str:
    """The manifest's ``framework``; for dumps written before it, the package of ``model_class``
    (``vllm.model_executor.models.llama.LlamaForCausalLM`` -> ``vllm``)."""
    value = manifest.get("framework")
    if isinstance(value, str) and value:
        return value
    model_class = manifest.get("model_class")
    if isinstance(model_class, str) and "." in model_class:
        return model_class.split(".", 1)[0]
    return ""


def side_info(side: Side) -> SideInfo:
    manifest: Mapping[str, Any] = {}
    record = None
    run_dir = None
    ranks: list[Correspondence] = []
    ran: dict[str, int] = {}
    for group in side.groups:
        for run in group.runs:
            if run.run is not None:
                manifest = run.run.manifest
                run_dir = run.run.path
                record = read_correspondence(run.run.path)
                ranks = _rank_records(side, run.run.root)
                ran = _run_order(run) if record is not None else {}
                break
        if manifest:
            break
    else:
        if side.path.is_file() and (side.path.parent / "manifest.json").is_file():
            from ...store.loader import read_manifest

            manifest = read_manifest(side.path.parent)
    classes = manifest.get("module_classes")
    model_class = str(manifest.get("model_class") or "")
    root = str(manifest.get("root") or model_class.rsplit(".", 1)[-1])
    integration = manifest.get("integration")
    engine = str(integration.get("name", "")) if isinstance(integration, dict) else ""
    return SideInfo(
        framework=_framework(manifest),
        root=root,
        classes=dict(classes) if isinstance(classes, dict) else {},
        integration=engine,
        record=record,
        ranks=tuple(ranks),
        ran=ran,
        run_dir=run_dir,
        grafted=isinstance(manifest.get("graft"), dict),
        stats=manifest.get("mode") == "stats",
    )


def convention_values(side: SideInfo) -> SideValues | None:
    """The values a side's conventions are measured on (:mod:`.conventions`): none for a grafted
    run, whose layers each took the reference's inputs, so no layer consumes the one before it
    and what a layer's next consumer holds tells nothing of its output (the records alone decide,
    as for a stats dump)."""
    return None if side.grafted else side_values(side.run_dir)


def conventions_untold(side: SideInfo) -> str | None:
    """Why nothing in a side tells its conventions, where that is so: a stats dump holds no value
    to read which of a layer's ``(hidden, residual)`` its next consumer took, so its tuple outputs
    are listed with this reason, never compared by an assumed sum. None for a grafted run (its
    records alone decide, :func:`convention_values`) and for a run with values."""
    if side.stats and not side.grafted:
        return (
            "the dump holds statistics, not values: nothing in it tells whether the next consumer "
            "took hidden + residual or hidden alone"
        )
    return None


def _run_order(run: RunSource) -> dict[str, int]:
    """Each module of a run's first pass -> the place of its first output in the capture order
    (the execution order of siblings: a module's output is captured when it returns); empty when
    the pass cannot be read (the plan reports that)."""
    passes = run.pass_indices()
    if not passes:
        return {}
    try:
        view = run.open_pass(passes[0])
    except (OSError, ValueError):  # unreadable (TracedumpError is a ValueError): the plan reports it
        return {}
    order: dict[str, int] = {}
    try:
        for name in view.entries:
            key = Key.parse(name)
            if not key.input:
                order.setdefault(key.module, len(order))
    except ValueError:
        pass
    finally:
        view.close()
    return order


def _rank_records(side: Side, root: str) -> list[Correspondence]:
    """Every rank's record of the dump's runs of one root, in rank order (not only the ranks the
    side compares: a tensor-parallel run is joined from all of them); empty when one lacks it."""
    if not side.path.is_dir():
        return []
    from ...store.loader import open_dump

    try:
        runs = sorted((r for r in open_dump(side.path).runs if r.root == root), key=lambda r: r.rank)
    except Exception:
        return []
    found = [read_correspondence(r.path) for r in runs]
    return [r for r in found if r is not None] if all(r is not None for r in found) else []
