"""Which modules get hooks: leaves or all, narrowed by a regex list or a predicate."""

from __future__ import annotations

import re
from collections.abc import Callable

from torch import nn

from ..config.settings import DumpSettings
from ..config.switch import DEFAULT_ENV_PREFIX
from ..errors import ConfigError
from .runtime import warn_once
from .torch_compat import registered_children

ROOT_NAME = "root"
Predicate = Callable[[str, nn.Module], bool]


def display_name(name: str) -> str:
    """The key prefix of a module: its dotted name, and ``root`` for the model itself."""
    return name or ROOT_NAME


def candidate_modules(model: nn.Module, modules: str) -> list[tuple[str, nn.Module]]:
    """Leaves (modules without children) or every submodule. The root counts only as a leaf."""
    named = list(model.named_modules())
    if modules == "all":
        chosen = [(n, m) for n, m in named if n] or named[:1]
    else:
        chosen = [(n, m) for n, m in named if next(iter(m.children()), None) is None]
    return [(display_name(n), m) for n, m in chosen]


def regex_predicate(patterns: list[str]) -> Predicate:
    """A module is selected when any pattern ``re.search``-es its dotted name (FILTER, capture's
    ``filter``). Raises ``re.error`` for a bad pattern."""
    compiled = [re.compile(p) for p in patterns]
    return lambda name, _module: any(p.search(name) for p in compiled)


def build_predicate(settings: DumpSettings) -> Predicate | None:
    """One predicate from FILTER or FILTER_FN."""
    if settings.filter is not None:
        return regex_predicate(settings.filter)
    return settings.resolve_callables().filter_fn  # imported once per settings, at attach()


def _ask(predicate: Predicate, name: str, module: nn.Module, settings: DumpSettings) -> bool:
    """Call the user's predicate; one that raises (or takes other arguments) is a bad setting,
    reported at ``attach()`` with the value that named it, before any hook exists."""
    try:
        return bool(predicate(name, module))
    except Exception as e:
        field = "filter_fn" if settings.filter_fn is not None else "filter"
        where = settings.describe(field)
        raise ConfigError(
            f"tracedump: bad setting\n  {where}: the predicate failed on module {name!r}: "
            f"{type(e).__name__}: {e} (it must take (name, module) and return a bool)"
        ) from e


def select_modules(
    model: nn.Module,
    settings: DumpSettings,
    env_prefix: str = DEFAULT_ENV_PREFIX,
    names: dict[str, nn.Module] | None = None,
) -> list[tuple[str, nn.Module]]:
    r"""The (name, module) pairs to hook, in registration order; warns when a filter matches none.

    A module with several names (``names``: :func:`every_name`) is selected when the filter takes
    any of them: ``FILTER=layers\.2\.`` selects vLLM's shared rotary embedding, whose first name is
    layer 0's (its calls under the other names are dropped by :func:`kept_names`)."""
    candidates = candidate_modules(model, settings.modules)
    predicate = build_predicate(settings)
    if predicate is None:
        return candidates
    aliases = _names_by_module(names or {})
    selected = [
        (n, m)
        for n, m in candidates
        if _ask(predicate, n, m, settings)
        or any(_ask(predicate, a, m, settings) for a in aliases.get(id(m), ()) if a != n)
    ]
    if not selected:
        sample = ", ".join(n for n, _ in candidates[:12])
        warn_once(
            f"empty_selection_{id(model)}",
            f"tracedump: the filter selects no module of {type(model).__name__} "
            f"(modules={settings.modules}); some names: {sample}",
        )
    return selected


MAX_NAMES = 100_000  # names walked for shared modules; a tree with more (sharing gone wild) gets none


def every_name(model: nn.Module) -> dict[str, nn.Module]:
    """Every dotted name of every submodule, a module held by several parents once per path
    (``named_modules(remove_duplicate=False)``: vLLM's one rotary embedding under each layer's
    attention), in that order. A child that is already on its own path (a cycle) is not walked
    again, and past :data:`MAX_NAMES` names the walk stops and only the first name of each module
    is given (``named_modules()``): a bound for attach(), never an error."""
    names: dict[str, nn.Module] = {}
    stack: list[tuple[str, nn.Module, frozenset[int]]] = [("", model, frozenset({id(model)}))]
    while stack:
        prefix, module, on_path = stack.pop()
        names[prefix] = module
        if len(names) > MAX_NAMES:
            return dict(model.named_modules())
        children = [(n, c) for n, c in registered_children(module) if id(c) not in on_path]
        for child_name, child in reversed(children):  # popped in registration order: torch's DFS
            stack.append((f"{prefix}.{child_name}" if prefix else child_name, child, on_path | {id(child)}))
    return names


def _names_by_module(names: dict[str, nn.Module]) -> dict[int, list[str]]:
    by_module: dict[int, list[str]] = {}
    for name, module in names.items():
        by_module.setdefault(id(module), []).append(display_name(name))
    return by_module


def kept_names(
    settings: DumpSettings, shared: dict[str, list[str]], selected: list[tuple[str, nn.Module]]
) -> dict[str, frozenset[str]] | None:
    """With a filter: the names of each shared module whose calls are kept (those the filter
    takes); None without one (every call is kept)."""
    predicate = build_predicate(settings)
    if predicate is None or not shared:
        return None
    modules = dict(selected)
    return {
        name: frozenset(a for a in aliases if _ask(predicate, a, modules[name], settings))
        for name, aliases in shared.items()
    }


def shared_names(names: dict[str, nn.Module], selected: list[tuple[str, nn.Module]]) -> dict[str, list[str]]:
    """Each selected module that has several names -> all of them, its selected name first."""
    by_module = _names_by_module(names)
    shared = {}
    for name, module in selected:
        aliases = by_module.get(id(module), [])
        if len(aliases) > 1:
            shared[name] = [name, *(alias for alias in aliases if alias != name)]
    return shared
