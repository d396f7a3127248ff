"""Defects found running tracedump against real programs and hostile input.

Each test names the defect it guards against; each failed on the code before its fix.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import read_passes, tracedump_warnings
from torch import nn

import tracedump

pytestmark = pytest.mark.usefixtures("fresh_warn_once")


class _Two(nn.Module):
    """A root with two leaves: ``a`` (a Linear) and ``b`` (returns whatever dtype it was built for)."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = _Cast(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        self.b(y)
        return y


class _Cast(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dtype.is_complex:
            return torch.polar(torch.ones_like(x.double()), x.double()).to(self.dtype)
        return x.to(self.dtype)


def _manifest(run_dir: Path) -> dict:
    return json.loads((run_dir / "manifest.json").read_text())


# ------------------------------------------------------------------ 1. unsupported dtypes


@pytest.mark.parametrize("dtype", [torch.complex128, torch.complex32])
def test_an_unwritable_dtype_is_skipped_and_counted_and_the_rest_of_every_pass_is_written(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    model = _Two(dtype)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tracedump.attach(model, {"dir": tmp_path}) as dumper, torch.no_grad():
            for _ in range(2):
                model(torch.ones(1, 4))
    assert dumper.failure is None
    passes = read_passes(dumper.run_dir)
    assert sorted(passes) == [0, 1]
    assert all(list(p) == ["a"] for p in passes.values())
    written = _manifest(dumper.run_dir)
    assert written["complete"] is True
    assert written["skipped"] == {"unsupported_tensor": 2}
    assert any("unsupported_tensor" in m for m in tracedump_warnings(caught))


def test_a_record_of_an_unwritable_dtype_is_skipped_and_counted(tmp_path: Path) -> None:
    model = _Two()
    lost = r"captures lost: \{'unsupported_tensor': 1\}"
    with (
        pytest.warns(tracedump.TracedumpWarning, match=lost),
        tracedump.attach(model, {"dir": tmp_path}) as dumper,
        torch.no_grad(),
        dumper.step(),
    ):
        model(torch.ones(1, 4))
        dumper.record("rope", torch.ones(2, dtype=torch.complex128))
        dumper.record("kept", torch.ones(2))
    assert sorted(read_passes(dumper.run_dir)[0]) == ["a", "b", "kept"]
    assert _manifest(dumper.run_dir)["skipped"] == {"unsupported_tensor": 1}


# ------------------------------------------------------------------ 5. reserved record names


def test_a_reserved_record_tag_is_refused_at_record_and_the_pass_is_still_written(tmp_path: Path) -> None:
    model = _Two()
    with tracedump.attach(model, {"dir": tmp_path}) as dumper, torch.no_grad(), dumper.step():
        model(torch.ones(1, 4))
        with pytest.raises(ValueError, match=r"__metadata__.*reserved"):
            dumper.record("__metadata__", torch.ones(1))
        with pytest.raises(ValueError, match="reserved"):
            tracedump.record("__metadata__", torch.ones(1))
    assert sorted(read_passes(dumper.run_dir)[0]) == ["a", "b"]
    assert _manifest(dumper.run_dir)["complete"] is True


# ------------------------------------------------------------------ 13. relative DUMP_DIR


def test_a_relative_dump_dir_is_resolved_at_attach_and_survives_a_chdir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "start").mkdir()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "start")
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", "rel")
    model = _Two()
    dumper = tracedump.attach(model)
    os.chdir(tmp_path / "elsewhere")
    with torch.no_grad():
        model(torch.ones(1, 4))
    dumper.close()
    assert dumper.run_dir.is_absolute()
    assert dumper.run_dir.parent == tmp_path / "start" / "rel"
    assert _manifest(dumper.run_dir)["settings"]["dir"] == str(tmp_path / "start" / "rel")
    assert sorted(read_passes(dumper.run_dir)) == [0]
    assert not (tmp_path / "elsewhere" / "rel").exists()


# ------------------------------------------------------------------ 4. interrupted passes


class _Interruptible(_Two):
    """``b`` raises ``error`` on the calls listed in ``fail_on`` (0-based), like Ctrl-C mid-forward."""

    def __init__(self, error: BaseException, fail_on: set[int]) -> None:
        super().__init__()
        self.error, self.fail_on, self.calls = error, fail_on, 0
        self.b.register_forward_pre_hook(self._maybe_fail)

    def _maybe_fail(self, _module: nn.Module, _args: object) -> None:
        self.calls += 1
        if self.calls - 1 in self.fail_on:
            raise self.error


def _truncated_flag(run_dir: Path, index: int) -> str | None:
    return tracedump.open_dump(run_dir).run().passes[index].metadata.get("tracedump.truncated")


