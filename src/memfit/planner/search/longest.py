"""The longest sequence a method fits (``memfit fit --max seq-len``): micro-batch 1, the method's
leanest settings, lengths in multiples of :data:`SEQ_STEP`.

Memory grows with the length and is close to linear in it, so the boundary is bracketed and
interpolated (:func:`~memfit.planner.search.bracketing.largest_fitting`). At long lengths the step
is learnt from two plans (:mod:`memfit.planner.shortcuts.lengths`): each length the search asks
about then costs a prediction instead of a simulation (a rough one while the boundary is looked
for, two exact ones at the boundary found), and one more plan checks the answer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from memfit.planner.report import MemoryPlan
from memfit.planner.search.bracketing import largest_fitting
from memfit.planner.search.plans import SearchPlanner
from memfit.planner.sharding import mode_problems
from memfit.spec import TILING_AUTO_TOKENS

#: Sequence lengths are reported in multiples of this many tokens.
SEQ_STEP = 128


def longest_sequence(
    planner: SearchPlanner, method: str, limit: int, effective_batch: int
) -> tuple[int, dict[str, Any] | None]:
    """Longest sequence (a multiple of SEQ_STEP, at most ``limit``) that ``method`` fits, and its spec.

    Micro-batch 1 (with gradient accumulation for the effective batch), the method's leanest
    settings (offloaded checkpointing, tiling on, its leanest optimizer).
    Returns (0, None) when not even SEQ_STEP tokens fit.
    """
    knobs = _leanest(planner, method, effective_batch)

    def check(steps: int) -> MemoryPlan:
        return planner(**knobs, seq_len=steps * SEQ_STEP)

    top = limit // SEQ_STEP
    if top < 1:
        return 0, None
    if planner.cannot_fit(**knobs, seq_len=SEQ_STEP):
        return 0, None  # the floor is the model states', the same at every length: no length fits
    # The first plan is taken where the step is what it is at long lengths (tiling on from
    # TILING_AUTO_TOKENS), so that what it shows holds far out.
    long_lengths = limit > 4 * TILING_AUTO_TOKENS
    mid = min(max(2048, TILING_AUTO_TOKENS) // SEQ_STEP, top) if long_lengths else min(2048 // SEQ_STEP, top)
    at_mid = check(mid)
    if not at_mid.fits:
        at_one = check(1)
        if not at_one.fits:
            return 0, None
        return _interpolated(check, _Bracket(1, mid, at_one, at_mid), top, _boundary_guess(1, at_one, mid, at_mid))
    if mid == top:
        return top * SEQ_STEP, at_mid.spec
    bracket = _Bracket(mid, top + 1, at_mid, None)
    # Plans alone when every plan is to be made the long way: a predicted one is a shortcut.
    if long_lengths and not planner.exact:
        found = _predicted_boundary(planner, knobs, at_mid, bracket)
        if found is not None:
            return bracket.lo * SEQ_STEP, found.spec
    # Without a model of the step over lengths: two plans give the bytes per token; the boundary
    # is predicted from them, then confirmed.
    if bracket.hi_plan is None and bracket.lo == mid:
        far = min(2 * mid, top)
        bracket.narrow(far, check(far))
    high, high_plan = (bracket.hi, bracket.hi_plan) if bracket.hi_plan is not None else (bracket.lo, bracket.best)
    return _interpolated(check, bracket, top, _boundary_guess(mid, at_mid, high, high_plan))


def _leanest(planner: SearchPlanner, method: str, effective_batch: int) -> dict[str, Any]:
    """The knobs of the method's leanest setting at micro-batch 1, the effective batch accumulated."""
    lean = [
        o
        for o in planner.optimizers[method]
        if not mode_problems(planner.base.get("shard", "none"), planner.base.get("gpus", 1), o)
    ]
    # Tiling on at every length: the leanest setting, and it keeps memory monotonic in the length
    # (with auto, lengths just below TILING_AUTO_TOKENS can need more than the threshold itself).
    knobs = {
        "method": method,
        "optimizer": lean[0],
        "checkpointing": "offload",
        "batch_size": 1,
        "grad_accum": effective_batch,
    }
    if planner.base.get("recipe", "memfit") == "memfit":
        knobs["tiling"] = "on"  # the hf recipe has no tiling to turn on
    return knobs


def _interpolated(
    check: Callable[[int], MemoryPlan], bracket: _Bracket, top: int, guess: int
) -> tuple[int, dict[str, Any]]:
    """The longest length in ``bracket`` that fits, from ``guess`` (in SEQ_STEPs), with plans."""
    lo, hi, best, hi_plan = bracket.lo, bracket.hi, bracket.best, bracket.hi_plan
    if guess >= top and hi > top and lo < top:
        # Predicted to fit all the way: one plan at the limit confirms it.
        at_top = check(top)
        if at_top.fits:
            return top * SEQ_STEP, at_top.spec
        hi, hi_plan = top, at_top
    steps, best = largest_fitting(check, lo, hi, guess, best, interpolate=True, hi_plan=hi_plan)
    return steps * SEQ_STEP, best.spec


