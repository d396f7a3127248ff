"""The structured view of a capture: a module's output (or inputs) rebuilt with the recorder's copies.

Why a module of its own: the recorder keeps flat tensor leaves under keys, which is what a dump
holds; a script wants the object the module returned. This walk is the inverse of
:func:`tracedump.dump.hooks.flatten_tensors` and must visit leaves in the same order; it touches no
hook and no recorder state.
"""

from __future__ import annotations

import collections.abc
import copy
import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ..hooks import MAX_DEPTH

__all__ = ["rebuild"]


def rebuild(obj: Any, copies: Iterator[torch.Tensor], depth: int = 0) -> Any:
    """``obj`` with each tensor leaf replaced by the recorder's copy of it.

    Walks in the order :func:`tracedump.dump.hooks.flatten_tensors` named the leaves (mappings by their
    items, sequences by index, dataclasses by field), so the n-th copy lands where the n-th leaf
    was. Tuples, lists, dicts, namedtuples, dataclasses and HF ``ModelOutput`` keep their type;
    any other leaf (ints, strings, ``None``, cache objects) is kept as the same object. Raises
    ``StopIteration`` when ``copies`` runs out (the recorder kept fewer leaves than ``obj`` holds).
    """
    if isinstance(obj, torch.Tensor):
        return next(copies)
    if depth >= MAX_DEPTH:
        return obj
    if isinstance(obj, Mapping):
        return _rebuild_mapping(obj, {key: rebuild(value, copies, depth + 1) for key, value in obj.items()})
    if isinstance(obj, tuple):
        items = [rebuild(item, copies, depth + 1) for item in obj]
        if hasattr(obj, "_fields"):  # namedtuple
            return type(obj)(*items)
        return tuple(items) if type(obj) is tuple else _rebuild_sequence(obj, items, tuple)
    if isinstance(obj, list):
        items = [rebuild(item, copies, depth + 1) for item in obj]
        return items if type(obj) is list else _rebuild_sequence(obj, items, list)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        new = copy.copy(obj)
        for field in dataclasses.fields(obj):
            object.__setattr__(new, field.name, rebuild(getattr(obj, field.name), copies, depth + 1))
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
