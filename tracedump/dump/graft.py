"""Grafting: run each chosen module on the reference's own inputs, so its output error is its own.

``tracedump diff`` of two ordinary dumps judges *propagated* error: every tensor carries whatever
went wrong upstream. A grafted run instead feeds each grafted module, at each call, the inputs the
reference dump captured for that module, pass and call (``INPUTS=1``: ``name@in[0]``,
``name@in[kw]``, ``::callN``), cast to the dtype and device the module under test was about to
receive. Its output then differs from the reference's by what that module alone adds: its *local*
error, judged by :mod:`tracedump.compare.local` without a growth allowance or a baseline::

    with tracedump.graft(model, "/tmp/ref_fp32", dir="/tmp/grafted") as g:   # every captured leaf
        g.run(input_ids=ids)
    with tracedump.graft(model, "/tmp/ref_fp32", level=r"layers\\.\\d+$", dir="/tmp/by_layer"):
        model(input_ids=ids)                                                 # each decoder layer

The same without code change: ``TRACEDUMP_DUMP_GRAFT_FROM=<reference dump>`` (and
``TRACEDUMP_DUMP_GRAFT_LEVEL``) for any ``attach()``-based engine, or ``tracedump run
--graft-from REF --graft-level REGEX``.

Honesty rules: a call whose reference inputs are missing (not dumped, another shape, another kind
of value) runs on its own inputs and is recorded as not grafted, with the reason, in the manifest's
``graft`` entry; the grafted run writes its own run dir, never into the reference's dump; hooks
live only while the graft does; grafting is refused on a ``torch.compile``'d model and during CUDA
graph capture (a graph would bake the reference's tensors in, or replay without the hooks).
"""

from __future__ import annotations

import re
import shutil
import tempfile
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..errors import ConfigError
from ..store.format import dtype_name, key_text
from .cuda import stream_is_capturing
from .hooks import MAX_DEPTH, flatten_inputs
from .selection import display_name
from .torch_compat import compiled_in_place, compiled_original

__all__ = ["Graft", "Grafter", "graft", "parse_graft_map"]

LEAVES = "leaves"  # the default level: every captured leaf
MAX_CALLS_LISTED = 20  # not-grafted calls listed per module in the manifest (all are counted)


def parse_graft_map(rules: Iterable[str]) -> list[tuple[re.Pattern[str], str]]:
    """``PATTERN=REPL`` rules (split at the last ``=``, as ``tracedump diff --map``): how the
    names of the model under test are spelt in the reference."""
    parsed = []
    for rule in rules:
        pattern, sep, repl = rule.rpartition("=")
        if not sep or not pattern:
            raise ConfigError(f"tracedump: bad graft map {rule!r}: expected 'PATTERN=REPL'")
        try:
            compiled = re.compile(pattern)
            compiled.sub(repl, "")
        except (re.error, IndexError) as e:
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

    def __init__(self, path: Path, rank: int, root: str) -> None:
        from ..errors import DumpReadError
        from ..store.loader import open_dump

        try:
            dump = open_dump(path)
            roots = list(dict.fromkeys(run.root for run in dump.runs))
            chosen = root if root in roots else (roots[0] if len(roots) == 1 else None)
            if chosen is None:
                raise DumpReadError(f"{path}: no run of root {root!r}; roots: {roots}")
            ranks = {run.rank for run in dump.runs if run.root == chosen}
            self.run = dump.run(rank=rank if rank in ranks else None, root=chosen)
        except DumpReadError as e:
            raise ConfigError(f"tracedump: bad graft reference: {e}") from e
        self.path = self.run.path
        self.dump_path = dump.path
        self._index: int | None = None
        self._pass: Any = None
        self._inputs_index: int | None = None
        self._inputs: dict[tuple[str, int], set[str]] = {}
        settings = self.run.manifest.get("settings")
        if isinstance(settings, dict) and settings.get("mode") not in (None, "full"):
            raise ConfigError(
                f"tracedump: bad graft reference {path}: it was dumped in {settings.get('mode')!r} "
                "mode; grafting needs whole tensors (MODE=full) with INPUTS=1"
            )
        if not any("@in" in name for pass_file in self.run.passes.values() for name in pass_file.names):
            raise ConfigError(
                f"tracedump: bad graft reference {path}: it holds no module inputs; dump the "
                "reference with TRACEDUMP_DUMP_INPUTS=1 (tracedump run --inputs)"
            )

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