def _boundary_guess(low: int, low_plan: MemoryPlan, high: int, high_plan: MemoryPlan) -> int:
    """Where the line through two plans (lengths in SEQ_STEPs) runs out of headroom."""
    per_step = max((high_plan.device_total_bytes - low_plan.device_total_bytes) / max(high - low, 1), 1.0)
    return low + int(low_plan.headroom_bytes // per_step)


@dataclass
class _Bracket:
    """The longest-sequence search's state, in SEQ_STEPs: ``lo`` fits (its plan ``best``), ``hi``
    does not (its plan ``hi_plan``, or None for one past the limit)."""

    lo: int
    hi: int
    best: MemoryPlan
    hi_plan: MemoryPlan | None

    def narrow(self, steps: int, result: MemoryPlan) -> None:
        if result.fits and steps > self.lo:
            self.lo, self.best = steps, result
        elif not result.fits and steps < self.hi:
            self.hi, self.hi_plan = steps, result


def _predicted_boundary(
    planner: SearchPlanner, knobs: dict[str, Any], first_plan: MemoryPlan, bracket: _Bracket
) -> MemoryPlan | None:
    """The plan of the longest sequence, found from a model of the step over lengths
    (:mod:`memfit.planner.shortcuts.lengths`), with ``bracket.lo`` its length; None when the search must go on
    without one (``bracket`` narrowed by the plans made here).

    ``first_plan``: the plan of ``bracket.lo``. One more length is planned
    (:func:`~memfit.planner.shortcuts.lengths.second_length`), the model learnt from the two, and the boundary
    searched on its predictions, which cost a replay of the allocator instead of a simulation. One
    plan then checks the answer: the predicted longest length's (or, when that was planned already,
    the next one's), which must be its prediction, storage by storage.
    """
    from memfit.planner.shortcuts.lengths import LengthSampler, Unpredictable, second_length

    first = bracket.lo
    second = second_length(first * SEQ_STEP, SEQ_STEP) // SEQ_STEP
    if second >= bracket.hi:
        return None
    at_second = planner(**knobs, seq_len=second * SEQ_STEP)
    bracket.narrow(second, at_second)
    if bracket.hi - bracket.lo <= 1:
        return bracket.best
    sampler = LengthSampler((first * SEQ_STEP, second * SEQ_STEP))
    steering = sampler.steering()

    def predict(steps: int) -> MemoryPlan:
        return planner.predict(sampler, **knobs, seq_len=steps * SEQ_STEP)

    def steer(steps: int) -> MemoryPlan:
        return planner.predict(steering, **knobs, seq_len=steps * SEQ_STEP)

    try:
        guess = _boundary_guess(first, first_plan, second, at_second)
        check, expected = _predicted_longest(predict, steer, bracket, guess)
    except Unpredictable:
        return None
    if expected is None:
        return bracket.best  # the next length was planned already: it does not fit
    planned = planner(**knobs, seq_len=check * SEQ_STEP)
    bracket.narrow(check, planned)
    same = planned.fits == expected.fits and planned.device_total_bytes == expected.device_total_bytes
    # Storage by storage where its simulations were made here (not where the plan came from the cache).
    if same and sampler.explains(check * SEQ_STEP) is not False:
        return bracket.best
    return None


def _predicted_longest(
    predict: Callable[[int], MemoryPlan], steer: Callable[[int], MemoryPlan], bracket: _Bracket, guess: int
) -> tuple[int, MemoryPlan | None]:
    """The length to check the predictions with (in SEQ_STEPs) and its predicted plan: the predicted
    longest length, or the next one when that was planned already; None for the plan when the next
    one is ``bracket.hi`` (planned: it does not fit). Raises ``Unpredictable`` as ``predict`` does.

    The boundary is found twice: roughly with ``steer`` (predictions that spare the full depth's
    replay, whose reserved bytes are close), then exactly with ``predict`` from there, which takes
    two predictions where the rough boundary is the exact one."""
    hi, hi_plan = bracket.hi, bracket.hi_plan
    # The limit predicted first: the boundary is then interpolated from both ends at once (memory
    # is close to linear in the length), in a few predictions instead of steps out from the guess.
    at_top = steer(hi - 1) if hi_plan is None and hi - 1 > bracket.lo else None
    if at_top is not None and at_top.fits:
        rough = hi - 1  # every length up to the limit fits, roughly
    else:
        if at_top is not None:
            hi, hi_plan = hi - 1, at_top
        rough, _ = largest_fitting(steer, bracket.lo, hi, guess, bracket.best, interpolate=True, hi_plan=hi_plan)
    steps, predicted = largest_fitting(predict, bracket.lo, bracket.hi, rough, bracket.best)
    check = steps if predicted is not bracket.best else steps + 1
    if check == bracket.hi:
        return check, None
    return check, predicted if check == steps else predict(check)
