"""The docs never drift from the code.

- ``docs/settings.md`` is generated from ``DumpSettings``; a field added, renamed or redescribed
  without regenerating fails here. ``docs/calibration.md`` is generated from the calibration
  results; a ``make calibrate`` whose JSON is committed without the page fails here.
- Every ``TRACEDUMP_DUMP_*`` variable named anywhere in the README or ``docs/`` is a real setting.
- Every flag shown on a ``tracedump <subcommand>`` command line in the docs exists in that
  subcommand's argparse parser, and every flag named in the run/diff guides exists in theirs.
- Every relative link between the pages points at a file that exists.
- The file format spec's manifest example and key tables list exactly what a real dump holds.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import types
from pathlib import Path

import pytest
from pydantic import Field, create_model

from tracedump.cli import build_parser
from tracedump.config.settings import DumpSettings

ROOT = Path(__file__).resolve().parent.parent
DOC_FILES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
ENV_VAR = re.compile(r"\bTRACEDUMP_DUMP_([A-Z][A-Z0-9_]*)\b")
# A tracedump command line, up to the end of the line or of the inline code span it sits in.
COMMAND_LINE = re.compile(r"\btracedump (ls|show|diff|run)\b([^`\n]*)")
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")
LINK = re.compile(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)")
# Guides whose every backquoted flag belongs to one subcommand.
GUIDE_SUBCOMMAND = {"run.md": "run", "comparator.md": "diff"}


def _load_docs_gen() -> types.ModuleType:
    """``tools/docs_gen.py``: a developer tool outside the package, loaded from its file."""
    spec = importlib.util.spec_from_file_location("docs_gen", ROOT / "tools" / "docs_gen.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


docs_gen = _load_docs_gen()


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _flags_of(parser: argparse.ArgumentParser) -> set[str]:
    return {flag for flag in parser._option_string_actions if flag.startswith("--")}


def _flags_in_command(rest: str) -> list[str]:
    """Flags of a tracedump command line; after a lone ``--`` they belong to COMMAND, not to us."""
    ours = re.split(r"(?:^|\s)--(?:\s|$)", rest, maxsplit=1)[0]
    return FLAG.findall(ours)


def test_docs_exist() -> None:
    names = {path.name for path in DOC_FILES}
    for required in ("README.md", "overview.md", "quickstart.md", "settings.md", "file-format.md"):
        assert required in names
    assert (ROOT / "docs" / "README.md").is_file()


def test_the_docs_generator_is_a_tool_outside_the_installed_package() -> None:
    assert not (ROOT / "tracedump" / "docs_gen.py").exists()
    assert docs_gen.REGENERATE == "python tools/docs_gen.py"


def test_settings_doc_is_current() -> None:
    assert docs_gen.check(), (
        f"docs/settings.md is stale: run `{docs_gen.REGENERATE}` and commit the result\n"
        "(or fix the field description in tracedump/config/fields.py)"
    )


def test_settings_doc_lists_every_field_with_env_name_default_and_description() -> None:
    text = docs_gen.SETTINGS_DOC.read_text()
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| `TRACEDUMP")}
    assert set(rows) == {f"`TRACEDUMP_DUMP_{name.upper()}`" for name in DumpSettings.model_fields}
    assert "`leaves` \\| `all`" in rows["`TRACEDUMP_DUMP_MODULES`"]
    assert "`4294967296` (4 GiB)" in rows["`TRACEDUMP_DUMP_MAX_PENDING_BYTES`"]
    assert "`abs_mean,sum,max,shape`" in rows["`TRACEDUMP_DUMP_STATS`"]
    assert DumpSettings.model_fields["dir"].description in rows["`TRACEDUMP_DUMP_DIR`"]


def test_check_fails_on_a_stale_copy(tmp_path: Path) -> None:
    """The guard itself must be able to fail: a hand edit, and a field the page does not know."""
    stale = tmp_path / "settings.md"
    calibration = tmp_path / "calibration.md"
    calibration.write_text(docs_gen.render_calibration_doc())
    pages = ["--output", str(stale), "--calibration-output", str(calibration)]
    lines = docs_gen.render_settings_doc().splitlines(keepends=True)
    first_row = next(i for i, line in enumerate(lines) if line.startswith("| `TRACEDUMP_DUMP_"))
    stale.write_text("".join(lines[:first_row] + lines[first_row + 1 :]))  # a setting the page forgot
    assert not docs_gen.check(stale)
    assert docs_gen.main(["--check", *pages]) == 1
    assert docs_gen.main(pages) == 0
    assert docs_gen.check(stale)
    assert docs_gen.main(["--check", *pages]) == 0

    grown = create_model(
        "GrownSettings",
        __base__=DumpSettings,
        compress=(bool, Field(False, description="Compress pass files.")),
    )
    rendered = docs_gen.render_settings_doc(grown)
    assert "| `TRACEDUMP_DUMP_COMPRESS` | `compress` | bool | `0` | Compress pass files. |" in rendered
    assert rendered != stale.read_text()


def test_calibration_doc_is_current() -> None:
    assert docs_gen.check(docs_gen.CALIBRATION_DOC, docs_gen.render_calibration_doc), (
        f"docs/calibration.md is stale: run `{docs_gen.REGENERATE}` and commit the result"
    )


def test_the_calibration_page_shows_every_row_of_the_results_and_its_check_can_fail(tmp_path: Path) -> None:
    """Each case of each calibration file is a row of the page, with its ratio; a result the page
    does not show (a rerun committed without the page) fails the check."""
    page = docs_gen.render_calibration_doc()
    for path in (docs_gen.CALIBRATION, docs_gen.CALIBRATION_GRAFT):
        document = json.loads(path.read_text())
        for name, setting in document["settings"].items():
            assert f"| {name} | " in page  # the setting's row in its table
            for row in setting["rows"]:
                label = row.get("case") or row.get("variant")
                assert f"| {row['family']} | {label}" in page, (path.name, name, label)
    results = json.loads(docs_gen.CALIBRATION.read_text())
    first = next(iter(results["settings"].values()))
    first["rows"][0]["ratio"] = 123.0  # a rerun whose numbers moved
    moved = tmp_path / "calibration.json"
    moved.write_text(json.dumps(results))
    rendered = docs_gen.render_calibration_doc(moved, docs_gen.CALIBRATION_GRAFT)
    assert "123x" in rendered and rendered != docs_gen.CALIBRATION_DOC.read_text()
    stale = tmp_path / "calibration.md"
    stale.write_text(docs_gen.render_calibration_doc())
    assert docs_gen.check(stale, docs_gen.render_calibration_doc)
    stale.write_text(rendered)
    assert not docs_gen.check(stale, docs_gen.render_calibration_doc)
    assert docs_gen.main(["--check", "--calibration-output", str(stale)]) == 1


@pytest.mark.parametrize("path", DOC_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_env_var_named_in_the_docs_is_a_setting(path: Path) -> None:
    unknown = sorted(
        {f"TRACEDUMP_DUMP_{m}" for m in ENV_VAR.findall(path.read_text())}
        - {f"TRACEDUMP_DUMP_{f.upper()}" for f in DumpSettings.model_fields}
    )
    assert not unknown, f"{path.name} names env vars that are not settings: {unknown}"


def test_env_var_check_can_fail() -> None:
    assert ENV_VAR.findall("export TRACEDUMP_DUMP_DIRECTORY=/x, not `TRACEDUMP_DUMP_*`") == ["DIRECTORY"]


@pytest.mark.parametrize("path", DOC_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_flag_on_a_tracedump_command_line_exists(path: Path) -> None:
    subparsers = _subparsers()
    wrong = []
    for match in COMMAND_LINE.finditer(path.read_text()):
        command, rest = match.group(1), match.group(2)
        known = _flags_of(subparsers[command])
        wrong += [f"tracedump {command} {flag}" for flag in _flags_in_command(rest) if flag not in known]
    assert not wrong, f"{path.name} shows flags the CLI does not have: {sorted(set(wrong))}"


@pytest.mark.parametrize("page, command", sorted(GUIDE_SUBCOMMAND.items()))
def test_every_flag_named_in_a_command_guide_exists(page: str, command: str) -> None:
    path = ROOT / "docs" / page
    if not path.is_file():
        pytest.skip(f"docs/{page} not written yet")
    known = _flags_of(_subparsers()[command])
    spans = re.findall(r"`([^`\n]+)`", path.read_text())
    named = {flag for span in spans for flag in _flags_in_command(span)}
    assert named, f"docs/{page} names no flag of `tracedump {command}`"
    assert not named - known, f"docs/{page} names flags `tracedump {command}` lacks: {sorted(named - known)}"


def test_flag_check_can_fail() -> None:
    rest = " --dir d --frobnicate -- python x.py --bug-layer 2"
    assert _flags_in_command(rest) == ["--dir", "--frobnicate"]
    assert "--frobnicate" not in _flags_of(_subparsers()["run"])


@pytest.mark.parametrize("path", DOC_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path: Path) -> None:
    missing = [
        target
        for target in LINK.findall(path.read_text())
        if "://" not in target and not (path.parent / target).is_file()
    ]
    assert not missing, f"{path.name} links to pages that do not exist: {missing}"


# ------------------------------------------------------------------ file-format.md against real files


def _section(text: str, heading: str) -> str:
    """The body of a ``## heading`` section, up to the next heading of the same level."""
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def _first_column_keys(section: str) -> set[str]:
    """Backquoted names in the first column of a section's tables (``| `a`, `b` | ... |``)."""
    cells = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    return {name for cell in cells for name in re.findall(r"`([^`]+)`", cell)}


