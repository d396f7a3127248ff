"""Hostile captures and targets for ``capture().save()`` and attach."""

from __future__ import annotations

import errno
import json
import warnings
from pathlib import Path

import pytest
import torch

import tracedump
import tracedump.dump.writer
from tracedump.dump.writer import MANIFEST


class Odd(torch.nn.Module):
    """Returns what it is told to: a tensor a pass file cannot hold."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "complex128":
            return torch.ones(3, dtype=torch.complex128)
        if self.kind == "sparse":
            return torch.eye(3).to_sparse()
        if self.kind == "nested":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch: "nested tensors are in prototype stage"
                return torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
        return torch.empty(3, device="meta")


class Pair(torch.nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.good, self.odd = torch.nn.Linear(4, 4), Odd(kind)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.odd(self.good(x))


def _captured(kind: str) -> tracedump.Capture:
    with tracedump.capture(Pair(kind), outputs=["good", "odd"]) as cap:
        cap.run(torch.ones(2, 4))  # one pass holding both
    return cap


# ------------------------------------------------------------------ 3: one rule for both paths


@pytest.mark.parametrize("kind", ["complex128", "sparse", "meta", "nested"])
def test_save_skips_and_counts_what_a_pass_file_cannot_hold_and_writes_the_rest(
    tmp_path: Path, kind: str
) -> None:
    cap = _captured(kind)
    run_dir = cap.save(tmp_path)
    manifest = json.loads((run_dir / MANIFEST).read_text())
    assert manifest["complete"] is True
    assert manifest["skipped"] == {"unsupported_tensor": 1}
    run = tracedump.open_dump(tmp_path).run()
    assert list(run.passes) == [0] and list(run.passes[0]) == ["good"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [run_dir.name]  # no stray run dir
    assert not list(run_dir.glob(".*"))


@pytest.mark.parametrize("kind", ["complex128", "sparse", "meta", "nested"])
def test_attach_skips_and_counts_the_same_tensors_as_save(
    tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other path of the one rule: attach() counts such an output as unsupported_tensor (not as
    a hook error) and writes the rest."""
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path))
    monkeypatch.setenv("TRACEDUMP_DUMP_MODULES", "all")
    model = Pair(kind)
    dumper = tracedump.attach(model)
    assert dumper is not None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the one-line summary of what was skipped
        with dumper.step():
            model(torch.ones(2, 4))
        dumper.close()
    manifest = json.loads((dumper.run_dir / MANIFEST).read_text())
    assert manifest["skipped"] == {"unsupported_tensor": 1}
    run = tracedump.open_dump(tmp_path).run()
    assert list(run.passes) == [0] and "good" in run.passes[0] and "odd" not in run.passes[0]


def test_a_failed_save_leaves_nothing_and_the_next_save_takes_the_plain_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cap = _captured("complex128")

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tracedump.dump.writer, "save_file", full)
    target = tmp_path / "ref"
    with pytest.raises(OSError, match=r"pass00000\.safetensors.*No space left") as info:
        cap.save(target)
    assert "the model continues" not in str(info.value)
    assert not target.exists()  # nothing behind, not even the directory it made
    monkeypatch.undo()
    run_dir = cap.save(target)
    assert run_dir.name.endswith(f"pid{__import__('os').getpid()}")  # no -2 suffix
    assert tracedump.open_dump(target).run().complete


# ------------------------------------------------------------------ 14: clear errors, not raw ones


def test_save_to_an_empty_path_or_onto_a_file_is_a_clear_error(tmp_path: Path) -> None:
    cap = _captured("complex128")
    with pytest.raises(ValueError, match="expected a directory path"):
        cap.save("")
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(NotADirectoryError) as info:
        cap.save(afile)
    assert str(afile) in str(info.value) and "filter_fn" not in str(info.value)
    assert afile.read_text() == "x"


def test_a_save_onto_a_really_full_disk_raises_and_leaves_nothing(tmp_path: Path) -> None:
    from hostile_fs import full_filesystem

    cap = _captured("complex128")
    with full_filesystem(tmp_path / "full", keep_free=4096) as full:
        before = sorted(p.name for p in full.iterdir())
        with pytest.raises(OSError) as info:
            cap.save(full / "ref")
        assert "No space left" in str(info.value) and "the model continues" not in str(info.value)
        assert sorted(p.name for p in full.iterdir()) == before


# ------------------------------------------------------------------ 5: one manifest writer


