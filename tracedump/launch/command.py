"""``tracedump run [options] -- COMMAND [ARGS...]``: dump a program that never heard of tracedump.

The settings become ``TRACEDUMP_DUMP_*`` env vars, validated here first (a bad value exits 2 before
COMMAND starts), and the bootstrap folder goes first on ``PYTHONPATH``; every Python process under
COMMAND, spawned or forked, inherits both. The exit status of COMMAND is passed through (128+N when
a signal N ended it) and a summary of the run dirs written is printed to stderr at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from ..errors import ExitCode
from ..util.console import printable

DEFAULT_DIR = "tracedump_out"
BOOTSTRAP_DIR = Path(__file__).resolve().parent
_FORWARDED_SIGNALS = ("SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
# (flag, settings field, help). Only flags given on the command line are exported; an env var set by
# the caller for any other field is inherited unchanged.
_VALUE_FLAGS = (
    ("--filter-fn", "filter_fn", "'pkg.mod:func' or '/path/file.py:func': a (name, module) -> bool"),
    ("--modules", "modules", "leaves (default) or all"),
    ("--mode", "mode", "full (default), last_row or stats"),
    ("--steps", "steps", "pass indices to keep, e.g. '0,3,10-20' (default: all)"),
    ("--tokens", "tokens", "capture only outputs whose token dimension has this size"),
    ("--token-dim", "token_dim", "0 for [tokens, hidden] (default), 1 for [batch, seq, hidden]"),
    ("--max-rows", "max_rows", "skip steps whose reported rows exceed this"),
    ("--stats", "stats", "stats mode: comma list of statistics"),
    ("--max-pending-bytes", "max_pending_bytes", "host memory cap for captures not yet on disk"),
    ("--graft-from", "graft_from", "a reference dump made with --inputs: grafted modules run on its inputs"),
    ("--graft-level", "graft_level", "with --graft-from: regex of the modules to graft (default: leaves)"),
)


def add_run_parser(sub: Any) -> None:
    """The ``run`` subcommand of the ``tracedump`` CLI."""
    parser = sub.add_parser(
        "run",
        help="run a command with dumping on in every Python process it starts",
        description="Run COMMAND with dumping on in every Python process it starts (and their "
        "children), without any change to their code. Each root module (one called while no other "
        "module runs) is attached at its first call; each root forward is one pass.",
        epilog="Example: tracedump run --dir /tmp/dump --filter 'layers\\.0\\.' -- python serve.py",
    )
    parser.add_argument(
        "--dir",
        help=f"dump directory (default: $TRACEDUMP_DUMP_DIR if set, else ./{DEFAULT_DIR})",
    )
    parser.add_argument(
        "--filter",
        action="append",
        metavar="REGEX",
        help="dump only modules whose dotted name matches (re.search); repeat for several",
    )
    for flag, field, text in _VALUE_FLAGS:
        parser.add_argument(flag, dest=field, help=text)
    parser.add_argument(
        "--inputs", action="store_true", default=None, help="also capture each selected module's inputs"
    )
    parser.add_argument(
        "--graft-map",
        action="append",
        metavar="PATTERN=REPL",
        help="with --graft-from: rename this model's modules to the reference's (as diff --map; repeatable)",
    )
    parser.add_argument(
        "--no-compile",
        action="store_true",
        help="set TORCHDYNAMO_DISABLE=1 so torch.compile runs eagerly and every hook fires",
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="no summary at the end")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- COMMAND [ARGS...]")
    parser.set_defaults(func=run_command)


def run_command(args: argparse.Namespace) -> int:
    """Validate, launch, wait, summarise; the return value is COMMAND's exit status."""
    command = list(args.cmd)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        print("tracedump run: no COMMAND given (tracedump run [options] -- COMMAND ...)", file=sys.stderr)
        return ExitCode.USAGE
    env = child_env(os.environ, args)
    error = validate_settings(env)
    if error:
        print(printable(f"{error}\ntracedump run: COMMAND not started.", keep_newlines=True), file=sys.stderr)
        return ExitCode.USAGE
    dump_dir = Path(env["TRACEDUMP_DUMP_DIR"])
    before = _run_dir_names(dump_dir)
    if not args.quiet:
        print(printable(f"tracedump run: dumping to {dump_dir}"), file=sys.stderr)
    status = launch(command, env)
    if not args.quiet:
        _print_summary(dump_dir, before, status)
    return status


