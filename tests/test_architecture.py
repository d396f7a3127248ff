"""The package's shape (docs/architecture.md): one capture engine for attach() and capture(), one
process-wide runtime, suspension per thread, every distinct error kept; no import circle at any
level, the sub-packages layered as the document says, and every module drawn in it.

Imports are read from the source with ``ast`` wherever they are written (module level, inside
functions, under ``if TYPE_CHECKING:``), so a circle hidden in a function-level import fails here."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_llama
from torch import nn

import tracedump
import tracedump.dump.runtime

PACKAGE = Path(tracedump.__file__).parent


def _ids() -> torch.Tensor:
    return torch.tensor([[3, 14, 15, 9, 26, 5]])


def test_capture_and_attach_keep_the_same_keys_and_identical_tensors(tmp_path: Path) -> None:
    model = make_tiny_llama()
    pattern = r"layers\.1\.(mlp|self_attn)$"
    with torch.no_grad(), tracedump.capture(model, filter=pattern) as cap:
        cap.run(_ids())
        cap.run(_ids()[:, :4])
    saved = cap.save(tmp_path / "captured")

    config = {"dir": tmp_path / "dumped", "modules": "all", "filter": [pattern]}
    with torch.no_grad(), tracedump.attach(model, config) as dumper:
        model(_ids())
        model(_ids()[:, :4])

    captured, dumped = tracedump.open_dump(saved).run(), tracedump.open_dump(dumper.run_dir).run()
    assert sorted(captured.passes) == sorted(dumped.passes) == [0, 1]
    for index in (0, 1):
        mine, theirs = captured.passes[index].load(), dumped.passes[index].load()
        assert sorted(mine) == sorted(theirs) == ["model.layers.1.mlp", "model.layers.1.self_attn[0]"]
        for key in mine:
            assert torch.equal(mine[key], theirs[key]), key
    # the structured view holds the very tensors that were saved
    attn_out, _ = cap["model.layers.1.self_attn"].outputs[1]
    assert torch.equal(attn_out, captured.passes[1].load()["model.layers.1.self_attn[0]"])


def test_a_saved_capture_is_a_dump_that_diff_reads(tmp_path: Path) -> None:
    model = make_tiny_llama()
    with torch.no_grad(), tracedump.capture(model, outputs=["model.layers.0", "model.norm"]) as cap:
        cap.run(_ids())
        model(_ids())  # a call outside run(): kept in records.safetensors
    saved = cap.save(tmp_path / "a")
    assert (saved / "records.safetensors").exists()
    manifest = json.loads((saved / "manifest.json").read_text())
    assert manifest["complete"] is True and manifest["modules"] == ["model.layers.0", "model.norm"]
    with torch.no_grad(), tracedump.capture(model, outputs=["model.layers.0", "model.norm"]) as again:
        again.run(_ids())
    other = again.save(tmp_path / "b")
    result = subprocess.run(
        [sys.executable, "-m", "tracedump", "diff", str(saved), str(other)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "model.norm" in result.stdout


def test_every_distinct_error_is_kept_with_where_type_first_message_and_count(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    dumper = tracedump.attach(model, {"dir": tmp_path})
    assert dumper is not None
    calls = iter(range(100))

    def failing(tensor: torch.Tensor, **_: object) -> object:
        raise RuntimeError(f"copy {next(calls)} failed")

    dumper.sink.copy = failing  # type: ignore[method-assign]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            model(torch.ones(1, 2))
        dumper.close()
    errors = json.loads((dumper.run_dir / "manifest.json").read_text())["errors"]
    assert errors == [
        {"where": "0", "type": "RuntimeError", "message": "copy 0 failed", "count": 3},
        {"where": "1", "type": "RuntimeError", "message": "copy 1 failed", "count": 3},
    ]
    assert sum("capture failed" in str(w.message) for w in caught) == 1  # warned once per dumper


def test_one_dumpers_warning_never_silences_anothers(tmp_path: Path) -> None:
    first, second = nn.Sequential(nn.Linear(2, 2)), nn.Sequential(nn.Linear(2, 2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dumpers = [tracedump.attach(m, {"dir": tmp_path}) for m in (first, second)]
        for dumper, model in zip(dumpers, (first, second), strict=True):
            dumper.sink.copy = lambda *a, **k: 1 / 0  # type: ignore[method-assign, union-attr]
            model(torch.ones(1, 2))
        for dumper in dumpers:
            dumper.close()  # type: ignore[union-attr]
    assert sum("capture failed" in str(w.message) for w in caught) == 2


def test_profiling_on_one_thread_does_not_suspend_another(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    other = nn.Sequential(nn.Linear(2, 2))
    entered, release = threading.Event(), threading.Event()

    def profile_run() -> None:
        with tracedump.profiling():
            entered.set()
            release.wait(10)

    with tracedump.attach(model, {"dir": tmp_path}) as dumper:
        thread = threading.Thread(target=profile_run)
        thread.start()
        assert entered.wait(10)
        model(torch.ones(1, 2))  # this thread is not profiling: a real pass
        with tracedump.profiling():
            model(torch.ones(1, 2))  # this one is: no pass
        release.set()
        thread.join()
        other(torch.ones(1, 2))
    assert sorted(tracedump.open_dump(dumper.run_dir).run().passes) == [0]


def test_record_goes_to_the_dumper_whose_pass_this_thread_runs(tmp_path: Path) -> None:
    class Recording(nn.Module):
        def __init__(self, tag: str) -> None:
            super().__init__()
            self.tag = tag
            self.lin = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            tracedump.record(self.tag, x * 2)
            return self.lin(x)

    a, b = Recording("from_a"), Recording("from_b")
    first = tracedump.attach(a, {"dir": tmp_path / "a"})
    second = tracedump.attach(b, {"dir": tmp_path / "b"})  # attached last
    a(torch.ones(1, 2))
    b(torch.ones(1, 2))
    first.close()  # type: ignore[union-attr]
    second.close()  # type: ignore[union-attr]
    assert set(tracedump.load_pass(first.run_dir / "pass00000.safetensors")) == {"from_a", "lin"}  # type: ignore[union-attr]
    assert set(tracedump.load_pass(second.run_dir / "pass00000.safetensors")) == {"from_b", "lin"}  # type: ignore[union-attr]


def test_the_off_path_creates_no_runtime_and_registers_nothing() -> None:
    code = (
        "import os, torch, tracedump, tracedump.dump.runtime as r\n"
        "os.environ.pop('TRACEDUMP_DUMP_DIR', None)\n"
        "m = torch.nn.Linear(2, 2)\n"
        "assert tracedump.attach(m) is None\n"
        "tracedump.record('x', torch.ones(1))\n"
        "assert r.existing() is None\n"
        "assert not m._forward_hooks and not m._forward_pre_hooks\n"
        "print('clean')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "clean", result.stderr


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level and node.module is not None:
            found.append((node.module, [alias.name for alias in node.names]))
    return found


def test_no_private_name_is_imported_across_modules() -> None:
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        for module, names in _imports(path):
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private and module != "_version":
                offenders.append(f"{path.relative_to(PACKAGE)}: from {module} import {private}")
    assert offenders == []


@pytest.mark.parametrize(
    ("low", "high"), [("hooks", "dumper"), ("hooks", "recorder"), ("runtime", "recorder")]
)
def test_lower_layers_never_import_higher_ones(low: str, high: str) -> None:
    assert all(module.split(".")[-1] != high for module, _ in _imports(PACKAGE / "dump" / f"{low}.py"))


ARCHITECTURE_DOC = PACKAGE.parent / "docs" / "architecture.md"

# Which sub-packages each may import (beyond itself and the leaf modules errors/_version).
# The dump side never reaches the comparator, the launcher or an integration; the on-disk contract
# (store/) imports neither half; integrations/ and launch/ sit above the dump side.
ALLOWED = {
    "util": set(),
    "store": {"util"},
    "config": {"store", "util"},
    "dump": {"config", "store", "util"},
    "compare": {"store", "util"},
    "integrations": {"dump", "config", "store", "util", "tracedump"},
    "launch": {"dump", "config", "store", "util", "tracedump"},
}
LEAVES = {"errors", "_version"}


def _module_names() -> dict[str, Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        dotted = ".".join(("tracedump", *parts)).removesuffix(".__init__")
        names[dotted] = path
    return names


MODULES = _module_names()


def _imported(module: str, path: Path) -> Iterator[tuple[str, int]]:
    """(imported tracedump module, line) for every import statement in ``path``, at any depth."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield from ((alias.name, node.lineno),) if alias.name.startswith("tracedump") else ()
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            if not source.startswith("tracedump"):
                continue
            for alias in node.names:
                candidate = f"{source}.{alias.name}"
                yield (candidate if candidate in MODULES else source), node.lineno


