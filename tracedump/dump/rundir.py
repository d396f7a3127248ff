"""The run directory ``<dir>/rank<R>_pid<P>/``: claiming it, its rank, fork, exit, the manifest.

Everything that can fail here at ``attach()`` fails before any hook exists and removes what it
made, so a bad dump dir leaves the model as it was. Everything that fails later is kept in the
manifest's error registry (where, type, first message, count) and warned about once.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime as dt
import importlib.metadata
import os
import platform
import shutil
import signal
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._version import __version__
from ..config.settings import DumpSettings
from ..errors import ConfigError
from ..store.format import FORMAT_VERSION, MANIFEST, ErrorEntry, run_dir_name
from ..store.fsio import SpaceReserve, json_text, move_into_place, probe_writable, write_json_atomic
from ..util.units import human_bytes
from .runtime import Warner
from .writer import MANIFEST_RESERVE, Writer, reserve_for

# Skips the settings asked for: reported in the summary, not warned about.
INTENDED_SKIPS = frozenset({"token_gate", "row_gate", "outside_pass", "profile"})
MAX_ERRORS_KEPT = 20  # distinct (where, type) pairs kept in the manifest's "errors"
MAX_ERROR_MESSAGE = 1000  # characters of an error's first message kept: the manifest's room is reserved
WORKER_NOT_CLOSED = (
    "not closed: a multiprocessing worker (a Pool may terminate it before it exits); each pass "
    "listed here was flushed when its forward returned"
)


_INTERRUPTED_AT_EXIT: list[bool] = []  # a dumper's flush at exit was cut by Ctrl-C
_EXIT_HOOK: list[bool] = []


def _leave_as_interrupted() -> None:
    """Registered before the first dumper's close, so it runs after every dumper's: a process whose
    flush at exit was interrupted leaves as Python leaves on Ctrl-C (killed by SIGINT), not 0."""
    if _INTERRUPTED_AT_EXIT:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)


def rank_and_world() -> tuple[int, int, bool]:
    """Rank and world size from RANK/WORLD_SIZE, else torch.distributed, else (0, 1).

    The third value says the rank is only a guess (no env var, no process group yet): an engine may
    attach before ``init_process_group``, so the run dir settles it at the first pass.
    """
    rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    dist = torch.distributed
    initialised = dist.is_available() and dist.is_initialized()
    provisional = rank is None and not initialised
    if rank is None:
        rank = str(dist.get_rank()) if initialised else "0"
    if world is None:
        world = str(dist.get_world_size()) if initialised else "1"
    return int(rank), int(world), provisional


def run_precision(model: nn.Module) -> dict[str, Any]:
    """What the comparator needs to judge this run's numbers: the dtypes its parameters hold, and
    whether fp32 matmuls on CUDA may run in TF32 (a 10-bit mantissa in an fp32 run)."""
    counts: dict[str, int] = {}
    devices: set[str] = set()
    for param in model.parameters():
        name = str(param.dtype).removeprefix("torch.")
        counts[name] = counts.get(name, 0) + param.numel()
        devices.add(param.device.type)
    on_cuda = "cuda" in devices
    tf32 = on_cuda and (
        torch.get_float32_matmul_precision() != "highest" or bool(torch.backends.cuda.matmul.allow_tf32)
    )
    return {
        "parameters": counts,
        "devices": sorted(devices),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "tf32": tf32,
    }


def framework_of(model: nn.Module) -> tuple[str, str | None]:
    """The package the model's class comes from and its version: ``("transformers", "5.24.0")``,
    ``("vllm", "0.32.0")``, ``("torch", ...)`` for a plain ``nn.Module`` subclass.

    The first class of the MRO whose top-level package has a version (its ``__version__``, else its
    distribution's) names it, so a script's ``class MyLM(PreTrainedModel)`` is ``transformers`` and
    ``class Port(nn.Module)`` in ``__main__`` is ``torch``. The comparator's bridges choose their
    rules by it. Runs once, at ``attach()``; imports nothing (the package is already loaded)."""
    for cls in type(model).__mro__:
        top = (getattr(cls, "__module__", None) or "").partition(".")[0]
        if not top or top in ("builtins", "__main__"):
            continue
        version = _package_version(top)
        if version is not None:
            return top, version
    return "torch", torch.__version__


def _package_version(top: str) -> str | None:
    version = getattr(sys.modules.get(top), "__version__", None)
    if isinstance(version, str):
        return version
    try:
        return importlib.metadata.version(top)
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return None


def model_fields(
    model: nn.Module,
    root: str,
    modules: Sequence[tuple[str, nn.Module]],
    shared: Mapping[str, list[str]] | None = None,
) -> dict[str, Any]:
    """The manifest's description of what was dumped: ``attach()`` and ``capture().save()`` alike.

    ``module_classes`` names each captured module's class, under each name its captures may carry
    (``shared``: a module with several names): ``SiluAndMul`` against ``SiLU`` under one name is
    no pair the comparator may measure."""
    framework, version = framework_of(model)
    shared = shared or {}
    classes: dict[str, str] = {}
    for name, module in modules:
        for alias in shared.get(name, [name]):
            classes.setdefault(alias, type(module).__qualname__)
    return {
        "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
        "framework": framework,
        "framework_version": version,
        "root": root,
        "modules": [name for name, _ in modules],
        "module_classes": classes,
        "shared_modules": {name: list(aliases) for name, aliases in shared.items()},
        "precision": run_precision(model),
        "attention": attention_masks(model),
    }


def attention_masks(model: nn.Module) -> dict[str, Any]:
    """Whether every attention of ``model`` is causal, as its modules declare it (HF attention's
    ``is_causal``; vLLM's ``attn_type``, ``"decoder"`` being causal): ``causal`` true when some
    declare it and none declares otherwise, false when one declares a bidirectional or cross
    attention, None when none says. The comparator reads it to know which tokens a near-tie routing
    flip cannot reach (under a causal mask, the positions before the first flipped one)."""
    causal, other = 0, []
    for name, module in model.named_modules():
        flag = _declared_causal(module)
        if flag is True:
            causal += 1
        elif flag is False:
            other.append(name)
    verdict = None if not causal and not other else not other
    return {"causal": verdict, "causal_modules": causal, "not_causal": other[:8]}


def _declared_causal(module: nn.Module) -> bool | None:
    flag = module.__dict__.get("is_causal", getattr(type(module), "is_causal", None))
    if isinstance(flag, bool):
        return flag
    kind = module.__dict__.get("attn_type")
    if kind is not None:
        return str(getattr(kind, "value", kind)) == "decoder"
    return None


class ErrorLog:
    """Every distinct run-time error: where, type, its first message, how often."""

    def __init__(self) -> None:
        self._entries: dict[tuple[str, str], ErrorEntry] = {}

    def add(self, where: str, kind: str, message: str) -> None:
        entry = self._entries.get((where, kind))
        if entry is not None:
            entry["count"] += 1
        elif len(self._entries) < MAX_ERRORS_KEPT:
            message = message[:MAX_ERROR_MESSAGE]
            self._entries[(where, kind)] = {"where": where, "type": kind, "message": message, "count": 1}

    def as_list(self) -> list[ErrorEntry]:
        return [ErrorEntry(**entry) for entry in self._entries.values()]


class RunDir:
    """One process's run dir and the manifest in it."""

    def __init__(self, settings: DumpSettings, env_prefix: str, fields: dict[str, Any], warn: Warner) -> None:
        self._settings = settings
        self._env_prefix = env_prefix
        self._fields = fields  # what the dumper knows of itself: model class, root, modules, precision
        self._warn = warn
        self.rank, self.world_size, self.rank_provisional = rank_and_world()
        self.pid = os.getpid()
        self._close: Callable[[], None] | None = None
        self._start()

    def _start(self) -> None:
        self.failure: str | None = None
        self.cut: str | None = None  # a step that raised: its pass is cut short (cut_short)
        self.errors = ErrorLog()
        self.path = self._make()
        try:
            self.writer = self._start_writer()
        except Exception as e:
            self._remove()
            where = self._settings.describe("dir")
            raise ConfigError(
                f"tracedump: bad setting\n  {where}: cannot write the manifest: {type(e).__name__}: {e}"
            ) from e

    # ------------------------------------------------------------------ the directory

    def _claim(self, base: Path) -> Path:
        """Create ``rank<R>_pid<P>``, or ``-2``, ``-3``... if taken. The mkdir is the claim: a second
        dumper in this process, or a process with the same pid on a shared disk (containers),
        never writes into a dir another one made."""
        serial = 1
        while True:
            path = base / run_dir_name(self.rank, self.pid, serial)
            try:
                path.mkdir(mode=0o700)
            except FileExistsError:
                serial += 1
                continue
            os.chmod(path, 0o700)
            return path

    def _make(self) -> Path:
        base = Path(self._settings.dir).expanduser()  # type: ignore[arg-type]
        self._made: list[Path] = []  # the dirs this call created, deepest last
        path: Path | None = None
        try:
            self._made_dirs(base)
            path = self._claim(base)
            probe_writable(path)
        except OSError as e:  # a name too long (ENAMETOOLONG), no permission, a full disk
            if path is not None:
                shutil.rmtree(path, ignore_errors=True)
            self._remove_made()
            where = self._settings.describe("dir")
            raise ConfigError(
                f"tracedump: bad setting\n  {where}: cannot create or write the dump "
                f"directory: {type(e).__name__}: {e}"
            ) from e
        return path

    def _remove(self) -> None:
        """Undo :meth:`_make` after a failed attach: an empty run dir would be listed (and picked by
        ``open_dump().run()``) ahead of the real one."""
        shutil.rmtree(self.path, ignore_errors=True)
        self._remove_made()

    def _made_dirs(self, base: Path) -> None:
        """Create ``base`` and its missing parents (``base`` itself ``0700``), noting each one made,
        so that a failure later in :meth:`_make` leaves none of them behind."""
        missing = []
        probe = base
        while not probe.exists():  # raises for a name too long: nothing is created then
            missing.append(probe)
            probe = probe.parent
        for directory in reversed(missing):
            try:
                directory.mkdir(mode=0o700 if directory == base else 0o777)
            except FileExistsError:  # another rank may create it meanwhile
                continue
            self._made.append(directory)
        if base in self._made:
            os.chmod(base, 0o700)

    def _remove_made(self) -> None:
        for directory in reversed(self._made):
            with contextlib.suppress(OSError):
                directory.rmdir()  # only if still empty: another rank may be using it
        self._made = []

    def discard(self) -> None:
        """Remove the run dir after a failed :meth:`tracedump.Capture.save`: a half-written dump
        would be refused by ``diff`` and push the next save to a ``-2`` name."""
        self.writer.drop_reserve()
        self._remove()

    def settle_rank(self) -> None:
        """Attached before ``init_process_group`` with no RANK env var: take the group's rank now,
        before the first pass, so that every rank does not write a ``rank0`` dir."""
        self.rank_provisional = False
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            return
        rank, world = dist.get_rank(), dist.get_world_size()
        if rank != self.rank:
            previous, self.rank = self.rank, rank
            try:
                moved = self._claim(self.path.parent)
                move_into_place(self.path, moved)  # replaces the empty dir just claimed
            except OSError as e:
                self.rank = previous
                self.report("moving the run dir to its rank", e)
                return
            self.path = self.writer.run_dir = moved
            if self.writer.reserve is not None:  # moved with its folder: removed from there at close
                self.writer.reserve.path = moved / MANIFEST_RESERVE
        self.world_size = world
        self.update(rank=self.rank, world_size=world)

    def rebind_after_fork(self) -> None:
        """A forked child inherits the hooks but not the writer thread: it gets its own dir and
        writer. Raises :class:`ConfigError` when it cannot (the dump dir is gone, say)."""
        self.pid = os.getpid()
        self._start()
        if self._close is not None:
            self.close_at_exit(self._close)

    # ------------------------------------------------------------------ exit

    def close_at_exit(self, close: Callable[[], None]) -> None:
        """Close at interpreter exit. Forked multiprocessing workers leave through ``os._exit``,
        which skips atexit but runs multiprocessing's finalizers, so register there too."""
        self._close = close
        if not _EXIT_HOOK:
            _EXIT_HOOK.append(True)
            atexit.register(_leave_as_interrupted)
        atexit.register(self._close_at_exit)
        mp_util = sys.modules.get("multiprocessing.util")
        if mp_util is not None:
            mp_util.Finalize(self, close, exitpriority=10)

    def _close_at_exit(self) -> None:
        """Close at exit; Ctrl-C during it is recorded by close() (manifest, stderr), and the exit
        status says so once every dumper has closed (:func:`_leave_as_interrupted`)."""
        if self._close is None:
            return
        try:
            self._close()
        except KeyboardInterrupt:
            _INTERRUPTED_AT_EXIT.append(True)

    def forget_exit(self) -> None:
        if self._close is not None:
            atexit.unregister(self._close_at_exit)

    # ------------------------------------------------------------------ the manifest

    def _start_writer(self) -> Writer:
        manifest = {
            "format": FORMAT_VERSION,
            "tracedump_version": __version__,
            "torch_version": torch.__version__,
            "python_version": platform.python_version(),
            "settings": self._settings.summary(),
            "env_prefix": self._env_prefix,
            **self._fields,
            "pid": self.pid,
            "rank": self.rank,
            "world_size": self.world_size,
            "hostname": socket.gethostname(),
            "argv": list(sys.argv),
            "start_time": dt.datetime.now(dt.timezone.utc).isoformat(),
            "complete": False,
            "incomplete_reason": None,
            "skipped": {},
            "truncated_passes": [],
            "errors": [],
            "anomalies": {},
        }
        write_json_atomic(self.path / MANIFEST, manifest)  # raises: no room for the manifest is refused
        reserve = self._reserve(len(json_text(manifest)))
        writer = Writer(self.path, self._settings.max_pending_bytes, manifest, self._on_write_error, reserve)
        writer.write_manifest()
        return writer

    def _reserve(self, manifest_bytes: int) -> SpaceReserve | None:
        """The space kept for the manifest's last version: as much as the disk (and a file size
        limit) allows now; none where the file cannot even be made."""
        try:
            reserve = SpaceReserve(self.path / MANIFEST_RESERVE)
        except OSError:
            return None
        reserve.hold_what_fits(reserve_for(manifest_bytes))
        return reserve

    @property
    def manifest(self) -> dict[str, Any]:
        return self.writer.manifest

    def update(self, **fields: Any) -> bool:
        """Change manifest fields and write the manifest atomically; True when it is on disk."""
        return self.writer.write_manifest(**fields)

    def note(self, **fields: Any) -> None:
        """Change manifest fields now, written with the next due write (at most once a second)."""
        self.writer.note_manifest(**fields)

    def report(self, where: str, error: BaseException) -> None:
        """A run-time failure: kept in the manifest's registry, warned about once per dumper."""
        kind, message = type(error).__name__, str(error)
        self.errors.add(where, kind, message)
        self._warn(
            "run_error",
            f"tracedump: capture failed at {where}: {kind}: {message}. The model continues; every "
            "distinct failure is kept in the manifest's 'errors', with its count.",
        )

    def cut_short(self, index: int, error: BaseException) -> None:
        """A step raised (the engine's forward failed, Ctrl-C): its pass holds part of a forward
        (``truncated_passes``). The manifest says the dump is incomplete, why, and keeps the error
        in ``errors``, whether or not the process gets to close the dump."""
        kind, message = type(error).__name__, str(error) or type(error).__name__
        self.errors.add(f"step {index}", kind, message)
        if self.cut is None:
            self.cut = f"step {index} raised {kind}: {message[:300]} (its pass is cut short: truncated)"
        self.update(complete=False, incomplete_reason=self.failure or self.cut, errors=self.errors.as_list())

    def _on_write_error(self, failure: str) -> None:
        self.failure = failure
        self.errors.add("writer", "WriteError", failure)
        landed = self.update(complete=False, incomplete_reason=failure, errors=self.errors.as_list())
        self._warn(
            "write_error",
            f"tracedump: {failure}. Dumping stopped; the model continues. " + self._manifest_says(landed),
        )

    def _manifest_says(self, landed: bool) -> str:
        """What the manifest on disk says now, for a line on stderr that must be true."""
        if landed:
            return f"{self.path / MANIFEST} is marked incomplete."
        return (
            f"{self.path / MANIFEST} could not be updated either ({self.writer.manifest_error}): "
            "it does not say that the dump is incomplete, nor what it lost."
        )

    def abandon_writes(self, error: BaseException) -> None:
        """The flush at close was interrupted: drop what is still queued, record why and how much."""
        before = self.writer.totals.dropped_jobs
        reason = (
            f"interrupted ({type(error).__name__}) during the flush at exit (or close()): the pass "
            "files not yet on disk were dropped (skipped.dropped_files)"
        )
        self.writer.abandon(reason)
        self.failure = reason
        self.errors.add("writer", type(error).__name__, reason)
        lost = self.writer.totals.dropped_jobs - before
        print(f"tracedump: {self.path}: {reason}: {lost} files lost", file=sys.stderr)

    def flush_for_termination(self, skipped: Mapping[str, int]) -> None:
        """In a multiprocessing worker, write the pass before its forward returns.

        ``with Pool(...)`` ends with ``terminate()``: SIGTERM to every worker, which skips atexit
        and multiprocessing's finalizers, so a pass still queued for the writer thread would be
        lost and the manifest would list none. Here the pass is on disk, and listed, when the
        task's forward returns; the manifest says why it may stay unclosed."""
        self.writer.flush()
        if self.failure is None:
            self.update(incomplete_reason=WORKER_NOT_CLOSED, skipped=dict(skipped))

    def finish(self, skipped: Mapping[str, int], *, records_file: str | None) -> None:
        """The closing manifest and the one-line summary on stderr (the writer is closed)."""
        totals = self.writer.totals
        skipped = dict(skipped)
        if totals.dropped_jobs:
            skipped["dropped_files"] = totals.dropped_jobs
            skipped["dropped_captures"] = totals.dropped_captures
            skipped["dropped_bytes"] = totals.dropped_bytes
        landed = self.update(
            complete=self.failure is None and self.cut is None,
            incomplete_reason=self.failure or self.cut,
            skipped=skipped,
            errors=self.errors.as_list(),
            end_time=dt.datetime.now(dt.timezone.utc).isoformat(),
            records_file=records_file,
        )
        self.writer.drop_reserve()  # a killed process leaves it; a closed one holds no space
        print(
            f"tracedump: {self.path}: {len(totals.passes)} passes, {human_bytes(totals.bytes)}"
            + (f"; skipped {skipped}" if skipped else "")
            + ("" if landed else f"; {self._manifest_says(False)}"),
            file=sys.stderr,
        )
        losses = {k: v for k, v in skipped.items() if k not in INTENDED_SKIPS}
        if losses and self.failure is None:
            self._warn(
                "skipped", f"tracedump: {self.path}: captures lost: {losses} (see manifest.json 'skipped')"
            )
