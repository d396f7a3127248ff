"""The one compiled part: the one-pass sums (the comparator and stats dumps) (tracedump/util/kernel.c).

Optional: where it does not build (no C compiler, no Python headers), the install goes on and
the comparator uses its numpy path, which gives the same results more slowly.
"""

import sys

from setuptools import Extension, setup

# No contraction of a * b + c into FMA: the same sums, to the bit, whichever of the CPU-specific
# builds the loader picks (gcc's -std=c99 implies it; clang's default does not).
_FLAGS = [] if sys.platform == "win32" else ["-O3", "-std=c99", "-ffp-contract=off"]

setup(
    ext_modules=[
        Extension(
            "tracedump.util.kernel",
            ["tracedump/util/kernel.c"],
            extra_compile_args=_FLAGS,
            optional=True,
        )
    ]
)
