"""In-memory capture of module inputs and outputs for scripts and notebooks (docs/capture.md)::

    with tracedump.capture(model, outputs=["model.layers.0"], early_exit=True, device="cpu") as cap:
        cap.run(**batch)                  # model output, or None when cut short
    cap["model.layers.0"].outputs         # one entry per forward
    cap.save("/tmp/ref")                  # a dump `tracedump diff` reads

It runs the recorder ``attach()`` runs, with a memory sink: same hooks, same keys, same copies.
Hooks live only on the requested modules and only inside the ``with`` block. Early exit raises a
private ``BaseException`` from the last hook that still had to fire and catches it in
:meth:`Capture.run`: the only way to stop an arbitrary ``forward`` without touching its code.
"""

from __future__ import annotations

import collections.abc
import copy
import dataclasses
import difflib
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal, NamedTuple

import torch
from torch import nn

from .hooks import MAX_DEPTH as _MAX_DEPTH
from .hooks import CallSites, HookSet
from .recorder import KeepPolicy, Recorder
from .rundir import ErrorLog
from .runtime import Warner
from .selection import ROOT_NAME, candidate_modules, display_name, every_name, regex_predicate, shared_names
from .sinks import MemorySink

__all__ = ["Capture", "CaptureSpec", "ModuleCapture", "capture", "parse_spec"]

Kind = Literal["inputs", "outputs"]
Device = str | torch.device | None

_SECTIONS: tuple[Kind, ...] = ("inputs", "outputs")
_SECTION_RE = re.compile(r"\s*([A-Za-z_]\w*)\s*\[([^\[\]]*)\]")
_CLOSE_MATCHES = 5


class _EarlyExit(BaseException):
    """Raised from a hook to abandon the rest of a forward once every requested capture has fired.

    It derives from ``BaseException`` so that model code with a broad ``except Exception`` fallback
    (common around optional fast kernels) can not swallow it and keep running the model.
    """


@dataclasses.dataclass
class ModuleCapture:
    """Everything recorded for one requested module.

    ``outputs`` holds one entry per forward of the module; ``inputs`` one ``{"args": tuple, "kwargs":
    dict}`` per forward.  A list stays empty when that side was not requested.
    """

    name: str
    outputs: list[Any] = dataclasses.field(default_factory=list)
    inputs: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def clear(self) -> None:
        """Forget what was recorded so far, e.g. between epochs of a long loop."""
        self.outputs.clear()
        self.inputs.clear()


