"""Stage 3, measuring: one planned pair at a time, read and measured (errors in chunks, stats
records, MoE routing, a grafted run's fp32 shadow). Measures only: no status is set here.
"""