@pytest.mark.parametrize("error", [KeyboardInterrupt(), RuntimeError("boom")], ids=["ctrl_c", "exception"])
def test_a_pass_whose_forward_was_cut_short_is_marked_truncated_in_file_and_manifest(
    tmp_path: Path, error: BaseException
) -> None:
    model = _Interruptible(error, fail_on={0})
    dumper = tracedump.attach(model, {"dir": tmp_path})
    with torch.no_grad():
        with pytest.raises(type(error)):
            model(torch.ones(1, 4))
        model(torch.ones(1, 4))  # the next forward: whole
    dumper.close()
    passes = read_passes(dumper.run_dir)
    assert list(passes[0]) == ["a"] and sorted(passes[1]) == ["a", "b"]
    assert _truncated_flag(dumper.run_dir, 0) == "true"
    assert _truncated_flag(dumper.run_dir, 1) is None
    assert _manifest(dumper.run_dir)["truncated_passes"] == [0]


def test_ctrl_c_in_the_last_forward_before_exit_marks_that_pass_truncated(tmp_path: Path) -> None:
    model = _Interruptible(KeyboardInterrupt(), fail_on={1})
    dumper = tracedump.attach(model, {"dir": tmp_path})
    with torch.no_grad():
        model(torch.ones(1, 4))
        with pytest.raises(KeyboardInterrupt):
            model(torch.ones(1, 4))
    dumper.close()  # what atexit does after the interrupt
    assert _manifest(dumper.run_dir)["truncated_passes"] == [1]
    assert _truncated_flag(dumper.run_dir, 1) == "true"


def test_ctrl_c_inside_a_step_marks_the_step_truncated(tmp_path: Path) -> None:
    model = _Interruptible(KeyboardInterrupt(), fail_on={0})
    with tracedump.attach(model, {"dir": tmp_path}) as dumper, torch.no_grad():
        with pytest.raises(KeyboardInterrupt), dumper.step():
            model(torch.ones(1, 4))
        with dumper.step():
            model(torch.ones(1, 4))
    assert _manifest(dumper.run_dir)["truncated_passes"] == [0]


def test_diff_says_which_passes_were_truncated(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tracedump.cli import main

    model = _Interruptible(KeyboardInterrupt(), fail_on={0})
    with tracedump.attach(model, {"dir": tmp_path / "a"}), torch.no_grad(), pytest.raises(KeyboardInterrupt):
        model(torch.ones(1, 4))
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "a"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "A rank0_pid" in out and "pass(es) 0 cut short (truncated)" in out


# ------------------------------------------------------------------ 6. losses after a write error


def test_after_a_write_error_every_lost_capture_and_byte_is_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    import tracedump.dump.writer

    original = tracedump.dump.writer.save_tensors_atomic
    calls: list[str] = []

    def save(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str], **options: Any) -> int:
        calls.append(path.name)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(path, tensors, metadata, **options)

    monkeypatch.setattr(tracedump.dump.writer, "save_tensors_atomic", save)
    model = _Two()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with tracedump.attach(model, {"dir": tmp_path}) as dumper, torch.no_grad():
            for _ in range(5):
                model(torch.ones(1, 4))
            dumper.record("outside", torch.ones(3))  # records.safetensors, dropped at close
    skipped = _manifest(dumper.run_dir)["skipped"]
    per_pass = 2 * 4 * 4  # two [1, 4] float32 tensors
    # pass 1 failed in the writer; passes 2-4 were dropped in the queue or refused at the hook
    # (which depends on when the writer thread met the error); the records file at close
    lost = skipped["dropped_captures"] + skipped.get("after_failure", 0)
    assert lost == 2 + 3 * 2 + 1
    lost_bytes = skipped["dropped_bytes"] + skipped.get("after_failure_bytes", 0)
    assert lost_bytes == 4 * per_pass + 3 * 4
    written = _manifest(dumper.run_dir)
    assert len(written["errors"]) == 1 and "No space left on device" in written["errors"][0]["message"]


def test_every_distinct_capture_error_is_kept_in_the_manifest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tracedump.dump.sinks

    def failing_copy(sink: object, tensor: torch.Tensor, **_: object) -> object:
        raise (ValueError("odd shape") if tensor.shape[-1] == 4 else TypeError("odd type"))

    monkeypatch.setattr(tracedump.dump.sinks.FileSink, "copy", failing_copy)
    model = _Two()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with tracedump.attach(model, {"dir": tmp_path}) as dumper, torch.no_grad():
            for _ in range(3):
                model(torch.ones(1, 4))
            dumper.record("r", torch.ones(2))
    written = _manifest(dumper.run_dir)
    assert written["skipped"]["errors"] == 7
    assert written["errors"] == [  # each distinct (where, type) once, with its first message and count
        {"where": "a", "type": "ValueError", "message": "odd shape", "count": 3},
        {"where": "b", "type": "ValueError", "message": "odd shape", "count": 3},
        {"where": "record('r')", "type": "TypeError", "message": "odd type", "count": 1},
    ]


