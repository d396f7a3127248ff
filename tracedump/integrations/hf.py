"""Moved: the HF batch layout is :mod:`tracedump.dump.hf_layout` (the dump side picks it for every
transformers model). This name is kept so that ``from tracedump.integrations.hf import ...`` still
works."""

from __future__ import annotations

from ..dump.hf_layout import HFBatchLayout, batch_layout_for, is_transformers_model

__all__ = ["HFBatchLayout", "batch_layout_for", "is_transformers_model"]
