"""The pairing table: which tensors of two module trees are one computation, as typed rows.

One :class:`Bridge` holds the rows of a diff, whoever wrote them: a rule file (``--bridge FILE``,
``tracedump/bridges/*.toml``, read by :mod:`.bridge_rules`) or the evidence of the two runs'
``correspondence.json`` (:mod:`.correspondence`, built here directly, never as rule text read
back). :mod:`.matcher` applies both the same way.

A row (:class:`Rule`) says which names of one side it claims (:attr:`Rule.match`), their
counterparts (:attr:`Rule.a`, :attr:`Rule.b`), how they relate (``op``: rename, unwrap at an
index, split at offsets, concat, sum, product, skip with a reason), what proves it
(:attr:`Rule.paired_by`) and the evidence in words (:attr:`Rule.id`). A rule file's row matches
names by its regex; a derived row by :class:`Tensors`: one module's tensors picked by
:class:`Part` (its output, an element of its tuple, its inputs, its submodules).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from enum import Enum

OPS = ("rename", "unwrap", "split", "concat", "sum", "product", "skip")
PLACEHOLDER = re.compile(r"\{(\d+)(?:([+-])(\d+))?\}")


# ------------------------------------------------------------------ templates


@dataclass(frozen=True)
class Template:
    """A name with ``{N}`` / ``{N+k}`` / ``{N-k}`` placeholders for the match's groups (a derived
    row's names are plain names, or ``{0}`` for the name matched)."""

    text: str

    def groups(self) -> list[int]:
        return [int(m.group(1)) for m in PLACEHOLDER.finditer(self.text)]

    def fill(self, match: re.Match[str]) -> str | None:
        """The name for this match; None when ``{N±k}`` meets a group that is not an integer, or
        the result is a negative index (layer 0 has no layer -1)."""
        failed = False

        def one(m: re.Match[str]) -> str:
            nonlocal failed
            value = match.group(int(m.group(1))) or ""
            if m.group(2) is None:
                return value
            if not value.isdigit():
                failed = True
                return ""
            number = int(value) + (int(m.group(3)) if m.group(2) == "+" else -int(m.group(3)))
            failed = failed or number < 0
            return str(number)

        text = PLACEHOLDER.sub(one, self.text)
        return None if failed else text


# ------------------------------------------------------------------ a derived row's names


class Part(Enum):
    """Which of one tensor name's keys a derived row claims (the name is a module's output, or a
    tensor recorded beside it). ``ELEMENT`` captures the element's index as the match's group 1,
    for a counterpart ``NAME[{1}]``."""

    ITSELF = ""  # the name exactly
    FIRST = r"\[0\]"  # its tuple's element 0
    SECOND = r"\[1\]"  # its tuple's element 1
    FIRST_TWO = r"\[[01]\]"  # element 0 or 1: a (hidden, residual) pair
    ELEMENT = r"\[(\d+)\]"  # any element, its index captured
    LATER = r"\[[1-9]\d*\]"  # any element after the first: extra outputs
    ITSELF_OR_ELEMENT = r"(\[\d+\])?"
    ITSELF_OR_FIELD = r"(\[\w+\])?"  # also a named field ([last_hidden_state])
    ANY_CALL = r"(\[\w+\])?(::call\d+)?"  # also every later call of a shared module
    SUBTREE = r"(\..*)?(\[\d+\])?(::call\d+)?"  # the module and every module below it
    INPUTS = r"@in(\[.*\])?(::call\d+)?"  # every input of every call


@dataclass(frozen=True)
class Tensors:
    """A derived row's names: ``name``'s keys picked by ``part``. Matched as a rule file's regex is
    (``fullmatch`` returns the match its templates fill), so one matcher applies both."""

    name: str
    part: Part = Part.ITSELF
    _regex: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_regex", re.compile(re.escape(self.name) + self.part.value))

    def fullmatch(self, name: str) -> re.Match[str] | None:
        return self._regex.fullmatch(name)

    @property
    def pattern(self) -> str:
        """The names it claims, written as a regex (for a message; nothing parses it)."""
        return self._regex.pattern

    @property
    def groups(self) -> int:
        return self._regex.groups


# ------------------------------------------------------------------ rows and tables


