"""Every name a docstring or comment of the package points at exists.

A module that moves or a method that is renamed leaves behind prose that still names the old place
(docstrings once named methods that no longer existed). Two kinds of pointer are checked:

- Sphinx cross references (``:mod:``, ``:func:``, ``:class:``, ``:meth:``, ``:attr:``, ``:data:``,
  ``:exc:``, ``:obj:``): an absolute target (``tracedump.x.y``, ``~tracedump.x.y``) is imported and
  walked attribute by attribute; a relative one (``.x.y``) is tried in the module it is written in,
  then in that module's package; any other name (``Capture.save``, ``compute_stats``) must be in the
  module's namespace (its imports, ``TYPE_CHECKING`` ones included), a class of the module, or the
  builtins. An attribute an instance sets (``self.name = ...``) or a class annotates counts.
- Source paths (``dump/recorder.py``, ``util/kernel.c``, ``tests/test_x.py``): a path with a folder
  exists under ``tracedump/``, the repository root, or the installed package its first folder names
  (``torch/utils/hooks.py``); a bare file name in double backquotes is a file of the package.

And no prose anywhere (code's comments, docstrings and strings, the docs, the README) points into
the project's history by number (an issue, a defect, a round of work): a reader cannot follow it,
and the history is ``git log``. The prose says the why instead.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import importlib.util
import inspect
import re
from functools import cache
from pathlib import Path
from types import ModuleType

import pytest

import tracedump

PACKAGE = Path(tracedump.__file__).resolve().parent
ROOT = PACKAGE.parent
ROLE = re.compile(r":(?:py:)?(mod|func|class|meth|attr|data|exc|obj):`(?:[^`<]*<)?([^`<>]+)>?`")
# A path with at least one folder, not absolute (``/path/file.py`` is a placeholder).
FOLDER_PATH = re.compile(r"(?<![\w./-])((?:[A-Za-z_][\w.-]*/)+[A-Za-z_]\w*\.(?:py|c))\b")
BARE_FILE = re.compile(r"``([A-Za-z_]\w*\.(?:py|c))``")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> list[Path]:
    """Every Python file of the package but ``__main__`` (importing it runs the CLI)."""
    return sorted(p for p in PACKAGE.rglob("*.py") if p.name != "__main__.py")


def _has(obj: object, name: str) -> bool:
    """``obj.name`` exists, or (a class) an instance gets it: a field, an annotation, ``self.name =``."""
    if hasattr(obj, name):
        return True
    if not inspect.isclass(obj):
        return False
    for klass in obj.__mro__:
        if name in getattr(klass, "__annotations__", {}) or name in getattr(klass, "model_fields", {}):
            return True
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        if re.search(rf"\bself\.{re.escape(name)}\s*[:=]", source):
            return True
    return False


def _walk(obj: object, names: list[str]) -> bool:
    """Follow ``names`` from ``obj``: attributes, or submodules of a module not yet imported."""
    for name in names:
        if not _has(obj, name):
            if not inspect.ismodule(obj):
                return False
            try:
                obj = importlib.import_module(f"{obj.__name__}.{name}")
            except ImportError:
                return False
            continue
        obj = getattr(obj, name, None)
        if obj is None:  # an instance attribute or a field: nothing further to walk
            return True
    return True


def _absolute(target: str) -> bool:
    """``a.b.c.d``: the longest prefix that imports as a module, then its attributes."""
    parts = target.split(".")
    for i in range(len(parts), 0, -1):
        name = ".".join(parts[:i])
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if found:
            return _walk(importlib.import_module(name), parts[i:])
    return False


@cache
def _imported_names(path: Path) -> dict[str, str]:
    """Every name the file imports, at any level (``TYPE_CHECKING`` blocks included) -> its dotted target."""
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package.pop()
    names: dict[str, str] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            for alias in node.names:
                names[alias.asname or alias.name] = f"{module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                names[alias.asname or alias.name.split(".")[0]] = (
                    alias.name if alias.asname else alias.name.split(".")[0]
                )
    return names


def resolves(target: str, module: ModuleType, path: Path) -> bool:
    """Whether a cross reference written in ``module`` (its file ``path``) names something that exists."""
    target = target.strip().lstrip("~!").removesuffix("()")
    if target.startswith("tracedump."):
        return _absolute(target)
    if target.startswith("."):
        rest = target.lstrip(".")
        package = module.__name__ if path.name == "__init__.py" else module.__name__.rpartition(".")[0]
        up = len(target) - len(rest) - 1  # ``..x`` is x in the parent package, as in an import
        if up:
            return _absolute(".".join([*package.split(".")[: len(package.split(".")) - up], rest]))
        places = [module.__name__, package]
        return any(place and _absolute(f"{place}.{rest}") for place in dict.fromkeys(places))
    head, _, rest = target.partition(".")
    names = rest.split(".") if rest else []
    if hasattr(module, head):
        return _walk(getattr(module, head), names)
    imported = _imported_names(path)
    if head in imported:
        return _absolute(".".join([imported[head], *names]))
    if hasattr(builtins, head):
        return _walk(getattr(builtins, head), names)
    own_classes = [v for v in vars(module).values() if inspect.isclass(v) and v.__module__ == module.__name__]
    return not names and any(_has(klass, head) for klass in own_classes)


def path_exists(path: str) -> bool:
    """A source path named in prose: under the package, the repository, or the package it starts with."""
    if (PACKAGE / path).is_file() or (ROOT / path).is_file():
        return True
    top = path.split("/")[0]
    if top == PACKAGE.name:
        return False
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return False
    folders = list(spec.submodule_search_locations or []) if spec else []
    return any((Path(folder).parent / path).is_file() for folder in folders)


def _line(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def broken_references(text: str, module: ModuleType, path: Path) -> list[str]:
    """Each cross reference in ``text`` that does not resolve, as ``line: :role:`target```."""
    return [
        f"{_line(text, m.start())}: :{m.group(1)}:`{m.group(2)}`"
        for m in ROLE.finditer(text)
        if not resolves(m.group(2), module, path)
    ]


def missing_paths(text: str) -> list[str]:
    """Each source path in ``text`` (a folder path, or a double-backquoted file name) that is not there."""
    bad = [
        f"{_line(text, m.start())}: {m.group(1)}"
        for m in FOLDER_PATH.finditer(text)
        if not path_exists(m.group(1))
    ]
    files = {p.name for p in PACKAGE.rglob("*") if p.suffix in (".py", ".c")}
    bad += [
        f"{_line(text, m.start())}: {m.group(1)}" for m in BARE_FILE.finditer(text) if m.group(1) not in files
    ]
    return bad


def test_every_cross_reference_in_the_package_resolves() -> None:
    broken = []
    for path in _sources():
        module = importlib.import_module(_module_name(path))
        broken += [
            f"{path.relative_to(ROOT)}:{where}" for where in broken_references(path.read_text(), module, path)
        ]
    assert not broken, "cross references to names that do not exist:\n" + "\n".join(broken)


def test_every_source_path_named_in_the_package_exists() -> None:
    missing = []
    for path in [*_sources(), *PACKAGE.rglob("*.c")]:
        missing += [f"{path.relative_to(ROOT)}:{where}" for where in missing_paths(path.read_text())]
    assert not missing, "paths that do not exist:\n" + "\n".join(missing)


@pytest.mark.parametrize(
    "reference",
    [
        ":func:`tracedump.store.loader.no_such_function`",
        ":class:`~tracedump.compare.judge.verdict.NoSuchClass`",
        ":mod:`tracedump.no_such_module`",
        ":mod:`.no_such_sibling`",
        ":meth:`Dumper.no_such_method`",
        ":meth:`_close_pass`",
        ":attr:`tracedump.compare.results.first_divergence`",  # moved to verdict.py
    ],
)
def test_a_made_up_reference_is_flagged(reference: str) -> None:
    import tracedump.dump.dumper as dumper

    path = Path(dumper.__file__)
    assert broken_references(f'"""See {reference}."""', dumper, path) == [f"1: {reference}"]


def test_real_references_of_each_form_resolve() -> None:
    import tracedump.dump.dumper as dumper

    path = Path(dumper.__file__)
    text = (
        ":func:`tracedump.store.loader.open_dump` :func:`~tracedump.compare.judge.verdict.conclude` "
        ":mod:`.passes` :mod:`tracedump.store` :meth:`Dumper.step` :func:`attach` "
        ":func:`is_enabled` :class:`ValueError` :attr:`Dumper.recorder`"
    )
    assert broken_references(text, dumper, path) == []


@pytest.mark.parametrize(
    "path", ["dump/nope.py", "compare/kernel.c", "tracestore/reduce.py", "torch/no_such.py"]
)
def test_a_path_that_moved_or_never_was_is_flagged(path: str) -> None:
    assert missing_paths(f"see ``{path}``") == [f"1: {path}"]


def test_real_paths_pass() -> None:
    assert (
        missing_paths(
            "``dump/recorder.py`` util/kernel.c tests/test_off.py torch/utils/hooks.py ``kernel.c``"
        )
        == []
    )


# ----------------------------------------------------------------------------- no history numbers

# A pointer into the project's history: "issue 35", "defect 14", "#24", "the sixth round", "rounds
# 6-9", "item 4". The history is git's log; docs, docstrings and comments say the why instead.
HISTORY = re.compile(
    r"\b[Ii]ssues? ?#?\d+"
    r"|\b[Dd]efects? ?#?\d+"
    r"|(?<![&\w])#\d{2}\b"  # an issue's number; an HTML entity (&#34;), a colour (#111827) are not
    r"|\b(?:second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|\d+(?:st|nd|rd|th)) rounds?\b"
    r"|\b[Rr]ounds? \d+(?:-\d+)?\b(?! (?:after|of|per|each))"
    r"|\bitems? \d+\b"
)
SCANNED_FOLDERS = ("tracedump", "benchmarks", "tests", "tests_vllm", "examples", "tools", "docs")
SCANNED_SUFFIXES = {".py", ".md", ".c", ".j2", ".js", ".css", ".toml"}


def _scanned_files() -> list[Path]:
    """Every text file of the repository that people read: code (its comments, docstrings and
    strings), the docs and the README; this file, which must spell the patterns, aside."""
    files = [ROOT / "README.md", ROOT / "Makefile", ROOT / "pyproject.toml"]
    for folder in SCANNED_FOLDERS:
        files += [p for p in (ROOT / folder).rglob("*") if p.is_file() and p.suffix in SCANNED_SUFFIXES]
    return sorted(p for p in files if p.is_file() and p.resolve() != Path(__file__).resolve())


def history_numbers(text: str) -> list[str]:
    """Each pointer into the project's history in ``text``, as ``line: what``."""
    return [f"{_line(text, m.start())}: {m.group(0)}" for m in HISTORY.finditer(text)]


def test_no_issue_round_or_defect_numbers_in_docs_docstrings_or_comments() -> None:
    found = []
    for path in _scanned_files():
        found += [f"{path.relative_to(ROOT)}:{where}" for where in history_numbers(path.read_text())]
    assert not found, "history numbers (say the why instead; the history is git log):\n" + "\n".join(found)


@pytest.mark.parametrize(
    "text",
    [
        "# measured slower (issue 14, second round)",
        '"""The guard (defect 6): exit 1 means diverged."""',
        "as in #26 item 10",
        "over rounds 6-9 the figure held",
        "see the seventh round",
        "Issue #25 moved it",
    ],
)
def test_a_history_number_is_flagged(text: str) -> None:
    assert history_numbers(text)


@pytest.mark.parametrize(
    "text",
    [
        "12 rounds after 2 warm-up rounds",
        "the first round warms up",
        "assert '&#34;' in page",
        "colour #1f77b4, #393b79, #111 and #374151",
        "round(x, 1)",
    ],
)
def test_words_that_are_not_history_pass(text: str) -> None:
    assert history_numbers(text) == []
