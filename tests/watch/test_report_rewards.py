"""memfit report on a preference run: its rewards (TRL's names) in the training section, table and chart."""

from __future__ import annotations

import re

import pytest
from watch_helpers import GiB, start_record, step_records, write_run

pytest.importorskip("matplotlib")

from memfit.watch.report import write_report  # noqa: E402


def _preference_metrics(steps: int) -> list[dict]:
    return [{"step": s, "loss": 0.69 - s / 100, "rewards/chosen": s / 20, "rewards/rejected": -s / 40,
             "rewards/margins": s / 20 + s / 40, "rewards/accuracies": min(1.0, 0.4 + s / 20),
             "logps/chosen": -30.0, "logps/rejected": -40.0} for s in range(1, steps + 1)]


def test_a_preference_runs_rewards_are_charted_and_tabled(tmp_path):
    run = write_run(tmp_path / "run", [start_record(), *step_records(10, rss=lambda s: GiB)], metrics=_preference_metrics(10))
    page = write_report(run).read_text()
    assert "Preference rewards" in re.findall(r'<img alt="([^"]+)"', page)
    assert "<tr><td>rewards/accuracies</td><td class=num>0.4500</td><td class=num>0.9000</td></tr>" in page
    assert "<th class=num>step 1</th><th class=num>step 10</th>" in page
    assert (run / "report-rewards.png").is_file()


def test_a_next_token_run_has_no_rewards(tmp_path):
    run = write_run(tmp_path / "run", [start_record(), *step_records(10, rss=lambda s: GiB)],
                    metrics=[{"step": s, "loss": 1.0 / s} for s in range(1, 11)])
    page = write_report(run).read_text()
    assert "rewards" not in page and not (run / "report-rewards.png").exists()
