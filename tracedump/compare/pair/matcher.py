"""The matcher: which tensors of two different module trees compare, and how, from one pairing
table (:mod:`.table`) and the names.

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
from typing import Any

from ...errors import UsageError
from ...store.format import Key
from ..options import DiffOptions, UnshardRule
from .apply_rules import apply_rule, apply_unwrap
from .engine_classes import IDENTITY, bare
from .expr import BridgedPair, Expr
from .input_roles import Role, input_role, is_input, pair_inputs
from .table import Bridge, Rule
from .unshard import SideEntry
from .weight_evidence import map_contradiction


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


@dataclass(frozen=True, kw_only=True)
class Matcher:
    """Matches two sides' names for one diff: the bridge (if any), then names, with the class
    check. Built once per diff (:func:`.bridge.matcher_for`); :meth:`match` runs per pass."""

    bridge: Bridge | None
    classes_a: Mapping[str, str]
    classes_b: Mapping[str, str]
    line: str = ""
    align: str | None = None  # the alignment to use when the user gave none (:func:`.bridge.matcher_for`)
    unshard: tuple[UnshardRule, ...] = ()  # tensor-parallel joins derived from the ranks' loads
    # module (one name on both sides) -> what its recorded weights say against B's
    # (:func:`.weight_evidence.weight_findings`)
    findings: Mapping[str, str] = field(default_factory=dict)
    # A's module -> B's, by parameters of unique values: what --map renames are checked against
    weight_pairs: Mapping[str, str] = field(default_factory=dict)
    pairs_from_load: bool = False  # weight_pairs is what a side's load record proves
    rules_from_file: bool = False  # the bridge is the user's --bridge file: its pairs are checked too
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
        return bare(found) if found else None

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
            module_a = Key.parse(name).module
        except ValueError:
            module_a = ""
        if mapped == name and module_a in self.findings:
            notes.append(self.findings[module_a])
        contradiction = self._map_contradiction(name, mapped, mapped)
        if contradiction is not None:
            notes.append(contradiction)
        return BridgedPair(
            a=Expr(names=(name,)),
            b=Expr(names=(mapped,)),
            how=None,
            paired_by="name" if mapped == name else "map",
            note="; ".join(notes) or None,
        )

    def _map_contradiction(self, name: str, mapped: str, name_b: str) -> str | None:
        """What the weights or the load record say against ``--map`` turning A's ``name`` into
        ``mapped``, which was paired with B's ``name_b``: None when the map left the name alone, or
        the evidence pairs A's module with ``name_b``'s (or with none)."""
        if mapped == name:
            return None
        try:
            module_a, module_b = Key.parse(name).module, Key.parse(name_b).module
        except ValueError:
            return None
        held = self.weight_pairs.get(module_a)
        if held is None or held == module_b:
            return None
        return map_contradiction(module_a, module_b, held, loaded=self.pairs_from_load)

    def _rule_contradiction(self, pair: BridgedPair, rule: Rule) -> str | None:
        """What the weights or the load record say against a ``--bridge`` file's rule pairing A's
        module with B's: None unless the evidence pairs A's module with a module none of the
        pair's B tensors belong to (a fused tensor split into pieces of several B modules is
        checked against each)."""
        if not pair.a.names or not pair.b.names:
            return None
        try:
            module_a = Key.parse(pair.a.names[0]).module
            modules_b = {Key.parse(name).module for name in pair.b.names}
        except ValueError:
            return None
        held = self.weight_pairs.get(module_a)
        if held is None or held in modules_b:
            return None
        shown = min(modules_b)
        return map_contradiction(
            module_a, shown, held, loaded=self.pairs_from_load, rule=f"--bridge {rule.title}"
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
        if known_different(bare(class_a or ""), bare(class_b or "")):
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
        if not (IDENTITY.fullmatch(qualname) and not key.path) and key.path != "[last_hidden_state]":
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
                applied = apply_unwrap(rule, name, have)
                if applied is None:
                    continue
            else:
                found = rule.match.fullmatch(name)
                if found is None:
                    continue
                applied = apply_rule(rule, found, have)
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
                state.anchored.append((position, self._anchored(pair, rule, state.original)))
            return
        if first_reason is not None:
            state.claimed[side].add(name)
            state.out.leftovers.append(_leftover(side, name, first_reason, state.original))

    def _anchored(self, pair: BridgedPair, rule: Rule, original: Mapping[str, str]) -> BridgedPair:
        """A pair a row made, under A's own names. Where ``--map`` renamed A's names first, the
        row's evidence is of the mapped names' modules, not A's: a derived row's pair is the map's
        (a rule file's stays its own), checked against what the weights or the load prove."""
        a = replace(pair.a, names=tuple(original.get(n, n) for n in pair.a.names))
        notes = [self._bridge_note(pair)]
        paired_by = rule.paired_by
        renamed = [(original[n], n) for n in pair.a.names if original.get(n, n) != n]
        if renamed and pair.b.names:
            paired_by = paired_by if paired_by == "rule" else "map"
            notes += [self._map_contradiction(name, mapped, pair.b.names[0]) for name, mapped in renamed]
        elif self.rules_from_file and rule.paired_by == "rule":
            notes.append(self._rule_contradiction(pair, rule))
        note = "; ".join(dict.fromkeys(n for n in notes if n)) or None
        return replace(pair, a=a, paired_by=paired_by, note=note)


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


def _names(pair: BridgedPair) -> tuple[str, ...]:
    return (*pair.a.names, *pair.b.names)


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
