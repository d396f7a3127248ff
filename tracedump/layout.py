"""Names in a dump dir that writer and readers share: file names, metadata keys, statistics.

Kept free of torch (and of everything else heavy) so that ``tracedump ls``/``show`` and the loader's
header parsing start without importing torch (1.5-2 s of a 2 s start-up, measured).
"""

from __future__ import annotations

FORMAT_VERSION = "1"
ORDER_KEY = "tracedump.order"
BATCH_KEY = "tracedump.batch"
# Capture sequence numbers of a stats-mode pass file's tensors (JSON list aligned with ORDER_KEY)
SEQ_KEY = "tracedump.seq"
TRUNCATED_KEY = "tracedump.truncated"
STATS_FILE = "stats.jsonl"
STATS_PARTIAL = "stats.jsonl.partial"
MANIFEST = "manifest.json"
RECORDS_FILE = "records.safetensors"
# The statistics that are numbers (stats.jsonl values); ``shape`` and ``dtype`` are the others.
NUMERIC_STAT_NAMES = ("abs_mean", "sum", "min", "max", "mean", "std", "l2", "nan_count", "inf_count")


def dtype_name(dtype: object) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")
