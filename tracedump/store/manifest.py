"""``manifest.json`` as one typed model, and its one reader.

The dumper writes the manifest (``store/format.py`` ``Manifest`` lists its keys in order); a reader
cannot trust it: a dump may come from another machine, a damaged disk or a hand. Every field a
reader uses is typed here, ``graft``, ``integration`` and ``control`` included, so a wrong type is
one :class:`~tracedump.errors.DumpReadError` naming the file and the field (``tracedump ls``,
``show`` and ``diff`` exit 2), never an ``AttributeError`` three calls later.

Every field is optional (manifests written before format 1.1 lack some), and keys this version
does not know are let through (a minor version only adds). ``world_size`` stays loose on purpose:
``diff --unshard`` checks it with a message of its own. The model validates; readers keep the
parsed dict (``Run.manifest``), whose types the model has then vouched for.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue, TypeAdapter

from ..errors import DumpReadError
from .format import MANIFEST, check_format
from .jsonio import read_json_file, validated

MAX_MANIFEST_BYTES = 1 << 28  # 256 MiB: a manifest of 100k modules is a few MB
MAX_RANK = 2**31 - 1

Count = Annotated[int, Field(ge=0)]
Number = float | Literal["nan", "inf", "-inf"]  # NaN / Infinity / 1e400 are read as these strings


class _Record(BaseModel):
    """A record of the manifest: strictly typed fields, unknown keys let through."""

    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True)


class NotGraftedCall(_Record):
    pass_index: int = Field(alias="pass")
    call: int
    reason: str


class NotGrafted(_Record):
    calls: int = 0
    listed: list[NotGraftedCall] = []


class ShadowRecord(_Record):
    """``graft.shadow``: the fp32 shadow of the grafted calls (``dump/shadow.py``)."""

    shadowed_calls: dict[str, int] = {}
    not_shadowed: dict[str, int] = {}  # reason -> calls


class GraftRecord(_Record):
    """The ``graft`` entry a grafted run writes (``dump/grafter.py`` ``Grafter.summary``)."""

    source: str = Field("", alias="from")
    level: str | None = None
    map: list[str] = []
    modules: list[str] = []
    containers: list[str] = []
    leaves: dict[str, list[str]] = {}
    reference_names: dict[str, str] = {}
    grafted_calls: dict[str, int] = {}
    kept_own_inputs: dict[str, list[str]] = {}
    feeds: dict[str, str] = {}
    fed_inputs: dict[str, dict[str, str]] = {}
    not_grafted: dict[str, NotGrafted] = {}
    shadow: ShadowRecord | None = None


class Integration(_Record):
    """The engine integration that dumped the run (the vLLM plugin: ``{"name": "vllm", ...}``)."""

    name: str = ""
    version: str | None = None
    runner: str | None = None


class OrderEntry(_Record):
    """One line of ``control.orders``: an arm/disarm order and what the process made of it."""

    id: int | None = None
    action: str | None = None
    event: str | None = None
    step: int | None = None
    time: Number | None = None
    start_step: int | None = None
    steps: int | None = None
    filter: str | None = None
    mode: str | None = None
    inputs: bool | None = None
    request: str | None = None
    dumped: int | None = None


class ControlRecord(_Record):
    """``control``: a run started with ``TRACEDUMP_DUMP_CONTROL=1`` (``dump/control.py``)."""

    enabled: bool | None = None
    state: str | None = None
    armed_from: int | None = None
    armed_until: int | None = None
    orders: list[OrderEntry] = []


class CompiledRecord(_Record):
    """``compiled``: a run with ``COMPILED=1`` (``dump/taps.py``): taps run, the CUDA graphs holding
    taps, the bytes of their buffers, and the dumped steps that ran the graph without taps."""

    taps: Count | None = None
    cuda_graphs: Count | None = None
    graph_tap_bytes: Count | None = None
    idle_graph_steps: Count | None = None


class Precision(_Record):
    parameters: dict[str, Count] | None = None
    devices: list[str] | None = None
    float32_matmul_precision: str | None = None
    tf32: bool | None = None


class PassesRecord(_Record):
    count: Count | None = None
    bytes: Count | None = None
    files: Count | None = None
    indices: list[Count] | None = None


class ErrorRecord(_Record):
    where: str | None = None
    type: str | None = None
    message: str | None = None
    count: Count | None = None


class ManifestModel(_Record):
    """``manifest.json``, every field typed (docs/file-format.md has each one's meaning)."""

    format: str | int | None = None
    tracedump_version: str | None = None
    torch_version: str | None = None
    python_version: str | None = None
    settings: dict[str, JsonValue] | None = None
    env_prefix: str | None = None
    model_class: str | None = None
    framework: str | None = None
    framework_version: str | None = None
    root: str | None = None
    modules: list[str] | None = None
    module_classes: dict[str, str] | None = None
    shared_modules: dict[str, list[str]] | None = None
    precision: Precision | None = None
    pid: Annotated[int, Field(ge=0, le=2**63 - 1)] | None = None
    rank: Annotated[int, Field(ge=0, le=MAX_RANK)] | None = None
    world_size: JsonValue = None  # checked by --unshard, which names the ranks it finds
    hostname: str | None = None
    argv: list[str] | None = None
    start_time: str | None = None
    end_time: str | None = None
    complete: bool | None = None
    incomplete_reason: str | None = None
    skipped: dict[str, Count] | None = None
    truncated_passes: list[int] | None = None
    errors: list[ErrorRecord] | None = None
    anomalies: dict[str, str] | None = None
    passes: PassesRecord | None = None
    records_file: str | None = None
    control: ControlRecord | None = None
    compiled: CompiledRecord | None = None
    manifest_error: str | None = None
    graft: GraftRecord | None = None
    integration: Integration | None = None


_ADAPTER = TypeAdapter(ManifestModel)


def parse_manifest(data: Any, path: Path | str) -> ManifestModel:
    """The typed manifest of parsed JSON ``data`` read from ``path``: a format this tracedump
    cannot read is a FormatVersionError, any other problem a DumpReadError naming the field."""
    if not isinstance(data, dict):
        raise DumpReadError(f"{path}: not a JSON object")
    check_format(data.get("format"), path)  # first: a newer major may type its fields otherwise
    return validated(_ADAPTER.validate_python, data, lambda line: DumpReadError(f"{path}: {line}"))


def read_manifest_file(path: Path) -> tuple[dict[str, Any], ManifestModel]:
    """``path`` (a ``manifest.json``) read, bounded and validated: the dict as written, and its model."""
    data = read_json_file(path, MAX_MANIFEST_BYTES)
    return data, parse_manifest(data, path)


def read_manifest(run_dir: Path) -> dict[str, Any]:
    """A run dir's ``manifest.json`` ({} when there is none), validated: a DumpReadError names the
    file and the field; a FormatVersionError (a DumpReadError) a major this tracedump cannot read."""
    path = run_dir / MANIFEST
    if not path.is_file():
        return {}
    return read_manifest_file(path)[0]


__all__ = [
    "MAX_MANIFEST_BYTES",
    "ControlRecord",
    "GraftRecord",
    "Integration",
    "ManifestModel",
    "OrderEntry",
    "ShadowRecord",
    "parse_manifest",
    "read_manifest",
    "read_manifest_file",
]
