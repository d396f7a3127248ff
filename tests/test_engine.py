"""The reference engine (``examples/engine.py``) with each gate, alone and combined.

The claim under test: with the right gate, an engine's dump lines up with a batch-1 reference —
pass 0 is the prefill and its module outputs equal those of one plain ``model(prompt_ids)`` call.
"""

from __future__ import annotations

import importlib.util
import sys
import warnings
from pathlib import Path
from types import ModuleType

import pytest
import torch
from conftest import read_passes

import tracedump

pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("fresh_warn_once")

ENGINE_PATH = Path(__file__).resolve().parents[1] / "examples" / "engine.py"
PROMPT = [5, 9, 13, 2, 7, 11]  # 6 tokens: not the profile (32) or warm-up (1 per row) token counts
NEW_TOKENS = 4
LEAF_MODULES = 24  # leaves of the 2-layer tiny Llama


def _load_engine_module() -> ModuleType:
    """Import examples/engine.py by path (examples/ is a plain folder, not a package)."""
    name = "tracedump_reference_engine"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ENGINE_PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # pydantic resolves the config's annotations through sys.modules
    spec.loader.exec_module(module)
    return module


engine_module = _load_engine_module()


def _run_engine(config: engine_module.EngineConfig | None = None) -> tuple[torch.Tensor, Path | None]:
    """Start an engine, serve PROMPT, close it; the generated ids and the run dir (None when off)."""
    with engine_module.Engine(config) as engine:
        tokens = engine.generate(PROMPT, NEW_TOKENS)
        run_dir = engine.dumper.run_dir if engine.dumper is not None else None
    return tokens, run_dir


def _module_outputs(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Module outputs only: records (logits, margin_<n>, token_ids) are not module names."""
    return {k: v for k, v in tensors.items() if k.split("[")[0] in _leaf_names()}


def _leaf_names() -> set[str]:
    model = engine_module.build_model(engine_module.ModelConfig())
    return {name for name, module in model.named_modules() if not list(module.children())}


def _reference_dump(directory: Path) -> dict[str, torch.Tensor]:
    """Batch-1 reference: the same model, plain attach(), one ``model(prompt_ids)`` call."""
    model = engine_module.build_model(engine_module.ModelConfig())
    dumper = tracedump.attach(model, tracedump.DumpConfig(dir=directory))
    assert dumper is not None
    with dumper, torch.inference_mode():
        model(torch.tensor([PROMPT]))
    return read_passes(dumper.run_dir)[0]


# --------------------------------------------------------------------------- engine basics


def test_engine_without_dump_dir_attaches_nothing_and_generates_the_same_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain_tokens, run_dir = _run_engine()
    assert run_dir is None
    assert plain_tokens.shape == (1, NEW_TOKENS) and plain_tokens.dtype == torch.int64

    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path))
    dumped_tokens, dumped_dir = _run_engine()
    assert dumped_dir is not None and dumped_dir.parent == tmp_path
    assert torch.equal(plain_tokens, dumped_tokens)  # dumping never changes what the engine computes


def test_decode_steps_feed_one_token_through_the_kv_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path))
    monkeypatch.setenv("TRACEDUMP_DUMP_MAX_ROWS", "1")
    _, run_dir = _run_engine()
    passes = read_passes(run_dir)
    embedding = engine_module.build_model(engine_module.ModelConfig()).model.embed_tokens.weight.detach()
    assert torch.equal(passes[0]["model.embed_tokens"][0], embedding[PROMPT])
    for step in range(1, NEW_TOKENS):
        # each decode step embeds exactly one token: the one the previous step chose
        previous_token = passes[step - 1]["token_ids"]
        assert torch.equal(passes[step]["model.embed_tokens"], embedding[previous_token][:, None, :])


def test_profile_forward_leaves_no_file_and_no_pass_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path))
    config = engine_module.EngineConfig(warmup_batch_sizes=())
    with engine_module.Engine(config) as engine:
        assert engine.dumper is not None
        assert engine.dumper.pass_index == 0
        assert not list(engine.dumper.run_dir.glob("pass*"))
        engine.generate(PROMPT, 1)
        run_dir = engine.dumper.run_dir
        skipped = dict(engine.dumper.skipped)
    passes = read_passes(run_dir)
    assert list(passes) == [0]
    assert passes[0]["model.embed_tokens"].shape == (1, len(PROMPT), 32)  # not the 32-token profile
    assert skipped == {}


def test_without_gates_warm_up_batches_take_the_first_pass_indices(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The control experiment: what the gates are for."""
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path))
    _, run_dir = _run_engine()
    passes = read_passes(run_dir)
    assert sorted(passes) == list(range(2 + NEW_TOKENS))
    assert passes[0]["model.embed_tokens"].shape == (4, 1, 32)
    assert passes[1]["model.embed_tokens"].shape == (2, 1, 32)
    assert passes[2]["model.embed_tokens"].shape == (1, len(PROMPT), 32)


