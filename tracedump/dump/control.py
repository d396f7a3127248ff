"""Arm and disarm a running engine: ``tracedump arm DIR`` / ``tracedump disarm DIR``.

A serving engine started with ``TRACEDUMP_DUMP_CONTROL=1`` (and ``DUMP_DIR``) attaches *disarmed*:
no capture hook is registered below the root (which keeps its pass hooks), nothing is
captured, no pass file is written. The channel is one file, ``DIR/control.json``, written
atomically by the CLI: each dumper looks at it once per step boundary (one ``os.stat``: no
thread, no port, no dependency) and reads it only when it changed.

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
import hashlib
import json
import math
import os
import re
import socket
import stat
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..errors import OrderError
from ..store.control import STATE_FILE, read_state_bytes
from ..store.fsio import write_text_atomic
from .stdlib_compat import parsed_regex

ORDER_FILE = "control.json"
LEAD_SECONDS = 1.0  # how far ahead of the furthest run an order starts, in that run's time
MIN_LEAD_STEPS = 2
HEARTBEAT_SECONDS = 0.5
STALE_SECONDS = 10.0  # a heartbeat older than this is no engine watching
MODES = ("full", "last_row", "stats")
MAX_STEP = 2**62 - 1  # the largest step number (and --steps) an order may hold: the engine's limit
MAX_RATE = 1e9  # steps per second a heartbeat may claim (a real engine makes at most thousands)
# An armed --filter runs on the engine's names: a pattern that backtracks catastrophically would
# stall the host's step. It is refused unless its cost on a name of n characters is at most
# O(n ** MAX_FILTER_REPEATS): no repeat inside a repeat, no alternation or backreference under a repeat,
# at most MAX_FILTER_REPEATS open-ended repeats, and at most MAX_FILTER_WAYS ways to combine every
# choice (bounded repeats such as ``.?`` or ``{0,16}`` and alternations included: 60 of ``.?`` in a
# row are 2**60 ways). Each name is then matched once per order (a memo).
MAX_FILTER_REPEATS = 2
MAX_FILTER_CHARS = 1000
MAX_REQUEST_CHARS = 1000  # a sequence id; the order file it goes into stays far below MAX_ORDER_BYTES
MAX_ORDER_BYTES = 1 << 16  # what a dumper reads of control.json: a larger file is refused, not cut
_WIDE_REPEAT = 16  # a repeat allowing more than this many copies counts as open-ended
# The choices a filter's backtracking may combine at one position: an open-ended repeat counts as
# the length of a long module name, so two of them in a row are the most (a bound, not a timing).
_NAME_CHARS = 256
MAX_FILTER_WAYS = 2 * _NAME_CHARS**2


@dataclass(frozen=True, kw_only=True)
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
        """What the CLI refuses and a dumper ignores: no step count below 1 or beyond
        :data:`MAX_STEP`, unknown modes, bad regexes."""
        if self.steps is not None and not 1 <= self.steps <= MAX_STEP:
            raise OrderError(f"--steps {self.steps}: expected a number of steps from 1 to {MAX_STEP}")
        if not 0 <= self.start_step <= MAX_STEP:
            raise OrderError(f"start step {self.start_step} is out of range (0 to {MAX_STEP})")
        if self.mode is not None and self.mode not in MODES:
            raise OrderError(f"--mode {self.mode!r}: choose from {', '.join(MODES)}")
        if self.filter is not None:
            check_filter(self.filter)
        if self.request is not None and len(self.request) > MAX_REQUEST_CHARS:
            raise OrderError(f"--request: {len(self.request)} characters, at most {MAX_REQUEST_CHARS}")


def check_filter(pattern: str) -> None:
    """Refuse a ``--filter`` whose matching cost could stall the engine (see :data:`MAX_FILTER_REPEATS`)."""
    try:
        re.compile(pattern)
    except (re.error, RecursionError, OverflowError) as e:
        raise OrderError(f"--filter {pattern!r}: invalid regex: {e}") from e
    if len(pattern) > MAX_FILTER_CHARS:
        raise OrderError(f"--filter: {len(pattern)} characters, at most {MAX_FILTER_CHARS}")
    try:
        repeats = _open_repeats(parsed_regex(pattern), under_repeat=False)
    except _Backtracks as e:
        raise OrderError(
            f"--filter {pattern!r}: {e}; such a pattern can take exponential time on one name and "
            "would stall the engine (see docs/operations.md)"
        ) from None
    if repeats > MAX_FILTER_REPEATS:
        raise OrderError(
            f"--filter {pattern!r}: {repeats} open-ended repeats (*, +, {{n,}}), at most "
            f"{MAX_FILTER_REPEATS}: more can take polynomial time of that degree on one name and "
            "stall the engine (see docs/operations.md)"
        )


class _Backtracks(Exception):
    pass


def _open_repeats(items: Any, under_repeat: bool) -> int:
    """Open-ended repeats in a parsed pattern; raises _Backtracks where a nested one is found, or
    where the ways its choices can be combined at one position pass :data:`MAX_FILTER_WAYS`."""
    wide, ways = _choices(items, under_repeat)
    if wide <= MAX_FILTER_REPEATS and ways > MAX_FILTER_WAYS:  # too many repeats: the caller says so
        raise _Backtracks(
            f"its repeats and alternations combine in more than {MAX_FILTER_WAYS} ways at one position"
        )
    return wide


def _choices(items: Any, under_repeat: bool) -> tuple[int, float]:
    """(open-ended repeats, ways to combine the choices) of a sequence: repeats add up, ways multiply.

    A repeat of up to n copies offers n + 1 choices (an open-ended one, :data:`_NAME_CHARS`), an
    alternation one per branch. Under a repeat of more than one copy a choice of any kind (a repeat of
    variable count, bounded or not, an alternation) is refused: it multiplies with every copy."""
    wide_total, ways = 0, 1.0
    for op, arg in items:
        name = str(op)
        if name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
            low, high, sub = arg
            wide = high > _WIDE_REPEAT
            if under_repeat and (wide or low != high):
                raise _Backtracks("a repeat inside a repeat")
            inner_wide, inner_ways = _choices(sub, under_repeat or high > 1)
            wide_total += int(wide) + inner_wide
            count = _NAME_CHARS if wide else high - low + 1
            ways *= count * inner_ways if high <= 1 else count
        elif name == "BRANCH":
            if under_repeat:
                raise _Backtracks("an alternation under a repeat")
            branches = [_choices(branch, under_repeat) for branch in arg[1]]
            wide_total += sum(w for w, _ in branches)
            ways *= sum(n for _, n in branches)
        elif name in ("GROUPREF", "GROUPREF_EXISTS"):
            raise _Backtracks("a backreference")
        elif name in ("SUBPATTERN", "ASSERT", "ASSERT_NOT", "ATOMIC_GROUP"):
            inner_wide, inner_ways = _choices(arg if name == "ATOMIC_GROUP" else arg[-1], under_repeat)
            wide_total += inner_wide  # the group's pattern comes last
            ways *= inner_ways
    return wide_total, ways


def _typed(data: dict[str, Any], key: str, kind: type, required: bool = False) -> Any:
    value = data.get(key)
    if value is None:
        if required:
            raise OrderError(f"malformed order: no {key}")
        return None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise OrderError(f"malformed order: {key} is {type(value).__name__}, not {kind.__name__}")
    if kind is int and not -MAX_STEP <= value <= MAX_STEP:
        raise OrderError(f"malformed order: {key} {value} is out of range (at most {MAX_STEP})")
    return value


def write_order(dump_dir: Path, order: Order) -> Path:
    """Write ``control.json`` atomically, owner-only (the CLI's side)."""
    path = dump_dir / ORDER_FILE
    try:
        write_text_atomic(path, json.dumps(order.to_json()))
    except OSError as e:  # a full disk: no temp file is left, and the message names the file
        raise OrderError(f"cannot write {path}: {e.strerror or e}") from e
    return path


def read_order(path: Path) -> Order:
    """The order in ``path``, if this process may obey it (raises OrderError saying why not)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise OrderError(f"cannot open: {e.strerror or e}") from e
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):  # a FIFO, a directory, a device
            raise OrderError("not a regular file")
        if info.st_uid != os.getuid() or info.st_mode & 0o022:
            raise OrderError(
                "written by another user, or writable by others: only the dump dir's owner may arm"
            )
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as handle:
        text = handle.read(MAX_ORDER_BYTES + 1)
    if len(text) > MAX_ORDER_BYTES:  # cut, valid JSON would read as "not valid JSON"
        raise OrderError(f"larger than {MAX_ORDER_BYTES} bytes: not an order the CLI writes")
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise OrderError(f"not valid JSON: {e}") from e
    return Order.from_json(data)  # raises OrderError saying what is wrong with the order itself


def _identity(path: Path) -> str:
    """What tells one ignored order file from another: inode, size and, for a regular file, a digest
    of its first 64 KiB (read without following a link or blocking on a FIFO)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return "unopenable"
    try:
        info = os.fstat(fd)
        regular = stat.S_ISREG(info.st_mode)
        digest = hashlib.sha256(os.read(fd, MAX_ORDER_BYTES)).hexdigest()[:16] if regular else ""
        return f"{info.st_ino}:{info.st_size}:{digest}"
    except OSError:
        return "unreadable"
    finally:
        os.close(fd)


def _stamp(path: Path | str) -> tuple[int, int] | None:
    """What tells a rewritten order file from the one seen before (None: there is none)."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_mtime_ns, info.st_ino


@dataclass(kw_only=True)
class Window:
    """The armed steps of one order in one process."""

    order: Order
    start: int  # the step it actually started at
    done: int = 0  # passes dumped so far
    matches: dict[str, bool] = field(default_factory=dict)  # --filter, decided once per name

    def wants(self, name: str) -> bool:
        """Whether ``--filter`` keeps ``name``: one ``re.search`` per name and order, then a lookup."""
        found = self.matches.get(name)
        if found is None:
            found = self.matches[name] = re.search(self.order.filter or "", name) is not None
        return found

    @property
    def end(self) -> int | None:
        """The step after the last armed one, when known (``--request`` makes it depend on traffic)."""
        if self.order.steps is None or self.order.request is not None:
            return None
        return self.start + self.order.steps

    @property
    def finished(self) -> bool:
        return self.order.steps is not None and self.done >= self.order.steps


@dataclass(frozen=True)
class Armed:
    """What an armed step captures beyond the settings: the order's overrides, as the recorder
    applies them (so it never reads the order itself)."""

    mode: str | None  # --mode: the run's mode from this step on
    inputs: bool  # --inputs
    name_filter: Callable[[str], bool] | None  # --filter, memoised per name; None: every name


@dataclass(kw_only=True)
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
    _ignored: set[str] = field(default_factory=set)  # order files ignored so far (see _ignore)
    _order_file: tuple[Path, str] | None = None  # (dump_dir, its order file's path as text)

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
            changed = self._ignore(self.dump_dir / ORDER_FILE, repr(e), step)
        if self.window is not None and self.window.finished:
            self._finish(step, "done")
            changed = True
        self._heartbeat(step)
        pending = self._pending  # only an arm order waits: a disarm acts when it is read
        if self.window is None and pending is not None and step >= pending.start_step:
            self.window = Window(order=pending, start=step)
            self._pending = None
            self._log(pending, "armed", step)
            changed = True
        return self.window, changed

    def arm_step(self, step: int) -> tuple[Armed | None, bool]:
        """At the recorder's step boundary ``step``: what this step captures if it is armed (None:
        idle), and whether the manifest's control record changed."""
        window, changed = self.at_boundary(step)
        if window is None:
            return None, changed
        order = window.order
        return Armed(order.mode, order.inputs, window.wants if order.filter else None), changed

    @property
    def needs_batches(self) -> bool:
        """The armed order names a ``--request``: each step must say its sequences (``set_batch``)."""
        return self.window is not None and self.window.order.request is not None

    def holds_request(self, batch: str) -> bool | None:
        """Whether the step whose latest ``set_batch`` stored ``batch`` (``tracedump.batch`` JSON)
        holds the armed ``--request`` sequence; None when no armed order names one."""
        window = self.window
        if window is None or window.order.request is None:
            return None
        return window.order.request in {str(s) for s in json.loads(batch)["seq_ids"]}

    def pass_dumped(self, mode: str) -> None:
        """A dumped pass of the armed window (a step without the ``--request`` sequence is not
        one): it counts towards ``--steps`` and fixes the run dir's mode (one mode per run dir)."""
        if self.window is not None:
            self.window.done += 1
        self.fixed_mode = mode

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
        order_file = self._order_file
        if order_file is None or order_file[0] != self.dump_dir:
            order_file = self._order_file = (self.dump_dir, os.fspath(self.dump_dir / ORDER_FILE))
        seen = _stamp(order_file[1])  # the text, made once: this runs at every step, armed or idle
        if seen is None or seen == self._seen:
            return False
        path = self.dump_dir / ORDER_FILE
        self._seen = seen
        try:
            order = read_order(path)
        except OrderError as e:
            return self._ignore(path, str(e), step)
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

    def _ignore(self, path: Path, reason: str, step: int) -> bool:
        """An order file this process may not obey: warned about and recorded in ``control.orders``
        once per distinct file (its reason, inode, size and content; touching it again is not
        another, but rewriting it in place with other bytes of the same length is)."""
        key = f"control_order:{reason}:{_identity(path)}"
        if key in self._ignored:
            return False
        self._ignored.add(key)
        self.warn(key, f"tracedump: ignoring {path}: {reason}")
        self.history.append(
            {
                "id": None,
                "action": "ignored",
                "event": f"ignored: {reason}",
                "step": step,
                "time": time.time(),
            }
        )
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
        child = Controller(dump_dir=self.dump_dir, run_dir=run_dir, warn=self.warn, fixed_mode=None)
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
        try:
            write_text_atomic(self.run_dir / STATE_FILE, json.dumps(state))  # 0600, like every file
        except OSError as e:
            self.warn("control_state", f"tracedump: cannot write {self.run_dir / STATE_FILE}: {e}")


