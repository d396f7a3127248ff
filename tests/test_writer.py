"""The writer under stress: back-pressure, part files, atomic files, and a full disk.

These are the promises that matter when a dump runs for hours on a busy machine: host memory stays
under ``MAX_PENDING_BYTES`` (give or take the one tensor being copied) and nothing is dropped; a
pass bigger than the cap still lands, in parts the loader puts back together; a crash never leaves
a truncated file under a final name; and a full disk stops the dump, not the model.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import make_tiny_llama, tracedump_warnings
from safetensors.torch import load_file
from torch import nn

import tracedump
import tracedump.dump.writer
from tracedump import TracedumpWarning, load_pass, open_dump
from tracedump.dump.writer import Writer
from tracedump.store.loader import open_pass

PROMPTS = [[3, 14, 15, 9, 26, 5], [7, 1, 2, 8, 4], [1, 2, 3, 4, 5, 6], [9, 9, 2], [5, 6, 7, 8, 9, 10]]


pytestmark = pytest.mark.usefixtures("fresh_warn_once")


@contextlib.contextmanager
def reference_outputs(model: nn.Module) -> Iterator[list[dict[str, torch.Tensor]]]:
    """Plain forward hooks on every leaf: one dict of cloned outputs per forward, in firing order."""
    passes: list[dict[str, torch.Tensor]] = []
    handles = []
    for name, module in model.named_modules():
        if list(module.children()):
            continue

        def hook(_module: nn.Module, _args: Any, output: Any, name: str = name) -> None:
            outputs = output if isinstance(output, tuple) else (output,)
            for index, tensor in enumerate(outputs):
                key = name if isinstance(output, torch.Tensor) else f"{name}[{index}]"
                passes[-1][key] = tensor.detach().clone()

        handles.append(module.register_forward_hook(hook))
    try:
        yield passes
    finally:
        for handle in handles:
            handle.remove()


def run_prompts(model: nn.Module, prompts: list[list[int]]) -> tuple[tracedump.Dumper, list[dict[str, Any]]]:
    """Attach, run one forward per prompt (one pass each), close; return the plain-hook reference."""
    dumper = tracedump.attach(model)
    assert dumper is not None
    with reference_outputs(model) as reference, torch.no_grad():
        for prompt in prompts:
            reference.append({})
            model(torch.tensor([prompt]))
    dumper.close()
    return dumper, reference


def assert_pass_equals(stored: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Same keys in the same (capture) order, every value bit-identical."""
    assert list(stored) == list(expected)
    for key, tensor in expected.items():
        assert torch.equal(stored[key], tensor), key


def part_number(path: Path) -> int:
    """``pass00000.part12.safetensors`` -> 12."""
    return int(path.name.split(".part")[1].split(".")[0])


def manifest(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "manifest.json").read_text())


def slow_saves(monkeypatch: pytest.MonkeyPatch, delay_s: float) -> list[str]:
    """Make every pass-file write take at least ``delay_s``: a writer that falls behind the forward."""
    original = tracedump.dump.writer.save_tensors_atomic
    saved: list[str] = []

    def slow_save(
        path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str], **options: Any
    ) -> int:
        time.sleep(delay_s)
        saved.append(path.name)
        return original(path, tensors, metadata, **options)

    monkeypatch.setattr(tracedump.dump.writer, "save_tensors_atomic", slow_save)
    return saved


# ---------------------------------------------------------------------------------------------
# Back-pressure


