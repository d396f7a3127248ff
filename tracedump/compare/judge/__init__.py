"""Stage 4, judging: each pair's status set from its typed evidence by one function, then the
outcome (first divergence, growth, coverage, exit code).
"""
