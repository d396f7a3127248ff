"""The grafting machinery: pre-hooks that feed each grafted module the reference's captured inputs.

What grafting is, and its honesty rules, is told in :mod:`tracedump.dump.graft` (the public
``graft()`` entry). This module holds the part a :class:`~tracedump.dump.dumper.Dumper` wires in
when ``GRAFT_FROM`` is set: the reference read one pass at a time, the :class:`Grafter` with its
pre-hooks, and the checks made before any hook (no compiled model, no CUDA graph capture, no run
dir inside the reference). It never imports the Dumper: the dumper builds on it, and ``graft()``
on both, so the two never import each other.
"""

from __future__ import annotations

import re
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..config.reference import reference_problem
from ..errors import ConfigError, DumpReadError, GraftFeedRefused
from ..store.correspondence import Correspondence, module_counterparts, read_correspondence
from ..store.format import dtype_name, key_text
from ..util.rules import check_replacement, split_rule
from .cuda import stream_is_capturing
from .graft_feed import KEPT, ZERO, InputFeed, fed_paths
from .hooks import MAX_DEPTH, flatten_inputs, input_prefix
from .recorder import leaf_path
from .selection import display_name
from .shadow import Shadow, fp32_inputs, shadow_applies, upcast
from .torch_compat import compiled_in_place, compiled_original

__all__ = ["LEAVES", "Grafter", "is_compiled", "parse_graft_map", "refuse_unsafe"]

LEAVES = "leaves"  # the default level: every captured leaf
MAX_CALLS_LISTED = 20  # not-grafted calls listed per module in the manifest (all are counted)


def parse_graft_map(rules: Iterable[str]) -> list[tuple[re.Pattern[str], str]]:
    """``PATTERN=REPL`` rules (split at the last ``=``, as ``tracedump diff --map``): how the
    names of the model under test are spelt in the reference."""
    parsed = []
    for rule in rules:
        try:
            pattern, repl = split_rule(rule)
            compiled = re.compile(pattern)
            check_replacement(compiled, repl)
        except (ValueError, re.error) as e:
            raise ConfigError(f"tracedump: bad graft map {rule!r}: {e}") from e
        parsed.append((compiled, repl))
    return parsed


def is_compiled(model: nn.Module) -> bool:
    """``torch.compile(model)`` (an ``OptimizedModule``) or ``model.compile()`` (in place)."""
    return compiled_original(model) is not None or compiled_in_place(model)


def refuse_unsafe(model: nn.Module) -> None:
    """Grafting under torch.compile or CUDA graph capture is refused here, before any hook."""
    if is_compiled(model):
        raise ConfigError(
            "tracedump: grafting refused: the model is torch.compile'd. A compiled graph runs no "
            "pre-hook (the inputs would not be replaced) or bakes the reference's tensors into the "
            "graph. Graft the eager model (tracedump run --no-compile, or the engine's eager flag)."
        )
    if stream_is_capturing():
        raise ConfigError(
            "tracedump: grafting refused during CUDA graph capture: a replay runs no hook, so the "
            "reference's inputs would be captured once and replayed. Disable CUDA graphs while grafting."
        )


# ------------------------------------------------------------------------------------ reference


