"""One method's settings and its largest micro-batch: for each checkpointing setting, fastest first,
the optimizer that fits and the largest micro-batch that splits the effective batch.

Memory grows with the micro-batch and is close to affine in it, so micro-batch 1's plan predicts
where the boundary lies and a search bracketed around the prediction confirms it
(:func:`largest_micro_batch`, shared with a training run's search,
:meth:`memfit.planner.search.run.RunPlanner.fit`). Once one setting fits the whole effective batch in
a single micro-batch, the slower ones are not planned.
"""

from __future__ import annotations

from collections.abc import Callable

from memfit.planner.report import MemoryPlan
from memfit.planner.search.bracketing import largest_fitting
from memfit.planner.search.plans import SearchPlanner, planned_miss
from memfit.planner.search.results import Fit, Miss
from memfit.planner.sharding import mode_problems
from memfit.spec import choices

#: Fastest first; each next one needs less memory.
CHECKPOINTING_FAST_FIRST = choices("checkpointing")  # RunSpec declares them fastest first


def micro_batches(effective_batch: int) -> list[int]:
    """Micro-batch sizes that divide the effective batch (so gradient accumulation keeps it exactly)."""
    return [b for b in range(1, effective_batch + 1) if effective_batch % b == 0]


def largest_micro_batch(
    plan_at: Callable[[int, int], MemoryPlan], options: list[int], effective_batch: int, at_one: MemoryPlan
) -> MemoryPlan:
    """The plan with the largest micro-batch in ``options`` (ascending divisors of ``effective_batch``)
    that fits; ``at_one``, micro-batch 1's plan, fits. ``plan_at(micro_batch, grad_accum)`` plans one.

    What one more sequence costs is guessed from micro-batch 1's plan (its activations and
    temporaries grow with the batch; weights and states do not), and confirmed with plans.
    """

    def check(index: int) -> MemoryPlan:
        b = options[index]
        return plan_at(b, effective_batch // b)

    if len(options) == 1:
        return at_one
    per_sample = max(at_one.categories["activations"] + at_one.categories["temporaries"], 1)
    room = at_one.headroom_bytes
    guess = max((i for i, b in enumerate(options) if (b - 1) * per_sample <= room), default=0)
    _, best = largest_fitting(check, 0, len(options), max(guess, 1), at_one)
    return best


def search_method(planner: SearchPlanner, method: str, effective_batch: int) -> tuple[list[Fit], list[Miss]]:
    """For each checkpointing setting of ``method``, fastest first: the preferred optimizer and the
    largest micro-batch that fit.

    A setting that fits the whole effective batch in one micro-batch makes the slower settings
    pointless (they cannot do better), so the search stops there.
    """
    fits: list[Fit] = []
    misses: list[Miss] = []
    options = micro_batches(effective_batch)
    for position, checkpointing in enumerate(CHECKPOINTING_FAST_FIRST):
        if position and len(options) > 1:
            whole = _whole_batch_at_once(planner, method, checkpointing, effective_batch)
            if whole is not None:
                fits.append(Fit(spec=whole.spec, plan=whole))
                break
        chosen = _first_fitting_optimizer(planner, method, checkpointing, effective_batch, misses)
        if chosen is None:
            continue  # leaner checkpointing may still fit
        knobs = {"method": method, "optimizer": chosen.spec["optimizer"], "checkpointing": checkpointing}
        best = largest_micro_batch(
            lambda b, accum, knobs=knobs: planner(**knobs, batch_size=b, grad_accum=accum),
            options,
            effective_batch,
            chosen,
        )
        fits.append(Fit(spec=best.spec, plan=best))
        if best.spec["batch_size"] == options[-1]:
            break
    return fits, misses


def _runnable_optimizers(planner: SearchPlanner, method: str) -> list[str]:
    """The method's optimizers, 32-bit AdamW first (exact), then lighter states, leanest last; those
    the shard mode cannot run left out."""
    return [
        optimizer
        for optimizer in planner.optimizers[method][::-1]
        if not mode_problems(planner.base.get("shard", "none"), planner.base.get("gpus", 1), optimizer)
    ]


def _first_fitting_optimizer(
    planner: SearchPlanner, method: str, checkpointing: str, effective_batch: int, misses: list[Miss]
) -> MemoryPlan | None:
    """Micro-batch 1's plan with the first optimizer that fits (:func:`_runnable_optimizers`' order),
    or None; each that does not fit is added to ``misses``."""
    for optimizer in _runnable_optimizers(planner, method):
        knobs = dict(
            method=method, optimizer=optimizer, checkpointing=checkpointing, batch_size=1, grad_accum=effective_batch
        )
        if planner.cannot_fit(**knobs):
            # Full fine-tuning of a model whose states alone are over the target (8B on 24 GB):
            # a plan could only say that it does not fit.
            misses.append(planner.unplanned_miss(**knobs))
            continue
        candidate = planner(**knobs)
        if candidate.fits:
            return candidate
        misses.append(planned_miss(candidate))
    return None


def _whole_batch_at_once(
    planner: SearchPlanner, method: str, checkpointing: str, effective_batch: int
) -> MemoryPlan | None:
    """The plan of the whole effective batch in one micro-batch with the optimizer the search tries
    first, when it fits; else None (one plan made, or none when that optimizer is ruled out).

    Once a faster setting has been planned, a slower one (more checkpointing) usually fits the whole
    batch at once, and then it is the answer :func:`search_method` reaches from micro-batch 1 in
    several plans: that optimizer fits at micro-batch 1 too (memory grows with the micro-batch), the
    largest micro-batch is the whole batch, and no optimizer of this setting misses. When it does
    not fit, the search goes on from micro-batch 1 as if this plan had not been made.
    """
    for optimizer in _runnable_optimizers(planner, method)[:1]:
        knobs = dict(
            method=method, optimizer=optimizer, checkpointing=checkpointing, batch_size=effective_batch, grad_accum=1
        )
        # Only the first optimizer the search would plan: a leaner one would leave misses to report.
        if planner.cannot_fit(**knobs):
            return None
        candidate = planner(**knobs)
        return candidate if candidate.fits else None
    return None
