"""The structural bridge: which tensors of two different module trees compare, and how.

Two implementations of one model rarely share a module tree. vLLM fuses ``q_proj``/``k_proj``/
``v_proj`` into one ``qkv_proj``, returns ``(out, bias)`` tuples from its linear layers, defers each
decoder layer's residual add to the next layer's norm, and fuses ``act_fn(gate) * up`` into
``SiluAndMul``. A bridge says, **as data**, how such tensors relate, so that ``tracedump diff VLLM
HF`` needs no flag. The rule format (TOML, or JSON with the same keys) is documented in
docs/engines.md; in short::

    [bridge]
    name = "vllm-transformers-llama"
    a = "vllm"                  # the framework whose names the rules call "a"
    b = "transformers"
    architectures = ['(Llama|Mistral|Qwen2|Qwen3)ForCausalLM']   # optional, regexes on the root
    align = "tokens"            # optional: the alignment when this bridge applies and none is asked

    [[rule]]
    op = "split"                # rename | unwrap | split | concat | sum | product | skip
    match = 'model\\.layers\\.(\\d+)\\.self_attn\\.qkv_proj\\[0\\]'   # re.fullmatch on side's names
    b = ["model.layers.{1}.self_attn.q_proj", "model.layers.{1}.self_attn.k_proj", ...]

``match`` is tried on the names of ``side`` ("a", the default, or "b"); ``a`` and ``b`` are
templates filled with its groups: ``{0}`` is the whole name, ``{1}`` the first group, and
``{1-1}`` / ``{1+1}`` a captured layer index minus or plus a constant (nothing else: no ``eval``).
The anchor's own side defaults to ``["{0}"]``. A rule **applies** to a name when every tensor it
names exists on its side; else the next matching rule is tried (a fallback chain: the ``down_proj``
input where inputs were dumped, else ``act_fn * up_proj``). A name some rule matched but none could
apply to is a leftover, counted with the first rule's reason; it is never matched by name.

The order, documented in docs/engines.md: A's names go through ``--map`` first (the user's
renames), the bridge's rules then see the mapped names and B's names, and what no rule claimed is
matched by name as always, whatever the two classes (the manifests' ``module_classes``): only two
classes known to compute different quantities (:func:`known_different`) are reported as not
comparable instead of being measured against each other. Every pair says what proves it
(:attr:`BridgedPair.paired_by`, docs/comparator.md "How two runs are paired").
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ...errors import UsageError
from ...store.correspondence import Correspondence, read_correspondence
from ...store.format import Key
from ..judge.tolerance import pair_precision
from ..load.sources import EntryMeta, RunSource, Side
from ..options import DiffOptions, UnshardRule
from .bridge_rules import Bridge, Rule, builtin_bridges
from .conventions import SideValues, side_values
from .correspondence import derive_bridge, tensor_parallel_joins, weight_findings, weight_pairs
from .input_roles import Role, input_role, is_input, pair_inputs
from .unshard import SideEntry

_COMBINE = {"sum": " + ", "product": " * "}
IDENTITY_CLASSES = re.compile(r"Dropout\d?d?|Identity")  # modules that return their input at inference


# ------------------------------------------------------------------ which bridge, which classes


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
    )


def _convention_values(side: SideInfo) -> SideValues | None:
    """The values a side's conventions are measured on (:mod:`.conventions`): none for a grafted
    run, whose layers each took the reference's inputs, so no layer consumes the one before it
    and what a layer's next consumer holds tells nothing of its output (the records alone decide,
    as for a stats dump)."""
    return None if side.grafted else side_values(side.run_dir)


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


def _fits(bridge: Bridge, a: SideInfo, b: SideInfo) -> bool:
    if bridge.a is not None and bridge.a != a.framework:
        return False
    if bridge.b is not None and bridge.b != b.framework:
        return False
    return not bridge.architectures or any(
        p.fullmatch(info.root) for p in bridge.architectures for info in (a, b)
    )


def select_bridge(
    option: Bridge | str | None, a: SideInfo, b: SideInfo, *, mapped: bool = False
) -> tuple[Bridge | None, str]:
    """The bridge to use and a line saying why: the user's file (as given, or swapped when its
    frameworks are the other way round), none, or the first built-in whose frameworks and
    architectures fit the two manifests (either way round)."""
    if option == "none":
        return None, "bridge: off (--bridge none)"
    if isinstance(option, Bridge):
        if option.a is not None and option.b is not None and _fits(option.swapped(), a, b):
            return option.swapped(), f"bridge: {option.name} from {option.source} (A is its {option.b})"
        return option, f"bridge: {option.name} from {option.source}"
    derived = _derived(a, b, mapped=mapped)
    if derived is not None:
        return derived, f"bridge: {derived.name} (correspondence.json; A {a.framework}, B {b.framework})"
    if not a.framework or not b.framework or a.framework == b.framework:
        return None, ""
    for bridge in builtin_bridges():
        if _fits(bridge, a, b):
            return bridge, f"bridge: {bridge.name} ({bridge.source}; A {a.framework}, B {b.framework})"
        if _fits(bridge.swapped(), a, b):
            return (
                bridge.swapped(),
                f"bridge: {bridge.name} ({bridge.source}; A {a.framework}, B {b.framework})",
            )
    return None, f"bridge: none built in for A {a.framework} and B {b.framework} ({a.root})"


def _derived(a: SideInfo, b: SideInfo, *, mapped: bool = False) -> Bridge | None:
    """The bridge derived from the two runs' correspondence records (:mod:`.correspondence`):
    when one side recorded its engine's weight load, or the two name their parameters
    differently; None otherwise (and for dumps without the records)."""
    if a.record is None or b.record is None:
        return None
    if mapped and not (a.record.loads or b.record.loads):
        return None  # two plain runs renamed by --map: the user's rules pair them
    return derive_bridge(
        a.record,
        b.record,
        framework_a=a.framework,
        framework_b=b.framework,
        classes_a=a.classes,
        classes_b=b.classes,
        ranks_a=list(a.ranks) or None,
        ranks_b=list(b.ranks) or None,
        ran=(a.ran, b.ran),
        values_a=_convention_values(a),
        values_b=_convention_values(b),
    )


# ------------------------------------------------------------------ expressions: what one side compares


@dataclass(frozen=True, kw_only=True)
class Expr:
    """One side of a pair: a stored tensor, or an op over several of that side's tensors.

    ``label`` is the name the report shows (``model.layers.0[0] + model.layers.0[1]``,
    ``model.layers.0.self_attn.qkv_proj[0][..., 0:256]``)."""

    names: tuple[str, ...]
    op: str | None = None  # None (one tensor), sum, product, concat, split
    dim: int = -1
    piece: tuple[int, int] | None = None  # split: [start, stop) along dim
    whole: int | None = None  # split: what the pieces add up to along dim

    @property
    def label(self) -> str:
        if self.op in _COMBINE:
            return _COMBINE[self.op].join(self.names)
        if self.op == "concat":
            return f"cat({', '.join(self.names)}, dim={self.dim})"
        if self.op == "split" and self.piece is not None:
            where = "" if self.dim == -1 else f"dim {self.dim}: "
            return f"{self.names[0]}[{where}{self.piece[0]}:{self.piece[1]}]"
        return self.names[0]

    def entry(self, entries: Mapping[str, SideEntry]) -> SideEntry | None:
        """This side's entry for one pass (None when a tensor it needs is not in the pass); a
        derived entry knows its shape from the parts' metadata, its values from :func:`.unshard.assemble`."""
        parts = [entries.get(name) for name in self.names]
        if any(p is None for p in parts):
            return None
        found = [p for p in parts if p is not None]
        if self.op is None:
            return found[0]
        first = found[0]
        problem = next((p.problem for p in found if p.problem is not None), None)
        if problem is None and any(p.meta.kind != "tensor" for p in found):
            problem = f"{self.op} needs whole tensors, not statistics"
        shape, why = self._shape([p.meta.shape for p in found])
        dtypes = {p.meta.dtype for p in found}
        # parts of several dtypes (bf16 + fp32) are joined as numbers (unshard._derive widens each
        # from its own dtype), judged at the least precise of them
        dtype = first.meta.dtype if len(dtypes) == 1 or self.op != "concat" else pair_precision(*dtypes)
        meta = EntryMeta("tensor", shape, dtype)
        status = next((p.problem_status for p in found if p.problem is not None), None)
        return SideEntry(
            name=self.label,
            meta=meta,
            how=first.how,
            problem=problem or why,
            problem_status=status or ("error" if why else None),
            op=self.op,
            parts=tuple(found),
            piece=(self.dim, *self.piece) if self.piece is not None else (self.dim, 0, 0),
        )

    def _shape(self, shapes: list[tuple[int, ...] | None]) -> tuple[tuple[int, ...] | None, str | None]:
        if any(s is None for s in shapes):
            return None, None
        known = [s for s in shapes if s is not None]
        if self.op == "split":
            shape = known[0]
            if not -len(shape) <= self.dim < len(shape):
                return shape, f"split: dim {self.dim} is out of range for a tensor of shape {list(shape)}"
            axis = self.dim % len(shape)
            if self.piece is None or self.piece[1] > shape[axis]:
                return shape, f"split: {list(shape)} has no [{self.piece}] along dim {self.dim}"
            if self.whole is not None and self.whole != shape[axis]:
                return shape, (
                    f"split: the pieces add up to {self.whole} along dim {self.dim}, "
                    f"the tensor {list(shape)} has {shape[axis]}"
                )
            return (*shape[:axis], self.piece[1] - self.piece[0], *shape[axis + 1 :]), None
        if self.op == "concat":
            ndim = len(known[0])
            if not ndim or not -ndim <= self.dim < ndim:
                return known[0], (
                    f"concat: dim {self.dim} is out of range for parts of shapes {[list(s) for s in known]}"
                )
            axis = self.dim % ndim
            if any(
                len(s) != ndim or s[:axis] + s[axis + 1 :] != known[0][:axis] + known[0][axis + 1 :]
                for s in known
            ):
                return known[0], f"concat: shapes {[list(s) for s in known]} do not join along dim {self.dim}"
            return (*known[0][:axis], sum(s[axis] for s in known), *known[0][axis + 1 :]), None
        squeezed = {tuple(d for d in s if d != 1) for s in known}
        if len(squeezed) > 1:
            return known[0], f"{self.op}: shapes differ: {[list(s) for s in known]}"
        return known[0], None