class _Reference:
    """The reference run, read one pass at a time (memory-mapped; only grafted inputs are read)."""

    def __init__(self, path: Path, rank: int, root: str, where: str) -> None:
        """``where``: the setting that named the reference (``TRACEDUMP_DUMP_GRAFT_FROM='...'``),
        which every refusal names."""
        from ..store.loader import open_dump

        try:
            dump = open_dump(path)
            roots = list(dict.fromkeys(run.root for run in dump.runs))
            chosen = root if root in roots else (roots[0] if len(roots) == 1 else None)
            if chosen is None:
                raise DumpReadError(f"{path}: no run of root {root!r}; roots: {roots}")
            ranks = {run.rank for run in dump.runs if run.root == chosen}
            self.run = dump.run(rank=rank if rank in ranks else None, root=chosen)
            problem = reference_problem(self.run)
        except (DumpReadError, OSError) as e:
            raise ConfigError(f"tracedump: bad setting\n  {where}: bad graft reference: {e}") from e
        if problem is not None:
            raise ConfigError(f"tracedump: bad setting\n  {where}: bad graft reference {path}: {problem}")
        self.path = self.run.path
        self.dump_path = dump.path
        self._index: int | None = None
        self._pass: Any = None
        self._inputs_index: int | None = None
        self._inputs: dict[tuple[str, int], set[str]] = {}

    def pass_file(self, index: int) -> Any:
        """The reference's pass ``index`` (None when it has none); the previous one is closed."""
        if index != self._index:
            if self._pass is not None:
                self._pass.close()
            self._index, self._pass = index, self.run.passes.get(index)
        return self._pass

    def inputs(self, index: int) -> dict[tuple[str, int], set[str]]:
        """(module, call) -> the input paths the reference dumped for it in pass ``index``."""
        if index != self._inputs_index:
            from ..store.format import Key

            found: dict[tuple[str, int], set[str]] = {}
            pass_file = self.pass_file(index)
            for name in pass_file.names if pass_file is not None else ():
                key = Key.parse(name)
                if key.input:
                    found.setdefault((key.module, key.call), set()).add(key.path)
            self._inputs_index, self._inputs = index, found
        return self._inputs

    def routing_consumers(self) -> set[str]:
        """Modules of the reference that take a router's expert indices as an input (an MoE
        block's experts): the module output of a router holds an integer ``[tokens, k]`` tensor,
        and a consumer in the same block takes one of that shape."""
        from ..store.format import Key

        first = min(self.run.passes) if self.run.passes else None
        pass_file = self.pass_file(first) if first is not None else None
        routers: set[tuple[str, tuple[int, ...]]] = set()
        takers: list[tuple[str, tuple[int, ...]]] = []
        for name in pass_file.names if pass_file is not None else ():
            info = pass_file.info(name)
            shape = tuple(info.shape)
            if not (
                info.dtype.startswith(("int", "uint"))
                and len(shape) == 2
                and 0 < shape[1] < min(64, shape[0])
            ):
                continue
            key = Key.parse(name)
            if key.input:
                takers.append((key.module, shape))
            else:
                routers.add((key.module.rpartition(".")[0], shape))
        return {
            m for m, shape in takers if any(m.startswith(block + ".") and s == shape for block, s in routers)
        }

    def close(self) -> None:
        if self._pass is not None:
            self._pass.close()
        self._index, self._pass = None, None


# ------------------------------------------------------------------------------------ replacing


class _NotGrafted(Exception):
    """Why one call keeps its own inputs (the message is the manifest's reason)."""


def _squeezed(shape: Sequence[int]) -> tuple[int, ...]:
    return tuple(s for s in shape if s != 1)


