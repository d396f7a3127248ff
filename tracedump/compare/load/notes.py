"""What a dump's own records say about its completeness, for ``tracedump diff`` to repeat.

A diff that exits 0 must not hide that one side holds less than it seems: a pass cut short by an
exception or Ctrl-C (``truncated_passes``), a dump that stopped early (``complete: false`` with its
``incomplete_reason``: a write error, a step that raised; or with none: a process killed, or a disk
that filled, before the manifest was finalised), the run-time ``errors`` it recorded, or
what the dumper flagged while running (``anomalies``: concurrent threads, compiled calls it could
not see). Read from the manifests and
pass-file metadata only; no tensor is touched.
"""

from __future__ import annotations

from typing import Any

from ...store.format import TRUNCATED_KEY
from .sources import RunSource, Side


def _run_notes(which: str, source: RunSource) -> list[str]:
    notes: list[str] = []
    if source.pass_file is not None:
        if source.pass_file.suffix != ".pt":
            from ...store.loader import open_pass

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
    notes.extend(_incomplete(which, source.name, manifest))
    anomalies = manifest.get("anomalies")
    if isinstance(anomalies, dict):
        notes.extend(f"{which} {source.name}: {text}" for text in anomalies.values() if isinstance(text, str))
    return notes


def _incomplete(which: str, name: str, manifest: dict[str, Any]) -> list[str]:
    """A dump that says it is incomplete (a write error stopped it, a step raised) with its reason,
    the files it dropped, and the run-time errors it recorded."""
    notes: list[str] = []
    reason = manifest.get("incomplete_reason")
    if manifest.get("complete") is False:
        skipped = manifest.get("skipped")
        dropped = skipped.get("dropped_files") if isinstance(skipped, dict) else None
        lost = f" ({dropped} files dropped)" if isinstance(dropped, int) and dropped else ""
        if not (isinstance(reason, str) and reason):  # the manifest was never finalised
            reason = (
                "its manifest was never finalised (complete: false, no reason): the process was "
                "killed, or the disk filled, before the dump closed; it may hold less than it seems"
            )
        notes.append(f"{which} {name}: the dump is incomplete{lost}: {reason}")
    errors = manifest.get("errors")
    if isinstance(errors, list):
        for error in errors[:5]:
            if isinstance(error, dict) and isinstance(error.get("message"), str):
                where, kind = error.get("where", "?"), error.get("type", "?")
                count = error.get("count")
                times = f" ({count} times)" if isinstance(count, int) and count > 1 else ""
                notes.append(f"{which} {name}: error at {where}: {kind}: {error['message'][:300]}{times}")
    return notes


def truncated_passes(source: RunSource) -> list[int]:
    """The passes a run's manifest says were cut short (their forward or step raised)."""
    manifest = source.run.manifest if source.run is not None else {}
    found = manifest.get("truncated_passes") if isinstance(manifest, dict) else None
    return [i for i in found if type(i) is int] if isinstance(found, list) else []


def side_notes(side: Side) -> list[str]:
    """One line per thing the side's dumps say they are missing or got wrong."""
    return [note for group in side.groups for source in group.runs for note in _run_notes(side.which, source)]
