"""Stage 1, reading: open each side (dump, run dir, pass file, ranks), map its bytes zero-copy, and
say what its manifest warns of. Nothing here compares anything.
"""
