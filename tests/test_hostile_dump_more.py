"""Dump-side defects a hostile run found: a full disk at close, the shadow and the host's
hooks, a dump written into its own reference, worker threads in one step, complex statistics.

Each test builds its premise (a really full filesystem, a forced interleaving of two threads) and
failed on the code before its fix.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import tracedump_warnings
from hostile_fs import full_filesystem
from torch import nn

import tracedump
from tracedump.dump.writer import MANIFEST_RESERVE

pytestmark = pytest.mark.usefixtures("fresh_warn_once")


def _manifest(run_dir: Path) -> dict:
    return json.loads((run_dir / "manifest.json").read_text())


class _Wide(nn.Module):
    """Two leaves whose outputs take a few KiB a pass: a 64 KiB disk fills within a few passes."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 512)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.up(x))


def _fill(where: Path) -> None:
    """Fill what is left of the filesystem at ``where`` (another program filling the disk)."""
    with contextlib.suppress(OSError), open(where / "more_ballast", "wb") as ballast:
        while True:
            ballast.write(b"\0" * 512)
            ballast.flush()


# ------------------------------------------------------------------ 1. a full disk at close


def test_a_disk_filled_mid_run_still_gets_the_last_manifest_saying_why_and_what_was_lost(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    model = _Wide().eval()
    with full_filesystem(tmp_path / "full", keep_free=40 << 10) as full:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with tracedump.attach(model, {"dir": full / "d"}) as dumper, torch.no_grad():
                with dumper.step():
                    model(torch.ones(2, 16))
                dumper.flush()
                assert (dumper.run_dir / "pass00000.safetensors").is_file()
                _fill(full)  # the premise: not one more block on the disk
                with pytest.raises(OSError):
                    (full / "probe").write_bytes(b"\0" * 4096)
                for _ in range(3):
                    with dumper.step():
                        model(torch.ones(2, 16))
        manifest = _manifest(dumper.run_dir)
        left = sorted(p.name for p in dumper.run_dir.iterdir())
    assert manifest["complete"] is False
    assert "No space left" in manifest["incomplete_reason"]
    assert manifest["passes"]["count"] == 1 and manifest["passes"]["indices"] == [0]
    lost = manifest["skipped"]
    assert lost.get("dropped_files", 0) + lost.get("after_failure", 0) >= 2, lost  # pass 1's, and later
    assert "end_time" in manifest  # the version written at close, not an earlier one
    assert any(e["where"] == "writer" for e in manifest["errors"])
    assert MANIFEST_RESERVE not in left and not [n for n in left if n.endswith(".tmp")]
    said = "\n".join(tracedump_warnings(caught)) + capfd.readouterr().err
    assert "is marked incomplete" in said and "could not be updated" not in said


def test_a_manifest_that_cannot_be_written_is_never_said_to_be_marked_incomplete(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """No reserve left (another program took the space first, say): stderr says the manifest is stale."""
    model = _Wide().eval()
    with full_filesystem(tmp_path / "full", keep_free=40 << 10) as full:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with tracedump.attach(model, {"dir": full / "d"}) as dumper, torch.no_grad():
                dumper.rundir.writer.drop_reserve()
                _fill(full)
                with dumper.step():
                    model(torch.ones(2, 16))
        manifest = _manifest(dumper.run_dir)
    said = "\n".join(tracedump_warnings(caught)) + capfd.readouterr().err
    assert manifest["incomplete_reason"] is None  # the premise: the manifest kept its first version
    assert "is marked incomplete" not in said
    assert "could not be updated" in said and "No space left" in said


def test_the_reserve_holds_real_blocks_without_fallocate_and_never_passes_a_file_size_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tracedump.store import fsio

    monkeypatch.delattr(fsio.os, "posix_fallocate")  # macOS, Windows: zeros written instead
    reserve = fsio.SpaceReserve(tmp_path / ".r")
    reserve.hold(20_000)
    assert reserve.held == 20_480 and os.stat(tmp_path / ".r").st_blocks * 512 >= 20_480
    monkeypatch.undo()
    monkeypatch.setattr(fsio, "_file_size_limit", lambda: 8000)  # RLIMIT_FSIZE: SIGXFSZ past it
    limited = fsio.SpaceReserve(tmp_path / ".s")
    assert limited.hold_what_fits(64 << 10) == 4096 and os.path.getsize(tmp_path / ".s") == 4096
    for each in (reserve, limited):
        each.remove()
    assert list(tmp_path.iterdir()) == []


def test_the_reserve_moves_with_a_run_dir_renamed_to_its_rank_and_is_gone_at_close(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _Wide().eval()
    monkeypatch.delenv("RANK", raising=False)
    dumper = tracedump.attach(model, {"dir": tmp_path / "d"})  # before init_process_group
    assert (dumper.run_dir / MANIFEST_RESERVE).is_file()
    dist = torch.distributed
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda *a, **k: 3)
    monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: 4)
    with torch.no_grad():
        model(torch.ones(2, 16))  # the first pass settles the rank: the folder becomes rank3_...
    assert dumper.run_dir.name.startswith("rank3_") and (dumper.run_dir / MANIFEST_RESERVE).is_file()
    dumper.close()
    (run_dir,) = (tmp_path / "d").iterdir()
    assert run_dir.name.startswith("rank3_") and MANIFEST_RESERVE not in {p.name for p in run_dir.iterdir()}


# ------------------------------------------------------------------ 7. a dump written into its reference


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A reference a graft can read: one pass with the modules' inputs."""
    root = tmp_path_factory.mktemp("reference") / "ref"
    model = _Wide().eval()
    with tracedump.attach(model, {"dir": root, "inputs": True}), torch.no_grad():
        model(torch.ones(2, 16))
    return root


def _runs(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.name.startswith("rank"))


@pytest.mark.parametrize("where", ["itself", "inside", "inside_its_run", "link", "run_dir_parent"])
def test_a_graft_whose_dump_dir_is_inside_its_reference_is_refused_naming_both_variables(
    reference: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    (run,) = _runs(reference)
    graft_from = reference / run if where == "run_dir_parent" else reference
    out = {
        "itself": reference,
        "inside": reference / "again",
        "inside_its_run": reference / run / "sub",
        "link": tmp_path / "link",
        "run_dir_parent": reference,
    }[where]
    if where == "link":
        out.symlink_to(reference)
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(out))
    monkeypatch.setenv("TRACEDUMP_DUMP_GRAFT_FROM", str(graft_from))
    with pytest.raises(tracedump.ConfigError) as info:
        tracedump.attach(_Wide().eval())
    message = str(info.value)
    assert f"TRACEDUMP_DUMP_DIR={str(out)!r}" in message, message
    assert "TRACEDUMP_DUMP_GRAFT_FROM" in message and "into the reference" in message
    assert _runs(reference) == [run] and not (reference / "again").exists()
    assert not (reference / run / "sub").exists()


def test_graft_into_its_own_reference_is_refused_and_beside_it_is_not(
    reference: Path, tmp_path: Path
) -> None:
    model = _Wide().eval()
    with pytest.raises(tracedump.ConfigError, match="into the reference"):
        tracedump.graft(model, reference, dir=reference / "g").__enter__()
    with torch.no_grad(), tracedump.graft(model, reference, dir=tmp_path / "g") as graft:
        graft.run(torch.ones(2, 16))
    assert len(_runs(tmp_path / "g")) == 1 and len(_runs(reference)) == 1


# ------------------------------------------------------------------ 6. the shadow and the host's hooks


class _Grafted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(16, 16), nn.GELU())
        self.out = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.inner(x))


