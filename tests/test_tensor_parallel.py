"""A TP=2 run against its TP=1 twin: ``tracedump diff --unshard`` puts the shards back together.

The model is the Megatron MLP: a column-parallel ``up`` (each rank holds half of W1's rows, so its
output is one half of the last dim), an activation on that shard, a row-parallel ``down`` (each rank
holds half of W2's columns, so its output is a partial sum), then a gloo all-reduce in ``mlp``, whose
output is the same on every rank. Both ranks and the unsharded twin name their modules ``mlp.up``,
``mlp.act``, ``mlp.down`` and ``mlp``, and are dumped with ``attach()`` like an integrated engine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import free_port

from tracedump.cli import main

TP_PROGRAM = """
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp
from torch import nn

import tracedump

OUT, PORT = sys.argv[1], sys.argv[2]
HIDDEN, INTERMEDIATE, WORLD = 8, 12, 2


class MLP(nn.Module):
    def __init__(self, up_weight, down_weight, all_reduce):
        super().__init__()
        self.up = nn.Linear(HIDDEN, up_weight.shape[0], bias=False)
        self.act = nn.SiLU()
        self.down = nn.Linear(down_weight.shape[1], HIDDEN, bias=False)
        with torch.no_grad():
            self.up.weight.copy_(up_weight)
            self.down.weight.copy_(down_weight)
        self.all_reduce = all_reduce

    def forward(self, x):
        out = self.down(self.act(self.up(x)))
        if self.all_reduce:
            out = out.clone()
            dist.all_reduce(out)
        return out


class Model(nn.Module):
    def __init__(self, mlp):
        super().__init__()
        self.mlp = mlp

    def forward(self, x):
        return self.mlp(x)


def build(rank=None, perturb=False):
    generator = torch.Generator().manual_seed(0)
    up = torch.randn(INTERMEDIATE, HIDDEN, generator=generator)
    down = torch.randn(HIDDEN, INTERMEDIATE, generator=generator)
    if rank is None:
        return Model(MLP(up, down, all_reduce=False))
    up_shard = up.chunk(WORLD, dim=0)[rank].clone()      # column parallel: output features split
    down_shard = down.chunk(WORLD, dim=1)[rank].clone()  # row parallel: input features split
    if perturb and rank == 1:
        down_shard[0, 0] += 0.5
    return Model(MLP(up_shard, down_shard, all_reduce=True))


def tokens():
    return torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(1))


def dump(model, variant):
    dumper = tracedump.attach(model, {"dir": f"{OUT}/{variant}", "modules": "all"})
    with torch.no_grad():
        model(tokens())
    dumper.close()


def rank_worker(rank):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{PORT}", rank=rank, world_size=WORLD)
    dump(build(rank), "tp2")
    dump(build(rank, perturb=True), "tp2_perturbed")
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    torch_mp.start_processes(rank_worker, nprocs=WORLD, start_method="fork")
    dump(build(), "tp1")
"""

UNSHARD = ["--unshard", r"mlp\.(up|act)$=cat:-1", "--unshard", r"mlp\.down$=sum"]


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``tp2/``, ``tp2_perturbed/`` (2 ranks each) and ``tp1/`` (the unsharded twin)."""
    root = tmp_path_factory.mktemp("tp")
    script = root / "tp.py"
    script.write_text(textwrap.dedent(TP_PROGRAM))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRACEDUMP_") and k != "RANK"}
    result = subprocess.run(
        [sys.executable, str(script), str(root), str(free_port())],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return root


def diff(a: Path, b: Path, report: Path, *extra: str) -> tuple[int, dict]:
    status = main(["diff", str(a), str(b), *extra, "--json", str(report), "--no-progress"])
    return status, json.loads(report.read_text())


def test_each_tp_rank_holds_its_shard(dumps: Path) -> None:
    from tracedump import open_dump

    runs = open_dump(dumps / "tp2").by_rank()
    assert sorted(runs) == [0, 1]
    for (run,) in runs.values():
        assert run.manifest["world_size"] == 2
        shapes = {name: tuple(run.passes[0][name].shape) for name in run.passes[0].names}
        assert shapes == {"mlp.up": (5, 6), "mlp.act": (5, 6), "mlp.down": (5, 8), "mlp": (5, 8)}


def test_a_tp2_run_unsharded_matches_its_tp1_twin(dumps: Path, tmp_path: Path) -> None:
    status, report = diff(dumps / "tp2", dumps / "tp1", tmp_path / "clean.json", *UNSHARD)
    assert status == 0, report["summary"]
    assert report["summary"]["first_divergence"] is None
    assert report["summary"]["compared"] == 4 and report["summary"]["rank_mismatch"] == 0


def test_a_perturbed_shard_is_named_as_the_first_divergence(dumps: Path, tmp_path: Path) -> None:
    status, report = diff(dumps / "tp2_perturbed", dumps / "tp1", tmp_path / "perturbed.json", *UNSHARD)
    assert status == 1
    first = report["summary"]["first_divergence"]
    assert (first["name"], first["pass"]) == ("mlp.down", 0)  # before the all-reduce spreads it to mlp
