"""The progress of a `memfit fit` search: which plan of about how many, the time elapsed and what is left."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from memfit.planner.search.driver import expected_plans
from memfit.planner.search.report import FitProgress, format_duration, progress_line, recent_seconds_per_plan


@pytest.mark.parametrize(
    ("seconds", "said"),
    [
        (0.2, "0 s"),
        (41.4, "41 s"),
        (59.4, "59 s"),
        (59.6, "1 min"),
        (89, "1 min"),
        (91, "2 min"),
        (3599, "60 min"),
        (5400, "1.5 h"),
    ],
)
def test_durations_read_as_people_say_them(seconds, said):
    assert format_duration(seconds) == said


def test_what_is_left_is_the_recent_pace_times_the_plans_to_make():
    # Plan 7 starts at a pace of 6 s a plan: it and 19 more are left, 20 x 6 s.
    assert progress_line(7, 26, elapsed_s=41.0, seconds_per_plan=6.0) == "plan 7 of ~26, 41 s elapsed, about 2 min left"
    assert progress_line(2, 26, elapsed_s=9.0, seconds_per_plan=2.4) == "plan 2 of ~26, 9 s elapsed, about 1 min left"
    assert (
        progress_line(1, 26, elapsed_s=3.0, seconds_per_plan=None) == "plan 1 of ~26, 3 s elapsed"
    )  # nothing measured yet
    assert (
        progress_line(26, 26, elapsed_s=130.0, seconds_per_plan=5.0) == "plan 26 of ~26, 2 min elapsed, about 5 s left"
    )
    assert (
        progress_line(27, 26, elapsed_s=140.0, seconds_per_plan=5.0)
        == "plan 27 (more than the ~26 expected), 2 min elapsed"
    )
    assert progress_line(3, None, elapsed_s=12.0, seconds_per_plan=4.0) == "plan 3, 12 s elapsed"


def test_the_pace_is_that_of_the_last_plans():
    # A search's later plans (its longest sequences) are slower: the pace follows them.
    assert recent_seconds_per_plan([10.0], now=10.0) is None  # the first plan is starting
    # Workers start their first plans together: no pace from those.
    assert recent_seconds_per_plan([10.0, 10.1, 10.2], now=10.2) is None
    assert recent_seconds_per_plan([10.0, 10.1, 10.2, 40.0], now=40.0) == 10.0
    starts = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 15.0, 25.0, 35.0, 45.0, 55.0]
    assert recent_seconds_per_plan(starts, now=55.0) == (55.0 - 5.0) / 5  # plans 6 to 10: 10 s each, not 1 s


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_log_gets_one_line_per_plan_with_the_estimate_from_a_clock():
    clock, out = FakeClock(), io.StringIO()
    progress = FitProgress(Console(file=out, width=80), clock=clock)
    clock.now += 4.0  # validation and imports: elapsed, but no plan's time
    progress.expect(8)
    for seconds in (0.0, 5.0, 5.0, 20.0, 10.0):
        clock.now += seconds
        progress("lora · checkpointing on · adamw · micro-batch 1 · 2048 tokens")
    progress.close()
    assert out.getvalue().splitlines() == [
        "fit: about 8 plans to make, each is one line",
        "plan 1 of ~8, 4 s elapsed: lora · checkpointing on · adamw · micro-batch 1 · 2048 tokens",
        "plan 2 of ~8, 9 s elapsed: lora · checkpointing on · adamw · micro-batch 1 · 2048 tokens",
        "plan 3 of ~8, 14 s elapsed: lora · checkpointing on · adamw · micro-batch 1 · 2048 tokens",
        "plan 4 of ~8, 34 s elapsed, about 50 s left: lora · checkpointing on · adamw · micro-batch 1 · 2048 tokens",
        "plan 5 of ~8, 44 s elapsed, about 40 s left: lora · checkpointing on · adamw · micro-batch 1 · 2048 tokens",
    ]  # whole lines, even past 80 columns; plans 1 to 3 took 30 s (10 s each), plans 1 to 4 40 s


def test_nothing_is_printed_before_the_search_knows_its_inputs_are_good():
    out = io.StringIO()
    progress = FitProgress(Console(file=out), clock=FakeClock())
    progress.close()  # an input error ended the command: it stands alone on stderr
    assert out.getvalue() == ""


def test_a_terminal_gets_one_status_line():
    clock, out = FakeClock(), io.StringIO()
    progress = FitProgress(Console(file=out, force_terminal=True, width=120), clock=clock)
    progress.expect(8)
    clock.now += 2.0
    progress("qlora · checkpointing offload · adamw · micro-batch 1 · 131072 tokens")
    assert progress._line.shown and progress._line.text.startswith("plan 1 of ~8")
    progress.close()
    assert not progress._line.shown and "plan " not in out.getvalue().replace("\r", "\n").split("\n")[-1]


def test_the_expected_plans_follow_the_methods_splits_and_the_longest_sequence():
    # 4 splits of 8: a guess confirmed in about log2(4) plans; the longest sequence: two plans to
    # learn the step over lengths from, one to check the answer.
    assert expected_plans(3, 8) == 3 * (2 + 2 + 3)
    assert expected_plans(1, 1, longest=False) == 2
    assert expected_plans(2, 12) == 2 * (2 + 3 + 3)  # 6 splits