# ------------------------------------------------------------------ 2. host hooks added after attach


def test_host_hooks_added_after_attach_that_replace_values_are_seen_by_the_dump(tmp_path: Path) -> None:
    model = _Two()
    dumper = tracedump.attach(model, {"dir": tmp_path, "inputs": True})
    model.a.register_forward_hook(lambda _m, _args, out: out * 2)
    model.b.register_forward_pre_hook(lambda _m, args: (args[0] + 1,))
    x = torch.randn(1, 4)
    with torch.no_grad():
        y = model(x)
        expected_a = model.a.forward(x) * 2
    dumper.close()
    (stored,) = read_passes(dumper.run_dir).values()
    assert torch.equal(y, expected_a)  # what the caller continued with
    assert torch.equal(stored["a"], expected_a)
    assert torch.equal(stored["b@in[0]"], expected_a + 1)
    assert torch.equal(stored["b"], expected_a + 1)


# ------------------------------------------------------------------ 3. two threads, one dumper


class _Handshake(nn.Module):
    """In ``owner``'s forward, lets the other thread run a whole forward before going on."""

    def __init__(self) -> None:
        super().__init__()
        self.inside, self.done = __import__("threading").Event(), __import__("threading").Event()
        self.owner: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import threading

        if threading.get_ident() == self.owner:
            self.inside.set()
            assert self.done.wait(timeout=30)
        return x + 1


def test_a_forward_from_a_second_thread_while_a_pass_is_open_is_kept_out_of_it(tmp_path: Path) -> None:
    import threading

    model = _Two()
    model.b = _Handshake()
    outputs: dict[str, torch.Tensor] = {}

    def first() -> None:
        model.b.owner = threading.get_ident()
        outputs["first"] = model(torch.ones(1, 4))

    def second() -> None:
        assert model.b.inside.wait(timeout=30)
        try:
            outputs["second"] = model(torch.full((1, 4), 5.0))
        finally:
            model.b.done.set()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tracedump.attach(model, {"dir": tmp_path}) as dumper, torch.no_grad():
            threads = [threading.Thread(target=first), threading.Thread(target=second)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=60)
            model(torch.full((1, 4), 2.0))  # afterwards, from one thread: a whole pass
    passes = read_passes(dumper.run_dir)
    assert sorted(passes) == [0, 1]
    with torch.no_grad():
        assert torch.equal(passes[0]["a"], model.a(torch.ones(1, 4)))  # the first thread's, unmixed
        assert torch.equal(passes[1]["a"], model.a(torch.full((1, 4), 2.0)))
    written = _manifest(dumper.run_dir)
    assert written["skipped"]["concurrent_thread"] == 2  # the second thread's a and b
    assert "concurrent_threads" in written["anomalies"]
    assert sum("second thread" in m for m in tracedump_warnings(caught)) == 1
    assert torch.equal(outputs["second"], model.a(torch.full((1, 4), 5.0)).detach())


# ------------------------------------------------------------------ 9. attach() all or nothing


def _hook_count(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def _attach_fails(model: nn.Module, match: str, config: dict | None = None) -> None:
    with pytest.raises(tracedump.ConfigError, match=match):
        tracedump.attach(model, config)
    assert _hook_count(model) == 0


_PREDICATES = {
    "raises": "def pick(name, module):\n    raise KeyError(name)\n",
    "arity": "def pick(name):\n    return True\n",
    "exits": "import sys\nsys.exit(3)\ndef pick(name, module):\n    return True\n",
}


@pytest.mark.parametrize("kind", sorted(_PREDICATES))
def test_a_bad_filter_fn_fails_at_attach_with_its_env_var_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    predicate = tmp_path / f"pred_{kind}.py"
    predicate.write_text(_PREDICATES[kind])
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path / "dump"))
    monkeypatch.setenv("TRACEDUMP_DUMP_FILTER_FN", f"{predicate}:pick")
    _attach_fails(_Two(), "TRACEDUMP_DUMP_FILTER_FN=")
    assert not (tmp_path / "dump").exists()


@pytest.mark.parametrize(
    ("name", "value", "match"),
    [
        ("MAX_PENDING_BYTES", "9" * 400, "MAX_PENDING_BYTES"),
        ("DIR", "~nosuchuser_tracedump/d", "no such user"),
        ("DIR", "/tmp/\udcff", "UTF-8"),
    ],
    ids=["huge_bytes", "unknown_user", "non_utf8_dir"],
)
def test_bad_values_that_used_to_escape_config_error_now_raise_it(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str, match: str
) -> None:
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", "/tmp/never-created-by-tracedump-tests")
    monkeypatch.setenv(f"TRACEDUMP_DUMP_{name}", value)
    _attach_fails(_Two(), match)
    assert not Path("/tmp/never-created-by-tracedump-tests").exists()


