"""Arming a live engine: ``TRACEDUMP_DUMP_CONTROL=1``, ``tracedump arm`` / ``disarm``, the order file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import free_port

import tracedump
import tracedump.cli
import tracedump.compare
from tracedump.dump.control import ORDER_FILE, Order, watchers, write_order

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("fresh_warn_once")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))


def _steps(dumper: tracedump.Dumper, model: torch.nn.Module, count: int, **batch: object) -> None:
    for _ in range(count):
        with dumper.step():
            if batch:
                dumper.set_batch(**batch)  # type: ignore[arg-type]
            model(torch.ones(2, 4))


def _passes(dump: Path) -> list[str]:
    return sorted(p.name for p in next(dump.glob("rank*")).glob("pass*.safetensors"))


def _arm(dump: Path, *args: str) -> int:
    return tracedump.cli.main(["arm", str(dump), *args])


_OPENED: list[tracedump.Dumper] = []


@pytest.fixture(autouse=True)
def _close_every_dumper() -> Iterator[None]:
    """A failing test must not leave an active dumper behind for the next test file."""
    yield
    while _OPENED:
        _OPENED.pop().close()


def _attach(dump: Path, model: torch.nn.Module, **settings: object) -> tracedump.Dumper:
    dumper = tracedump.attach(model, {"dir": str(dump), "control": True, **settings})
    assert dumper is not None
    _OPENED.append(dumper)
    return dumper


def _until(dumper: tracedump.Dumper, model: torch.nn.Module, event: str, **batch: object) -> None:
    """Step until the last order reaches ``event``: its start step is a second of steps ahead, by
    the heartbeat's step rate, however fast the steps are (bounded: 200k steps)."""
    assert dumper.recorder.control is not None
    for _ in range(200_000):
        history = dumper.recorder.control.history
        if history and any(e["event"] == event and e["id"] == history[-1]["id"] for e in history):
            return
        _steps(dumper, model, 1, **batch)
    raise AssertionError(f"the order never reached {event!r}: {dumper.recorder.control.history}")


def test_control_attaches_disarmed_hooks_in_place_no_pass_file(tmp_path: Path) -> None:
    model = _model()
    dumper = _attach(tmp_path, model)
    assert any(m._forward_hooks for m in model.modules())
    _steps(dumper, model, 5)
    tracedump.record("logits", torch.ones(3))
    dumper.close()
    run_dir = next(tmp_path.glob("rank*"))
    assert _passes(tmp_path) == [] and not (run_dir / "records.safetensors").exists()
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["control"]["state"] == "idle" and manifest["skipped"] == {}


def _capture_hooks(model: torch.nn.Module) -> int:
    """Hooks on the model beyond the root's two pass hooks (its pre-hook and its closing hook)."""
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()) - 2


def test_an_idle_engine_carries_no_capture_hook_and_a_window_registers_them_while_it_runs(
    tmp_path: Path,
) -> None:
    model = _model()
    dumper = _attach(tmp_path, model)
    _steps(dumper, model, 2)
    assert _capture_hooks(model) == 0  # idle: torch's fast call path for every module
    assert _arm(tmp_path, "--steps", "2", "--inputs") == 0
    _until(dumper, model, "armed")
    assert _capture_hooks(model) == 2 * len(dumper.modules)  # outputs and, for --inputs, inputs
    _until(dumper, model, "done")
    assert _capture_hooks(model) == 0  # the boundary that ended the window removed them
    dumper.flush()
    dumped = _passes(tmp_path)
    assert len(dumped) == 2
    run_dir = next(tmp_path.glob("rank*"))
    stored = tracedump.load_pass(run_dir / dumped[0])
    assert any("@in" in key for key in stored) and any("@in" not in key for key in stored)


