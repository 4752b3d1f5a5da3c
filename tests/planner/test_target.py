"""What a plan is compared against (memfit.planner.target): a Target from --gpu / --budget, or from a
live device read through a probe the tests fake."""

from __future__ import annotations

import pytest

from memfit.models.gpus import get_gpu
from memfit.planner.errors import PlanError
from memfit.planner.target import (
    NO_TARGET,
    DeviceReading,
    live_target,
    resolve_target,
    target_from_options,
)
from memfit.units import GiB

RTX_4090 = "NVIDIA GeForce RTX 4090"


class _Probe:
    """A CUDA device as the driver would report it, and the indices it was asked about."""

    def __init__(self, name: str, free_bytes: int, total_bytes: int):
        self.reading = DeviceReading(name, free_bytes, total_bytes)
        self.asked: list[int | None] = []

    def __call__(self, index: int | None) -> DeviceReading:
        self.asked.append(index)
        return self.reading


def test_a_gpu_gives_its_catalog_memory_arch_and_bf16_support():
    card = get_gpu("rtx-4090")
    target, problems = resolve_target("4090", None)
    assert problems == []
    assert (target.name, target.memory_bytes, target.arch, target.supports_bf16, target.card) == (
        "rtx-4090",
        card.memory_bytes,
        card.arch,
        card.supports_bf16,
        "rtx-4090",
    )
    assert target.source == "gpu" and target.context_bytes is None  # the planner's estimate


def test_a_budget_lowers_the_cards_memory_and_keeps_its_figures():
    target = target_from_options("rtx-4090", "20GiB")
    assert target.name == "rtx-4090, budget 20GiB" and target.memory_bytes == 20 * GiB
    assert target.arch == get_gpu("rtx-4090").arch and target.card == "rtx-4090" and target.source == "budget"
    alone = target_from_options(None, 24 * GiB)
    assert alone.name == f"budget {24 * GiB}" and alone.memory_bytes == 24 * GiB and alone.arch is None
    assert target_from_options(None, None) == NO_TARGET and not NO_TARGET.has_memory


def test_bad_options_are_named_with_the_value_and_the_fix_all_at_once():
    _, problems = resolve_target("rtx 4009", "0")
    assert problems[0].startswith("--gpu: ") and "Did you mean 'rtx-4090'" in problems[0]
    assert problems[1] == "--budget: '0' must be more than 0 bytes (e.g. '24GiB')"
    _, problems = resolve_target("rtx-4090", "30GiB")
    assert problems == [
        "--budget: 30GiB is more than rtx-4090's 24.0 GiB: a budget can only be lower than the card's "
        "memory. Drop --budget, or use a larger --gpu."
    ]
    with pytest.raises(PlanError) as info:
        target_from_options("no-such-card", "lots")
    assert [p.split(":")[0] for p in info.value.problems] == ["--gpu", "--budget"]


def test_a_live_device_is_judged_by_what_is_free_with_its_context_spent():
    probe = _Probe(RTX_4090, free_bytes=10 * GiB, total_bytes=24 * GiB)
    target = live_target(1, probe)
    assert probe.asked == [1]  # read once, the device asked for
    assert target.memory_bytes == 10 * GiB and target.context_bytes == 0 and target.source == "device"
    card = get_gpu("rtx-4090")  # a known card lends its catalog figures to the runtime estimates
    assert (target.card, target.arch, target.supports_bf16) == ("rtx-4090", card.arch, card.supports_bf16)
    assert "10.0 GiB free of 24.0 GiB" in target.description and "14.0 GiB held" in target.description


def test_an_unknown_card_plans_with_the_default_estimates():
    target = live_target(None, _Probe("Quantum Toaster 9000", free_bytes=5 * GiB, total_bytes=8 * GiB))
    assert (
        target.memory_bytes == 5 * GiB and target.card is None and target.arch is None and target.supports_bf16 is None
    )
    assert target.name == "Quantum Toaster 9000 (free memory)"


def test_a_plan_against_a_live_device_adds_no_context_and_compares_with_the_free_memory(tiny_llama):
    import memfit

    knobs = dict(method="lora", seq_len=64, batch_size=1)
    device = live_target(0, _Probe(RTX_4090, free_bytes=20 * GiB, total_bytes=24 * GiB))
    on_device = memfit.plan(tiny_llama, target=device, **knobs)
    by_options = memfit.plan(tiny_llama, gpu="rtx-4090", **knobs)
    assert on_device.details["context_bytes"] == 0 and by_options.details["context_bytes"] > 0
    assert on_device.device_total_bytes == by_options.device_total_bytes - by_options.details["context_bytes"]
    assert on_device.gpu == {"name": f"{RTX_4090} (free memory)", "memory_bytes": 20 * GiB}
    assert on_device.headroom_bytes == 20 * GiB - on_device.device_total_bytes
    with pytest.raises(TypeError, match="not both"):
        memfit.plan(tiny_llama, target=device, gpu="rtx-4090", **knobs)
