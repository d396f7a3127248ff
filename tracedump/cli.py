"""The ``tracedump`` command: ``ls``, ``show``, ``diff``, ``run``.

Each subcommand imports what it needs when it runs, so ``import tracedump`` stays light: ``--help``,
``ls`` and ``show`` never import torch (it is most of a 2 s start-up); tests/test_loader_cli.py checks.
Exit codes: 0 ok, 1 a divergence (``diff``), 2 a usage error or unreadable input.
"""

from __future__ import annotations

import argparse
import functools
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .console import console

EXIT_OK, EXIT_DIVERGED, EXIT_USAGE = 0, 1, 2


class _Parser(argparse.ArgumentParser):
    """argparse exits with 2 on usage errors, which is the exit code we document for them too."""


def _human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


def cmd_ls(args: argparse.Namespace) -> int:
    """Runs, passes, tensors and bytes of a dump."""
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    from .loader import open_dump

    dump = open_dump(args.dir)
    title = f"tracedump {dump.path}"
    table = Table(title=escape(title), min_width=len(title))  # a title wrapped to the table splits the path
    for column in ("run", "rank", "pid", "passes", "tensors", "bytes", "complete"):
        table.add_column(column, justify="right" if column in ("passes", "tensors", "bytes") else "left")
    for run in dump.runs:
        passes = run.passes
        tensors = sum(len(p) for p in passes.values())
        size = sum(p.nbytes for p in passes.values())
        stats = run.stats()  # stats mode: one record per tensor, beside any whole-stored records
        tensors += len(stats)
        table.add_row(
            Text(run.name),
            str(run.rank),
            str(run.pid),
            str(len(set(passes) | {s.get("pass") for s in stats})),
            str(tensors),
            _human_bytes(size),
            "yes" if run.complete else "no",
        )
    console().print(table)
    for run in dump.runs:
        _print_sequences(run)
    return EXIT_OK


def _print_sequences(run: Any) -> None:
    """The sequences and positions each pass holds, for runs whose engine called ``set_batch``."""
    from .sequences import SequenceError

    try:
        found = run.batches()
    except (SequenceError, ValueError) as e:
        console().print(f"{run.name}: sequence metadata unreadable: {e}", markup=False)
        return
    declared = {index: batch for index, batch in found.items() if batch.declared}
    if not declared:
        return
    console().print(f"{run.name}: sequences per pass (seq: positions)", markup=False)
    for index, batch in sorted(declared.items()):
        console().print(f"  pass {index}: {batch.summary()}", markup=False)


def cmd_show(args: argparse.Namespace) -> int:
    """Name, shape, dtype and simple statistics of each tensor of a pass, in capture order.

    A pass file is read with numpy from its memory map (bf16 widened from its bits), without torch;
    only a ``.pt`` file, which torch pickled, needs torch to be read."""
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    from .compare.reader import SafetensorsMap, Stored, stored_from_torch
    from .layout import dtype_name
    from .loader import load_pass, open_pass

    pattern = re.compile(args.filter) if args.filter else None
    read: Callable[[str], Stored]
    describe: Callable[[str], tuple[tuple[int, ...], str]]
    if args.passfile.suffix == ".pt":  # a {name: tensor} file, read as `diff` reads it
        loaded = load_pass(args.passfile)
        names = list(loaded)
        read = lambda name: stored_from_torch(loaded[name])  # noqa: E731
        describe = lambda name: (tuple(loaded[name].shape), dtype_name(loaded[name].dtype))  # noqa: E731
    else:  # a pass file (or its parts), one tensor at a time
        pass_file = open_pass(args.passfile)
        names = pass_file.names
        maps = {id(h): SafetensorsMap(h) for h in pass_file.headers}
        read = lambda name: maps[id(pass_file.header_of(name))].array(name)  # noqa: E731
        describe = lambda name: (pass_file.info(name).shape, pass_file.info(name).dtype)  # noqa: E731
    table = Table(title=escape(str(args.passfile)))
    for column in ("name", "shape", "dtype", "min", "max", "mean", "abs_mean"):
        table.add_column(column, justify="left" if column in ("name", "dtype") else "right")
    for name in names:
        if pattern and not pattern.search(name):
            continue
        shape, dtype = describe(name)
        cells = _summary_cells(functools.partial(read, name))
        table.add_row(Text(name), str(list(shape)), dtype, *cells)  # Text: `model[x]` keeps its brackets
    console().print(table)
    return EXIT_OK


def _summary_cells(read: Callable[[], Any]) -> list[str]:
    """min, max, mean, abs_mean as text (in float64); ``-`` for a dtype numpy cannot widen (float4)."""
    import numpy as np

    from .compare.routing import as_float

    try:
        values = np.asarray(as_float(read()), dtype=np.float64).reshape(-1)
    except (ValueError, TypeError, RuntimeError, NotImplementedError):
        return ["-"] * 4
    if not values.size:
        values = np.zeros(1)
    with np.errstate(all="ignore"):
        stats = (values.min(), values.max(), values.mean(), np.abs(values).mean())
    return [f"{float(value):.4g}" for value in stats]


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
