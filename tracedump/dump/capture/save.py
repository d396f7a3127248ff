"""``Capture.save()``: what a capture kept in memory, written as a run dir that ``tracedump diff`` reads.

Why a module of its own: saving is the one place where ``capture()`` meets the file side (settings,
the run dir, the writer). It writes all of the run dir or, on any failure, none of it; the capture
session itself never touches a file.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError
from torch import nn

from ...config.settings import DumpSettings
from ...config.switch import DEFAULT_ENV_PREFIX
from ...errors import ConfigError
from ...store.format import RECORDS_FILE
from ..rundir import RunDir, model_fields
from ..runtime import Warner
from ..selection import every_name, shared_names
from ..writer import PassJob, storable

__all__ = ["Entries", "host_entries", "save_target", "write_run"]

Entries = list[tuple[str, torch.Tensor, Any]]  # (key, contiguous CPU copy, no event), as PassJob holds


def save_target(directory: str | Path) -> Path:
    """The directory :meth:`.session.Capture.save` writes under; a clear error for what cannot be one."""
    if not isinstance(directory, (str, os.PathLike)) or not str(directory).strip():
        raise ConfigError(f"save(): expected a directory path, got {directory!r}")
    target = Path(directory).expanduser()
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(20, "exists and is not a directory", str(target))
    return target


def host_entries(tensors: Mapping[str, torch.Tensor], skipped: collections.Counter[str]) -> Entries:
    """(key, contiguous CPU copy, no event) for a pass file: the writer writes host memory. A tensor
    a pass file cannot hold is counted in ``skipped["unsupported_tensor"]`` instead."""
    kept = []
    for key, tensor in tensors.items():
        if storable(tensor):
            kept.append((key, tensor.detach().to("cpu", copy=True).contiguous(), None))
        else:
            skipped["unsupported_tensor"] += 1
    return kept


def write_run(
    target: Path,
    *,
    model: nn.Module,
    captured: list[tuple[str, nn.Module]],
    passes: list[tuple[int, Entries]],
    loose: Entries,
    skipped: Mapping[str, int],
    warn: Warner,
) -> Path:
    """The run dir of :meth:`.session.Capture.save` under ``target``: all of it, or (on any failure)
    none of it.

    ``captured`` are the (recorder key, module) pairs the manifest describes; ``passes`` one entry
    list per run; ``loose`` what was recorded outside every run (``records.safetensors``)."""
    try:
        settings = DumpSettings.model_validate({"dir": str(target)})  # no env: this is a script's call
    except ValidationError as e:
        raise ConfigError(f"save({str(target)!r}): {e.errors()[0]['msg'].splitlines()[-1].strip()}") from None
    shared = shared_names(every_name(model), captured)
    fields = model_fields(model, type(model).__name__, captured, shared)

    def quiet_write_error(key: str, message: str) -> None:  # raised below, not warned
        if key != "write_error":
            warn(key, message)

    try:
        rundir = RunDir(settings, DEFAULT_ENV_PREFIX, fields, quiet_write_error)  # type: ignore[arg-type]
    except ConfigError as e:
        raise OSError(f"save({str(target)!r}): {str(e).splitlines()[-1].strip()}") from None
    try:
        for index, entries in passes:
            rundir.writer.submit(PassJob(index=index, part=None, mode="full", entries=entries, nbytes=0))
        if loose:
            rundir.writer.submit(
                PassJob(index=-1, part=None, mode="records", entries=loose, nbytes=0, file_name=RECORDS_FILE)
            )
        rundir.writer.close()
        if rundir.failure is not None:
            raise OSError(f"save(): {rundir.failure}; nothing was saved")
        rundir.finish(skipped, records_file=RECORDS_FILE if loose else None)
    except BaseException:
        rundir.writer.close()
        rundir.discard()
        raise
    return rundir.path
