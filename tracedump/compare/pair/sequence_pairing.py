"""``--align tokens``: each side's sequences read from its batches, and the sequences of two runs
paired (by seq id, else by the tokens they hold, else in order of first appearance), with what the
summary must say of them (recomputed positions, passes cut short, pairs sharing no position).
:mod:`.align` plans the pairs' tensors from here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...errors import SequenceError, UsageError
from ...store.sequences import Batch, SeqId, Sequence, sequences
from ..load.notes import truncated_passes
from ..load.sources import PassView, RootGroup, Side
from ..options import DiffOptions
from .plan import short_list, side_entries
from .unshard import SideEntry


@dataclass(kw_only=True)
class SideSequences:
    """One side's passes, batches and sequences, for one root group."""

    group: RootGroup
    batches: dict[int, Batch]
    sequences: dict[SeqId, Sequence]
    views: dict[int, list[PassView]] = field(default_factory=dict)
    entries: dict[int, dict[str, SideEntry]] = field(default_factory=dict)

    def view(self, index: int, options: DiffOptions) -> tuple[list[PassView], dict[str, SideEntry]]:
        if index not in self.views:
            self.views[index] = [run.open_pass(index) for run in self.group.runs]
            self.entries[index] = side_entries(self.views[index], options)
        return self.views[index], self.entries[index]

    def close(self) -> None:
        """Close every pass opened; a later :meth:`view` opens it again (``--baseline`` reads B's
        rows once more after the executor closed them)."""
        for views in self.views.values():
            for view in views:
                view.close()
        self.views, self.entries = {}, {}

    @property
    def declared(self) -> bool:
        return any(b.declared for b in self.batches.values())


@dataclass(frozen=True, kw_only=True)
class Alignment:
    """How the sequences of A and B were paired, and where the first divergence happened."""

    matched_by: str
    pairs: tuple[tuple[SeqId, SeqId], ...]
    only_in_a: tuple[SeqId, ...]
    only_in_b: tuple[SeqId, ...]
    first: dict[str, Any] | None = None
    notes: tuple[str, ...] = ()  # pairs that could not be compared, or look suspicious

    def to_json(self) -> dict[str, Any]:
        return {
            "matched_by": self.matched_by,
            "pairs": [[a, b] for a, b in self.pairs],
            "only_in_a": list(self.only_in_a),
            "only_in_b": list(self.only_in_b),
            "notes": list(self.notes),
            "first": self.first,
        }


def read_side(side: Side, group: RootGroup) -> SideSequences:
    if group.mode != "full":
        raise UsageError(
            f"--align tokens needs full dumps: {side.which} {side.path} is a {group.mode!r} dump "
            "(its records hold no rows per token)"
        )
    if group.is_pass_file:
        raise UsageError(f"--align tokens reads whole runs: give {side.which} as a dump or run dir")
    run = group.runs[0].run
    assert run is not None
    try:
        found = run.batches()
        return SideSequences(group=group, batches=found, sequences=sequences(found))
    except SequenceError as e:
        raise UsageError(f"{side.which} {side.path}: {e}") from e


def pair_sequences(a: SideSequences, b: SideSequences) -> tuple[str, list[tuple[SeqId, SeqId]], list[SeqId]]:
    """Pairs of (A's sequence, B's sequence), how they were matched, and A's sequences left
    without a counterpart on purpose (a second child of a prompt whose B sequence is taken).

    By seq id when both sides name their sequences and share ids. Else by tokens: two sequences
    whose known tokens agree at every prompt position (either side's) share a prompt; pairs are
    taken longest shared prefix first, then in order of first appearance (a parallel-sampling
    child whose request id comes first). A's sequences that share a prompt with a B sequence
    another child took stay unpaired, never paired by order; the rest (prompts that differ,
    tokens unknown) are paired in order of first appearance, so that a prompt one token off is
    reported as an input difference."""
    if a.declared and b.declared:
        common = [s for s in a.sequences if s in b.sequences]
        if common:
            return "seq id", [(s, s) for s in common], []
    order_a = {s: i for i, s in enumerate(a.sequences)}
    order_b = {s: i for i, s in enumerate(b.sequences)}
    candidates = []  # (shared prefix, A's order, B's order)
    for seq_a, sequence_a in a.sequences.items():
        for seq_b, sequence_b in b.sequences.items():
            shared = _shared_prompt(sequence_a, sequence_b)
            if shared is not None:
                candidates.append((-shared, order_a[seq_a], order_b[seq_b], seq_a, seq_b))
    if not candidates:
        return "order of first appearance", list(zip(a.sequences, b.sequences, strict=False)), []
    pairs: dict[SeqId, SeqId] = {}
    taken: set[SeqId] = set()
    sharing: set[SeqId] = set()  # A's sequences whose prompt some B sequence shares
    for _, _, _, seq_a, seq_b in sorted(candidates, key=lambda c: c[:3]):
        sharing.add(seq_a)
        if seq_a not in pairs and seq_b not in taken:
            pairs[seq_a] = seq_b
            taken.add(seq_b)
    children = [s for s in a.sequences if s in sharing and s not in pairs]
    rest_a = [s for s in a.sequences if s not in pairs and s not in sharing]
    rest_b = [s for s in b.sequences if s not in taken]
    ordered = sorted(pairs.items(), key=lambda p: order_a[p[0]])
    return "input_ids", ordered + list(zip(rest_a, rest_b, strict=False)), children


