"""Token gate, row gate, STEPS selection and the profiling suspend, each on its own.

HF models give ``[batch, seq, hidden]`` (TOKEN_DIM=1); the flattened ``[tokens, hidden]`` layout of
vLLM/SGLang (TOKEN_DIM=0) and 1-D per-token tensors come from small modules written here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import read_passes
from torch import nn

import tracedump
from tracedump.dump.gates import row_gate_allows, token_count, token_gate_allows
from tracedump.dump.suspend import globally_suspended

transformers = pytest.importorskip("transformers")

VOCAB = 64
HIDDEN = 32


class TokenScores(nn.Module):
    """A leaf returning one score per token: a 1-D ``[tokens]`` tensor."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.sum(dim=-1)


class FlattenedBlock(nn.Module):
    """vLLM/SGLang layout: the batch is flattened into ``[tokens, hidden]``."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.scores = TokenScores()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.scores(self.proj(hidden))


def _ids(batch: int, seq: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(batch * 100 + seq))


def _pass_files(run_dir: Path) -> list[str]:
    return sorted(p.name for p in run_dir.glob("pass*.safetensors"))


def _set_dump_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, **fields: str) -> None:
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path))
    for field, value in fields.items():
        monkeypatch.setenv(f"TRACEDUMP_DUMP_{field.upper()}", value)


# --------------------------------------------------------------------------- the gate functions


@pytest.mark.parametrize(
    ("shape", "token_dim", "expected"),
    [
        ((6, 32), 0, 6),  # flattened [tokens, hidden]
        ((2, 6, 32), 1, 6),  # HF [batch, seq, hidden]
        ((2, 6, 32), 0, 2),  # HF layout read with the flattened setting sees the batch
        ((6,), 1, 6),  # fewer dims than token_dim + 1: the leading dim
        ((6,), 0, 6),
        ((), 0, None),  # a scalar has no token dim
    ],
)
def test_token_count_reads_the_configured_dim_or_the_leading_dim(
    shape: tuple[int, ...], token_dim: int, expected: int | None
) -> None:
    assert token_count(torch.zeros(shape), token_dim) == expected


def test_token_gate_without_a_token_setting_lets_everything_through() -> None:
    assert token_gate_allows(torch.zeros(3, 5), None, 0)
    assert token_gate_allows(torch.zeros(()), None, 1)
    assert not token_gate_allows(torch.zeros(()), 3, 0)


def test_row_gate_closes_only_while_reported_rows_exceed_max_rows() -> None:
    assert row_gate_allows(None, 1)  # nothing reported yet
    assert row_gate_allows(4, None)  # no gate
    assert row_gate_allows(1, 1)
    assert not row_gate_allows(2, 1)


# --------------------------------------------------------------------------- token gate on models


def test_token_gate_with_token_dim_one_keeps_only_prompt_length_forwards(
    llama: nn.Module, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _set_dump_env(monkeypatch, tmp_path, tokens="6", token_dim="1")
    with tracedump.attach(llama) as dumper, torch.inference_mode():
        llama(_ids(4, 1))  # warm-up shapes: refused, no index
        llama(_ids(2, 3))
        assert dumper.pass_index == 0
        llama(_ids(1, 6))  # the real prompt: pass 0
        llama(_ids(4, 2))
        assert dumper.pass_index == 1
    passes = read_passes(dumper.run_dir)
    assert list(passes) == [0]
    assert passes[0]["model.embed_tokens"].shape == (1, 6, HIDDEN)
    assert all(t.shape[1] == 6 for t in passes[0].values())
    assert dumper.skipped["token_gate"] == 3 * len(dumper.modules)


def test_token_gate_with_token_dim_zero_reads_the_flattened_token_dim(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _set_dump_env(monkeypatch, tmp_path, tokens="3", token_dim="0")
    torch.manual_seed(0)
    block = FlattenedBlock()
    with tracedump.attach(block) as dumper, torch.no_grad():
        block(torch.randn(5, 8))  # 5 tokens: refused
        scores = block(torch.randn(3, 8))
    passes = read_passes(dumper.run_dir)
    assert list(passes) == [0]
    assert passes[0]["proj"].shape == (3, 8)
    assert torch.equal(passes[0]["scores"], scores)
    assert dumper.skipped == {"token_gate": 2}


def test_token_dim_zero_on_the_hf_layout_judges_the_batch_dim(
    llama: nn.Module, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wrong TOKEN_DIM is visible: with 0 on ``[batch, seq, hidden]`` the batch is the 'tokens'."""
    _set_dump_env(monkeypatch, tmp_path, tokens="3", token_dim="0", filter='["embed_tokens"]')
    with tracedump.attach(llama) as dumper, torch.inference_mode():
        llama(_ids(1, 3))  # 3 tokens but batch 1: refused
        llama(_ids(3, 5))  # batch 3: kept
    assert read_passes(dumper.run_dir)[0]["model.embed_tokens"].shape == (3, 5, HIDDEN)


