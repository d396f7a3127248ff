"""The ``tracedump`` command: ``ls``, ``show``, ``diff``, ``run``.

Each subcommand imports what it needs when it runs, so ``import tracedump`` stays light: ``--help``,
``ls`` and ``show`` never import torch (it is most of a 2 s start-up); tests/test_loader_cli.py checks.
Exit codes: 0 ok, 1 a divergence (``diff``), 2 a usage error or unreadable input.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from .errors import ExitCode
from .util.console import console, printable
from .util.units import human_bytes


def cmd_ls(args: argparse.Namespace) -> int:
    """Runs, passes, tensors and bytes of a dump."""
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    from .store.loader import open_dump

    dump = open_dump(args.dir)
    title = printable(f"tracedump {dump.path}")
    table = Table(title=escape(title), min_width=len(title))  # a title wrapped to the table splits the path
    for column in ("run", "rank", "pid", "passes", "tensors", "bytes", "complete", "root"):
        table.add_column(column, justify="right" if column in ("passes", "tensors", "bytes") else "left")
    for run in dump.runs:
        passes = run.passes
        stats = run.stats()  # stats mode: one record per tensor, beside any whole-stored records
        table.add_row(
            Text(printable(run.name)),  # names and labels come from files: no control character raw
            str(run.rank),
            str(run.pid),
            str(len(set(passes) | {s.get("pass") for s in stats})),
            str(sum(len(p) for p in passes.values()) + len(stats)),
            human_bytes(run.disk_bytes),  # pass files, records and stats.jsonl: a stats dump is not 0 B
            "yes" if run.complete else "no",
            Text(
                printable(run.root)
            ),  # the model this run followed: tells several roots of one process apart
        )
    console().print(table)
    for run in dump.runs:
        _print_control(run)
        _print_sequences(run, everything=args.sequences)
    return ExitCode.OK


def _print_control(run: Any) -> None:
    """State and order history of a run started with TRACEDUMP_DUMP_CONTROL=1: the manifest's
    ``control`` record (typed when the manifest was read), and the heartbeat's state when there is
    one an engine could have written (never a FIFO, a link or a file over its cap)."""
    from .store.control import read_heartbeat

    control = run.info.control
    if control is None:
        return
    state, until, at = control.state or "?", control.armed_until, ""
    beat = read_heartbeat(run.path)
    if beat is not None:
        state, until, at = beat.state, beat.armed_until, f", at step {beat.step}"
    armed = f" until step {until}" if state == "armed" and until is not None else ""
    console().print(printable(f"{run.name}: control {state}{armed}{at}"), markup=False)
    for order in control.orders:
        if order.action == "ignored":  # an order file the engine may not obey, and why
            line = f"  order file {order.event} (at step {order.step})"
            console().print(printable(line), markup=False)
            continue
        what = ", ".join(
            f"{k} {getattr(order, k)}"
            for k in ("steps", "filter", "mode", "request", "start_step")
            if getattr(order, k) is not None
        )
        dumped = f", dumped {order.dumped}" if order.dumped is not None else ""
        console().print(
            printable(
                f"  order {order.id}: {order.action} ({what}) {order.event} at step {order.step}{dumped}"
            ),
            markup=False,
        )


LISTED_SEQUENCES = 8  # sequences named per pass by `tracedump ls` (all with --sequences)
LISTED_PASSES = 20  # passes listed by `tracedump ls` (all with --sequences)


def _print_sequences(run: Any, *, everything: bool = False) -> None:
    """The sequences and positions each pass holds, for runs whose engine called ``set_batch``:
    summarised (a pass of many sequences counted, the first passes listed) unless ``everything``
    (``--sequences``). Linear in the rows either way: an engine's passes hold thousands."""
    try:
        found = run.batches()
    except ValueError as e:  # a SequenceError, or metadata no tracedump wrote
        console().print(printable(f"{run.name}: sequence metadata unreadable: {e}"), markup=False)
        return
    declared = [batch for _, batch in sorted(found.items()) if batch.declared]
    if not declared:
        return
    shown = declared if everything else declared[:LISTED_PASSES]
    lines = [f"{run.name}: sequences per pass (seq: positions)"]
    listed = None if everything else LISTED_SEQUENCES
    lines += [f"  pass {batch.pass_index}: {batch.summary(listed)}" for batch in shown]  # seq ids: user data
    if len(shown) < len(declared):
        lines.append(
            f"  ... {len(declared) - len(shown)} more passes (`tracedump ls --sequences` lists every one)"
        )
    console().print("\n".join(printable(line) for line in lines), markup=False)


