"""Which ops of two runs pair, inside each module that ``TRACEDUMP_DUMP_OPS`` tapped.

An op's key is ``<module>/<i>:<op>[path][::callN]`` (docs/file-format.md): ``i`` counts the ops of
one call of the module, so one extra op in a run shifts every index after it, and pairing by name
would compare each later op with its neighbour. Instead, per module call (module, ``::callN``), the
two runs' sequences of op names are aligned (:class:`difflib.SequenceMatcher`, no junk heuristic):
ops in matching blocks pair, whatever their indices; an op in one run only is an :class:`ExtraOp`,
reported as a divergence of its own ("B runs an extra aten.mul.Tensor in model.layers.2.mlp") at its
place in execution order. A module call whose ops only one run dumped (the other ran without
``OPS``, or did not call it) is left unmatched, like any name on one side only.

``--map`` applies to the module part of A's op keys, as to any of A's names.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from ...store.format import Key
from ..options import DiffOptions
from .kinds import PairKind
from .unshard import SideEntry

EXTRA_OP = PairKind.EXTRA_OP  # the kind of pair of an op present in one run only

# Ops whose output holds memory they never wrote (uninitialised: whatever the allocator handed out,
# or a resize's new elements): two identical runs differ there, so they are never compared.
ALLOCATION_OPS = frozenset(
    {"empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided", "empty_permuted"}
    | {"resize_", "resize_as_"}
)

# ``<module>/<i>:<namespace>.<op>.<overload>`` as dump/ops.py writes it: ``i`` a decimal without
# leading zeros, the op the three dotted identifiers torch names every op overload with
# (``aten.mul.Tensor``, ``mylib.fused.default``). A module name cannot end so: a component holds no
# ``.``, so ``x/3:aten.mul.Tensor`` would be three modules, the first named ``x/3:aten``; a
# ``ModuleDict`` key such as ``block/1:conv`` stays a module's name.
_IDENT = r"[A-Za-z_]\w*"
_OP = re.compile(
    rf"(?P<module>.*[^.])/(?P<index>0|[1-9]\d*):(?P<op>{_IDENT}\.{_IDENT}\.{_IDENT})", re.S | re.ASCII
)


@dataclass(frozen=True)
class OpKey:
    """An op key taken apart: the module, the op's index in that call and its name, the path
    inside its output, and the module's call number."""

    module: str
    index: int
    op: str
    path: str
    call: int


def parse_op_key(name: str) -> OpKey | None:
    """``model.layers.2.mlp/3:aten.mul.Tensor::call1`` -> its parts; None for a key that is no op's."""
    try:
        key = Key.parse(name)
    except ValueError:
        return None
    if key.input:
        return None
    match = _OP.fullmatch(key.module)
    if match is None:
        return None
    return OpKey(match["module"], int(match["index"]), match["op"], key.path, key.call)


def split_ops(entries: Mapping[str, SideEntry]) -> tuple[dict[str, SideEntry], dict[str, SideEntry]]:
    """(op entries, every other entry), each in capture order."""
    ops: dict[str, SideEntry] = {}
    rest: dict[str, SideEntry] = {}
    for name, entry in entries.items():
        (ops if parse_op_key(name) is not None else rest)[name] = entry
    return ops, rest


@dataclass(frozen=True)
class ExtraOp:
    """An op one run ran and the other did not, inside a module call both runs tapped."""

    side: str  # "A" or "B": the run that has it
    entry: SideEntry
    module: str
    op: str
    after: str | None  # A's op key it comes after in execution order (None: first of its call)

    @property
    def message(self) -> str:
        return f"{self.side} runs an extra {self.op} in {self.module}"


@dataclass
class OpAlignment:
    """The op pairs of one pass, the extra ops, and the op keys of calls only one run tapped."""

    pairs: list[tuple[SideEntry, SideEntry]] = field(default_factory=list)
    # A's name of a pair -> why its values are not compared (an allocation op's output)
    unwritten: dict[str, str] = field(default_factory=dict)
    extras: list[ExtraOp] = field(default_factory=list)
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)


_Group = dict[tuple[int, str], dict[str, SideEntry]]  # (index, op) -> path -> entry, in order


