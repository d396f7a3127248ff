"""What a dump's own records say about its completeness, for ``tracedump diff`` to repeat.

A diff that exits 0 must not hide that one side holds less than it seems: a pass cut short by an
exception or Ctrl-C (``truncated_passes``), or what the dumper flagged while running
(``anomalies``: concurrent threads, compiled calls it could not see). Read from the manifests and
pass-file metadata only; no tensor is touched.
"""

from __future__ import annotations

from typing import Any

from ..store.format import TRUNCATED_KEY
from .sources import RunSource, Side


def _run_notes(which: str, source: RunSource) -> list[str]:
    notes: list[str] = []
    if source.pass_file is not None:
        if source.pass_file.suffix != ".pt":
            from ..store.loader import open_pass

            if open_pass(source.pass_file).metadata.get(TRUNCATED_KEY) == "true":
                notes.append(f"{which} {source.name}: the pass was cut short (truncated)")
        return notes
    manifest: dict[str, Any] = source.run.manifest if source.run is not None else {}
    truncated = manifest.get("truncated_passes")
    if isinstance(truncated, list) and truncated:
        shown = ", ".join(str(i) for i in truncated[:10]) + (", ..." if len(truncated) > 10 else "")
        notes.append(
            f"{which} {source.name}: pass(es) {shown} cut short (truncated): their forward did not finish"
        )
    anomalies = manifest.get("anomalies")
    if isinstance(anomalies, dict):
        notes.extend(f"{which} {source.name}: {text}" for text in anomalies.values() if isinstance(text, str))
    return notes


def side_notes(side: Side) -> list[str]:
    """One line per thing the side's dumps say they are missing or got wrong."""
    return [note for group in side.groups for source in group.runs for note in _run_notes(side.which, source)]
