"""The switch: is dumping on, and the name of each setting's env var.

Why a module of its own: the off path must cost one env lookup and import nothing heavy. The
settings' sources import pydantic-settings (about half a second of every process's start-up); this
module imports only ``os``, so the vLLM plugin's ``register()`` (run in every vLLM process) and
``attach()`` with dumping off read the same variable by the same rules, from one place, for free.
``tracedump run``'s bootstrap (``launch/sitecustomize.py``) cannot even import tracedump before
torch is imported: it checks the same name, and a test holds it to :func:`env_name`.
"""

from __future__ import annotations

import os
from typing import Any

DEFAULT_ENV_PREFIX = "TRACEDUMP_"


def env_name(field: str, env_prefix: str = DEFAULT_ENV_PREFIX) -> str:
    """The env var that sets ``field``: ``env_name("dir") == "TRACEDUMP_DUMP_DIR"``."""
    return f"{env_prefix}DUMP_{field.upper()}"


def is_blank(value: Any) -> bool:
    """Empty or whitespace-only: unset, in env and config alike (neither clears a value nor lifts a gate)."""
    text = os.fspath(value) if isinstance(value, os.PathLike) else value
    return isinstance(text, str) and not text.strip()


def is_enabled(config: Any = None, env_prefix: str | None = DEFAULT_ENV_PREFIX) -> bool:
    """Is dumping on, i.e. is ``DIR`` set? The off path's whole cost: one env lookup (the name
    the settings' env source reads) and one attribute read. ``env_prefix=None`` asks ``config`` alone."""
    if env_prefix is not None and (os.environ.get(env_name("dir", env_prefix)) or "").strip():
        return True
    value = config.get("dir") if isinstance(config, dict) else getattr(config, "dir", None)
    return value is not None and not is_blank(value)
