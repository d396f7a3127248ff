"""Conventions read off the run itself, never assumed: what a module's output *is*, from what the
same run computed with it (docs/engines.md, "Conventions measured in the run").

The derived bridge (:mod:`.correspondence`) pairs modules by the checkpoint tensors they hold; a
pair of modules that hold the same weights can still return different quantities:

- a decoder layer returning ``(hidden, residual)``: Llama-style engines defer the residual add
  (``hidden`` is the MLP's output, the next layer's fused add + norm adds ``residual``), others
  (Cohere, StableLM in vLLM) return ``hidden`` with the residual already in it. Which one is the
  layer's output is read from what the run's next consumer took (:func:`tuple_output`): the fused
  add + norm's running residual equal to ``hidden + residual`` says "the sum", a consumer taking
  ``hidden`` alone (a norm's pass-through residual, the next layer's only hidden input) says
  "``hidden``". Nothing downstream that tells: unknown, and the bridge lists the layer with the
  reason instead of comparing it by a guess;
- a block that adds its input (the residual) to its last child's output against one that returns
  that output as it is (HF's Bloom attention and MLP against vLLM's): :func:`returns_last_child`
  on both sides, compared where the two last children are themselves a pair;
- a module of an identity class (``Dropout``) whose output is not the tensor recorded before it
  (attention probabilities computed in a function): :func:`copies_previous`.

Only the first pass of one run per side is read (a few tensors per decoder layer, memory-mapped,
their first :data:`ROWS` rows).
Two values are "the same" within a couple of roundings of their dtype: a fused add in the run's
dtype against the float64 sum of its two stored operands.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ...store.dtypes import UNIT_ROUNDOFF
from ...store.format import Key

SCAN = 48  # records after a layer's outputs searched for the consumer that tells its convention
ROWS = 16  # rows (tokens) of each tensor read: evidence enough, and cheap for a large model

SUM, FIRST = "sum", "first"


def _parse(name: str) -> Key | None:
    try:
        return Key.parse(name)
    except ValueError:
        return None


def _descends(module: str, container: str) -> bool:
    return module.startswith(container + ".") or (container == "" and module != "")


@dataclass
class SideValues:
    """One side's first pass: its tensor names in capture order and their values on demand
    (float64), or None for a name without values (a stats dump, an integer tensor)."""

    names: list[str]
    read: Callable[[str], np.ndarray | None]
    dtypes: Mapping[str, str]
    shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    keys: list[Key | None] = field(init=False)
    index: dict[str, int] = field(init=False)
    _cache: dict[str, np.ndarray | None] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self.keys = [_parse(n) for n in self.names]
        self.index = {n: i for i, n in enumerate(self.names)}

    def value(self, name: str) -> np.ndarray | None:
        if name not in self._cache:
            self._cache[name] = self.read(name) if name in self.index else None
        return self._cache[name]

    def roundoff(self, name: str) -> float:
        return UNIT_ROUNDOFF.get(self.dtypes.get(name, "float32"), UNIT_ROUNDOFF["float32"])

    def outputs(self, module: str) -> list[str]:
        """The output leaves of ``module``'s first call, in capture order."""
        return [
            n
            for n, k in zip(self.names, self.keys, strict=True)
            if k is not None and k.module == module and not k.input and k.call == 0
        ]

    def output(self, module: str) -> str | None:
        """The name holding ``module``'s (first) output tensor: the plain output, ``[0]``, or HF's
        ``[last_hidden_state]``."""
        found = set(self.outputs(module))
        for name in (module, module + "[0]", module + "[last_hidden_state]"):
            if name in found:
                return name
        return None


def side_values(run_dir: Path | None) -> SideValues | None:
    """The first pass of the run dir that holds tensor values, or None (no run dir, a stats dump,
    nothing readable): then nothing is measured and the bridge keeps its record-only rules."""
    if run_dir is None:
        return None
    try:
        from ...store.loader import open_pass
        from ..load.reader import SafetensorsMap, widen

        files = sorted(Path(run_dir).glob("pass*.safetensors"))
        if not files:
            return None
        pass_file = open_pass(files[0])  # the lowest pass, its parts reassembled
        names = list(pass_file.names)
        infos = {n: pass_file.info(n) for n in names}
        dtypes = {n: info.dtype for n, info in infos.items()}
        shapes = {n: tuple(info.shape) for n, info in infos.items()}
        maps: dict[str, SafetensorsMap] = {}

        def read(name: str) -> np.ndarray | None:
            header = pass_file.header_of(name)
            key = str(header.path)
            if key not in maps:
                maps[key] = SafetensorsMap(header)
            stored = maps[key].array(name)
            if stored.dtype not in UNIT_ROUNDOFF:
                return None
            array = stored.array.reshape(core(stored.array.shape))  # [1, tokens, h] as [tokens, h]
            head = array[:ROWS] if array.ndim > 1 else array
            return np.asarray(widen(head, stored.dtype, np.float64), dtype=np.float64)

        return SideValues(names, read, dtypes, shapes)
    except Exception:
        return None