# --------------------------------------------------------------------------- the gates


def test_token_gate_skips_warm_up_so_pass_zero_is_the_prefill(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path))
    monkeypatch.setenv("TRACEDUMP_DUMP_TOKENS", str(len(PROMPT)))
    monkeypatch.setenv("TRACEDUMP_DUMP_TOKEN_DIM", "1")
    _, run_dir = _run_engine()
    passes = read_passes(run_dir)
    assert sorted(passes) == list(range(NEW_TOKENS))
    prefill = _module_outputs(passes[0])
    assert len(prefill) == LEAF_MODULES + 1  # rotary_emb gives two tensors
    assert all(t.shape[1] == len(PROMPT) for t in prefill.values())
    assert all(t.shape[0] == 1 for t in prefill.values())  # no warm-up batch of 4 or 2 anywhere
    for step in range(1, NEW_TOKENS):  # one-token decode steps are gated too; their records remain
        assert set(passes[step]) == {f"margin_{step}", "token_ids"}
    manifest = tracedump.open_dump(run_dir).run().manifest
    assert manifest["skipped"] == {"token_gate": LEAF_MODULES * (2 + NEW_TOKENS - 1)}


def test_row_gate_skips_warm_up_so_pass_zero_is_the_prefill(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path))
    monkeypatch.setenv("TRACEDUMP_DUMP_MAX_ROWS", "1")
    _, run_dir = _run_engine()
    passes = read_passes(run_dir)
    assert sorted(passes) == list(range(NEW_TOKENS))
    assert passes[0]["model.embed_tokens"].shape == (1, len(PROMPT), 32)
    for step in range(1, NEW_TOKENS):  # the row gate keeps decode steps whole
        assert passes[step]["lm_head"].shape == (1, 1, 64)
        assert f"margin_{step}" in passes[step]
    manifest = tracedump.open_dump(run_dir).run().manifest
    assert manifest["skipped"] == {"row_gate": LEAF_MODULES * 2}


@pytest.mark.parametrize(
    "gate_env",
    [
        pytest.param(
            {"TRACEDUMP_DUMP_TOKENS": str(len(PROMPT)), "TRACEDUMP_DUMP_TOKEN_DIM": "1"}, id="tokens"
        ),
        pytest.param({"TRACEDUMP_DUMP_MAX_ROWS": "1"}, id="max_rows"),
        pytest.param(
            {
                "TRACEDUMP_DUMP_MAX_ROWS": "1",
                "TRACEDUMP_DUMP_TOKENS": str(len(PROMPT)),
                "TRACEDUMP_DUMP_TOKEN_DIM": "1",
            },
            id="both",
        ),
    ],
)
def test_prefill_pass_equals_a_batch_one_reference_dump(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gate_env: dict[str, str]
) -> None:
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path / "engine"))
    for key, value in gate_env.items():
        monkeypatch.setenv(key, value)
    _, run_dir = _run_engine()
    engine_prefill = _module_outputs(read_passes(run_dir)[0])
    for key in [*gate_env, "TRACEDUMP_DUMP_DIR"]:
        monkeypatch.delenv(key)

    reference = _reference_dump(tmp_path / "reference")
    assert list(engine_prefill) == list(reference)  # same keys, same capture order
    for key, expected in reference.items():
        assert torch.equal(engine_prefill[key], expected), key


def test_tracedump_diff_finds_no_divergence_between_the_gated_engine_and_the_reference(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from tracedump.cli import main as tracedump_main

    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path / "engine"))
    monkeypatch.setenv("TRACEDUMP_DUMP_MAX_ROWS", "1")
    _run_engine()
    monkeypatch.delenv("TRACEDUMP_DUMP_DIR")
    monkeypatch.delenv("TRACEDUMP_DUMP_MAX_ROWS")
    _reference_dump(tmp_path / "reference")
    argv = ["diff", str(tmp_path / "engine"), str(tmp_path / "reference"), "--pass", "0", "--no-progress"]
    assert tracedump_main(argv) == 0  # exit 0: no divergence (the records exist only in the engine's dump)
    assert "lm_head" in capsys.readouterr().out


# --------------------------------------------------------------------------- STEPS and records


@pytest.mark.parametrize(
    "gate_env",
    [
        pytest.param(
            {"TRACEDUMP_DUMP_TOKENS": str(len(PROMPT)), "TRACEDUMP_DUMP_TOKEN_DIM": "1"}, id="tokens"
        ),
        pytest.param({"TRACEDUMP_DUMP_MAX_ROWS": "1"}, id="max_rows"),
    ],
)
def test_steps_with_a_gate_keep_files_for_exactly_the_selected_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gate_env: dict[str, str]
) -> None:
    """Unselected warm-ups must still take no index, or every step number after them would shift."""
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path))
    monkeypatch.setenv("TRACEDUMP_DUMP_STEPS", "1,3")
    for key, value in gate_env.items():
        monkeypatch.setenv(key, value)
    _, run_dir = _run_engine()
    assert sorted(p.name for p in run_dir.glob("pass*")) == ["pass00001.safetensors", "pass00003.safetensors"]
    passes = read_passes(run_dir)
    assert "margin_1" in passes[1] and "margin_3" in passes[3]
    assert "logits" not in passes[1]  # the prefill wrote the once-only logits, in unselected pass 0


