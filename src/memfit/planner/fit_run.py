"""Fit one training run to its card: the knobs the user left open, chosen by plans.

``memfit train --fit`` keeps what defines the run (method, rank, precision, learning rate, data,
sequence length and the effective batch ``batch_size x grad_accum``) and searches what only decides
memory and speed: how the effective batch splits into micro-batch and accumulation, activation
checkpointing (off, on, offload), tiling, and the optimizer only when the user allows it. Every
candidate is a plan; the fastest that fits (estimated, :mod:`memfit.planner.throughput`) is chosen.

When a step still runs out of memory, :func:`smaller_configuration` finds the next configuration
down: one move at a time (half the micro-batch with twice the accumulation, then leaner
checkpointing, then tiling), the first whose plan needs less memory than the one that failed and
fits the target. The effective batch and the data order stay the same, so the run goes on with
the very examples it would have trained.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from memfit.json_form import JsonForm
from memfit.planner.report import MemoryPlan
from memfit.planner.search import CHECKPOINTING_FAST_FIRST, OPTIMIZERS_LEAN_FIRST, largest_micro_batch, micro_batches
from memfit.planner.throughput import relative_speeds
from memfit.spec import upper_bound
from memfit.units import format_bytes

#: Knobs the search may set; everything else of the run is kept as given.
SEARCHED = ("batch_size", "grad_accum", "checkpointing", "tiling", "optimizer")


@dataclass
class RunFit(JsonForm):
    """The configuration chosen for a run, the runner-up, and why."""

    chosen: MemoryPlan
    runner_up: MemoryPlan | None
    candidates: int  # configurations planned
    why: str
    fitting: list[MemoryPlan] = field(default_factory=list)

    def knobs(self) -> dict[str, Any]:
        """The searched knobs of the chosen configuration."""
        return {k: self.chosen.spec[k] for k in SEARCHED}

    def to_dict(self) -> dict[str, Any]:
        def summary(plan: MemoryPlan | None) -> dict[str, Any] | None:
            if plan is None:
                return None
            return {**{k: plan.spec[k] for k in SEARCHED}, "device_total_bytes": plan.device_total_bytes,
                    "headroom_bytes": plan.headroom_bytes}

        return {"chosen": summary(self.chosen), "runner_up": summary(self.runner_up), "candidates": self.candidates,
                "why": self.why}


def describe(knobs: dict[str, Any]) -> str:
    """``micro-batch 2 x 4 accumulated, checkpointing on, tiling off, adamw``."""
    return (f"micro-batch {knobs['batch_size']} x {knobs['grad_accum']} accumulated, checkpointing {knobs['checkpointing']}, "
            f"tiling {knobs['tiling']}, {knobs['optimizer']}")


def fit_run(
    model: str | dict,
    knobs: dict[str, Any],
    *,
    gpu: str | None = None,
    budget: str | int | None = None,
    context_bytes: int | None = None,
    allow_optimizer: bool = False,
    progress: Callable[[str], None] | None = None,
) -> RunFit | None:
    """The fastest configuration of the run ``knobs`` describe that fits ``gpu`` / ``budget``.

    ``knobs`` are the run's RunSpec knobs; ``batch_size x grad_accum`` is the effective batch kept.
    Returns None when nothing fits. Raises PlanError for bad input, before any simulation.
    """
    from memfit.planner.api import plan

    effective = int(knobs.get("batch_size", 1)) * int(knobs.get("grad_accum", 1))
    # Ascending; a split needs an accumulation the knobs allow (an effective batch above that bound
    # cannot start at micro-batch 1).
    splits = [b for b in micro_batches(effective) if effective // b <= upper_bound("grad_accum")]
    optimizers = [knobs.get("optimizer", "adamw")]
    if allow_optimizer:
        optimizers += [o for o in OPTIMIZERS_LEAN_FIRST[knobs.get("method", "lora")][::-1] if o not in optimizers]
    tilings = ["off", "on"] if knobs.get("tiling", "auto") == "auto" else [knobs["tiling"]]
    count = 0

    def planned(**changes: Any) -> MemoryPlan:
        nonlocal count
        count += 1
        spec = {**knobs, **changes}
        if progress is not None:
            progress(describe({k: spec.get(k) for k in SEARCHED}))
        return plan(model, gpu=gpu, budget=budget, context_bytes=context_bytes, **spec)

    fitting: list[MemoryPlan] = []
    for optimizer in optimizers:
        for checkpointing in CHECKPOINTING_FAST_FIRST:
            for tiling in tilings:
                # Memory grows with the micro-batch: if the smallest does not fit, none does; else
                # the largest that fits, as memfit fit finds it.
                def plan_at(batch: int, accum: int, settings=dict(checkpointing=checkpointing, tiling=tiling, optimizer=optimizer)) -> MemoryPlan:
                    return planned(batch_size=batch, grad_accum=accum, **settings)

                smallest = plan_at(splits[0], effective // splits[0])
                if not smallest.fits:
                    continue
                best = largest_micro_batch(plan_at, splits, effective, smallest)
                fitting.append(best)
    if not fitting:
        return None
    speeds = relative_speeds([p.spec for p in fitting])
    # A configuration slower than another that needs no less memory is no choice at all (tiling at a
    # length where it saves nothing, say): only the others are ranked.
    useful = [(p, v) for p, v in zip(fitting, speeds)
              if not any(w > v and q.device_total_bytes <= p.device_total_bytes for q, w in zip(fitting, speeds))]
    ranked = sorted(useful, key=lambda pair: (-pair[1], -(pair[0].headroom_bytes or 0)))
    chosen, runner_up = ranked[0][0], (ranked[1][0] if len(ranked) > 1 else None)
    why = (f"the fastest (estimated) of {len(ranked)} that fit, {format_bytes(chosen.headroom_bytes or 0)} to spare")
    if runner_up is not None:
        slower = 1.0 - ranked[1][1] / ranked[0][1]
        why += (f"; runner-up {describe({k: runner_up.spec[k] for k in SEARCHED})}, about {slower:.0%} slower"
                if slower > 0.005 else f"; runner-up {describe({k: runner_up.spec[k] for k in SEARCHED})}, as fast, less headroom")
    return RunFit(chosen=chosen, runner_up=runner_up, candidates=count, why=why, fitting=[p for p, _ in ranked])


def smaller_configuration(
    model: str | dict,
    knobs: dict[str, Any],
    failed: MemoryPlan,
    *,
    gpu: str | None = None,
    budget: str | int | None = None,
    context_bytes: int | None = None,
) -> tuple[dict[str, Any], MemoryPlan, list[str]] | None:
    """The next configuration down from ``knobs``, which ran out of memory (``failed``: its plan):
    (knobs, plan, the moves made), or None when nothing smaller fits. Smaller: less device memory
    at the peak, or as much (the allocator's segments are coarse) and fewer bytes allocated.

    Moves in the order that costs least speed: half the micro-batch with twice the accumulation (the
    same effective batch), leaner checkpointing, tiling on. The first move whose plan needs less is
    taken; if that still does not fit the target, the descent goes on from there. Each move keeps
    the data order and the optimizer's state, so the run continues exactly; the optimizer is never
    changed here (its state would not carry over).
    """
    from memfit.planner.api import plan

    current, current_plan, made = dict(knobs), failed, []
    while True:
        step = None
        for changes, what in _moves(current):
            candidate = {**current, **changes}
            result = plan(model, gpu=gpu, budget=budget, context_bytes=context_bytes, **candidate)
            if (result.device_total_bytes, result.allocated_bytes) < (current_plan.device_total_bytes, current_plan.allocated_bytes):
                step = (candidate, result, what)
                break
        if step is None:
            return None
        current, current_plan, what = step
        made = made + [what]
        if current_plan.fits is not False:
            return current, current_plan, made


def _moves(knobs: dict[str, Any]) -> list[tuple[dict[str, Any], str]]:
    moves: list[tuple[dict[str, Any], str]] = []
    batch, accum = int(knobs["batch_size"]), int(knobs["grad_accum"])
    if batch > 1 and batch % 2 == 0:
        moves.append(({"batch_size": batch // 2, "grad_accum": accum * 2},
                      f"micro-batch {batch} -> {batch // 2}, accumulation {accum} -> {accum * 2}"))
    leaner = CHECKPOINTING_FAST_FIRST[CHECKPOINTING_FAST_FIRST.index(knobs["checkpointing"]) + 1:]
    for checkpointing in leaner:
        moves.append(({"checkpointing": checkpointing}, f"checkpointing {knobs['checkpointing']} -> {checkpointing}"))
    if knobs.get("tiling") != "on":
        moves.append(({"tiling": "on"}, f"tiling {knobs.get('tiling', 'auto')} -> on"))
    return moves
