"""The largest setting that fits (memfit.planner.search.bracketing.largest_fitting): on memory
curves made up by the test, steeper and flatter than a line, it finds what planning every index
finds, from any guess, with bisection and with interpolation."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

from memfit.planner.search.bracketing import largest_fitting


def _curve(base: int, slope: int, bend: float, memory: int):
    """Plans of a memory curve: ``base + slope * i ** bend`` bytes at index ``i``, against ``memory``."""
    asked: list[int] = []

    def check(index: int):
        asked.append(index)
        total = base + int(slope * index**bend)
        return SimpleNamespace(
            index=index, fits=total <= memory, headroom_bytes=memory - total, device_total_bytes=total
        )

    return check, asked


@pytest.mark.parametrize(
    ("slope", "bend", "memory", "guess", "interpolate"),
    list(itertools.product((3, 50, 400), (0.7, 1.0, 1.6), (1_000, 9_000), (None, 1, 40, 199), (False, True))),
)
def test_the_answer_is_the_last_index_that_fits(slope, bend, memory, guess, interpolate):
    check, asked = _curve(100, slope, bend, memory)
    hi = 200  # one past the end: not planned, or planned where it does not fit
    expected = max(i for i in range(hi) if check(i).fits)
    at_hi = check(hi)
    hi_plan = at_hi if interpolate and not at_hi.fits else None
    lo_plan = check(0)
    asked.clear()
    index, best = largest_fitting(check, 0, hi, guess, lo_plan, interpolate=interpolate, hi_plan=hi_plan)
    assert index == expected and best.index == expected
    assert len(set(asked)) == len(asked)  # no index planned twice


def test_a_right_guess_takes_two_plans():
    check, asked = _curve(0, 10, 1.0, 505)  # index 50 fits, 51 does not
    index, _ = largest_fitting(check, 0, 100, 50, check(0))
    assert index == 50 and asked[1:] == [50, 51]
