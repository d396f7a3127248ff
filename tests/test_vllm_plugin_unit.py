"""The vLLM plugin without vLLM: off is one env lookup, another vLLM gives one warning, and the
runner instrumentation on fake V1 and V2 model runners shaped like vLLM's (the real engine is
tested by ``make test-vllm``, tests_vllm/)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import tracedump
import tracedump.integrations.vllm as plugin
import tracedump.integrations.vllm_compat as vllm_compat

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str, **env: str) -> dict[str, Any]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TRACEDUMP_")}
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return {"out": json.loads(done.stdout.strip().splitlines()[-1]), "stderr": done.stderr}


_PROBE = """
import json, sys
import tracedump.integrations.vllm as p
p.register(); p.register()
import tracedump.dump.runtime as r
print(json.dumps({"vllm": sorted(m for m in sys.modules if m == "vllm" or m.startswith("vllm.")),
                  "torch": "torch" in sys.modules, "runtime": r.existing() is not None,
                  "settings": [m for m in sys.modules if m.startswith(("tracedump.config.", "pydantic"))
                               and m != "tracedump.config.switch"],
                  "registered": p._registered}))
"""


def test_off_is_one_env_lookup_no_vllm_import_no_torch() -> None:
    out = _python(_PROBE)["out"]
    assert out == {"vllm": [], "torch": False, "runtime": False, "settings": [], "registered": False}
    from tracedump.config.switch import env_name
    from tracedump.launch import sitecustomize

    # the bootstrap, which runs before tracedump may be imported, checks the switch's variable
    assert env_name("dir") == sitecustomize._DIR_VAR


def test_on_without_a_known_runner_warns_once_and_patches_nothing(tmp_path: Path) -> None:
    if importlib_has("vllm"):
        pytest.skip("vLLM is installed here: the real engine's case is tests_vllm/")
    done = _python(_PROBE, TRACEDUMP_DUMP_DIR=str(tmp_path))
    assert done["stderr"].count("no model runner found that this plugin knows") == 1
    assert done["out"]["registered"] is True
    assert list(tmp_path.iterdir()) == []


def test_under_tracedump_run_the_launchers_global_hooks_yield_to_the_plugin(tmp_path: Path) -> None:
    known = _LAUNCHED.format(runners='(("__main__", "Runner"),)')
    out = _python(known, TRACEDUMP_DUMP_DIR=str(tmp_path))["out"]
    assert out == {"auto": True, "before": 2, "after": 0, "roots": []}
    assert not list(tmp_path.glob("rank*"))  # the root called after the plugin got no dumper


def test_under_tracedump_run_an_unknown_vllm_keeps_the_launchers_dump(tmp_path: Path) -> None:
    done = _python(_LAUNCHED.format(runners='(("no.such", "Runner"),)'), TRACEDUMP_DUMP_DIR=str(tmp_path))
    assert done["out"] == {"auto": True, "before": 2, "after": 2, "roots": ["Linear"]}
    assert done["stderr"].count("only `tracedump run`'s auto-attach dumps it") == 1


_LAUNCHED = """
import json, torch
from torch.nn.modules import module as m
from tracedump.launch.auto import install
auto = install()  # what tracedump run's bootstrap does once torch is imported
before = len(m._global_forward_hooks) + len(m._global_forward_pre_hooks)

class Runner:
    def load_model(self): ...
    def execute_model(self, scheduler_output): ...

import tracedump.integrations.vllm as p
import tracedump.integrations.vllm_compat as c
c.RUNNERS = {runners}
p.register()
torch.nn.Linear(2, 2)(torch.ones(1, 2))
after = len(m._global_forward_hooks) + len(m._global_forward_pre_hooks)
print(json.dumps({{"auto": auto is not None, "before": before, "after": after, "roots": list(auto.roots)}}))
auto.remove()
"""


def importlib_has(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


# ----------------------------------------------------------------------------- fake runners


class _Model(nn.Module):
    """vLLM's shape: a forward over flattened tokens, logits computed outside it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(32, 8)
        self.body = nn.Linear(8, 8)
        self.logits_processor = nn.Linear(8, 32)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.body(self.embed(input_ids))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits_processor(hidden)


def _scheduled(**tokens: int) -> Any:
    return types.SimpleNamespace(num_scheduled_tokens=tokens, total_num_scheduled_tokens=sum(tokens.values()))