@pytest.fixture(scope="module")
def real_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real dump: a dumper on a small model, one pass, one record outside every pass."""
    import torch

    import tracedump

    directory = tmp_path_factory.mktemp("dump")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    dumper = tracedump.attach(model, {"dir": str(directory)})
    assert dumper is not None
    tracedump.record("outside", torch.ones(2))
    with dumper.step():
        model(torch.ones(3, 4))
    dumper.close()
    return dumper.run_dir


def test_manifest_example_and_table_have_exactly_the_keys_the_writer_writes(real_run: Path) -> None:
    section = _section((ROOT / "docs" / "file-format.md").read_text(), "`manifest.json`")
    example = json.loads(re.search(r"```json\n(.*?)```", section, re.S).group(1))
    real = json.loads((real_run / "manifest.json").read_text())
    assert set(example) == set(real)
    assert set(example["settings"]) == set(real["settings"]) == set(DumpSettings.model_fields)
    assert set(example["passes"]) == set(real["passes"])
    documented = _first_column_keys(section)
    assert set(real) <= documented, f"manifest keys missing from the table: {set(real) - documented}"
    # manifest_error: only after a failed manifest write; control: only with CONTROL=1; graft: only
    # in a grafted run; compiled: only with COMPILED=1
    assert documented - set(real) == {"manifest_error", "control", "graft", "compiled"}


def test_metadata_table_has_exactly_the_keys_of_real_files(real_run: Path) -> None:
    from safetensors import safe_open

    section = _section((ROOT / "docs" / "file-format.md").read_text(), "Pass files")
    documented = {key for key in _first_column_keys(section) if key.startswith("tracedump.")}
    written = set()
    for name in ("pass00000.safetensors", "records.safetensors"):
        with safe_open(str(real_run / name), framework="pt") as handle:
            written |= set(handle.metadata())
    assert written <= documented
    # only in part files of an oversized pass, in stats-mode pass files, in cut-short passes, and
    # in passes whose engine called set_batch()
    assert documented - written == {
        "tracedump.part",
        "tracedump.seq",
        "tracedump.truncated",
        "tracedump.batch",
    }
