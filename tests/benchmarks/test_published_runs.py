"""The published-runs table: every case names where its figure was published and how it is compared,
and the summary counts what it says (a refused case and a case with an unplannable key apart)."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import published_runs  # noqa: E402


def test_every_case_names_its_source_commit_counter_and_configuration():
    cases = published_runs.cases()
    assert len({case["id"] for case in cases}) == len(cases)
    for case in cases:
        source = case["source"]
        assert source["repository"] and source["path"] and source["commit"] and source["quote"], case["id"]
        assert case["counter"] in published_runs.COMPARED, case["id"]
        assert case["published_gib"] > 0 and case["config"], case["id"]
    assert len({case["tool"] for case in cases}) >= 5


def _row(case_id: str, error: float | None, unplannable: list[str] | None = None) -> dict:
    planned = None if error is None else 1
    return {
        "id": case_id,
        "tool": case_id.split()[0],
        "planned_bytes": planned,
        "error": error,
        "unplannable": unplannable or [],
    }


def test_summary_takes_the_worst_under_from_fully_plannable_cases():
    rows = [
        _row("a one", 0.02),
        _row("b two", -0.04),
        _row("c three", -0.30, ["liger: kernels"]),
        _row("d four", 0.10),
        _row("e five", None, ["refused: too long"]),
    ]
    summary = published_runs.summary(rows)
    assert summary["cases"] == 4 and summary["tools"] == ["a", "b", "c", "d"]
    assert summary["median_abs_error"] == 0.07  # of 0.02, 0.04, 0.10, 0.30
    assert summary["worst_under"] == {"id": "b two", "error": -0.04}
    assert summary["worst_under_any"] == {"id": "c three", "error": -0.30}
    assert summary["worst_under_by"] == 0.04 and summary["worst_under_any_by"] == 0.30
    assert summary["under_by_more_than_5_percent"] == []
    assert summary["refused"] == ["e five"]
