"""What the user asked ``tracedump diff`` for, parsed and validated once, before any file is read.

Bad input (a regex that does not compile, ``--unshard`` with an unknown op) raises :class:`UsageError`,
which the command turns into exit code 2 with the message: a typo should not cost a 10 GB read.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from ..errors import UsageError
from ..util import rules
from ..util.ranges import IndexRanges
from .pair.bridge_rules import Bridge, load_bridge

Metric = Literal["rel_diff", "max_abs", "cosine"]
METRICS: tuple[Metric, ...] = ("rel_diff", "max_abs", "cosine")


def split_rule(text: str, option: str) -> tuple[str, str]:
    """``PATTERN=VALUE`` split as every rule of the package is (:func:`tracedump.util.rules.split_rule`),
    a bad one a usage error naming ``option``."""
    try:
        return rules.split_rule(text)
    except ValueError:
        raise UsageError(f"{option} {text!r}: expected 'PATTERN=VALUE'") from None


def compile_regex(pattern: str, option: str) -> re.Pattern[str]:
    try:
        return re.compile(pattern)
    except (re.error, RecursionError, OverflowError) as e:  # '[' * 100000 recurses in the parser
        raise UsageError(f"{option} {pattern[:80]!r}: invalid regex: {type(e).__name__}: {e}") from None


@dataclass(frozen=True)
class NameMap:
    """One ``--map PATTERN=REPL`` rule: ``re.sub`` on the names of A (the run under test)."""

    pattern: re.Pattern[str]
    replacement: str

    @classmethod
    def parse(cls, text: str) -> NameMap:
        pattern, replacement = split_rule(text, "--map")
        rule = cls(compile_regex(pattern, "--map"), replacement)
        try:
            rules.check_replacement(rule.pattern, replacement)
        except ValueError as e:
            raise UsageError(f"--map {rule}: {e}") from e
        return rule

    def apply(self, name: str) -> str:
        return self.pattern.sub(self.replacement, name)

    def __str__(self) -> str:
        return f"{self.pattern.pattern}={self.replacement}"


@dataclass(frozen=True)
class UnshardRule:
    """One ``--unshard REGEX=cat:DIM`` or ``REGEX=sum`` rule for tensor-parallel ranks."""

    pattern: re.Pattern[str]
    op: Literal["cat", "sum", "gather", "first"]
    dim: int | None = None
    # gather (derived from the ranks' weight loads, never parsed): (rank, start, stop) along dim,
    # in the order the pieces are concatenated; first: rank 0's tensor (the others hold none)
    pieces: tuple[tuple[int, int, int], ...] = ()
    # a join derived from the ranks' load records: what they say of the layout, in words (a hand
    # rule that joins the same tensor otherwise is reported with it)
    recorded: str = field(default="", compare=False)

    @classmethod
    def parse(cls, text: str) -> UnshardRule:
        pattern, spec = split_rule(text, "--unshard")
        regex = compile_regex(pattern, "--unshard")
        spec = spec.strip().lower()
        if spec == "sum":
            return cls(regex, "sum")
        match = re.fullmatch(r"cat:(-?\d+)", spec)
        if not match:
            raise UsageError(f"--unshard {text!r}: expected 'REGEX=cat:DIM' or 'REGEX=sum', got {spec!r}")
        return cls(regex, "cat", int(match.group(1)))

    def matches(self, name: str) -> bool:
        return self.pattern.search(name) is not None

    def __str__(self) -> str:
        return f"{self.pattern.pattern}={self.op}" + (f":{self.dim}" if self.op in ("cat", "gather") else "")


@dataclass(frozen=True)
class ToleranceRule:
    """One ``--rtol REGEX=VALUE`` (or ``--atol``) rule: names where REGEX is found get VALUE."""

    option: str
    pattern: re.Pattern[str]
    value: float

    @classmethod
    def parse(cls, text: str, option: str) -> ToleranceRule:
        pattern, value = split_rule(text, option)
        return cls(option, compile_regex(pattern, option), _non_negative(value, option, text))

    def matches(self, *names: str) -> bool:
        return any(self.pattern.search(n) for n in names)

    def __str__(self) -> str:
        return f"{self.option} {self.pattern.pattern}={self.value:g}"


def _non_negative(text: str, option: str, whole: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value >= 0 or math.isinf(value):
        raise UsageError(f"{option} {whole!r}: expected a non-negative number, got {text!r}")
    return value


def parse_tolerances(values: list[str] | None, option: str) -> tuple[float | None, tuple[ToleranceRule, ...]]:
    """``--rtol 1e-3`` (global) and ``--rtol 'REGEX=VALUE'`` (rules, first match wins), repeatable."""
    global_value: float | None = None
    rules: list[ToleranceRule] = []
    for text in values or []:
        if "=" in text:
            rules.append(ToleranceRule.parse(text, option))
        else:
            global_value = _non_negative(text, option, text)
    return global_value, tuple(rules)


def parse_passes(text: str | None) -> IndexRanges | None:
    """``--pass 3`` or ``--pass 0,2,5-7``, as merged ranges (``ranges[0][0]`` is the first pass
    asked for); None means every pass present in both dumps."""
    if text is None:
        return None
    try:
        selection = IndexRanges.parse(text)
    except ValueError as e:
        raise UsageError(f"--pass {text!r}: {e}") from e
    if not selection.ranges:
        raise UsageError(f"--pass {text!r}: expected a pass index such as 3, or a list such as 0,2,5-7")
    return selection.merged()


@dataclass(frozen=True, kw_only=True)
class DiffOptions:
    """Everything that decides what is compared and how; frozen so no stage can change it."""

    a: Path
    b: Path
    passes: IndexRanges | None = None
    rank: int | None = None
    filter: re.Pattern[str] | None = None
    maps: tuple[NameMap, ...] = ()
    unshard: tuple[UnshardRule, ...] = ()
    metric: Metric = "rel_diff"
    rtol: float | None = None
    atol: float | None = None
    rtol_rules: tuple[ToleranceRule, ...] = ()
    atol_rules: tuple[ToleranceRule, ...] = ()
    baseline: Path | None = None
    align: Literal["passes", "tokens"] = "passes"
    align_given: bool = True  # False: --align was not given, a bridge may choose (compare/pair/bridge.py)
    bridge: Bridge | Literal["none"] | None = None  # --bridge: None chooses by the manifests
    json_path: str | None = None
    plot_path: Path | None = None
    html_path: Path | None = None
    max_rows: int = 500
    progress: bool | None = None  # None: decide from the terminal and the size of the diff
    min_coverage: float | None = None  # --min-coverage: below this fraction of B compared, exit 2

    def __post_init__(self) -> None:
        if self.metric not in METRICS:
            raise UsageError(f"--metric {self.metric!r}: choose from {', '.join(METRICS)}")
        for flag, value in (("--rtol", self.rtol), ("--atol", self.atol)):
            if value is not None and not value >= 0:
                raise UsageError(f"{flag} {value}: expected a non-negative number")
        if self.align not in ("passes", "tokens"):
            raise UsageError(f"--align {self.align!r}: choose passes or tokens")
        if self.rank is not None and self.rank < 0:
            raise UsageError(f"--rank {self.rank}: expected a non-negative rank")
        if self.min_coverage is not None and not 0 <= self.min_coverage <= 1:
            raise UsageError(
                f"--min-coverage {self.min_coverage}: expected a fraction of the reference, "
                "0 to 1 (0.8: 80 %)"
            )

    def map_name(self, name: str) -> str:
        """A's name as the reference would spell it (every ``--map`` rule, in order)."""
        for rule in self.maps:
            name = rule.apply(name)
        return name

    def tolerances_for(self, *names: str) -> tuple[float | None, float | None]:
        """(rtol, atol) the user set for this pair: the first matching rule, else the global value."""
        rtol = next((r.value for r in self.rtol_rules if r.matches(*names)), self.rtol)
        atol = next((r.value for r in self.atol_rules if r.matches(*names)), self.atol)
        return rtol, atol

    def unshard_rule(self, name: str) -> UnshardRule | None:
        """The first ``--unshard`` rule whose regex is found in ``name``."""
        return next((rule for rule in self.unshard if rule.matches(name)), None)

    def selected(self, *names: str) -> bool:
        """``--filter`` keeps a tensor when its regex is found in any of its names (A's or B's)."""
        return self.filter is None or any(self.filter.search(n) for n in names if n is not None)