def cast_like(reference: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """The reference tensor as the module under test was about to receive it: ``own``'s shape
    (size-1 dims may differ), dtype and device, in fresh memory (the module may write into its
    inputs). A float cast saturates: fp32's largest masks (``finfo.min``) stay finite in bf16."""
    value = reference.reshape(own.shape) if tuple(reference.shape) != tuple(own.shape) else reference
    out = value.to(device=own.device, dtype=own.dtype, copy=True)
    narrower = own.is_floating_point() and torch.finfo(own.dtype).max < torch.finfo(value.dtype).max
    if narrower and not torch.isinf(value).any():
        limit = torch.finfo(own.dtype)
        out = torch.nan_to_num(out, nan=float("nan"), posinf=limit.max, neginf=limit.min)
    return out


def _check_pair(path: str, own: torch.Tensor, info: Any) -> None:
    """Refuse a reference input of another shape (size-1 dims aside) or another kind of value."""
    if info is None:
        raise _NotGrafted(f"input {path} was not dumped in the reference")
    if _squeezed(own.shape) != _squeezed(info.shape):
        shapes = f"{list(own.shape)} here, {list(info.shape)} in the reference"
        raise _NotGrafted(f"input {path} has shape {shapes}")
    ref_float = info.dtype.startswith(("float", "bfloat"))
    if own.is_floating_point() != ref_float or (own.dtype == torch.bool) != (info.dtype == "bool"):
        raise _NotGrafted(f"input {path} is {dtype_name(own.dtype)} here, {info.dtype} in the reference")


def _replace(value: Any, path: str, new: Mapping[str, torch.Tensor], depth: int = 0) -> Any:
    """``value`` with each tensor leaf at a path in ``new`` replaced, walked as
    :func:`tracedump.dump.hooks.flatten_tensors` names the leaves. Plain tuples, lists, namedtuples and
    dicts are rebuilt; a tensor to replace inside anything else is refused (not rebuilt blindly)."""
    if isinstance(value, torch.Tensor):
        return new.get(path, value)
    if depth >= MAX_DEPTH or not any(key.startswith(path + "[") for key in new):
        return value
    if type(value) is dict:
        return {k: _replace(v, f"{path}[{k}]", new, depth + 1) for k, v in value.items()}
    if type(value) in (tuple, list):
        return type(value)(_replace(v, f"{path}[{i}]", new, depth + 1) for i, v in enumerate(value))
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_replace(v, f"{path}[{i}]", new, depth + 1) for i, v in enumerate(value)))
    where = leaf_path(path, is_input=True) or "[...]"
    raise _NotGrafted(f"input {where} is a {type(value).__name__}, which grafting does not rebuild")


# ------------------------------------------------------------------------------------ grafter


