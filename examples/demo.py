"""``make demo``: find a bug planted in one layer of a model port, with one ``tracedump diff``.

The setting is the everyday one: an engine author ported a Hugging Face Llama (``examples/port.py``:
own module names, fused q/k/v and gate/up, own RMSNorm and rotary) and the logits are slightly
off. The demo

1. dumps four runs, switched on by env vars only: the reference (HF ``transformers``, random
   weights from a fixed seed, no download) through ``tracedump run`` in fp32 and bf16, and the port,
   which calls ``tracedump.attach()`` at start-up like an engine, with and without the planted bug;
2. runs ``tracedump diff`` on the buggy port against the reference with no flag: the two module
   trees are paired by the weights each run recorded (the port loaded the reference's), fresh norms
   and other values several modules hold by their place (docs/comparator.md, "How two runs are
   paired"); prints its table, checks that it names the planted layer as the first divergence, and
   writes the plot and the report page (``demo_out/report.html``);
3. shows that the bug-free port passes (exit 0), and that bf16 against fp32 is within the default
   tolerances (exit 0);
4. shows a bug only grafting finds: the bf16 port with one MLP output 2% too large passes against
   the fp32 reference even with ``--baseline``, and is named when each block runs on the
   reference's own input (``TRACEDUMP_DUMP_GRAFT_FROM``, docs/comparator.md).

    python examples/demo.py [--out demo_out] [--bug-layer 2] [--quick]

Exit status 0 when every expectation held, 1 otherwise (with the reason).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent
REPO = EXAMPLES.parent
DEFAULT_OUT = REPO / "demo_out"
DEFAULT_BUG_LAYER = 2
LAYERS = 4  # examples/reference.py: reference_config().num_hidden_layers

# Dump the modules both models have: embedding, each decoder block and its four parts, final norm, head.
PORT_FILTER = r"^(tok_emb|blocks\.\d+(\.(norm1|attn|norm2|mlp))?|final_norm|head)$"
REFERENCE_FILTER = (
    r"^(model\.embed_tokens|model\.layers\.\d+(\.(input_layernorm|self_attn|post_attention_layernorm|mlp))?"
    r"|model\.norm|lm_head)$"
)
DUMPS = (
    "ref_fp32",
    "ref_bf16",
    "port_buggy",
    "port_fixed",
    "port_buggy_bf16",
    *("ref_inputs", "port_mlp", "port_mlp_graft"),
)
GRAFT_LEVEL = r"^blocks\.\d+$"  # step 4: each block grafted onto the reference's own input
PLOT = "port_vs_reference.png"
HTML = "report.html"  # the buggy port's diff as a page: open it in a browser, attach it to a bug report
REPORTS = {
    "diff_buggy": "port_vs_reference.json",
    "diff_fixed": "fixed.json",
    "diff_bf16": "bf16.json",
    "diff_bf16_bug": "bf16_port_vs_fp32_reference.json",
    "diff_mlp": "mlp_propagated.json",
    "diff_mlp_graft": "mlp_grafted.json",
}


@dataclass
class Job:
    """One subprocess of the demo: what it is, how it runs, where its output goes."""

    label: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    shown: str = ""
    returncode: int | None = None
    output: str = ""
    seconds: float = 0.0

    def run(self, log_dir: Path) -> Job:
        started = time.perf_counter()
        done = subprocess.run(
            self.argv,
            cwd=REPO,
            env={**os.environ, **self.env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            check=False,
        )
        self.seconds = time.perf_counter() - started
        self.returncode, self.output = done.returncode, done.stdout
        (log_dir / f"{self.label}.log").write_text(f"$ {self.shown}\n{self.output}")
        return self


def python(script: str, *args: str) -> list[str]:
    return [sys.executable, str(EXAMPLES / script), *args]


def tracedump_cli(*args: str) -> list[str]:
    """The CLI of the tracedump this interpreter imports (``tracedump`` on PATH may be another)."""
    return [sys.executable, "-m", "tracedump", *args]


def dump_env(directory: Path, module_filter: str) -> dict[str, str]:
    """Dumping is switched on by env vars only: a dump dir, every module (not just leaves), a filter."""
    return {
        "TRACEDUMP_DUMP_DIR": str(directory),
        "TRACEDUMP_DUMP_MODULES": "all",
        "TRACEDUMP_DUMP_FILTER": module_filter,
    }


def shown_command(env: dict[str, str], argv: list[str]) -> str:
    """How a person would type ``argv``: env first, ``python``/``tracedump`` instead of full paths."""
    words = [f"{k}={shlex.quote(relative(v))}" for k, v in env.items() if k != "TRACEDUMP_DUMP_FILTER"]
    if "TRACEDUMP_DUMP_FILTER" in env:
        words.append("TRACEDUMP_DUMP_FILTER=...")
    rest = list(argv)
    if rest[:3] == [sys.executable, "-m", "tracedump"]:
        rest = ["tracedump", *rest[3:]]
    rest = ["python" if word == sys.executable else word for word in rest]
    return " ".join(words + [shlex.quote(relative(word)) for word in rest])


def relative(word: str) -> str:
    try:
        return str(Path(word).relative_to(Path.cwd())) if word.startswith("/") else word
    except ValueError:
        return word


def dump_jobs(out: Path, bug_layer: int, quick: bool) -> list[Job]:
    """The dumps: the fp32 reference and the buggy port always; the bug-free port and bf16 unless quick."""
    reference = tracedump_cli("run", "--", *python("reference.py"))
    jobs = [
        Job("ref_fp32", reference, dump_env(out / "ref_fp32", REFERENCE_FILTER)),
        Job(
            "port_buggy",
            python("port.py", "--bug-layer", str(bug_layer)),
            dump_env(out / "port_buggy", PORT_FILTER),
        ),
    ]
    if not quick:
        jobs += [
            Job("port_fixed", python("port.py"), dump_env(out / "port_fixed", PORT_FILTER)),
            Job(
                "ref_bf16", [*reference, "--dtype", "bfloat16"], dump_env(out / "ref_bf16", REFERENCE_FILTER)
            ),
            Job(
                "port_buggy_bf16",
                python("port.py", "--bug-layer", str(bug_layer), "--bug", "eps", "--dtype", "bfloat16"),
                dump_env(out / "port_buggy_bf16", PORT_FILTER),
            ),
            Job(
                "ref_inputs",
                reference,
                {**dump_env(out / "ref_inputs", REFERENCE_FILTER), "TRACEDUMP_DUMP_INPUTS": "1"},
            ),
            Job("port_mlp", python("port.py", *MLP_BUG), dump_env(out / "port_mlp", PORT_FILTER)),
        ]
    return jobs


MLP_BUG = ("--bug-layer", "2", "--bug", "mlp", "--dtype", "bfloat16")


def graft_job(out: Path) -> Job:
    """Step 4's grafted run: the bf16 port with the MLP bug, each block fed the fp32 reference's input."""
    env = {
        **dump_env(out / "port_mlp_graft", PORT_FILTER),
        "TRACEDUMP_DUMP_GRAFT_FROM": str(out / "ref_inputs"),
        "TRACEDUMP_DUMP_GRAFT_LEVEL": GRAFT_LEVEL,
        "TRACEDUMP_DUMP_GRAFT_MAP": r"^blocks\.=model.layers.",
    }
    return Job("port_mlp_graft", python("port.py", *MLP_BUG), env)


def diff_jobs(out: Path, quick: bool) -> list[Job]:
    """The comparisons, A (under test) first and B (reference) second, each writing a JSON report."""

    def diff(label: str, a: str, b: str, *options: str) -> Job:
        return Job(
            label,
            tracedump_cli("diff", str(out / a), str(out / b), *options, "--json", str(out / REPORTS[label])),
        )

    jobs = [
        diff(
            "diff_buggy",
            "port_buggy",
            "ref_fp32",
            "--plot",
            str(out / PLOT),
            "--html",
            str(out / HTML),
        )
    ]
    if not quick:
        jobs += [
            diff("diff_fixed", "port_fixed", "ref_fp32"),
            diff("diff_bf16", "ref_bf16", "ref_fp32"),
            diff("diff_bf16_bug", "port_buggy_bf16", "ref_fp32", "--baseline", str(out / "ref_bf16")),
            diff("diff_mlp", "port_mlp", "ref_fp32", "--baseline", str(out / "ref_bf16")),
            diff("diff_mlp_graft", "port_mlp_graft", "ref_inputs"),
        ]
    return jobs


def run_all(jobs: list[Job], log_dir: Path) -> list[Job]:
    """Run independent jobs side by side: on a small machine most of each is interpreter start-up."""
    for job in jobs:
        job.shown = job.shown or shown_command(job.env, job.argv)
    with ThreadPoolExecutor(max_workers=min(len(jobs), max(2, os.cpu_count() or 2))) as pool:
        return list(pool.map(lambda job: job.run(log_dir), jobs))


def first_divergence(report_path: Path) -> tuple[str | None, str | None]:
    """``(name in the port, name in the reference)`` of the first divergent tensor in a ``--json`` report."""
    first = json.loads(report_path.read_text())["summary"]["first_divergence"]
    if not first:
        return None, None
    return first["name"], first.get("name_b") or first["name"]


def closest_call(report_path: Path) -> tuple[str, float, float] | None:
    """``(name, error, tolerance)`` of the tensor that came closest to its tolerance: how much room
    a passing comparison had."""
    tensors = [r for r in json.loads(report_path.read_text())["tensors"] if r.get("tolerance")]
    if not tensors:
        return None
    worst = max(tensors, key=lambda r: (r["error"] or 0.0) / r["tolerance"])
    return worst["name"], worst["error"] or 0.0, worst["tolerance"]


def layer_of(name: str | None) -> int | None:
    match = re.search(r"(?:^|\.)(?:layers|blocks)\.(\d+)(?:\.|\[|$)", name or "")
    return int(match.group(1)) if match else None


class Demo:
    """The demo's steps, each printing what it ran and what it found; ``failures`` collects surprises."""

    def __init__(self, out: Path, bug_layer: int, quick: bool) -> None:
        self.out, self.bug_layer, self.quick = out, bug_layer, quick
        self.logs = out / "logs"
        self.failures: list[str] = []

    def prepare(self) -> None:
        """Remove what an earlier demo wrote here (and only that: ``--out`` may be any folder)."""
        for name in (*DUMPS, "logs"):
            shutil.rmtree(self.out / name, ignore_errors=True)
        for name in (PLOT, HTML, *REPORTS.values()):
            (self.out / name).unlink(missing_ok=True)
        self.logs.mkdir(parents=True)

    def dump(self) -> bool:
        jobs = dump_jobs(self.out, self.bug_layer, self.quick)
        print(f"\n[1/4] Dumping {len(jobs)} runs, switched on by env vars only (side by side):")
        print(f"  TRACEDUMP_DUMP_FILTER, port:      {PORT_FILTER}")
        print(f"  TRACEDUMP_DUMP_FILTER, reference: {REFERENCE_FILTER}")
        done = run_all(jobs, self.logs)
        if not self.quick:  # grafted onto a reference that must exist first
            done += run_all([graft_job(self.out)], self.logs)
        for job in done:
            print(f"  {job.label:<11} {job.seconds:5.1f}s  {job.shown}")
            if job.returncode != 0:
                self.failures.append(f"{job.label} exited {job.returncode}; see {self.logs / job.label}.log")
                print(job.output)
        return not self.failures

    def compare(self) -> None:
        done = {job.label: job for job in run_all(diff_jobs(self.out, self.quick), self.logs)}
        buggy = done["diff_buggy"]
        print(f"\n[2/4] The buggy port against the reference ({buggy.seconds:.1f}s):\n  $ {buggy.shown}\n")
        print(buggy.output.rstrip())
        self.check_buggy(buggy)
        if self.quick:
            return
        print("\n[3/4] What must pass:")
        self.check_clean(done["diff_fixed"], "the port without the bug, against the reference")
        self.check_clean(done["diff_bf16"], "the reference in bf16, against itself in fp32")
        self.check_bf16_bug(done["diff_bf16_bug"])
        self.check_graft(done["diff_mlp"], done["diff_mlp_graft"])

    def check_graft(self, plain: Job, grafted: Job) -> None:
        """A bug only grafting finds: an MLP output 2% too large in the bf16 port. Against the fp32
        reference (even with --baseline) it hides in the noise carried from upstream; grafted, each
        block runs on the reference's own input and its local error stands out."""
        print(
            "\n[4/4] A bug only grafting finds: the bf16 port with its layer-2 MLP output 2% too large.\n"
            f"  propagated, with the bf16 baseline:\n    $ {plain.shown}"
        )
        print(
            f"    exit {plain.returncode}"
            + (": not found (the bug is as large as the bf16 noise)" if plain.returncode == 0 else "")
        )
        print(f"  each block grafted onto the fp32 reference's input (INPUTS=1):\n    $ {grafted.shown}")
        name, _ = first_divergence(self.out / REPORTS[grafted.label])
        if grafted.returncode != 1 or layer_of(name) != 2:
            self.failures.append(f"grafted MLP bug: exit {grafted.returncode}, first divergence {name}")
            print(grafted.output)
            return
        report = json.loads((self.out / REPORTS[grafted.label]).read_text())
        row = report["tensors"][report["summary"]["first_divergence"]["index"]]
        print(
            f"    exit 1, first divergence {name}: local error {row['error']:.2g} > {row['tolerance']:.2g} "
            "(what the block alone may add in bf16; no baseline)"
        )

    def check_bf16_bug(self, job: Job) -> None:
        """The port in bf16 (with a norm-eps bug) against the fp32 reference, the bf16 reference as
        --baseline: the bug is found in bf16, where no fixed threshold tells it from rounding."""
        print(
            "\n  the port in bf16 with an eps bug in the same layer, against the fp32 reference, "
            f"the bf16 reference as baseline:\n    $ {job.shown}"
        )
        report = json.loads((self.out / REPORTS[job.label]).read_text())
        first = report["summary"]["first_divergence"]
        if job.returncode != 1 or first is None or layer_of(first["name"]) != self.bug_layer:
            self.failures.append(
                f"bf16 port vs fp32 reference with --baseline: exit {job.returncode}, {first}"
            )
            print(job.output)
            return
        row = report["tensors"][first["index"]]
        print(
            f"    exit 1, first divergence {first['name']}: rel_diff {row['rel_diff']:.2g}, "
            f"{row['x_noise']:.3g}x the bf16 noise measured there ({row['noise']:.2g});\n"
            f"    a fixed bf16 threshold (1e-2, the old default) would have passed it"
            if row["rel_diff"] < 1e-2
            else f"    exit 1, first divergence {first['name']}: {row['x_noise']:.3g}x the bf16 noise"
        )

    def check_buggy(self, job: Job) -> None:
        report = self.out / REPORTS[job.label]
        if job.returncode != 1:
            self.failures.append(f"diff of the buggy port exited {job.returncode}, expected 1 (a divergence)")
            return
        port_name, reference_name = first_divergence(report)
        found = layer_of(port_name)
        print(f"\n  first divergence: {port_name}  (reference: {reference_name})")
        if found != self.bug_layer:
            self.failures.append(f"the first divergence is {port_name!r}, not in layer {self.bug_layer}")
        else:
            print(f"  = layer {found}, the layer with the planted bug (rotary base 500000 instead of 10000)")

    def check_clean(self, job: Job, what: str) -> None:
        verdict = "exit 0, no divergence" if job.returncode == 0 else f"exit {job.returncode}"
        print(f"  {what}: {verdict}  ({job.seconds:.1f}s)\n    $ {job.shown}")
        if job.returncode != 0:
            self.failures.append(f"{what}: expected exit 0, got {job.returncode}")
            print(job.output)
            return
        closest = closest_call(self.out / REPORTS[job.label])
        if closest and closest[1] == 0:
            print("    every tensor identical (rel_diff 0)")
        elif closest:
            name, error, tolerance = closest
            print(f"    closest call: {name}, rel_diff {error:.2g} against a tolerance of {tolerance:.0e}")

    def summary(self, seconds: float) -> None:
        print(f"\nFiles in {relative(str(self.out))}/:")
        for name, what in (
            (HTML, "the report page: summary, error per layer and per token, every tensor"),
            (PLOT, "the plot: difference per layer, buggy port vs reference"),
            (REPORTS["diff_buggy"], "its full report (--json); fixed.json, bf16.json: the other diffs"),
            ("port_buggy/, port_fixed/", "the port's dumps (tracedump ls / tracedump show)"),
            ("ref_fp32/, ref_bf16/", "the reference's dumps"),
            ("logs/", "the output of every command"),
        ):
            print(f"  {name:<26} {what}")
        if self.failures:
            print(f"\nDEMO FAILED after {seconds:.0f}s:\n  " + "\n  ".join(self.failures))
        else:
            print(f"\nDemo OK in {seconds:.0f}s: tracedump named layer {self.bug_layer}, the planted one.")
        if (self.out / HTML).is_file():
            print(f"Open the report in a browser: {self.out / HTML}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Find a bug planted in one layer of a model port.")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (emptied first)")
    parser.add_argument(
        "--bug-layer", type=int, default=DEFAULT_BUG_LAYER, choices=range(LAYERS), help="layer to plant it in"
    )
    parser.add_argument(
        "--quick", action="store_true", help="only the core: buggy port vs fp32 reference (for the tests)"
    )
    args = parser.parse_args(argv)
    started = time.perf_counter()
    demo = Demo(args.out.resolve(), args.bug_layer, args.quick)
    print(
        f"tracedump demo: a port of a {LAYERS}-layer Llama with a bug planted in layer {args.bug_layer},"
        f" found by comparing activations.\nOutput: {demo.out}"
    )
    demo.prepare()
    if demo.dump():
        demo.compare()
    demo.summary(time.perf_counter() - started)
    return 1 if demo.failures else 0


if __name__ == "__main__":
    sys.exit(main())