def test_a_config_stats_of_the_wrong_type_is_a_config_error(tmp_path: Path) -> None:
    _attach_fails(_Two(), "DumpConfig.stats=5: expected a comma list", {"dir": tmp_path / "d", "stats": 5})


def test_a_manifest_that_cannot_be_written_fails_attach_and_removes_its_run_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tracedump.dump.rundir

    def unwritable(_path: Path, _data: object) -> None:
        raise TypeError("not JSON serializable")

    monkeypatch.setattr(tracedump.dump.rundir, "write_json_atomic", unwritable)
    (tmp_path / "d").mkdir()
    _attach_fails(_Two(), "cannot write the manifest", {"dir": tmp_path / "d"})
    assert list((tmp_path / "d").iterdir()) == []


# ------------------------------------------------------------------ 17. one rule for every setting


@pytest.mark.parametrize("name", ["tracedump_dump_mode", "Tracedump_Dump_Mode", "tracedump_dump_mdoe"])
def test_env_names_in_another_case_are_refused_not_read_or_ignored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path))
    monkeypatch.setenv("TRACEDUMP_DUMP_MODE", "full")
    monkeypatch.setenv(name, "stats")
    with pytest.raises(tracedump.ConfigError, match=name):
        tracedump.config.settings.load_settings()


@pytest.mark.parametrize(
    ("field", "config_value"),
    [("mode", "stats"), ("token_dim", 1), ("inputs", True), ("stats", ["sum"]), ("max_pending_bytes", 1024)],
)
def test_a_whitespace_only_env_value_is_unset_for_every_field(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, field: str, config_value: object
) -> None:
    monkeypatch.setenv(f"TRACEDUMP_DUMP_{field.upper()}", "   ")
    settings = tracedump.config.settings.load_settings({"dir": tmp_path, field: config_value})
    assert getattr(settings, field) == config_value  # the config's value, neither cleared nor an error
    blank_config = tracedump.config.settings.load_settings({"dir": tmp_path, field: "  "})
    assert getattr(blank_config, field) == tracedump.config.settings.DumpSettings.model_fields[field].default


@pytest.mark.parametrize(("field", "value"), [("TOKENS", "٣"), ("MAX_ROWS", "٣"), ("STEPS", "٣")])
def test_non_ascii_digits_are_refused(monkeypatch: pytest.MonkeyPatch, field: str, value: str) -> None:
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", "/tmp/x")
    monkeypatch.setenv(f"TRACEDUMP_DUMP_{field}", value)
    with pytest.raises(tracedump.ConfigError, match=f"TRACEDUMP_DUMP_{field}="):
        tracedump.config.settings.load_settings()


def test_surrounding_spaces_of_dir_are_dropped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", f"  {tmp_path}/d  ")
    assert tracedump.config.settings.load_settings().dir == tmp_path / "d"


def test_run_with_a_dir_that_is_a_file_exits_2_without_starting_the_command(tmp_path: Path) -> None:
    import sys

    from tracedump.cli import main

    (tmp_path / "afile").write_text("x")
    marker = tmp_path / "started"
    command = [sys.executable, "-c", f"open({str(marker)!r}, 'w').close()"]
    assert main(["run", "--quiet", "--dir", str(tmp_path / "afile"), "--", *command]) == 2
    assert not marker.exists()


# ------------------------------------------------------------------ 14. user strings in tables


class _Named(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = _DictOut()

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.model(x)


class _DictOut(nn.Module):
    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"last_hidden_state": x * 2, "bold": x}


def test_names_with_brackets_keep_them_in_show_and_diff(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tracedump.cli import main

    model = _Named()
    with tracedump.attach(model, {"dir": tmp_path / "[bold]d"}) as dumper, torch.no_grad():
        model(torch.ones(1, 3))
    pass_file = dumper.run_dir / "pass00000.safetensors"
    assert main(["show", str(pass_file)]) == 0
    out = capsys.readouterr().out
    assert "model[last_hidden_state]" in out and "model[bold]" in out and "[bold]d" in out
    assert main(["diff", str(pass_file), str(pass_file), "--no-progress", "--max-rows", "0"]) == 0
    out = capsys.readouterr().out
    assert "model[last_hidden_state]" in out and "model[bold]" in out and "[bold]d" in out
    assert main(["ls", str(tmp_path / "[bold]d")]) == 0
    assert "[bold]d" in capsys.readouterr().out


# ------------------------------------------------------------------ 10. hostile files for readers


def _one_pass_dump(base: Path) -> Path:
    model = _Two()
    with tracedump.attach(model, {"dir": base}) as dumper, torch.no_grad():
        model(torch.ones(1, 4))
    return dumper.run_dir


def _cli_fails_in_one_line(argv: list[str], capsys: pytest.CaptureFixture[str], expected: str) -> None:
    from tracedump.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert expected in err and len(err.splitlines()) == 1, err


def test_a_header_nested_100k_deep_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    header = b"[" * 100_000 + b"]" * 100_000
    path = tmp_path / "pass00000.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header)
    for command in ("show", "diff"):
        argv = [command, str(path)] + ([str(path)] if command == "diff" else [])
        _cli_fails_in_one_line(argv, capsys, "not a readable safetensors file")


@pytest.mark.parametrize(
    "manifest", ['{"rank": 1e400}', '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"], ids=["rank_inf", "deep"]
)
def test_a_hostile_manifest_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], manifest: str
) -> None:
    run_dir = _one_pass_dump(tmp_path / "d")
    (run_dir / "manifest.json").write_text(manifest)
    capsys.readouterr()
    _cli_fails_in_one_line(["ls", str(tmp_path / "d")], capsys, "manifest.json")
    _cli_fails_in_one_line(["diff", str(run_dir), str(run_dir)], capsys, "manifest.json")