def test_a_slow_writer_under_a_tiny_cap_makes_the_forward_wait_and_drops_nothing(
    dump_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cap = 32 << 10  # one pass of the tiny Llama (<= 22 KB) fits; two do not
    monkeypatch.setenv("TRACEDUMP_DUMP_MAX_PENDING_BYTES", "32KiB")
    forward_is_waiting = threading.Event()
    waits: list[tuple[int, int]] = []
    after_wait: list[tuple[int, int]] = []
    held_after_submit: list[int] = []
    original_save = tracedump.dump.writer.save_tensors_atomic
    original_wait, original_submit = Writer.wait_below, Writer.submit

    def save_once_the_forward_waits(
        path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str], **options: Any
    ) -> int:
        # The writer has fallen behind for as long as the forward keeps going: deterministic, no sleeps.
        forward_is_waiting.wait(timeout=30)
        return original_save(path, tensors, metadata, **options)

    def counting_wait(self: Writer, limit: int) -> None:
        if self.pending_bytes > limit:
            waits.append((self.pending_bytes, limit))
            forward_is_waiting.set()
        original_wait(self, limit)
        after_wait.append((self.pending_bytes, limit))

    def recording_submit(self: Writer, job: Any) -> None:
        original_submit(self, job)
        held_after_submit.append(self.pending_bytes)

    monkeypatch.setattr(tracedump.dump.writer, "save_tensors_atomic", save_once_the_forward_waits)
    monkeypatch.setattr(Writer, "wait_below", counting_wait)
    monkeypatch.setattr(Writer, "submit", recording_submit)
    model = make_tiny_llama()

    dumper, reference = run_prompts(model, PROMPTS)

    assert waits, "the forward never had to wait for the writer"
    assert all(pending <= limit or pending == 0 for pending, limit in after_wait)
    assert max(held_after_submit) <= cap
    assert max(sum(t.numel() * t.element_size() for t in p.values()) for p in reference) <= cap
    assert sorted(p.name for p in dumper.run_dir.glob("pass*")) == [
        f"pass{i:05d}.safetensors" for i in range(5)
    ]
    for index, expected in enumerate(reference):
        assert_pass_equals(load_pass(dumper.run_dir / f"pass{index:05d}.safetensors"), expected)
    written = manifest(dumper.run_dir)
    assert written["complete"] is True
    assert written["passes"]["indices"] == [0, 1, 2, 3, 4]
    assert written["skipped"] == {}


def test_a_pass_larger_than_the_cap_is_written_in_numbered_parts_the_loader_reassembles(
    dump_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cap = 2048  # a tiny-Llama pass holds ~20 KB: several parts per pass
    monkeypatch.setenv("TRACEDUMP_DUMP_MAX_PENDING_BYTES", str(cap))
    model = make_tiny_llama()

    dumper, reference = run_prompts(model, PROMPTS[:2])

    run_dir = dumper.run_dir
    assert not (run_dir / "pass00000.safetensors").exists()
    for index, expected in enumerate(reference):
        parts = sorted(run_dir.glob(f"pass{index:05d}.part*.safetensors"), key=part_number)
        assert [part_number(p) for p in parts] == list(range(1, len(parts) + 1)) and len(parts) >= 3
        largest_tensor = max(t.numel() * t.element_size() for t in expected.values())
        for path in parts:
            part = load_file(str(path))  # one part on its own, bypassing the loader's reassembly
            assert part, f"{path.name} is empty"
            assert sum(t.numel() * t.element_size() for t in part.values()) <= cap + largest_tensor
        # Any name of the pass opens the whole pass, in capture order.
        assert_pass_equals(load_pass(run_dir / f"pass{index:05d}.safetensors"), expected)
        assert_pass_equals(load_pass(parts[-1]), expected)
        assert open_pass(parts[0]).names == list(expected)
    run = open_dump(dumper.run_dir.parent).runs[0]
    assert sorted(run.passes) == [0, 1]
    assert run.passes[1].names == list(reference[1])
    assert_pass_equals(run.passes[0].load(), reference[0])
    assert run.passes[0].metadata["tracedump.part"] == "1"
    assert manifest(run_dir)["passes"]["indices"] == [0, 1]


def test_parts_and_back_pressure_together_keep_every_value_under_a_slow_writer(
    dump_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRACEDUMP_DUMP_MAX_PENDING_BYTES", "4KiB")
    saved = slow_saves(monkeypatch, delay_s=0.01)
    model = make_tiny_llama()

    dumper, reference = run_prompts(model, PROMPTS[:3])

    run = open_dump(dumper.run_dir).runs[0]
    assert len(saved) == sum(len(p.files) for p in run.passes.values())
    for index, expected in enumerate(reference):
        assert_pass_equals(run.passes[index].load(), expected)


# ---------------------------------------------------------------------------------------------
# Atomic, private files


def test_a_closed_run_leaves_no_temp_files_and_private_permissions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = tmp_path / "fresh" / "dump"
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(base))
    model = make_tiny_llama()

    full, _ = run_prompts(model, PROMPTS[:2])
    monkeypatch.setenv("TRACEDUMP_DUMP_MODE", "stats")
    stats, _ = run_prompts(model, PROMPTS[:1])

    assert sorted(p.name for p in full.run_dir.iterdir()) == [
        "correspondence.json",
        "manifest.json",
        "pass00000.safetensors",
        "pass00001.safetensors",
    ]
    assert sorted(p.name for p in stats.run_dir.iterdir()) == [
        "correspondence.json",
        "manifest.json",
        "stats.jsonl",
    ]
    assert list(base.rglob("*.tmp")) == [] and list(base.rglob(".*")) == []
    for directory in (base, full.run_dir, stats.run_dir):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700, directory
    for file in [*full.run_dir.iterdir(), *stats.run_dir.iterdir()]:
        assert stat.S_IMODE(file.stat().st_mode) == 0o600, file


def test_a_write_that_fails_halfway_leaves_no_file_under_the_final_name(
    dump_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def half_then_fail(
        tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str], **options: Any
    ) -> None:
        Path(path).write_bytes(b"\0" * 4096)  # half a file
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(tracedump.dump.writer, "save_file", half_then_fail)
    model = make_tiny_llama()

    with pytest.warns(TracedumpWarning, match="Input/output error"):
        dumper, _ = run_prompts(model, PROMPTS[:1])

    assert sorted(p.name for p in dumper.run_dir.iterdir()) == ["correspondence.json", "manifest.json"]
    assert open_dump(dumper.run_dir).runs[0].passes == {}
    assert manifest(dumper.run_dir)["complete"] is False


CRASH_SCRIPT = """
import os, torch
import tracedump, tracedump.dump.writer

def half_then_die(tensors, path, metadata, **options):
    with open(path, "wb") as f:
        f.write(b"\\0" * 4096)
        f.flush()
    os._exit(17)  # the process dies mid-write: no cleanup, no rename

tracedump.dump.writer.save_file = half_then_die
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())  # the model is beside the point here
dumper = tracedump.attach(model)
with torch.no_grad():
    model(torch.ones(3, 4))
dumper.close()
"""


def test_a_process_killed_mid_write_leaves_only_a_dot_temp_file_that_the_loader_ignores(
    dump_dir: Path,
) -> None:
    env = {**os.environ, "TRACEDUMP_DUMP_DIR": str(dump_dir)}

    result = subprocess.run([sys.executable, "-c", CRASH_SCRIPT], env=env, capture_output=True, timeout=120)

    assert result.returncode == 17, result.stderr.decode()[-2000:]
    (run_dir,) = dump_dir.iterdir()
    names = sorted(p.name for p in run_dir.iterdir())
    assert "pass00000.safetensors" not in names
    assert [n for n in names if n.endswith(".tmp")] == [
        n for n in names if n.startswith(".pass00000.safetensors.")
    ]
    assert len([n for n in names if n.endswith(".tmp")]) == 1
    run = open_dump(dump_dir).runs[0]
    assert run.passes == {}
    assert run.complete is False


# ---------------------------------------------------------------------------------------------
# Disk full


def enospc_on_write(monkeypatch: pytest.MonkeyPatch, failing_call: int) -> list[str]:
    """Pass-file writes succeed except call number ``failing_call`` (1-based), which finds the disk full."""
    original = tracedump.dump.writer.save_tensors_atomic
    attempts: list[str] = []

    def save(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str], **options: Any) -> int:
        attempts.append(path.name)
        if len(attempts) == failing_call:
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(path, tensors, metadata, **options)

    monkeypatch.setattr(tracedump.dump.writer, "save_tensors_atomic", save)
    return attempts


