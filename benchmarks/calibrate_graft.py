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

Run: ``python benchmarks/calibrate_graft.py [--families llama,t5] [--markdown] [--out FILE]``
(``make calibrate`` runs it after ``calibrate.py``).
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

import tracedump
from benchmarks import common
from benchmarks.calibrate import FAMILIES, INIT, Family

# The layer-level regex of each family (what `--graft-level` would be given).
LEVELS = {
    "llama": r"layers\.\d+$",
    "mixtral": r"layers\.\d+$",
    "qwen2moe": r"layers\.\d+$",
    "olmoe": r"layers\.\d+$",
    "gpt2": r"h\.\d+$",
    "t5": r"block\.\d+$",
    "unet": r"(down_blocks|up_blocks)\.\d+$|mid_block$",
}
LEAF_VISIBLE = ("norm_eps",)  # bugs inside a leaf: the only ones a leaf-level graft can see
# The planted layer of each family, as its module (for the layer-level first divergence).
PLANTED = {
    "llama": "model.layers.3",
    "mixtral": "model.layers.2",
    "qwen2moe": "model.layers.2",
    "olmoe": "model.layers.2",
    "gpt2": "transformer.h.2",
    "t5": "decoder.block.1",
    "unet": "mid_block",
}


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
            visible = level == "layer" or bug in LEAF_VISIBLE
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

    def row(self) -> dict[str, Any]:
        return {
            "family": self.case.family,
            "variant": self.case.variant,
            "level": self.case.level,
            "expect": self.case.expect,
            "exit": self.exit_code,
            "first_divergence": self.first,
            "error": self.error,
            "threshold": self.threshold,
            "worst_clean_ratio": self.worst_clean,
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
    return GraftOutcome(
        case,
        report.exit_code,
        name,
        first.error if first else None,
        first.threshold if first else None,
        max(outside, default=0.0),
        passed,
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
            f"worst clean {outcome.worst_clean:.2f}"
        )
        shutil.rmtree(grafted, ignore_errors=True)
    log(f"{name}: {len(outcomes)} grafted cases in {time.perf_counter() - started:.1f} s")
    return outcomes


def _g(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def markdown(outcomes: list[GraftOutcome]) -> str:
    """One row per family and run, the leaf and layer columns side by side (the docs table)."""
    lines = [
        "| family | bf16 run, grafted from fp32 | leaf level | layer level | held |",
        "|---|---|---|---|---|",
    ]
    by_row: dict[tuple[str, str], dict[str, GraftOutcome]] = {}
    for o in outcomes:
        by_row.setdefault((o.case.family, o.case.variant), {})[o.case.level] = o
    for (fam, variant), levels in by_row.items():
        cells = []
        for level in ("leaf", "layer"):
            o = levels.get(level)
            if o is None:
                cells.append("-")
            elif o.first:
                tag = " (propagated: a container's output)" if o.case.expect == "invisible" else ""
                cells.append(f"exit {o.exit_code}: {o.first} {_g(o.error)} / {_g(o.threshold)}{tag}")
            else:
                tag = " (not visible)" if o.case.expect == "invisible" else ""
                cells.append(f"exit {o.exit_code}, worst {o.worst_clean:.2f}x{tag}")
        held = "yes" if all(o.passed for o in levels.values()) else "NO"
        lines.append(f"| {fam} | {variant} | {cells[0]} | {cells[1]} | {held} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="llama,gpt2,mixtral,qwen2moe,olmoe,t5")
    parser.add_argument("--out", type=Path, help="write the outcomes as JSON")
    parser.add_argument("--markdown", action="store_true", help="print the docs table")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="tracedump-calibrate-graft-"))
    outcomes: list[GraftOutcome] = []
    try:
        for name in [n for n in args.families.split(",") if n]:
            outcomes += calibrate_family(name, root / name)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.markdown:
        print(markdown(outcomes))
    if args.out:
        args.out.write_text(json.dumps([o.row() for o in outcomes], indent=1) + "\n")
    failed = [o for o in outcomes if not o.passed]
    print(f"{len(outcomes) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