def child_env(environ: Mapping[str, str], args: argparse.Namespace) -> dict[str, str]:
    """The environment of COMMAND: the caller's, the flags as ``TRACEDUMP_DUMP_*``, the bootstrap."""
    from ..config.switch import env_name

    env = dict(environ)
    directory = args.dir or env.get(env_name("dir")) or DEFAULT_DIR
    env[env_name("dir")] = str(Path(directory).expanduser().resolve())
    if args.filter or args.filter_fn:  # a filter flag replaces an inherited filter of either kind
        env.pop(env_name("filter"), None)
        env.pop(env_name("filter_fn"), None)
    if args.filter:
        env[env_name("filter")] = json.dumps(args.filter)
    for _flag, field, _text in _VALUE_FLAGS:
        value = getattr(args, field, None)
        if value is not None:
            env[env_name(field)] = str(value)
    if args.inputs:
        env[env_name("inputs")] = "1"
    if getattr(args, "graft_from", None) is not None:  # the children may chdir: fix the reference now
        env[env_name("graft_from")] = str(Path(args.graft_from).expanduser().resolve())
        # with MODULES unset the child's settings dump every module (_grafted_runs_dump_every_module)
    if getattr(args, "graft_map", None):
        env[env_name("graft_map")] = json.dumps(args.graft_map)
    if args.no_compile:
        env["TORCHDYNAMO_DISABLE"] = "1"
    env["PYTHONPATH"] = _with_bootstrap_first(env.get("PYTHONPATH", ""))
    return env


def _with_bootstrap_first(pythonpath: str) -> str:
    entries = [p for p in pythonpath.split(os.pathsep) if p and Path(p).resolve() != BOOTSTRAP_DIR]
    return os.pathsep.join([str(BOOTSTRAP_DIR), *entries])


def validate_settings(env: Mapping[str, str]) -> str | None:
    """The error message for a bad setting (as the children would meet it), or None."""
    from unittest import mock  # patch.dict: ``env`` is os.environ for the block, then the caller's again

    from ..config.settings import check_combination, load_settings
    from ..errors import ConfigError

    with mock.patch.dict(os.environ, env, clear=True):  # pydantic-settings reads os.environ
        try:
            settings = load_settings(None)
            check_combination(settings)  # STEPS with CONTROL, as attach() would refuse it in COMMAND
            settings.resolve_callables()  # a FILTER_FN that cannot be imported stops COMMAND too
        except ConfigError as error:
            return str(error)
        problem = _dir_problem(Path(settings.dir).expanduser()) if settings.dir is not None else None
        if problem:
            return f"tracedump: bad setting\n  {settings.describe('dir')}: {problem}"
    return None


def _dir_problem(path: Path) -> str | None:
    """What attach() in COMMAND would meet creating ``path`` that can be seen before it starts: a
    component longer than the file system allows (ENAMETOOLONG; each child would warn and dump
    nothing)."""
    probe = path
    while not os.path.lexists(probe) and probe != probe.parent:
        probe = probe.parent
    try:
        longest = os.pathconf(probe, "PC_NAME_MAX")
    except (OSError, ValueError):
        longest = 255
    sizes = [len(os.fsencode(part)) for part in path.parts]
    if max(sizes, default=0) > longest:
        return f"cannot create the dump directory: a component of {max(sizes)} bytes (at most {longest})"
    return None