def _groups(
    entries: Mapping[str, SideEntry], rename: bool, options: DiffOptions
) -> dict[tuple[str, int], _Group]:
    groups: dict[tuple[str, int], _Group] = {}
    for name, entry in entries.items():
        key = parse_op_key(name)
        if key is None:
            continue
        module = options.map_name(key.module) if rename else key.module
        groups.setdefault((module, key.call), {}).setdefault((key.index, key.op), {})[key.path] = entry
    return groups


def align_ops(
    ops_a: Mapping[str, SideEntry], ops_b: Mapping[str, SideEntry], options: DiffOptions
) -> OpAlignment:
    """Pair the ops of each module call by aligning the two runs' sequences of op names."""
    out = OpAlignment()
    groups_a, groups_b = _groups(ops_a, True, options), _groups(ops_b, False, options)
    for where, group_a in groups_a.items():
        group_b = groups_b.get(where)
        if group_b is None:
            out.only_a.extend(entry.name for leaves in group_a.values() for entry in leaves.values())
            continue
        _align_call(where[0], group_a, group_b, out)
    for where, group_b in groups_b.items():
        if where not in groups_a:
            out.only_b.extend(entry.name for leaves in group_b.values() for entry in leaves.values())
    return out


def _align_call(module: str, group_a: _Group, group_b: _Group, out: OpAlignment) -> None:
    ops_a, ops_b = list(group_a), list(group_b)
    matcher = difflib.SequenceMatcher(None, [op for _, op in ops_a], [op for _, op in ops_b], autojunk=False)
    last_a: str | None = None  # A's latest op key in execution order, where a B-only op is placed
    for tag, a0, a1, b0, b1 in matcher.get_opcodes():
        if tag == "equal":
            for op_a, op_b in zip(ops_a[a0:a1], ops_b[b0:b1], strict=True):
                leaves_a, leaves_b = group_a[op_a], group_b[op_b]
                for path, entry_a in leaves_a.items():
                    entry_b = leaves_b.get(path)
                    if entry_b is None:
                        out.extras.append(ExtraOp("A", entry_a, module, op_a[1], last_a))
                    else:
                        out.pairs.append((entry_a, entry_b))
                        why = unwritten_reason(op_a[1])
                        if why is not None:
                            out.unwritten[entry_a.name] = why
                    last_a = entry_a.name
                for path, entry_b in leaves_b.items():
                    if path not in leaves_a:
                        out.extras.append(ExtraOp("B", entry_b, module, op_b[1], last_a))
            continue
        for op_a in ops_a[a0:a1]:  # delete, replace: A's ops here have no counterpart
            for entry_a in group_a[op_a].values():
                out.extras.append(ExtraOp("A", entry_a, module, op_a[1], last_a))
                last_a = entry_a.name
        for op_b in ops_b[b0:b1]:  # insert, replace: nor have B's
            for entry_b in group_b[op_b].values():
                out.extras.append(ExtraOp("B", entry_b, module, op_b[1], last_a))


def unwritten_reason(op: str) -> str | None:
    """Why the output of ``op`` (``aten.empty_like.default``) is not compared: an allocation op
    returns memory it did not write; None for any other op."""
    name = op.split(".")[1] if op.count(".") >= 2 else op
    if name not in ALLOCATION_OPS:
        return None
    return f"{op} allocates its output without writing it (uninitialised memory): never compared"


def suggest_ops(name: str, dumped: Mapping[str, object] | None = None) -> str | None:
    """The rerun that looks inside a module-level divergence: ``TRACEDUMP_DUMP_OPS='^M$'``.

    ``M`` is the module whose forward computed the diverged tensor's inputs and ran its ops: the
    diverged module itself when it has dumped children (a container: its own ``forward`` holds the
    ops between them), else its parent (a leaf's wrong output is its own op or a wrong input built
    by the parent; the parent's ops include the leaf's). None for an op key (already inside) or a
    record tag with no module name."""
    try:
        key = Key.parse(name)
    except ValueError:
        return None
    if parse_op_key(name) is not None or not key.module:
        return None
    module = key.module
    has_children = dumped is not None and any(other.startswith(module + ".") for other in dumped)
    if not has_children and "." in module:
        module = module.rsplit(".", 1)[0]
    return f"TRACEDUMP_DUMP_OPS='^{re.escape(module)}$'"