@dataclass(frozen=True, kw_only=True)
class BridgedPair:
    """One comparison the bridge decided: A's expression, B's, and how (for the table)."""

    a: Expr
    b: Expr
    how: str | None  # "split -1", "sum", ... ; None for a pair matched by name
    rule: str | None = None  # "rule 3 (split)"
    # set: not comparable (one name, two classes known to compute different quantities, no rule)
    classes: tuple[str, str] | None = None
    paired_by: str = "name"  # what proves the pair: name | weights | load | structure | rule | map
    note: str | None = None  # what the pairing saw beside it: two classes, a weights finding

    def describe(self) -> str | None:
        """``split -1 (rule 4: qkv)``: what the table's bridge column shows; None for a name match."""
        if self.how is None:
            return None
        return f"{self.how} ({self.rule})" if self.rule else self.how


@dataclass(frozen=True, kw_only=True)
class Leftover:
    """A tensor without a counterpart, and why."""

    side: str  # "A" or "B"
    name: str
    reason: str
    mapped: str | None = None


@dataclass
class Matched:
    """The outcome of matching one pass's names: pairs in A's order, not comparable, leftovers."""

    pairs: list[BridgedPair] = field(default_factory=list)  # with the not comparable, in A's order
    leftovers: list[Leftover] = field(default_factory=list)


