"""One method's settings and largest micro-batch (memfit.planner.search.micro_batch): the shortcut
through the settings leaves the answers as they were: a slower setting tries the whole batch in one
micro-batch first."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

from memfit.planner.search.micro_batch import CHECKPOINTING_FAST_FIRST, micro_batches, search_method

GiB = 2**30


class _LinePlanner:
    """Stands in for the search's planner: memory is a line in the micro-batch for each setting
    (states, plus activations a sequence), so every answer can be worked out by hand."""

    def __init__(self, states: dict[str, int], per_sample: dict[str, int], memory: int):
        self.states, self.per_sample, self.memory = states, per_sample, memory
        self.optimizers = {"lora": ("adamw",)}
        self.base: dict = {}
        self.count = 0

    def total(self, checkpointing: str, batch_size: int) -> int:
        return self.states[checkpointing] + batch_size * self.per_sample[checkpointing]

    def __call__(self, **knobs):
        self.count += 1
        total = self.total(knobs["checkpointing"], knobs["batch_size"])
        spec = dict(knobs)
        return SimpleNamespace(
            spec=spec,
            fits=total <= self.memory,
            headroom_bytes=self.memory - total,
            device_total_bytes=total,
            details={},
            categories={"activations": knobs["batch_size"] * self.per_sample[knobs["checkpointing"]], "temporaries": 0},
        )

    def cannot_fit(self, **knobs) -> bool:
        return False


def _every_plan_answer(planner: _LinePlanner, effective_batch: int) -> list[tuple[str, int]]:
    """What the search must answer, from every micro-batch of every setting: for each setting,
    fastest first, the largest micro-batch that fits, until one fits the whole batch."""
    answer = []
    for checkpointing in CHECKPOINTING_FAST_FIRST:
        fitting = [b for b in micro_batches(effective_batch) if planner.total(checkpointing, b) <= planner.memory]
        if fitting:
            answer.append((checkpointing, fitting[-1]))
            if fitting[-1] == effective_batch:
                break
    return answer


@pytest.mark.parametrize(
    "per_sample_off, per_sample_on, per_sample_offload, memory_gib",
    list(itertools.product((3, 6), (1, 2, 3), (1, 2), (20, 23, 30))),
)
def test_settings_found_are_those_every_plan_finds(per_sample_off, per_sample_on, per_sample_offload, memory_gib):
    planner = _LinePlanner(
        states={"off": 16 * GiB, "on": 16 * GiB, "offload": 16 * GiB},
        per_sample={
            "off": per_sample_off * GiB,
            "on": per_sample_on * GiB // 2,
            "offload": per_sample_offload * GiB // 4,
        },
        memory=memory_gib * GiB,
    )
    fits, misses = search_method(planner, "lora", 8)
    assert [(f.spec["checkpointing"], f.spec["batch_size"]) for f in fits] == _every_plan_answer(planner, 8)
    assert all(f.spec["batch_size"] * f.spec["grad_accum"] == 8 for f in fits)
    # Misses: the settings tried before the last one that fits, micro-batch 1 over the memory.
    last = CHECKPOINTING_FAST_FIRST.index(fits[-1].spec["checkpointing"]) if fits else len(CHECKPOINTING_FAST_FIRST) - 1
    assert [m.spec["checkpointing"] for m in misses] == [
        c for c in CHECKPOINTING_FAST_FIRST[: last + 1] if planner.total(c, 1) > planner.memory
    ]


def test_a_slower_setting_that_fits_the_whole_batch_is_found_in_one_plan():
    # Checkpointing off fits micro-batch 1 only; with checkpointing on the whole batch fits: one
    # plan for it instead of micro-batch 1, then 4, then 8.
    planner = _LinePlanner(
        states={c: 16 * GiB for c in CHECKPOINTING_FAST_FIRST},
        per_sample={"off": 6 * GiB, "on": GiB // 2, "offload": GiB // 4},
        memory=23 * GiB,
    )
    fits, _ = search_method(planner, "lora", 8)
    assert [(f.spec["checkpointing"], f.spec["batch_size"]) for f in fits] == [("off", 1), ("on", 8)]
    assert planner.count == 3  # off at 1 and 2, on at 8
