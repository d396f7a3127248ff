"""Reading dumps back: load_pass order, lazy open_dump, .pt files, and `tracedump ls` / `show`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import tracedump
from tracedump.cli import main


@pytest.fixture
def dumped(tiny_llama, prompt_ids, tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path / "dump"))
    dumper = tracedump.attach(tiny_llama)
    with torch.no_grad():
        tiny_llama(prompt_ids)
        tiny_llama(prompt_ids[:, :2])
    dumper.close()
    return dumper.run_dir


def test_load_pass_restores_capture_order_not_file_order(tmp_path):
    tensors = {"z.last": torch.ones(2), "a.first": torch.zeros(3, dtype=torch.int64)}
    save_file(tensors, str(tmp_path / "x.safetensors"), metadata={"tracedump.order": '["z.last", "a.first"]'})
    loaded = tracedump.load_pass(tmp_path / "x.safetensors")
    assert list(loaded) == ["z.last", "a.first"]
    assert loaded["a.first"].dtype == torch.int64


def test_load_pass_reads_pt_files_with_weights_only(tmp_path):
    torch.save({"b": torch.ones(2), "a": torch.zeros(1)}, tmp_path / "ref.pt")
    loaded = tracedump.load_pass(tmp_path / "ref.pt")
    assert list(loaded) == ["b", "a"] and torch.equal(loaded["b"], torch.ones(2))


def test_load_pass_refuses_pickled_objects_in_pt_files(tmp_path):
    torch.save({"a": torch.ones(1), "obj": Path("/x")}, tmp_path / "evil.pt")
    with pytest.raises(Exception, match=r"(?i)weights_only|unsupported|dict of tensors"):
        tracedump.load_pass(tmp_path / "evil.pt")


def test_open_dump_lists_runs_and_passes_lazily(dumped):
    dump = tracedump.open_dump(dumped.parent)
    assert [r.path for r in dump.runs] == [dumped]
    run = dump.runs[0]
    assert run.rank == 0 and run.pid == os.getpid() and run.complete
    assert sorted(run.passes) == [0, 1]
    second = run.passes[1]
    assert second.info("lm_head").shape == (1, 2, 64) and second.info("lm_head").dtype == "float32"
    assert second.names == list(tracedump.load_pass(second.files[0]))
    assert torch.equal(second["lm_head"], tracedump.load_pass(second.files[0])["lm_head"])


def test_open_dump_accepts_a_run_dir_too(dumped):
    assert tracedump.open_dump(dumped).runs[0].path == dumped


def test_reading_one_tensor_maps_the_file_instead_of_reading_it(tmp_path):
    big = {f"t{i}": torch.full((1024, 1024), float(i)) for i in range(16)}  # 64 MiB
    save_file(big, str(tmp_path / "pass00000.safetensors"))
    pass_file = tracedump.open_dump(tmp_path).runs[0].passes[0]

    def rss_kib() -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")

    before = rss_kib()
    tensor = pass_file["t7"]
    grown_mib = (rss_kib() - before) / 1024
    assert float(tensor[0, 0]) == 7.0
    assert grown_mib < 24, f"reading one 4 MiB tensor grew RSS by {grown_mib:.0f} MiB"


def test_unreadable_inputs_raise_dump_read_error(tmp_path):
    (tmp_path / "junk.safetensors").write_text("not safetensors")
    with pytest.raises(tracedump.DumpReadError):
        tracedump.load_pass(tmp_path / "junk.safetensors")
    with pytest.raises(tracedump.DumpReadError):
        tracedump.open_dump(tmp_path / "missing")
    with pytest.raises(tracedump.DumpReadError):
        tracedump.open_dump(tmp_path)


def test_cli_ls_shows_runs_passes_tensors_and_bytes(dumped, capsys):
    assert main(["ls", str(dumped.parent)]) == 0
    out = capsys.readouterr().out
    assert dumped.name in out
    pass_files = list(dumped.glob("pass*.safetensors"))
    tensors = sum(len(tracedump.load_pass(p)) for p in pass_files)
    row = next(line for line in out.splitlines() if dumped.name in line)
    cells = [c.strip() for c in row.split("│") if c.strip()]
    assert cells[3] == "2" and cells[4] == str(tensors)
    assert cells[6] == "yes"


def test_cli_show_lists_tensors_in_capture_order_with_stats(dumped, capsys):
    path = dumped / "pass00000.safetensors"
    assert main(["show", str(path), "--filter", r"layers\.0\.mlp"]) == 0
    out = capsys.readouterr().out
    names = [n for n in tracedump.load_pass(path) if "layers.0.mlp" in n]
    positions = [out.index(n) for n in names]
    assert positions == sorted(positions)
    assert "model.layers.1" not in out
    down = tracedump.load_pass(path)["model.layers.0.mlp.down_proj"]
    row = next(line for line in out.splitlines() if "model.layers.0.mlp.down_proj" in line)
    assert f"{down.min().item():.4g}" in row and f"{down.abs().mean().item():.4g}" in row
    assert "[1, 6, 32]" in row and "float32" in row


def test_cli_exits_2_on_unreadable_input(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "tracedump", "ls", str(tmp_path / "nope")], capture_output=True, text=True
    )
    assert result.returncode == 2
    assert "not a directory" in result.stderr