GRAPH = {
    name: {target for target, _ in _imported(name, path) if target in MODULES and target != name}
    for name, path in MODULES.items()
}


def _circle() -> list[str]:
    state: dict[str, int] = {}
    trail: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        trail.append(node)
        for dep in sorted(GRAPH[node]):
            if state.get(dep) == 1:
                return [*trail[trail.index(dep) :], dep]
            if dep not in state and (found := visit(dep)):
                return found
        trail.pop()
        state[node] = 2
        return []

    for name in sorted(GRAPH):
        if name not in state and (found := visit(name)):
            return found
    return []


def test_no_import_circle_at_any_level() -> None:
    assert _circle() == [], " -> ".join(_circle())


def test_the_reader_of_imports_sees_function_level_ones() -> None:
    """The test above can fail: it sees an import written inside a function."""
    assert "tracedump.compare.pipeline" in GRAPH["tracedump.compare.command"]


def _subpackage(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir()) else ""


@pytest.mark.parametrize("sub", sorted(ALLOWED))
def test_each_sub_package_imports_only_the_layers_below_it(sub: str) -> None:
    offenders = []
    for name, deps in GRAPH.items():
        if _subpackage(name) != sub:
            continue
        for dep in deps:
            target = dep.removeprefix("tracedump.")
            other = _subpackage(dep)
            if other == sub or target in LEAVES:
                continue
            allowed = ALLOWED[sub]
            if other in allowed or target in allowed or (dep == "tracedump" and "tracedump" in allowed):
                continue
            offenders.append(f"{name} imports {dep}")
    assert offenders == []