def test_a_full_disk_stops_the_dump_once_while_the_model_keeps_running(
    dump_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    attempts = enospc_on_write(monkeypatch, failing_call=2)
    model = make_tiny_llama()
    with torch.no_grad():
        expected = [model(torch.tensor([p])).logits for p in PROMPTS]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dumper = tracedump.attach(model)
        with torch.no_grad():
            logits = [model(torch.tensor([p])).logits for p in PROMPTS]
        dumper.close()  # must not raise

    assert all(torch.equal(a, b) for a, b in zip(logits, expected, strict=True))
    failed_path = dumper.run_dir / "pass00001.safetensors"
    (message,) = tracedump_warnings(caught)
    assert str(failed_path) in message and "No space left on device" in message
    assert dumper.failure is not None and "No space left on device" in dumper.failure
    assert attempts == ["pass00000.safetensors", "pass00001.safetensors"], "no write after the failure"
    assert sorted(p.name for p in dumper.run_dir.iterdir()) == [
        "correspondence.json",
        "manifest.json",
        "pass00000.safetensors",
    ]
    written = manifest(dumper.run_dir)
    assert written["complete"] is False
    assert (
        "No space left" in written["incomplete_reason"] and str(failed_path) in written["incomplete_reason"]
    )
    assert written["passes"]["indices"] == [0]
    assert open_dump(dump_dir).runs[0].complete is False


def test_a_full_disk_in_stats_mode_keeps_the_lines_written_before_it(
    dump_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRACEDUMP_DUMP_MODE", "stats")
    original = Writer.append_stats
    calls: list[int] = []

    def append(self: Writer, lines: list[str]) -> None:
        calls.append(len(lines))
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        original(self, lines)

    monkeypatch.setattr(Writer, "append_stats", append)
    model = make_tiny_llama()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dumper, _ = run_prompts(model, PROMPTS)

    (message,) = tracedump_warnings(caught)
    assert "stats.jsonl" in message and "No space left on device" in message
    assert len(calls) == 2
    records = open_dump(dump_dir).runs[0].stats()
    assert {r["pass"] for r in records} == {0} and len(records) == calls[0]
    written = manifest(dumper.run_dir)
    assert written["complete"] is False and "No space left" in written["incomplete_reason"]


def test_a_write_error_while_the_forward_waits_for_the_writer_releases_the_wait(
    dump_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRACEDUMP_DUMP_MAX_PENDING_BYTES", "2KiB")
    enospc_on_write(monkeypatch, failing_call=2)
    original = tracedump.dump.writer.save_tensors_atomic

    def slow(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str], **options: Any) -> int:
        time.sleep(0.02)
        return original(path, tensors, metadata, **options)

    monkeypatch.setattr(tracedump.dump.writer, "save_tensors_atomic", slow)
    model = make_tiny_llama()
    outcome: dict[str, Any] = {}

    def run() -> None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            outcome["dumper"], _ = run_prompts(model, PROMPTS[:3])
        outcome["warnings"] = tracedump_warnings(caught)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(timeout=60)

    assert not worker.is_alive(), "the forward is stuck waiting for a writer that stopped"
    dumper = outcome["dumper"]
    assert dumper.failure is not None and "pass00000.part2.safetensors" in dumper.failure
    assert len(outcome["warnings"]) == 1
    assert manifest(dumper.run_dir)["complete"] is False


RLIMIT_SCRIPT = """
import json, os, resource, signal, sys, warnings
import torch
from transformers import LlamaConfig, LlamaForCausalLM
import tracedump

cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
torch.manual_seed(0)
model = LlamaForCausalLM(cfg).eval()
prompts = [[3, 14, 15, 9, 26, 5], [7, 1, 2, 8, 4], [1, 2, 3, 4, 5, 6], [9, 9, 2], [5, 6, 7, 8, 9, 10]]
with torch.no_grad():
    expected = [model(torch.tensor([p])).logits for p in prompts]

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG from write() instead of being killed
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), resource.RLIM_INFINITY))
reports = {}
for mode in ("full", "stats"):
    os.environ["TRACEDUMP_DUMP_MODE"] = mode
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dumper = tracedump.attach(model)
        with torch.no_grad():
            logits = [model(torch.tensor([p])).logits for p in prompts]
        dumper.close()
    reports[mode] = {
        "same_logits": all(torch.equal(a, b) for a, b in zip(logits, expected)),
        "warnings": [str(w.message) for w in caught if issubclass(w.category, tracedump.TracedumpWarning)],
        "failure": dumper.failure,
        "run_dir": str(dumper.run_dir),
    }
print(json.dumps(reports))
"""


def test_a_real_file_size_limit_stops_the_dump_and_the_host_finishes_cleanly_in_full_and_stats_mode(
    dump_dir: Path,
) -> None:
    limit = 8000  # above a manifest (~2 KB), below a pass file (~22 KB) and five passes of stats
    env = {**os.environ, "TRACEDUMP_DUMP_DIR": str(dump_dir)}

    result = subprocess.run(
        [sys.executable, "-c", RLIMIT_SCRIPT, str(limit)], env=env, capture_output=True, timeout=180
    )

    assert result.returncode == 0, result.stderr.decode()[-3000:]
    reports = json.loads(result.stdout.decode().strip().splitlines()[-1])
    for mode, failing_file in (("full", "pass00000.safetensors"), ("stats", "stats.jsonl.partial")):
        report = reports[mode]
        run_dir = Path(report["run_dir"])
        assert report["same_logits"] is True, mode
        (message,) = report["warnings"]
        assert str(run_dir / failing_file) in message and "File too large" in message
        written = manifest(run_dir)
        assert written["complete"] is False
        assert written["incomplete_reason"] == report["failure"]
        assert str(run_dir / failing_file) in written["incomplete_reason"]
        assert all(path.stat().st_size <= limit for path in run_dir.iterdir())
    assert not list((Path(reports["full"]["run_dir"])).glob("pass*"))


def test_a_fork_waits_for_the_writer_to_go_idle_so_the_child_inherits_no_half_done_write(
    tmp_path, monkeypatch
):
    from tracedump.dump import writer as writer_module

    original_run = writer_module.PassJob.run

    def slow_run(self, writer):
        time.sleep(0.3)  # a write (or a lazy import inside it) still under way when the host forks
        original_run(self, writer)

    monkeypatch.setattr(writer_module.PassJob, "run", slow_run)
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path))
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    dumper = tracedump.attach(model)
    model(torch.ones(1, 2))
    pid = os.fork()
    if pid == 0:  # the child leaves at once, without running any of the parent's exit handlers
        os._exit(0)
    os.waitpid(pid, 0)
    written_before_close = (dumper.run_dir / "pass00000.safetensors").exists()
    dumper.close()
    assert written_before_close


