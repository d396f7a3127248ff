"""``make bench``: every CPU benchmark, a table on the terminal, ``benchmarks/results.json`` on disk.

    python benchmarks/run_all.py --out benchmarks/results.json     # ~3 min on 2 cores
    python benchmarks/run_all.py --quick                            # tiny model, < 30 s: a smoke run

Targets are judged on the full run only; ``--quick`` uses a model too small for its ratios to mean
anything (the fixed per-hook cost dominates a 5 ms forward) and says so in the JSON.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import bench_memory, bench_overhead, common

# name -> (section, key, comparison, target, what it measures)
TARGETS: dict[str, tuple[str, str, str, float | bool, str]] = {
    "off": ("off", "forward_ratio", "<=", 1.01, "step with attach() off / untouched"),
    "off_no_hooks": ("off", "hooks_registered", "==", 0, "hooks registered when off"),
    "full_step": ("full", "ratio_vs_untouched", "<=", 1.05, "full step as the host sees it / untouched"),
    "full_e2e": (
        "full",
        "ratio_e2e_vs_untouched",
        "<=",
        1.20,
        "full step until on disk / untouched",
    ),
    "full_steady": (
        "full",
        "ratio_steady_vs_untouched",
        "<=",
        1.35,
        "full steps back to back / untouched",
    ),
    "full_vs_naive": ("full", "speedup_vs_naive", ">=", 1.5, "naive step / full step (host-visible)"),
    "stats": ("stats", "ratio", "<=", 1.10, "stats step / untouched"),
    "last_row": ("last_row", "ratio", "<=", 1.10, "last_row step / untouched"),
    "memory": ("memory", "within_cap", "==", True, "peak RSS <= untouched peak + cap + margin"),
    "cli": ("cli", "slowest_torch_free_s", "<=", 0.3, "slowest of tracedump --help / ls / show, seconds"),
    "control_idle": ("control", "idle_ratio", "<=", 1.01, "CONTROL=1 attached, not armed / untouched"),
    "align": ("align", "ratio_vs_raw_read", ">=", 0.8, "diff --align tokens / raw read of the same bytes"),
    "vllm_off": ("vllm", "off_ratio", "<=", 1.03, "vLLM generate, plugin installed and off / no tracedump"),
    "vllm_full": (
        "vllm",
        "full_ratio",
        "<=",
        1.20,
        "vLLM generate 8 x 16 tokens, MODULES=all full dump / none",
    ),
    "vllm_decode": ("vllm", "full_decode_ratio", "<=", 1.20, "vLLM decode step, MODULES=all full / none"),
    "vllm_wide_full": (
        "vllm_wide",
        "full_ratio",
        "<=",
        1.20,
        "vLLM generate 8 x 16 tokens on the 8-layer 1024-wide model, MODULES=all full dump / none",
    ),
    "vllm_wide_decode": (
        "vllm_wide",
        "full_decode_ratio",
        "<=",
        1.20,
        "vLLM decode step of the 8-layer 1024-wide model, MODULES=all full / none",
    ),
}


def run(quick: bool = False, skip: frozenset[str] = frozenset()) -> dict[str, Any]:
    """Run the benchmarks and assemble ``results.json``'s content."""
    started = time.perf_counter()
    results: dict[str, Any] = {"machine": common.machine_info(), "quick": quick}
    overhead = bench_overhead.run(quick=quick)
    results.update(overhead)
    if "memory" not in skip:
        results["memory"] = bench_memory.run(quick=quick)
    if "diff" not in skip:
        results["diff"] = _run_diff(quick)
    if "align" not in skip:
        results["align"] = _run_module("bench_align", quick)
    if "control" not in skip:
        results["control"] = _run_module("bench_control", quick)
    if "cli" not in skip:
        results["cli"] = _run_module("bench_cli", quick)
    if "budget" not in skip:  # where a dumped decode step's time goes, layer by layer
        results["budget"] = _run_module("bench_budget", quick)
    if "compiled" not in skip:  # COMPILED=1 on an inductor-compiled model, beside the eager dump
        results["compiled"] = _run_module("bench_compiled", quick)
    if "vllm" not in skip:  # where vLLM is importable, here or in make test-vllm's .venv-vllm
        results["vllm"] = _run_module("bench_vllm", quick)
        if "skipped" in results["vllm"]:
            print(f"bench_vllm skipped: {results['vllm']['skipped']}", file=sys.stderr)
        elif not quick:  # the second engine model: steps ~8x longer, the same captures
            results["vllm_wide"] = _run_module("bench_vllm", quick, model="wide")
    results["targets"] = judge(results)
    results["seconds"] = time.perf_counter() - started
    return results


