"""A hand ``--unshard`` rule checked against the ranks' load records: a TP=2 engine run whose
fused ``qkv_proj`` holds ``[q_r | k_r | v_r]`` on each rank (as its ``correspondence.json``
records), against a one-rank HF-style reference holding ``q_proj``, ``k_proj``, ``v_proj``.

Without a rule the ranks are joined as the records say and the two runs agree. With the rule an
earlier version of the docs gave, ``qkv_proj|gate_up_proj=cat:-1``, the ranks are concatenated
whole (``[q_0 k_0 v_0 | q_1 k_1 v_1]``), a false divergence: the rule is the user's word and is
applied, but the rows, the summary and the JSON say that it contradicts the recorded load.
Real files on disk, the writer's own pass format, no engine needed.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from conftest import checkpoint_source, write_recorded_run

from tracedump.cli import main
from tracedump.compare import compare
from tracedump.compare.options import UnshardRule
from tracedump.compare.pair.rank_joins import join_contradiction
from tracedump.store.correspondence import Correspondence, Load

H, ROWS, WORLD, TOKENS = 8, 8, 2, 5  # hidden; rows of each of q, k, v; ranks; tokens
OLD_RULE = "qkv_proj|gate_up_proj=cat:-1"


def _weights() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {f"l.{x}_proj.weight": torch.randn(ROWS, H, generator=generator) for x in "qkv"}


def _engine(base: Path, weights: dict[str, torch.Tensor], x: torch.Tensor) -> Path:
    """Two ranks; each holds rows [rank*4, rank*4 + 4) of q, k and v, fused as [q_r | k_r | v_r]."""
    half = ROWS // WORLD
    sources = {name: checkpoint_source(w) for name, w in weights.items()}
    for rank in range(WORLD):
        rows = [w[rank * half : (rank + 1) * half] for w in weights.values()]
        loads = [
            Load(param="l.qkv_proj.weight", source=f"l.{x}_proj.weight", shard=x,
                 region=[[k * half, (k + 1) * half], [0, H]], rows=[[0, rank * half, half]])
            for k, x in enumerate("qkv")
        ]  # fmt: skip
        params = {"l.qkv_proj.weight": {"module": "l.qkv_proj", "shape": [3 * half, H]}}
        record = Correspondence(parameters=params, sources=sources, loads=loads, tp_rank=rank, tp_size=WORLD)
        manifest = {
            "rank": rank, "pid": 100 + rank, "root": "Toy", "world_size": WORLD, "framework": "vllm",
            "module_classes": {"": "Toy", "l": "Layer", "l.qkv_proj": "QKVParallelLinear"},
        }  # fmt: skip
        output = x @ torch.cat(rows).T  # [tokens, 12]: [q_r | k_r | v_r]
        write_recorded_run(base / f"rank{rank}_pid{100 + rank}", manifest, {"l.qkv_proj[0]": output}, record)
    return base


def _reference(base: Path, weights: dict[str, torch.Tensor], x: torch.Tensor) -> Path:
    params = {
        name: {"module": name.rpartition(".")[0], **checkpoint_source(w)} for name, w in weights.items()
    }
    manifest = {
        "rank": 0, "pid": 200, "root": "Toy", "world_size": 1, "framework": "transformers",
        "module_classes": {"": "Toy", "l": "Layer", **{f"l.{x}_proj": "Linear" for x in "qkv"}},
    }  # fmt: skip
    outputs = {f"l.{name}_proj": x @ weights[f"l.{name}_proj.weight"].T for name in "qkv"}
    write_recorded_run(base / "rank0_pid200", manifest, outputs, Correspondence(parameters=params))
    return base


def _runs(tmp_path: Path) -> tuple[Path, Path]:
    weights = _weights()
    x = torch.randn(TOKENS, H, generator=torch.Generator().manual_seed(1))
    return _engine(tmp_path / "engine", weights, x), _reference(tmp_path / "hf", weights, x)


def test_the_ranks_are_joined_as_their_load_records_say(tmp_path: Path) -> None:
    engine, hf = _runs(tmp_path)
    report = compare(engine, hf)
    compared = {r.name_b: r for r in report.results}
    assert set(compared) == {"l.q_proj", "l.k_proj", "l.v_proj"}  # the premise: split into q, k, v
    assert report.exit_code == 0
    assert all(r.metrics is not None and r.metrics.max_abs < 1e-5 for r in compared.values())
    assert not any("--unshard" in (r.pairing or "") for r in report.results)
    assert not any("--unshard" in note for note in report.settings["notes"])


def test_a_hand_unshard_rule_the_load_record_contradicts_is_reported(tmp_path: Path, capsys) -> None:
    engine, hf = _runs(tmp_path)
    report = compare(engine, hf, unshard=(OLD_RULE,))
    assert report.exit_code == 1  # the rule is applied: [q_0 k_0 v_0 | q_1 ...] is no [q | k | v]
    rows = {r.name_b: r for r in report.results}
    expected = (
        f"--unshard '{OLD_RULE}' concatenates the ranks along dim -1 for l.qkv_proj[0], but the "
        "ranks' load record says each rank's 12 outputs are [l.q_proj.weight rows | l.k_proj.weight "
        "rows | l.v_proj.weight rows] (a slice of each), joined source by source: rank 0 [0:4], "
        "rank 1 [0:4], rank 0 [4:8], rank 1 [4:8], rank 0 [8:12], rank 1 [8:12]: the rule "
        "contradicts the recorded load"
    )
    assert all(expected in (rows[name].pairing or "") for name in ("l.q_proj", "l.k_proj", "l.v_proj"))
    assert report.settings["notes"].count(expected) == 1  # the summary says it once
    document = report.to_json()
    assert expected in document["settings"]["notes"]
    assert any(expected in (row.get("pairing") or "") for row in document["tensors"])

    assert main(["diff", str(engine), str(hf), "--unshard", OLD_RULE]) == 1
    printed = re.sub(r"\s+", " ", capsys.readouterr().out)
    assert "the rule contradicts the recorded load" in printed and OLD_RULE in printed


def test_a_rule_that_joins_as_the_record_says_is_no_contradiction() -> None:
    pattern = re.compile("qkv")
    by_rank = UnshardRule(pattern, "gather", -1, ((0, 0, 6), (1, 0, 6)), recorded="rank by rank")
    interleaved = UnshardRule(pattern, "gather", -1, ((0, 0, 3), (1, 0, 3), (0, 3, 6), (1, 3, 6)))
    cat_last, cat_first = UnshardRule(pattern, "cat", -1), UnshardRule(pattern, "cat", 0)
    assert join_contradiction("qkv[0]", 2, UnshardRule(pattern, "cat", 1), by_rank) is None  # dim 1 is -1
    assert join_contradiction("attn", 2, cat_last, cat_last) is None
    assert join_contradiction("qkv[0]", 2, cat_last, interleaved) is not None
    assert join_contradiction("qkv[0]", 2, cat_first, by_rank) is not None
    assert join_contradiction("attn", 2, UnshardRule(pattern, "sum"), cat_last) is not None
