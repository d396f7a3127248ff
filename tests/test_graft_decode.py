"""Grafting a ``generate()``: decode passes of one token are judged on their few elements.

The fp32 reference is a greedy ``generate()`` (3 new tokens) of the calibration Llama (6 layers,
GQA), dumped with INPUTS=1: a prefill pass and two one-token decode passes. The bf16 model is
dumped grafted from it. A one-token tensor's rel_diff is the mean of its hidden values' squared
roundings only, so it spreads wider than a prefill pass's: the local allowance widens by a tail
factor for small tensors (``tail_factor``) and stays as tight as calibrated for prefill passes.
Premises first: the decode passes really are one token, and the bf16 run really differs there.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tracedump
from benchmarks import common
from benchmarks.calibrate import INIT, _random_norms
from benchmarks.calibrate_graft import LEVELS
from tests.conftest import MODEL_SEED
from tracedump.compare import compare
from tracedump.compare.judge.verdict import N_CALIBRATED, tail_factor

pytest.importorskip("transformers")

LAYER = LEVELS["llama"]
NEW_TOKENS = 3


def _llama(dtype: torch.dtype, bug: bool) -> torch.nn.Module:
    """The reviewer's Llama: 6 layers, GQA (4 heads, 2 KV), hidden 128, weights at 5x HF's init,
    norms 1 +- 0.2; ``bug``: layer 3's MLP output scaled by 1.02."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=INIT,
        attn_implementation="eager",
    )
    torch.manual_seed(MODEL_SEED)
    model = _random_norms(LlamaForCausalLM(config)).eval().to(dtype)
    if bug:
        model.model.layers[3].mlp.register_forward_hook(lambda mod, args, out: out * 1.02)
    return model


def _generate_dump(
    out: Path, dtype: torch.dtype, graft_from: Path | None = None, level: str | None = None, bug: bool = False
) -> Path:
    model = _llama(dtype, bug)
    config: dict[str, object] = {"dir": str(out), "modules": "all", "inputs": True}
    if graft_from is not None:
        config.update(graft_from=str(graft_from), graft_level=level)
    with common.clean_env():
        dumper = tracedump.attach(model, config)
    assert dumper is not None
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        model.generate(input_ids=ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    dumper.close()
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _generate_dump(tmp_path_factory.mktemp("graft_decode") / "ref", torch.float32)


def test_the_tail_factor_is_one_for_calibrated_sizes_and_wider_for_a_token() -> None:
    assert tail_factor(N_CALIBRATED) == 1.0 and tail_factor(24 * 64) == 1.0 and tail_factor(10**6) == 1.0
    assert 2.0 < tail_factor(128, 1) < 2.6  # one token: one row's spread, not its 128 elements'
    assert 1.3 < tail_factor(68, 4) < 1.6  # a decode step's attention weights: 4 heads x 17 keys
    assert tail_factor(64) > tail_factor(128) > tail_factor(512) > 1.0
    assert tail_factor(128, 1) > tail_factor(1536, 12) > 1.0 == tail_factor(1536, 16)


@pytest.mark.parametrize("level", [None, LAYER], ids=["leaf", "layer"])
def test_a_clean_bf16_generate_grafted_from_fp32_exits_0(
    reference: Path, tmp_path: Path, level: str | None
) -> None:
    grafted = _generate_dump(tmp_path / "bf16", torch.bfloat16, reference, level)
    passes = tracedump.open_dump(grafted).run().passes
    assert len(passes) == NEW_TOKENS
    down = "model.layers.0.mlp.down_proj"
    ref_passes = tracedump.open_dump(reference).run().passes
    for index in (1, 2):  # premise: one-token decode passes that differ from the reference
        a, b = passes[index][down], ref_passes[index][down]
        assert a.shape[-2] == 1 and a.dtype == torch.bfloat16
        assert not torch.equal(a.float(), b)
    report = compare(grafted, reference)
    local = [t for t in report.results if getattr(t, "local", False)]
    decode = [t for t in local if t.pass_index > 0 and t.threshold is not None]
    assert decode, "no decode tensor was judged locally"
    one_token = [t for t in decode if t.tolerance.source and "elements" in t.tolerance.source]
    assert one_token, "no decode tensor got the small-tensor tail"  # the case this file is about
    assert report.exit_code == 0, [
        (t.name, t.pass_index, t.error, t.threshold) for t in local if t.status != "ok"
    ]


def test_a_planted_mlp_bug_in_layer_3_is_still_named_on_the_prefill_pass(
    reference: Path, tmp_path: Path
) -> None:
    ungrafted = _generate_dump(tmp_path / "plain", torch.bfloat16, bug=True)
    clean = _generate_dump(tmp_path / "plain_clean", torch.bfloat16)
    key = "model.layers.3.mlp"
    a = tracedump.open_dump(ungrafted).run().passes[0][key]
    b = tracedump.open_dump(clean).run().passes[0][key]
    assert not torch.equal(a, b)  # premise: the bug changes layer 3's MLP
    grafted = _generate_dump(tmp_path / "bug", torch.bfloat16, reference, LAYER, bug=True)
    report = compare(grafted, reference)
    first = report.first_divergence
    assert report.exit_code == 1 and first is not None
    assert first.pass_index == 0 and first.name.startswith("model.layers.3."), (first.name, first.pass_index)