# What a pair may be proven by (``TensorResult.paired_by``), strongest first: the engine's load
# record, one name on both sides, the parameters' values, the place among proven pairs; a rule
# file's rules and --map are the user's say-so (docs/comparator.md, "How two runs are paired").
PAIRED_BY = ("load", "name", "weights", "structure", "rule", "map")

# Two classes under one name known to compute different quantities, whatever the model: a fused
# ``act(gate) * up`` against an activation alone.
_KNOWN_DIFFERENT = (
    (
        re.compile(r".*AndMul"),
        "one computes act(gate) * up from the fused gate and up halves, the other the activation alone",
    ),
)


def known_different(class_a: str | None, class_b: str | None) -> str | None:
    """Why two modules of one name compute different quantities, or None: a class difference is
    by itself no such reason (a port's own ``Linear`` subclass, its own RMSNorm)."""
    if not class_a or not class_b or class_a == class_b:
        return None
    for pattern, why in _KNOWN_DIFFERENT:
        if bool(pattern.fullmatch(class_a)) != bool(pattern.fullmatch(class_b)):
            return why
    return None


NO_NAME_IN_B = "no tensor of that name in B"
NO_NAME_IN_A = "no tensor of that name in A"
PLAIN_REASONS = frozenset({NO_NAME_IN_A, NO_NAME_IN_B})


def _bare(qualname: str) -> str:
    return qualname.rsplit(".", 1)[-1]


