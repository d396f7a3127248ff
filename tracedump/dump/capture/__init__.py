"""In-memory capture of module inputs and outputs for scripts and notebooks (docs/capture.md)::

    with tracedump.capture(model, outputs=["model.layers.0"], early_exit=True, device="cpu") as cap:
        cap.run(**batch)                  # model output, or None when cut short
    cap["model.layers.0"].outputs         # one entry per forward
    cap.save("/tmp/ref")                  # a dump `tracedump diff` reads

It runs the recorder ``attach()`` runs, with a memory sink: same hooks, same keys, same copies.
Four parts, each on its own seam: :mod:`.spec` (what to capture: names, spec strings, filters),
:mod:`.session` (the ``with`` block: hooks, runs, early exit), :mod:`.rebuild` (the structured view
of a module's output from the flat copies) and :mod:`.save` (the dump on disk).
"""

from __future__ import annotations

from .session import Capture, ModuleCapture, capture
from .spec import CaptureSpec, parse_spec

__all__ = ["Capture", "CaptureSpec", "ModuleCapture", "capture", "parse_spec"]