class CaptureSpec(NamedTuple):
    """The module names a spec string selects, in order of first mention, without duplicates."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


# --------------------------------------------------------------------------------------------- spec


def _split_items(text: str) -> list[str]:
    """Split a ``|``-separated item list, dropping whitespace and empty items."""
    return [item.strip() for item in text.split("|") if item.strip()]


def parse_spec(spec: str) -> CaptureSpec:
    """Parse a capture spec string such as ``"inputs[a.b]|outputs[a.b|c.d]"``.

    Grammar: a ``|``-separated sequence of parts; a part is either ``inputs[NAMES]``,
    ``outputs[NAMES]`` or a bare module name (which means its output).  ``NAMES`` is itself
    ``|``-separated.  Sections are optional and may repeat; whitespace and empty items are dropped.
    Malformed text (unknown section, stray bracket) and a spec that selects nothing raise
    ``ValueError``.  Names are not checked against a model here; :func:`capture` does that.
    """
    if not isinstance(spec, str):
        raise TypeError(f"spec must be a str, got {type(spec).__name__}")
    selected: dict[Kind, dict[str, None]] = {"inputs": {}, "outputs": {}}
    pos = 0
    while pos < len(spec):
        if spec[pos].isspace() or spec[pos] == "|":
            pos += 1
            continue
        section = _SECTION_RE.match(spec, pos)
        if section is not None:
            kind = section.group(1)
            if kind not in _SECTIONS:
                raise ValueError(f"unknown section {kind!r} in spec {spec!r}; expected one of {_SECTIONS}")
            selected[kind].update(dict.fromkeys(_split_items(section.group(2))))
            pos = section.end()
            rest = spec[pos:].lstrip()
            if rest and not rest.startswith("|"):
                raise ValueError(f"expected '|' after {section.group(0).strip()!r} in spec {spec!r}")
            continue
        end = spec.find("|", pos)
        end = len(spec) if end < 0 else end
        item = spec[pos:end].strip()
        if "[" in item or "]" in item:
            raise ValueError(
                f"malformed part {item!r} in spec {spec!r}; expected inputs[...] or outputs[...]"
            )
        selected["outputs"][item] = None
        pos = end
    result = CaptureSpec(inputs=tuple(selected["inputs"]), outputs=tuple(selected["outputs"]))
    if not result.inputs and not result.outputs:
        raise ValueError(f"spec {spec!r} selects nothing")
    return result


# ------------------------------------------------------------------------------------------ structure


def _rebuild(obj: Any, copies: Iterator[torch.Tensor], depth: int = 0) -> Any:
    """``obj`` with each tensor leaf replaced by the recorder's copy of it.

    Walks in the order :func:`tracedump.dump.hooks.flatten_tensors` named the leaves (mappings by their
    items, sequences by index, dataclasses by field), so the n-th copy lands where the n-th leaf
    was. Tuples, lists, dicts, namedtuples, dataclasses and HF ``ModelOutput`` keep their type;
    any other leaf (ints, strings, ``None``, cache objects) is kept as the same object.
    """
    if isinstance(obj, torch.Tensor):
        return next(copies)
    if depth >= _MAX_DEPTH:
        return obj
    if isinstance(obj, Mapping):
        return _rebuild_mapping(obj, {key: _rebuild(value, copies, depth + 1) for key, value in obj.items()})
    if isinstance(obj, tuple):
        items = [_rebuild(item, copies, depth + 1) for item in obj]
        if hasattr(obj, "_fields"):  # namedtuple
            return type(obj)(*items)
        return tuple(items) if type(obj) is tuple else _rebuild_sequence(obj, items, tuple)
    if isinstance(obj, list):
        items = [_rebuild(item, copies, depth + 1) for item in obj]
        return items if type(obj) is list else _rebuild_sequence(obj, items, list)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        new = copy.copy(obj)
        for field in dataclasses.fields(obj):
            object.__setattr__(new, field.name, _rebuild(getattr(obj, field.name), copies, depth + 1))
        return new
    return obj


def _rebuild_mapping(obj: Mapping[Any, Any], items: dict[Any, Any]) -> Any:
    """Same mapping type with copied values; a plain ``dict`` (same keys) when the type can't be rebuilt."""
    if type(obj) is dict:
        return items
    if dataclasses.is_dataclass(obj):
        # HF ModelOutput: an OrderedDict *and* a dataclass whose items() are its non-None fields.
        try:
            return type(obj)(**items)
        except Exception:
            return dict(items)
    if isinstance(obj, collections.abc.MutableMapping):
        try:
            new = copy.copy(obj)  # keeps e.g. a defaultdict's factory
            new.clear()
            new.update(items)
            return new
        except Exception:
            return dict(items)
    return dict(items)


def _rebuild_sequence(obj: Any, items: list[Any], fallback: type) -> Any:
    """Same sequence subclass when its constructor takes an iterable, else the plain base type."""
    try:
        return type(obj)(items)
    except Exception:
        return fallback(items)


class _MemoryLog:
    """``capture()``'s run log: no manifest; a failure is warned about once and counted."""

    def __init__(self, warn: Warner) -> None:
        self.manifest: dict[str, Any] = {}
        self.errors = ErrorLog()
        self._warn = warn

    def update(self, **fields: Any) -> None:
        self.manifest.update(fields)

    def report(self, where: str, error: BaseException) -> None:
        self.errors.add(where, type(error).__name__, str(error))
        self._warn("capture_error", f"tracedump.capture(): copying at {where} failed: {error!r}")


# ------------------------------------------------------------------------------------------ capture