class _Probe:
    """A host's probe: every call its hooks see, with the output's dtype and values."""

    def __init__(self) -> None:
        self.pre: list[str] = []
        self.post: list[tuple[str, torch.dtype, torch.Tensor]] = []
        self.global_post: list[str] = []
        self.names: dict[nn.Module, str] = {}

    def attach(self, model: nn.Module, kind: str) -> list[torch.utils.hooks.RemovableHandle]:
        handles = []
        for name, module in model.named_modules():
            self.names[module] = name or type(module).__name__
            if not name or kind != "module":
                continue
            handles.append(module.register_forward_pre_hook(lambda m, a, n=name: self.pre.append(n)))
            handles.append(
                module.register_forward_hook(
                    lambda m, a, out, n=name: self.post.append((n, out.dtype, out.detach().clone()))
                )
            )
        handles.append(
            nn.modules.module.register_module_forward_hook(
                lambda m, a, out: self.global_post.append(self.names.get(m, "a module not the host's"))
            )
        )
        return handles


def _probed_run(model: nn.Module, x: torch.Tensor, graft: Any, kind: str) -> tuple[_Probe, torch.Tensor]:
    probe = _Probe()
    handles = probe.attach(model, kind)
    try:
        with torch.no_grad():
            out = graft.run(x) if graft is not None else model(x)
    finally:
        for handle in handles:
            handle.remove()
    return probe, out