@pytest.mark.parametrize(("tokens", "captured"), [(3, True), (5, False)])
def test_tensors_with_fewer_dims_are_judged_by_their_leading_dim(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tokens: int, captured: bool
) -> None:
    _set_dump_env(monkeypatch, tmp_path, tokens=str(tokens), token_dim="1", filter='["^scores$"]')
    block = FlattenedBlock()
    with tracedump.attach(block) as dumper, torch.no_grad():
        scores = block(torch.randn(3, 8))  # scores are 1-D [3]; dim 1 does not exist
    assert scores.shape == (3,)
    passes = read_passes(dumper.run_dir)
    if captured:
        assert torch.equal(passes[0]["scores"], scores)
    else:
        assert passes == {}
        assert dumper.pass_index == 0  # refused by the gate: a warm-up, no index


# --------------------------------------------------------------------------- row gate


def test_row_gate_refuses_capture_while_reported_rows_exceed_max_rows(
    llama: nn.Module, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _set_dump_env(monkeypatch, tmp_path, max_rows="1", filter='["lm_head"]')
    with tracedump.attach(llama) as dumper, torch.inference_mode():
        dumper.set_rows(4)
        with dumper.step():
            llama(_ids(4, 3))
        assert dumper.pass_index == 0
        assert _pass_files(dumper.run_dir) == []
        dumper.set_rows(1)
        with dumper.step():
            llama(_ids(1, 3))
        dumper.set_rows(None)  # lifts the gate
        with dumper.step():
            llama(_ids(4, 2))
        assert dumper.pass_index == 2
    passes = read_passes(dumper.run_dir)
    assert passes[0]["lm_head"].shape == (1, 3, VOCAB)
    assert passes[1]["lm_head"].shape == (4, 2, VOCAB)
    assert dumper.skipped["row_gate"] == 1


def test_row_gate_and_token_gate_combined_keep_only_the_real_request(
    llama: nn.Module, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _set_dump_env(monkeypatch, tmp_path, max_rows="1", tokens="5", token_dim="1", filter='["lm_head"]')
    with tracedump.attach(llama) as dumper, torch.inference_mode():
        for rows, seq in [(4, 5), (1, 2), (1, 5), (2, 5)]:
            dumper.set_rows(rows)
            with dumper.step():
                llama(_ids(rows, seq))
    passes = read_passes(dumper.run_dir)
    assert list(passes) == [0]
    assert passes[0]["lm_head"].shape == (1, 5, VOCAB)
    assert dumper.skipped == {"row_gate": 2, "token_gate": 1}


# --------------------------------------------------------------------------- profiling


def test_module_level_profiling_without_a_dumper_runs_the_block_unchanged(llama: nn.Module) -> None:
    ids = _ids(1, 4)
    with torch.inference_mode():
        expected = llama(ids).logits
        with tracedump.profiling():
            assert globally_suspended()
            inside = llama(ids).logits
            tracedump.record("ignored", torch.ones(2))  # no dumper, no error
    assert not globally_suspended()
    assert torch.equal(inside, expected)


def test_module_level_profiling_leaves_no_file_and_no_pass_index(
    llama: nn.Module, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _set_dump_env(monkeypatch, tmp_path, filter='["lm_head"]')
    with tracedump.attach(llama) as dumper, torch.inference_mode():
        with tracedump.profiling():
            llama(_ids(1, 32))  # auto pass: not opened
            with dumper.step():  # an explicit step: not opened either
                llama(_ids(1, 32))
                dumper.record("profile_logits", torch.ones(3))
                dumper.record_step("margin", torch.ones(1))
        assert dumper.pass_index == 0
        assert _pass_files(dumper.run_dir) == []
        llama(_ids(1, 4))
        dumper.record_step("margin", torch.zeros(1))
    passes = read_passes(dumper.run_dir)
    assert list(passes) == [0]
    assert passes[0]["lm_head"].shape == (1, 4, VOCAB)
    records = tracedump.open_dump(dumper.run_dir).run().records
    assert records is not None and records.names == ["margin_0"]  # the profile call used no number
    assert dict(dumper.skipped) == {}


def test_profiling_inside_an_open_step_still_takes_no_pass_index(
    llama: nn.Module, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine whose step wrapper is outside its profile run gets the same result."""
    _set_dump_env(monkeypatch, tmp_path, filter='["lm_head"]')
    with tracedump.attach(llama) as dumper, torch.inference_mode():
        with dumper.step(), tracedump.profiling():
            llama(_ids(1, 32))
        with dumper.step(), dumper.profiling():
            llama(_ids(1, 32))
        assert dumper.pass_index == 0
        with dumper.step():
            real = llama(_ids(1, 4)).logits
    passes = read_passes(dumper.run_dir)
    assert list(passes) == [0]
    assert torch.equal(passes[0]["lm_head"], real)


def test_dumper_profiling_suspends_only_that_dumper(
    llama: nn.Module, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _set_dump_env(monkeypatch, tmp_path, filter='["^proj$", "lm_head"]')
    block = FlattenedBlock()
    with tracedump.attach(llama) as suspended, tracedump.attach(block) as running, torch.no_grad():
        with suspended.profiling():
            llama(_ids(1, 4))
            block(torch.randn(3, 8))
        assert suspended.pass_index == 0
        assert running.pass_index == 1
    assert _pass_files(suspended.run_dir) == []
    assert read_passes(running.run_dir)[0]["proj"].shape == (3, 8)


# --------------------------------------------------------------------------- STEPS


def test_steps_keeps_files_for_exactly_the_selected_pass_indices(
    llama: nn.Module, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _set_dump_env(monkeypatch, tmp_path, steps="0,3,5-6", filter='["lm_head"]')
    with tracedump.attach(llama) as dumper, torch.inference_mode():
        for seq in range(1, 9):  # pass n runs n + 1 tokens
            llama(_ids(1, seq))
        assert dumper.pass_index == 8
    assert _pass_files(dumper.run_dir) == [f"pass{n:05d}.safetensors" for n in (0, 3, 5, 6)]
    passes = read_passes(dumper.run_dir)
    assert {n: t["lm_head"].shape[1] for n, t in passes.items()} == {0: 1, 3: 4, 5: 6, 6: 7}
    assert tracedump.open_dump(dumper.run_dir).run().manifest["passes"]["indices"] == [0, 3, 5, 6]


def test_steps_numbering_skips_warm_ups_even_when_their_index_is_unselected(
    llama: nn.Module, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _set_dump_env(monkeypatch, tmp_path, steps="1", tokens="4", token_dim="1", filter='["lm_head"]')
    with tracedump.attach(llama) as dumper, torch.inference_mode():
        llama(_ids(2, 1))  # warm-up while index 0 is unselected: still no index
        llama(_ids(1, 4))  # pass 0
        llama(_ids(3, 1))  # warm-up again
        second = llama(_ids(1, 4)).logits  # pass 1
    assert _pass_files(dumper.run_dir) == ["pass00001.safetensors"]
    assert torch.equal(read_passes(dumper.run_dir)[1]["lm_head"], second)


def test_steps_with_no_selected_pass_left_writes_no_files(
    llama: nn.Module, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _set_dump_env(monkeypatch, tmp_path, steps="10-20")
    with tracedump.attach(llama) as dumper, torch.inference_mode():
        llama(_ids(1, 2))
        llama(_ids(1, 2))
        assert dumper.pass_index == 2
    assert _pass_files(dumper.run_dir) == []


# --------------------------------------------------------------------------- bad values


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("STEPS", "a-b"),
        ("STEPS", "-1"),
        ("STEPS", "3-1"),
        ("STEPS", "1,,x"),
        ("TOKENS", "0"),
        ("TOKENS", "-3"),
        ("TOKENS", "six"),
        ("MAX_ROWS", "0"),
        ("MAX_ROWS", "1.5"),
        ("TOKEN_DIM", "2"),
        ("TOKEN_DIM", "-1"),
    ],
)
def test_bad_gate_values_fail_at_attach_naming_the_env_var_and_value(
    llama: nn.Module, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, field: str, value: str
) -> None:
    _set_dump_env(monkeypatch, tmp_path, **{field.lower(): value})
    with pytest.raises(tracedump.ConfigError) as error:
        tracedump.attach(llama)
    assert f"TRACEDUMP_DUMP_{field}={value!r}" in str(error.value)
    assert not list(tmp_path.iterdir())  # nothing was created
    assert all(not hooks for hooks in (m._forward_hooks for m in llama.modules()))


def test_bad_gate_value_from_a_config_dict_names_the_config_field(llama: nn.Module, tmp_path: Path) -> None:
    with pytest.raises(tracedump.ConfigError, match=r"DumpConfig\.steps='3-1'"):
        tracedump.attach(llama, {"dir": str(tmp_path), "steps": "3-1"})


def test_bad_gate_value_under_an_engine_prefix_names_that_prefix(
    llama: nn.Module, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MYENGINE_DUMP_DIR", str(tmp_path))
    monkeypatch.setenv("MYENGINE_DUMP_MAX_ROWS", "-2")
    with pytest.raises(tracedump.ConfigError, match=r"MYENGINE_DUMP_MAX_ROWS='-2'"):
        tracedump.attach(llama, env_prefix="MYENGINE_")


def test_bad_gate_values_are_ignored_while_dumping_is_off(
    llama: nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Off means off: no dump dir, no validation, no cost (the settings are never read)."""
    monkeypatch.setenv("TRACEDUMP_DUMP_STEPS", "3-1")
    assert tracedump.attach(llama) is None
