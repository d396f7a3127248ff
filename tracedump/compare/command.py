"""``tracedump diff`` (placeholder until the comparator lands)."""

from __future__ import annotations

import argparse
from typing import Any


def add_diff_parser(sub: Any) -> None:
    parser = sub.add_parser("diff", help="compare two dumps and name the first divergent module")
    parser.add_argument("a")
    parser.add_argument("b")
    parser.set_defaults(func=run_diff)


def run_diff(args: argparse.Namespace) -> int:
    raise NotImplementedError