def parse_options(
    a: str | Path,
    b: str | Path,
    *,
    passes: str | None = None,
    rank: int | None = None,
    filter: str | None = None,
    maps: list[str] | tuple[str, ...] = (),
    unshard: list[str] | tuple[str, ...] = (),
    metric: str = "rel_diff",
    rtol: list[str] | None = None,
    atol: list[str] | None = None,
    baseline: str | Path | None = None,
    align: str | None = "passes",
    bridge: str | Path | None = None,
    json_path: str | None = None,
    plot_path: Path | None = None,
    html_path: Path | None = None,
    max_rows: int = 500,
    progress: bool | None = None,
    min_coverage: float | None = None,
) -> DiffOptions:
    """Every option as the user wrote it, parsed and checked once (the CLI and ``compare()`` both).

    ``json_path``, ``plot_path``, ``html_path``, ``max_rows`` and ``progress`` only change the
    report: where it is written, how many table rows, whether a progress bar shows."""
    rtol_value, rtol_rules = parse_tolerances(rtol, "--rtol")
    atol_value, atol_rules = parse_tolerances(atol, "--atol")
    if baseline is not None and not Path(baseline).exists():
        raise UsageError(f"--baseline {baseline}: no such file or directory")
    chosen_bridge: Bridge | Literal["none"] | None = None
    if bridge is not None and str(bridge).lower() == "none":
        chosen_bridge = "none"
    elif bridge is not None:
        chosen_bridge = load_bridge(bridge)  # a bad rule file fails here, before any dump is read
    return DiffOptions(
        a=Path(a),
        b=Path(b),
        passes=parse_passes(passes),
        rank=rank,
        filter=compile_regex(filter, "--filter") if filter else None,
        maps=tuple(NameMap.parse(text) for text in maps),
        unshard=tuple(UnshardRule.parse(text) for text in unshard),
        metric=metric,  # type: ignore[arg-type]
        rtol=rtol_value,
        atol=atol_value,
        rtol_rules=rtol_rules,
        atol_rules=atol_rules,
        baseline=Path(baseline) if baseline is not None else None,
        align=align or "passes",  # type: ignore[arg-type]
        align_given=align is not None,
        bridge=chosen_bridge,
        json_path=json_path,
        plot_path=plot_path,
        html_path=html_path,
        max_rows=max_rows,
        progress=progress,
        min_coverage=min_coverage,
    )
