"""Planning one training run: what ``memfit train`` asks of the planner, in one place.

A :class:`RunPlanner` holds one model (its config dict) and one
:class:`~memfit.planner.target.Target`, and answers every question a run asks before and while it
trains, each with plans of the run's own knobs against that one Target:

- :meth:`~RunPlanner.check`: the plan of a configuration;
- :meth:`~RunPlanner.preflight`: the run checked before loading; one that does not fit is refused
  with the configurations that do (the search below), unless forced;
- :meth:`~RunPlanner.fit` (``fit: auto``, ``train --fit``): the run's knobs kept (method, rank,
  precision, learning rate, data, sequence length and the effective batch ``batch_size x
  grad_accum``), the ones that only decide memory and speed searched: how the effective batch
  splits into micro-batch and accumulation, activation checkpointing (off, on, offload), tiling,
  and the optimizer only when the user allows it. Every candidate is a plan; the fastest that fits
  (estimated, :mod:`memfit.planner.throughput`) is chosen;
- :meth:`~RunPlanner.step_down`: after a step ran out of memory, the next configuration down: one
  move at a time (half the micro-batch with twice the accumulation, then leaner checkpointing, then
  tiling), the first whose plan needs less memory than the one that failed and fits the Target. The
  effective batch and the data order stay the same, so the run goes on with the very examples it
  would have trained;
- :meth:`~RunPlanner.replan`: the plan of a run that was not planned before it ran out of memory.

What the console says about each answer is the trainer's (:mod:`memfit.train`); this module
returns plans and choices.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from memfit.json_form import JsonForm
from memfit.planner.api import plan
from memfit.planner.report import MemoryPlan
from memfit.planner.search.micro_batch import CHECKPOINTING_FAST_FIRST, largest_micro_batch, micro_batches
from memfit.planner.search.plans import OPTIMIZERS_LEAN_FIRST
from memfit.planner.target import Target
from memfit.planner.throughput import relative_speeds
from memfit.spec import upper_bound
from memfit.units import format_bytes

#: Knobs the search may set; everything else of the run is kept as given.
SEARCHED = ("batch_size", "grad_accum", "checkpointing", "tiling", "optimizer")
#: Configurations that fit, named in a preflight refusal.
REFUSAL_FITS = 3


def describe(knobs: dict[str, Any]) -> str:
    """``micro-batch 2 x 4 accumulated, checkpointing on, tiling off, adamw``."""
    return (
        f"micro-batch {knobs['batch_size']} x {knobs['grad_accum']} accumulated, checkpointing {knobs['checkpointing']}, "
        f"tiling {knobs['tiling']}, {knobs['optimizer']}"
    )


@dataclass
class RunFit(JsonForm):
    """The configuration chosen for a run, the runner-up, and why; ``fitting``: every configuration
    that fits and is worth choosing, fastest first."""

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
            return {
                **{k: plan.spec[k] for k in SEARCHED},
                "device_total_bytes": plan.device_total_bytes,
                "headroom_bytes": plan.headroom_bytes,
            }

        return {
            "chosen": summary(self.chosen),
            "runner_up": summary(self.runner_up),
            "candidates": self.candidates,
            "why": self.why,
        }


@dataclass
class Preflight(JsonForm):
    """A run's plan checked against its Target before any weight is loaded (``plan`` None: the Target
    has no memory to check against). ``fitting``: when the run does not fit and is not forced, the
    configurations of it that do, fastest first (at most :data:`REFUSAL_FITS`)."""

    plan: MemoryPlan | None
    target: Target
    forced: bool = False
    fitting: list[MemoryPlan] = field(default_factory=list)

    @property
    def fits(self) -> bool | None:
        return self.plan.fits if self.plan is not None else None

    @property
    def refused(self) -> bool:
        """The run does not fit and was not forced: it must not start."""
        return self.fits is False and not self.forced

    @property
    def target_name(self) -> str | None:
        return self.plan.gpu["name"] if self.plan is not None and self.plan.gpu else None

    @property
    def target_bytes(self) -> int | None:
        return self.plan.gpu["memory_bytes"] if self.plan is not None and self.plan.gpu else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target_name,
            "target_bytes": self.target_bytes,
            "fits": self.fits,
            "forced": self.forced,
            "plan": self.plan.to_dict() if self.plan is not None else None,
        }


@dataclass(frozen=True)
class StepDown:
    """The configuration one step down: its knobs, its plan, the moves that led there."""

    knobs: dict[str, Any]
    plan: MemoryPlan
    moves: list[str]


class RunPlanner:
    """Plans of one run (``model``: its config dict, overrides included) against one ``target``.

    ``progress`` is called with each candidate's description as a search plans it.
    """

    def __init__(self, model: str | dict, target: Target, *, progress: Callable[[str], None] | None = None):
        self.model = model
        self.target = target
        self.progress = progress

    def check(self, knobs: dict[str, Any]) -> MemoryPlan:
        """The plan of the run with ``knobs`` (RunSpec knobs), against the Target."""
        return plan(self.model, target=self.target, **knobs)

    def replan(self, knobs: dict[str, Any]) -> MemoryPlan:
        """The plan of a configuration that ran without one (planning is advice then)."""
        return self.check(knobs)

    def preflight(
        self,
        knobs: dict[str, Any],
        *,
        force: bool = False,
        fit_knobs: dict[str, Any] | None = None,
        allow_optimizer: bool = False,
    ) -> Preflight:
        """The run checked before loading. Nothing is planned when the Target has no memory. A run that
        does not fit and is not ``force``\\ d gets the configurations that do: :meth:`fit` of
        ``fit_knobs`` (default ``knobs``; a search over micro-batch sizes plans at the data's longest
        example), ``allow_optimizer`` as there."""
        if not self.target.has_memory:
            return Preflight(plan=None, target=self.target)
        result = self.check(knobs)
        if result.fits is not False:
            return Preflight(plan=result, target=self.target)
        if force:
            return Preflight(plan=result, target=self.target, forced=True)
        found = self.fit(fit_knobs or knobs, allow_optimizer=allow_optimizer)
        return Preflight(plan=result, target=self.target, fitting=found.fitting[:REFUSAL_FITS] if found else [])

    def fit(self, knobs: dict[str, Any], *, allow_optimizer: bool = False) -> RunFit | None:
        """The fastest configuration of the run ``knobs`` describe that fits the Target.

        ``knobs`` are the run's RunSpec knobs; ``batch_size x grad_accum`` is the effective batch kept.
        Returns None when nothing fits. Raises PlanError for bad input, before any simulation.
        """
        planned = _Counted(self, knobs)
        fitting = []
        for settings in _settings(knobs, allow_optimizer):
            best = _largest_fitting_split(planned, knobs, settings)
            if best is not None:
                fitting.append(best)
        if not fitting:
            return None
        return _chosen(fitting, planned.count)

    def step_down(self, knobs: dict[str, Any], failed: MemoryPlan) -> StepDown | None:
        """The next configuration down from ``knobs``, which ran out of memory (``failed``: its plan),
        or None when nothing smaller fits. Smaller: less device memory at the peak, or as much (the
        allocator's segments are coarse) and fewer bytes allocated.

        Moves in the order that costs least speed: half the micro-batch with twice the accumulation
        (the same effective batch), leaner checkpointing, tiling on. The first move whose plan needs
        less is taken; if that still does not fit the Target, the descent goes on from there. Each
        move keeps the data order and the optimizer's state, so the run continues exactly; the
        optimizer is never changed here (its state would not carry over).
        """
        current, current_plan, made = dict(knobs), failed, []
        while True:
            step = None
            for changes, what in _moves(current):
                candidate = {**current, **changes}
                result = self.check(candidate)
                if (result.device_total_bytes, result.allocated_bytes) < (
                    current_plan.device_total_bytes,
                    current_plan.allocated_bytes,
                ):
                    step = (candidate, result, what)
                    break
            if step is None:
                return None
            current, current_plan, what = step
            made = made + [what]
            if current_plan.fits is not False:
                return StepDown(current, current_plan, made)


class _Counted:
    """The plans of a search: the run's knobs with some changed, counted, each announced to ``progress``."""

    def __init__(self, planner: RunPlanner, knobs: dict[str, Any]):
        self.planner, self.knobs, self.count = planner, knobs, 0

    def __call__(self, **changes: Any) -> MemoryPlan:
        self.count += 1
        spec = {**self.knobs, **changes}
        if self.planner.progress is not None:
            self.planner.progress(describe({k: spec.get(k) for k in SEARCHED}))
        return self.planner.check(spec)


def _settings(knobs: dict[str, Any], allow_optimizer: bool) -> list[dict[str, str]]:
    """The optimizer, checkpointing and tiling settings a search tries, in that nesting."""
    optimizers = [knobs.get("optimizer", "adamw")]
    if allow_optimizer:
        optimizers += [o for o in OPTIMIZERS_LEAN_FIRST[knobs.get("method", "lora")][::-1] if o not in optimizers]
    tilings = ["off", "on"] if knobs.get("tiling", "auto") == "auto" else [knobs["tiling"]]
    return [
        dict(checkpointing=checkpointing, tiling=tiling, optimizer=optimizer)
        for optimizer in optimizers
        for checkpointing in CHECKPOINTING_FAST_FIRST
        for tiling in tilings
    ]


def _largest_fitting_split(planned: _Counted, knobs: dict[str, Any], settings: dict[str, str]) -> MemoryPlan | None:
    """The plan of the largest micro-batch that fits with ``settings``, the effective batch kept
    (``memfit fit``'s arithmetic); None when not even the smallest split fits."""
    effective = int(knobs.get("batch_size", 1)) * int(knobs.get("grad_accum", 1))
    # Ascending; a split needs an accumulation the knobs allow (an effective batch above that bound
    # cannot start at micro-batch 1).
    splits = [b for b in micro_batches(effective) if effective // b <= upper_bound("grad_accum")]

    def plan_at(batch: int, accum: int) -> MemoryPlan:
        return planned(batch_size=batch, grad_accum=accum, **settings)

    # Memory grows with the micro-batch: if the smallest does not fit, none does.
    smallest = plan_at(splits[0], effective // splits[0])
    if not smallest.fits:
        return None
    return largest_micro_batch(plan_at, splits, effective, smallest)


def _chosen(fitting: list[MemoryPlan], candidates: int) -> RunFit:
    """The fastest of ``fitting`` (estimated), the runner-up, and why."""
    speeds = relative_speeds([p.spec for p in fitting])
    # A configuration slower than another that needs no less memory is no choice at all (tiling at a
    # length where it saves nothing, say): only the others are ranked.
    useful = [
        (p, v)
        for p, v in zip(fitting, speeds)
        if not any(w > v and q.device_total_bytes <= p.device_total_bytes for q, w in zip(fitting, speeds))
    ]
    ranked = sorted(useful, key=lambda pair: (-pair[1], -(pair[0].headroom_bytes or 0)))
    chosen, runner_up = ranked[0][0], (ranked[1][0] if len(ranked) > 1 else None)
    why = f"the fastest (estimated) of {len(ranked)} that fit, {format_bytes(chosen.headroom_bytes or 0)} to spare"
    if runner_up is not None:
        slower = 1.0 - ranked[1][1] / ranked[0][1]
        why += (
            f"; runner-up {describe({k: runner_up.spec[k] for k in SEARCHED})}, about {slower:.0%} slower"
            if slower > 0.005
            else f"; runner-up {describe({k: runner_up.spec[k] for k in SEARCHED})}, as fast, less headroom"
        )
    return RunFit(chosen=chosen, runner_up=runner_up, candidates=candidates, why=why, fitting=[p for p, _ in ranked])


def _moves(knobs: dict[str, Any]) -> list[tuple[dict[str, Any], str]]:
    """The moves one step down from ``knobs``, the cheapest in speed first, each with how it is said."""
    moves: list[tuple[dict[str, Any], str]] = []
    batch, accum = int(knobs["batch_size"]), int(knobs["grad_accum"])
    if batch > 1 and batch % 2 == 0:
        moves.append(
            (
                {"batch_size": batch // 2, "grad_accum": accum * 2},
                f"micro-batch {batch} -> {batch // 2}, accumulation {accum} -> {accum * 2}",
            )
        )
    leaner = CHECKPOINTING_FAST_FIRST[CHECKPOINTING_FAST_FIRST.index(knobs["checkpointing"]) + 1 :]
    for checkpointing in leaner:
        moves.append(({"checkpointing": checkpointing}, f"checkpointing {knobs['checkpointing']} -> {checkpointing}"))
    if knobs.get("tiling") != "on":
        moves.append(({"tiling": "on"}, f"tiling {knobs.get('tiling', 'auto')} -> on"))
    return moves
