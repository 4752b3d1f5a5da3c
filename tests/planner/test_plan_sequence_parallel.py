"""Plans with sequence parallelism: per rank, a shard of every row outside attention, the whole row
for a share of the heads inside it, the all-to-alls' buffers."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from memfit.planner.api import plan  # noqa: E402
from memfit.planner.errors import PlanError  # noqa: E402


def test_eight_ranks_sharing_a_long_row_plan_at_most_a_quarter_of_the_activations():
    knobs = dict(method="lora", gpus=8, shard="fsdp", seq_len=131072)
    alone = plan("llama-3.1-8b", **knobs)
    shared = plan("llama-3.1-8b", sequence_parallel=8, **knobs)
    assert shared.categories["activations"] * 4 <= alone.categories["activations"]
    assert shared.device_total_bytes < alone.device_total_bytes
    assert any("sequence parallel 8" in note for note in shared.details["notes"])


def test_heads_that_do_not_split_are_refused_before_planning():
    with pytest.raises(PlanError, match="--sequence-parallel 3: the model's 32 attention heads"):
        plan("llama-3.1-8b", method="lora", gpus=3, shard="fsdp", seq_len=3072, sequence_parallel=3)
