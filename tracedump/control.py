"""Arm and disarm a running engine: ``tracedump arm DIR`` / ``tracedump disarm DIR``.

A serving engine started with ``TRACEDUMP_DUMP_CONTROL=1`` (and ``DUMP_DIR``) attaches *disarmed*:
its hooks are in place, nothing is captured, no pass file is written. The channel is one file,
``DIR/control.json``, written atomically by the CLI: each dumper looks at it once per step
boundary (one ``os.stat``: no thread, no port, no dependency) and reads it only when it changed.

- **Who may arm**: the order file must belong to the engine's own user and be writable by nobody
  else (the dump dir is ``0700``); any other file, or one that does not parse, is ignored with one
  warning. The CLI refuses a ``DIR`` its user does not own.
- **Which steps**: every dumper under ``DIR`` keeps a heartbeat, ``<run dir>/control.state``
  (its step count, the time, its step rate), written at attach (so a server that has loaded its
  model can be armed before its first request) and rewritten at most twice a second. ``arm`` reads them
  and names a **start step** a little ahead of the furthest run (:data:`LEAD_SECONDS` of its steps,
  at least :data:`MIN_LEAD_STEPS`); every process dumps its steps ``start .. start+N-1`` of its own
  step counter. Tensor-parallel ranks step in lockstep, so they dump the same steps and
  ``--unshard`` works on the result; a process that sees the order only after its start step
  (it stepped faster than the lead) starts at its next boundary and records where it did.
- **What**: ``--steps N`` (else until disarmed), ``--filter`` (a regex narrowing the names
  captured), ``--mode``, ``--inputs`` and ``--request SEQ_ID`` (only steps whose ``set_batch``
  holds that sequence; they count towards N).

Each order and what the process made of it goes into the manifest (``control``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import socket
import stat
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ORDER_FILE = "control.json"
STATE_FILE = "control.state"
LEAD_SECONDS = 1.0  # how far ahead of the furthest run an order starts, in that run's time
MIN_LEAD_STEPS = 2
HEARTBEAT_SECONDS = 0.5
STALE_SECONDS = 10.0  # a heartbeat older than this is no engine watching
MODES = ("full", "last_row", "stats")


class OrderError(ValueError):
    """An order the CLI refuses, or a file a dumper ignores (says why)."""


@dataclass(frozen=True)
class Order:
    """One arm or disarm order, as written to ``control.json``."""

    id: int
    action: str  # "arm" | "disarm"
    start_step: int = 0
    steps: int | None = None
    filter: str | None = None
    mode: str | None = None
    inputs: bool = False
    request: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_json(cls, data: Any) -> Order:
        """Strictly typed: a file is obeyed only when every field is what the CLI writes."""
        if not isinstance(data, dict) or data.get("action") not in ("arm", "disarm"):
            raise OrderError("not an order (expected an object with action arm or disarm)")
        order = cls(
            id=_typed(data, "id", int, required=True),
            action=data["action"],
            start_step=_typed(data, "start_step", int) or 0,
            steps=_typed(data, "steps", int),
            filter=_typed(data, "filter", str),
            mode=_typed(data, "mode", str),
            inputs=bool(_typed(data, "inputs", bool)),
            request=_typed(data, "request", str),
        )
        order.check()
        return order

    def check(self) -> None:
        """What the CLI refuses and a dumper ignores: no step count below 1, unknown modes, bad regexes."""
        if self.steps is not None and self.steps < 1:
            raise OrderError(f"--steps {self.steps}: expected a number of steps >= 1")
        if self.mode is not None and self.mode not in MODES:
            raise OrderError(f"--mode {self.mode!r}: choose from {', '.join(MODES)}")
        if self.filter is not None:
            try:
                re.compile(self.filter)
            except re.error as e:
                raise OrderError(f"--filter {self.filter!r}: invalid regex: {e}") from e


def _typed(data: dict[str, Any], key: str, kind: type, required: bool = False) -> Any:
    value = data.get(key)
    if value is None:
        if required:
            raise OrderError(f"malformed order: no {key}")
        return None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise OrderError(f"malformed order: {key} is {type(value).__name__}, not {kind.__name__}")
    if kind is int and not -(2**62) < value < 2**62:
        raise OrderError(f"malformed order: {key} {value} is out of range")
    return value


def write_order(dump_dir: Path, order: Order) -> Path:
    """Write ``control.json`` atomically, owner-only (the CLI's side)."""
    path = dump_dir / ORDER_FILE
    tmp = dump_dir / f".{ORDER_FILE}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        json.dump(order.to_json(), handle)
    os.replace(tmp, path)
    return path


def read_order(path: Path) -> Order:
    """The order in ``path``, if this process may obey it (raises OrderError saying why not)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise OrderError(f"cannot open: {e.strerror or e}") from e
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise OrderError("not a regular file")
        if info.st_uid != os.getuid() or info.st_mode & 0o022:
            raise OrderError(
                "written by another user, or writable by others: only the dump dir's owner may arm"
            )
        text = handle.read(1 << 16)
    try:
        return Order.from_json(json.loads(text))
    except (ValueError, RecursionError) as e:
        raise OrderError(f"not valid JSON: {e}") from e


def _stamp(path: Path) -> tuple[int, int] | None:
    """What tells a rewritten order file from the one seen before (None: there is none)."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_mtime_ns, info.st_ino


@dataclass
class Window:
    """The armed steps of one order in one process."""

    order: Order
    start: int  # the step it actually started at
    done: int = 0  # passes dumped so far

    @property
    def end(self) -> int | None:
        """The step after the last armed one, when known (``--request`` makes it depend on traffic)."""
        if self.order.steps is None or self.order.request is not None:
            return None
        return self.start + self.order.steps

    @property
    def finished(self) -> bool:
        return self.order.steps is not None and self.done >= self.order.steps


@dataclass
class Controller:
    """One dumper's side of the channel: poll at step boundaries, keep the heartbeat, log orders."""

    dump_dir: Path
    run_dir: Path
    warn: Any  # callable(key, message): one-time warnings of the dumper
    history: list[dict[str, Any]] = field(default_factory=list)
    window: Window | None = None
    _seen: tuple[int, int] | None = None
    _last_id: int | None = None
    _pending: Order | None = None
    _beat_at: float = 0.0
    _beat_step: int = 0
    _rate: float = 0.0
    _step: int = 0
    fixed_mode: str | None = None  # the mode of the passes already in the run dir (one mode per run)

    def __post_init__(self) -> None:
        """An order file already in the dump dir belongs to an earlier run: seen, not obeyed."""
        path = self.dump_dir / ORDER_FILE
        self._seen = _stamp(path)
        if self._seen is not None:
            with contextlib.suppress(Exception):  # whatever it holds, it is not this run's order
                self._last_id = read_order(path).id
        # A heartbeat from attach on, not from the first step: a server that loads its model and
        # waits for traffic (vLLM with the plugin) can be armed before its first request.
        self._heartbeat(0)

    def at_boundary(self, step: int) -> tuple[Window | None, bool]:
        """Poll the order file at step ``step``; the armed window this step belongs to (None: idle),
        and whether the manifest's control record changed."""
        self._step = step
        try:
            changed = self._poll(step)
        except Exception as e:  # never into the engine's step: a broken order is ignored
            self.warn("control_order", f"tracedump: ignoring {self.dump_dir / ORDER_FILE}: {e!r}")
            changed = False
        if self.window is not None and self.window.finished:
            self._finish(step, "done")
            changed = True
        self._heartbeat(step)
        pending = self._pending  # only an arm order waits: a disarm acts when it is read
        if self.window is None and pending is not None and step >= pending.start_step:
            self.window = Window(pending, step)
            self._pending = None
            self._log(pending, "armed", step)
            changed = True
        return self.window, changed

    def counted(self) -> None:
        """A dumped step of the window (a step without the ``--request`` sequence is not one)."""
        if self.window is not None:
            self.window.done += 1

    def state(self) -> dict[str, Any]:
        window = self.window
        return {
            "enabled": True,
            "state": "armed" if window else ("pending" if self._pending is not None else "idle"),
            "armed_from": window.start if window else None,
            "armed_until": window.end if window else None,
            "orders": self.history,
        }

    def _poll(self, step: int) -> bool:
        path = self.dump_dir / ORDER_FILE
        seen = _stamp(path)
        if seen is None or seen == self._seen:
            return False
        self._seen = seen
        try:
            order = read_order(path)
        except OrderError as e:
            self.warn("control_order", f"tracedump: ignoring {path}: {e}")
            return False
        if order.id == self._last_id:
            return False
        self._last_id = order.id
        if order.action == "disarm":
            self._pending = None
            if self.window is not None:
                self._finish(step, "disarmed")
            else:
                self._log(order, "disarm (idle already)", step)
            return True
        if order.mode and self.fixed_mode and order.mode != self.fixed_mode:
            self._log(order, f"refused: this run dir holds {self.fixed_mode} passes", step)
            self.warn(
                "control_mode",
                f"tracedump: arm --mode {order.mode} refused in {self.run_dir}: its passes are "
                f"{self.fixed_mode} (one mode per run dir; dump another mode into another DUMP_DIR)",
            )
            return True
        if self.window is not None:
            self._finish(step, "replaced")
        self._pending = order
        if step > order.start_step:
            self._pending = Order(**{**asdict(order), "start_step": step})
            self._log(order, f"seen late at step {step}: starts there", step)
        else:
            self._log(order, "pending", step)
        return True

    def _finish(self, step: int, how: str) -> None:
        assert self.window is not None
        self._log(self.window.order, how, step, dumped=self.window.done)
        self.window = None

    def _log(self, order: Order, what: str, step: int, **extra: Any) -> None:
        entry = {"id": order.id, "action": order.action, "event": what, "step": step, "time": time.time()}
        self.history.append({**entry, **order.to_json(), **extra})

    def close(self) -> None:
        """The process stops watching: its heartbeat says so at once."""
        self._beat_at = 0.0
        self._heartbeat(self._step, state="closed")

    def forked(self, run_dir: Path) -> Controller:
        """A forked child's own controller: its run dir, the orders already seen, a fresh history."""
        child = Controller(self.dump_dir, run_dir, self.warn, fixed_mode=None)
        child._seen, child._last_id = self._seen, self._last_id
        return child

    def _heartbeat(self, step: int, state: str | None = None) -> None:
        now = time.monotonic()
        if state is None and now - self._beat_at < HEARTBEAT_SECONDS:
            return
        if self._beat_at and now > self._beat_at:
            self._rate = (step - self._beat_step) / (now - self._beat_at)
        self._beat_at, self._beat_step = now, step
        window = self.window
        state = {
            "step": step,
            "time": time.time(),
            "rate": self._rate,
            "state": state or ("armed" if window else "idle"),
            "armed_until": window.end if window else None,
            "pid": os.getpid(),
            "host": socket.gethostname(),
        }
        tmp = self.run_dir / f".{STATE_FILE}.tmp"
        try:
            tmp.write_text(json.dumps(state))
            os.replace(tmp, self.run_dir / STATE_FILE)
        except OSError as e:
            self.warn("control_state", f"tracedump: cannot write {self.run_dir / STATE_FILE}: {e}")


# ------------------------------------------------------------------------------- the CLI's side


@dataclass(frozen=True)
class Watcher:
    """A run dir whose engine watches the order file (a fresh heartbeat)."""

    run_dir: Path
    step: int
    rate: float
    age: float
    state: str


def watchers(dump_dir: Path) -> list[Watcher]:
    """Run dirs under ``dump_dir`` with a heartbeat younger than :data:`STALE_SECONDS`."""
    found = []
    now = time.time()
    for path in sorted(dump_dir.glob(f"rank*_pid*/{STATE_FILE}")):
        try:
            data = json.loads(path.read_text())
            age = now - float(data["time"])
            step, rate = int(data["step"]), float(data.get("rate") or 0.0)
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if data.get("state") == "closed":
            continue
        if 0 <= age < STALE_SECONDS or _alive_here(data):  # an idle server steps no boundary
            found.append(
                Watcher(
                    path.parent, step, rate if age < STALE_SECONDS else 0.0, age, str(data.get("state", "?"))
                )
            )
    return found


def _alive_here(data: dict[str, Any]) -> bool:
    """A heartbeat of a process of this host that still runs (a server without traffic)."""
    if data.get("host") != socket.gethostname() or not isinstance(data.get("pid"), int):
        return False
    try:
        os.kill(data["pid"], 0)
    except (ProcessLookupError, PermissionError, OverflowError, ValueError):
        return False
    return True


def start_step(found: list[Watcher], lead: float = LEAD_SECONDS) -> int:
    """A step every watcher reaches after the order is written: the furthest one's step now, plus
    ``lead`` seconds of its steps (at least :data:`MIN_LEAD_STEPS`)."""
    return max(w.step + max(MIN_LEAD_STEPS, math.ceil(w.rate * (w.age + lead))) for w in found)