def _reference_and_bf16(tmp_path: Path) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = _Grafted().eval()
    x = torch.randn(4, 16)
    dumper = tracedump.attach(model, {"dir": str(tmp_path / "ref"), "modules": "all", "inputs": True})
    with torch.no_grad():
        model(x)
    dumper.close()
    return model.to(torch.bfloat16), x.to(torch.bfloat16)


def _shadow_summary(path: Path) -> dict[str, Any]:
    return tracedump.open_dump(path).run().manifest["graft"]["shadow"]


@pytest.mark.parametrize("probe_kind", ["module", "global"])
def test_the_host_hooks_see_the_hosts_own_calls_never_the_shadows(tmp_path: Path, probe_kind: str) -> None:
    model, x = _reference_and_bf16(tmp_path)
    plain, _ = _probed_run(model, x, None, probe_kind)  # what the host's hooks see alone
    with tracedump.graft(model, tmp_path / "ref", dir=tmp_path / "g", level="^(inner|out)$") as graft:
        probe, out = _probed_run(model, x, graft, probe_kind)
    if probe_kind == "module":
        assert probe.pre == plain.pre == ["inner", "inner.0", "inner.1", "out"]
        assert [n for n, _, _ in probe.post] == [n for n, _, _ in plain.post]
        assert all(dtype == torch.bfloat16 for _, dtype, _ in probe.post)  # never the shadow's float32
        seen = {n: value for n, _, value in probe.post}
        assert torch.equal(seen["out"], out)  # the host's own output, as the host got it
        run = tracedump.open_dump(tmp_path / "g").run().passes[0].load()
        assert torch.equal(seen["inner"], run["inner"]) and torch.equal(seen["out"], run["out"])
    assert probe.global_post == plain.global_post
    if probe_kind == "global":
        assert probe.global_post == ["inner.0", "inner.1", "inner", "out", "_Grafted"]
    # A hook may change what a module computes: a call under one is not shadowed, and says why.
    shadow = _shadow_summary(tmp_path / "g")
    assert shadow["shadowed_calls"] == {}
    assert sum(shadow["not_shadowed"].values()) == 2
    assert all("hooks" in reason for reason in shadow["not_shadowed"]), shadow


def test_without_host_hooks_the_shadow_runs_and_with_a_hook_inside_it_does_not(tmp_path: Path) -> None:
    model, x = _reference_and_bf16(tmp_path)
    with (
        torch.no_grad(),
        tracedump.graft(model, tmp_path / "ref", dir=tmp_path / "a", level="^(inner|out)$") as g,
    ):
        g.run(x)
    assert _shadow_summary(tmp_path / "a") == {"shadowed_calls": {"inner": 1, "out": 1}, "not_shadowed": {}}
    handle = model.inner[1].register_forward_hook(lambda m, a, out: out * 1.02)  # a planted bug
    try:
        with (
            torch.no_grad(),
            tracedump.graft(model, tmp_path / "ref", dir=tmp_path / "b", level="^(inner|out)$") as g,
        ):
            g.run(x)
    finally:
        handle.remove()
    shadow = _shadow_summary(tmp_path / "b")
    assert shadow["shadowed_calls"] == {"out": 1}
    (reason,) = shadow["not_shadowed"]
    assert "inner.1" in reason


# ------------------------------------------------------------------ 12. worker threads in one step()


