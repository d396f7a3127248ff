"""The CUDA-graph replay watch: ``COMPILED`` taps inside a captured graph reach the dump at replay.

A CUDA graph replays kernels, not Python: a ``tracedump::tap`` captured into a graph runs its
Python once, at capture, where it keeps buffers the graph's replays refresh
(:class:`~.taps.GraphTaps`). Something must say when a capture ends and when a replay is done.
Every engine's graph runner goes through the Python class ``torch.cuda.CUDAGraph``
(``torch/cuda/graphs.py``: ``torch.cuda.graph`` calls its ``capture_end``; vLLM's
``CUDAGraphWrapper``, SGLang's runners and inductor's cudagraph trees call its ``replay``), so
while at least one ``COMPILED`` dumper is open that class's two methods are wrapped:

- after ``capture_end``: ``target.graph.captured(graph)`` for every open ``COMPILED`` target (the
  taps made during the capture now belong to that graph; a capture that raised drops them);
- after ``replay``: ``target.graph.replayed(graph)``: its taps run as they would have in the
  compiled code (pass edges and captures), with this replay's values.

Reference-counted: the first ``COMPILED`` dumper installs the wrappers, the last one to close takes
its own layer off: the exact attributes it found come back, unless another library wrapped the
methods after tracedump did; then its wrapper stays and ours, under it, is switched to
pass-through (removing it would drop theirs). Off means off: without ``COMPILED`` nothing is patched. The
wrappers never raise into the host: a failure of tracedump's part is reported through the
target's ``report`` (the manifest's ``errors``, one warning); the graph's own exceptions pass
through unchanged. The class is looked up at install time and may be given (tests use a fake one
on CPU); a torch without it installs nothing.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable
from typing import Any

import torch

from .taps import TapTarget

__all__ = ["graph_class", "unwatch", "watch", "watched_class"]

WRAPPED = ("capture_end", "replay")
# Our wrappers, each with whether it is active (False: pass-through). By identity, not by a mark on
# the function: a wrapper another library makes with functools.wraps copies a function's attributes.
_LAYERS: dict[Callable[..., Any], bool] = {}
_UNDER: dict[Callable[..., Any], Any] = {}  # each of ours -> the class attribute it was put over
_ABSENT = object()  # the class inherited the method: put back by deleting ours

_lock = threading.Lock()
_targets: dict[int, TapTarget] = {}  # serial -> the open COMPILED dumpers' targets
_patched: tuple[type, dict[str, Any]] | None = None  # the class wrapped, and what it held before


def graph_class() -> type | None:
    """``torch.cuda.CUDAGraph`` as this process sees it now (a CPU-only torch has a placeholder
    class, which is patched the same way and never instantiated), or None where there is none."""
    cuda = getattr(torch, "cuda", None)
    cls = getattr(cuda, "CUDAGraph", None)
    return cls if isinstance(cls, type) else None


def watched_class() -> type | None:
    """The class whose methods are wrapped now (None when nothing is)."""
    return _patched[0] if _patched is not None else None


def watch(target: TapTarget, cls: type | None = None) -> None:
    """``target``'s graphs are followed from now on; the first target installs the wrappers on
    ``cls`` (default :func:`graph_class`). Never raises: a class that cannot be patched is
    reported through ``target.report`` and leaves CUDA graphs unwatched."""
    global _patched
    with _lock:
        _targets[target.serial] = target
        if _patched is not None:
            return
        cls = cls if cls is not None else graph_class()
        if cls is None:
            return
        try:
            _patched = (cls, _install(cls))
        except Exception as e:
            target.report("CUDA graph watch", e)


def unwatch(target: TapTarget) -> None:
    """``target``'s dumper closed; the last one out restores the class as it was."""
    global _patched
    with _lock:
        _targets.pop(target.serial, None)
        if _targets or _patched is None:
            return
        cls, saved = _patched
        _patched = None
        _restore(cls, saved)


def _install(cls: type) -> dict[str, Any]:
    """Wrap the class's methods; what each held before (restored at the last :func:`unwatch`).
    A wrapper of ours left dormant by an earlier :func:`_restore` (another library had wrapped
    over it) and outermost again is switched back on instead of wrapped over."""
    saved = {name: cls.__dict__.get(name, _ABSENT) for name in WRAPPED}
    try:
        for name, make in (("capture_end", _capture_end), ("replay", _replay)):
            current = cls.__dict__.get(name)
            if current in _LAYERS:
                _LAYERS[current] = True  # ours, dormant: active again, no second layer
                saved[name] = _UNDER[current]
            else:
                layer = make(getattr(cls, name))
                _UNDER[layer] = saved[name]
                setattr(cls, name, layer)
    except BaseException:
        _restore(cls, saved)
        raise
    return saved


def _restore(cls: type, saved: dict[str, Any]) -> None:
    """Take our layer off each method. Outermost, it is replaced by what it wrapped; under a
    wrapper another library put on afterwards, it stays (removing it would drop theirs) and is
    switched off: it then only calls through."""
    for name, value in saved.items():
        current = cls.__dict__.get(name)
        if current not in _LAYERS:  # not ours (another layer on top, or gone)
            _switch_off(current)
            continue
        del _LAYERS[current], _UNDER[current]
        if value is _ABSENT:
            delattr(cls, name)
        else:
            setattr(cls, name, value)


def _switch_off(method: Any, depth: int = 0) -> None:
    """Our wrapper somewhere under ``method`` (followed through ``__wrapped__``): pass-through."""
    while method is not None and depth < 32:
        if method in _LAYERS:
            _LAYERS[method] = False
            return
        method = getattr(method, "__wrapped__", None)
        depth += 1


def _capture_end(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def capture_end(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not _LAYERS.get(capture_end):
            return original(self, *args, **kwargs)
        try:
            result = original(self, *args, **kwargs)
        except BaseException:
            _each("CUDA graph capture", lambda target: target.graph.abandon())
            raise
        _each("CUDA graph capture", lambda target: _captured(target, self))
        return result

    _LAYERS[capture_end] = True
    return capture_end


def _replay(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def replay(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        if _LAYERS.get(replay):
            _each("CUDA graph replay", lambda target: target.graph.replayed(self))
        return result

    _LAYERS[replay] = True
    return replay


def _captured(target: TapTarget, graph: Any) -> None:
    target.graph.captured(graph)
    if target.changed is not None:
        target.changed()


def _each(where: str, action: Callable[[TapTarget], Any]) -> None:
    """``action`` on every open target; a failure is that target's to report, never the host's."""
    for target in list(_targets.values()):
        try:
            action(target)
        except Exception as e:
            with contextlib.suppress(Exception):  # a failing report: nothing left to tell, never the host
                target.report(where, e)
