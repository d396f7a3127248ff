"""The seams: every private name of torch lives in ``dump/torch_compat.py``, every private name of
vLLM in ``integrations/vllm_compat.py``.

A private API moves between releases without notice; with each one named in one module (and each
checked there against the release it was written for), an upgrade breaks in one place. Read from
the source with ``ast``, so a name in a comment or a docstring does not count, and a name built
in code (an attribute, a ``getattr`` string, an import) does.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "tracedump"
TORCH_SEAM = PACKAGE / "dump" / "torch_compat.py"
VLLM_SEAM = PACKAGE / "integrations" / "vllm_compat.py"

# torch's private module state tracedump relies on, whatever object it is reached through.
TORCH_PRIVATE_NAMES = frozenset(
    {
        "_forward_hooks",
        "_forward_hooks_with_kwargs",
        "_forward_hooks_always_called",
        "_forward_pre_hooks",
        "_forward_pre_hooks_with_kwargs",
        "_backward_hooks",
        "_backward_pre_hooks",
        "_global_forward_hooks",
        "_global_forward_pre_hooks",
        "_global_module_registration_hooks",
        "_call_impl",
        "_compiled_call_impl",
        "_orig_mod",
    }
)
# vLLM's internals the plugin touches: the runner's private methods and state, the engine config.
VLLM_PRIVATE_NAMES = frozenset(
    {
        "_model_forward",
        "_dummy_run",
        "_dummy_sampler_run",
        "_dummy_pooler_run",
        "input_batch",
        "num_computed_tokens_np",
        "compilation_config",
        "enforce_eager",
        "create_engine_config",
        "_get_logits",
        "GPUModelRunner",
        "EngineArgs",
    }
)


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the string constants that are docstrings (never code)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def _code_string(node: ast.AST, docs: set[int]) -> bool:
    """A short string constant without spaces that is no docstring: a name or a module path."""
    if not isinstance(node, ast.Constant) or not isinstance(node.value, str) or id(node) in docs:
        return False
    return len(node.value) < 200 and " " not in node.value


def _names_used(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """Every name the code reaches something by: attributes, imported names, and the strings
    passed around (``getattr(runner, "input_batch")``, a module path), docstrings excluded; each
    string also as its dotted parts."""
    docs = _docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            yield node.lineno, node.attr
        elif isinstance(node, ast.ImportFrom):
            for part in (node.module or "").split("."):
                yield node.lineno, part
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.Import):
            for alias in node.names:
                for part in alias.name.split("."):
                    yield node.lineno, part
        elif _code_string(node, docs):
            value = str(node.value)  # type: ignore[attr-defined]
            yield node.lineno, value
            for part in value.split("."):
                yield node.lineno, part


def _private_of_torch(node: ast.AST) -> bool:
    """An attribute chain from the name ``torch`` with a private part (``torch._dynamo``,
    ``torch.library._register_effectful_op``); dunders such as ``__version__`` are public."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id != "torch":
        return False
    return any(p.startswith("_") and not p.startswith("__") for p in parts)


def _torch_private_modules(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """``torch._x`` reached as an attribute, an import or a module path."""
    for node in ast.walk(tree):
        if _private_of_torch(node) and not _private_of_torch(getattr(node, "value", None)):
            yield node.lineno, ast.unparse(node)  # the shortest private chain, once
        modules: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module:
            modules = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        for module in modules:
            parts = module.split(".")
            if parts[0] == "torch" and any(p.startswith("_") and not p.startswith("__") for p in parts[1:]):
                yield node.lineno, module


def _violations(seam: Path, names: frozenset[str], extra: bool) -> list[str]:
    found = []
    for path in _modules():
        if path == seam:
            continue
        tree = ast.parse(path.read_text(), str(path))
        hits = [(line, name) for line, name in _names_used(tree) if name in names]
        if extra:
            hits += list(_torch_private_modules(tree))
        found += [f"{path.relative_to(PACKAGE.parent)}:{line}: {name}" for line, name in sorted(set(hits))]
    return found


def test_torch_privates_live_in_torch_compat_only() -> None:
    assert _violations(TORCH_SEAM, TORCH_PRIVATE_NAMES, extra=True) == []


def test_vllm_privates_live_in_vllm_compat_only() -> None:
    assert _violations(VLLM_SEAM, VLLM_PRIVATE_NAMES, extra=False) == []


@pytest.mark.parametrize(
    ("source", "seam", "names", "extra"),
    [
        ("import torch\nx = torch._dynamo\n", TORCH_SEAM, TORCH_PRIVATE_NAMES, True),
        (
            "import torch\ntorch.library._register_effectful_op('a::b', 0)\n",
            TORCH_SEAM,
            TORCH_PRIVATE_NAMES,
            True,
        ),
        (
            "from torch._C._dynamo.eval_frame import set_code_exec_strategy\n",
            TORCH_SEAM,
            TORCH_PRIVATE_NAMES,
            True,
        ),
        ("from torch._library.effects import EffectType\n", TORCH_SEAM, TORCH_PRIVATE_NAMES, True),
        ("def f(m):\n    return m._forward_hooks\n", TORCH_SEAM, TORCH_PRIVATE_NAMES, True),
        ("HOOKS = ('_forward_pre_hooks',)\n", TORCH_SEAM, TORCH_PRIVATE_NAMES, True),
        ("def f(r):\n    return r.input_batch.req_ids\n", VLLM_SEAM, VLLM_PRIVATE_NAMES, False),
        ("NAME = '_model_forward'\n", VLLM_SEAM, VLLM_PRIVATE_NAMES, False),
        ("SPEC = ('vllm.engine.arg_utils', 'EngineArgs')\n", VLLM_SEAM, VLLM_PRIVATE_NAMES, False),
    ],
)
def test_the_scan_finds_a_private_name_outside_its_seam(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    source: str,
    seam: Path,
    names: frozenset[str],
    extra: bool,
) -> None:
    """The premise of the two tests above: a private name written in any of the ways code reaches
    one is found, and the same text in a docstring or a comment is not."""
    package = tmp_path / "tracedump"
    package.mkdir()
    (package / "offender.py").write_text(source)
    (package / "harmless.py").write_text(f'"""{source}"""\n# {source.splitlines()[0]}\n')
    monkeypatch.setattr(__import__(__name__), "PACKAGE", package)
    found = _violations(seam, names, extra)
    assert found and all(f.startswith("tracedump/offender.py") for f in found), found
