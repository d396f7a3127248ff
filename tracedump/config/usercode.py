"""User code named by the settings (``FILTER_FN``, ``SYNC_ESCAPE``): imported here and nowhere else.

Importing a ``pkg.module:func`` or ``/path/file.py:func`` runs the user's code, which may print,
fail or call ``sys.exit()``; so it happens once, at ``attach()``
(:meth:`tracedump.config.settings.DumpSettings.resolve_callables`), never while settings are built,
and every failure comes back as a ValueError for the caller to name the setting.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class UserCallables:
    """``FILTER_FN`` and ``SYNC_ESCAPE`` imported: see :meth:`.settings.DumpSettings.resolve_callables`."""

    filter_fn: Callable[[str, Any], Any] | None = None
    sync_escape: Callable[[], AbstractContextManager[Any]] | None = None


def load_callable(spec: str) -> Callable[..., Any]:
    """Import a ``"pkg.module:func"`` or ``"/path/file.py:func"`` spec and return the callable."""
    module_part, _, attr = spec.rpartition(":")
    if module_part.endswith(".py"):
        module = _import_file(module_part)
    else:
        try:
            module = importlib.import_module(module_part)
        except (Exception, SystemExit) as e:  # a module that calls sys.exit() must not end the host
            raise ValueError(f"cannot import module {module_part!r}: {type(e).__name__}: {e}") from e
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{module_part!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{attr!r} in {module_part!r} is not callable (it is {type(obj).__name__})")
    return obj


@cache
def _import_file(path: str) -> Any:
    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"file {path!r} does not exist")
    module_name = f"_tracedump_user_{abs(hash(str(file.resolve())))}"
    spec = importlib.util.spec_from_file_location(module_name, file)  # never None for a .py file
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    except (Exception, SystemExit) as e:  # a file that calls sys.exit() must not end the host
        sys.modules.pop(module_name, None)
        raise ValueError(f"importing {path!r} failed: {type(e).__name__}: {e}") from e
    return module