@dataclass(frozen=True, kw_only=True)
class Matcher:
    """Matches two sides' names for one diff: the bridge (if any), then names, with the class
    check. Built once per diff (:func:`matcher_for`); :meth:`match` runs per pass."""

    bridge: Bridge | None
    classes_a: Mapping[str, str]
    classes_b: Mapping[str, str]
    line: str = ""
    align: str | None = None  # the alignment to use when the user gave none (:func:`matcher_for`)
    unshard: tuple[UnshardRule, ...] = ()  # tensor-parallel joins derived from the ranks' loads
    # module (one name on both sides) -> what its recorded weights say against B's (:func:`weight_findings`)
    findings: Mapping[str, str] = field(default_factory=dict)
    # A's module -> B's, by parameters of unique values: what --map renames are checked against
    weight_pairs: Mapping[str, str] = field(default_factory=dict)
    # two module trees (a bridge applies): inputs pair by what they hold (:mod:`.input_roles`)
    inputs_by_role: bool = False
    # passes of one run usually hold the same names: matched once (names in order, and the roles
    # of their inputs -> Matched)
    _seen: dict[tuple[Any, ...], Matched] = field(default_factory=dict, compare=False, repr=False)

    def class_of(self, side: str, name: str) -> str | None:
        classes = self.classes_a if side == "a" else self.classes_b
        if not classes:
            return None
        try:
            module = Key.parse(name).module
        except ValueError:
            return None
        found = classes.get(module)
        return _bare(found) if found else None

    def match(
        self,
        names_a: Iterable[str] | Mapping[str, SideEntry],
        names_b: Iterable[str] | Mapping[str, SideEntry],
        options: DiffOptions,
    ) -> Matched:
        """The pairs (bridged, then by name), in A's capture order, and the leftovers with why.
        Given each side's entries (not names alone), inputs pair by what they hold where
        :attr:`inputs_by_role`."""
        roles_a, roles_b = self._roles(names_a), self._roles(names_b)
        key = (tuple(names_a), tuple(names_b), tuple(roles_a.items()), tuple(roles_b.items()))
        if key not in self._seen:
            self._seen[key] = self._match(list(key[0]), list(key[1]), options, (roles_a, roles_b))
        return self._seen[key]

    def _roles(self, names: Iterable[str] | Mapping[str, SideEntry]) -> dict[str, Role | None]:
        """Each input's role (None: not known), where inputs pair by role; else none."""
        if not self.inputs_by_role:
            return {}
        if isinstance(names, Mapping):
            return {n: input_role(e.meta) for n, e in names.items() if is_input(n)}
        return {n: None for n in names if is_input(n)}

    def _match(
        self,
        names_a: list[str],
        names_b: list[str],
        options: DiffOptions,
        roles: tuple[Mapping[str, Role | None], Mapping[str, Role | None]] = ({}, {}),
    ) -> Matched:
        mapped = {name: options.map_name(name) for name in names_a}
        _refuse_map_collisions(mapped, set(names_b), options)
        original = {m: name for name, m in mapped.items()}
        have = {"a": set(original), "b": set(names_b)}
        claimed: dict[str, set[str]] = {"a": set(), "b": set()}
        out = Matched()
        anchored: list[tuple[int, BridgedPair]] = []
        order = {m: i for i, m in enumerate(mapped.values())}
        state = _Matching(claimed, out, anchored, order, original)
        for side, names in (("a", list(mapped.values())), ("b", names_b)):
            for name in names:
                if name in claimed[side] or self.bridge is None:
                    continue
                self._anchor(side, name, have, state)
        if self.inputs_by_role:
            roles_a = {m: roles[0].get(name) for name, m in mapped.items() if name in roles[0]}
            self._pair_inputs(list(mapped.values()), names_b, (roles_a, roles[1]), state)
        in_b = set(names_b)
        for name in names_a:
            m = mapped[name]
            if m in claimed["a"]:
                continue
            if m not in in_b:
                out.leftovers.append(Leftover(side="A", name=name, reason=NO_NAME_IN_B, mapped=m))
                continue
            anchored.append((order[m], self._by_name(name, m)))
            claimed["b"].add(m)
        for name in names_b:
            if name not in claimed["b"]:
                out.leftovers.append(Leftover(side="B", name=name, reason=NO_NAME_IN_A))
        anchored.sort(key=lambda item: item[0])
        if self.bridge is not None:
            self._identities(out, anchored, names_a, names_b)
        out.pairs = [pair for _, pair in anchored if options.selected(*_names(pair))]
        out.leftovers = [u for u in out.leftovers if options.selected(u.name, u.mapped)]
        return out

    def _by_name(self, name: str, mapped: str) -> BridgedPair:
        """A pair of one name (``name``), or made by ``--map`` (``mapped``), whatever the classes:
        not comparable only where the two classes are known to compute different quantities. The
        note says what the classes and the recorded weights say beside it."""
        class_a, class_b = self.class_of("a", name), self.class_of("b", mapped)
        why = known_different(class_a, class_b) if mapped == name else None
        if why is not None:
            classes = (class_a or "", class_b or "")
            return BridgedPair(a=Expr(names=(name,)), b=Expr(names=(mapped,)), how=None, classes=classes)
        notes = []
        if class_a and class_b and class_a != class_b:
            notes.append(f"classes: A {class_a}, B {class_b}")
        try:
            module_a, module_b = Key.parse(name).module, Key.parse(mapped).module
        except ValueError:
            module_a = module_b = ""
        if mapped == name and module_a in self.findings:
            notes.append(self.findings[module_a])
        held = self.weight_pairs.get(module_a)
        if mapped != name and held is not None and held != module_b:
            notes.append(map_contradiction(module_a, module_b, held))
        return BridgedPair(
            a=Expr(names=(name,)),
            b=Expr(names=(mapped,)),
            how=None,
            paired_by="name" if mapped == name else "map",
            note="; ".join(notes) or None,
        )

    def _pair_inputs(
        self,
        names_a: list[str],
        names_b: list[str],
        roles: tuple[Mapping[str, Role | None], Mapping[str, Role | None]],
        state: _Matching,
    ) -> None:
        """The inputs no rule claimed, call by call of two paired modules, by what they hold
        (:func:`.input_roles.pair_inputs`): the module's counterpart is the bridge's (the modules
        it pairs by their weights), else the module of the same name and class. Inputs of a
        module with no such counterpart are left to the name match (and its class check). B's
        inputs a rule already compares are candidates too, never listed as left over."""
        calls_a = _input_calls(n for n in names_a if n not in state.claimed["a"])
        calls_b = _input_calls(names_b)
        modules = self.bridge.module_pairs if self.bridge is not None else {}
        for (module, call), group_a in calls_a.items():
            counterpart = self._input_counterpart(module, modules)
            group_b = calls_b.get((counterpart, call), []) if counterpart is not None else []
            if not group_b:
                continue
            paired = pair_inputs(group_a, group_b, roles[0], roles[1])
            for a, b in paired.pairs:
                by_name = a == b
                role = roles[0].get(a)
                pair = BridgedPair(
                    a=Expr(names=(state.original.get(a, a),)),
                    b=Expr(names=(b,)),
                    how=None if by_name else "input by role",
                    rule=None if by_name or role is None else role.describe(),
                    paired_by="name" if by_name else "structure",
                )
                state.anchored.append((state.order.get(a, len(state.order)), pair))
                state.claimed["a"].add(a)
                state.claimed["b"].add(b)
            for a, reason in paired.left_a:
                if reason:  # else: no role known, left to the name match
                    state.claimed["a"].add(a)
                    state.out.leftovers.append(_leftover("a", a, reason, state.original))
            for b, reason in paired.left_b:
                if reason and b not in state.claimed["b"]:
                    state.claimed["b"].add(b)
                    state.out.leftovers.append(Leftover(side="B", name=b, reason=reason))

    def _input_counterpart(self, module: str, modules: Mapping[str, str]) -> str | None:
        """The module of B whose inputs A's ``module``'s inputs pair with: the bridge's module
        pair (``modules``), else the same name unless the two classes are known to compute
        different quantities (not comparable, by name)."""
        if module in modules:
            return modules[module]
        class_a, class_b = self.classes_a.get(module), self.classes_b.get(module)
        if known_different(_bare(class_a or ""), _bare(class_b or "")):
            return None
        return module

    def _identities(
        self, out: Matched, anchored: list[tuple[int, BridgedPair]], names_a: list[str], names_b: list[str]
    ) -> None:
        """A leftover that is an identity at inference (a ``Dropout``) or HF's ``last_hidden_state``
        holds the tensor captured just before it on its side (its input; the final norm's
        output): compared with that tensor's counterpart, bridged as ``identity``."""
        for side, names in (("A", names_a), ("B", names_b)):
            partner: dict[str, tuple[int, Expr]] = {}
            for position, pair in anchored:
                own, theirs = (pair.a, pair.b) if side == "A" else (pair.b, pair.a)
                if own.op is None and pair.classes is None:
                    partner.setdefault(own.names[0], (position, theirs))
            kept = []
            for leftover in out.leftovers:
                plain = leftover.side == side and leftover.reason in PLAIN_REASONS  # not skipped by a rule
                source = self._identity_source(side, leftover, names) if plain else None
                found = partner.get(source) if source is not None else None
                if found is None:
                    kept.append(leftover)
                    continue
                position, other = found
                mine = Expr(names=(leftover.name,))
                a, b = (mine, other) if side == "A" else (other, mine)
                pair = BridgedPair(a=a, b=b, how="identity", rule=f"returns {source}", paired_by="structure")
                anchored.append((position, pair))
            out.leftovers = kept
        anchored.sort(key=lambda item: item[0])

    def _identity_source(self, side: str, leftover: Leftover, names: list[str]) -> str | None:
        try:
            key = Key.parse(leftover.name)
        except ValueError:
            return None
        qualname = self.class_of(side.lower(), leftover.name) or ""
        if not (IDENTITY_CLASSES.fullmatch(qualname) and not key.path) and key.path != "[last_hidden_state]":
            return None
        if key.input or leftover.name not in names:
            return None
        for name in reversed(names[: names.index(leftover.name)]):
            try:
                before = Key.parse(name)
            except ValueError:
                continue
            if not before.input and not re.fullmatch(r"\[[1-9]\d*\]", before.path):
                return name
        return None

    def _bridge_note(self, pair: BridgedPair) -> str | None:
        """What the bridge saw of a pair's module (its weights held nowhere on the other side)."""
        if self.bridge is None or not self.bridge.notes:
            return None
        notes = {(side, module): note for side, module, note in self.bridge.notes}
        for side, expr in (("A", pair.a), ("B", pair.b)):
            try:
                module = Key.parse(expr.names[0]).module
            except ValueError:
                continue
            if (side, module) in notes:
                return notes[(side, module)]
        return None

    def _anchor(
        self,
        side: str,
        name: str,
        have: dict[str, set[str]],
        state: _Matching,
    ) -> None:
        assert self.bridge is not None
        first_reason: str | None = None
        for rule in self.bridge.rules:
            if rule.side != side:
                continue
            if rule.op == "unwrap":
                applied = _apply_unwrap(rule, name, have)
                if applied is None:
                    continue
            else:
                found = rule.match.fullmatch(name)
                if found is None:
                    continue
                applied = _apply(rule, found, have)
            if isinstance(applied, str):
                first_reason = first_reason or applied
                continue
            names_a, names_b, pairs = applied
            state.claimed["a"].update(names_a)
            state.claimed["b"].update(names_b)
            if not pairs:  # skip, or a tuple element unwrap does not keep
                reason = rule.reason or f"element of an (out, bias) tuple that {rule.title} does not keep"
                skipped = f"skipped by {rule.title}: {reason}"
                state.out.leftovers.append(_leftover(side, name, skipped, state.original))
                return
            position = min((state.order[n] for n in names_a if n in state.order), default=len(state.order))
            for pair in pairs:
                a = replace(pair.a, names=tuple(state.original.get(n, n) for n in pair.a.names))
                note = self._bridge_note(pair)
                state.anchored.append((position, replace(pair, a=a, paired_by=rule.paired_by, note=note)))
            return
        if first_reason is not None:
            state.claimed[side].add(name)
            state.out.leftovers.append(_leftover(side, name, first_reason, state.original))


