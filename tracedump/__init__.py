"""tracedump: at which layer do two runs of a model first produce different numbers?

``attach(model)`` hooks the selected modules when ``TRACEDUMP_DUMP_DIR`` is set and does nothing at
all when it is not; ``tracedump diff A B`` names the first divergent module.
"""

from ._version import __version__
from .api import profiling, record, record_step
from .capture import Capture, ModuleCapture, capture
from .cuda import TracedumpWarning, allow_sync, resolve_compile, resolve_cuda_graph
from .dumper import Dumper, attach
from .loader import Dump, DumpReadError, PassFile, Run, load_pass, open_dump
from .settings import ConfigError, DumpConfig, DumpSettings

__all__ = [
    "Capture",
    "ConfigError",
    "Dump",
    "DumpConfig",
    "DumpReadError",
    "DumpSettings",
    "Dumper",
    "ModuleCapture",
    "PassFile",
    "Run",
    "TracedumpWarning",
    "__version__",
    "allow_sync",
    "attach",
    "capture",
    "load_pass",
    "open_dump",
    "profiling",
    "record",
    "record_step",
    "resolve_compile",
    "resolve_cuda_graph",
]
