"""train --fit's search (memfit.planner.search.run.RunPlanner.fit), with plans made up by the test: which splits it plans."""

from __future__ import annotations

from memfit.planner.report import MemoryPlan
from memfit.planner.search import run
from memfit.planner.search.run import RunPlanner
from memfit.planner.target import target_from_options
from memfit.spec import upper_bound


def _made_up_plan(knobs: dict) -> MemoryPlan:
    """Every configuration fits; memory grows with the micro-batch."""
    spec = dict(
        knobs, seq_len=knobs.get("seq_len", 64), method=knobs.get("method", "lora"), tiling=knobs.get("tiling", "auto")
    )
    device_total = 2**30 + spec["batch_size"] * 2**20
    categories = {"activations": 2**20, "temporaries": 0}
    return MemoryPlan(
        model="made-up",
        spec=spec,
        allocated_bytes=device_total,
        reserved_bytes=device_total,
        device_total_bytes=device_total,
        phase="backward",
        categories=categories,
        gpu={"name": "budget", "memory_bytes": 2**40},
        fits=True,
        headroom_bytes=2**40 - device_total,
    )


def test_an_effective_batch_above_the_accumulation_bound_starts_at_the_smallest_split_allowed(monkeypatch):
    planned = []

    def plan(model, **knobs):
        planned.append((knobs["batch_size"], knobs["grad_accum"]))
        return _made_up_plan({k: v for k, v in knobs.items() if k != "target"})

    monkeypatch.setattr(run, "plan", plan)
    most = upper_bound("grad_accum")
    knobs = {
        "method": "lora",
        "batch_size": 4,
        "grad_accum": most,
        "seq_len": 64,
        "checkpointing": "on",
        "tiling": "off",
        "optimizer": "adamw",
    }
    result = RunPlanner("made-up", target_from_options(None, "1TiB")).fit(knobs)
    assert result is not None
    assert planned and all(accum <= most for _, accum in planned)  # micro-batch 1 would accumulate 4 x the bound
    assert min(batch for batch, _ in planned) == 4 and all(b * a == 4 * most for b, a in planned)
