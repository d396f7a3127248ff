"""The HF reference as it is usually run: a padded batch through ``generate`` (or one
forward) gets its batch layout from the root forward's ``input_ids`` / ``attention_mask``, with no
``set_batch``, so ``tracedump diff --align tokens`` pairs each row with the same prompt run alone,
padding is never compared, and a bug is named with its sequence and position."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_llama
from torch import nn

import tracedump
import tracedump.cli
from tracedump.dump.hf_layout import batch_layout_for, is_transformers_model
from tracedump.store.sequences import batch_metadata

pytest.importorskip("transformers")

PROMPTS = ([3, 14, 15, 9, 26], [7, 8, 9])
NEW_TOKENS = 3
PAD = 0
BUG_LAYER = 1


@pytest.fixture(scope="module")
def llama() -> nn.Module:
    model = make_tiny_llama(layers=2, seed=1)
    model.generation_config.eos_token_id = None  # every row generates NEW_TOKENS, alone or batched
    return model


def _padded(side: str) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, PROMPTS))
    ids, mask = [], []
    for prompt in PROMPTS:
        pad = [PAD] * (width - len(prompt))
        ids.append(pad + prompt if side == "left" else prompt + pad)
        ones, zeros = [1] * len(prompt), [0] * len(pad)
        mask.append(zeros + ones if side == "left" else ones + zeros)
    return torch.tensor(ids), torch.tensor(mask)


def _dump(model: nn.Module, out: Path, run: Callable[[], object]) -> tracedump.Run:
    dumper = tracedump.attach(model, {"dir": str(out), "modules": "all"})
    assert dumper is not None
    try:
        with torch.no_grad():
            run()
    finally:
        dumper.close()
    return tracedump.open_dump(out).run()


def _generate(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    return model.generate(  # type: ignore[operator]
        input_ids=ids,
        attention_mask=torch.ones_like(ids) if mask is None else mask,
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        pad_token_id=PAD,
    )


def _one_by_one(model: nn.Module) -> None:
    for prompt in PROMPTS:
        _generate(model, torch.tensor([prompt]))


def _diff(tmp_path: Path, a: Path, b: Path) -> tuple[int, dict]:
    out = tmp_path / f"{a.name}-{b.name}.json"
    code = tracedump.cli.main(["diff", str(a), str(b), "--align", "tokens", "--json", str(out)])
    return code, json.loads(out.read_text())


@pytest.fixture(scope="module")
def dumps(llama: nn.Module, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_layout")
    ids, mask = _padded("left")
    _dump(llama, root / "batched", lambda: _generate(llama, ids, mask))
    _dump(llama, root / "single", lambda: _one_by_one(llama))
    return {"batched": root / "batched", "single": root / "single"}


def test_a_padded_generate_gets_its_layout_from_its_own_inputs(dumps: dict[str, Path]) -> None:
    run = tracedump.open_dump(dumps["batched"]).run()
    batches = run.batches()
    assert sorted(batches) == list(range(NEW_TOKENS))  # the prefill, then one pass per decode step
    prefill = batches[0]
    assert (prefill.grid, prefill.declared) == ((2, 5), True)
    # row 1 is left-padded: two padding cells, then its 3 tokens at positions 0, 1, 2
    assert prefill.seq_ids == (0, 0, 0, 0, 0, None, None, 1, 1, 1)
    assert prefill.positions[:5] == (0, 1, 2, 3, 4) and prefill.positions[7:] == (0, 1, 2)
    assert prefill.input_ids == (*PROMPTS[0], PAD, PAD, *PROMPTS[1])
    for step in (1, 2):  # one token per row, each sequence continuing where it was
        assert batches[step].grid == (2, 1)
        assert batches[step].seq_ids == (0, 1)
        assert batches[step].positions == (4 + step, 2 + step)
    sequences = run.sequences()
    assert sorted(sequences) == [0, 1]
    assert sequences[1].positions == list(range(len(PROMPTS[1]) + NEW_TOKENS - 1))
    # the loader's view: a [2, 5, 32] prefill tensor gives sequence 1's 3 rows, then its decode rows
    assert run.passes[0].info("model.embed_tokens").shape == (2, 5, 32)
    assert run.sequence(1)["model.embed_tokens"].shape == (len(PROMPTS[1]) + NEW_TOKENS - 1, 32)


def test_ls_shows_the_grid_and_the_padding(
    dumps: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    assert tracedump.cli.main(["ls", str(dumps["batched"])]) == 0
    out = capsys.readouterr().out
    assert "pass 0: [2 x 5] 0: 0-4, 1: 0-2, 2 padding rows" in out
    assert "pass 1: [2 x 1] 0: 5, 1: 3" in out


def test_the_padded_batch_pairs_with_the_prompts_run_alone_and_padding_is_never_compared(
    dumps: dict[str, Path], tmp_path: Path
) -> None:
    batched = tracedump.open_dump(dumps["batched"]).run().sequences()
    single = tracedump.open_dump(dumps["single"]).run().sequences()
    # the premise: greedy decoding chose the same tokens batched and alone (no near tie flipped)
    assert {s: q.tokens() for s, q in batched.items()} == {s: q.tokens() for s, q in single.items()}
    code, report = _diff(tmp_path, dumps["batched"], dumps["single"])
    assert code == 0, report["summary"]
    (alignment,) = report["summary"]["alignment"]
    assert alignment["matched_by"] == "seq id" and alignment["pairs"] == [[0, 0], [1, 1]]
    measured = [t for t in report["tensors"] if t["status"] == "ok"]
    assert len(measured) > 40
    # only real positions were compared: sequence 1 holds 5 (3 prompt + 2 fed back), never a pad
    rows_of_1 = {t["shape_a"][0] for t in measured if t["sequence"] == "seq 1" and t["name"] != "lm_head"}
    assert rows_of_1 == {len(PROMPTS[1]) + NEW_TOKENS - 1}
    # logits: one row per sequence and step (generate keeps the last position's), never a pad's
    logits = next(t for t in measured if t["sequence"] == "seq 1" and t["name"] == "lm_head")
    assert logits["shape_a"][0] == NEW_TOKENS


def test_garbage_in_the_padding_rows_is_not_compared(
    llama: nn.Module, dumps: dict[str, Path], tmp_path: Path
) -> None:
    ids, mask = _padded("left")

    def garbage(_module: nn.Module, _args: object, output: torch.Tensor) -> torch.Tensor | None:
        if output.shape[1] == ids.shape[1]:  # the prefill: the padding cells of row 1 get huge values
            output = output.clone()
            output[1, :2] = 1e6
            return output
        return None

    handle = llama.model.layers[0].mlp.register_forward_hook(garbage)
    try:
        run = _dump(llama, tmp_path / "padded_garbage", lambda: _generate(llama, ids, mask))
    finally:
        handle.remove()
    assert run.passes[0]["model.layers.0.mlp"][1, :2].abs().min() == 1e6  # the premise: it is dumped
    code, report = _diff(tmp_path, tmp_path / "padded_garbage", dumps["single"])
    assert code == 0, report["summary"]


def test_a_bug_in_one_row_is_named_with_its_sequence_and_position(
    llama: nn.Module, dumps: dict[str, Path], tmp_path: Path
) -> None:
    ids, mask = _padded("left")
    forwards: list[int] = []

    def bug(_module: nn.Module, _args: object, output: torch.Tensor) -> torch.Tensor | None:
        # the last decode step only (its token is fed to nothing), row 1 only (sequence 1)
        if output.shape[1] == 1 and len(forwards) == NEW_TOKENS:
            output = output.clone()
            output[1] *= 1.01
            return output
        return None

    counter = llama.register_forward_pre_hook(lambda *_: forwards.append(1) and None)
    handle = llama.model.layers[BUG_LAYER].mlp.register_forward_hook(bug)
    try:
        _dump(llama, tmp_path / "buggy", lambda: _generate(llama, ids, mask))
    finally:
        handle.remove()
        counter.remove()
    code, report = _diff(tmp_path, tmp_path / "buggy", dumps["single"])
    assert code == 1
    first = report["summary"]["alignment"][0]["first"]
    last_position = len(PROMPTS[1]) + NEW_TOKENS - 2  # sequence 1's last fed position
    assert (first["sequence"], first["position"], first["step"]) == ("seq 1", last_position, NEW_TOKENS - 1)
    assert first["name"] == f"model.layers.{BUG_LAYER}.mlp"


def test_a_right_padded_forward_pairs_with_each_prompt_alone(llama: nn.Module, tmp_path: Path) -> None:
    ids, mask = _padded("right")
    batched = _dump(llama, tmp_path / "right", lambda: llama(input_ids=ids, attention_mask=mask))
    assert batched.batches()[0].seq_ids == (0, 0, 0, 0, 0, 1, 1, 1, None, None)

    def alone() -> None:
        for prompt in PROMPTS:
            llama(torch.tensor([prompt]))

    single = _dump(llama, tmp_path / "alone", alone)
    assert [b.seq_ids for b in single.batches().values()] == [(0,) * 5, (1,) * 3]
    code, report = _diff(tmp_path, tmp_path / "right", tmp_path / "alone")
    assert code == 0, report["summary"]
    ok_in_1 = [t for t in report["tensors"] if t["sequence"] == "seq 1" and t["status"] == "ok"]
    assert {t["shape_a"][0] for t in ok_in_1} == {3}


def test_set_batch_takes_the_same_grid_and_only_hf_models_get_a_layout(llama: nn.Module) -> None:
    # what the HF hook stores is what set_batch stores for the same grid
    layout = batch_layout_for(llama)
    assert layout is not None and is_transformers_model(llama)
    ids, mask = _padded("left")
    stored = layout.observe((), {"input_ids": ids, "attention_mask": mask}, wanted=True)
    by_hand = batch_metadata(
        [[0] * 5, [None, None, 1, 1, 1]], [[0, 1, 2, 3, 4], [-1, -1, 0, 1, 2]], ids.tolist()
    )
    assert stored == by_hand
    assert json.loads(stored)["grid"] == [2, 5]
    assert batch_layout_for(nn.Linear(2, 2)) is None
    with pytest.raises(ValueError, match="grid"):
        batch_metadata([[0, 0], [1]], None, None)


def test_tracedump_run_gives_the_first_generate_forward_its_layout_too(tmp_path: Path) -> None:
    """Under `tracedump run` the first root call's pre-hooks are replayed by a global hook that sees
    no keyword arguments; generate() passes only keywords, so they are read from the call's frame."""
    from tracedump.config.settings import load_settings
    from tracedump.launch.auto import AutoAttach

    model = make_tiny_llama(layers=1, seed=2)
    ids, mask = _padded("left")
    auto = AutoAttach(load_settings({"dir": str(tmp_path / "auto"), "modules": "all"}))
    auto.register()
    try:
        with torch.no_grad():
            _generate(model, ids, mask)
    finally:
        auto.remove()
    batches = tracedump.open_dump(tmp_path / "auto").run().batches()
    assert batches[0].grid == (2, 5) and batches[0].seq_ids[5:7] == (None, None)
    assert [batches[i].seq_ids for i in (1, 2)] == [(0, 1), (0, 1)]


