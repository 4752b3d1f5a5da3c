"""What ``memfit fit`` answers: the configurations that fit (:class:`Fit`), the faster settings that
do not (:class:`Miss`), and the whole answer (:class:`FitResult`, with its JSON form)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from memfit.json_form import JsonForm
from memfit.planner.report import MemoryPlan


@dataclass
class Fit(JsonForm):
    """A configuration that fits, its plan and its estimated relative speed."""

    spec: dict[str, Any]
    plan: MemoryPlan
    relative_speed: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        shard = self.plan.details.get("shard", self.spec.get("shard", "none"))
        return {
            "spec": self.spec,
            "gpus": self.spec.get("gpus", 1),
            "shard": shard,
            "per_rank": bool(self.plan.details.get("per_rank")),
            "peak": self.plan.to_dict()["peak"],
            "relative_speed": round(self.relative_speed, 4),
            "headroom_bytes": self.plan.headroom_bytes,
        }


@dataclass
class Miss:
    """A faster setting that does not fit, and by how much.

    A setting proven not to fit without a plan (:meth:`~memfit.planner.search.plans.SearchPlanner.cannot_fit`)
    has no figures yet (None) and keeps the knobs to plan it with: the search plans it only if it is
    reported.
    """

    spec: dict[str, Any]
    device_total_bytes: int | None
    over_bytes: int | None
    knobs: dict[str, Any] | None = field(default=None, repr=False)


@dataclass
class FitResult(JsonForm):
    """Everything `memfit fit` reports."""

    model: str
    gpu: dict[str, Any]
    fits: list[Fit]
    misses: list[Miss]
    max_seq_len: dict[str, int]
    max_seq_len_specs: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: With sequence parallelism: each method's longest sequence at each GPU count searched, with the
    #: degree asked (``seq_len``) and without sequence parallelism (``without``).
    max_seq_len_by_gpus: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    #: A vision-language model's largest image at the fastest fit (:mod:`memfit.planner.search.images`).
    max_image: dict[str, Any] | None = None
    plans_made: int = 0
    seconds: float = 0.0
    max_gpus: int = 1
    notes: list[str] = field(default_factory=list)  # how the model's config was obtained, when worth saying
    config: dict[str, Any] | None = None  # another tool's config fitted (memfit.interop), as read

    def to_dict(self) -> dict[str, Any]:
        """The JSON form as a dict (docs/fit.md); ``to_json(indent=...)`` gives it as JSON text."""
        return {
            "model": self.model,
            "gpu": self.gpu,
            "fits": [f.to_dict() for f in self.fits],
            "max_seq_len": dict(self.max_seq_len),
            **({"max_seq_len_by_gpus": dict(self.max_seq_len_by_gpus)} if self.max_seq_len_by_gpus else {}),
            **({"max_image": dict(self.max_image)} if self.max_image else {}),
            "details": {
                "max_gpus": self.max_gpus,
                "per_rank": self.max_gpus > 1,
                "max_seq_len_specs": self.max_seq_len_specs,
                "not_fitting": [
                    {"spec": m.spec, "device_total_bytes": m.device_total_bytes, "over_bytes": m.over_bytes}
                    for m in self.misses
                ],
                "plans_made": self.plans_made,
                "seconds": round(self.seconds, 2),
                "relative_speed": "an estimate (memfit.planner.throughput), not a measurement",
                **({"notes": list(self.notes)} if self.notes else {}),
                **({"config": self.config} if self.config else {}),
            },
        }
