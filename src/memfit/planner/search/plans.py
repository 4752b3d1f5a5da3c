"""The plans a search makes: :class:`SearchPlanner` plans with a fixed model, Target and base knobs,
counts its plans and announces each, and counts paged optimizer states against the headroom."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from memfit.planner.api import plan
from memfit.planner.layout import proven_over_budget
from memfit.planner.report import MemoryPlan
from memfit.planner.search.results import Miss
from memfit.planner.target import Target

#: The optimizers tried for each method, leanest first.
OPTIMIZERS_LEAN_FIRST = {
    "full": ("paged-adamw8bit", "adamw8bit", "adamw"),
    "lora": ("adamw",),
    "qlora": ("adamw",),
    "lora-8bit": ("adamw",),
}


class SearchPlanner:
    """Plans with fixed model, target and base knobs; counts the plans it makes.

    ``exact``: every plan made the long way (``plan(..., exact=True)``).
    """

    def __init__(
        self,
        model: str | dict,
        target: Target,
        base: dict[str, Any],
        progress: Callable[[str], None] | None,
        deepspeed: Any = None,
        *,
        exact: bool = False,
    ):
        self.model = model
        self.target = target
        self.deepspeed = {"deepspeed": deepspeed} if deepspeed is not None else {}
        self.exact = exact
        self.base = base
        self.count = 0
        self.progress = progress or (lambda message: None)
        self.supports_bf16 = True
        self.optimizers = OPTIMIZERS_LEAN_FIRST  # the optimizers tried for each method, leanest first

    def precision_for(self, method: str) -> str:
        """bf16 where the card has it; otherwise fp16 for adapters and fp32 for full fine-tuning."""
        if self.supports_bf16:
            return "bf16"
        return "fp32" if method == "full" else "fp16"

    def knobs_for(self, **knobs: Any) -> dict[str, Any]:
        """Every knob a plan of ``knobs`` is made with: the base knobs, these, the precision. grpo's
        sequence keeps its prompt budget: a longer one is a longer completion (the search for the
        longest sequence is then the search for the longest completion)."""
        merged = dict(self.base)
        merged.update(knobs)
        merged.setdefault("precision", self.precision_for(merged["method"]))
        if merged.get("objective") == "grpo" and "seq_len" in knobs and "max_completion_length" in self.base:
            from memfit.spec import whole_number_value

            base_len, completion, length = (
                whole_number_value(v)
                for v in (self.base.get("seq_len"), self.base["max_completion_length"], merged["seq_len"])
            )
            if all(isinstance(v, int) for v in (base_len, completion, length)):
                merged["max_completion_length"] = max(length - (base_len - completion), 1)
        return merged

    def __call__(self, **knobs: Any) -> MemoryPlan:
        merged = self.knobs_for(**knobs)
        self.count += 1
        self.progress(describe(merged))
        # exact is said to plan() only when asked, so that a plan without it is the plan it always was.
        exact = {"exact": True} if self.exact else {}
        return room_for_paged_states(plan(self.model, target=self.target, **self.deepspeed, **exact, **merged))

    def predict(self, sampler: Any, **knobs: Any) -> MemoryPlan:
        """The plan of ``knobs`` with its step predicted by ``sampler`` (:func:`memfit.planner.api.predicted_plan`);
        not counted, not reported: it only steers the search."""
        from memfit.planner.api import predicted_plan

        return room_for_paged_states(
            predicted_plan(self.model, sampler, target=self.target, **self.deepspeed, **self.knobs_for(**knobs))
        )

    def cannot_fit(self, **knobs: Any) -> bool:
        """Whether what the model states alone need (weights, gradients, optimizer states: a floor
        under any plan, :func:`memfit.planner.layout.memory_lower_bound`) is over the target already,
        so that planning ``knobs`` could only say it does not fit. No plan is made."""
        return proven_over_budget(self.model, target=self.target, **self.deepspeed, **self.knobs_for(**knobs))

    def unplanned_miss(self, **knobs: Any) -> Miss:
        """The miss ``knobs`` would be, proven by :meth:`cannot_fit`, its figures left to plan."""
        from memfit.spec import make_spec

        merged = self.knobs_for(**knobs)
        return Miss(make_spec(**merged).knobs(), None, None, knobs=merged)


def planned_miss(candidate: MemoryPlan) -> Miss:
    """The miss a plan that does not fit is: what it needs (the device total, plus paged optimizer
    states where the search counts them) and by how much it is over."""
    return Miss(
        candidate.spec,
        candidate.device_total_bytes + int(candidate.details.get("paged_peak_bytes") or 0),
        -candidate.headroom_bytes,
    )


def room_for_paged_states(result: MemoryPlan) -> MemoryPlan:
    """The plan as the search counts it: paged optimizer states need room on the device too.

    bitsandbytes' paged states live in CUDA unified memory, outside the caching allocator, so a
    plan fits without them. But when they do not fit beside the step's peak they are paged out to
    host memory and back every step, which runs, slowly; the search looks for configurations
    that run at speed, so it counts them against the headroom.
    """
    paged = int(result.details.get("paged_peak_bytes") or 0)
    if not paged or result.headroom_bytes is None:
        return result
    headroom = result.headroom_bytes - paged
    details = dict(
        result.details,
        notes=list(result.details.get("notes", []))
        + ["fit counts the paged optimizer states against the headroom (paged to the host every step otherwise)"],
    )
    return dataclasses.replace(result, headroom_bytes=headroom, fits=headroom >= 0, details=details)


def describe(knobs: dict[str, Any]) -> str:
    """A plan's line in the search's progress:
    ``lora · checkpointing off · adamw · micro-batch 1 · 2048 tokens``."""
    return (
        f"{knobs.get('method')} · checkpointing {knobs.get('checkpointing')} · {knobs.get('optimizer')} · "
        f"micro-batch {knobs.get('batch_size')} · {knobs.get('seq_len')} tokens"
        + (f" · {knobs['gpus']} GPUs, {knobs.get('shard')}" if knobs.get("gpus", 1) > 1 else "")
    )
