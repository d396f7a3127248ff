"""tracedump: at which layer do two runs of a model first produce different numbers?

``attach(model)`` hooks the selected modules when ``TRACEDUMP_DUMP_DIR`` is set and does nothing at
all when it is not; ``tracedump diff A B`` names the first divergent module.

The names below are imported on first use (PEP 562): ``tracedump ls``, ``show`` and ``--help``
import this package too, and must start without importing torch (most of a 2 s start-up).
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

from ._version import __version__

# public name -> the submodule that defines it
_EXPORTS = {
    "profiling": "api",
    "record": "api",
    "record_step": "api",
    "Capture": "capture",
    "ModuleCapture": "capture",
    "capture": "capture",
    "Graft": "graft",
    "graft": "graft",
    "TracedumpWarning": "runtime",
    "allow_sync": "cuda",
    "resolve_compile": "cuda",
    "resolve_cuda_graph": "cuda",
    "Dumper": "dumper",
    "attach": "dumper",
    "Dump": "loader",
    "DumpReadError": "loader",
    "PassFile": "loader",
    "Run": "loader",
    "load_pass": "loader",
    "open_dump": "loader",
    "ConfigError": "settings",
    "DumpConfig": "settings",
    "DumpSettings": "settings",
}

if TYPE_CHECKING:
    from .api import profiling, record, record_step
    from .capture import Capture, ModuleCapture, capture
    from .cuda import allow_sync, resolve_compile, resolve_cuda_graph
    from .dumper import Dumper, attach
    from .graft import Graft, graft
    from .loader import Dump, DumpReadError, PassFile, Run, load_pass, open_dump
    from .runtime import TracedumpWarning
    from .settings import ConfigError, DumpConfig, DumpSettings


def __getattr__(name: str) -> Any:
    """Import a public name's module on first access and keep the name here for the next one.
    A submodule (``tracedump.writer``) is imported when first named, as an eager import made it."""
    module = _EXPORTS.get(name)
    if module is None:
        try:
            return importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


class _Package(types.ModuleType):
    """``tracedump.capture`` is the function, as it was when this file imported it eagerly: importing
    the submodule of the same name would otherwise put the module in its place."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and _EXPORTS.get(name) == name:
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = [
    "Capture",
    "ConfigError",
    "Dump",
    "DumpConfig",
    "DumpReadError",
    "DumpSettings",
    "Dumper",
    "Graft",
    "ModuleCapture",
    "PassFile",
    "Run",
    "TracedumpWarning",
    "__version__",
    "allow_sync",
    "attach",
    "capture",
    "graft",
    "load_pass",
    "open_dump",
    "profiling",
    "record",
    "record_step",
    "resolve_compile",
    "resolve_cuda_graph",
]
