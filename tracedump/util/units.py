"""One unit convention for every size tracedump prints: binary units, IEC labels (KiB, MiB, GiB).

The closing line of a run, ``tracedump run``'s summary and ``tracedump ls`` all print through
:func:`human_bytes`, so one dump is never "1.0 MB" in one place and "0.95 MB" in another.
"""

from __future__ import annotations


def human_bytes(n: float) -> str:
    """``512 B``, ``1.5 KiB``, ``20.0 MiB``: powers of 1024, labelled as such."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover - the loop returns at TiB
