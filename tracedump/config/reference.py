"""What a graft reference (``GRAFT_FROM``) must hold, checked when the setting is read.

Why here, with the settings, and not only at ``attach()``: ``tracedump run --graft-from`` validates
the settings before it starts COMMAND (docs/run.md), so a reference that cannot graft (one dumped
without ``INPUTS=1``, in a stats mode, or with a pass file it cannot read) stops the launch with
exit 2 instead of a host that runs undumped; and ``attach()`` raises a
:class:`~tracedump.errors.ConfigError` that names the variable, as for every other setting. Only
the reference's manifests and headers are read (no tensor, no torch): ``tracedump arm`` loads the
settings too.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import DumpReadError
from ..store.format import INPUT_MARK, MANIFEST, parse_run_dir_name

if TYPE_CHECKING:
    from ..store.loader import Run


def reference_problem(run: Run) -> str | None:
    """Why ``run`` cannot be grafted from (a sentence for a person), or None when it can.
    Raises :class:`DumpReadError` for a pass file it cannot read."""
    settings = run.manifest.get("settings")
    if isinstance(settings, dict) and settings.get("mode") not in (None, "full"):
        return (
            f"it was dumped in {settings.get('mode')!r} mode; grafting needs whole tensors "
            "(MODE=full) with INPUTS=1"
        )
    if not any(INPUT_MARK in name for pass_file in run.passes.values() for name in pass_file.names):
        return (
            "it holds no module inputs; dump the reference with TRACEDUMP_DUMP_INPUTS=1 "
            "(tracedump run --inputs)"
        )
    return None


def check_graft_reference(path: Path) -> None:
    """Raise ``ValueError`` (the settings' message) unless some run of the dump at ``path`` can be
    grafted from; which run a host takes (its root, its rank) is decided, and checked, at
    ``attach()`` (:mod:`tracedump.dump.grafter`)."""
    from ..store.loader import open_dump

    try:
        problems = [reference_problem(run) for run in open_dump(path).runs]
    except (DumpReadError, OSError) as e:
        raise ValueError(f"cannot read the reference: {e}") from None
    if problems and all(problems):
        raise ValueError(str(problems[0]))


def written_into_reference(out: Path, reference: Path) -> Path | None:
    """Where a dump into ``out`` would land inside the dump read from ``reference`` (a dump dir
    or one of its run dirs), or None when it stays outside it. Links are resolved on both sides.

    A run dir is made *in* ``out``: ``out`` inside the reference's dump (the reference dir itself,
    or the folder that holds a reference run dir, which that run's dump is) adds a run to the dump
    being read, or writes among its files. A dump never writes into what it reads."""
    out_real = Path(os.path.realpath(os.path.expanduser(out)))
    ref_real = Path(os.path.realpath(os.path.expanduser(reference)))
    dump_root = ref_real.parent if _is_run_dir(ref_real) else ref_real
    return out_real if out_real.is_relative_to(dump_root) else None


def _is_run_dir(path: Path) -> bool:
    """A run dir (``rank<R>_pid<P>`` or a folder holding a manifest), not a dump dir of them."""
    return parse_run_dir_name(path.name) is not None or (path / MANIFEST).is_file()
