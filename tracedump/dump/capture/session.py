"""The capture session: :func:`capture` and the :class:`Capture` context manager it returns.

Why this module: it is the only part of ``capture()`` that holds state over time: the hooks (only
on the requested modules, only inside the ``with`` block), the recorder ``attach()`` runs with a
memory sink, the records, and early exit. What to capture is parsed in :mod:`.spec`, the structured
view is rebuilt in :mod:`.rebuild`, the dump is written in :mod:`.save`. (The module is not
called ``capture``: a submodule of that name would shadow the function ``capture`` in its package.)

Early exit raises a private ``BaseException`` from the last hook that still had to fire and catches
it in :meth:`Capture.run`: the only way to stop an arbitrary ``forward`` without touching its code.
"""

from __future__ import annotations

import collections
import dataclasses
import difflib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...errors import ConfigError
from ...store.format import RECORDS_FILE
from ..hooks import CallSites, HookSet
from ..passes import KeepPolicy
from ..recorder import Recorder
from ..rundir import ErrorLog
from ..runtime import Warner
from ..selection import display_name, every_name, shared_names
from ..sinks import MemorySink
from ..writer import PassJob
from .rebuild import rebuild
from .save import host_entries, save_target, write_run
from .spec import Kind, requested_names

__all__ = ["Capture", "Device", "ModuleCapture", "capture"]

Device = str | torch.device | None

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

    def cut_short(self, index: int, error: BaseException) -> None:
        """A run cut short by its own exception: the caller sees that exception; nothing to keep."""


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
            raise ConfigError("nothing to capture: pass outputs, inputs, spec or filter")
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
                entry = {"args": rebuild(tuple(args), copies), "kwargs": rebuild(dict(kwargs), copies)}
                self._records[name].inputs.append(entry)
            else:
                self._records[name].outputs.append(rebuild(value, copies))
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
        target = save_target(directory)
        self._sink.submit(
            PassJob(
                index=-1,
                part=None,
                mode="records",
                entries=self._recorder.loose,
                nbytes=0,
                file_name=RECORDS_FILE,
            )
        )
        self._recorder.loose = []
        skipped = collections.Counter(self._recorder.skipped)
        passes = [
            (index, host_entries(tensors, skipped)) for index, tensors in sorted(self._sink.passes.items())
        ]
        loose = host_entries(self._sink.loose, skipped)
        captured = [(key, self._modules[name]) for key, name in self._by_key.items()]
        return write_run(
            target,
            model=self.model,
            captured=captured,
            passes=passes,
            loose=loose,
            skipped=skipped,
            warn=self._warn,
        )

    def __repr__(self) -> str:
        state = "active" if self._hooks is not None else "inactive"
        return f"Capture({', '.join(f'{k}[{n}]' for n, k in self._requests)}, {state})"


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
            (see :func:`~tracedump.dump.capture.spec.parse_spec`).
        filter: regexes; outputs of every module whose full dotted name ``re.search``-matches any of
            them are recorded.  The root module (empty name) is never matched.
        early_exit: in :meth:`Capture.run`, stop the forward as soon as every requested capture has
            fired once (see :class:`Capture` for the exact rule).
        device: where copies go; ``None`` leaves them on the device they were produced on.

    All sources are combined (union).  Unknown names raise ``KeyError`` listing the closest real
    names; an empty selection, a spec selecting nothing and invalid regexes raise ``ValueError``.
    Use the result as a context manager: hooks exist only inside its ``with`` block.
    """
    names = requested_names(model, outputs, inputs, spec, filter)
    return Capture(model, outputs=names.outputs, inputs=names.inputs, early_exit=early_exit, device=device)
