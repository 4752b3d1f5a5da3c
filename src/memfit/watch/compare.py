"""Predicted versus measured: the plan's categories next to what the run really held.

The measured side comes from the first-step attribution (the planner's ``MemoryTracker`` run on
the real tensors of the first training step(s), see :meth:`MemoryRecorder.attribute`), which
splits the live bytes at the step's peak into the same categories the plan uses. The allocator's
reserve and the CUDA context are measured from the device readings when the run is on CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memfit.json_form import JsonForm
from memfit.planner.categories import CATEGORIES
from memfit.units import format_bytes
from memfit.watch.thresholds import Thresholds
from memfit.watch.timeline import Finding, Timeline


@dataclass(frozen=True)
class CategoryRow(JsonForm):
    """One category: predicted bytes, measured bytes (None when not measurable), measured / predicted."""

    name: str
    predicted_bytes: int | None
    measured_bytes: int | None

    @property
    def ratio(self) -> float | None:
        if self.predicted_bytes and self.measured_bytes is not None:
            return self.measured_bytes / self.predicted_bytes
        return None

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "predicted_bytes": self.predicted_bytes,
            "measured_bytes": self.measured_bytes,
            "ratio": self.ratio,
        }


def measured_categories(timeline: Timeline) -> dict[str, int]:
    """Measured bytes per plan category: tracked categories from the attribution, plus ``allocator``
    (reserved - allocated at the peak) and the CUDA context when the run's device reported them."""
    measured: dict[str, int] = {}
    attribution = timeline.attribution
    if attribution:
        for name, value in (attribution.get("categories") or {}).items():
            # The tracker sees tensors made by operators; library workspaces (cuBLAS) are allocated
            # behind its back, so its "runtime" is not a measurement.
            if name != "runtime":
                measured[name] = int(value)
    device = run_device(timeline)
    if device is not None:
        records = [r["devices"][device] for r in timeline.steps if device in r.get("devices", {})]
        peak_reserved = max((e.get("peak_reserved_bytes", 0) for e in records), default=0)
        peak_allocated = max((e.get("peak_allocated_bytes", 0) for e in records), default=0)
        if peak_reserved and peak_allocated:
            measured["allocator"] = peak_reserved - peak_allocated
        # The context is what NVML sees of this process beyond what PyTorch reserved.
        contexts = [
            e["process_bytes"] - e["reserved_bytes"] for e in records if "process_bytes" in e and "reserved_bytes" in e
        ]
        if contexts:
            measured["runtime"] = min(contexts)
    return measured


def compare_categories(plan: dict[str, Any] | None, timeline: Timeline) -> list[CategoryRow]:
    """The plan's categories (``MemoryPlan.to_dict()['categories']``) next to the measured ones."""
    predicted = (plan or {}).get("categories") or {}
    measured = measured_categories(timeline)
    rows = []
    for name in CATEGORIES:
        if name not in predicted and name not in measured:
            continue
        rows.append(CategoryRow(name, predicted.get(name), measured.get(name)))
    return rows


def comparison_lines(rows: list[CategoryRow]) -> list[str]:
    """Plain-text table of predicted vs measured, for a trainer to print at the end of a run."""
    if not rows:
        return []
    lines = [f"{'category':<12} {'plan':>11} {'measured':>13} {'ratio':>6}"]
    for row in rows:
        plan = format_bytes(row.predicted_bytes) if row.predicted_bytes is not None else "-"
        measured = format_bytes(row.measured_bytes) if row.measured_bytes is not None else "not measured"
        ratio = f"{row.ratio:.2f}" if row.ratio is not None else "-"
        lines.append(f"{row.name:<12} {plan:>11} {measured:>13} {ratio:>6}")
    return lines


def measured_peak_allocated(timeline: Timeline) -> tuple[int | None, str]:
    """The run's peak allocated bytes and where it was read: the device counters, else the attribution."""
    device = run_device(timeline)
    if device is not None:
        peaks = [
            r["devices"][device].get("peak_allocated_bytes") for r in timeline.steps if device in r.get("devices", {})
        ]
        peaks = [p for p in peaks if p]
        if peaks:
            return max(peaks), f"torch.cuda.max_memory_allocated on {device}"
    if timeline.attribution and timeline.attribution.get("peak_allocated_bytes"):
        return int(timeline.attribution["peak_allocated_bytes"]), "the first-step attribution"
    return None, ""


