"""Reading what someone else could have written: bounded bytes, strict JSON, one-line errors.

Every file tracedump reads but did not necessarily write (a manifest, ``stats.jsonl``, a heartbeat,
``correspondence.json``, a bridge rule file, a safetensors header's JSON) goes through here, so
that a crafted or damaged file is one message naming the file and the field, never a traceback
later:

- :func:`read_limited` opens without blocking (a FIFO under a file's name would block every reader
  forever), refuses anything but a regular file (``/dev/zero`` behind a link would fill memory) and
  reads at most a cap, so a huge file is refused, not cut;
- :func:`loads` parses JSON whose non-finite numbers (``NaN``, ``Infinity``, ``1e400``) become the
  strings ``"nan"``, ``"inf"``, ``"-inf"`` (what tracedump writes for them: a report stays strict
  JSON), whose integers longer than :data:`MAX_INT_DIGITS` digits stay text (Python refuses to
  convert them), and which is at most :data:`MAX_DEPTH` levels deep;
- :func:`validation_problem` turns a pydantic ``ValidationError`` into ``field 'a.b': ...``.

The limits are documented in docs/file-format.md ("Limits a reader enforces").
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import DumpReadError, LimitError

if TYPE_CHECKING:
    from pydantic import ValidationError

MAX_DEPTH = 32  # nesting of any JSON tracedump reads (a manifest's deepest record is 6 levels)
MAX_INT_DIGITS = 4300  # Python's own limit for int(str): longer JSON integers are kept as text
MAX_SHOWN = 60  # characters of a bad value quoted in a message
_CHUNK = 1 << 20


def read_limited(path: Path, limit: int) -> bytes:
    """``path``'s bytes: a regular file (links followed) of at most ``limit`` bytes. Raises OSError
    when it cannot be opened or read, :class:`LimitError` for a FIFO, device or directory, or a file
    larger than ``limit``. Opened with ``O_NONBLOCK`` so a FIFO is seen as one, never waited on."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise LimitError("not a regular file")
        if os.fstat(fd).st_size > limit:
            raise LimitError(f"larger than {limit} bytes")
        chunks, total = [], 0
        while total <= limit:  # in chunks: read(limit) would allocate the whole cap up front
            chunk = handle.read(min(_CHUNK, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    if total > limit:
        raise LimitError(f"larger than {limit} bytes")
    return b"".join(chunks)


def read_json_file(path: Path, limit: int) -> Any:
    """A JSON file of a run (a manifest, ``correspondence.json``): :func:`read_limited` and
    :func:`loads`, every failure one :class:`DumpReadError` naming the file."""
    try:
        return loads(read_limited(path, limit))
    except OSError as e:
        raise DumpReadError(f"{path}: cannot read ({e.strerror or e})") from e
    except LimitError as e:
        raise DumpReadError(f"{path}: {e}") from e
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise DumpReadError(f"{path}: not valid JSON ({type(e).__name__}: {e})") from e


def _constant(name: str) -> str:
    return {"NaN": "nan", "Infinity": "inf", "-Infinity": "-inf"}[name]


def _float(text: str) -> float | str:
    value = float(text)
    if math.isfinite(value):
        return value
    return "inf" if value > 0 else "-inf"  # 1e400: beyond a float64


def _int(text: str) -> int | str:
    return int(text) if len(text) <= MAX_INT_DIGITS else text


def loads(text: str | bytes, depth: int | None = MAX_DEPTH) -> Any:
    """Strict JSON as tracedump reads it (see the module docstring). Raises ValueError (a
    ``JSONDecodeError``, a ``UnicodeDecodeError``, or :class:`LimitError` for nesting deeper than
    ``depth``; None: a reader whose typed model bounds the depth itself, the parser's recursion
    limit still applies)."""
    try:
        try:
            value = json.loads(text, parse_constant=_constant, parse_float=_float)
        except ValueError as e:
            if "digits" not in str(e) or isinstance(e, json.JSONDecodeError):
                raise
            # an integer beyond Python's conversion limit: parsed again, each integer by hand (the
            # fast path leaves integers to the C scanner: a header holds thousands)
            value = json.loads(text, parse_constant=_constant, parse_float=_float, parse_int=_int)
    except RecursionError as e:
        raise LimitError(f"nested more than {depth or 'a thousand'} levels deep") from e
    if depth is not None:
        check_depth(value, depth)
    return value


def check_depth(value: Any, depth: int = MAX_DEPTH) -> None:
    """Raise :class:`LimitError` when ``value`` (parsed JSON or TOML) nests deeper than ``depth``."""
    level = [value]
    for _ in range(depth + 1):
        level = [
            item
            for node in level
            if isinstance(node, (dict, list))
            for item in (node.values() if isinstance(node, dict) else node)
            if isinstance(item, (dict, list))
        ]
        if not level:
            return
    raise LimitError(f"nested more than {depth} levels deep")


def shown(value: Any) -> str:
    """A value as a message quotes it: its repr, cut to :data:`MAX_SHOWN` characters."""
    text = repr(value)
    return text if len(text) <= MAX_SHOWN else text[: MAX_SHOWN - 3] + "..."


def validation_problem(error: ValidationError, data: Any) -> str:
    """The first problem of a pydantic validation as one line: ``field 'graft.modules': expected
    a list, got 7``. The path is the keys and indices found in ``data`` (pydantic's union tags
    dropped)."""
    first = error.errors(include_url=False)[0]
    path: list[str] = []
    node = data
    for part in first["loc"]:
        if (isinstance(node, dict) and part in node) or (
            isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node)
        ):
            node = node[part]
        else:
            break
        path.append(f"[{part}]" if isinstance(part, int) else ("." if path else "") + str(part))
    if first["type"] == "missing" and len(path) < len(first["loc"]):  # name the absent key itself
        part = first["loc"][len(path)]
        path.append(f"[{part}]" if isinstance(part, int) else ("." if path else "") + str(part))
    where = "".join(path) or "(the whole file)"
    message = str(first["msg"]).removeprefix("Value error, ")
    if message.startswith("Input should be "):  # "a valid dictionary or instance of Graft": a dict
        message = "expected " + re.sub(r" or instance of \w+", "", message.removeprefix("Input should be "))
    got = "" if first["type"] == "missing" else f", got {shown(node)}"
    return f"field {where!r}: {message}{got}"


def validated(validate: Callable[[Any], Any], data: Any, fail: Callable[[str], Exception]) -> Any:
    """``validate(data)``, a pydantic validation, with its first problem raised as ``fail(line)``."""
    from pydantic import ValidationError

    try:
        return validate(data)
    except ValidationError as e:
        raise fail(validation_problem(e, data)) from None