def test_a_window_armed_by_a_root_forward_captures_the_roots_own_inputs_in_its_first_step(
    tmp_path: Path,
) -> None:
    """Without step(), the root's pre-hook arms the window: the root's input hook, registered
    inside that very call (torch read the hooks before it), still sees the first step's inputs."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)  # a root that is itself the selected leaf
    dumper = _attach(tmp_path, model)
    for _ in range(2):
        model(torch.ones(2, 4))
    assert _arm(tmp_path, "--steps", "1", "--inputs") == 0
    for _ in range(200_000):
        history = dumper.recorder.control.history  # type: ignore[union-attr]
        if any(e["event"] == "done" for e in history):
            break
        model(torch.ones(2, 4))
    dumper.flush()
    (dumped,) = _passes(tmp_path)
    stored = tracedump.load_pass(next(tmp_path.glob("rank*")) / dumped)
    inputs = [key for key in stored if "@in" in key]
    assert len(inputs) == 1 and len(stored) == 2  # its input once (not twice), and its output
    assert torch.equal(stored[inputs[0]], torch.ones(2, 4))


def test_arm_for_n_steps_then_idle_and_disarm_ends_an_open_order(tmp_path: Path) -> None:
    model = _model()
    dumper = _attach(tmp_path, model)
    _steps(dumper, model, 2)
    assert _arm(tmp_path, "--steps", "3") == 0
    _until(dumper, model, "done")
    _steps(dumper, model, 5)
    dumper.flush()  # passes are written by the writer thread
    dumped = _passes(tmp_path)
    assert len(dumped) == 3 and dumped == sorted(dumped)
    first = int(dumped[0][4:9])
    assert [int(n[4:9]) for n in dumped] == [first, first + 1, first + 2]  # named by engine step
    assert _arm(tmp_path) == 0  # until disarmed
    _until(dumper, model, "armed")
    _steps(dumper, model, 4)
    assert tracedump.cli.main(["disarm", str(tmp_path)]) == 0
    _steps(dumper, model, 3)
    dumper.close()
    assert len(_passes(tmp_path)) > 3
    manifest = json.loads((next(tmp_path.glob("rank*")) / "manifest.json").read_text())
    events = [o["event"] for o in manifest["control"]["orders"]]
    assert "done" in events and "disarmed" in events and manifest["control"]["state"] == "idle"
    listing = subprocess.run(
        [sys.executable, "-m", "tracedump", "ls", str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert "control closed" in listing.stdout and "disarmed at step" in listing.stdout


def test_an_armed_window_honours_filter_mode_and_inputs(tmp_path: Path) -> None:
    model = _model()
    dumper = _attach(tmp_path, model)
    _steps(dumper, model, 1)
    assert _arm(tmp_path, "--steps", "1", "--filter", "^2$", "--inputs") == 0
    _until(dumper, model, "done")
    dumper.close()
    (name,) = _passes(tmp_path)
    stored = tracedump.load_pass(next(tmp_path.glob("rank*")) / name)
    assert set(stored) == {"2", "2@in[0]"}


def test_request_targeted_arming_dumps_only_steps_holding_that_sequence(tmp_path: Path) -> None:
    model = _model()
    dumper = _attach(tmp_path, model)
    _steps(dumper, model, 1, seq_ids=[1, 2])
    assert _arm(tmp_path, "--steps", "2", "--request", "7") == 0
    _until(dumper, model, "armed", seq_ids=[1, 2])
    _steps(dumper, model, 1, seq_ids=[7, 2])
    _steps(dumper, model, 2, seq_ids=[1, 1])
    _steps(dumper, model, 3, seq_ids=[7, 7])
    dumper.close()
    run = tracedump.open_dump(tmp_path).run()
    assert len(run.passes) == 2
    assert all(7 in batch.seq_ids for batch in run.batches().values())


def test_bad_orders_are_refused_by_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _arm(tmp_path) == 2
    assert "no engine watches it" in capsys.readouterr().err
    model = _model()
    dumper = _attach(tmp_path, model)
    _steps(dumper, model, 1)
    assert _arm(tmp_path, "--steps", "-1") == 2
    assert "--steps -1" in capsys.readouterr().err
    assert _arm(tmp_path, "--filter", "(") == 2
    assert "invalid regex" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        _arm(tmp_path, "--mode", "everything")
    assert exit_info.value.code == 2
    assert _arm(tmp_path / "nothing") == 2
    dumper.close()
    assert not (tmp_path / ORDER_FILE).exists()


@pytest.mark.parametrize("how", ["corrupt", "writable by others"])
def test_an_order_file_it_may_not_obey_is_ignored_with_one_warning(tmp_path: Path, how: str) -> None:
    model = _model()
    dumper = _attach(tmp_path, model)
    path = tmp_path / ORDER_FILE
    if how == "corrupt":
        path.write_text("{not json")
        path.chmod(0o600)
    else:
        write_order(tmp_path, Order(id=1, action="arm", steps=2))
        path.chmod(0o666)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _steps(dumper, model, 3)
        os.utime(path)  # touched again: still ignored, not warned twice
        _steps(dumper, model, 2)
    dumper.close()
    messages = [str(w.message) for w in caught if "ignoring" in str(w.message)]
    assert len(messages) == 1 and ORDER_FILE in messages[0]
    assert _passes(tmp_path) == []


@pytest.mark.parametrize(
    "text",
    [
        '{"id":1,"action":"arm","filter":5}',
        '{"id":Infinity,"action":"arm"}',
        '{"id":1,"action":"arm","start_step":1e400}',
        '{"id":1,"action":"arm","filter":["a"]}',
        '{"id":true,"action":"arm"}',
        "[1]",
    ],
)
def test_a_malformed_order_never_reaches_the_engine(tmp_path: Path, text: str) -> None:
    model = _model()
    dumper = _attach(tmp_path, model)
    _steps(dumper, model, 1)
    path = tmp_path / ORDER_FILE
    path.write_text(text)
    path.chmod(0o600)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _steps(dumper, model, 3)
    dumper.close()
    assert _passes(tmp_path) == [] and any("ignoring" in str(w.message) for w in caught)


def test_an_order_left_by_an_earlier_run_does_not_arm_a_new_engine(tmp_path: Path) -> None:
    model = _model()
    first = _attach(tmp_path, model)
    _steps(first, model, 1)
    assert _arm(tmp_path) == 0  # until disarmed, and never disarmed
    _until(first, model, "armed")
    _steps(first, model, 2)
    first.close()
    assert _passes(tmp_path)
    for run in tmp_path.glob("rank*"):
        for name in run.glob("pass*"):
            name.unlink()
    second = _attach(tmp_path, model)
    _steps(second, model, 30)
    second.close()
    assert not list(tmp_path.glob("rank*/pass*.safetensors"))


def test_a_stats_window_makes_a_stats_run_and_another_mode_is_refused(tmp_path: Path) -> None:
    model = _model()
    dumper = _attach(tmp_path, model)
    _steps(dumper, model, 1)
    assert _arm(tmp_path, "--steps", "2", "--mode", "stats") == 0
    _until(dumper, model, "done")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _arm(tmp_path, "--steps", "2", "--mode", "full") == 0
        _until(dumper, model, "refused: this run dir holds stats passes")
    dumper.close()
    run = tracedump.open_dump(tmp_path).run()
    assert run.manifest["settings"]["mode"] == "stats" and not run.passes
    assert len({record["pass"] for record in run.stats()}) == 2
    assert any("refused" in str(w.message) for w in caught)
    report = tracedump.compare.compare(tmp_path, tmp_path)
    assert report.exit_code == 0 and report.compared > 0


def test_a_nested_root_call_is_no_step_boundary(tmp_path: Path) -> None:
    class Outer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, again: bool = True) -> torch.Tensor:
            y = self.inner(x)
            return self(y, again=False) if again else y

    model = Outer()
    dumper = _attach(tmp_path, model)
    for _ in range(4):
        model(torch.ones(1, 4))
    assert dumper.recorder.boundaries == 4
    dumper.close()


def test_a_stale_batch_of_an_idle_step_does_not_hide_the_requested_one(tmp_path: Path) -> None:
    model = _model()
    dumper = _attach(tmp_path, model)
    _steps(dumper, model, 1, seq_ids=[0, 0])
    assert _arm(tmp_path, "--steps", "2", "--request", "7") == 0
    _until(dumper, model, "armed", seq_ids=[0, 0])
    for batch in ([0, 0], [7, 7], [7, 0], [0, 0]):
        with dumper.step():
            dumper.set_batch(seq_ids=batch)
            model(torch.ones(2, 4))
    dumper.close()
    run = tracedump.open_dump(tmp_path).run()
    assert [b.seq_ids for b in run.batches().values()] == [(7, 7), (7, 0)]


def test_an_idle_server_of_this_host_can_be_armed_whatever_its_heartbeat_age(tmp_path: Path) -> None:
    model = _model()
    dumper = _attach(tmp_path, model)
    _steps(dumper, model, 1)
    state = next(tmp_path.glob("rank*/control.state"))
    beat = json.loads(state.read_text())
    state.write_text(json.dumps({**beat, "time": beat["time"] - 3600}))  # an hour without traffic
    assert _arm(tmp_path, "--steps", "1") == 0
    _until(dumper, model, "done")
    dumper.close()
    assert len(_passes(tmp_path)) == 1


def test_without_control_nothing_changes(tmp_path: Path) -> None:
    model = _model()
    dumper = tracedump.attach(model, {"dir": str(tmp_path)})
    assert dumper is not None
    _steps(dumper, model, 2)
    dumper.close()
    assert _passes(tmp_path) == ["pass00000.safetensors", "pass00001.safetensors"]
    assert "control" not in json.loads((next(tmp_path.glob("rank*")) / "manifest.json").read_text())


def _server(
    out: Path, steps: int, env: dict[str, str], port: int, pause: float = 0.02, until: Path | None = None
) -> subprocess.Popen[str]:
    """The example server; with ``until``, it serves until that file exists (``steps`` at most)."""
    clean = {k: v for k, v in os.environ.items() if not k.upper().startswith("TRACEDUMP_")}
    return subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / "server.py"), "--steps", str(steps), "--out", str(out),
         "--port", str(port), "--pause", str(pause), *(["--until", str(until)] if until else [])],
        env={**clean, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def _wait_for_heartbeats(dump: Path, ranks: int, server: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        found = watchers(dump) if dump.is_dir() else []
        if len(found) == ranks and all(w.rate > 0 for w in found):
            return
        assert server.poll() is None, server.communicate()[0][-3000:]
        time.sleep(0.2)
    raise AssertionError("the server never started watching")


def _wait_until_done(dump: Path, server: subprocess.Popen[str]) -> None:
    """Until every rank's manifest records the order as done."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        manifests = [json.loads((run / "manifest.json").read_text()) for run in dump.glob("rank*")]
        if manifests and all(
            any(o["event"] == "done" for o in m.get("control", {}).get("orders", [])) for m in manifests
        ):
            return
        assert server.poll() is None, server.communicate()[0][-3000:]
        time.sleep(0.2)
    raise AssertionError("the armed steps never finished")