class FakeV1Runner:
    """The V1 runner's protocol: execute_model runs the forward and compute_logits and returns None,
    sample_tokens follows; dummy runs call the model directly."""

    def __init__(self) -> None:
        self.model: nn.Module | None = None
        self.input_batch = types.SimpleNamespace(req_ids=[])
        self.computed: dict[str, int] = {}
        self.state: Any = None
        self.pad = 0  # padding rows after the real ones (a CUDA-graph size or DP would add some)

    def load_model(self) -> None:
        self.model = _Model()

    def get_model(self) -> nn.Module:
        assert self.model is not None
        return self.model

    def execute_model(self, scheduler_output: Any, intermediate_tensors: Any = None) -> Any:
        if not scheduler_output.total_num_scheduled_tokens:
            return "empty"
        self.input_batch.req_ids = list(scheduler_output.num_scheduled_tokens)
        ids, positions, last = [], [], []
        for req in self.input_batch.req_ids:
            start = self.computed.get(req, 0)
            count = scheduler_output.num_scheduled_tokens[req]
            positions += range(start, start + count)
            ids += [(start + k + len(req)) % 32 for k in range(count)]
            self.computed[req] = start + count
            last.append(len(ids) - 1)
        pad = self.pad
        hidden = self._model_forward(
            input_ids=torch.tensor(ids + [0] * pad), positions=torch.tensor(positions + [0] * pad)
        )
        self.state = self.model.compute_logits(hidden[last])  # type: ignore[union-attr]
        return None

    def sample_tokens(self, grammar_output: Any) -> Any:
        logits, self.state = self.state, None
        return logits.argmax(-1)

    def _model_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, **kwargs: Any) -> Any:
        return self.model(input_ids=input_ids, positions=positions)  # type: ignore[misc]

    def _dummy_run(self, num_tokens: int) -> None:
        self.model(input_ids=torch.zeros(num_tokens, dtype=torch.long), positions=torch.arange(num_tokens))  # type: ignore[misc]

    def profile_run(self) -> None:
        self._dummy_run(16)
        self._dummy_run(4)

    def shutdown(self) -> None:
        pass


@pytest.fixture
def patched(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """The plugin registered, dumping on, with this file's fake runners as vLLM's."""
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path))
    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setattr(vllm_compat, "RUNNERS", ((__name__, "FakeV1Runner"), (__name__, "FakeV2Runner")))
    for cls in (FakeV1Runner, FakeV2Runner):
        monkeypatch.setattr(cls, "__init__", cls.__init__)  # undone after the test
    plugin.register()
    yield tmp_path


def test_padding_rows_are_declared_as_padding_and_aligned_by_token(patched: Path) -> None:
    """A CUDA-graph size pads a step: the tensors hold the padding rows, set_batch declares them as
    padding (seq id None), and ``--align tokens`` lines the real rows up with a step that has none."""
    runner = FakeV1Runner()
    runner.load_model()
    runner.pad = 2
    with warnings.catch_warnings():
        warnings.simplefilter("error", tracedump.TracedumpWarning)  # nothing to warn about
        runner.execute_model(_scheduled(a=3, b=2))
    runner.sample_tokens(None)
    runner.shutdown()
    (pass_file,) = sorted(patched.glob("rank*"))[0].glob("pass*.safetensors")
    from safetensors import safe_open

    with safe_open(str(pass_file), "pt") as handle:
        batch = json.loads(handle.metadata()["tracedump.batch"])
        assert handle.get_slice("body").get_shape() == [7, 8]  # the tensors hold the padding rows
    assert batch["seq_ids"] == ["a", "a", "a", "b", "b", None, None]
    assert batch["input_ids"][:5] == [1, 2, 3, 1, 2] and batch["positions"][:5] == [0, 1, 2, 0, 1]
    unpadded = FakeV1Runner()
    unpadded.load_model()  # the plugin dumps it too, into a run dir of its own
    unpadded.execute_model(_scheduled(a=3, b=2))
    unpadded.sample_tokens(None)
    unpadded.shutdown()
    padded_dir, unpadded_dir = sorted(patched.glob("rank*"))
    from tracedump.compare import compare

    report = compare(padded_dir, unpadded_dir, align="tokens")
    assert report.exit_code == 0
    body = [t for t in report.results if t.name == "body"]
    assert sorted(t.shape_a for t in body) == [(2, 8), (3, 8)]  # each request's rows, no padding