def core(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A shape without its leading size-1 dims: a batch of one (HF's ``[1, tokens, hidden]``)
    holds what a flat ``[tokens, hidden]`` holds."""
    dims = list(shape)
    while len(dims) > 1 and dims[0] == 1:
        dims.pop(0)
    return tuple(dims)


def same(values: SideValues, x: np.ndarray | None, y: np.ndarray | None, name: str) -> bool:
    """Whether ``x`` holds ``y`` up to a couple of roundings of ``name``'s dtype."""
    if x is None or y is None or x.shape != y.shape or x.size == 0:
        return False
    u = values.roundoff(name)
    scale = float(np.max(np.abs(y))) or 1.0
    return bool(np.all(np.abs(x - y) <= 2 * u * np.abs(y) + 1e-3 * u * scale))


@dataclass(frozen=True)
class Told:
    """What the run says of one module: ``what`` (:data:`SUM`, :data:`FIRST`, True/False) or None
    when nothing in the run tells, and why."""

    what: str | bool | None
    why: str


def tuple_output(values: SideValues, module: str) -> Told:
    """Which of ``module``'s ``(hidden, residual)`` is its output: read from the first later
    record (not inside the module) that holds ``hidden + residual`` or ``hidden`` alone. A later
    call's inputs that take the two apart (``hidden`` and ``residual`` both passed on) tell
    nothing: the consumer that combines them does."""
    first, second = module + "[0]", module + "[1]"
    if first not in values.index:
        return Told(None, f"{module} recorded no output [0]")
    if second not in values.index:
        return Told(FIRST, f"{module} returns ({first}, None)")
    hidden, residual = values.value(first), values.value(second)
    if hidden is None or residual is None or hidden.shape != residual.shape:
        return Told(None, f"{first} and {second} are no two tensors of one shape with values")
    total = hidden + residual
    start = max(values.index[first], values.index[second]) + 1
    checked = 0
    for position in range(start, len(values.names)):
        key = values.keys[position]
        if key is None or key.module == module or _descends(key.module, module):
            continue
        checked += 1
        if checked > SCAN:
            break
        name = values.names[position]
        if values.shapes and core(values.shapes.get(name) or ()) != core(values.shapes.get(first) or ()):
            continue  # another shape: not read
        x = values.value(name)
        if x is None or x.shape != hidden.shape:
            continue
        is_sum, is_first = same(values, x, total, name), same(values, x, hidden, name)
        if is_sum and not is_first:
            return Told(SUM, f"{name} holds {first} + {second}")
        if is_first and not is_sum:
            if key.input and _passes_pair(values, key, residual):
                continue  # the pair handed on: its consumer inside tells
            return Told(FIRST, f"{name} holds {first} alone")
    return Told(
        None,
        f"nothing recorded after it holds {first} + {second} or {first} alone (the next layer's "
        "fused add + norm, or its inputs with --inputs)",
    )


def _passes_pair(values: SideValues, key: Key, residual: np.ndarray) -> bool:
    """Whether the call of input ``key`` also took ``residual`` as an input of its own."""
    for name, other in zip(values.names, values.keys, strict=True):
        same_call = other is not None and other.input and (other.module, other.call) == (key.module, key.call)
        if same_call and other != key and same(values, values.value(name), residual, name):
            return True
    return False


def last_child(values: SideValues, module: str) -> str | None:
    """The output name of the last module inside ``module`` recorded before ``module``'s own output
    (its last child's result), or None when no child was recorded."""
    own = values.output(module)
    if own is None:
        return None
    outputs = values.outputs(module)
    position = min(values.index[n] for n in outputs) if outputs else values.index[own]
    for j in range(position - 1, -1, -1):
        key = values.keys[j]
        if key is None:
            return None
        if key.module == module:
            if key.input:
                return None
            continue
        if not _descends(key.module, module):
            return None
        if key.input:
            continue
        return values.output(key.module) or values.names[j]
    return None


def returns_last_child(values: SideValues, module: str, output: np.ndarray | None = None) -> Told:
    """Whether ``module``'s output is its last child's output as it is (True), or something more
    (the residual added inside: False); None when the run does not show both."""
    child = last_child(values, module)
    own = values.output(module)
    if child is None or own is None:
        return Told(None, f"{module}: no child recorded before its output")
    mine = output if output is not None else values.value(own)
    theirs = values.value(child)
    if mine is None or theirs is None:
        return Told(None, f"{module}: no values")
    return Told(same(values, mine, theirs, own), child)


def copies_previous(values: SideValues, module: str) -> bool | None:
    """Whether an identity-class module's output is the tensor recorded just before it (its
    input); None when the run does not show it."""
    own = values.output(module)
    if own is None:
        return None
    for j in range(values.index[own] - 1, -1, -1):
        key = values.keys[j]
        if key is None or key.input or (key.path and key.path not in ("[0]", "")):
            continue
        return same(values, values.value(own), values.value(values.names[j]), own)
    return None


def tuple_roles(values: SideValues, module: str, wanted: Mapping[str, tuple[bool, int]]) -> dict[str, str]:
    """Which output leaf of ``module`` is which, by what it holds, never by its position:
    ``wanted`` maps a role to (integer dtype, last dim); a role is named only where exactly one
    leaf fits it (a router's ``(logits, weights, ids)`` in whatever order it returns them)."""
    found: dict[str, str] = {}
    leaves = values.outputs(module)
    for role, (integer, width) in wanted.items():
        fits = [
            name
            for name in leaves
            if values.dtypes.get(name, "").startswith(("int", "uint")) == integer
            and (values.shapes.get(name) or (0,))[-1:] == (width,)
        ]
        if len(fits) == 1:
            found[role] = fits[0]
    return found


@dataclass(frozen=True)
class Observed:
    """Both runs' values (their first pass), read to measure what the records cannot say
    (this module); a side is None when its dump holds no values (stats)."""

    a: SideValues | None
    b: SideValues | None
    untold: str | None = None  # why A's dump cannot tell its conventions (a stats dump), if so

    def output_of(self, module: str) -> Told:
        """Which of the engine container's ``(hidden, residual)`` is its output, from the run; a
        stats dump's is untold (listed with the reason), a run read from its records alone (a
        grafted one) keeps the records' sum."""
        if self.a is None:
            return Told(None, self.untold) if self.untold else Told(SUM, "no values to read")
        return tuple_output(self.a, module)
