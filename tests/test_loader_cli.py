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
from tracedump.store.loader import open_pass


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


def _maps_of(directory: Path) -> int:
    """Memory maps this process holds of files under ``directory``."""
    return sum(str(directory) in line for line in Path("/proc/self/maps").read_text().splitlines())


def test_listing_a_dump_opens_no_pass_file_and_reading_headers_maps_none(tmp_path):
    """3000 passes used to mean 3000+ maps up front (vm.max_map_count is 65530 by default)."""
    for index in range(40):
        save_file({"x": torch.full((4,), float(index))}, str(tmp_path / f"pass{index:05d}.safetensors"))
    (tmp_path / "pass00040.safetensors").write_bytes(b"garbage, found only when pass 40 is used")
    run = tracedump.open_dump(tmp_path).runs[0]
    assert sorted(run.passes) == list(range(41))  # listing reads no file: the garbage goes unnoticed
    assert [run.passes[i].info("x").shape for i in range(40)] == [(4,)] * 40
    assert _maps_of(tmp_path) == 0
    assert float(run.passes[7]["x"][0]) == 7.0  # reading a tensor maps its file, and only that one
    assert _maps_of(tmp_path) == 1
    with pytest.raises(tracedump.DumpReadError, match=r"pass00040\.safetensors: not a readable safetensors"):
        len(run.passes[40])


def test_truncated_pass_files_exit_2_in_ls_and_show(dumped, capsys):
    victim = dumped / "pass00001.safetensors"
    whole = victim.read_bytes()
    for cut in (6, 100, len(whole) - 8):  # no header length; inside the header; inside the data
        victim.write_bytes(whole[:cut])
        for command in (["ls", str(dumped)], ["show", str(victim)]):
            assert main(command) == 2, (command, cut)
            assert f"{victim}: not a readable safetensors file" in capsys.readouterr().err


def test_bad_order_metadata_falls_back_to_sorted_names(tmp_path):
    save_file(
        {"b": torch.ones(1), "a": torch.ones(1)}, str(tmp_path / "x.safetensors"), {"tracedump.order": "[no"}
    )
    assert open_pass(tmp_path / "x.safetensors").names == ["a", "b"]


def _run_dir(base: Path, name: str, root: str) -> None:
    (base / name).mkdir(parents=True)
    save_file({"x": torch.ones(1)}, str(base / name / "pass00000.safetensors"))
    (base / name / "manifest.json").write_text(f'{{"rank": 0, "pid": 1, "root": "{root}"}}')


def test_dump_run_refuses_to_guess_between_runs_of_one_rank_and_root(tmp_path):
    _run_dir(tmp_path, "rank0_pid1", "Llama")
    _run_dir(tmp_path, "rank0_pid2", "Llama")
    with pytest.raises(
        tracedump.DumpReadError, match="several runs of rank 0 for root 'Llama': rank0_pid1, rank0_pid2"
    ):
        tracedump.open_dump(tmp_path).run()


def test_dump_run_tells_roots_apart_by_label(tmp_path):
    for serial, root in ((1, "Vae"), (2, "Unet"), (10, "TextEncoder")):
        _run_dir(tmp_path, "rank0_pid1" + (f"-{serial}" if serial > 1 else ""), root)
    dump = tracedump.open_dump(tmp_path)
    assert [r.name for r in dump.runs] == ["rank0_pid1", "rank0_pid1-2", "rank0_pid1-10"]
    assert dump.run().name == "rank0_pid1"  # the process's first root
    assert dump.run(root="TextEncoder").name == "rank0_pid1-10"
    with pytest.raises(tracedump.DumpReadError, match="no run of root 'Clip'"):
        dump.run(root="Clip")
