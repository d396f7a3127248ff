"""Grafting: run each chosen module on the reference's own inputs, so its output error is its own.

``tracedump diff`` of two ordinary dumps judges *propagated* error: every tensor carries whatever
went wrong upstream. A grafted run instead feeds each grafted module, at each call, the inputs the
reference dump captured for that module, pass and call (``INPUTS=1``: ``name@in[0]``,
``name@in[kw]``, ``::callN``), cast to the dtype and device the module under test was about to
receive. Its output then differs from the reference's by what that module alone adds: its *local*
error, judged by :mod:`tracedump.compare.judge.local` without a growth allowance or a baseline::

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

Layout: this module is the public entry (:func:`graft`, :class:`Graft`), a
:class:`~tracedump.dump.dumper.Dumper` with ``GRAFT_FROM`` set; the hooks that replace the inputs
are :mod:`tracedump.dump.grafter`'s, which the dumper wires in. A module whose call takes the
reference's values in another form (an engine's decoder layer with a deferred residual) is fed as
an engine integration describes it (:mod:`tracedump.dump.graft_feed`, ``Dumper.set_graft_feeds``).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from torch import nn

from ..config.settings import settings_of_call
from ..store.fsio import scratch_dir
from .dumper import Dumper
from .grafter import LEAVES, Grafter

__all__ = ["Graft", "graft"]


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
        if self.dumper is not None:
            raise RuntimeError("this graft is already active")
        try:
            self.dumper = Dumper(self.model, settings_of_call(self._settings))  # no env: a script's call
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
        if self.dumper is None or self.dumper.closed:
            raise RuntimeError("Graft.run() must be called inside the `with tracedump.graft(...)` block")
        with self.dumper.step():
            return self.model(*args, **kwargs)

    def save(self, directory: str | Path) -> Path:
        """Copy the finished run dir under ``directory``; returns the copy's path."""
        if self.dumper is None or not self.dumper.closed:
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
    shadow: bool = True,
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
        shadow: run each grafted call again in float32 (``GRAFT_SHADOW``, :mod:`.shadow`), so the
            diff judges logic and rounding apart; False: the counting rule only.

    A bad reference, level or map raises :class:`tracedump.ConfigError` before any hook exists.
    """
    temporary = None
    if dir is None:
        temporary = scratch_dir("tracedump-graft-")
        dir = temporary
    settings: dict[str, Any] = {
        "dir": str(dir),
        "modules": modules,
        "inputs": inputs,
        "graft_from": str(reference),
        "graft_level": level,
        "graft_map": list(maps) or None,
        "graft_shadow": shadow,
    }
    if filter is not None:
        settings["filter"] = [filter] if isinstance(filter, str) else list(filter)
    return Graft(model, {k: v for k, v in settings.items() if v is not None}, temporary)