def launch(command: Sequence[str], env: Mapping[str, str]) -> int:
    """Run COMMAND to its end and return its status: its exit code, or 128+N if signal N ended it.

    Ctrl-C reaches COMMAND from the terminal (same process group), so the launcher itself ignores
    SIGINT and stays to write the summary; SIGTERM, SIGHUP and friends sent to the launcher alone are
    forwarded to COMMAND.
    """
    executable = shutil.which(command[0], path=env.get("PATH"))
    try:
        child = subprocess.Popen([executable or command[0], *command[1:]], env=dict(env))
    except FileNotFoundError:
        print(printable(f"tracedump run: command not found: {command[0]}"), file=sys.stderr)
        return ExitCode.NOT_FOUND
    except PermissionError as error:
        print(printable(f"tracedump run: cannot execute {command[0]}: {error}"), file=sys.stderr)
        return ExitCode.NOT_EXECUTABLE
    with _signals_forwarded_to(child):
        returncode = child.wait()
    return 128 - returncode if returncode < 0 else returncode


@contextlib.contextmanager
def _signals_forwarded_to(child: subprocess.Popen[bytes]) -> Iterator[None]:
    def forward(signum: int, _frame: FrameType | None) -> None:
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signum)

    previous: dict[int, Any] = {}
    try:
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.SIG_IGN)
        for name in _FORWARDED_SIGNALS:
            signum = getattr(signal, name, None)
            if signum is not None:
                previous[signum] = signal.signal(signum, forward)
    except ValueError:  # not the main thread (the CLI called from a thread): leave signals alone
        pass
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _run_dir_names(dump_dir: Path) -> set[str]:
    return {p.name for p in dump_dir.iterdir()} if dump_dir.is_dir() else set()


def _print_summary(dump_dir: Path, before: set[str], status: int) -> None:
    """What COMMAND's processes wrote under ``dump_dir`` (run dirs new since the launch), to stderr."""
    lines = [f"tracedump run: COMMAND exited with status {status}"]
    try:
        lines += summary_lines(dump_dir, before)
    except Exception as error:  # the summary must never hide COMMAND's status
        lines.append(f"tracedump run: cannot read {dump_dir}: {type(error).__name__}: {error}")
    print(printable("\n".join(lines), keep_newlines=True), file=sys.stderr)  # paths, roots: user strings


def summary_lines(dump_dir: Path, before: set[str]) -> list[str]:
    """One line per run dir written since ``before``: root, rank, pid, passes, bytes, completeness."""
    from ..store.loader import open_dump
    from ..util.units import human_bytes

    new = _run_dir_names(dump_dir) - before
    if not new:
        return [
            f"tracedump run: nothing written to {dump_dir}: no Python process under COMMAND ran a "
            "torch module forward eagerly (torch.compile'd forwards run no hooks: try --no-compile; "
            "or Python started with -S/-I/-E, which skip the bootstrap)."
        ]
    runs = [run for run in open_dump(dump_dir).runs if run.path.name in new]
    # What is on disk, not what the manifests say: a process killed (or a Pool worker terminated)
    # before its last manifest write still wrote pass files.
    total = sum(run.disk_bytes for run in runs)
    lines = [f"tracedump run: {len(runs)} run dir(s) in {dump_dir}, {human_bytes(total)}"]
    for run in runs:
        passes = run.manifest.get("passes")
        indices = passes.get("indices") if isinstance(passes, dict) else None
        count = len(set(run.passes) | set(indices if isinstance(indices, list) else []))
        lines.append(
            f"  {run.name}: root {run.manifest.get('root')}, rank {run.rank}/"
            f"{run.manifest.get('world_size')}, {count} passes, "
            f"{human_bytes(run.disk_bytes)}, {_state(run)}"
        )
    return lines


def _state(run: Any) -> str:
    if run.complete:
        return "complete"
    reason = run.manifest.get("incomplete_reason") or (
        "the process ended without closing its dumper: killed, or a Pool worker terminated"
    )
    return f"INCOMPLETE ({reason})"
