"""Which sequence lengths the page plans, and where memory crosses the card."""

from memfit.ui.context import MAX_POINTS, longest_fitting, sweep_lengths

GiB = 2**30


def test_lengths_double_up_to_the_model_and_keep_the_chosen_one():
    assert sweep_lengths(2048, 8192) == [512, 1024, 2048, 4096, 8192]
    assert sweep_lengths(3000, 8192) == [512, 1024, 2048, 3000, 4096, 8192]
    long = sweep_lengths(1024, 131072)
    assert len(long) == MAX_POINTS and long[-1] == 131072 and 1024 in long
    assert sweep_lengths(2048, None)[-1] == 131072
    assert sweep_lengths(100, 256) == [100, 256]


def test_longest_fitting_reads_the_line_between_two_plans():
    points = [(1024, 10 * GiB), (2048, 14 * GiB), (4096, 22 * GiB), (8192, 38 * GiB)]
    # 24 GiB lies an eighth of the way from 4096 (22) to 8192 (38): 4608 tokens; 25 GiB 4864, in steps of 128.
    assert longest_fitting(points, 24 * GiB) == {"seq_len": 4608, "exact": False, "between": [4096, 8192]}
    assert longest_fitting(points, 25 * GiB)["seq_len"] == 4864
    assert longest_fitting(points, 40 * GiB) == {"seq_len": 8192, "exact": True, "between": None}
    assert longest_fitting(points, 9 * GiB)["seq_len"] == 0
    assert longest_fitting(points, None) is None
