"""Shared fixtures: tiny real HF models (random weights, no download) and a clean environment."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import tracedump
import tracedump.dump.cuda
import tracedump.dump.runtime

# The numerics tests' model seed: `make test-numerics` reruns them with other seeds, so a premise
# that holds for one draw of random weights only shows. Read once, at import: the autouse fixture
# below removes every TRACEDUMP_* variable from each test's environment. (Not a DUMP_ setting.)
MODEL_SEED = int(os.environ.get("TRACEDUMP_TEST_SEED", "0") or 0)


def pytest_report_header(config: pytest.Config) -> str:
    """Which rounding the numerics ran under: the seed and the ISA caps, in every run's header."""
    names = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
    caps = [f"{name}={os.environ[name]}" for name in names if name in os.environ]
    return f"tracedump numerics: model seed {MODEL_SEED}, cpu {torch.backends.cpu.get_cpu_capability()}" + (
        f" ({', '.join(caps)})" if caps else ""
    )


@contextlib.contextmanager
def model_seed_offset(offset: int = MODEL_SEED) -> Iterator[None]:
    """``torch.manual_seed(s)`` seeds ``s + offset`` inside: reseeds a builder that seeds itself
    (``benchmarks.calibrate``'s families call ``torch.manual_seed(0)``) without editing it."""
    real = torch.manual_seed
    torch.manual_seed = lambda seed: real(int(seed) + offset)  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.manual_seed = real  # type: ignore[assignment]


def seeded_build(build: Callable[..., torch.nn.Module]) -> Callable[..., torch.nn.Module]:
    """A family's ``build`` drawing its weights with :data:`MODEL_SEED` added to its own seed."""

    def wrapped(*args: object, **kwargs: object) -> torch.nn.Module:
        with model_seed_offset():
            return build(*args, **kwargs)

    return wrapped


@pytest.fixture(autouse=True, scope="session")
def _one_intra_op_thread() -> None:
    """Tiny forwards on 2 cores: OpenMP workers spin-waiting beside tracedump's writer thread make them
    ~20x slower. One intra-op thread keeps the suite fast; numbers do not depend on it."""
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _no_tracedump_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts with no TRACEDUMP_* variable, whatever the developer's shell exports."""
    for name in list(os.environ):
        if name.upper().startswith("TRACEDUMP_"):
            monkeypatch.delenv(name)


def make_tiny_llama(layers: int = 2, seed: int = 0, **overrides: object) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        **overrides,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


@pytest.fixture
def tiny_llama() -> torch.nn.Module:
    return make_tiny_llama()


@pytest.fixture(scope="module")
def llama() -> torch.nn.Module:
    """The tiny Llama, built once per test file and shared by its tests (a file may override it)."""
    return make_tiny_llama()


@pytest.fixture
def prompt_ids() -> torch.Tensor:
    return torch.tensor([[3, 14, 15, 9, 26, 5]])


@pytest.fixture
def dump_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``TRACEDUMP_DUMP_DIR`` set to a fresh ``dump`` folder (not created) under the test's tmp_path."""
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path / "dump"))
    return tmp_path / "dump"


@pytest.fixture
def fresh_warn_once() -> Iterator[None]:
    """``warn_once`` remembers keys for the whole process: start a test as if nothing had warned yet.
    Opt in per file with ``pytestmark = pytest.mark.usefixtures("fresh_warn_once")``."""
    found = tracedump.dump.runtime.existing()  # none yet: nothing has warned
    with contextlib.nullcontext() if found is None else found.warn.fresh():
        yield


def graft_bf16_onto_fp32(
    model: torch.nn.Module, x: torch.Tensor, tmp_path: Path, level: str
) -> tuple[Path, Path]:
    """``model`` dumped in fp32 with its inputs (``tmp_path/ref``), then run in bf16 grafted onto
    that reference at ``level`` (``tmp_path/g``): the grafted dump and its reference."""
    dumper = tracedump.attach(model, {"dir": str(tmp_path / "ref"), "modules": "all", "inputs": True})
    assert dumper is not None
    with torch.no_grad():
        model(x)
    dumper.close()
    model = model.to(torch.bfloat16)
    with torch.no_grad(), tracedump.graft(model, tmp_path / "ref", dir=tmp_path / "g", level=level) as g:
        g.run(x.to(torch.bfloat16))
    return tmp_path / "g", tmp_path / "ref"


def read_passes(run_dir: Path) -> dict[int, dict[str, torch.Tensor]]:
    """Every pass of the run in ``run_dir``, loaded: pass index -> {key: tensor}."""
    run = tracedump.open_dump(run_dir).run()
    return {index: pass_file.load() for index, pass_file in run.passes.items()}


def tracedump_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    """The messages of the ``TracedumpWarning``s among ``caught``."""
    return [str(w.message) for w in caught if issubclass(w.category, tracedump.TracedumpWarning)]


def free_port() -> int:
    """A TCP port free now, for a gloo group's rendezvous (tests may run side by side)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def checkpoint_source(tensor: torch.Tensor) -> dict[str, Any]:
    """A checkpoint tensor as ``correspondence.json`` records it (shape, dtype, fingerprint)."""
    from tracedump.dump.weights import fingerprint

    return {"shape": list(tensor.shape), "dtype": "torch.float32", "fingerprint": fingerprint(tensor)}


def write_recorded_run(
    run_dir: Path, manifest: dict[str, Any], tensors: dict[str, torch.Tensor], record: Any
) -> None:
    """One run dir as a dumper leaves it: pass 0 of full tensors, the manifest, ``correspondence.json``."""
    from tracedump.dump.writer import save_tensors_atomic
    from tracedump.store.correspondence import write_correspondence
    from tracedump.store.format import pass_file_name

    run_dir.mkdir(parents=True)
    save_tensors_atomic(run_dir / pass_file_name(0), tensors, {"tracedump.mode": "full"})
    (run_dir / "manifest.json").write_text(json.dumps({**manifest, "settings": {"mode": "full"}}))
    write_correspondence(run_dir, record)