@dataclass
class _Matching:
    """What one match builds as its rules and the input pairing claim names (the same objects
    :meth:`Matcher._match` goes on with): the names claimed per side, the result, the
    anchored pairs, A's order, and A's original name of each mapped one."""

    claimed: dict[str, set[str]]
    out: Matched
    anchored: list[tuple[int, BridgedPair]]
    order: dict[str, int]
    original: dict[str, str]


def _input_calls(names: Iterable[str]) -> dict[tuple[str, int], list[str]]:
    """(module, call) -> the input names of that call, in order."""
    out: dict[tuple[str, int], list[str]] = {}
    for name in names:
        if is_input(name):
            key = Key.parse(name)
            out.setdefault((key.module, key.call), []).append(name)
    return out


def _leftover(side: str, name: str, reason: str, original: Mapping[str, str]) -> Leftover:
    if side == "a":
        return Leftover(side="A", name=original.get(name, name), reason=reason, mapped=name)
    return Leftover(side="B", name=name, reason=reason)


_ELEMENT = re.compile(r"\[(\d+)\]")


def _apply_unwrap(
    rule: Rule, name: str, have: dict[str, set[str]]
) -> tuple[list[str], list[str], list[BridgedPair]] | str | None:
    """``unwrap``: ``match`` is tried on the module part of a tuple element's key (``o_proj`` of
    ``o_proj[0]``); element ``index`` pairs with the counterpart module (``{0}`` by default) plus
    the rest of the path and call suffix, the other elements are skipped. None: no match."""
    try:
        key = Key.parse(name)
    except ValueError:
        return None
    element = _ELEMENT.match(key.path)
    found = rule.match.fullmatch(key.module) if element and not key.input else None
    if found is None or element is None:
        return None
    own = "a" if rule.side == "a" else "b"
    other = "b" if own == "a" else "a"
    if int(element.group(1)) != rule.index:
        return ([name], [], []) if own == "a" else ([], [name], [])  # another element: skipped
    module = rule.templates(other)[0].fill(found)
    if module is None:
        return f"{rule.title}: {rule.templates(other)[0].text!r} has no value for {key.module!r}"
    counterpart = Key(module, key.path[element.end() :], False, key.call).format()
    if counterpart not in have[other]:
        return f"{rule.title}: {other.upper()} has no {counterpart}"
    pair = _unwrap(rule, name, counterpart) if own == "a" else _unwrap(rule, counterpart, name)
    return ([name], [counterpart], [pair]) if own == "a" else ([counterpart], [name], [pair])