def test_the_manifest_written_from_two_threads_never_fails_and_the_last_state_wins(tmp_path: Path) -> None:
    import sys
    import threading

    errors: list[str] = []
    big = {"modules": [f"model.layers.{i}.mlp" for i in range(5000)]}  # encoding takes many switches
    writer = tracedump.dump.writer.Writer(tmp_path, 1 << 20, big, errors.append)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    failures: list[BaseException] = []
    go = threading.Barrier(2)

    def host() -> None:  # RunDir.update from inside hooks: new keys, so the dict changes size
        go.wait()
        try:
            for i in range(100):
                writer.write_manifest(**{f"host{i}": list(range(20))})
        except BaseException as e:
            failures.append(e)

    def writer_thread() -> None:  # note_file -> write_manifest, as the writer thread does
        go.wait()
        try:
            for i in range(100):
                writer.note_file(i, 10, is_pass=True)
                writer.write_manifest()
        except BaseException as e:
            failures.append(e)

    threads = [threading.Thread(target=host), threading.Thread(target=writer_thread)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    sys.setswitchinterval(interval)
    writer.close()
    assert failures == [] and errors == []
    on_disk = json.loads((tmp_path / MANIFEST).read_text())
    assert "manifest_error" not in on_disk
    assert on_disk == json.loads(json.dumps(writer.manifest, default=str))  # the last state, not an older one
    assert on_disk["passes"]["count"] == 100 and all(f"host{i}" in on_disk for i in range(100))
    assert not list(tmp_path.glob(".*tmp"))


# ------------------------------------------------------------------ 4: Ctrl-C during the flush at exit

_INTERRUPTED_FLUSH = r"""
import os, signal, sys, threading, time
import torch, tracedump, tracedump.dump.writer as writer

# The premise is built, not raced: no pass is written before the flush at exit; during it, the
# third file waits at its first chunk until Ctrl-C has landed in the main thread (inside the
# flush) and close() has abandoned the flush. However loaded the machine, the interrupt arrives
# while that pass is being written, with two passes on disk and nine still queued.
flushing, writing, landed = threading.Event(), threading.Event(), threading.Event()
files_in_flush = []
original = writer.save_file
def held(tensors, path, metadata=None, pause=None):
    assert flushing.wait(120)
    files_in_flush.append(path)
    third = len(files_in_flush) == 3
    def waiting():
        if third:
            writing.set()
            assert landed.wait(120)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:  # pause() raises once close() abandoned the flush
                pause()
                time.sleep(0.01)
        elif pause is not None:
            pause()
    return original(tensors, path, metadata=metadata, pause=waiting)
writer.save_file = held
flush = writer.Writer.flush
def flush_seen(self):
    flushing.set()
    return flush(self)
writer.Writer.flush = flush_seen

def ctrl_c(signum, frame):
    landed.set()
    raise KeyboardInterrupt
signal.signal(signal.SIGINT, ctrl_c)

torch.manual_seed(0)
model = torch.nn.Linear(1024, 1024)
dumper = tracedump.attach(model)
with torch.no_grad():
    for _ in range(12):  # 8 MiB per pass
        with dumper.step():
            model(torch.ones(2048, 1024))

def ctrl_c_in_the_flush_at_exit_while_a_pass_is_being_written():
    assert writing.wait(120)
    os.kill(os.getpid(), signal.SIGINT)

threading.Thread(target=ctrl_c_in_the_flush_at_exit_while_a_pass_is_being_written, daemon=True).start()
"""


def test_ctrl_c_during_the_flush_at_exit_is_recorded_cleaned_up_and_not_a_clean_exit(tmp_path: Path) -> None:
    import os
    import signal
    import subprocess
    import sys

    env = {**os.environ, "TRACEDUMP_DUMP_DIR": str(tmp_path / "dump"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _INTERRUPTED_FLUSH], env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode in (-signal.SIGINT, 128 + signal.SIGINT), done.stderr  # says interrupted
    run_dir = next((tmp_path / "dump").glob("rank*"))
    manifest = json.loads((run_dir / MANIFEST).read_text())
    written = sorted(run_dir.glob("pass*.safetensors"))
    assert manifest["complete"] is False
    assert "interrupted" in manifest["incomplete_reason"] and "at exit" in manifest["incomplete_reason"]
    assert len(written) == 2 and manifest["skipped"]["dropped_files"] == 10  # the third, and the rest
    assert manifest["passes"]["count"] == len(written)
    assert not [p.name for p in run_dir.iterdir() if p.name.startswith(".")]  # no temp file left
    assert "Traceback" not in done.stderr