def test_a_v1_runner_gets_a_pass_per_step_with_its_batch_and_logits(patched: Path) -> None:
    runner = FakeV1Runner()
    assert runner.model is None and not list(patched.iterdir())
    runner.load_model()
    (run_dir,) = patched.glob("rank*")  # the run dir exists from the model's load on
    runner.profile_run()  # suspended, counted once (the outermost run)
    assert runner.execute_model(_scheduled()) == "empty"  # no tokens: no pass
    for step in (_scheduled(a=3, b=2), _scheduled(a=1, b=1), _scheduled(b=1)):
        assert runner.execute_model(step) is None
        runner.sample_tokens(None)
    runner.shutdown()
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["complete"] is True and manifest["skipped"] == {"profile": 1}
    run = tracedump.open_dump(patched).run()
    batches = run.batches()
    assert sorted(batches) == [0, 1, 2]
    assert batches[0].seq_ids == ("a", "a", "a", "b", "b") and batches[0].positions == (0, 1, 2, 0, 1)
    assert batches[0].input_ids == (1, 2, 3, 1, 2)  # padding rows left out
    assert batches[1].seq_ids == ("a", "b") and batches[1].positions == (3, 2)
    assert batches[2].seq_ids == ("b",) and batches[2].positions == (3,)
    assert run.passes[0]["logits_processor"].shape == (2, 32)  # computed outside the forward, in the pass
    assert run.passes[2]["logits_processor"].shape == (1, 32)


class FakeV2Runner(FakeV1Runner):
    """The V2 runner's protocol: prepare_inputs returns the step's InputBatch; dummy runs go through
    execute_model(dummy_run=True); compute_logits runs in sample_tokens."""

    def execute_model(
        self, scheduler_output: Any, intermediate_tensors: Any = None, dummy_run: bool = False
    ) -> Any:
        if dummy_run:
            self.model(input_ids=torch.zeros(4, dtype=torch.long), positions=torch.arange(4))  # type: ignore[misc]
            return None
        if not scheduler_output.total_num_scheduled_tokens:
            return "empty"
        batch = self.prepare_inputs(scheduler_output)
        self.state = self.model(input_ids=batch.input_ids, positions=torch.zeros(len(batch.input_ids)))  # type: ignore[misc]
        return None

    def prepare_inputs(self, scheduler_output: Any) -> Any:
        req_ids = list(scheduler_output.num_scheduled_tokens)
        counts = [scheduler_output.num_scheduled_tokens[r] for r in req_ids]
        starts = [self.computed.get(r, 0) for r in req_ids]
        for r, c in zip(req_ids, counts, strict=True):
            self.computed[r] = self.computed.get(r, 0) + c
        ids = torch.arange(sum(counts)) % 32
        return types.SimpleNamespace(
            req_ids=req_ids,
            num_reqs=len(req_ids),
            num_scheduled_tokens=counts,
            num_computed_tokens_np=starts,
            input_ids=ids,
        )

    def sample_tokens(self, grammar_output: Any) -> Any:
        hidden, self.state = self.state, None
        return self.model.compute_logits(hidden[-1:]).argmax(-1)  # type: ignore[union-attr]


def test_a_v2_runner_keeps_the_step_open_across_sample_tokens(patched: Path) -> None:
    runner = FakeV2Runner()
    runner.load_model()
    runner.execute_model(None, dummy_run=True)  # V2's dummy runs: suspended, counted
    runner.execute_model(_scheduled(x=4))
    runner.sample_tokens(None)
    runner.execute_model(_scheduled(x=1))
    runner.sample_tokens(None)
    runner.shutdown()
    run = tracedump.open_dump(patched).run()
    batches = run.batches()
    assert [b.positions for b in batches.values()] == [(0, 1, 2, 3), (4,)]
    assert "logits_processor" in run.passes[0] and "logits_processor" in run.passes[1]
    manifest = json.loads((next(patched.glob("rank*")) / "manifest.json").read_text())
    assert manifest["skipped"] == {"profile": 1}


def test_bench_vllm_is_skipped_with_a_message_where_vllm_is_absent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks import bench_vllm

    monkeypatch.setattr(bench_vllm, "VLLM_VENV_PYTHON", ROOT / "no-such-venv" / "python")
    monkeypatch.setattr(bench_vllm.importlib.util, "find_spec", lambda name: None)
    assert bench_vllm.run(quick=True) == {"skipped": bench_vllm.SKIP_MESSAGE}


class FakeRouter:
    """vLLM's router object (no module): ``select_experts`` returns its top-k in another order
    than HF's (smallest first here; the CPU router's ``topk(sorted=False)``: any order)."""

    def select_experts(self, hidden_states: torch.Tensor, router_logits: torch.Tensor, **kw: Any) -> Any:
        values, ids = torch.topk(router_logits, k=2, dim=-1)
        return torch.softmax(values, dim=-1).flip(-1), ids.to(torch.int32).flip(-1)


