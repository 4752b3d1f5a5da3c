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


def test_the_doc_table_is_the_results_file():
    text = interop_accuracy.DOC.read_text()
    assert interop_accuracy.render_doc(text, RESULT) == text, "python benchmarks/interop_accuracy.py --doc"