def test_records_of_a_generation_land_in_the_pass_of_their_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path))
    monkeypatch.setenv("TRACEDUMP_DUMP_MAX_ROWS", "1")
    tokens, run_dir = _run_engine()
    passes = read_passes(run_dir)

    prefill_logits = passes[0]["logits"]  # record(once=True): the prefill's, and nowhere else
    assert torch.equal(prefill_logits, passes[0]["lm_head"][:, -1, :])
    assert all("logits" not in passes[step] for step in range(1, NEW_TOKENS))

    top2 = prefill_logits.topk(2, dim=-1).values
    assert torch.equal(passes[0]["margin_0"], top2[:, 0] - top2[:, 1])
    for step in range(NEW_TOKENS):
        assert [k for k in passes[step] if k.startswith("margin_")] == [f"margin_{step}"]
        assert passes[step]["margin_" + str(step)].item() >= 0
        assert passes[step]["token_ids"].dtype == torch.int64
        assert torch.equal(passes[step]["token_ids"], tokens[:, step])
        last_logits = passes[step]["lm_head"][:, -1, :]
        assert torch.equal(passes[step]["token_ids"], last_logits.argmax(dim=-1))


# --------------------------------------------------------------------------- config and flags


def test_engine_config_dump_field_alone_turns_dumping_on(tmp_path: Path) -> None:
    config = engine_module.EngineConfig(
        dump=tracedump.DumpConfig(dir=tmp_path, max_rows=1, filter=["lm_head"])
    )
    _, run_dir = _run_engine(config)
    assert run_dir is not None and run_dir.parent == tmp_path
    passes = read_passes(run_dir)
    assert sorted(passes) == list(range(NEW_TOKENS))
    assert set(passes[0]) == {"lm_head", "logits", "margin_0", "token_ids"}


def test_env_dir_overrides_the_engine_config_dir_and_keeps_its_other_fields(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config_dir, env_dir = tmp_path / "from_config", tmp_path / "from_env"
    config = engine_module.EngineConfig(
        dump=tracedump.DumpConfig(dir=config_dir, max_rows=1, filter=["lm_head"])
    )
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(env_dir))
    _, run_dir = _run_engine(config)
    assert run_dir is not None and run_dir.parent == env_dir
    assert not config_dir.exists()
    assert set(read_passes(run_dir)[0]) == {"lm_head", "logits", "margin_0", "token_ids"}


def test_engine_with_its_own_env_prefix_reads_only_that_prefix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path / "ignored"))
    monkeypatch.setenv("MYENGINE_DUMP_DIR", str(tmp_path / "mine"))
    monkeypatch.setenv("MYENGINE_DUMP_MAX_ROWS", "1")
    _, run_dir = _run_engine(engine_module.EngineConfig(dump_env_prefix="MYENGINE_"))
    assert run_dir is not None and run_dir.parent == tmp_path / "mine"
    assert sorted(read_passes(run_dir)) == list(range(NEW_TOKENS))


def test_use_cuda_graph_is_refused_with_one_warning_while_dumping(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path))
    config = engine_module.EngineConfig(use_cuda_graph=True)
    with (
        pytest.warns(tracedump.TracedumpWarning, match="CUDA graphs disabled") as caught,
        engine_module.Engine(config) as engine,
    ):
        assert engine.use_cuda_graph is False
    assert len([w for w in caught if "CUDA graphs" in str(w.message)]) == 1


def test_use_cuda_graph_without_dumping_gives_no_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", tracedump.TracedumpWarning)
        with engine_module.Engine(engine_module.EngineConfig(use_cuda_graph=True)) as engine:
            assert engine.dumper is None
            # the engine captures graphs only on CUDA; on this CPU host the flag resolves to off
            assert engine.use_cuda_graph is (engine.device.type == "cuda")


def test_main_serves_one_prompt_and_prints_where_the_dump_went(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TRACEDUMP_DUMP_DIR", str(tmp_path))
    monkeypatch.setenv("TRACEDUMP_DUMP_MAX_ROWS", "1")
    assert engine_module.main(["--prompt-len", "5", "--max-new-tokens", "2"]) == 0
    out = capsys.readouterr().out
    (run_dir,) = tmp_path.iterdir()
    assert f"dump: {run_dir}" in out
    assert "generated: [" in out
    assert sorted(p.name for p in run_dir.glob("pass*")) == ["pass00000.safetensors", "pass00001.safetensors"]