def cmd_show(args: argparse.Namespace) -> int:
    """Name, shape, dtype and simple statistics of each tensor of a pass, in capture order.

    A pass file is read with numpy from its memory map (bf16 widened from its bits), without torch;
    only a ``.pt`` file, which torch pickled, needs torch to be read."""
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    from .compare.load.reader import SafetensorsMap, Stored, stored_from_torch
    from .store.format import dtype_name
    from .store.loader import load_pass, open_pass

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
    table = Table(title=escape(printable(args.passfile)))
    for column in ("name", "shape", "dtype", "min", "max", "mean", "abs_mean"):
        table.add_column(column, justify="left" if column in ("name", "dtype") else "right")
    for name in names:
        if pattern and not pattern.search(name):
            continue
        shape, dtype = describe(name)
        cells = _summary_cells(functools.partial(read, name))
        table.add_row(
            Text(printable(name)), str(list(shape)), dtype, *cells
        )  # Text: `model[x]` keeps its brackets
    console().print(table)
    return ExitCode.OK


def _summary_cells(read: Callable[[], Any]) -> list[str]:
    """min, max, mean, abs_mean as text (in float64); ``-`` for a dtype numpy cannot widen (float4)."""
    import numpy as np

    from .compare.load.reader import widen

    try:
        stored = read()
        values = widen(stored.array, stored.dtype, np.float64).reshape(-1)
    except (ValueError, TypeError, RuntimeError, NotImplementedError):
        return ["-"] * 4
    if not values.size:
        values = np.zeros(1)
    with np.errstate(all="ignore"):
        stats = (values.min(), values.max(), values.mean(), np.abs(values).mean())
    return [f"{float(value):.4g}" for value in stats]


def _watched(directory: Path) -> list[Any]:
    """The engines watching ``directory`` (raises OrderError with a clear message)."""
    from .dump.control import STALE_SECONDS, watchers
    from .errors import OrderError

    if not directory.is_dir():
        raise OrderError(f"{directory}: no such directory")
    if directory.stat().st_uid != os.getuid():
        raise OrderError(f"{directory}: owned by another user; only the dump dir's owner may arm")
    found = watchers(directory)
    if not found:
        raise OrderError(
            f"{directory}: no engine watches it (no run dir with TRACEDUMP_DUMP_CONTROL=1 and a "
            f"heartbeat in the last {STALE_SECONDS:.0f} s)"
        )
    return found


def cmd_order(args: argparse.Namespace) -> int:
    """Write an arm order (every watching process dumps from a common start step) or a disarm order
    (each goes idle at its next step boundary)."""
    import time

    from .dump.control import Order, start_step, write_order

    arm = args.command == "arm"  # an OrderError (a refused order, a full disk) is main()'s: exit 2
    found = _watched(args.dir)
    order = Order(id=time.time_ns(), action=args.command)
    if arm:  # the arm flags, by the names of Order's fields
        what = {name: getattr(args, name) for name in ("steps", "filter", "mode", "inputs", "request")}
        order = Order(id=order.id, action="arm", start_step=start_step(found), **what)
        order.check()
    write_order(args.dir, order)
    if arm:
        steps = f"{order.steps} steps" if order.steps else "every step until disarmed"
        print(printable(f"armed {len(found)} runs under {args.dir}: {steps} from step {order.start_step}"))
    else:
        print(printable(f"disarmed {len(found)} runs under {args.dir} (from their next step)"))
    return ExitCode.OK


def build_parser() -> argparse.ArgumentParser:
    # argparse exits with 2 on usage errors, which is the exit code we document for them too
    parser = argparse.ArgumentParser(
        prog="tracedump", description="Find the first layer where two runs of a model diverge."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("ls", help="list the runs and passes of a dump")
    ls.add_argument("dir", type=Path)
    ls.add_argument(
        "--sequences",
        action="store_true",
        help="list every sequence of every pass (by default a pass of many sequences is counted, and "
        f"the first {LISTED_PASSES} passes are listed)",
    )
    ls.set_defaults(func=cmd_ls)
    show = sub.add_parser("show", help="show the tensors of one pass file")
    show.add_argument("passfile", type=Path)
    show.add_argument("--filter", help="regex on tensor names (re.search)")
    show.set_defaults(func=cmd_show)
    arm = sub.add_parser(
        "arm",
        help="make the engines dumping under DIR (started with TRACEDUMP_DUMP_CONTROL=1) dump the next steps",
    )
    arm.add_argument("dir", type=Path)
    arm.add_argument("--steps", type=int, help="dump this many steps, then go idle (default: until disarmed)")
    arm.add_argument("--filter", help="only names where this regex is found (within the attached selection)")
    arm.add_argument("--mode", choices=("full", "last_row", "stats"), help="the mode of the armed steps")
    arm.add_argument("--inputs", action="store_true", help="capture module inputs too")
    arm.add_argument("--request", help="only steps whose set_batch() holds this sequence id")
    arm.set_defaults(func=cmd_order)
    disarm = sub.add_parser("disarm", help="stop the dumping ordered by tracedump arm at the next step")
    disarm.add_argument("dir", type=Path)
    disarm.set_defaults(func=cmd_order)
    from .compare.command import add_diff_parser
    from .launch.command import add_run_parser

    add_diff_parser(sub)
    add_run_parser(sub)
    for each in (parser, *dict.fromkeys(sub.choices.values())):
        _add_debug_flag(each)
    return parser


_DEBUG_HELP = "on an internal error, print the traceback (a bug report needs it)"


def _add_debug_flag(parser: argparse.ArgumentParser) -> None:
    """``--debug`` before or after the subcommand: ``tracedump --debug diff A B`` and
    ``tracedump diff A B --debug`` both work (SUPPRESS: the subcommand's default never resets
    the flag given before it)."""
    parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=_DEBUG_HELP)


