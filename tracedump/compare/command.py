"""``tracedump diff A B``: the argparse front of the comparator (see docs/comparator.md)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ..errors import ExitCode

_DESCRIPTION = """\
Compare dump A (the run under test) with dump B (the reference) and name the first tensor, in
execution order, whose difference exceeds tolerance. A and B are each a dump dir, a run dir
(rank<R>_pid<P>) or a pass file. Default tolerances depend on the dtypes (docs/comparator.md).
"""
_EPILOG = """\
exit codes: 0 no divergence, 1 divergence found, 2 usage error or unreadable input.
examples:
  tracedump diff /tmp/dump_engine /tmp/dump_hf
  tracedump diff A B --pass 0 --filter 'layers\\.(0|1)\\.'
  tracedump diff A B --map '^model\\.layers\\.(\\d+)\\.self_attn=transformer.h.\\1.attn'
  tracedump diff /tmp/dump_vllm /tmp/dump_hf            # the built-in vLLM/HF bridge applies
  tracedump diff /tmp/dump_port /tmp/dump_hf --bridge my_port.toml
  tracedump diff TP2 TP1 --unshard 'q_proj|k_proj|v_proj|gate_proj|up_proj=cat:-1' \\
                         --unshard 'o_proj|down_proj=sum'
"""


def add_diff_parser(sub: Any) -> None:
    parser = sub.add_parser(
        "diff",
        help="compare two dumps and name the first divergent module",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("a", type=Path, help="the run under test")
    parser.add_argument("b", type=Path, help="the reference")
    parser.add_argument(
        "--pass",
        dest="passes",
        metavar="N",
        help="compare pass N only (also 0,3,5-7); default: every pass in both",
    )
    parser.add_argument(
        "--rank", type=int, metavar="R", help="the rank to compare (default: rank 0 / the only run)"
    )
    parser.add_argument(
        "--filter", metavar="REGEX", help="compare only names where REGEX is found (re.search)"
    )
    parser.add_argument(
        "--map",
        dest="maps",
        action="append",
        default=[],
        metavar="PATTERN=REPL",
        help="rename A's names before matching (re.sub; repeatable, applied in order; split at the last '=')",
    )
    parser.add_argument(
        "--unshard",
        action="append",
        default=[],
        metavar="REGEX=cat:DIM|sum",
        help="join a multi-rank side's tensors: cat along DIM, or sum partial results (repeatable)",
    )
    parser.add_argument(
        "--metric",
        choices=("rel_diff", "max_abs", "cosine"),
        default="rel_diff",
        help="what must stay under tolerance",
    )
    parser.add_argument(
        "--rtol",
        action="append",
        metavar="VALUE|REGEX=VALUE",
        help="fixed relative threshold instead of the noise model: for every pair, or for names where "
        "REGEX is found (repeatable, first matching rule wins)",
    )
    parser.add_argument(
        "--atol",
        action="append",
        metavar="VALUE|REGEX=VALUE",
        help="absolute threshold: pairs whose max |A-B| is within it pass (repeatable, rules as --rtol)",
    )
    parser.add_argument(
        "--align",
        choices=("passes", "tokens"),
        default=None,
        help="tokens: compare each sequence's rows gathered over all steps, by position (a batching "
        "engine against a batch-1 reference; see set_batch). Default: passes, or what the bridge "
        "in use says (tokens for vLLM against HF)",
    )
    parser.add_argument(
        "--bridge",
        metavar="FILE|none",
        help="structural rules between two module trees (docs/engines.md): a rule file (TOML or "
        "JSON) for your engine or port, or none; default: the built-in bridge that fits the two "
        "manifests' frameworks (vLLM against HF transformers), if any",
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        metavar="C",
        help="a rerun of the reference under the difference you accept (e.g. in A's dtype): each "
        "pair's threshold becomes its measured noise err(C, B) times a factor",
    )
    parser.add_argument(
        "--json", dest="json_path", metavar="PATH", help="write the full per-tensor report ('-': stdout)"
    )
    parser.add_argument(
        "--plot", dest="plot_path", type=Path, metavar="PATH.png", help="plot the error along execution order"
    )
    parser.add_argument(
        "--html",
        dest="html_path",
        type=Path,
        metavar="PATH.html",
        help="write a self-contained report page: summary, error curve, per-token heatmap, table, notes",
    )
    parser.add_argument(
        "--max-rows",
        type=_rows,
        default=500,
        metavar="N",
        help="table rows before ok rows are hidden (0: all)",
    )
    parser.add_argument(
        "--min-coverage",
        type=_fraction,
        metavar="FRACTION",
        help="exit 2 when less than this fraction of the reference's (B's) tensors per step was "
        "compared (e.g. 0.8); default: only said in the summary (below 0.5)",
    )
    parser.add_argument("--no-progress", action="store_true", help="never show the progress bar")
    parser.set_defaults(func=run_diff)


def run_diff(args: argparse.Namespace) -> int:
    from ..errors import UsageError
    from ..util.console import printable
    from .options import parse_options
    from .pipeline import run

    # every dest of the diff parser but these is an argument of parse_options, by the same name
    given = {k: v for k, v in vars(args).items() if k not in ("command", "func", "no_progress")}
    try:
        return run(parse_options(**given, progress=False if args.no_progress else None))
    except UsageError as e:
        print(printable(f"tracedump diff: {e}", keep_newlines=True), file=sys.stderr)
        return ExitCode.USAGE


def _fraction(text: str) -> float:
    """``--min-coverage``: a fraction from 0 to 1 (argparse turns the error into exit 2)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a fraction such as 0.8") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"{text}: expected a fraction from 0 to 1 (0.8: 80 %)")
    return value


def _rows(text: str) -> int:
    """``--max-rows``: a count of rows, 0 for all (argparse turns the ValueError into exit 2)."""
    rows = int(text)
    if rows < 0:
        raise argparse.ArgumentTypeError(f"{rows}: expected a number of rows >= 0 (0 shows all)")
    return rows
