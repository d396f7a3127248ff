"""The one compiled part: the comparator's one-pass sums (tracedump/compare/kernel.c).

Optional: where it does not build (no C compiler, no Python headers), the install goes on and
the comparator uses its numpy path, which gives the same results more slowly.
"""

import sys

from setuptools import Extension, setup

_FLAGS = [] if sys.platform == "win32" else ["-O3", "-std=c99"]

setup(
    ext_modules=[
        Extension(
            "tracedump.compare.kernel",
            ["tracedump/compare/kernel.c"],
            extra_compile_args=_FLAGS,
            optional=True,
        )
    ]
)