class _SlowReads(dict):
    """A pass's call counts whose reads wait (releasing the GIL): every thread that reads a count
    before another wrote it back would take the same call number, unless the count is locked."""

    def get(self, key: Any, default: Any = None) -> Any:
        value = super().get(key, default)
        time.sleep(0.002)
        return value


@pytest.mark.parametrize("mode", ["full", "stats"])
def test_worker_threads_capturing_into_one_step_lose_no_capture(tmp_path: Path, mode: str) -> None:
    model = _Wide().eval()
    threads_n, calls_n = 4, 15
    start = threading.Barrier(threads_n)

    def work() -> None:
        start.wait(timeout=60)
        for _ in range(calls_n):
            model.up(torch.ones(1, 16))  # a leaf called on an engine's worker thread, inside the step

    dumper = tracedump.attach(model, {"dir": tmp_path / "d", "mode": mode})
    with dumper, torch.no_grad(), dumper.step():
        dumper.recorder.current.calls = _SlowReads()
        workers = [threading.Thread(target=work) for _ in range(threads_n)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(timeout=120)
    run = tracedump.open_dump(dumper.run_dir).run()
    if mode == "full":
        keys = list(run.passes[0].load())
    else:
        keys = [f"{r['module']}::call{r['call']}" for r in run.stats()]
        seqs = [r["seq"] for r in run.stats()]
        assert sorted(seqs) == list(range(threads_n * calls_n))
    assert len(keys) == len(set(keys)) == threads_n * calls_n
    assert run.manifest["skipped"] == {}


# ------------------------------------------------------------------ 14. complex statistics


class _Complex(nn.Module):
    """A leaf with a complex output (a rotary embedding's ``polar``, an FFT)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.complex(x[..., 0], x[..., 1])


class _ComplexRoot(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rot = _Complex()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rot(x)


STATS = "abs_mean,sum,min,max,mean,std,l2,dtype"


@pytest.mark.parametrize("conjugated", [False, True])
def test_complex_statistics_are_of_the_real_and_imaginary_parts(tmp_path: Path, conjugated: bool) -> None:
    parts = torch.tensor([[3.0, 4.0], [-1.0, 2.0]])  # 3+4j, -1+2j
    model = _ComplexRoot().eval()
    if conjugated:  # a conjugate view (torch's lazy conj bit): its parts are (3, -4), (-1, -2)
        model.rot.forward = lambda x: torch.complex(x[..., 0], x[..., 1]).conj()  # type: ignore[method-assign]
    with tracedump.attach(model, {"dir": tmp_path / "s", "mode": "stats", "stats": STATS}), torch.no_grad():
        model(parts)
    (line,) = tracedump.open_dump(tmp_path / "s").run().stats()
    values = parts * torch.tensor([1.0, -1.0]) if conjugated else parts
    flat = values.flatten().double()
    assert line["dtype"] == "complex64"
    assert line["sum"] == pytest.approx(float(flat.sum()))  # 8 (-4 conjugated), not the moduli's 7.24
    assert line["mean"] == pytest.approx(float(flat.mean()))
    assert line["abs_mean"] == pytest.approx(2.5) and line["mean"] != line["abs_mean"]
    assert line["min"] == pytest.approx(float(flat.min())) and line["max"] == pytest.approx(float(flat.max()))
    assert line["std"] == pytest.approx(float(flat.std(correction=0)), rel=1e-6)
    assert line["l2"] == pytest.approx(30**0.5)  # the complex norm: sqrt(|3+4j|^2 + |-1+2j|^2)


def test_a_complex_stats_dump_agrees_with_the_full_dump_of_the_same_run(tmp_path: Path) -> None:
    from tracedump.compare import compare

    torch.manual_seed(0)
    x = torch.randn(3, 5, 2)
    model = _ComplexRoot().eval()
    for mode in ("full", "stats"):
        with tracedump.attach(model, {"dir": tmp_path / mode, "mode": mode, "stats": STATS}), torch.no_grad():
            model(x)
    report = compare(tmp_path / "stats", tmp_path / "full")
    assert report.exit_code == 0, report.first_divergence
