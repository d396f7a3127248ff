"""Manual records: ``dumper.record``/``record_step`` and the module-level ``tracedump.record*``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from conftest import read_passes
from torch import nn

import tracedump
import tracedump.dump.dumper

transformers = pytest.importorskip("transformers")


def _attach(model: nn.Module, tmp_path: Path, **fields: object) -> tracedump.Dumper:
    fields.setdefault("filter", ["lm_head"])
    dumper = tracedump.attach(model, tracedump.DumpConfig(dir=tmp_path, **fields))
    assert dumper is not None
    return dumper


def _records(dumper: tracedump.Dumper) -> dict[str, torch.Tensor]:
    records = tracedump.open_dump(dumper.run_dir).run().records
    return records.load() if records is not None else {}


def _ids(seq: int) -> torch.Tensor:
    return torch.arange(seq)[None, :] % 64


# --------------------------------------------------------------------------- record_step


def test_record_step_numbers_each_tag_per_call_from_zero(llama: nn.Module, tmp_path: Path) -> None:
    with _attach(llama, tmp_path) as dumper, torch.inference_mode():
        for step in range(3):
            with dumper.step():
                llama(_ids(2))
                dumper.record_step("margin", torch.tensor([float(step)]))
                dumper.record_step("entropy", torch.tensor([10.0 + step]))
    passes = read_passes(dumper.run_dir)
    for step in range(3):
        assert passes[step]["margin_" + str(step)].item() == float(step)
        assert passes[step]["entropy_" + str(step)].item() == 10.0 + step
        assert sorted(k for k in passes[step] if k != "lm_head") == [f"entropy_{step}", f"margin_{step}"]


def test_record_step_outside_every_pass_goes_to_the_records_file(llama: nn.Module, tmp_path: Path) -> None:
    with _attach(llama, tmp_path) as dumper:
        for value in (0.5, 0.25):
            dumper.record_step("margin", torch.tensor(value))
    assert read_passes(dumper.run_dir) == {}
    records = _records(dumper)
    assert list(records) == ["margin_0", "margin_1"]
    assert records["margin_0"].item() == 0.5 and records["margin_1"].item() == 0.25
    assert tracedump.open_dump(dumper.run_dir).run().manifest["records_file"] == "records.safetensors"


def test_row_gated_record_step_uses_no_number(llama: nn.Module, tmp_path: Path) -> None:
    with _attach(llama, tmp_path, max_rows=1) as dumper, torch.inference_mode():
        dumper.set_rows(4)
        with dumper.step():  # a warm-up: no pass index, no margin number
            llama(_ids(2).expand(4, 2))
            dumper.record_step("margin", torch.ones(4))
        dumper.set_rows(1)
        with dumper.step():
            llama(_ids(2))
            dumper.record_step("margin", torch.full((1,), 7.0))
    passes = read_passes(dumper.run_dir)
    assert list(passes) == [0]
    assert passes[0]["margin_0"].tolist() == [7.0]


# --------------------------------------------------------------------------- once


def test_record_once_keeps_the_first_write(llama: nn.Module, tmp_path: Path) -> None:
    with _attach(llama, tmp_path) as dumper, torch.inference_mode():
        for step in range(3):
            with dumper.step():
                logits = llama(_ids(3 + step)).logits[:, -1, :]
                dumper.record("prefill_logits", logits, once=True)
                if step == 0:
                    first = logits.clone()
    passes = read_passes(dumper.run_dir)
    assert torch.equal(passes[0]["prefill_logits"], first)
    assert "prefill_logits" not in passes[1] and "prefill_logits" not in passes[2]


def test_record_once_outside_a_pass_keeps_the_first_value(llama: nn.Module, tmp_path: Path) -> None:
    with _attach(llama, tmp_path) as dumper:
        dumper.record("config_ids", torch.tensor([1, 2]), once=True)
        dumper.record("config_ids", torch.tensor([9, 9]), once=True)
    assert _records(dumper)["config_ids"].tolist() == [1, 2]


def test_a_row_gated_or_profiled_once_record_does_not_use_up_the_once(
    llama: nn.Module, tmp_path: Path
) -> None:
    with _attach(llama, tmp_path, max_rows=1) as dumper:
        dumper.set_rows(8)
        dumper.record("logits", torch.zeros(2), once=True)  # warm-up batch: refused
        dumper.set_rows(1)
        with tracedump.profiling():
            dumper.record("logits", torch.ones(2), once=True)  # profile run: suspended
        dumper.record("logits", torch.full((2,), 3.0), once=True)
        dumper.record("logits", torch.full((2,), 4.0), once=True)
    assert _records(dumper)["logits"].tolist() == [3.0, 3.0]


def test_repeated_record_without_once_gets_call_suffixes(llama: nn.Module, tmp_path: Path) -> None:
    with _attach(llama, tmp_path) as dumper, torch.inference_mode(), dumper.step():
        llama(_ids(2))
        for value in range(3):
            dumper.record("router_probs", torch.tensor([value]))
    tensors = read_passes(dumper.run_dir)[0]
    assert [tensors[k].item() for k in ("router_probs", "router_probs::call1", "router_probs::call2")] == [
        0,
        1,
        2,
    ]


# --------------------------------------------------------------------------- what is stored


@pytest.mark.parametrize("mode", ["full", "last_row", "stats"])
def test_integer_records_are_stored_whole_and_as_is_in_every_mode(
    llama: nn.Module, tmp_path: Path, mode: str
) -> None:
    expert_ids = torch.tensor([[3, 7], [0, 5], [2, 2]], dtype=torch.int64)
    router_weights = torch.rand(3, 2, dtype=torch.float64)
    with _attach(llama, tmp_path, mode=mode) as dumper, torch.inference_mode(), dumper.step():
        llama(_ids(3))
        dumper.record("expert_ids", expert_ids)
        dumper.record("router_weights", router_weights)
    tensors = read_passes(dumper.run_dir)[0]
    assert tensors["expert_ids"].dtype == torch.int64
    assert torch.equal(tensors["expert_ids"], expert_ids)
    assert tensors["router_weights"].dtype == torch.float64
    assert torch.equal(tensors["router_weights"], router_weights)


def test_record_copies_the_value_at_call_time(llama: nn.Module, tmp_path: Path) -> None:
    buffer = torch.zeros(4)
    with _attach(llama, tmp_path) as dumper, dumper.step():
        dumper.record("buffer", buffer)
        buffer.fill_(5.0)  # an engine reusing its buffer must not change what was recorded
    assert read_passes(dumper.run_dir)[0]["buffer"].tolist() == [0.0] * 4


def test_record_accepts_numbers_and_lists_as_tensors(llama: nn.Module, tmp_path: Path) -> None:
    with _attach(llama, tmp_path) as dumper:
        dumper.record("seq_len", 7)
        dumper.record("token_ids", [4, 5, 6])
    records = _records(dumper)
    assert records["seq_len"].item() == 7 and records["token_ids"].tolist() == [4, 5, 6]


def test_record_in_a_steps_unselected_pass_writes_nothing_but_keeps_numbering(
    llama: nn.Module, tmp_path: Path
) -> None:
    with _attach(llama, tmp_path, steps="1") as dumper, torch.inference_mode():
        for step in range(2):
            with dumper.step():
                llama(_ids(2))
                dumper.record("logits", torch.full((1,), float(step)), once=True)
                dumper.record_step("margin", torch.full((1,), float(step)))
    passes = read_passes(dumper.run_dir)
    assert list(passes) == [1]
    assert set(passes[1]) == {"lm_head", "margin_1"}  # the once-only write happened in pass 0


# --------------------------------------------------------------------------- module-level API


def test_module_level_record_without_a_dumper_is_a_no_op(tmp_path: Path) -> None:
    assert tracedump.dump.dumper.active_dumper() is None
    assert tracedump.record("logits", torch.ones(3)) is None
    assert tracedump.record("logits", torch.ones(3), once=True) is None
    assert tracedump.record_step("margin", torch.ones(1)) is None
    assert list(tmp_path.iterdir()) == []


def test_module_level_record_goes_to_the_active_dumper_until_it_closes(
    llama: nn.Module, tmp_path: Path
) -> None:
    with _attach(llama, tmp_path) as dumper, torch.inference_mode():
        assert tracedump.dump.dumper.active_dumper() is dumper
        with dumper.step():
            llama(_ids(2))
            tracedump.record("token_ids", torch.tensor([11]))
            tracedump.record("logits", torch.ones(2), once=True)
            tracedump.record_step("margin", torch.tensor([0.5]))
        with dumper.step():
            llama(_ids(1))
            tracedump.record("logits", torch.zeros(2), once=True)
            tracedump.record_step("margin", torch.tensor([0.25]))
    tracedump.record("after_close", torch.ones(1))  # no dumper is active any more: a no-op
    passes = read_passes(dumper.run_dir)
    assert set(passes[0]) == {"lm_head", "token_ids", "logits", "margin_0"}
    assert set(passes[1]) == {"lm_head", "margin_1"}
    assert passes[0]["token_ids"].tolist() == [11] and passes[1]["margin_1"].tolist() == [0.25]
    assert _records(dumper) == {}


def test_module_level_record_reaches_the_most_recently_attached_dumper(
    llama: nn.Module, tmp_path: Path
) -> None:
    with _attach(llama, tmp_path / "first") as first:
        with _attach(nn.Sequential(nn.Linear(2, 2)), tmp_path / "second", filter=None) as second:
            tracedump.record("where", torch.tensor([2]))
        tracedump.record("where", torch.tensor([1]))
    assert _records(first)["where"].tolist() == [1]
    assert _records(second)["where"].tolist() == [2]


def test_a_forked_child_numbers_its_records_afresh_in_its_own_run_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path))
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    dumper = tracedump.attach(model)
    for _ in range(2):
        with dumper.step():
            model(torch.ones(1, 2))
            dumper.record_step("margin", torch.ones(1))
            dumper.record("logits", torch.ones(2), once=True)
    pid = os.fork()
    if pid == 0:
        try:
            with dumper.step():
                model(torch.ones(1, 2))
                dumper.record_step("margin", torch.zeros(1))
                dumper.record("logits", torch.zeros(2), once=True)
            dumper.close()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    dumper.close()

    runs = {run.pid: run for run in tracedump.open_dump(tmp_path).runs}
    child = runs[pid]
    assert child.passes[0].names == ["0", "margin_0", "logits"]
    assert child.manifest["complete"] and child.manifest["skipped"] == {}
    assert runs[os.getpid()].passes[1].names == ["0", "margin_1"]


def test_a_forked_child_that_cannot_make_its_run_dir_runs_unhooked_and_never_raises(tmp_path, monkeypatch):
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path / "dump"))
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    dumper = tracedump.attach(model)
    model(torch.ones(1, 2))
    dumper.flush()
    (tmp_path / "dump").rename(tmp_path / "moved")
    (tmp_path / "dump").write_text("a file where the dump dir was")
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            out = model(torch.ones(1, 2))  # the first pass in the child re-binds, and fails
            hooked = any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
            code = 0 if out.shape == (1, 2) and not hooked else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    (tmp_path / "dump").unlink()
    (tmp_path / "moved").rename(tmp_path / "dump")
    dumper.close()
    assert os.waitstatus_to_exitcode(status) == 0
