"""The ``--json`` report's typed model: one ``Status`` for the table, the JSON and the
page; real reports validate against the model with unknown keys refused; the schema in the docs is
the one generated from it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import graft_bf16_onto_fp32
from test_compare_unshard import write_run

from tracedump.cli import main
from tracedump.compare import compare
from tracedump.compare.judge.status import Status
from tracedump.compare.judge.verdict import FAILING
from tracedump.compare.report import page as html_report
from tracedump.compare.report.display import STATUS_TEXT
from tracedump.compare.report.page import rows as page_rows
from tracedump.compare.report.schema import Report, Summary, TensorRecord, schema_markdown

ROOT = Path(__file__).resolve().parent.parent


def _sides(tmp_path: Path) -> tuple[Path, Path]:
    """A diverged pair, a shape mismatch, a NaN pattern, names on one side only, two passes."""
    values = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    with_nan = values.clone()
    with_nan[0, 0] = math.nan
    a = {"x": values + 1, "y": values, "z": with_nan, "only_a": values}
    b = {"x": values, "y": values.reshape(4, 3), "z": values, "only_b": values}
    write_run(tmp_path / "a", 0, {0: a, 1: a})
    write_run(tmp_path / "b", 0, {0: b, 1: b})
    return tmp_path / "a", tmp_path / "b"


def test_a_real_report_validates_against_the_model(tmp_path: Path) -> None:
    a, b = _sides(tmp_path)
    out = tmp_path / "r.json"
    assert main(["diff", str(a), str(b), "--json", str(out)]) == 1
    doc = json.loads(out.read_text())
    report = Report.model_validate(doc)
    statuses = {t.status for t in report.tensors}
    assert {Status.DIVERGED, Status.SHAPE_MISMATCH} <= statuses  # the premise: more than ok
    assert report.summary.first_divergence is not None and report.only_in_a and report.only_in_b
    # the model describes what is there: dumped back by alias, it is the document itself
    assert report.model_dump(by_alias=True, exclude_unset=True, mode="json") == doc


def test_a_key_the_model_does_not_know_is_refused(tmp_path: Path) -> None:
    doc = compare(*_sides(tmp_path)).to_json()
    doc["summary"]["a_new_count"] = 3
    with pytest.raises(ValueError, match="a_new_count"):
        Report.model_validate(doc)


def test_one_status_list_for_the_verdict_the_table_and_the_page(tmp_path: Path) -> None:
    assert {s.value for s in Status if s.fails} == set(FAILING)
    assert {s.value: s.text for s in Status} == STATUS_TEXT
    report = compare(*_sides(tmp_path))
    page = html_report.render(report)
    for status in {r.status for r in report.results}:
        assert f">{Status(status).text}<" in page  # the filter's option, in the table's words


def test_the_schema_in_the_docs_is_up_to_date() -> None:
    assert (ROOT / "docs" / "report-schema.md").read_text() == schema_markdown(), (
        "docs/report-schema.md is stale: run python tools/docs_gen.py"
    )


def test_the_page_s_key_lists_name_only_keys_the_report_has() -> None:
    """The page shows some keys in places of its own and lists the rest: its lists must not name a
    key the report no longer writes (they had drifted from the JSON's before the model)."""
    tensor_keys = {field.alias or name for name, field in TensorRecord.model_fields.items()}
    summary_keys = set(Summary.model_fields)
    assert tensor_keys >= page_rows.SHOWN_KEYS, page_rows.SHOWN_KEYS - tensor_keys
    assert summary_keys >= page_rows.SUMMARY_SHOWN, page_rows.SUMMARY_SHOWN - summary_keys


# ------------------------------------------------------------------ the model writes the report


def _grafted(tmp_path: Path) -> tuple[Path, Path]:
    """A bf16 model grafted from its fp32 reference: its report carries local, grafted_at."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 8)).eval()
    return graft_bf16_onto_fp32(model, torch.randn(4, 16), tmp_path, level="^0$")


def test_a_grafted_report_is_written_and_validates(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    a, b = _grafted(tmp_path)
    assert main(["diff", str(a), str(b), "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert any("local" in t and "grafted_at" in t for t in doc["tensors"])  # the premise
    report = Report.model_validate(doc)
    assert report.model_dump(by_alias=True, exclude_unset=True, mode="json") == doc
    schema = json.loads(schema_markdown().split("```json\n", 1)[1].split("\n```", 1)[0])
    listed = schema["$defs"]["TensorRecord"]["properties"]
    assert {"local", "grafted_at", "not_grafted", "paired_by"} <= set(listed)


@pytest.mark.parametrize("which", ["plain", "grafted"])
def test_the_model_writes_the_records_unchanged(tmp_path: Path, which: str) -> None:
    """Through the model, a report is the JSON of its records: no key added, dropped or changed."""
    report = compare(*(_sides(tmp_path) if which == "plain" else _grafted(tmp_path)))
    assert report.to_json() == json.loads(json.dumps(report.records()))


def test_a_record_key_the_model_does_not_list_never_reaches_a_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    report = compare(*_sides(tmp_path))
    records = report.records()
    records["tensors"][0]["unlisted"] = 1
    monkeypatch.setattr(type(report), "records", lambda self: records)
    with pytest.raises(ValueError, match="unlisted"):
        report.to_json()