def _names(pair: BridgedPair) -> tuple[str, ...]:
    return (*pair.a.names, *pair.b.names)


def _apply(
    rule: Rule, found: re.Match[str], have: dict[str, set[str]]
) -> tuple[list[str], list[str], list[BridgedPair]] | str:
    """The pairs one rule makes of one matched name, or why it cannot apply (a name it needs is
    not there)."""
    filled: dict[str, list[str]] = {}
    for side in ("a", "b"):
        names = []
        for template in rule.templates(side):
            name = template.fill(found)
            if name is None:
                return f"{rule.title}: {template.text!r} has no value for {found.group(0)!r}"
            if name not in have[side]:
                return f"{rule.title}: {side.upper()} has no {name}"
            names.append(name)
        filled[side] = names
    a, b = filled["a"], filled["b"]
    if rule.op == "skip":  # claims the name it lists; its other names are conditions, left free
        anchor = [found.group(0)]
        return (anchor, [], []) if rule.side == "a" else ([], anchor, [])
    how = rule.op if rule.op != "split" else f"split {rule.dim}"
    if rule.op == "unwrap":
        return a, b, [_unwrap(rule, a[0], b[0])]
    if rule.op == "rename":
        return a, b, [BridgedPair(a=Expr(names=(a[0],)), b=Expr(names=(b[0],)), how=how, rule=rule.title)]
    if rule.op == "split":
        return a, b, [BridgedPair(a=x, b=y, how=how, rule=rule.title) for x, y in _split_later(rule, a, b)]
    op = rule.op
    expr_a = Expr(names=tuple(a), op=op if len(a) > 1 else None, dim=rule.dim)
    expr_b = Expr(names=tuple(b), op=op if len(b) > 1 else None, dim=rule.dim)
    return a, b, [BridgedPair(a=expr_a, b=expr_b, how=how, rule=rule.title)]