def test_later_passes_copy_into_recycled_buffers_and_still_store_their_own_values(tmp_path, monkeypatch):
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path))
    monkeypatch.setattr(tracedump.dump.cuda, "POOLED_FROM_BYTES", 0)  # these small tensors too
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    dumper = tracedump.attach(model)
    pool = dumper.rundir.writer.buffers
    pool.smallest = 0
    inputs = [torch.full((4, 8), float(i)) for i in range(4)]
    counts: list[tuple[int, int]] = []  # (buffers allocated, buffers reused) after each pass
    for x in inputs:
        model(x)
        dumper.flush()  # the pass is on disk: its buffers are back in the pool for the next one
        counts.append((pool.allocated, pool.reused))
    dumper.close()

    # the first pass's two captures take fresh buffers; every capture after them a recycled one
    assert counts == [(2, 0), (2, 2), (2, 4), (2, 6)]
    for index, x in enumerate(inputs):
        stored = tracedump.load_pass(dumper.run_dir / f"pass{index:05d}.safetensors")
        assert torch.equal(stored["0"], model[0](x).detach())
        assert torch.equal(stored["1"], model(x).detach())


def test_small_captures_are_clones_and_large_ones_recycled_buffers(tmp_path, monkeypatch):
    """Below POOLED_FROM_BYTES a capture is one clone (the pool is neither asked nor fed); above
    it, the second pass copies into the first pass's buffers. Both store their own values."""
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path))
    big = tracedump.dump.cuda.POOLED_FROM_BYTES // 4  # float32 elements of one pooled capture
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, big))
    dumper = tracedump.attach(model)
    pool = dumper.rundir.writer.buffers
    inputs = [torch.full((1, 4), float(i)) for i in range(3)]
    counts = []
    for x in inputs:
        model(x)
        dumper.flush()
        counts.append((pool.allocated, pool.reused))
    dumper.close()
    assert counts == [(1, 0), (1, 1), (1, 2)]  # only the large output went through the pool
    for index, x in enumerate(inputs):
        stored = tracedump.load_pass(dumper.run_dir / f"pass{index:05d}.safetensors")
        assert torch.equal(stored["0"], model[0](x).detach())
        assert torch.equal(stored["1"], model(x).detach())