@dataclass(frozen=True, kw_only=True)
class Rule:
    """One row of a pairing table (docs/engines.md for a rule file's spelling of it)."""

    number: int  # 1-based, in table order: what messages call it
    op: str
    side: str  # "a" or "b": whose names `match` is tried on
    match: re.Pattern[str] | Tensors
    a: tuple[Template, ...]
    b: tuple[Template, ...]
    dim: int = -1
    index: int = 0  # unwrap: the tuple element kept
    reason: str = ""
    id: str = ""  # a rule file's name for it; a derived row's evidence in words
    paired_by: str = "rule"  # what proves its pairs: a rule file's say-so, or a derived row's evidence

    @property
    def title(self) -> str:
        return f"rule {self.number}: {self.id}" if self.id else f"rule {self.number}"

    def templates(self, side: str) -> tuple[Template, ...]:
        return self.a if side == "a" else self.b


def row(
    op: str,
    match: Tensors,
    *,
    side: str = "a",
    a: str | list[str] | None = None,
    b: str | list[str] | None = None,
    dim: int = -1,
    index: int = 0,
    reason: str = "",
    id: str = "",
    paired_by: str = "rule",
) -> Rule:
    """A derived row, numbered later (:func:`numbered`): its own side's names default to the name
    matched (``{0}``), as a rule file's do; ``unwrap`` pairs it with the same name by default."""

    def names(value: str | list[str] | None, default: tuple[str, ...]) -> tuple[Template, ...]:
        given = default if value is None else (value,) if isinstance(value, str) else tuple(value)
        return tuple(Template(text) for text in given)

    default_other: tuple[str, ...] = ("{0}",) if op == "unwrap" else ()
    return Rule(
        number=0,
        op=op,
        side=side,
        match=match,
        a=names(a, ("{0}",) if side == "a" else default_other),
        b=names(b, ("{0}",) if side == "b" else default_other),
        dim=dim,
        index=index,
        reason=reason,
        id=id,
        paired_by=paired_by,
    )


def skip_pair(module: str, counterpart: str, *, reason: str, id: str) -> list[Rule]:
    """Both sides of a module pair listed, never compared, for one reason: A's module (itself or
    its tuple's elements) and B's counterpart (itself or its output's fields)."""
    return [
        row("skip", Tensors(module, Part.ITSELF_OR_ELEMENT), reason=reason, id=id),
        row("skip", Tensors(counterpart, Part.ITSELF_OR_FIELD), side="b", reason=reason, id=id),
    ]


def numbered(rules: list[Rule] | tuple[Rule, ...]) -> tuple[Rule, ...]:
    """The rows numbered 1.. in table order (what the table's bridge column calls them)."""
    return tuple(replace(rule, number=i) for i, rule in enumerate(rules, 1))


@dataclass(frozen=True, kw_only=True)
class Bridge:
    """A pairing table: which frameworks it joins, for which architectures, and its rows, tried in
    order for each name."""

    name: str
    source: str  # the file it came from, "built-in NAME", or "correspondence.json"
    a: str | None
    b: str | None
    architectures: tuple[re.Pattern[str], ...]
    align: str | None
    rules: tuple[Rule, ...]
    description: str = ""
    # (module of a, module of b) that compute the same thing (a derived table's, paired by their
    # weights): whose inputs pair (compare/pair/input_roles.py); a rule file names none
    modules: tuple[tuple[str, str], ...] = ()
    # (side "A" or "B" of the diff, module, its candidates on the other side): a derived table's
    # modules whose weights several modules hold, no structure telling which
    ambiguous: tuple[tuple[str, str, tuple[str, ...]], ...] = ()
    # (side "A" or "B" of the diff, module, what the pairing saw of it): rows of its pairs carry it
    notes: tuple[tuple[str, str, str], ...] = ()
    # (module of a, module of b) holding the same checkpoint tensors, each side's only holder (no
    # pair placed by structure): what the records prove, the evidence a --map rename is checked
    # against where a side recorded its load
    proven: tuple[tuple[str, str], ...] = ()

    @property
    def module_pairs(self) -> dict[str, str]:
        """A's module -> B's, the first pair of each module of A."""
        out: dict[str, str] = {}
        for a, b in self.modules:
            out.setdefault(a, b)
        return out

    def swapped(self) -> Bridge:
        """The same table for a diff whose A is this table's b (``tracedump diff HF VLLM``)."""
        rules = tuple(replace(r, side="b" if r.side == "a" else "a", a=r.b, b=r.a) for r in self.rules)
        modules = tuple((b, a) for a, b in self.modules)
        proven = tuple((b, a) for a, b in self.proven)
        return replace(self, a=self.b, b=self.a, rules=rules, modules=modules, proven=proven)

    @property
    def proven_pairs(self) -> dict[str, str]:
        """A's module -> B's, for the modules the records prove are one (:attr:`proven`)."""
        return dict(self.proven)
