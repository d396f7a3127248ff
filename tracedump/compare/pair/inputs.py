"""Inputs first: aligned sequences that were fed different token ids are reported before any number.

The most common cause of "vLLM differs from HF" is not a kernel but the prompt: a tokenizer or
chat-template difference, a doubled or missing BOS. Every tensor downstream then differs, and the
first of them (``embed_tokens``) would be named as the first divergence, which sends the user to
the wrong place. So the token ids each side recorded (``set_batch``'s ``input_ids``, or the batch
layout read from an HF model's ``input_ids``) are compared first; when they differ, the report
says ``inputs differ: seq S, position P: token 1 vs 2``, exits 1 and names no module.
"""

from __future__ import annotations

from typing import Any

from ...errors import SequenceError
from ...store.sequences import Batch, SeqId, Sequence
from ..load.sources import Side
from .plan import Plan


def first_token_difference(a: Sequence, b: Sequence) -> tuple[int, int, int] | None:
    """(position, A's token, B's token) at the first position both know the token of and where they
    differ; None when they agree wherever both know it."""
    for position in sorted(set(a.input_ids) & set(b.input_ids)):
        if a.input_ids[position] != b.input_ids[position]:
            return position, a.input_ids[position], b.input_ids[position]
    return None


def sequence_finding(seq_a: SeqId, seq_b: SeqId, a: Sequence, b: Sequence) -> dict[str, Any] | None:
    """The first token that differs between one aligned pair of sequences, if any, with its
    ``kind``: ``prompt`` when either side holds that position as a prompt token (a tokenizer, BOS
    or chat-template difference: inputs differ, no module is to blame), else ``generated`` (both
    sides fed back a token they sampled: the consequence of an earlier divergence, or of sampling;
    compare/pair/align.py compares what came before it). A sequence's prompt is told from its batch
    layout (:attr:`~tracedump.store.sequences.Sequence.prompt_end`)."""
    found = first_token_difference(a, b)
    if found is None:
        return None
    position, token_a, token_b = found
    kind = "prompt" if a.is_prompt(position) or b.is_prompt(position) else "generated"
    return {
        "sequence": seq_a,
        "sequence_b": seq_b,
        "position": position,
        "a": token_a,
        "b": token_b,
        "kind": kind,
    }


def describe(finding: dict[str, Any]) -> str:
    """``inputs differ: seq 0, position 0: token 1 vs 2`` (B's seq id too when it is another)."""
    seq = f"seq {finding['sequence']}"
    if finding.get("sequence_b") is not None and finding["sequence_b"] != finding["sequence"]:
        seq += f" (B: {finding['sequence_b']})"
    where = f"pass {finding['pass']}, " if "pass" in finding else ""
    return (
        f"inputs differ: {where}{seq}, position {finding['position']}: token {finding['a']} vs {finding['b']}"
    )


def describe_output_change(finding: dict[str, Any]) -> str:
    """``greedy output changed at seq S position P: X vs Y, after the first divergence at ...``."""
    seq = f"seq {finding['sequence']}"
    if finding.get("sequence_b") is not None and finding["sequence_b"] != finding["sequence"]:
        seq += f" (B: {finding['sequence_b']})"
    text = f"greedy output changed at {seq} position {finding['position']}: {finding['a']} vs {finding['b']}"
    after = finding.get("after")
    if after is not None:
        where = f"{after['sequence']}, position {after['position']}, step {after['step']}, {after['name']}"
        return f"{text}, after the first divergence at {where}"
    return (
        f"{text}, with no divergence before it (every row computed before that token is within "
        "tolerance: a near-tie of the logits, or sampling that is not greedy); what followed it is "
        "not compared"
    )


def _batches(side: Side, label: str | None) -> dict[int, Batch]:
    for group in side.groups:
        if label is not None and group.label != label:
            continue
        run = group.runs[0].run
        if run is None:
            return {}
        try:
            return run.batches()
        except SequenceError:
            return {}
    return {}


def inputs_differ_by_pass(side_a: Side, side_b: Side, plan: Plan) -> list[dict[str, Any]]:
    """``--align passes``: for each compared pass whose two batch layouts both carry token ids, row
    for row, the first row where they differ (only when both hold the same number of rows)."""
    found: list[dict[str, Any]] = []
    single = len(side_a.groups) == 1 and len(side_b.groups) == 1
    cache: dict[tuple[str, str | None], dict[int, Batch]] = {}

    def layouts(which: str, side: Side, label: str | None) -> dict[int, Batch]:
        # built once per side and root: every pass's layout comes from one read of the run (a
        # setdefault's default, built anew for each pass, made the diff quadratic in the passes)
        if (which, label) not in cache:
            cache[which, label] = _batches(side, label)
        return cache[which, label]

    for unit in plan.units:
        label = None if single else unit.root
        batches_a = layouts("A", side_a, label)
        batches_b = layouts("B", side_b, label)
        a, b = batches_a.get(unit.pass_a), batches_b.get(unit.pass_b)
        if a is None or b is None or a.input_ids is None or b.input_ids is None:
            continue
        if len(a.input_ids) != len(b.input_ids):
            continue
        pairs = zip(a.input_ids, b.input_ids, a.seq_ids, b.seq_ids, strict=True)
        row = next(
            (i for i, (x, y, s, t) in enumerate(pairs) if x != y and s is not None and t is not None), None
        )  # padding rows (seq None) hold no input
        if row is not None:
            found.append(
                {
                    "pass": unit.pass_a,
                    "sequence": a.seq_ids[row],
                    "sequence_b": b.seq_ids[row],
                    "position": a.positions[row],
                    "a": a.input_ids[row],
                    "b": b.input_ids[row],
                }
            )
    return found