def _run_diff(quick: bool) -> dict[str, Any]:
    """``benchmarks/bench_diff.py`` in a process of its own, as ``tracedump diff`` runs: not in
    this one, whose heap and threads the other benchmarks' models and dumpers have shaped. Its
    failure is reported, not fatal."""
    command = [sys.executable, "-m", "benchmarks.bench_diff", *(["--quick"] if quick else [])]
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(command, cwd=root, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return {"error": f"bench_diff exited {done.returncode}", "stderr": done.stderr[-4000:]}
    return dict(json.loads(done.stdout))


def _run_module(name: str, quick: bool, **options: Any) -> dict[str, Any]:
    """Another benchmark module's ``run()``; its failure is reported, not fatal."""
    try:
        return dict(importlib.import_module(f"benchmarks.{name}").run(quick=quick, **options))
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=5)}


def judge(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each target with what was measured and whether it is met (None when not measured)."""
    verdicts: dict[str, dict[str, Any]] = {}
    for name, (section, key, comparison, target, what) in TARGETS.items():
        measured = results.get(section, {}).get(key)
        verdicts[name] = {
            "target": f"{comparison} {target}",
            "measured": measured,
            "met": _met(measured, comparison, target),
            "what": what,
        }
    diff = results.get("diff", {})
    for name, verdict in diff.get("targets", {}).items():
        verdicts[f"diff_{name}"] = verdict
    if "meets_target" in diff and "targets" not in diff:
        verdicts["diff"] = {
            "target": f">= {diff.get('target_ratio')}",
            "measured": diff.get("ratio"),
            "met": diff["meets_target"],
            "what": "diff throughput / raw read bandwidth of the same files",
        }
    return verdicts


def _met(measured: Any, comparison: str, target: float | bool) -> bool | None:
    if measured is None or (isinstance(measured, float) and math.isnan(measured)):
        return None
    if comparison == "<=":
        return measured <= target
    if comparison == ">=":
        return measured >= target
    return measured == target


# ---------------------------------------------------------------------------------------------- table


def print_table(results: dict[str, Any]) -> None:
    """The figures that matter, as a rich table (plain text when rich is missing)."""
    rows = _rows(results)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        for row in rows:
            print(" | ".join(row))
        return
    model = results["model"]
    caption = (
        f"{model['kind']} {model['params'] / 1e6:.1f}M params, {model['tokens']} tokens, "
        f"forward {model['forward_ms']:.0f} ms; {results['machine']['cpu_count']} CPUs, "
        f"{results['machine']['torch_threads']} torch threads"
        + ("\nQUICK run: tiny model, the targets are not meaningful" if results.get("quick") else "")
    )
    table = Table(title="tracedump benchmarks (ratios: interleaved, medians)", caption=caption)
    for column in ("figure", "measured", "target", "met"):
        table.add_column(column, justify="left" if column == "figure" else "right")
    for row in rows:
        table.add_row(*row)
    Console().print(table)


def _rows(results: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    targets = {(v[0], v[1]): k for k, v in TARGETS.items()}
    verdicts = results.get("targets", {})
    shown = [
        ("off", "forward_ratio", "x"),
        ("off", "attach_off_us", "us"),
        ("off", "record_noop_ns", "ns"),
        ("off", "hooks_registered", ""),
        ("full", "ratio_vs_untouched", "x"),
        ("full", "floor_ratio", "x"),
        ("full", "ratio_e2e_vs_untouched", "x"),
        ("full", "floor_ratio_e2e", "x"),
        ("full", "ratio_steady_vs_untouched", "x"),
        ("full", "speedup_vs_naive", "x"),
        ("full", "speedup_vs_naive_e2e", "x"),
        ("full", "speedup_vs_naive_steady", "x"),
        ("full", "speedup_vs_naive_ideal", "x"),
        ("full", "capture_GBps", "GB/s"),
        ("full", "memcpy_GBps", "GB/s"),
        ("full", "clone_GBps", "GB/s"),
        ("full", "throughput_vs_memcpy", "x"),
        ("full", "throughput_vs_clone", "x"),
        ("full", "copies_per_byte", ""),
        ("full", "write_GBps", "GB/s"),
        ("full", "save_file_GBps", "GB/s"),
        ("full", "write_speedup_vs_save_file", "x"),
        ("full", "write_cost_in_memcpys", "x"),
        ("page_cache", "warm_GBps", "GB/s"),
        ("page_cache", "cold_GBps", "GB/s"),
        ("last_row", "ratio", "x"),
        ("last_row", "floor_ratio", "x"),
        ("stats", "ratio", "x"),
        ("stats", "floor_ratio", "x"),
        ("stats", "ratio_e2e", "x"),
        ("memory", "peak_rss_MB", "MB"),
        ("memory", "untouched_peak_rss_MB", "MB"),
        ("memory", "allowed_MB", "MB"),
        ("memory", "within_cap", ""),
        ("align", "ratio_vs_raw_read", "x"),
        ("align", "align_GBps", "GB/s"),
        ("align", "peak_anon_over_sequence_tensor", "x"),
        ("control", "idle_ratio", "x"),
        ("control", "hook_ns", "ns"),
        ("control", "step_boundary_ns", "ns"),
        ("control", "armed_ratio", "x"),
        ("diff", "activations_ratio", "x"),
        ("diff", "kernel", ""),
        ("diff", "numpy_path_ratio", "x"),
        ("cli", "python_s", "s"),
        ("cli", "import_torch_s", "s"),
        ("cli", "help_s", "s"),
        ("cli", "ls_s", "s"),
        ("cli", "show_s", "s"),
        ("cli", "diff_s", "s"),
        ("cli", "slowest_torch_free_s", "s"),
        ("budget", "untouched_step_us", "us"),
        ("budget", "captures_per_step", ""),
        ("vllm", "off_ratio", "x"),
        ("vllm", "full_ratio", "x"),
        ("vllm", "off_decode_ratio", "x"),
        ("vllm", "full_decode_ratio", "x"),
        ("vllm", "naive_decode_ratio", "x"),
        ("vllm", "held_decode_ratio", "x"),
        ("vllm", "held_generate_ratio", "x"),
        ("vllm", "steady_ratio", "x"),
        ("vllm", "steady_decode_ratio", "x"),
        ("vllm", "steady_prefill_ratio", "x"),
        ("vllm", "full_prefill_ratio", "x"),
        ("vllm", "off_ratio_min", "x"),
        ("vllm", "full_ratio_min", "x"),
        ("vllm", "register_off_us", "us"),
        ("vllm_wide", "full_ratio", "x"),
        ("vllm_wide", "full_decode_ratio", "x"),
        ("vllm_wide", "naive_decode_ratio", "x"),
        ("vllm_wide", "held_decode_ratio", "x"),
        ("vllm_wide", "held_generate_ratio", "x"),
        ("vllm_wide", "steady_ratio", "x"),
        ("vllm_wide", "steady_decode_ratio", "x"),
        ("vllm_wide", "steady_prefill_ratio", "x"),
        ("vllm_wide", "full_prefill_ratio", "x"),
        ("compiled", "eager_dump_ratio", "x"),
        ("compiled", "eager_dump_host_ratio", "x"),
        ("compiled", "compiled_dump_ratio", "x"),
        ("compiled", "compiled_dump_host_ratio", "x"),
        ("compiled", "compiled_taps_idle_ratio", "x"),
    ]
    rows = []
    for section, key, unit in shown:
        if key not in results.get(section, {}):
            continue
        name = targets.get((section, key))
        verdict = verdicts.get(name, {}) if name else {}
        met = verdict.get("met")
        rows.append(
            (
                f"{section}.{key}",
                _fmt(results[section][key], unit),
                verdict.get("target", ""),
                "" if not name else ("yes" if met else "n/a" if met is None else "NO"),
            )
        )
    rows.extend(_floor_rows(results))
    budget = results.get("budget", {})
    for layer, ratio in budget.get("ratio", {}).items():
        per_capture = budget.get("added_us_per_capture", {}).get(layer, float("nan"))
        rows.append(
            (f"budget.{layer} (step ratio; +us per capture)", f"{ratio:.3f}x; +{per_capture:.1f} us", "", "")
        )
    for name, verdict in verdicts.items():
        if name.startswith("diff"):
            met = verdict.get("met")
            rows.append((name, _fmt(verdict.get("measured"), ""), str(verdict.get("target", "")),
                         "yes" if met else "n/a" if met is None else "NO"))  # fmt: skip
    return rows


FLOOR_KEYS = ("bytes_floor_ratio", "bytes_floor_fresh_ratio")  # memory already mapped | fresh


def _floor_rows(results: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """The floor from bytes and bandwidth, beside each engine's figures."""
    rows = []
    for section in ("vllm", "vllm_wide"):
        floors = [results.get(section, {}).get(key, {}) for key in FLOOR_KEYS]
        if all(floors):
            clocks = ("decode", "prefill", "generate")
            text = " | ".join("/".join(f"{floor[clock]:.3f}" for clock in clocks) for floor in floors)
            rows.append((f"{section} floor from bytes: decode/prefill/generate, mapped|fresh", text, "", ""))
    return rows


def _fmt(value: Any, unit: str) -> str:
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, float):
        if unit == "x":
            return f"{value:.3f}x"
        if unit == "s":
            return f"{value:.3f} s"
        return f"{value:.1f} {unit}" if unit else f"{value:.3g}"
    return f"{value} {unit}" if unit else str(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write the results JSON here")
    parser.add_argument("--quick", action="store_true", help="tiny model, few rounds: a smoke run (< 30 s)")
    parser.add_argument(
        "--skip",
        action="append",
        default=[],
        choices=["memory", "diff", "align", "control", "cli", "budget", "vllm"],
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice, reported)"
    )
    args = parser.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    results = run(quick=args.quick, skip=frozenset(args.skip))
    print_table(results)
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