def _shared_prompt(a: Sequence, b: Sequence) -> int | None:
    """How far two sequences' tokens agree (the first position where they differ, or the end of
    what both know), when they agree at every prompt position both know and share one at least;
    else None."""
    known = sorted(set(a.input_ids) & set(b.input_ids))
    if not known:
        return None
    differ = next((p for p in known if a.input_ids[p] != b.input_ids[p]), None)
    if differ is None:
        return known[-1] + 1
    if a.is_prompt(differ) or b.is_prompt(differ) or differ == known[0]:
        return None
    return differ


def pair_notes(
    a: SideSequences, b: SideSequences, pairs: list[tuple[SeqId, SeqId]], matched_by: str
) -> list[str]:
    """What the summary must say of the pairs: none shares a position, or (paired by order) their
    lengths differ, which usually means the order is not the same request order."""
    notes = []
    for seq_a, seq_b in pairs:
        held_a, held_b = a.sequences[seq_a].rows, b.sequences[seq_b].rows
        if not set(held_a) & set(held_b):
            notes.append(
                f"sequence {seq_a} (B: {seq_b}) shares no position: A holds {_span(held_a)}, "
                f"B holds {_span(held_b)}"
            )
        elif matched_by.startswith("order") and len(held_a) != len(held_b):
            notes.append(
                f"paired by order, sequence {seq_a} ({len(held_a)} positions) and B's {seq_b} "
                f"({len(held_b)}) differ in length: are the requests in the same order? "
                "(set_batch with input_ids on both sides pairs them by tokens)"
            )
    return notes


def _span(rows: dict[int, Any]) -> str:
    positions = sorted(rows)
    return f"{positions[0]}-{positions[-1]}" if positions else "nothing"


def check_passes(options: DiffOptions, side: SideSequences) -> None:
    """``--pass`` under ``--align tokens`` names A's steps (engine steps): the rows those steps
    computed are compared. A step A does not have is exit 2, as a pass not in the dumps is."""
    if options.passes is None:
        return
    absent = options.passes.missing(sorted(side.batches))
    if absent:
        raise UsageError(
            f"--pass {absent}: A has no such step with token rows (steps: "
            f"{short_list(sorted(side.batches))}); with --align tokens, --pass chooses A's steps "
            "whose rows are compared"
        )


def recompute_notes(which: str, side: SideSequences) -> list[str]:
    """One note per sequence whose positions a later step computed again (preemption)."""
    notes = []
    for sequence in side.sequences.values():
        for position, index in sequence.recomputed:
            notes.append(
                f"{which}: sequence {sequence.seq_id} computed again from position {position} in pass "
                f"{index} (preemption with recompute): its recomputation is compared"
            )
    return notes


def cut_truncated(which: str, side: SideSequences) -> list[str]:
    """A pass cut short (its step raised, Ctrl-C) holds part of a forward: no row of it, nor any
    later row of a sequence it held, is compared (each sequence is cut before its first row there)."""
    truncated = {i for run in side.group.runs for i in truncated_passes(run)}
    notes = []
    for seq, sequence in list(side.sequences.items()):
        cut = next((p for p in sequence.positions if sequence.rows[p][0] in truncated), None)
        if cut is None:
            continue
        side.sequences[seq] = sequence.before(cut)
        notes.append(
            f"{which}: pass {sequence.rows[cut][0]} was cut short (its step raised): sequence {seq} "
            f"is compared before position {cut} only"
        )
    return notes
