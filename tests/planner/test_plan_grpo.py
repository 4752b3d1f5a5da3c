"""A grpo plan: the generation phase and the training phase, each planned, the larger the plan's
peak; the knobs that drive each; vLLM colocated or served, planned from its rules."""

from __future__ import annotations

import pytest

import memfit
from memfit.planner.categories import CATEGORIES
from memfit.planner.report import fact_lines
from memfit.train.conformance import TINY_MODELS

LLAMA = TINY_MODELS["llama"]
GRPO = dict(objective="grpo", method="lora", num_generations=2, batch_size=4, seq_len=48, max_completion_length=16)


def _phases(plan) -> dict[str, dict]:
    return {p["name"]: p for p in plan.details["phases"]}


def test_a_grpo_plan_has_two_phases_and_its_peak_is_the_larger():
    plan = memfit.plan(LLAMA, **GRPO, gpu="rtx-4090")
    phases = _phases(plan)
    assert set(phases) == {"generation", "training"}
    assert phases["generation"]["planned"] == phases["training"]["planned"] == "simulated"
    top = max(phases.values(), key=lambda p: p["device_total_bytes"])
    assert plan.device_total_bytes == top["device_total_bytes"] and plan.phase == f"{top['name']} ({top['phase']})"
    assert sum(plan.categories[name] for name in CATEGORIES) == plan.device_total_bytes
    assert plan.headroom_bytes == plan.gpu["memory_bytes"] - plan.device_total_bytes
    lines = fact_lines(plan.spec, plan.details)
    assert lines[0].startswith("generation ") and lines[1].startswith("training ")
    assert "max_completion_length (KV cache)" in lines[0] and "<- peak" in " ".join(lines[:2])
    assert plan.details["reference"].startswith("none: beta 0")


def test_the_generation_grows_with_the_completion_and_the_generations():
    base = _phases(memfit.plan(LLAMA, **GRPO))["generation"]
    longer = _phases(memfit.plan(LLAMA, **{**GRPO, "max_completion_length": 64, "seq_len": 96}))["generation"]
    more = _phases(memfit.plan(LLAMA, **{**GRPO, "num_generations": 4, "batch_size": 8}))["generation"]
    assert longer["kv_cache_bytes"] > base["kv_cache_bytes"] > 0
    assert longer["sub_phases"]["decode"] > base["sub_phases"]["decode"]
    assert more["kv_cache_bytes"] > base["kv_cache_bytes"] and more["allocated_bytes"] > base["allocated_bytes"]


def test_beta_adds_the_reference_pass():
    plan = memfit.plan(LLAMA, **{**GRPO, "method": "full", "precision": "fp32", "beta": 0.04})
    assert "frozen copy" in plan.details["reference"]
    assert "reference" in plan.details["phase_peaks_allocated_bytes"]


def test_vllm_colocated_takes_its_share_of_the_card_and_sleeps_if_asked():
    vllm = {**GRPO, "use_vllm": True, "vllm_gpu_memory_utilization": 0.3}
    awake = memfit.plan(LLAMA, **vllm, gpu="a100-80gb")
    phases = _phases(awake)
    share = int(80 * 1024**3 * 0.3)
    assert phases["generation"]["planned"] == "planned only" and phases["generation"]["vllm_bytes"] == share
    assert phases["training"]["vllm_bytes"] == share  # held through training without sleep mode
    assert any("vllm/config/cache.py" in note for note in awake.details["notes"])
    asleep = _phases(memfit.plan(LLAMA, **vllm, vllm_enable_sleep_mode=True, gpu="a100-80gb"))
    assert "vllm_bytes" not in asleep["training"]
    assert asleep["training"]["device_total_bytes"] < phases["training"]["device_total_bytes"]


def test_vllm_served_holds_nothing_on_the_training_gpu_and_colocated_needs_a_card():
    served = memfit.plan(LLAMA, **GRPO, use_vllm=True, vllm_mode="server", gpu="a100-80gb")
    assert set(_phases(served)) == {"training"}
    assert any("vllm_mode server" in note for note in served.details["notes"])
    unknown = memfit.plan(LLAMA, **GRPO, use_vllm=True)
    assert any("give --gpu or --budget" in note for note in unknown.details["notes"])


@pytest.mark.slow
def test_llama_8b_qlora_grpo_plans_above_sft_and_higher_with_16_generations():
    lengths = dict(method="qlora", seq_len=1536)
    grpo = dict(objective="grpo", max_completion_length=1024, **lengths)
    sft = memfit.plan("llama-3.1-8b", **lengths)
    eight = memfit.plan("llama-3.1-8b", num_generations=8, **grpo)
    sixteen = memfit.plan("llama-3.1-8b", num_generations=16, **grpo)
    assert set(_phases(eight)) == {"generation", "training"}
    assert _phases(eight)["generation"]["kv_cache_bytes"] > 0
    assert sft.device_total_bytes < eight.device_total_bytes < sixteen.device_total_bytes
    assert _phases(eight)["generation"]["device_total_bytes"] < _phases(sixteen)["generation"]["device_total_bytes"]