def test_docs_architecture_draws_every_module() -> None:
    text = ARCHITECTURE_DOC.read_text()
    files = [p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py") if p.name != "__main__.py"]
    files += [p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.c")]
    missing = sorted(f for f in files if not re.search(rf"(?<![\w/]){re.escape(f)}(?!\w)", text))
    assert missing == [], f"docs/architecture.md does not name: {missing}"


def test_docs_architecture_names_no_module_that_does_not_exist() -> None:
    """Except in the table of moves, whose left column names the old paths on purpose."""
    text = ARCHITECTURE_DOC.read_text().split("## Moved in the re-layout")[0]
    named = set(re.findall(r"(?<![\w/.])((?:[a-z_]+/)+[a-z_]+\.(?:py|c))\b", text))
    gone = sorted(n for n in named if not (PACKAGE / n).exists() and not (PACKAGE.parent / n).exists())
    assert gone == []


def test_capture_copies_like_attach_lifting_a_sync_debug_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    modes: list[int] = []
    state = {"mode": 2}  # set_sync_debug_mode("error"): an engine that forbids stray syncs
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: state["mode"])

    def set_mode(mode: int) -> None:
        state["mode"] = mode
        modes.append(mode)

    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", set_mode)
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    with torch.no_grad(), tracedump.capture(model, outputs=["0", "1"], device="cpu") as cap:
        cap.run(torch.ones(1, 2))
    assert modes == [0, 2, 0, 2]  # lifted for each copy, and put back
    assert torch.equal(cap["1"].outputs[0], model(torch.ones(1, 2)))


def _dumper_api() -> set[str]:
    """The public methods and properties of ``Dumper`` (its instance attributes, such as
    ``rundir`` or ``recorder``, are its internals)."""
    tree = ast.parse((PACKAGE / "dump" / "dumper.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Dumper")
    return {
        n.name
        for n in cls.body
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and not n.name.startswith("_")
    } | {"__enter__", "__exit__"}


def _is_dumper(node: ast.AST) -> bool:
    """``dumper``, ``self.dumper``, ``root.dumper``: an expression naming a Dumper."""
    return (isinstance(node, ast.Name) and node.id == "dumper") or (
        isinstance(node, ast.Attribute) and node.attr == "dumper"
    )


def _dumper_uses(path: Path) -> list[tuple[int, str]]:
    """(line, attribute) of every attribute an integration reads of a Dumper, ``getattr`` included."""
    uses = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and _is_dumper(node.value):
            uses.append((node.lineno, node.attr))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr")
            and node.args
            and _is_dumper(node.args[0])
        ):
            named = len(node.args) > 1 and isinstance(node.args[1], ast.Constant)
            uses.append((node.lineno, str(node.args[1].value) if named else "?"))
    return uses


def test_integrations_call_only_public_dumper_methods() -> None:
    """The vLLM plugin calls only ``Dumper``'s public methods, never its internals
    (``rundir``, ``recorder``, ``hooks`` …), so the dump side can change inside without breaking
    an engine integration."""
    api = _dumper_api()
    assert {"step", "set_batch", "close", "note_integration", "count_skipped", "report_error"} <= api
    assert not api & {"rundir", "recorder", "hooks", "sink"}
    used: dict[str, list[str]] = {}
    for path in sorted((PACKAGE / "integrations").glob("*.py")):
        for line, attr in _dumper_uses(path):
            used.setdefault(attr, []).append(f"{path.name}:{line}")
    private = {attr: where for attr, where in used.items() if attr not in api}
    assert not private, f"integrations/ reach into Dumper internals: {private}"
    # the scan sees the plugin's calls (a scan that finds nothing proves nothing)
    assert {"step", "set_batch", "note_integration", "count_skipped", "report_error"} <= set(used)
