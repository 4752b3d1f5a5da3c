"""memfit report on a preference run: its rewards (TRL's names, in training and evaluation) in the training section,
table and chart; the end-of-run record in one line."""

from __future__ import annotations

import re

import pytest
from watch_helpers import GiB, start_record, step_records, write_run

pytest.importorskip("matplotlib")

from memfit.watch.report import write_report


def _preference_metrics(steps: int) -> list[dict]:
    return [
        {
            "step": s,
            "loss": 0.69 - s / 100,
            "rewards/chosen": s / 20,
            "rewards/rejected": -s / 40,
            "rewards/margins": s / 20 + s / 40,
            "rewards/accuracies": min(1.0, 0.4 + s / 20),
            "logps/chosen": -30.0,
            "logps/rejected": -40.0,
        }
        for s in range(1, steps + 1)
    ]


def test_a_preference_runs_rewards_are_charted_and_tabled(tmp_path):
    run = write_run(
        tmp_path / "run", [start_record(), *step_records(10, rss=lambda s: GiB)], metrics=_preference_metrics(10)
    )
    page = write_report(run).read_text()
    assert "Preference rewards" in re.findall(r'<img alt="([^"]+)"', page)
    assert "<tr><td>rewards/accuracies</td><td class=num>0.4500</td><td class=num>0.9000</td></tr>" in page
    assert "<th class=num>step 1</th><th class=num>step 10</th>" in page
    assert (run / "report-rewards.png").is_file()


def test_a_next_token_run_has_no_rewards(tmp_path):
    run = write_run(
        tmp_path / "run",
        [start_record(), *step_records(10, rss=lambda s: GiB)],
        metrics=[{"step": s, "loss": 1.0 / s} for s in range(1, 11)],
    )
    page = write_report(run).read_text()
    assert "rewards" not in page and not (run / "report-rewards.png").exists()


def test_evaluation_rewards_and_the_end_of_run_record_are_shown(tmp_path):
    metrics = _preference_metrics(10)
    for step, accuracy in ((5, 0.55), (10, 0.8)):
        metrics.insert(
            metrics.index(next(m for m in metrics if m["step"] == step)) + 1,
            {
                "step": step,
                "epoch": step / 10,
                "eval_loss": 0.6,
                "eval_rewards/chosen": 0.1,
                "eval_rewards/rejected": -0.1,
                "eval_rewards/margins": 0.2,
                "eval_rewards/accuracies": accuracy,
            },
        )
    metrics.append(
        {
            "step": 10,
            "epoch": 1.0,
            "train_runtime": 12.5,
            "train_samples_per_second": 6.4,
            "train_steps_per_second": 0.8,
            "train_loss": 0.635,
        }
    )
    run = write_run(tmp_path / "run", [start_record(), *step_records(10, rss=lambda s: GiB)], metrics=metrics)
    page = write_report(run).read_text()
    assert "<th>preference metric (evaluation)</th><th class=num>step 5</th><th class=num>step 10</th>" in page
    assert "<tr><td>eval_rewards/accuracies</td><td class=num>0.5500</td><td class=num>0.8000</td></tr>" in page
    assert "end of run (step 10): train_loss 0.6350, train_runtime 12.5 s, 6.400 samples/s, 0.800 steps/s" in page
    assert "Preference rewards" in re.findall(r'<img alt="([^"]+)"', page)


def test_a_grpo_runs_reward_is_charted_and_tabled(tmp_path):
    metrics = [
        {
            "step": s,
            "loss": 0.01,
            "reward": 0.5 + s / 40,
            "reward_std": 0.2,
            "rewards/length/mean": 0.5 + s / 40,
            "rewards/length/std": 0.2,
            "frac_reward_zero_std": 0.0,
            "completions/mean_length": 30.0 - s,
            "completions/clipped_ratio": 0.5,
            "entropy": 6.0 - s / 10,
        }
        for s in range(1, 11)
    ]
    run = write_run(tmp_path / "run", [start_record(), *step_records(10, rss=lambda s: GiB)], metrics=metrics)
    page = write_report(run).read_text()
    assert "GRPO rewards" in re.findall(r'<img alt="([^"]+)"', page) and (run / "report-grpo-rewards.png").is_file()
    assert "<tr><td>reward</td><td class=num>0.5250</td><td class=num>0.7500</td></tr>" in page
    assert "<tr><td>rewards/length/mean</td>" in page and "<th>grpo metric</th>" in page
    assert "Preference rewards" not in page