class Grafter:
    """The pre-hooks that feed the grafted modules the reference's inputs, and their record.

    ``pass_index`` says which pass is open (None: none, nothing is grafted); the grafter counts
    each module's calls within a pass as the recorder numbers them (``::callN``).
    """

    def __init__(
        self,
        model: nn.Module,
        reference: str | Path,
        *,
        level: str | None = None,
        maps: Iterable[str] = (),
        captured: Iterable[tuple[str, nn.Module]] = (),
        rank: int = 0,
        root: str = "",
        pass_index: Callable[[], int | None] = lambda: None,
        warn: Callable[[str, str], None] | None = None,
        where: str = "the graft reference",
        shadow: Shadow | None = None,
    ) -> None:
        """``where``: the setting that named ``reference``, for the messages of its refusals;
        ``shadow``: runs each grafted call again in float32 (:mod:`.shadow`), None: no shadow."""
        refuse_unsafe(model)
        self.given = Path(reference).expanduser()
        self.reference = _Reference(self.given, rank, root, where)
        self.level = level or LEAVES
        self.map_rules = list(maps)
        self._maps = parse_graft_map(self.map_rules)
        self._pass_index = pass_index
        self._warn = warn
        self.counterparts: dict[str, str] = {}  # from the correspondence (use_correspondence)
        try:
            self.targets = self._choose(model, level, list(captured))
        except DumpReadError as e:  # the reference's first pass, read for its routing
            raise ConfigError(f"tracedump: bad setting\n  {where}: bad graft reference: {e}") from e
        if not self.targets:
            what = "no captured module is a leaf" if level is None else f"level {level!r} matches no module"
            raise ConfigError(f"tracedump: bad graft setting: {what} of {type(model).__name__}")
        self.handles: list[RemovableHandle] = []
        self._lock = threading.Lock()
        self._calls_pass: int | None = None
        self._calls: Counter[str] = Counter()
        self.grafted: Counter[str] = Counter()  # name -> calls run on the reference's inputs
        self.not_grafted: dict[str, list[dict[str, Any]]] = {}  # name -> [{pass, call, reason}]
        self.not_grafted_count: Counter[str] = Counter()
        self.kept_own: dict[str, list[str]] = {}  # name -> inputs the reference has no tensor for
        self.feeds: dict[str, InputFeed] = {}  # name -> how its calls take the reference's inputs
        self.fed: dict[str, dict[str, str]] = {}  # name -> own input path -> reference path, 0, own
        self.shadow = shadow

    # ---------------------------------------------------------------- choosing

    def reference_name(self, name: str) -> str:
        """The reference's name of a module: the map rules' when they rename it, else its
        counterpart from the correspondence (:meth:`use_correspondence`), else its own."""
        mapped = name
        for pattern, repl in self._maps:
            mapped = pattern.sub(repl, mapped)
        return self.counterparts.get(name, name) if mapped == name else mapped

    def _choose(
        self, model: nn.Module, level: str | None, captured: list[tuple[str, nn.Module]]
    ) -> list[tuple[str, nn.Module]]:
        """Leaves of the captured selection; or the outermost modules a level regex matches (by the
        name here or as the reference spells it), never the root, never one inside another."""
        if level is None:
            leaves = [(n, m) for n, m in captured if next(iter(m.children()), None) is None and n != "root"]
            # An MoE block's experts (a container whose leaves run per expert) take the reference's
            # routing too, so their per-expert calls line up with the reference's whatever the
            # router here decided at a near-tie.
            routed = self.reference.routing_consumers()
            have = {id(m) for _, m in leaves}
            experts = [
                (display_name(n), m)
                for n, m in model.named_modules()
                if n and id(m) not in have and self.reference_name(n) in routed
            ]
            return experts + leaves
        try:
            pattern = re.compile(level)
        except re.error as e:
            raise ConfigError(f"tracedump: bad graft level {level!r}: invalid regex: {e}") from e
        chosen: list[tuple[str, nn.Module]] = []
        for name, module in model.named_modules():
            if not name or not (pattern.search(name) or pattern.search(self.reference_name(name))):
                continue
            if any(name.startswith(outer + ".") for outer, _ in chosen):
                continue  # inside a grafted module: it runs on that module's own values
            chosen.append((display_name(name), module))
        return chosen

    def with_targets(self, modules: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
        """The capture selection plus any grafted module it lacks: a graft is judged by its output."""
        have = {id(m) for _, m in modules}
        return modules + [(n, m) for n, m in self.targets if id(m) not in have]

    # ---------------------------------------------------------------- hooks

    def register(self) -> None:
        """One forward pre-hook (with kwargs) per grafted module. The capture hooks run after it
        (:meth:`tracedump.dump.hooks.HookSet.keep_last`), so ``INPUTS=1`` records the grafted inputs."""
        for name, module in self.targets:
            hook = _GraftHook(self, name)
            self.handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
            if self.shadow is not None:
                self.handles.append(module.register_forward_hook(_ShadowHook(self.shadow, name)))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        self.reference.close()

    def _next_call(self, pass_index: int, name: str) -> int:
        if pass_index != self._calls_pass:
            self._calls_pass, self._calls = pass_index, Counter()
        call = self._calls[name]
        self._calls[name] = call + 1
        return call

    def inputs_for(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The replaced ``(args, kwargs)`` for this call, or None to run on its own inputs."""
        if self.shadow is not None and self.shadow.is_running():
            return None  # the shadow's own run (a hook-free copy; nothing of it is grafted)
        with self._lock:
            pass_index = self._pass_index()
            if pass_index is None:
                return None  # no pass open (a warm-up or profile run): nothing to line up with
            call = self._next_call(pass_index, name)
            try:
                if torch.compiler.is_compiling():
                    raise _NotGrafted("torch.compile is tracing this call: grafting refused")
                if stream_is_capturing():
                    raise _NotGrafted("CUDA graph capture: grafting refused")
                replaced = self._replaced(pass_index, name, call, args, kwargs)
            except _NotGrafted as why:
                self._not_grafted(name, pass_index, call, str(why))
                return None
            except Exception as e:  # never break the host's forward: run on its own inputs
                self._not_grafted(name, pass_index, call, f"{type(e).__name__}: {e}")
                return None
            self.grafted[name] += 1
            return replaced

    def _replaced(
        self, pass_index: int, name: str, call: int, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        refused = self.feeds[name].refuse if name in self.feeds else None
        if refused is not None:
            raise _NotGrafted(refused)
        pass_file = self.reference.pass_file(pass_index)
        if pass_file is None:
            raise _NotGrafted(f"the reference has no pass {pass_index}")
        own = flatten_inputs(args, kwargs)
        if not own:
            raise _NotGrafted("the call has no tensor input")
        ref_name = self.reference_name(name)
        dumped = self.reference.inputs(pass_index).get((ref_name, call), set())
        if not dumped:
            raise _NotGrafted(f"the reference dumped no input of {ref_name}, call {call}, pass {pass_index}")
        if name in self.feeds:
            return self._replaced_by_feed(self.feeds[name], pass_file, name, call, own, dumped, args, kwargs)
        new: dict[str, torch.Tensor] = {}
        references: dict[str, tuple[torch.Tensor, str]] = {}  # flat -> (the reference's value, dtype)
        kept: list[str] = []
        for flat, tensor in own:
            path = leaf_path(flat, is_input=True)
            if path not in dumped:
                kept.append(path)  # only this side has it (a mask the reference passed as None)
                continue
            key = key_text(ref_name, path, input=True, call=call)
            _check_pair(path, tensor, pass_file.info(key))
            new[flat] = cast_like(pass_file[key], tensor)
            if self.shadow is not None:
                references[flat] = (pass_file[key], pass_file.info(key).dtype)
        if not new:
            listed = ", ".join(sorted(dumped))
            raise _NotGrafted(f"no input of this call lines up with the reference's ({listed})")
        if kept:
            self.kept_own.setdefault(name, sorted(kept))
        new_args = _replace(tuple(args), input_prefix(), new)
        new_kwargs = {k: _replace(v, input_prefix(k), new) for k, v in kwargs.items()}
        if self.shadow is not None:
            self._prepare_shadow(name, call, (args, kwargs), dict(own), references)
        return new_args, new_kwargs

    # ---------------------------------------------------------------- correspondence

    def use_correspondence(self, record: Correspondence) -> None:
        """An engine's load record (which checkpoint tensors each parameter holds): each grafted
        module takes the recorded inputs of the reference module holding the same checkpoint
        tensors (:func:`~tracedump.store.correspondence.module_counterparts`; a fused ``qkv_proj``
        takes ``q_proj``'s), where the map rules do not rename it. Nothing when the reference has
        no ``correspondence.json``."""
        theirs = read_correspondence(self.reference.path)
        if theirs is None or not record.loads:
            return
        found = module_counterparts(record, theirs)
        with self._lock:
            self.counterparts = {
                display_name(mine): display_name(other) for mine, other in found.items() if mine != other
            }

    # ---------------------------------------------------------------- feeds

    def use_feeds(self, feeds: Mapping[str, InputFeed]) -> None:
        """How some grafted modules take the reference's inputs when their signature is not the
        reference module's (:mod:`tracedump.dump.graft_feed`); a feed for a module not grafted is
        ignored. Set before the first pass (an engine integration, right after ``attach()``)."""
        with self._lock:
            targets = {name for name, _ in self.targets}
            self.feeds = {name: feed for name, feed in feeds.items() if name in targets}

    def _replaced_by_feed(
        self,
        feed: InputFeed,
        pass_file: Any,
        name: str,
        call: int,
        own: list[tuple[str, torch.Tensor]],
        dumped: set[str],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The call's inputs as ``feed`` says: some from the reference (by parameter, not by
        path), some zeros, the rest its own."""
        tensors = {leaf_path(flat, is_input=True): (flat, tensor) for flat, tensor in own}
        try:
            fed, kept = fed_paths(feed, tensors, dumped)
        except GraftFeedRefused as why:
            raise _NotGrafted(str(why)) from None
        ref_name = self.reference_name(name)
        new: dict[str, torch.Tensor] = {}
        for path, source in fed.items():
            flat, tensor = tensors[path]
            if source == ZERO:
                new[flat] = torch.zeros_like(tensor)
                continue
            key = key_text(ref_name, source, input=True, call=call)
            _check_pair(f"{path} (the reference's {source})", tensor, pass_file.info(key))
            new[flat] = cast_like(pass_file[key], tensor)
        if kept:
            self.kept_own.setdefault(name, sorted(kept))
        self.fed.setdefault(name, {**fed, **dict.fromkeys(kept, KEPT)})
        new_args = _replace(tuple(args), input_prefix(), new)
        new_kwargs = {k: _replace(v, input_prefix(k), new) for k, v in kwargs.items()}
        return new_args, new_kwargs

    def _prepare_shadow(
        self,
        name: str,
        call: int,
        call_inputs: tuple[tuple[Any, ...], dict[str, Any]],
        own: dict[str, torch.Tensor],
        references: dict[str, tuple[torch.Tensor, str]],
    ) -> None:
        """The shadow's inputs of this call (:mod:`.shadow`): each grafted input the reference's own
        value in float32, every other float input upcast; or the reason no shadow runs."""
        assert self.shadow is not None
        floats = [(flat, value) for flat, value in references.items() if own[flat].is_floating_point()]
        why = next(
            (w for flat, (_, dtype) in floats if (w := shadow_applies(own[flat], dtype)) is not None),
            None if floats else "no float input was grafted",
        )
        if why is not None:
            self.shadow.skip(why)
            return
        fresh = {flat: fp32_inputs(value, own[flat]) for flat, (value, _) in references.items()}
        args, kwargs = call_inputs
        shadow_args = upcast(_replace(tuple(args), input_prefix(), fresh))
        shadow_kwargs = {k: upcast(_replace(v, input_prefix(k), fresh)) for k, v in kwargs.items()}
        self.shadow.prepare(name, call, shadow_args, shadow_kwargs)

    def _not_grafted(self, name: str, pass_index: int, call: int, reason: str) -> None:
        self.not_grafted_count[name] += 1
        listed = self.not_grafted.setdefault(name, [])
        if len(listed) < MAX_CALLS_LISTED:
            listed.append({"pass": pass_index, "call": call, "reason": reason})
        if self._warn is not None:  # once per run: the manifest lists every module and reason
            self._warn(
                "graft_missing",
                f"tracedump: {name} (pass {pass_index}, call {call}) runs on its own inputs, not "
                f"grafted: {reason}; every call not grafted is listed in manifest.json 'graft'",
            )

    # ---------------------------------------------------------------- record

    def summary(self) -> dict[str, Any]:
        """The manifest's ``graft`` entry: from which dump, at which modules, what was not grafted."""
        return {
            "from": str(self.reference.path),
            "level": self.level,
            "map": list(self.map_rules),
            "modules": [name for name, _ in self.targets],
            "containers": [name for name, m in self.targets if next(iter(m.children()), None) is not None],
            "leaves": {  # each grafted container's leaves (the verdict counts those that ran)
                name: [
                    f"{name}.{n}"
                    for n, leaf in m.named_modules()
                    if n and next(iter(leaf.children()), None) is None
                ]
                for name, m in self.targets
                if next(iter(m.children()), None) is not None
            },
            "reference_names": {
                name: self.reference_name(name)
                for name, _ in self.targets
                if self.reference_name(name) != name
            },
            "grafted_calls": dict(self.grafted),
            "kept_own_inputs": dict(self.kept_own),
            "feeds": {name: feed.describe() for name, feed in self.feeds.items()},
            "fed_inputs": {name: dict(paths) for name, paths in self.fed.items()},
            "not_grafted": {
                name: {"calls": self.not_grafted_count[name], "listed": listed}
                for name, listed in self.not_grafted.items()
            },
            **({"shadow": self.shadow.summary()} if self.shadow is not None else {}),
        }


class _GraftHook:
    """The pre-hook of one grafted module: the reference's inputs for this call, or None."""

    __slots__ = ("grafter", "name")

    def __init__(self, grafter: Grafter, name: str) -> None:
        self.grafter = grafter
        self.name = name

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return self.grafter.inputs_for(self.name, args, kwargs)

    def __repr__(self) -> str:
        return f"GraftHook({self.name!r})"


class _ShadowHook:
    """The forward hook of one grafted module: its call returned, run its fp32 shadow."""

    __slots__ = ("name", "shadow")

    def __init__(self, shadow: Shadow, name: str) -> None:
        self.shadow = shadow
        self.name = name

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        self.shadow.after(self.name, module)

    def __repr__(self) -> str:
        return f"ShadowHook({self.name!r})"