# ------------------------------------------------------------------------------- the CLI's side


@dataclass(frozen=True, kw_only=True)
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
            data = json.loads(read_state_bytes(path))
            if not isinstance(data, dict):
                continue
            when, step, rate = data["time"], data["step"], data.get("rate") or 0.0
        except (OSError, ValueError, KeyError, TypeError, RecursionError):
            continue
        _check_heartbeat(path, when, step, rate)
        age = now - float(when)
        if data.get("state") == "closed":
            continue
        if 0 <= age < STALE_SECONDS or _alive_here(data):  # an idle server steps no boundary
            found.append(
                Watcher(
                    run_dir=path.parent,
                    step=step,
                    rate=rate if age < STALE_SECONDS else 0.0,
                    age=age,
                    state=str(data.get("state", "?")),
                )
            )
    return found


def _check_heartbeat(path: Path, when: Any, step: Any, rate: Any) -> None:
    """A heartbeat the CLI can compute a start step from, or an OrderError naming the file."""

    def number(value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

    problem = None
    if not number(when) or when < 0:
        problem = f"time {when!r} is not a finite time"
    elif type(step) is not int or not 0 <= step <= MAX_STEP:
        problem = f"step {step!r} is not a step number from 0 to {MAX_STEP}"
    elif not number(rate) or not 0 <= rate <= MAX_RATE:
        problem = f"rate {rate!r} is not a step rate from 0 to {MAX_RATE:.0e} per second"
    if problem is not None:
        raise OrderError(f"{path}: a heartbeat no engine wrote: {problem}")


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
    start = max(w.step + max(MIN_LEAD_STEPS, math.ceil(w.rate * (max(w.age, 0.0) + lead))) for w in found)
    if start > MAX_STEP:
        raise OrderError(f"start step {start} is out of range (at most {MAX_STEP}): check the heartbeats")
    return start
