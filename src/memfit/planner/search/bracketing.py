"""The arithmetic of a search for the largest setting that fits, where memory grows with it: steps
out from a guess until the boundary is bracketed, then bisection or interpolation. The largest
micro-batch (:mod:`~memfit.planner.search.micro_batch`, and a training run's search) and the longest
sequence (:mod:`~memfit.planner.search.longest`) are both found with it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from memfit.planner.report import MemoryPlan


def largest_fitting(
    check: Callable[[int], MemoryPlan],
    lo: int,
    hi: int,
    guess: int | None,
    best: MemoryPlan | None,
    *,
    interpolate: bool = False,
    hi_plan: MemoryPlan | None = None,
) -> tuple[int, MemoryPlan | None]:
    """Largest index in (lo, hi) whose plan fits, given ``lo`` fits (or is a sentinel) and ``hi`` does
    not, with its plan (``best``, ``lo``'s plan, when none in between fits).

    Memory grows with the index. The search starts at ``guess`` and steps away from it (1, 2, 4...)
    in the direction the plans point until the boundary is bracketed, then narrows the bracket:
    by bisection, or with ``interpolate`` (memory close to linear in the index, as it is in
    sequence length) where the headroom crosses zero between the bracket's ends, from the first
    plan on when ``hi_plan`` (the plan of ``hi``) gives the far end's headroom. Memory is not quite
    linear, so interpolation from the same stale end would creep up on the boundary one side at a
    time; when one end moves twice running, the other end's headroom counts half (the Illinois
    rule), which keeps the bracket closing from both sides. Two plans when the guess is right.
    """
    ends = _Ends(
        lo,
        hi,
        best,
        best.headroom_bytes if best is not None else None,
        hi_plan.headroom_bytes if hi_plan is not None else None,
    )
    index = min(max(guess, lo + 1), hi - 1) if guess is not None else None
    step = 1
    if interpolate and ends.bracketed and hi - lo > 1:
        index = ends.interpolated()
    while ends.hi - ends.lo > 1:
        if index is None or not ends.lo < index < ends.hi:
            index = (ends.lo + ends.hi) // 2
        result = check(index)
        ends.narrow(index, result, illinois=interpolate)
        if not ends.bracketed:  # keep stepping away from the guess
            index = index + step if result.fits else index - step
            step *= 2
        elif interpolate and ends.hi - ends.lo > 1:
            index = ends.interpolated()
        else:
            index = None  # bisection
    return ends.lo, ends.best


@dataclass
class _Ends:
    """The bracket of :func:`largest_fitting`: ``lo`` fits (its plan ``best``), ``hi`` does not; the
    headroom at each end once a plan there is known, and its weight (Illinois)."""

    lo: int
    hi: int
    best: MemoryPlan | None
    lo_room: int | None
    hi_room: int | None
    lo_weight: float = 1.0
    hi_weight: float = 1.0
    direction: int = 0  # which end the last plan moved: 1 lo, -1 hi

    @property
    def bracketed(self) -> bool:
        """Whether the headroom at both ends is known (the boundary can be interpolated)."""
        return self.lo_room is not None and self.hi_room is not None

    def interpolated(self) -> int:
        """Where the line between the ends' (weighted) headroom crosses zero, strictly inside."""
        a, b = self.lo_room * self.lo_weight, self.hi_room * self.hi_weight
        return min(max(self.lo + int((self.hi - self.lo) * a / (a - b)), self.lo + 1), self.hi - 1)

    def narrow(self, index: int, result: MemoryPlan, *, illinois: bool) -> None:
        """Move the end ``result`` (the plan of ``index``) replaces; with ``illinois``, halve the
        other end's weight when the same end moved twice running."""
        moved_lo = result.fits
        if moved_lo:
            self.lo, self.best, self.lo_room, self.lo_weight = index, result, result.headroom_bytes, 1.0
        else:
            self.hi, self.hi_room, self.hi_weight = index, result.headroom_bytes, 1.0
        same_side = self.direction == (1 if moved_lo else -1)
        if illinois and same_side and self.bracketed:
            if moved_lo:
                self.hi_weight /= 2
            else:
                self.lo_weight /= 2
        self.direction = 1 if moved_lo else -1
