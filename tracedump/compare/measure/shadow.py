"""A grafted run's fp32 shadow, measured: what each local tensor's error is made of.

A grafted run with its shadow on (``GRAFT_SHADOW``, :mod:`tracedump.dump.shadow`) stores beside
each tensor ``KEY`` of a grafted call its float32 shadow ``shadow~KEY`` (the same module, upcast,
run on the reference's own inputs) and ``shadow-noise~KEY`` (what moving the weights within the
run dtype's rounding changes in that shadow). For every planned tensor pair of A and B this module
measures, with the pair's own pairing (bridge splits, unsharding, last-row cuts):

- ``rounding``: the run against its own shadow, what the run's narrow dtype did;
- ``logic``: the shadow against the reference, what the module's code does differently, plus the
  rounding of the weights to the run's dtype;
- ``weights``: that weight rounding's size, measured on the shadow (``shadow-noise~KEY``: the
  largest of its draws);
- ``routed_otherwise``: an integer tensor (a router's top-k) of the shadow that differs from the
  reference's: the shadow took other experts at a near-tie, so what follows in that grafted
  module is not judged by the shadow;
- ``unfit``: a shadow whose shape or kind of dtype is not its tensor's (a transposed or hand-made
  ``shadow~KEY``) is not used, never compared element by element: the tensor is judged as if it
  had no shadow, by the counting rule, with this reason.

Measured by the one executor (:mod:`.execute`), pair by pair, with the pair's own reading; a shadow
that cannot be read is reported on its row and in the report's notes. The judging itself is
:func:`tracedump.compare.judge.judge.judge` (the shadow's allowances:
:mod:`tracedump.compare.judge.allowance`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ...store.dtypes import BY_NAME
from ...store.format import SHADOW_NOISE_PREFIX, SHADOW_PREFIX
from ..load.reader import Stored
from ..load.sources import PassView
from ..pair.plan import PairPlan
from ..pair.unshard import SideEntry, assemble
from .metrics import compare_arrays


@dataclass(frozen=True, kw_only=True)
class ShadowMeasure:
    """One tensor's error split by the shadow; (rel_diff, 1 - cosine) each, None where unknown."""

    rounding: tuple[float, float] | None = None  # the run vs its shadow
    logic: tuple[float, float] | None = None  # the shadow vs the reference
    weights: tuple[float, float] | None = None  # the shadow vs itself with the weights moved
    routed_otherwise: bool = False  # an integer tensor of the shadow differs from the reference's
    unfit: str | None = None  # why the shadow is not used: its shape or dtype is not the tensor's


def _renamed(entry: SideEntry, prefix: str) -> SideEntry:
    return replace(entry, name=prefix + entry.name, parts=tuple(_renamed(p, prefix) for p in entry.parts))


def _names(entry: SideEntry) -> list[str]:
    return [entry.name] if not entry.parts else [n for p in entry.parts for n in _names(p)]


def _has(entry: SideEntry, prefix: str, views: list[PassView]) -> bool:
    return all(any(prefix + name in view.shadow for view in views) for name in _names(entry))


def _pair_of(metrics: object) -> tuple[float, float]:
    return (float(metrics.rel_diff), float(metrics.one_minus_cosine))  # type: ignore[attr-defined]


def _weights(entry: SideEntry, views: list[PassView]) -> tuple[float, float] | None:
    """The weight rounding's size of a plain entry (one name, one rank); None for a derived one."""
    if entry.parts or len(views) != 1 or not _has(entry, SHADOW_NOISE_PREFIX, views):
        return None
    values = np.asarray(views[0].array(SHADOW_NOISE_PREFIX + entry.name).array, dtype=np.float64)
    draws = values.reshape(-1, 2) if values.size and values.size % 2 == 0 else None
    if draws is None or not np.isfinite(draws).all():
        return None
    largest = draws.max(axis=0)  # one draw (a dump before several) or the largest of several
    return (float(largest[0]), float(largest[1]))


def _kind(stored: Stored) -> str:
    """What kind of values a tensor holds: a float shadow stands for a float tensor of any width,
    an integer shadow (a router's top-k) for an integer tensor only."""
    known = BY_NAME.get(stored.dtype)
    if known is not None:
        return "exact" if known.integer else known.kind
    return "exact" if np.issubdtype(stored.array.dtype, np.integer) or stored.array.dtype == bool else "float"


def _unfit(run: Stored, shadow: Stored) -> str | None:
    """Why ``shadow`` cannot stand for ``run`` (None when it can): another shape, or another kind."""
    if shadow.shape != run.shape:
        return f"its shadow's shape {list(shadow.shape)} is not the tensor's {list(run.shape)}"
    if _kind(shadow) != _kind(run):
        return f"its shadow's dtype {shadow.dtype} does not fit the tensor's {run.dtype}"
    return None


def measure_shadow(pair: PairPlan, views_a: list[PassView], views_b: list[PassView]) -> ShadowMeasure | None:
    """The pair's A tensor against its shadow and the shadow against B; None when A holds no
    shadow of it. Raises what reading raises: the executor reports it, never drops it."""
    if pair.kind != "tensor" or not _has(pair.a, SHADOW_PREFIX, views_a):
        return None
    shadow = assemble(_renamed(pair.a, SHADOW_PREFIX), views_a)
    run = assemble(pair.a, views_a)
    unfit = _unfit(run, shadow)
    if unfit is not None:
        return ShadowMeasure(unfit=unfit)
    reference = assemble(pair.b, views_b)
    if _kind(shadow) == "exact":
        same = shadow.array.shape == reference.array.shape and np.array_equal(shadow.array, reference.array)
        return ShadowMeasure(routed_otherwise=not same)
    return ShadowMeasure(
        rounding=_pair_of(compare_arrays(run, shadow)),
        logic=_pair_of(compare_arrays(shadow, reference)),
        weights=_weights(pair.a, views_a),
    )