def _unwrap(rule: Rule, a: str, b: str) -> BridgedPair:
    return BridgedPair(a=Expr(names=(a,)), b=Expr(names=(b,)), how=f"unwrap [{rule.index}]", rule=rule.title)


def _split_later(rule: Rule, a: list[str], b: list[str]) -> list[tuple[Expr, Expr]]:
    """Split pairs whose pieces are sized later, from the pieces' shapes (:func:`size_splits`):
    marked with an open piece ``(-1, k)``, k the piece's ordinal."""
    if len(a) == 1:
        return [
            (Expr(names=(a[0],), op="split", dim=rule.dim, piece=(-1, k)), Expr(names=(name,)))
            for k, name in enumerate(b)
        ]
    return [
        (Expr(names=(name,)), Expr(names=(b[0],), op="split", dim=rule.dim, piece=(-1, k)))
        for k, name in enumerate(a)
    ]


def size_splits(
    pairs: list[BridgedPair], entries_a: Mapping[str, SideEntry], entries_b: Mapping[str, SideEntry]
) -> list[BridgedPair]:
    """Give every split piece its bounds: the counterpart pieces' sizes along the split dim, in order.
    A piece whose counterpart's shape is unknown keeps an empty bound (reported as an error)."""
    offsets: dict[tuple[str, str, int], int] = {}
    out = []
    for pair in pairs:
        for which, fused, other, entries in (
            ("a", pair.a, pair.b, entries_b),
            ("b", pair.b, pair.a, entries_a),
        ):
            if fused.op != "split" or fused.piece is None or fused.piece[0] != -1:
                continue
            entry = entries.get(other.names[0])
            shape = entry.meta.shape if entry is not None else None
            key = (which, fused.names[0], fused.dim)
            start = offsets.get(key, 0)
            size = shape[fused.dim] if shape and -len(shape) <= fused.dim < len(shape) else 0
            offsets[key] = start + size
            sized = replace(fused, piece=(start, start + size))
            pair = replace(pair, **{which: sized})
        out.append(pair)
    return [_with_whole(pair, offsets) for pair in out]


