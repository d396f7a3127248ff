"""Calibrate the grafted verdict (local error): bf16 grafted from an fp32 reference, no baseline.

For every family and bug of ``benchmarks/calibrate.py`` (plus the softmax-scale bug wherever the
family's attention has a ``scaling``), an fp32 reference with eager attention is dumped with
``INPUTS=1`` (``MODULES=all``), then the bf16 model is dumped *grafted* from it

- at leaf level (every captured leaf runs on the reference's inputs: each leaf's own error), and
- at the family's layer level (``layers\\.\\d+$``, ``h\\.\\d+$``, ``block\\.\\d+$``: each layer's
  own error, the leaves inside running on the layer's own values),

clean (eager attention, and sdpa: a kernel change too) and with each bug planted in the middle
layer, and compared with default flags. A layer-level graft must pass clean runs and name the
planted layer for every bug; a leaf-level graft must pass clean runs and name a bug that lives
inside a leaf (a norm's eps); bugs in code between leaves (rotary, attention scale, a block's
output scale) are invisible at leaf level by construction (docs/comparator.md) and marked "(not
visible)" there. ``tests/test_graft*.py`` run Llama, Mixtral and T5 rows in CI.

Phi3, Gemma2 and Bart too (:data:`DEFAULT_FAMILIES`), every setting of
calibrate.py's ``SETTINGS`` (each a child process; ``--seed`` there is calibrate.py's model seed),
and each row's ratio to its allowance and the margin goals, in calibrate.py's row form, so its
settings table, summary and ``--merge`` serve both scripts.

Run: ``python benchmarks/calibrate_graft.py [--families llama,t5] [--settings native,capped]
[--markdown] [--out FILE]`` (``make calibrate`` runs it after ``calibrate.py``: about 20 s a
setting on one core).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import benchmarks.calibrate as calibrate_module
import tracedump
from benchmarks import common
from benchmarks.calibrate import (
    DEFAULT_SETTINGS,
    FAMILIES,
    INIT,
    SETTINGS,
    Family,
    _g,
    _x,
    cpu_name,
    failed_setting,
    goal_met,
    merge_settings,
    ratios,
    settings_markdown,
    summary_markdown,
)

# The layer-level regex of each family (what `--graft-level` would be given).
LEVELS = {
    "llama": r"layers\.\d+$",
    "mixtral": r"layers\.\d+$",
    "qwen2moe": r"layers\.\d+$",
    "olmoe": r"layers\.\d+$",
    "gpt2": r"h\.\d+$",
    "t5": r"block\.\d+$",
    "unet": r"(down_blocks|up_blocks)\.\d+$|mid_block$",
    "phi3": r"layers\.\d+$",
    "gemma2": r"layers\.\d+$",
    "bart": r"layers\.\d+$",
}
# Bugs inside a leaf: the only ones a leaf-level graft can see (an eps, Bart's fc2 scaled, and
# Gemma2's MLP branch, scaled at its post-norm's output).
LEAF_VISIBLE = ("norm_eps", "fc2_scale")
LEAF_VISIBLE_IN = {("gemma2", "mlp_scale")}
# The planted layer of each family, as its module (for the layer-level first divergence).
PLANTED = {
    "llama": "model.layers.3",
    "mixtral": "model.layers.2",
    "qwen2moe": "model.layers.2",
    "olmoe": "model.layers.2",
    "gpt2": "transformer.h.2",
    "t5": "decoder.block.1",
    "unet": "mid_block",
    "phi3": "model.layers.2",
    "gemma2": "model.layers.1",
    "bart": "model.decoder.layers.1",
}
DEFAULT_FAMILIES = "llama,gpt2,mixtral,qwen2moe,olmoe,t5,phi3,gemma2,bart"


SEED = int(os.environ.get("TEST_SEED", "0"))  # another seed: other random weights, same configs


def family(name: str, seed: int | None = None) -> Family:
    """The calibration family, with a softmax-scale bug added where its attention has a scale;
    with ``seed`` (default ``$TEST_SEED``, 0: the calibration's own weights) other weights."""
    fam = copy.copy(FAMILIES[name]())
    fam.bugs = dict(fam.bugs)
    seed = SEED if seed is None else seed
    if seed:
        fam.build = _reseeded(fam.build, seed)
    if "softmax_scale" not in fam.bugs and name in ("mixtral", "qwen2moe", "olmoe"):
        fam.bugs["softmax_scale"] = lambda m: _scale_attention(m.model.layers[2].self_attn, 1.05)
    return fam


def _reseeded(
    build: Callable[[torch.dtype, str], nn.Module], seed: int
) -> Callable[[torch.dtype, str], nn.Module]:
    """The family's model with every weight drawn again from ``seed`` (in fp32, then cast, so the
    bf16 model is the fp32 one rounded): norms 1 +- 0.2, biases +- 0.02, the rest at 5x HF's init."""

    def rebuilt(dtype: torch.dtype, attention: str) -> nn.Module:
        model = build(dtype, attention)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in model.named_parameters():
                noise = torch.randn(param.shape, generator=generator)
                if param.dim() == 1:
                    is_scale = name.endswith("weight") and re.search(r"norm|ln_", name)
                    noise = 1 + 0.2 * noise if is_scale else 0.02 * noise
                else:
                    noise = INIT * noise
                param.copy_(noise.to(param.dtype))
        return model

    return rebuilt


def _scale_attention(attention: nn.Module, factor: float) -> None:
    attention.scaling = attention.scaling * factor


def reference_variant(fam: Family) -> str:
    """fp32 with eager attention where the family has it: its attention weights are dumped."""
    return "fp32-eager" if "eager" in fam.attentions else "fp32"


def dump(
    fam: Family, variant: str, out: Path, graft_from: Path | None = None, level: str | None = None
) -> Path:
    """Dump ``<dtype>[-<attention>][+<bug>]`` with INPUTS=1 and MODULES=all; grafted when
    ``graft_from`` is given (``level`` None: every captured leaf)."""
    spec, _, bug = variant.partition("+")
    dtype_name, _, attention = spec.partition("-")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    model = fam.build(dtype, attention or fam.attentions[-1])
    if bug:
        fam.bugs[bug](model)
    config: dict[str, Any] = {"dir": str(out), "modules": "all", "inputs": True}
    if graft_from is not None:
        config.update(graft_from=str(graft_from), graft_level=level)
    with common.clean_env():
        dumper = tracedump.attach(model, config)
    assert dumper is not None
    with torch.no_grad():
        fam.run(model)
    dumper.close()
    return out


@dataclass(frozen=True)
class GraftCase:
    family: str
    variant: str  # the bf16 run grafted from the fp32 reference
    level: str  # "leaf" or "layer"
    expect: str  # clean | detect | invisible

    @property
    def bug(self) -> str | None:
        return self.variant.partition("+")[2] or None


def cases(fam: Family) -> list[GraftCase]:
    eager = "bf16-eager" if "eager" in fam.attentions else "bf16"
    out = []
    for level in ("leaf", "layer"):
        out.append(GraftCase(fam.name, eager, level, "clean"))
        if len(fam.attentions) > 1:
            out.append(GraftCase(fam.name, f"bf16-{fam.attentions[-1]}", level, "clean"))  # kernel change
        for bug in fam.bugs:
            visible = level == "layer" or bug in LEAF_VISIBLE or (fam.name, bug) in LEAF_VISIBLE_IN
            out.append(GraftCase(fam.name, f"{eager}+{bug}", level, "detect" if visible else "invisible"))
    return out


@dataclass
class GraftOutcome:
    case: GraftCase
    exit_code: int
    first: str | None
    error: float | None
    threshold: float | None
    worst_clean: float  # the largest error / threshold of a local tensor outside the planted layer
    passed: bool
    ratio: float | None = None  # clean: worst error / threshold anywhere; bug: clearest in the planted layer

    def row(self) -> dict[str, Any]:
        """The row in calibrate.py's form (``case``: "<variant> @ <level>"), so its settings table,
        summary and merge read it, plus this script's own keys."""
        return {
            "family": self.case.family,
            "case": f"{self.case.variant} @ {self.case.level}",
            "variant": self.case.variant,
            "level": self.case.level,
            "expect": self.case.expect,
            "exit": self.exit_code,
            "first_divergence": self.first,
            "error": self.error,
            "threshold": self.threshold,
            "worst_clean_ratio": self.worst_clean,
            "ratio": self.ratio,
            "goal_met": goal_met(self.case.expect, self.ratio),
            "passed": self.passed,
        }


def planted(name: str | None, fam_name: str) -> bool:
    """``name`` is the planted layer or lies inside it."""
    layer = PLANTED[fam_name]
    return bool(name and (name == layer or re.match(re.escape(layer) + r"[.\[@:]", name)))


def judge(case: GraftCase, grafted: Path, reference: Path) -> GraftOutcome:
    from tracedump.compare import compare

    report = compare(grafted, reference)
    first = report.first_divergence
    name = first.name if first else None
    local = [r for r in report.results if getattr(r, "local", False) and r.error is not None and r.threshold]
    outside = [r.error / r.threshold for r in local if not planted(r.name, case.family)]  # type: ignore[operator]
    if case.expect == "detect":
        passed = report.exit_code == 1 and planted(name, case.family)
    elif case.expect == "clean":
        passed = report.exit_code == 0
    else:
        passed = True
    anywhere, inside = ratios(report.results, lambda n: planted(n, case.family))
    return GraftOutcome(
        case,
        report.exit_code,
        name,
        first.error if first else None,
        first.threshold if first else None,
        max(outside, default=0.0),
        passed,
        ratio=max(anywhere, inside) if case.expect == "clean" else inside,
    )


def calibrate_family(name: str, root: Path, log: Callable[[str], None] = print) -> list[GraftOutcome]:
    fam = family(name)
    started = time.perf_counter()
    reference = dump(fam, reference_variant(fam), root / "ref")
    outcomes = []
    for case in cases(fam):
        level = None if case.level == "leaf" else LEVELS[name]
        grafted = dump(fam, case.variant, root / f"{case.variant}-{case.level}", reference, level)
        outcome = judge(case, grafted, reference)
        outcomes.append(outcome)
        mark = "ok " if outcome.passed else "BAD"
        log(
            f"  {mark} {name:8s} {case.level:5s} {case.variant:26s} expect {case.expect:9s} exit "
            f"{outcome.exit_code} first {outcome.first} ({_g(outcome.error)} > {_g(outcome.threshold)}) "
            f"ratio {_x(outcome.ratio)} worst clean {outcome.worst_clean:.2f}"
        )
        shutil.rmtree(grafted, ignore_errors=True)
    shutil.rmtree(root, ignore_errors=True)
    log(f"{name}: {len(outcomes)} grafted cases in {time.perf_counter() - started:.1f} s")
    return outcomes


def markdown(rows: list[dict[str, Any]]) -> str:
    """One row per family and run, the leaf and layer columns side by side (the docs table), each
    with its ratio to the allowance and whether it meets the margin goals."""
    lines = [
        "| family | bf16 run, grafted from fp32 | leaf level | layer level | held |",
        "|---|---|---|---|---|",
    ]
    by_row: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    for row in rows:
        by_row.setdefault((row["family"], row["variant"]), {})[row["level"]] = row
    for (fam, variant), levels in by_row.items():
        cells = [_cell(levels.get(level)) for level in ("leaf", "layer")]
        held = "yes" if all(r["passed"] for r in levels.values()) else "NO"
        lines.append(f"| {fam} | {variant} | {cells[0]} | {cells[1]} | {held} |")
    return "\n".join(lines)


def _cell(row: dict[str, Any] | None) -> str:
    if row is None:
        return "-"
    invisible = row["expect"] == "invisible"
    missed = " **(goal missed)**" if row.get("goal_met") is False else ""
    if row["first_divergence"]:
        tag = " (propagated: a container's output)" if invisible else ""
        return (
            f"exit {row['exit']}: {row['first_divergence']} {_g(row['error'])} / {_g(row['threshold'])}, "
            f"bug {_x(row.get('ratio'))}{missed}{tag}"
        )
    if row["expect"] == "clean":
        return f"exit {row['exit']}, worst {_x(row.get('ratio'))}{missed}"
    tag = " (not visible)" if invisible else ""
    return f"exit {row['exit']}, bug {_x(row.get('ratio'))}{missed}{tag}"


def run_setting(name: str, families: list[str], log: Callable[[str], None] = print) -> dict[str, Any]:
    """One setting of calibrate.py's SETTINGS, this script in a child process whose env holds its
    ISA caps (:func:`benchmarks.calibrate.run_setting`)."""
    return calibrate_module.run_setting(name, families, log, script=__file__, label="graft setting")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=DEFAULT_FAMILIES)
    parser.add_argument("--settings", default=",".join(DEFAULT_SETTINGS), help=f"of {', '.join(SETTINGS)}")
    parser.add_argument("--out", type=Path, help="write the outcomes as JSON")
    parser.add_argument("--markdown", action="store_true", help="print the docs table")
    parser.add_argument("--one", action="store_true", help="run in this process, as the env is (no settings)")
    parser.add_argument("--seed", type=int, default=0, help="with --one: calibrate.py's model seed")
    parser.add_argument("--merge", type=Path, nargs="+", help="instead of running: merge these --out files")
    args = parser.parse_args(argv)
    names = [n for n in args.families.split(",") if n]
    if args.one:
        return _main_one(names, args)
    if args.merge:
        results = merge_settings(args.merge)
    else:
        unknown = [n for n in args.settings.split(",") if n and n not in SETTINGS]
        if unknown:
            parser.error(f"unknown setting(s) {', '.join(unknown)}; known: {', '.join(SETTINGS)}")
        results = {}
        for setting in [n for n in args.settings.split(",") if n]:
            try:
                results[setting] = run_setting(setting, names)
            except (RuntimeError, OSError, json.JSONDecodeError) as exc:
                results[setting] = failed_setting(setting, exc)
    if args.markdown and results:
        print(markdown(next(iter(results.values()))["rows"]))
        print()
        print(settings_markdown(results))
        print()
        print(summary_markdown(results))
    if args.out:
        document = {"cpu": cpu_name(), "torch": torch.__version__, "settings": results}
        args.out.write_text(json.dumps(document, indent=1) + "\n")
    failed = {name: sum(1 for r in data["rows"] if not r["passed"]) for name, data in results.items()}
    for name, data in results.items():
        print(f"graft {name}: {len(data['rows']) - failed[name]} of {len(data['rows'])} as expected")
    errors = any(data.get("errors") for data in results.values())
    return 1 if any(failed.values()) or errors else 0


def _main_one(names: list[str], args: argparse.Namespace) -> int:
    """Every family in this process, as the env is; ``--seed`` is calibrate.py's model seed."""
    calibrate_module.SEED = args.seed
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="tracedump-calibrate-graft-"))
    outcomes: list[GraftOutcome] = []
    try:
        for name in names:
            outcomes += calibrate_family(name, root / name)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows = [o.row() for o in outcomes]
    if args.markdown:
        print(markdown(rows))
    if args.out:
        document = {"capability": torch.backends.cpu.get_cpu_capability(), "rows": rows}
        args.out.write_text(json.dumps(document, indent=1) + "\n")
    failed = [o for o in outcomes if not o.passed]
    print(f"{len(outcomes) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