def test_a_live_two_rank_server_armed_for_3_steps_dumps_the_same_3_in_every_rank(tmp_path: Path) -> None:
    dump = tmp_path / "live"
    env = {"TRACEDUMP_DUMP_DIR": str(dump), "TRACEDUMP_DUMP_CONTROL": "1"}
    stop = tmp_path / "stop"  # the server serves until this exists: never done before it was armed
    server = _server(tmp_path / "on", 20_000, env, free_port(), until=stop)
    try:
        _wait_for_heartbeats(dump, 2, server)
        armed = subprocess.run(
            [sys.executable, "-m", "tracedump", "arm", str(dump), "--steps", "3"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert armed.returncode == 0, armed.stderr
        _wait_until_done(dump, server)
        assert tracedump.cli.main(["disarm", str(dump)]) == 0  # while it serves on
        stop.touch()
        output, _ = server.communicate(timeout=240)
        assert server.returncode == 0, output[-3000:]
    finally:
        stop.touch()  # a failed test leaves no rank serving on: each stops after its next step
        server.kill()
    runs = sorted(dump.glob("rank*"))
    assert len(runs) == 2
    dumped = [sorted(p.name for p in run.glob("pass*.safetensors")) for run in runs]
    assert len(dumped[0]) == 3 and dumped[0] == dumped[1]  # the same steps on both ranks
    assert tracedump.cli.main(["disarm", str(dump)]) == 2  # the engine is gone: nobody watches
    served = len(torch.load(tmp_path / "on" / "rank0.pt"))
    off = _server(tmp_path / "off", served, {}, free_port(), pause=0)  # no traffic to wait for: same logits
    assert off.wait(timeout=240) == 0
    for rank in (0, 1):
        on_logits = torch.load(tmp_path / "on" / f"rank{rank}.pt")
        off_logits = torch.load(tmp_path / "off" / f"rank{rank}.pt")
        assert len(on_logits) == len(off_logits) == served > 3
        assert all(torch.equal(a, b) for a, b in zip(on_logits, off_logits, strict=True))


def _child_steps(dumper: tracedump.Dumper, model: torch.nn.Module) -> None:
    _steps(dumper, model, 2)
    dumper.close()


def test_a_forked_worker_watches_with_its_own_heartbeat(tmp_path: Path) -> None:
    import multiprocessing

    model = _model()
    dumper = _attach(tmp_path, model)
    _steps(dumper, model, 1)
    child = multiprocessing.get_context("fork").Process(target=_child_steps, args=(dumper, model))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    states = {json.loads(p.read_text())["pid"]: p.parent for p in tmp_path.glob("rank*/control.state")}
    assert os.getpid() in states and child.pid in states  # each process its own heartbeat
    assert states[os.getpid()] != states[child.pid]
    assert json.loads((states[os.getpid()] / "control.state").read_text())["state"] != "closed"
    dumper.close()