class FakeRunner(nn.Module):  # vLLM's MoERunner: the router is a plain attribute
    def __init__(self) -> None:
        super().__init__()
        self.router = FakeRouter()

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = self.router.select_experts(hidden_states=hidden, router_logits=router_logits)
        return hidden * (weights.sum(-1, keepdim=True) + ids.sum(-1, keepdim=True))


class LogitsProcessor(nn.Module):  # vLLM's: the head, then the soft cap
    def forward(self, head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self._get_logits(hidden, head) / 2.0) * 2.0

    def _get_logits(self, hidden: torch.Tensor, head: nn.Module) -> torch.Tensor:
        return head(hidden)


class FakeMoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Module()
        self.block.gate = nn.Linear(8, 4, bias=False)
        self.block.experts = FakeRunner()
        self.head = nn.Linear(8, 16, bias=False)
        self.logits_processor = LogitsProcessor()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.block.experts(x, self.block.gate(x))
        return self.logits_processor(self.head, hidden)


def test_the_routing_and_the_raw_logits_are_recorded_and_the_engines_numbers_kept(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """integrations/vllm_records.py on fakes shaped like vLLM's (the real engine: tests_vllm):
    each router's logits and top-k, rows ordered by weight; the head's logits before the cap."""
    from tracedump.integrations.vllm_records import record_head_logits, record_routing

    torch.manual_seed(0)
    model, x = FakeMoE(), torch.randn(5, 8)
    expected = model(x)
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path))
    monkeypatch.setenv("TRACEDUMP_DUMP_MODULES", "all")
    dumper = tracedump.attach(model)
    assert record_routing(model, dumper) == 1 and record_head_logits(model, dumper) == 1
    assert record_routing(model, dumper) == 0  # wrapped once
    with dumper.step():
        got = model(x)
    dumper.close()
    assert torch.equal(got, expected)  # the engine's numbers untouched
    stored = tracedump.open_dump(tmp_path).run().passes[0]
    logits = model.block.gate(x).detach()
    top, ids = torch.topk(logits, k=2, dim=-1)  # sorted: largest first
    assert torch.equal(stored["block.routing[logits]"], logits)
    assert torch.equal(stored["block.routing[topk_ids]"], ids.to(torch.int32))
    assert torch.allclose(stored["block.routing[topk_weights]"], torch.softmax(top, dim=-1))
    assert torch.allclose(stored["logits_processor[raw]"], model.head(model.block.experts(x, logits)))
    assert not torch.allclose(stored["logits_processor[raw]"], stored["logits_processor"])


