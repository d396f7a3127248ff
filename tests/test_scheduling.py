"""An engine's scheduling against a reference, by sequence: coverage stated
and enforced, causes before consequences (a generated token that differs is the consequence of an
earlier divergence, a prompt token that differs is an input difference), preemption with
recompute, parallel sampling, a step that raised, ``--pass`` under ``--align tokens``.

Synthetic engine dumps: a tiny embedding + two linear layers, each step's rows declared with
``set_batch`` (sequence, position, token id) as the vLLM plugin declares them, so every batch layout
(prefill rows, one-row decode steps, a recomputation) is built exactly as the test needs it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import tracedump
from tracedump.cli import main
from tracedump.compare import compare
from tracedump.errors import UsageError

Row = tuple[object, int, int]  # (sequence, position, token id)


class Tiny(nn.Module):
    """Token ids in, one row per token out: the rows of a sequence depend on its own tokens only."""

    def __init__(self, bug: float = 1.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(64, 16)
        self.layer = nn.Linear(16, 16)
        self.head = nn.Linear(16, 16)
        self.logits = nn.Linear(16, 8)  # one row per sequence of a step: its last row's (sampled)
        with torch.no_grad():
            self.layer.weight.mul_(bug)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.layer(self.embed(ids))))


def dump(out: Path, steps: list[list[Row]], bug: float = 1.0, raise_at: int | None = None) -> Path:
    """One ``dumper.step()`` per step, its rows declared by ``set_batch``; ``raise_at``: that step's
    forward raises after the embedding ran (a crashed engine step)."""
    model = Tiny(bug)
    dumper = tracedump.attach(model, {"dir": str(out), "modules": "all"})
    assert dumper is not None
    with torch.no_grad():
        for index, rows in enumerate(steps):
            ids = torch.tensor([token for _, _, token in rows])
            try:
                with dumper.step():
                    dumper.set_batch(
                        seq_ids=[s for s, _, _ in rows],
                        positions=[p for _, p, _ in rows],
                        input_ids=ids.tolist(),
                    )
                    if index == raise_at:
                        model.embed(ids)
                        raise RuntimeError("engine step failed")
                    hidden = model(ids)
                    seqs = [s for s, _, _ in rows]
                    last = [max(i for i, t in enumerate(seqs) if t == s) for s in dict.fromkeys(seqs)]
                    model.logits(hidden[last])
            except RuntimeError:
                assert index == raise_at
                break
    dumper.close()
    return out


def generate(seq: object, prompt: list[int], generated: list[int], start: int = 0) -> list[list[Row]]:
    """A prefill step, then one decode step per generated token fed back (the last is never fed)."""
    steps = [[(seq, p, t) for p, t in enumerate(prompt)]]
    steps += [[(seq, len(prompt) + i, t)] for i, t in enumerate(generated[:-1])]
    return steps


PROMPT = [1, 5, 9, 23, 44]
TOKENS = [7, 8, 3, 12]  # greedy output of the reference


def merge(*runs: list[list[Row]]) -> list[list[Row]]:
    """Several sequences' steps batched together, step by step (continuous batching)."""
    longest = max(len(r) for r in runs)
    return [[row for run in runs if i < len(run) for row in run[i]] for i in range(longest)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return dump(tmp_path_factory.mktemp("ref") / "ref", generate(0, PROMPT, TOKENS))


def _json(tmp_path: Path, *args: str) -> tuple[int, str, dict[str, object]]:
    out = tmp_path / "report.json"
    code = main(["diff", *args, "--align", "tokens", "--json", str(out)])
    return code, "", json.loads(out.read_text()) if out.exists() else {}


# ----------------------------------------------------------------------- causes before consequences


def test_a_bug_that_flips_a_generated_token_is_named_before_the_token(
    reference: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flipped = [7, 8, 30, 31]  # the bug changed the third greedy token, fed back at position 7
    buggy = dump(tmp_path / "a", generate(0, PROMPT, flipped), bug=1.05)
    out = tmp_path / "report.json"
    code = main(["diff", str(buggy), str(reference), "--align", "tokens", "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 1
    summary = json.loads(out.read_text())["summary"]
    assert summary["inputs_differ"] == []  # a generated position: a consequence, not an input
    (change,) = summary["output_changed"]
    assert (change["position"], change["a"], change["b"], change["kind"]) == (7, 30, 3, "generated")
    assert change["step"] == 2  # the step whose row 6 sampled it
    first = summary["alignment"][0]["first"]
    assert (first["name"], first["step"], first["position"]) == ("layer", 0, 0)
    assert change["after"] == first
    assert summary["first_divergence"]["name"] == "layer"
    assert (
        "greedy output changed at seq 0 position 7: 30 vs 3, after the first divergence at seq 0, " in printed
    )
    tensors = json.loads(out.read_text())["tensors"]
    assert tensors and all(max(t["per_token"]["positions"]) < 7 for t in tensors)  # nothing fed 30


def test_a_generated_token_that_differs_with_no_divergence_before_it_passes_and_says_so(
    reference: Path, tmp_path: Path
) -> None:
    other = dump(tmp_path / "a", generate(0, PROMPT, [7, 9, 2, 2]))  # sampled, not greedy: no bug
    report = compare(other, reference, align="tokens")
    assert report.exit_code == 0 and report.inputs_differ == []
    (change,) = report.output_changed
    assert change["position"] == 6 and change["after"] is None
    assert all(max(r.positions or ()) < 6 for r in report.results)


def test_a_prompt_token_that_differs_is_an_input_difference_naming_no_module(
    reference: Path, tmp_path: Path
) -> None:
    bos = dump(tmp_path / "a", generate(0, [2, *PROMPT[1:]], TOKENS), bug=1.05)
    report = compare(bos, reference, align="tokens")
    assert report.exit_code == 1 and report.first_divergence is None and report.output_changed == []
    (finding,) = report.inputs_differ
    assert (finding["position"], finding["a"], finding["b"], finding["kind"]) == (0, 2, 1, "prompt")


def test_the_prompt_is_told_by_either_side_s_layout(tmp_path: Path) -> None:
    # A's prompt is one token longer: position 5 is A's prompt token and B's first generated one
    a = dump(tmp_path / "a", generate(0, [*PROMPT, 40], TOKENS))
    b = dump(tmp_path / "b", generate(0, PROMPT, TOKENS))
    report = compare(a, b, align="tokens")
    assert [f["position"] for f in report.inputs_differ] == [5] and report.output_changed == []


# ----------------------------------------------------------------------- the engine's scheduling


def test_preemption_with_recompute_compares_the_recomputation(reference: Path, tmp_path: Path) -> None:
    steps = generate(0, PROMPT, TOKENS)  # prefill 0-4, decode 5, 6, 7
    preempted = [*steps[:3], [(0, p, t) for p, t in enumerate([*PROMPT, *TOKENS[:2]])], steps[3]]
    a = dump(tmp_path / "a", preempted)
    report = compare(a, reference, align="tokens")
    assert report.exit_code == 0, [r.message for r in report.results if r.status != "ok"]
    notes = "\n".join(report.alignment_lines)
    assert "sequence 0 computed again from position 0 in pass 3 (preemption with recompute)" in notes
    layer = next(r for r in report.results if r.name == "layer")
    assert layer.positions == tuple(range(8))
    run = tracedump.open_dump(a).run()
    assert [run.sequences()[0].rows[p][0] for p in range(8)] == [3] * 7 + [4]  # the recomputation's


def test_logits_of_a_step_whose_tail_was_recomputed_again_keep_their_position(
    reference: Path, tmp_path: Path
) -> None:
    # preempted twice: step 3 recomputes 0-6 (its logits: position 6's), step 4 recomputes 6-7
    steps = generate(0, PROMPT, TOKENS)
    fed = [*PROMPT, *TOKENS[:3]]
    twice = [*steps[:3], [(0, p, fed[p]) for p in range(7)], [(0, 6, fed[6]), (0, 7, fed[7])]]
    report = compare(dump(tmp_path / "a", twice), reference, align="tokens")
    assert report.exit_code == 0, [(r.name, r.positions) for r in report.results if r.status != "ok"]
    logits = next(r for r in report.results if r.name == "logits")
    assert logits.positions == (7,)  # step 3's row was sampled at 6, which step 4 computed again


def test_parallel_sampling_pairs_children_by_shared_prefix_never_by_order(tmp_path: Path) -> None:
    other = [1, 6, 10]
    # A: two children of one prompt (request ids "0_r0", "1_r0"), then another prompt's request
    a = dump(
        tmp_path / "a",
        merge(
            generate("0_r0", PROMPT, [7, 9, 9]),
            generate("1_r0", PROMPT, [7, 8, 3]),
            generate("0_r1", other, [4, 4]),
        ),
    )
    b = dump(tmp_path / "b", merge(generate(0, PROMPT, [7, 8, 3]), generate(1, other, [4, 4])))
    report = compare(a, b, align="tokens")
    alignment = report.alignment[0]  # type: ignore[index]
    assert alignment["matched_by"] == "input_ids"
    assert sorted(map(tuple, alignment["pairs"])) == [("0_r1", 1), ("1_r0", 0)]  # the longer shared prefix
    assert alignment["only_in_a"] == ["0_r0"]
    assert any("parallel sampling" in note for note in alignment["notes"])
    assert report.inputs_differ == [] and report.exit_code == 0


def test_a_step_that_raised_marks_the_dump_incomplete_and_is_not_compared_whole(
    reference: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    crashed = dump(tmp_path / "a", generate(0, PROMPT, TOKENS), raise_at=2)
    manifest = json.loads(next(crashed.glob("rank*/manifest.json")).read_text())
    assert manifest["complete"] is False and manifest["truncated_passes"] == [2]
    assert "step 2 raised RuntimeError: engine step failed" in manifest["incomplete_reason"]
    assert [(e["where"], e["type"]) for e in manifest["errors"]] == [("step 2", "RuntimeError")]
    out = tmp_path / "report.json"
    code = main(["diff", str(crashed), str(reference), "--align", "tokens", "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0
    report = json.loads(out.read_text())
    assert all(max(t["per_token"]["positions"]) < 6 for t in report["tensors"])  # position 6: step 2
    assert "pass 2 was cut short (its step raised): sequence 0 is compared before position 6" in printed
    assert "the dump is incomplete: step 2 raised RuntimeError" in printed


def test_a_pass_cut_short_lists_what_it_lacks_with_the_reason(reference: Path, tmp_path: Path) -> None:
    crashed = dump(tmp_path / "a", generate(0, PROMPT, TOKENS), raise_at=2)
    report = compare(crashed, reference, align="passes", passes="2")
    assert report.exit_code == 0 and [r.name for r in report.results] == ["embed"]  # what it captured
    reasons = {u.name: u.reason for u in report.plan.only_in_b}
    assert reasons == {n: "A's pass 2 was cut short (its step raised)" for n in ("layer", "head", "logits")}


def test_a_dump_stopped_by_a_write_error_is_said_in_the_summary(reference: Path, tmp_path: Path) -> None:
    a = dump(tmp_path / "a", generate(0, PROMPT, TOKENS))
    path = next(a.glob("rank*/manifest.json"))
    manifest = json.loads(path.read_text())
    manifest.update(
        complete=False,
        incomplete_reason="cannot write pass00003.safetensors: No space left on device",
        skipped={"dropped_files": 31},
    )
    path.write_text(json.dumps(manifest))
    for align in ("tokens", "passes"):
        report = compare(a, reference, align=align)
        assert report.exit_code == 0
        notes = report.settings["notes"]
        assert any("the dump is incomplete (31 files dropped): cannot write pass00003" in n for n in notes), (
            notes
        )


def test_pass_is_honoured_under_token_alignment_or_refused(reference: Path, tmp_path: Path) -> None:
    a = dump(tmp_path / "a", generate(0, PROMPT, TOKENS))
    report = compare(a, reference, align="tokens", passes="1-2")
    assert {r.positions for r in report.results} == {(5, 6)}  # the rows A's steps 1 and 2 computed
    with pytest.raises(UsageError, match=r"--pass 99: A has no such step"):
        compare(a, reference, align="tokens", passes="99")
    assert main(["diff", str(a), str(reference), "--align", "tokens", "--pass", "99"]) == 2


# ----------------------------------------------------------------------- coverage


def test_every_report_says_first_how_much_of_the_reference_was_compared(
    reference: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = dump(tmp_path / "a", generate(0, PROMPT, TOKENS))
    out = tmp_path / "report.json"
    assert main(["diff", str(a), str(reference), "--json", str(out)]) == 0
    first_line = capsys.readouterr().out.splitlines()[0]
    assert first_line == "compared 4 of 4 reference tensors per step (100 %)"  # embed, layer, head, logits
    coverage = json.loads(out.read_text())["summary"]["coverage"]
    assert coverage == {"compared": 4, "reference": 4, "fraction": 1.0, "low": False}


class SiluAndMul(nn.Module):
    """An engine's fused ``silu(gate) * up`` over the two halves of its input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up


def test_a_diff_that_compares_nothing_exits_2_with_the_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # one name, two classes known to compute different quantities (a fused act(gate) * up against
    # the act alone), no rule relating them: not comparable, and nothing else in common
    for out, model in (
        (tmp_path / "a", nn.Sequential(SiluAndMul())),
        (tmp_path / "b", nn.Sequential(nn.SiLU())),
    ):
        with tracedump.attach(model, {"dir": str(out)}), torch.no_grad():
            model(torch.ones(2, 4))
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert "nothing comparable" in err and "not comparable" in err and "SiluAndMul" in err
    with pytest.raises(UsageError, match="nothing comparable"):
        compare(tmp_path / "a", tmp_path / "b")


def test_low_coverage_is_said_and_min_coverage_makes_it_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    small = nn.Sequential(nn.Linear(4, 4))
    big = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Tanh(), nn.Tanh())
    for out, model in ((tmp_path / "a", small), (tmp_path / "b", big)):
        torch.manual_seed(0)
        model[0].reset_parameters()
        with tracedump.attach(model, {"dir": str(out), "modules": "leaves"}), torch.no_grad():
            model(torch.ones(2, 4))
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("compared 1 of 4 reference tensors per step (25 %)")
    assert "warning: less than half of the reference (B) was compared (25 %)" in printed
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b"), "--min-coverage", "0.2"]) == 0
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b"), "--min-coverage", "0.8"]) == 2
    assert "below --min-coverage 0.8: exit 2" in capsys.readouterr().out
    report = compare(tmp_path / "a", tmp_path / "b", min_coverage=0.8)
    assert report.exit_code == 2 and report.summary()["coverage"]["low"] is True
    with pytest.raises(SystemExit) as refused:  # argparse: exit 2
        main(["diff", str(tmp_path / "a"), str(tmp_path / "b"), "--min-coverage", "1.5"])
    assert refused.value.code == 2