def main(argv: Sequence[str] | None = None) -> int:
    """The ``tracedump`` command; returns its exit code and never lets a traceback out.

    Exit 1 means "diverged" (``diff``) and nothing else, so that a CI gate never reads a crash
    as a divergence. Besides a :class:`~tracedump.errors.TracedumpError` (its own code) and an
    unreadable input (2), :func:`guarded` maps what no command expects: an internal error to 2
    with one line (``--debug`` shows the traceback), a closed or broken stdout to 2, Ctrl-C to
    130 (docs/comparator.md, "Exit codes")."""
    with _stdout_guard():
        try:
            args = build_parser().parse_args(argv)
        except KeyboardInterrupt:
            _say("tracedump: interrupted")
            return INTERRUPTED
        return guarded(args)


def guarded(args: argparse.Namespace) -> int:
    """Run the chosen command; every way it can end becomes an exit code and at most one line."""
    from .errors import TracedumpError

    command = f"tracedump {args.command}"
    debug = bool(vars(args).pop("debug", False))  # the guard's flag, not the command's
    try:
        return int(args.func(args))
    except TracedumpError as e:  # anything tracedump refused: one line and the error's own exit code
        _say(f"{command}: {e}")
        return int(e.exit_code)
    except BrokenPipeError:  # `| head -1`: the reader left; what was not written is lost
        _silence_stdout()
        _say(f"{command}: stdout closed before the output was written (exit {ExitCode.USAGE})")
        return ExitCode.USAGE
    except (OSError, re.error) as e:  # unreadable input is a usage error, never a trace
        _say(f"{command}: {e}")
        return ExitCode.USAGE
    except KeyboardInterrupt:  # Ctrl-C: the shell's code for SIGINT, no traceback
        _say(f"{command}: interrupted")
        return INTERRUPTED
    except Exception as e:  # a bug, or an input no check foresaw: never exit 1 ("diverged")
        return _internal_error(command, e, debug)


INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a command ended by Ctrl-C


def _internal_error(command: str, error: BaseException, debug: bool) -> int:
    """Exit 2 with one line naming the error; the traceback too with ``--debug``."""
    if debug:
        import traceback

        traceback.print_exception(error, file=sys.stderr)
    first_line = (str(error).splitlines() or [""])[0]
    _say(
        f"{command}: internal error: {type(error).__name__}: {first_line}; "
        "rerun with `--debug` for the traceback"
    )
    return ExitCode.USAGE


def _say(line: str) -> None:
    """One line on stderr (a closed stderr loses it; the exit code still tells)."""
    with contextlib.suppress(OSError, AttributeError, ValueError):
        print(printable(line, keep_newlines=True), file=sys.stderr, flush=True)


def _silence_stdout() -> None:
    """Point fd 1 at /dev/null, so the interpreter's last flush of a broken stdout neither fails
    again nor prints "Exception ignored" (the recipe of Python's signal docs, "Note on SIGPIPE")."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)  # fd 1 itself when fd 1 was closed
        if devnull != 1:
            os.dup2(devnull, 1)
            os.close(devnull)
    except OSError:
        pass


class _ClosedStdout:
    """``sys.stdout`` when the command was started with fd 1 closed (``>&-``): a write fails as a
    write to a closed pipe would (EPIPE), so the command ends with exit 2 and one line, not with a
    traceback from ``None.write`` (or silently, as ``print`` to ``None`` would)."""

    def write(self, text: str) -> int:
        raise BrokenPipeError("stdout is closed")

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        raise OSError("stdout is closed")


@contextlib.contextmanager
def _stdout_guard() -> Iterator[None]:
    """With fd 1 closed, hold it on /dev/null (so no file tracedump opens lands on fd 1, where a
    child of ``tracedump run`` would write into it) and make ``sys.stdout`` a stream that refuses."""
    if sys.stdout is not None:
        yield
        return
    _silence_stdout()
    sys.stdout = _ClosedStdout()  # type: ignore[assignment]
    try:
        yield
    finally:
        sys.stdout = None  # type: ignore[assignment]


if __name__ == "__main__":
    sys.exit(main())
