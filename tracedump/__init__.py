"""tracedump: at which layer do two runs of a model first produce different numbers?

``attach(model)`` hooks the selected modules when ``TRACEDUMP_DUMP_DIR`` is set and does nothing at
all when it is not; ``tracedump diff A B`` names the first divergent module.

The names below are imported on first use (PEP 562): ``tracedump ls``, ``show`` and ``--help``
import this package too, and must start without importing torch (most of a 2 s start-up).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__

# public name -> the submodule that defines it
_EXPORTS = {
    "profiling": "dump.suspend",
    "record": "api",
    "record_step": "api",
    "Capture": "dump.capture.session",
    "ModuleCapture": "dump.capture.session",
    "capture": "dump.capture.session",
    "Graft": "dump.graft",
    "graft": "dump.graft",
    "TracedumpWarning": "dump.runtime",
    "allow_sync": "dump.cuda",
    "resolve_compile": "dump.cuda",
    "resolve_cuda_graph": "dump.cuda",
    "Dumper": "dump.dumper",
    "attach": "dump.dumper",
    "Dump": "store.loader",
    "PassFile": "store.loader",
    "Run": "store.loader",
    "load_pass": "store.loader",
    "open_dump": "store.loader",
    "DumpConfig": "config.settings",
    "DumpSettings": "config.settings",
    "TracedumpError": "errors",
    "ConfigError": "errors",
    "DumpReadError": "errors",
    "FormatVersionError": "errors",
    "UsageError": "errors",
}

# Modules that lived at the top of the package before it was split into sub-packages
# (docs/architecture.md says where each lives now). ``tracedump.loader`` still names the module it was;
# ``from tracedump.loader import ...`` does not (the import system looks for a file).
_MOVED = {
    "settings": "config.settings",
    **{
        m: f"dump.{m}"
        for m in (
            "dumper",
            "selection",
            "hooks",
            "recorder",
            "gates",
            "cuda",
            "runtime",
            "control",
            "sinks",
            "writer",
            "buffers",
            "rundir",
        )
    },
    **{m: f"store.{m}" for m in ("format", "fsio", "stformat", "loader", "sequences", "reduce")},
    **{m: f"util.{m}" for m in ("console", "units", "cpus")},
}

if TYPE_CHECKING:
    from .api import record, record_step
    from .config.settings import DumpConfig, DumpSettings
    from .dump.capture.session import Capture, ModuleCapture, capture
    from .dump.cuda import allow_sync, resolve_compile, resolve_cuda_graph
    from .dump.dumper import Dumper, attach
    from .dump.graft import Graft, graft
    from .dump.runtime import TracedumpWarning
    from .dump.suspend import profiling
    from .errors import ConfigError, DumpReadError, FormatVersionError, TracedumpError, UsageError
    from .store.loader import Dump, PassFile, Run, load_pass, open_dump


def __getattr__(name: str) -> Any:
    """Import a public name's module on first access and keep the name here for the next one.
    A submodule (``tracedump.dump``) is imported when first named, as an eager import made it."""
    module = _EXPORTS.get(name)
    if module is None:
        target = _MOVED.get(name, name)
        try:
            return importlib.import_module(f".{target}", __name__)
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{target}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


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
    "FormatVersionError",
    "Graft",
    "ModuleCapture",
    "PassFile",
    "Run",
    "TracedumpError",
    "TracedumpWarning",
    "UsageError",
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