class Capture:
    """Context manager that records inputs/outputs of named modules; create it with :func:`capture`.

    Inside the ``with`` block every forward of a requested module is recorded, whether it is run via
    :meth:`run` or by calling the model directly.  Early exit applies only within :meth:`run`.
    Each :meth:`run` is one pass (as one engine step is for ``attach()``); :meth:`save` writes them
    as a dump that ``tracedump diff`` reads.

    Early-exit rule: at the start of each :meth:`run` every requested capture (module name and side)
    is armed; when a capture fires for the first time it is disarmed, and when the last armed one
    fires the forward is abandoned right there and ``run`` returns ``None``.  Input captures fire
    before the module's forward, output captures after it, so a block's output fires after all its
    children.  If some requested capture never fires, the forward completes and ``run`` returns the
    model output.
    """

    def __init__(
        self,
        model: nn.Module,
        outputs: Iterable[str] = (),
        inputs: Iterable[str] = (),
        *,
        early_exit: bool = False,
        device: Device = None,
    ) -> None:
        """Validate the names against ``model`` and prepare empty records (no hooks yet)."""
        self.model = model
        self.early_exit = early_exit
        self.device = torch.device(device) if device is not None else None
        self._modules = dict(model.named_modules(remove_duplicate=False))
        self._requests: dict[tuple[str, Kind], None] = {}
        for kind, names in (("inputs", inputs), ("outputs", outputs)):
            for name in names:
                self._check_name(name)
                self._requests[(name, kind)] = None
        if not self._requests:
            raise ValueError("nothing to capture: pass outputs, inputs, spec or filter")
        self._records = {name: ModuleCapture(name) for name, _ in self._requests}
        self._by_key = {display_name(name): name for name in self._records}  # recorder key -> name
        self._warn = Warner()
        self._sink = MemorySink(self.device)
        self._recorder = Recorder(
            model,
            KeepPolicy(inputs=True, implicit_passes=False, keep_outside=True),
            self._sink,
            _MemoryLog(self._warn),
            self._warn,
        )
        self._hooks: HookSet | None = None
        self._pending: set[tuple[str, Kind]] | None = None

    # ------------------------------------------------------------------ names and records

    def _check_name(self, name: str) -> None:
        if name not in self._modules:
            raise self._unknown_name(name)

    def _unknown_name(self, name: str) -> KeyError:
        """``KeyError`` naming the closest real module names, so typos are fixed in one go."""
        real = [n for n in self._modules if n]
        close = difflib.get_close_matches(name, real, n=_CLOSE_MATCHES, cutoff=0.5)
        hint = f"; closest: {', '.join(close)}" if close else ""
        return KeyError(f"no module named {name!r} in {type(self.model).__name__}{hint}")

    @property
    def names(self) -> list[str]:
        """Requested module names, in request order (inputs first)."""
        return list(self._records)

    def __getitem__(self, name: str) -> ModuleCapture:
        """Record of a requested module; ``KeyError`` explains unrequested and unknown names."""
        if name in self._records:
            return self._records[name]
        if name in self._modules:
            raise KeyError(f"module {name!r} was not requested; requested: {', '.join(self._records)}")
        raise self._unknown_name(name)

    def __contains__(self, name: object) -> bool:
        return name in self._records

    def __iter__(self) -> Iterator[str]:
        return iter(self._records)

    def __len__(self) -> int:
        return len(self._records)

    def clear(self) -> None:
        """Forget every recorded entry, keeping the requests (and hooks, inside the block)."""
        for record in self._records.values():
            record.clear()
        self._sink.passes.clear()
        self._sink.loose.clear()
        self._recorder.loose.clear()

    # ------------------------------------------------------------------ hooks

    def __enter__(self) -> Capture:
        """Register the hooks; only requested modules get one."""
        if self._hooks is not None:
            raise RuntimeError("this Capture is already active; a with-block can not be nested in itself")
        sides: dict[Kind, list[tuple[str, nn.Module]]] = {"inputs": [], "outputs": []}
        for name, kind in self._requests:
            sides[kind].append((display_name(name), self._modules[name]))
        hooked = list(dict.fromkeys(sides["outputs"] + sides["inputs"]))
        names = every_name(self.model)
        shared = shared_names(names, hooked)
        sites = CallSites(self.model, names, shared) if shared else None
        self._hooks = HookSet(
            self.model,
            self._recorder,
            sides["outputs"],
            sides["inputs"],
            then=self._captured,
            passes=False,
            sites=sites,
        )
        return self

    def __exit__(self, *exc_info: object) -> None:
        """Remove every hook, also when an exception propagates (it is not suppressed)."""
        if self._hooks is not None:
            self._hooks.remove()
        self._hooks = None
        self._pending = None

    def _captured(self, key: str, is_input: bool, value: Any) -> None:
        """After the recorder kept a capture: the structured view, then early exit."""
        copies = iter(self._sink.take_recent())
        name = self._by_key[key]
        try:
            if is_input:
                args, kwargs = value
                entry = {"args": _rebuild(tuple(args), copies), "kwargs": _rebuild(dict(kwargs), copies)}
                self._records[name].inputs.append(entry)
            else:
                self._records[name].outputs.append(_rebuild(value, copies))
        except StopIteration:  # the recorder kept nothing (a failure it reported): no entry
            pass
        self._fired((name, "inputs" if is_input else "outputs"))

    def _fired(self, key: tuple[str, Kind]) -> None:
        """Disarm ``key``; cut the forward once nothing armed is left (only inside an early-exit run)."""
        if self._pending is None:
            return
        self._pending.discard(key)
        if not self._pending:
            self._pending = None
            raise _EarlyExit

    # ------------------------------------------------------------------ running

    def run(self, *args: Any, **kwargs: Any) -> Any:
        """Call ``model(*args, **kwargs)``; return its output, or ``None`` when early exit cut it short.

        Must be called inside the ``with`` block, where the hooks live.
        """
        if self._hooks is None:
            raise RuntimeError("Capture.run() must be called inside the `with capture(...)` block")
        if self.early_exit:
            self._pending = set(self._requests)
        with self._recorder.step():
            try:
                return self.model(*args, **kwargs)
            except _EarlyExit:
                return None
            finally:
                self._pending = None

    def save(self, directory: str | Path) -> Path:
        """Write what :meth:`run` captured as a dump under ``directory`` (one pass per run, calls made
        outside :meth:`run` in ``records.safetensors``), for ``tracedump diff``. Returns the run dir.

        The keys are the ones ``attach()`` writes, so a capture diffs against an engine's dump. A
        capture a pass file cannot hold (``complex128``, sparse, meta, quantized) is skipped and
        counted as ``unsupported_tensor``, as ``attach()`` does, and the rest is written. A save that
        fails (a full disk) raises ``OSError`` naming the file and leaves no run dir behind."""
        from ..store.format import RECORDS_FILE
        from .writer import PassJob

        target = _save_target(directory)
        self._sink.submit(PassJob(-1, None, "records", self._recorder.loose, 0, file_name=RECORDS_FILE))
        self._recorder.loose = []
        skipped = collections.Counter(self._recorder.skipped)
        passes = [
            (index, _host_entries(tensors, skipped)) for index, tensors in sorted(self._sink.passes.items())
        ]
        loose = _host_entries(self._sink.loose, skipped)
        return self._write(target, passes, loose, skipped)

    def _write(
        self,
        target: Path,
        passes: list[tuple[int, list[tuple[str, torch.Tensor, Any]]]],
        loose: list[tuple[str, torch.Tensor, Any]],
        skipped: Mapping[str, int],
    ) -> Path:
        """The run dir of :meth:`save`: all of it, or (on any failure) none of it."""
        from pydantic import ValidationError

        from ..config.settings import DEFAULT_ENV_PREFIX, DumpSettings
        from ..errors import ConfigError
        from ..store.format import RECORDS_FILE
        from .rundir import RunDir, model_fields
        from .writer import PassJob

        try:
            settings = DumpSettings.model_validate({"dir": str(target)})  # no env: this is a script's call
        except ValidationError as e:
            raise ValueError(
                f"save({str(target)!r}): {e.errors()[0]['msg'].splitlines()[-1].strip()}"
            ) from None
        captured = [(key, self._modules[name]) for key, name in self._by_key.items()]
        shared = shared_names(every_name(self.model), captured)
        fields = model_fields(self.model, type(self.model).__name__, captured, shared)
        warn = self._warn

        def quiet_write_error(key: str, message: str) -> None:  # raised below, not warned
            if key != "write_error":
                warn(key, message)

        try:
            rundir = RunDir(settings, DEFAULT_ENV_PREFIX, fields, quiet_write_error)  # type: ignore[arg-type]
        except ConfigError as e:
            raise OSError(f"save({str(target)!r}): {str(e).splitlines()[-1].strip()}") from None
        try:
            for index, entries in passes:
                rundir.writer.submit(PassJob(index, None, "full", entries, 0))
            if loose:
                rundir.writer.submit(PassJob(-1, None, "records", loose, 0, RECORDS_FILE))
            rundir.writer.close()
            if rundir.failure is not None:
                raise OSError(f"save(): {rundir.failure}; nothing was saved")
            rundir.finish(skipped, records_file=RECORDS_FILE if loose else None)
        except BaseException:
            rundir.writer.close()
            rundir.discard()
            raise
        return rundir.path

    def __repr__(self) -> str:
        state = "active" if self._hooks is not None else "inactive"
        return f"Capture({', '.join(f'{k}[{n}]' for n, k in self._requests)}, {state})"