def test_a_capture_lands_in_the_open_part_when_another_thread_spills_the_pass_during_its_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Worker threads capture into one ``step()`` pass: while one copies a tensor, another's
    capture may fill the cap and move the pass's entries into a part file. The copy then joins
    the entries still open, never the part already on its way to disk (where it was lost: the
    writer had its tensors already). Staged here: the spill runs inside the second copy."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    dumper = tracedump.attach(model, tracedump.DumpConfig(dir=tmp_path))
    assert dumper is not None
    recorder = dumper.recorder
    original = tracedump.dump.sinks.FileSink.copy
    spilled: list[list[str]] = []

    def copy_while_another_thread_spills(sink: Any, tensor: torch.Tensor, **kwargs: Any) -> Any:
        copied = original(sink, tensor, **kwargs)
        current = recorder.current
        if not spilled and current is not None and current.entries:  # another thread's spill, now
            current.parts += 1
            job = current.take_job(current.parts, recorder.mode)
            spilled.append([key for key, _, _ in job.entries])
            sink.submit(job)
        return copied

    monkeypatch.setattr(tracedump.dump.sinks.FileSink, "copy", copy_while_another_thread_spills)
    x = torch.ones(2, 4)
    with torch.no_grad(), dumper.step():
        out = model(x)
        open_keys = [key for key, _, _ in recorder.current.entries]
    dumper.close()

    assert spilled == [["0"]] and open_keys == ["1"]
    stored = open_dump(dumper.run_dir).run().passes[0]
    assert sorted(stored) == ["0", "1"]
    assert torch.equal(stored["0"], model[0](x)) and torch.equal(stored["1"], out)