def check_not_into_reference(out_dir: Path, reference: _Reference, given: Path) -> None:
    """A grafted run writes a run dir of its own, never into the reference's dump."""
    target = Path(out_dir).resolve()
    for forbidden in {p.resolve() for p in (given, reference.path, reference.dump_path)}:
        if target == forbidden or forbidden in target.parents:
            raise ConfigError(
                f"tracedump: bad setting\n  the grafted run's dump dir {out_dir} is the reference's "
                f"dump ({forbidden}) or inside it: a grafted run never writes into its reference. "
                "Give it a dump dir of its own."
            )


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
    where = path.removeprefix("@in") or "[...]"
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
    ) -> None:
        refuse_unsafe(model)
        self.given = Path(reference).expanduser()
        self.reference = _Reference(self.given, rank, root)
        self.level = level or LEAVES
        self.map_rules = list(maps)
        self._maps = parse_graft_map(self.map_rules)
        self._pass_index = pass_index
        self._warn = warn
        self.targets = self._choose(model, level, list(captured))
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

    # ---------------------------------------------------------------- choosing

    def reference_name(self, name: str) -> str:
        for pattern, repl in self._maps:
            name = pattern.sub(repl, name)
        return name

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
        new: dict[str, torch.Tensor] = {}
        kept: list[str] = []
        for path, tensor in own:
            path = path.removeprefix("@in")
            if path not in dumped:
                kept.append(path)  # only this side has it (a mask the reference passed as None)
                continue
            key = key_text(ref_name, path, input=True, call=call)
            _check_pair(path, tensor, pass_file.info(key))
            new["@in" + path] = cast_like(pass_file[key], tensor)
        if not new:
            listed = ", ".join(sorted(dumped))
            raise _NotGrafted(f"no input of this call lines up with the reference's ({listed})")
        if kept:
            self.kept_own.setdefault(name, sorted(kept))
        new_args = _replace(tuple(args), "@in", new)
        new_kwargs = {k: _replace(v, f"@in[{k}]", new) for k, v in kwargs.items()}
        return new_args, new_kwargs

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
            "not_grafted": {
                name: {"calls": self.not_grafted_count[name], "listed": listed}
                for name, listed in self.not_grafted.items()
            },
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


# ------------------------------------------------------------------------------------ graft()


class Graft:
    """An active graft: a dumper whose grafted modules run on the reference's inputs.

    Each :meth:`run` (or each direct outermost call of the model inside the block) is one pass,
    lined up with the reference's pass of the same index. On exit the run dir is complete:
    :attr:`run_dir`, or :meth:`save` to copy it elsewhere.
    """

    def __init__(self, model: nn.Module, settings: dict[str, Any], temporary: Path | None) -> None:
        self.model = model
        self._settings = settings
        self._temporary = temporary
        self.dumper: Any = None

    def __enter__(self) -> Graft:
        from ..config.settings import DumpSettings
        from .dumper import Dumper

        if self.dumper is not None:
            raise RuntimeError("this graft is already active")
        settings = DumpSettings.model_validate(self._settings)  # no env: this is a script's call
        try:
            self.dumper = Dumper(self.model, settings)
        except BaseException:
            self._drop_temporary()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.dumper is not None:
            self.dumper.close()

    @property
    def run_dir(self) -> Path:
        if self.dumper is None:
            raise RuntimeError("the graft has not started: use it in a `with` block")
        return self.dumper.run_dir

    @property
    def grafter(self) -> Grafter:
        return self.dumper.graft  # type: ignore[no-any-return]

    def run(self, *args: Any, **kwargs: Any) -> Any:
        """Call the model as one pass (as ``capture().run`` does); returns its output."""
        if self.dumper is None or self.dumper._closed:
            raise RuntimeError("Graft.run() must be called inside the `with tracedump.graft(...)` block")
        with self.dumper.step():
            return self.model(*args, **kwargs)

    def save(self, directory: str | Path) -> Path:
        """Copy the finished run dir under ``directory``; returns the copy's path."""
        if self.dumper is None or not self.dumper._closed:
            raise RuntimeError("Graft.save() is for after the `with` block")
        target = Path(directory) / self.run_dir.name
        shutil.copytree(self.run_dir, target)
        return target

    def _drop_temporary(self) -> None:
        if self._temporary is not None:
            shutil.rmtree(self._temporary, ignore_errors=True)

    def __repr__(self) -> str:
        level = self._settings.get("graft_level") or LEAVES
        return f"Graft({self._settings.get('graft_from')}, level={level})"


def graft(
    model: nn.Module,
    reference: str | Path,
    *,
    dir: str | Path | None = None,
    level: str | None = None,
    maps: Iterable[str] = (),
    modules: str = "all",
    filter: str | Iterable[str] | None = None,
    inputs: bool = True,
) -> Graft:
    """Run ``model`` with each grafted module fed the reference's captured inputs.

    Args:
        model: the model under test (not ``torch.compile``'d).
        reference: a dump (dir or run dir) made with ``INPUTS=1`` (``MODE=full``).
        dir: where the grafted run dir goes (default: a new temp dir; see :attr:`Graft.run_dir`).
        level: None grafts every captured leaf (each leaf's own error); a regex (``r"layers\\.\\d+$"``)
            grafts the outermost modules it matches (each decoder layer's own error).
        maps: ``PATTERN=REPL`` rules turning this model's names into the reference's (``--map``).
        modules, filter: what is dumped, as ``MODULES`` and ``FILTER``; grafted modules are always
            dumped.
        inputs: also dump the inputs (the grafted ones), so a test can check they were replaced.

    A bad reference, level or map raises :class:`tracedump.ConfigError` before any hook exists.
    """
    temporary = None
    if dir is None:
        temporary = Path(tempfile.mkdtemp(prefix="tracedump-graft-"))
        dir = temporary
    settings: dict[str, Any] = {
        "dir": str(dir),
        "modules": modules,
        "inputs": inputs,
        "graft_from": str(reference),
        "graft_level": level,
        "graft_map": list(maps) or None,
    }
    if filter is not None:
        settings["filter"] = [filter] if isinstance(filter, str) else list(filter)
    return Graft(model, {k: v for k, v in settings.items() if v is not None}, temporary)