def _with_whole(pair: BridgedPair, offsets: dict[tuple[str, str, int], int]) -> BridgedPair:
    """Each split piece knows what its pieces add up to: a fused tensor of another size is an
    error, never a silently dropped remainder."""
    for which in ("a", "b"):
        fused: Expr = getattr(pair, which)
        if fused.op == "split":
            pair = replace(
                pair, **{which: replace(fused, whole=offsets.get((which, fused.names[0], fused.dim)))}
            )
    return pair


def matcher_for(options: DiffOptions, side_a: Side, side_b: Side) -> Matcher:
    """The matcher of one diff: the bridge chosen for its two manifests (or ``--bridge``), with
    both sides' module classes, and the alignment when the user gave none: the bridge's, else
    ``tokens`` when a side was dumped by an engine integration (the vLLM plugin's
    ``set_batch`` in every step), else passes."""
    info_a, info_b = side_info(side_a), side_info(side_b)
    bridge, line = select_bridge(options.bridge, info_a, info_b, mapped=bool(options.maps))
    align = bridge.align if bridge is not None else None
    if align is None and (info_a.integration or info_b.integration):
        align = "tokens"  # an engine integration batches requests and records each step's layout
    unshard: tuple[UnshardRule, ...] = ()
    for info in (info_a, info_b):  # a tensor-parallel side joined as its ranks' loads say
        unshard += tensor_parallel_joins(list(info.ranks), info.classes)
    findings: dict[str, str] = {}
    held: dict[str, str] = {}
    if info_a.record is not None and info_b.record is not None:
        findings = weight_findings(info_a.record, info_b.record)
        if options.maps:  # the user's renames, checked against what the weights say
            held = weight_pairs(info_a.record, info_b.record)
    return Matcher(
        bridge=bridge,
        classes_a=info_a.classes,
        classes_b=info_b.classes,
        line=line,
        align=align,
        unshard=unshard,
        inputs_by_role=bridge is not None,  # two module trees: their calls take other arguments
        findings=findings,
        weight_pairs=held,
    )


def ambiguous_modules(matcher: Matcher) -> list[dict[str, Any]]:
    """The modules no evidence paired (their weights held by several modules of the other side, no
    structure telling which), for the report: side, module, candidates."""
    if matcher.bridge is None:
        return []
    return [
        {"side": side, "module": module, "candidates": list(candidates)}
        for side, module, candidates in matcher.bridge.ambiguous
    ]


def map_contradiction(module_a: str, module_b: str, held: str) -> str:
    """The note on a pair ``--map`` made against the recorded weights."""
    return (
        f"--map pairs {module_a} with {module_b}, but its weights are {held}'s: "
        "the rule contradicts the recorded weights"
    )


def _refuse_map_collisions(mapped: Mapping[str, str], names_b: set[str], options: DiffOptions) -> None:
    """Several names of A that ``--map`` turns into one name of B would all be compared with the
    same tensor: an error naming them, before any verdict."""
    sources: dict[str, list[str]] = {}
    for name, target in mapped.items():
        if target in names_b and options.selected(name, target):
            sources.setdefault(target, []).append(name)
    clashes = [
        f"{', '.join(map(repr, names))} -> {target!r}" for target, names in sources.items() if len(names) > 1
    ]
    if not clashes:
        return
    more = f" (and {len(clashes) - 5} more)" if len(clashes) > 5 else ""
    raise UsageError(
        f"--map turns several names of A into one name of B: {'; '.join(clashes[:5])}{more}; "
        "each name of B can be compared with one name of A only"
    )