def test_a_record_that_fails_is_counted_in_the_manifests_errors_and_the_engine_goes_on(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A routing record that raises (a vLLM whose router is called another way) never reaches the
    engine's forward, and the dump says so: the manifest's ``errors`` count it per call, through
    the public ``Dumper.report_error``, not a warning alone."""
    from tracedump.integrations import vllm_compat
    from tracedump.integrations.vllm_records import record_routing

    def broken(*args: Any) -> Any:
        raise RuntimeError("select_experts called another way")

    torch.manual_seed(0)
    model, x = FakeMoE(), torch.randn(5, 8)
    expected = model(x)
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path))
    monkeypatch.setenv("TRACEDUMP_DUMP_MODULES", "all")
    monkeypatch.setattr(vllm_compat, "select_experts_call", broken)
    dumper = tracedump.attach(model)
    assert record_routing(model, dumper) == 1
    for _ in range(2):
        with dumper.step():
            got = model(x)
        assert torch.equal(got, expected)
    dumper.close()
    manifest = json.loads((next(tmp_path.glob("rank*")) / "manifest.json").read_text())
    (error,) = [e for e in manifest["errors"] if "select_experts" in e["where"]]
    assert error["where"] == "vllm record select_experts in block.experts"
    assert error["type"] == "RuntimeError" and error["count"] == 2
    assert "called another way" in error["message"]
    assert "block.routing[logits]" not in tracedump.open_dump(tmp_path).run().passes[0]


def test_a_record_traced_into_a_fullgraph_compile_is_left_out_and_the_forward_runs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """vLLM compiles its model with ``fullgraph``: the routing record's Python (the dumper's pass
    state, a ``ContextVar``) cannot be traced into it, and before it was left out there it failed
    the engine's start. In compiled code the wrapped router returns its result unrecorded; called
    eagerly, the same wrapper records (the premise: the record is there to be left out)."""
    from tracedump.integrations.vllm_records import record_routing

    torch.manual_seed(0)
    model, x = FakeMoE(), torch.randn(5, 8)
    expected = model(x)
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path))
    monkeypatch.setenv("TRACEDUMP_DUMP_MODULES", "all")
    dumper = tracedump.attach(model)
    assert record_routing(model, dumper) == 1
    with dumper.step():
        model(x)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    with dumper.step():
        got = compiled(x)
    torch._dynamo.reset()
    assert torch.allclose(got, expected)
    dumper.close()
    manifest = json.loads((next(tmp_path.glob("rank*")) / "manifest.json").read_text())
    assert not [e for e in manifest["errors"] if "select_experts" in e["where"]]
    passes = tracedump.open_dump(tmp_path).run().passes
    assert any("routing" in name for name in passes[0])  # eager: recorded
    assert not any("routing" in name for name in passes.get(1, {}))  # compiled: left out


def test_without_compiled_the_engine_is_made_eager_and_with_it_compiling_stays_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The one decision (``_make_dumpable``) on fake ``EngineArgs``: eager unless ``COMPILED=1``;
    with it, ``enforce_eager`` stays as asked, vLLM's compile cache is off for the engine's
    processes, and CUDA graphs stay as configured (a dict ``compilation_config`` as ``LLM(...)``
    takes it, or a config object): their taps run at each replay."""
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path))
    monkeypatch.delenv("VLLM_DISABLE_COMPILE_CACHE", raising=False)
    plain = types.SimpleNamespace(enforce_eager=False, compilation_config={})
    plugin._make_dumpable(plain)
    assert plain.enforce_eager is True and plain.compilation_config == {}
    assert "VLLM_DISABLE_COMPILE_CACHE" not in os.environ

    monkeypatch.setenv("TRACEDUMP_DUMP_COMPILED", "1")
    compiled = types.SimpleNamespace(enforce_eager=False, compilation_config={"mode": 3})
    plugin._make_dumpable(compiled)
    assert compiled.enforce_eager is False
    assert compiled.compilation_config == {"mode": 3}  # no cudagraph_mode added
    assert os.environ["VLLM_DISABLE_COMPILE_CACHE"] == "1"
    graphed = types.SimpleNamespace(
        enforce_eager=False, compilation_config={"mode": 3, "cudagraph_mode": "FULL_AND_PIECEWISE"}
    )
    plugin._make_dumpable(graphed)
    assert graphed.compilation_config == {"mode": 3, "cudagraph_mode": "FULL_AND_PIECEWISE"}
    mode = types.SimpleNamespace(name="PIECEWISE")
    config = types.SimpleNamespace(cudagraph_mode=mode)
    as_object = types.SimpleNamespace(enforce_eager=False, compilation_config=config)
    plugin._make_dumpable(as_object)
    assert as_object.enforce_eager is False and as_object.compilation_config.cudagraph_mode is mode

    monkeypatch.setenv("TRACEDUMP_DUMP_COMPILED", "maybe")  # a bad value fails before the engine starts
    with pytest.raises(tracedump.ConfigError, match="TRACEDUMP_DUMP_COMPILED"):
        plugin._make_dumpable(types.SimpleNamespace(enforce_eager=False, compilation_config={}))


@pytest.mark.parametrize("compiled", [False, True])
def test_the_runner_guard_warns_of_cuda_graphs_only_without_compiled(
    tmp_path: Path, compiled: bool, recwarn: pytest.WarningsRecorder
) -> None:
    """A runner configured for piecewise CUDA graphs and compilation: an eager dumper cannot see
    those forwards (one warning each); a ``COMPILED=1`` dumper's taps run in both, so no warning."""
    model = nn.Linear(2, 2)
    dumper = tracedump.attach(model, {"dir": tmp_path, "compiled": compiled})
    assert dumper is not None
    piecewise, compiling = types.SimpleNamespace(name="PIECEWISE"), types.SimpleNamespace(name="VLLM_COMPILE")
    config = types.SimpleNamespace(cudagraph_mode=piecewise, mode=compiling)
    hooks = types.SimpleNamespace(runner=types.SimpleNamespace(compilation_config=config), dumper=dumper)
    from tracedump.dump.runtime import runtime

    try:
        with runtime().warn.fresh():
            plugin.RunnerHooks._guard_cuda_graphs(hooks)  # type: ignore[arg-type]
    finally:
        dumper.close()
    said = " ".join(str(w.message) for w in recwarn.list)
    assert ("CUDA graphs disabled" in said) is not compiled
    assert ("torch.compile disabled" in said) is not compiled