def _save_target(directory: str | Path) -> Path:
    """The directory :meth:`Capture.save` writes under; a clear error for what cannot be one."""
    if not isinstance(directory, (str, os.PathLike)) or not str(directory).strip():
        raise ValueError(f"save(): expected a directory path, got {directory!r}")
    target = Path(directory).expanduser()
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(20, "exists and is not a directory", str(target))
    return target


def _host_entries(
    tensors: Mapping[str, torch.Tensor], skipped: collections.Counter[str]
) -> list[tuple[str, torch.Tensor, Any]]:
    """(key, contiguous CPU copy, no event) for a pass file: the writer writes host memory. A tensor
    a pass file cannot hold is counted in ``skipped["unsupported_tensor"]`` instead."""
    from .writer import storable

    kept = []
    for key, tensor in tensors.items():
        if storable(tensor):
            kept.append((key, tensor.detach().to("cpu", copy=True).contiguous(), None))
        else:
            skipped["unsupported_tensor"] += 1
    return kept


def _as_list(value: str | Iterable[str] | None) -> list[str]:
    """Accept one string or an iterable of strings (a bare string is one name, not its characters)."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    return list(value)


def _filter_matches(model: nn.Module, patterns: list[str]) -> list[str]:
    """Names of all (non-root) modules where any pattern ``re.search``-es the full dotted name: the
    candidates of ``MODULES=all``, narrowed as ``FILTER`` narrows them in ``attach()``."""
    try:
        chosen = regex_predicate(patterns)
    except re.error as err:
        raise ValueError(f"invalid filter pattern {err.pattern!r}: {err}") from err
    matches = [name for name, module in candidate_modules(model, "all") if chosen(name, module)]
    matches = [name for name in matches if name != ROOT_NAME]
    if not matches:
        raise ValueError(f"filter {patterns!r} matches no module of {type(model).__name__}")
    return matches


def capture(
    model: nn.Module,
    outputs: str | Iterable[str] | None = None,
    inputs: str | Iterable[str] | None = None,
    *,
    spec: str | None = None,
    filter: str | Iterable[str] | None = None,
    early_exit: bool = False,
    device: Device = None,
) -> Capture:
    """Capture inputs and/or outputs of named modules of ``model`` in memory.

    Args:
        model: any ``nn.Module``; names are those of ``model.named_modules()``.
        outputs: module names whose outputs to record.
        inputs: module names whose inputs to record as ``{"args": tuple, "kwargs": dict}``.
        spec: spec string such as ``"inputs[model.layers.0]|outputs[model.layers.0|model.layers.5]"``
            (see :func:`parse_spec`).
        filter: regexes; outputs of every module whose full dotted name ``re.search``-matches any of
            them are recorded.  The root module (empty name) is never matched.
        early_exit: in :meth:`Capture.run`, stop the forward as soon as every requested capture has
            fired once (see :class:`Capture` for the exact rule).
        device: where copies go; ``None`` leaves them on the device they were produced on.

    All sources are combined (union).  Unknown names raise ``KeyError`` listing the closest real
    names; an empty selection, a spec selecting nothing and invalid regexes raise ``ValueError``.
    Use the result as a context manager: hooks exist only inside its ``with`` block.
    """
    output_names = _as_list(outputs)
    input_names = _as_list(inputs)
    if spec is not None:
        parsed = parse_spec(spec)
        output_names += parsed.outputs
        input_names += parsed.inputs
    if filter is not None:
        output_names += _filter_matches(model, _as_list(filter))
    return Capture(
        model,
        outputs=dict.fromkeys(output_names),
        inputs=dict.fromkeys(input_names),
        early_exit=early_exit,
        device=device,
    )