def test_a_padded_hf_batch_lines_up_with_a_packed_engines_flat_rows(tmp_path: Path) -> None:
    """[batch, seq, hidden] against [tokens, hidden]: the continuous-batching engine of
    examples/batching.py (requests packed into flat rows, chunked prefill, set_batch) against one
    left-padded HF generate of the same prompts, with no set_batch on the HF side."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import batching
    from engine import ModelConfig, build_model

    requests = batching.default_requests()
    prompts = [r.prompt for r in requests]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path / "engine"))
        mp.setenv("TRACEDUMP_DUMP_MODULES", "all")
        served = batching.serve(build_model(ModelConfig()), requests)
    model = build_model(ModelConfig())
    model.generation_config.eos_token_id = None  # the engine stops at its lengths, not at EOS
    width = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    most = max(r.new_tokens for r in requests)
    run = _dump(
        model,
        tmp_path / "hf",
        lambda: model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=most, do_sample=False, pad_token_id=PAD
        ),
    )
    assert run.passes[0].info("model.layers.0.mlp").shape == (3, width, 32)
    # the premise: the engine fed each request a prefix of what HF fed the same row
    hf_tokens = {s: q.tokens() for s, q in run.sequences().items()}
    for request in served:
        fed = request.tokens[:-1]
        assert hf_tokens[request.seq_id][: len(fed)] == fed
    code, report = _diff(tmp_path, tmp_path / "engine", tmp_path / "hf")
    assert code == 0, report["summary"]
    assert report["summary"]["alignment"][0]["pairs"] == [[0, 0], [1, 1], [2, 2]]
    rows = {t["sequence"]: t["shape_a"][0] for t in report["tensors"] if t["name"] == "model.layers.1.mlp"}
    assert rows == {f"seq {r.seq_id}": len(r.tokens) - 1 for r in served}  # every fed position, no pad