def compare_peaks(plan: dict[str, Any] | None, timeline: Timeline) -> list[CategoryRow]:
    """The plan's three peaks next to the run device's: allocated (``max_memory_allocated``),
    reserved (``max_memory_reserved``) and the device total (NVML's bytes of this process, what
    nvidia-smi shows). Empty without a plan or a CUDA run device; a peak not read is None."""
    device = run_device(timeline)
    peak = (plan or {}).get("peak") or {}
    if device is None or not peak:
        return []
    records = [r["devices"][device] for r in timeline.steps if device in r.get("devices", {})]

    def highest(key: str) -> int | None:
        values = [e[key] for e in records if isinstance(e.get(key), (int, float))]
        return int(max(values)) if values else None

    return [
        CategoryRow("peak allocated", peak.get("allocated_bytes"), highest("peak_allocated_bytes")),
        CategoryRow("peak reserved", peak.get("reserved_bytes"), highest("peak_reserved_bytes")),
        CategoryRow("device total", peak.get("device_total_bytes"), highest("process_bytes")),
    ]


_CATEGORY_FIX = {
    "activations": (
        "Check that activation checkpointing is really on in the model that trains (a wrapper, "
        "gradient_checkpointing_disable(), use_cache=True or model.eval() switch it off; `memfit doctor` "
        "names the cause when the model was inspected), and that batch_size and seq_len are the planned ones."
    ),
    "gradients": "More parameters train than planned: freeze the base weights (requires_grad_(False)) for LoRA/QLoRA.",
    "optimizer": "More parameters train than planned, or a different optimizer is used: check requires_grad and the optimizer.",
    "trainable": "More parameters train than planned: check which parameters have requires_grad=True.",
}


def detect_above_plan(
    timeline: Timeline, plan: dict[str, Any] | None, thresholds: Thresholds = Thresholds()
) -> list[Finding]:
    """Measured categories (and the peak) well above what the plan predicted."""
    if not plan:
        return []
    t = thresholds
    findings = []
    spec = plan.get("spec") or {}
    for row in compare_categories(plan, timeline):
        if row.name not in _CATEGORY_FIX or row.measured_bytes is None or row.predicted_bytes is None:
            continue
        excess = row.measured_bytes - row.predicted_bytes
        if row.measured_bytes < t.activations_ratio * row.predicted_bytes or excess < t.activations_min_excess_bytes:
            continue
        message = (
            f"measured {row.name} are {format_bytes(row.measured_bytes)}, {row.ratio:.1f}x the plan's "
            f"{format_bytes(row.predicted_bytes)} (+{format_bytes(excess)})"
        )
        if row.name == "activations" and spec.get("checkpointing") in ("on", "offload"):
            message += (
                f": the plan assumed checkpointing {spec['checkpointing']}, and the run behaves as if it were off"
            )
        findings.append(
            Finding(
                severity="error",
                code=f"{row.name}_above_plan",
                message=message + ".",
                fix=_CATEGORY_FIX[row.name],
                step=timeline.attribution.get("first_step") if timeline.attribution else None,
                data={
                    "category": row.name,
                    "measured_bytes": row.measured_bytes,
                    "predicted_bytes": row.predicted_bytes,
                    "ratio": row.ratio,
                },
            )
        )
    peak, source = measured_peak_allocated(timeline)
    planned = (plan.get("peak") or {}).get("allocated_bytes")
    if peak is not None and planned and peak >= t.peak_ratio * planned and peak - planned >= t.peak_min_excess_bytes:
        findings.append(
            Finding(
                severity="warning",
                code="peak_above_plan",
                message=f"peak allocated memory is {format_bytes(peak)} ({source}), {peak / planned:.2f}x the plan's {format_bytes(planned)}.",
                fix="Compare the categories in `memfit report` to see which part grew; re-plan with the run's real batch_size, seq_len and method.",
                data={"measured_bytes": peak, "predicted_bytes": planned, "source": source},
            )
        )
    return findings


def run_device(timeline: Timeline) -> str | None:
    """The CUDA device the run is on, when exactly one expected device is CUDA and was recorded."""
    cuda = [d for d in timeline.expected_devices if d.startswith("cuda")]
    if len(cuda) == 1 and cuda[0] in timeline.device_names():
        return cuda[0]
    return None