def test_a_fifo_under_a_pass_file_name_is_refused_not_waited_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = _one_pass_dump(tmp_path / "d")
    capsys.readouterr()
    fifo = run_dir / "pass00001.safetensors"
    os.mkfifo(fifo)
    _cli_fails_in_one_line(["show", str(fifo)], capsys, "not a regular file")
    _cli_fails_in_one_line(["ls", str(tmp_path / "d")], capsys, "not a regular file")
    _cli_fails_in_one_line(["diff", str(run_dir), str(run_dir)], capsys, "not a regular file")
    with pytest.raises(tracedump.store.loader.DumpReadError, match="not a regular file"):
        tracedump.load_pass(fifo)
    os.mkfifo(tmp_path / "x.pt")
    _cli_fails_in_one_line(["show", str(tmp_path / "x.pt")], capsys, "not a regular file")


def test_show_reads_float4_and_pt_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from safetensors.torch import save_file

    from tracedump.cli import main

    packed = torch.tensor([0x12, 0x34], dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    save_file({"fp4": packed, "x": torch.ones(2)}, str(tmp_path / "pass00000.safetensors"))
    assert main(["show", str(tmp_path / "pass00000.safetensors")]) == 0
    out = capsys.readouterr().out
    assert "fp4" in out and "float4_e2m1fn_x2" in out
    torch.save({"h": torch.full((2,), 3.0)}, tmp_path / "ref.pt")
    assert main(["show", str(tmp_path / "ref.pt")]) == 0
    out = capsys.readouterr().out
    assert "h" in out and "3" in out and "float32" in out


# ------------------------------------------------------------------ 11. diff options checked cheaply


def test_a_huge_pass_range_stays_a_range(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import tracemalloc

    from tracedump.cli import main

    run_dir = _one_pass_dump(tmp_path / "d")
    capsys.readouterr()
    tracemalloc.start()
    try:
        assert main(["diff", str(run_dir), str(run_dir), "--pass", "0-99999999999", "--no-progress"]) == 2
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    err = capsys.readouterr().err
    assert "--pass 1-99999999999: not in both dumps" in err and len(err) < 500
    assert peak < 50 << 20
    assert main(["diff", str(run_dir), str(run_dir), "--pass", "0,0-0", "--no-progress"]) == 0


def test_a_plot_path_of_an_unknown_format_fails_before_the_diff(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("matplotlib")
    import tracedump.compare.pipeline
    from tracedump.cli import main

    run_dir = _one_pass_dump(tmp_path / "d")
    capsys.readouterr()

    def no_diff(_options: object) -> None:
        raise AssertionError("the diff ran before --plot was checked")

    monkeypatch.setattr(tracedump.compare.pipeline, "build_report", no_diff)
    assert main(["diff", str(run_dir), str(run_dir), "--plot", str(tmp_path / "x.txt")]) == 2
    assert "--plot" in capsys.readouterr().err and not (tmp_path / "x.txt").exists()


# ------------------------------------------------------------------ 12. every dtype written is read back


class _Exotic(nn.Module):
    """Leaves returning each dtype the dumper writes that numpy has no type for."""

    def __init__(self) -> None:
        super().__init__()
        self.leaves = nn.ModuleList(_Cast(dtype) for dtype in _EXOTIC)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for leaf in self.leaves:
            leaf(x)
        return x


_EXOTIC = [
    torch.complex64,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2fnuz,
    torch.float8_e8m0fnu,
    torch.float4_e2m1fn_x2,
]


def _exotic_cast(self: _Cast, x: torch.Tensor) -> torch.Tensor:
    if self.dtype.is_complex:
        return torch.polar(torch.ones_like(x), x).to(self.dtype)
    if self.dtype == torch.float4_e2m1fn_x2:
        return (x.abs() * 7).to(torch.uint8).view(torch.float4_e2m1fn_x2)
    return x.to(self.dtype)


def test_a_self_diff_of_every_exotic_dtype_exits_0_and_a_changed_value_exits_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from tracedump.cli import main

    monkeypatch.setattr(_Cast, "forward", _exotic_cast)
    model = _Exotic()
    for name, scale in (("a", 1.0), ("b", 1.0), ("c", 3.0)):
        with tracedump.attach(model, {"dir": tmp_path / name}), torch.no_grad():
            model(torch.linspace(0.1, 2.0, 8).reshape(2, 4) * scale)
    capsys.readouterr()
    stored = tracedump.open_dump(tmp_path / "a").run().passes[0]
    assert [stored.info(n).dtype for n in stored.names] == [str(d).removeprefix("torch.") for d in _EXOTIC]
    assert stored.load()["leaves.4"].shape == (2, 4)
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "compared 5 tensors" in out
    assert main(["diff", str(tmp_path / "c"), str(tmp_path / "a"), "--no-progress", "--max-rows", "0"]) == 1
    out = capsys.readouterr().out
    assert "compared 5 tensors" in out and "5 diverged" in out


# ------------------------------------------------------------------ 15. sizes: on disk, one unit


def test_ls_counts_a_stats_dump_s_bytes_and_every_size_uses_binary_units(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tracedump.cli import main

    model = _Two()
    with tracedump.attach(model, {"dir": tmp_path, "mode": "stats"}) as dumper, torch.no_grad():
        for _ in range(3):
            model(torch.ones(1, 4))
    closing = capsys.readouterr().err
    from tracedump.util.units import human_bytes

    size = (dumper.run_dir / "stats.jsonl").stat().st_size
    assert size > 0
    assert f"3 passes, {human_bytes(size)}" in closing
    assert main(["ls", str(tmp_path)]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if dumper.run_dir.name in line)
    assert human_bytes(size) in row


def test_human_bytes_says_which_units_it_means() -> None:
    from tracedump.util.units import human_bytes

    assert human_bytes(512) == "512 B"
    assert human_bytes(1536) == "1.5 KiB"
    assert human_bytes(20 << 20) == "20.0 MiB"


def test_the_run_summary_counts_what_is_on_disk_when_the_manifest_lags(tmp_path: Path) -> None:
    from tracedump.launch.command import summary_lines

    run_dir = _one_pass_dump(tmp_path / "d")
    manifest = _manifest(run_dir)
    manifest.update(complete=False, passes={"count": 0, "bytes": 0, "files": 0, "indices": []})
    (run_dir / "manifest.json").write_text(json.dumps(manifest))  # as a terminated worker leaves it
    size = (run_dir / "pass00000.safetensors").stat().st_size
    lines = summary_lines(tmp_path / "d", set())
    assert lines[0].endswith(f", {size} B")
    assert f"1 passes, {size} B, INCOMPLETE (the process ended without closing its dumper" in lines[1]


# ------------------------------------------------------------------ 7. Pool workers terminated at exit

_POOL_PROGRAM = """
import multiprocessing as mp, sys, torch
from torch import nn
import tracedump

torch.set_num_threads(1)
model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
dumper = tracedump.attach(model, {"dir": sys.argv[1]})

def task(i):
    with torch.no_grad():
        return float(model(torch.full((1, 4), float(i))).sum())

if __name__ == "__main__":
    with mp.get_context("fork").Pool(2) as pool:  # __exit__ terminates the workers
        print(pool.map(task, range(6), chunksize=1))
"""


def test_pool_workers_terminated_by_with_pool_keep_every_task_s_pass(tmp_path: Path) -> None:
    import subprocess
    import sys

    script = tmp_path / "pool.py"
    script.write_text(_POOL_PROGRAM)
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "d")], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    workers = [r for r in tracedump.open_dump(tmp_path / "d").runs if r.passes]
    assert sum(len(r.passes) for r in workers) == 6  # one pass per task, none lost
    for run in workers:
        assert run.manifest["passes"]["indices"] == sorted(run.passes)  # the manifest lists them
        # a worker that exits before terminate() reaches it closes normally; one killed says why
        assert run.manifest["complete"] or "multiprocessing worker" in run.manifest["incomplete_reason"]
        assert all(sorted(p.names) == ["0", "1"] for p in run.passes.values())


# ------------------------------------------------------------------ 8. torch.compile is never silent


@pytest.fixture
def _reset_dynamo() -> object:
    yield
    torch._dynamo.reset()


def _compiled_runs(tmp_path: Path, setup: str) -> tuple[tracedump.Dumper, list[str]]:
    model = _Two()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dumper = tracedump.attach(model, {"dir": tmp_path})
        with torch.no_grad():
            if setup == "eager_then_compiled":
                model(torch.ones(1, 4))
            if setup == "in_place":
                model.compile(backend="eager")
                call = model
            else:
                call = torch.compile(model, backend="eager", fullgraph=True)
            for _ in range(3):
                call(torch.ones(1, 4))
        dumper.close()
    return dumper, tracedump_warnings(caught)


@pytest.mark.usefixtures("_reset_dynamo")
@pytest.mark.parametrize("setup", ["attach_then_compile", "eager_then_compiled", "in_place"])
def test_a_compiled_call_of_a_dumped_model_warns_once_and_marks_the_manifest(
    tmp_path: Path, setup: str
) -> None:
    dumper, messages = _compiled_runs(tmp_path, setup)
    compiled = [m for m in messages if "torch.compile is compiling the dumped _Two" in m]
    assert len(compiled) == 1 and "--no-compile" in compiled[0]
    anomalies = _manifest(dumper.run_dir)["anomalies"]
    assert "passes are missing" in anomalies["compiled"]
    expected = [0] if setup == "eager_then_compiled" else []
    assert sorted(read_passes(dumper.run_dir)) == expected


@pytest.mark.usefixtures("_reset_dynamo")
def test_diff_says_a_side_lacks_passes_because_it_ran_compiled(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tracedump.cli import main

    _compiled_runs(tmp_path / "compiled", "eager_then_compiled")
    model = _Two()
    with tracedump.attach(model, {"dir": tmp_path / "eager"}), torch.no_grad():
        for _ in range(4):
            model(torch.ones(1, 4))
    capsys.readouterr()
    main(["diff", str(tmp_path / "compiled"), str(tmp_path / "eager"), "--no-progress"])
    out = capsys.readouterr().out
    assert "passes only in B: 1, 2, 3" in out
    assert "note: A rank0_pid" in out and "torch.compile compiled this model's forward" in out


# ------------------------------------------------------------------ 16. roots and passes


def _tiny_t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=64,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=1,
        num_decoder_layers=1,
        num_heads=2,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    return T5ForConditionalGeneration(config).eval()


def test_generate_s_encoder_forward_is_dumped_into_the_first_pass(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    model = _tiny_t5()
    ids = torch.tensor([[5, 6, 7, 8]])
    with tracedump.attach(model, {"dir": tmp_path}), torch.no_grad():
        for _ in range(2):
            model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False)
        model.encoder(input_ids=ids)  # called by the program itself, not by a method of the model
    with torch.no_grad():
        expected = model.encoder(input_ids=ids).last_hidden_state
    run = tracedump.open_dump(tmp_path).run()
    assert sorted(run.passes) == [0, 1, 2, 3, 4, 5]
    assert [any(n.startswith("encoder.") for n in p.names) for p in run.passes.values()] == [
        True,
        False,
        False,
    ] * 2
    first = run.passes[0]
    assert "encoder.final_layer_norm" in first.names and "lm_head" in first.names
    assert first.names.index("encoder.final_layer_norm") < first.names.index("lm_head")  # in time order
    torch.testing.assert_close(first["encoder.final_layer_norm"], expected)
    assert not any(n.startswith("encoder.") for n in run.passes[1].names)
    # the program's own direct call of the encoder: no method of the model made it, so outside
    assert list(run.manifest["skipped"]) == ["outside_pass"]


def test_under_tracedump_run_a_part_of_a_known_root_called_alone_is_no_new_root(tmp_path: Path) -> None:
    from tracedump.config.settings import load_settings
    from tracedump.launch.auto import AutoAttach

    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    auto = AutoAttach(load_settings({"dir": tmp_path}))
    auto.register()
    try:
        with torch.no_grad():
            net(torch.ones(1, 4))
            net[0](torch.full((1, 4), 2.0))  # the part alone, then the root again
            net(torch.ones(1, 4))
    finally:
        auto.remove()
    assert list(auto.roots) == ["Sequential"]  # not a second root "Linear"
    run = tracedump.open_dump(tmp_path).run()
    passes = read_passes(run.path)
    assert sorted(passes) == [0, 1] and sorted(passes[1]) == ["0", "1"]
    assert run.manifest["skipped"] == {"outside_pass": 1}  # called by no method of the model


def test_ls_shows_each_run_s_root(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tracedump.cli import main

    _one_pass_dump(tmp_path)
    capsys.readouterr()
    assert main(["ls", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "root" in out and "_Two" in out


class _EncDec(nn.Module):
    """A model whose own methods call its parts without its forward, as ``generate()`` and
    ``vae.decode()`` do."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(4, 4)
        self.post = nn.Linear(4, 4)
        self.decoder = nn.Sequential(nn.Linear(4, 4), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(x)

    def generate(self, x: torch.Tensor, steps: int) -> torch.Tensor:
        memory = self.encoder(x)
        for _ in range(steps):
            memory = self(memory)
        return memory

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.post(z))


def test_under_tracedump_run_parts_called_by_the_model_s_own_methods_belong_to_the_model(
    tmp_path: Path,
) -> None:
    from tracedump.config.settings import load_settings
    from tracedump.launch.auto import AutoAttach

    for method in ("generate", "decode"):
        torch.manual_seed(0)
        model = _EncDec()
        auto = AutoAttach(load_settings({"dir": tmp_path / method}))
        auto.register()
        try:
            with torch.no_grad():
                for _ in range(2):
                    model.generate(torch.ones(1, 4), steps=2) if method == "generate" else model.decode(
                        torch.ones(1, 4)
                    )
        finally:
            auto.remove()
        assert list(auto.roots) == ["_EncDec"], method  # not Linear / Sequential roots
        passes = read_passes(tracedump.open_dump(tmp_path / method).run().path)
        if method == "generate":  # the encoder joins the first decoder forward's pass
            assert [sorted(passes[i]) for i in sorted(passes)] == [
                ["decoder.0", "decoder.1", "encoder"],
                ["decoder.0", "decoder.1"],
            ] * 2
        else:  # each decode() is one pass, named by the parts' full names
            assert [sorted(p) for p in passes.values()] == [["decoder.0", "decoder.1", "post"]] * 2


@pytest.mark.usefixtures("_reset_dynamo")
def test_under_tracedump_run_an_in_place_compiled_model_says_why_nothing_is_dumped(tmp_path: Path) -> None:
    from tracedump.config.settings import load_settings
    from tracedump.launch.auto import AutoAttach

    model = _Two()
    model.compile(backend="eager")
    auto = AutoAttach(load_settings({"dir": tmp_path}))
    auto.register()
    try:
        with warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter("always")
            for _ in range(3):
                model(torch.ones(1, 4))
    finally:
        auto.remove()
    (message,) = [m for m in tracedump_warnings(caught) if "torch.compile" in m]
    assert "a compiled graph runs no hooks" in message and "--no-compile" in message


class _WithLogits(nn.Module):
    """An engine-style model: ``forward`` runs the body; ``compute_logits`` runs the head after it."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)


def test_parts_called_after_each_forward_keep_the_pass_numbering_of_the_forwards(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tracedump.dump.sinks

    copies: list[tuple[int, ...]] = []
    real_copy = tracedump.dump.sinks.FileSink.copy

    def counting_copy(sink: object, tensor: torch.Tensor, **kwargs: object) -> object:
        copies.append(tuple(tensor.shape))
        return real_copy(sink, tensor, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(tracedump.dump.sinks.FileSink, "copy", counting_copy)
    model = _WithLogits()
    with tracedump.attach(model, {"dir": tmp_path}) as dumper, torch.no_grad():
        for _ in range(4):
            model.compute_logits(model(torch.ones(1, 4)))
    passes = read_passes(dumper.run_dir)
    assert {i: sorted(p) for i, p in passes.items()} == {i: ["body"] for i in range(4)}  # no shift
    assert _manifest(dumper.run_dir)["skipped"] == {"outside_pass": 4}  # as without implicit passes
    assert copies.count((1, 8)) == 1  # the head was copied once, then no more


def test_a_program_calling_parts_itself_stops_costing_a_stack_walk_per_capture(tmp_path: Path) -> None:
    from tracedump.dump.passes import AnchorSearch

    walks: list[int] = []
    real_walk = AnchorSearch().find
    model = _Two()
    with tracedump.attach(model, {"dir": tmp_path}) as dumper, torch.no_grad():
        # the recorder's policy for implicit passes: a counting walk, and a limit of 3 captures
        dumper.recorder.anchors = AnchorSearch(
            find=lambda m: walks.append(1) or real_walk(m), give_up_after=3
        )
        for _ in range(10):
            model.a(torch.ones(1, 4))  # the program steps the part itself, no method of the model
    assert len(walks) == 3
    assert _manifest(dumper.run_dir)["skipped"] == {"outside_pass": 10}


@pytest.mark.usefixtures("_reset_dynamo")
def test_generate_with_a_static_cache_compiling_its_decode_steps_warns_and_marks_the_manifest(
    tmp_path: Path, llama: nn.Module
) -> None:
    from transformers import CompileConfig

    compile_config = CompileConfig(backend="eager", mode=None)
    compile_config._compile_all_devices = True  # what generate() does by itself on CUDA
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tracedump.attach(llama, {"dir": tmp_path}) as dumper, torch.no_grad():
            llama.generate(
                torch.tensor([[3, 14, 15, 9]]),
                max_new_tokens=3,
                min_new_tokens=3,
                do_sample=False,
                cache_implementation="static",
                compile_config=compile_config,
            )
    assert sorted(read_passes(dumper.run_dir)) == [0]  # the prefill ran eagerly; decode compiled
    assert "first at pass 1" in _manifest(dumper.run_dir)["anomalies"]["compiled"]
    assert sum("compiling the dumped LlamaForCausalLM" in m for m in tracedump_warnings(caught)) == 1
