"""Multi-rank and data-parallel runs under ``tracedump run``: one run dir per process, all visible.

One program does both, to pay for one torch + transformers import: a real 2-rank gloo group
(``torch.multiprocessing``, forked workers, rank taken from ``torch.distributed``), then two
data-parallel style workers that each report ``RANK=0``. Every worker saves the logits it computed,
so the test can tell that each run dir holds its own process's tensors.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import free_port

import tracedump
from tracedump.cli import main

pytest.importorskip("transformers")

RANKS_PROGRAM = """
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp
import transformers

OUT, PORT = sys.argv[1], sys.argv[2]


def tiny_llama():
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def prompt(seed):
    return torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(seed))


def group_worker(rank):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{PORT}", rank=rank, world_size=2)
    model = tiny_llama()
    with torch.no_grad():
        logits = model(prompt(rank)).logits
        total = logits.sum().reshape(1)
        dist.all_reduce(total)
        model(prompt(rank))
    torch.save({"pid": os.getpid(), "logits": logits, "total": total}, f"{OUT}/group_{rank}.pt")
    dist.destroy_process_group()


def data_parallel_worker(index):
    os.environ["RANK"] = "0"  # every replica believes it is rank 0
    model = tiny_llama()
    with torch.no_grad():
        logits = model(prompt(10 + index)).logits
    torch.save({"pid": os.getpid(), "logits": logits}, f"{OUT}/replica_{index}.pt")


if __name__ == "__main__":
    torch.set_num_threads(1)
    torch_mp.start_processes(group_worker, nprocs=2, start_method="fork")
    torch_mp.start_processes(data_parallel_worker, nprocs=2, start_method="fork")
"""


@pytest.fixture(scope="module")
def ranks_dump(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    """(dump dir, worker outputs dir, launcher stderr) of one ``tracedump run`` of the program."""
    root = tmp_path_factory.mktemp("ranks")
    script = root / "ranks.py"
    script.write_text(textwrap.dedent(RANKS_PROGRAM))
    outputs = root / "outputs"
    outputs.mkdir()
    dump_dir = root / "dump"
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("TRACEDUMP_") or k == "RANK"}
    launcher_stderr = io.StringIO()
    command = [sys.executable, str(script), str(outputs), str(free_port())]
    try:
        with contextlib.redirect_stderr(launcher_stderr):
            status = main(["run", "--dir", str(dump_dir), "--", *command])
    finally:
        os.environ.update(saved)
    assert status == 0, launcher_stderr.getvalue()
    return dump_dir, outputs, launcher_stderr.getvalue()


def worker_outputs(outputs: Path, prefix: str) -> list[dict[str, torch.Tensor]]:
    return [torch.load(outputs / f"{prefix}_{i}.pt") for i in range(2)]


def test_each_rank_of_a_gloo_group_writes_its_own_run_dir_with_rank_and_world_size(
    ranks_dump: tuple[Path, Path, str],
) -> None:
    dump_dir, outputs, _ = ranks_dump
    runs = {run.name: run for run in tracedump.open_dump(dump_dir).runs}
    group = worker_outputs(outputs, "group")
    both_ranks = group[0]["logits"].sum() + group[1]["logits"].sum()
    torch.testing.assert_close(group[0]["total"], both_ranks.reshape(1))  # a real all-reduce ran
    for rank, saved in enumerate(group):
        run = runs[f"rank{rank}_pid{saved['pid']}"]
        assert (run.manifest["rank"], run.manifest["world_size"], run.manifest["pid"]) == (
            rank,
            2,
            saved["pid"],
        )
        assert sorted(run.passes) == [0, 1]
        assert torch.equal(run.passes[0]["lm_head"], saved["logits"])  # its own rank's tensors


def test_replicas_that_all_report_rank_0_stay_apart_by_pid(ranks_dump: tuple[Path, Path, str]) -> None:
    dump_dir, outputs, _ = ranks_dump
    runs = {run.name: run for run in tracedump.open_dump(dump_dir).runs}
    replicas = worker_outputs(outputs, "replica")
    assert replicas[0]["pid"] != replicas[1]["pid"]
    for saved in replicas:
        run = runs[f"rank0_pid{saved['pid']}"]
        assert (run.manifest["rank"], run.manifest["world_size"]) == (0, 1)
        assert torch.equal(run.passes[0]["lm_head"], saved["logits"])
    assert not torch.equal(replicas[0]["logits"], replicas[1]["logits"])  # nothing was overwritten


def test_the_loader_ls_and_the_run_summary_show_every_rank(
    ranks_dump: tuple[Path, Path, str], capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    dump_dir, outputs, launcher_stderr = ranks_dump
    pids = [saved["pid"] for prefix in ("group", "replica") for saved in worker_outputs(outputs, prefix)]
    expected = sorted(
        [f"rank0_pid{pids[0]}", f"rank1_pid{pids[1]}", f"rank0_pid{pids[2]}", f"rank0_pid{pids[3]}"]
    )
    dump = tracedump.open_dump(dump_dir)
    assert sorted(run.name for run in dump.runs) == expected
    assert {rank: len(runs) for rank, runs in dump.by_rank().items()} == {0: 3, 1: 1}

    monkeypatch.setenv("COLUMNS", "200")
    assert main(["ls", str(dump_dir)]) == 0
    listing = capfd.readouterr().out
    assert all(name in listing for name in expected)
    assert "4 run dir(s)" in launcher_stderr
    assert all(f"{name}: root LlamaForCausalLM" in launcher_stderr for name in expected)


EARLY_ATTACH_PROGRAM = """
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp

import tracedump

OUT, PORT = sys.argv[1], sys.argv[2]


def worker(rank):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    dumper = tracedump.attach(model)  # before the group exists, and no RANK env var
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{PORT}", rank=rank, world_size=2)
    model(torch.full((1, 4), float(rank)))
    dumper.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    torch_mp.start_processes(worker, nprocs=2, start_method="fork")
"""


def test_attach_before_init_process_group_still_writes_one_dir_per_rank(tmp_path):
    import subprocess

    program = tmp_path / "early.py"
    program.write_text(EARLY_ATTACH_PROGRAM)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["TRACEDUMP_DUMP_DIR"] = str(tmp_path / "dump")
    subprocess.run(
        [sys.executable, str(program), str(tmp_path), str(free_port())], env=env, check=True, timeout=120
    )

    runs = tracedump.open_dump(tmp_path / "dump").runs
    assert sorted(r.rank for r in runs) == [0, 1]
    for run in runs:
        assert re.fullmatch(rf"rank{run.rank}_pid\d+", run.path.name)  # rank 0 keeps its name too
        assert run.manifest["rank"] == run.rank and run.manifest["world_size"] == 2
        assert run.complete
        assert run.passes[0].names == ["0"] and run.passes[0].info("0").shape == (1, 4)
