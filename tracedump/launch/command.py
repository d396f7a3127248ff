"""``tracedump run`` (placeholder until the launcher lands)."""

from __future__ import annotations

import argparse
from typing import Any


def add_run_parser(sub: Any) -> None:
    parser = sub.add_parser("run", help="run a command with dumping on in every Python process")
    parser.add_argument("cmd", nargs=argparse.REMAINDER)
    parser.set_defaults(func=run_command)


def run_command(args: argparse.Namespace) -> int:
    raise NotImplementedError
