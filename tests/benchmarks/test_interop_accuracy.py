"""The interop accuracy results: each case as the benchmark defines it, its ratio and the medians
recomputed from the figures, and docs/interop.md's table made from the file."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import interop_accuracy  # noqa: E402

RESULT = json.loads(interop_accuracy.RESULTS.read_text())


def test_every_case_of_the_benchmark_is_in_the_results():
    assert [row["id"] for row in RESULT["cases"]] == [case["id"] for case in interop_accuracy.cases()]
    for row, case in zip(RESULT["cases"], interop_accuracy.cases()):
        assert row["config"] == case["config"] and row["published_gib"] == case["published_gib"]
        assert row["source"].startswith("https://") and row["quote"]


@pytest.mark.parametrize("row", RESULT["cases"], ids=lambda r: r["id"])
def test_each_ratio_is_planned_over_published(row):
    assert row["ratio"] == pytest.approx(row["planned_gib"] / row["published_gib"], abs=2e-3)


def test_the_medians_are_those_of_the_cases():
    assert RESULT["summary"] == interop_accuracy.summary(RESULT["cases"])


def test_the_doc_table_and_figures_are_the_results_file():
    import figures

    text = interop_accuracy.DOC.read_text()
    assert "<!-- figures:begin interop-accuracy" in text
    assert [f for _, f, _ in figures.references([interop_accuracy.DOC])].count("interop_accuracy") >= 10
    problems = figures.check_text(text, figures.Results(), interop_accuracy.DOC)
    assert not problems, f"{problems} (python benchmarks/interop_accuracy.py --doc)"


def test_doc_rewrites_the_table_from_the_results(tmp_path, monkeypatch):
    """--doc writes the block from the file it is given: a changed median reaches the page."""
    results = tmp_path / "results"
    results.mkdir()
    changed = json.loads(json.dumps(RESULT))
    changed["summary"]["all"]["median_abs_error"] = 0.5
    (results / "interop_accuracy.json").write_text(json.dumps(changed))
    doc = tmp_path / "interop.md"
    doc.write_text(interop_accuracy.DOC.read_text())
    monkeypatch.setattr(interop_accuracy, "DOC", doc)
    assert interop_accuracy.main(["--doc", "--out", str(results / "interop_accuracy.json")]) == 0
    text = doc.read_text()
    assert "| all | 21 | 50.0% |" in text and "cases the median is\n50.0%<!--fig" in text
