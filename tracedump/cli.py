"""The ``tracedump`` command: ``ls``, ``show``, ``diff``, ``run``.

Each subcommand imports what it needs when it runs, so ``import tracedump`` stays light.
Exit codes: 0 ok, 1 a divergence (``diff``), 2 a usage error or unreadable input.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .compare.display import console
from .units import human_bytes

EXIT_OK, EXIT_DIVERGED, EXIT_USAGE = 0, 1, 2


class _Parser(argparse.ArgumentParser):
    """argparse exits with 2 on usage errors, which is the exit code we document for them too."""


def cmd_ls(args: argparse.Namespace) -> int:
    """Runs, passes, tensors and bytes of a dump."""
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    from .loader import open_dump

    dump = open_dump(args.dir)
    table = Table(title=escape(f"tracedump {dump.path}"))
    for column in ("run", "rank", "pid", "passes", "tensors", "bytes", "complete", "root"):
        table.add_column(column, justify="right" if column in ("passes", "tensors", "bytes") else "left")
    for run in dump.runs:
        passes = run.passes
        tensors = sum(len(p) for p in passes.values())
        size = run.disk_bytes  # pass files, records and stats.jsonl: a stats dump is not 0 B
        stats = run.stats()  # stats mode: one record per tensor, beside any whole-stored records
        tensors += len(stats)
        table.add_row(
            Text(run.name),
            str(run.rank),
            str(run.pid),
            str(len(set(passes) | {s.get("pass") for s in stats})),
            str(tensors),
            human_bytes(size),
            "yes" if run.complete else "no",
            Text(run.root),  # the model this run followed: tells several roots of one process apart
        )
    console().print(table)
    return EXIT_OK


def cmd_show(args: argparse.Namespace) -> int:
    """Name, shape, dtype and simple statistics of each tensor of a pass, in capture order."""
    import torch
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    from .loader import load_pass, open_pass
    from .reduce import dtype_name

    pattern = re.compile(args.filter) if args.filter else None
    # A .pt file of {name: tensor} is read as `diff` reads it; a pass file lazily, one tensor at a time.
    tensors = load_pass(args.passfile) if args.passfile.suffix == ".pt" else open_pass(args.passfile)
    table = Table(title=escape(str(args.passfile)))
    for column in ("name", "shape", "dtype", "min", "max", "mean", "abs_mean"):
        table.add_column(column, justify="left" if column in ("name", "dtype") else "right")
    for name in list(tensors):
        if pattern and not pattern.search(name):
            continue
        tensor = tensors[name]
        table.add_row(
            Text(name),  # not markup: `model[last_hidden_state]` keeps its brackets
            str(list(tensor.shape)),
            dtype_name(tensor.dtype),
            *_summary_cells(tensor, torch),
        )
    console().print(table)
    return EXIT_OK


def _summary_cells(tensor: Any, torch: Any) -> list[str]:
    """min, max, mean, abs_mean as text; ``-`` for a dtype torch cannot widen (float4, bits)."""
    try:
        values = tensor.double() if tensor.numel() else torch.zeros(1, dtype=torch.float64)
        stats = (values.min(), values.max(), values.mean(), values.abs().mean())
        return [f"{value.item():.4g}" for value in stats]
    except (NotImplementedError, RuntimeError, TypeError):
        return ["-"] * 4


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tracedump", description="Find the first layer where two runs of a model diverge.")
    sub = parser.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("ls", help="list the runs and passes of a dump")
    ls.add_argument("dir", type=Path)
    ls.set_defaults(func=cmd_ls)
    show = sub.add_parser("show", help="show the tensors of one pass file")
    show.add_argument("passfile", type=Path)
    show.add_argument("--filter", help="regex on tensor names (re.search)")
    show.set_defaults(func=cmd_show)
    from .compare.command import add_diff_parser
    from .launch.command import add_run_parser

    add_diff_parser(sub)
    add_run_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from .loader import DumpReadError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except (DumpReadError, OSError, re.error) as e:  # unreadable input is a usage error, never a trace
        print(f"tracedump {args.command}: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
