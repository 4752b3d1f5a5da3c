"""grpo's generation, simulated: transformers' generate under fake tensors counts what it counts on
real CPU tensors; the planned prompts."""

from __future__ import annotations

import pytest

from memfit.planner.exact.generation import planned_prompts, whole_generation
from memfit.spec import make_spec
from memfit.train.conformance import TINY_MODELS

LLAMA, QWEN2 = TINY_MODELS["llama"], TINY_MODELS["qwen2"]


def _spec(**knobs):
    base = dict(objective="grpo", num_generations=2, batch_size=4, seq_len=48, max_completion_length=12)
    return make_spec(**{**base, **knobs})


@pytest.mark.parametrize(
    "config, knobs",
    [
        (LLAMA, dict(method="lora", precision="bf16")),
        (LLAMA, dict(method="full", precision="fp32", beta=0.1, top_p=0.9, temperature=0.7)),
        (QWEN2, dict(method="qlora", precision="bf16", num_iterations=2)),
    ],
    ids=["llama lora", "llama full reference top_p", "qwen2 qlora old logps"],
)
def test_fake_generation_counts_what_a_real_one_counts(config, knobs):
    spec = _spec(**knobs)
    fake = whole_generation(config, spec, new_tokens=6)
    real = whole_generation(config, spec, new_tokens=6, fake=False)
    assert fake.peak.allocated_bytes == real.peak.allocated_bytes
    assert fake.phase_peaks == real.phase_peaks
    assert fake.peak.categories == real.peak.categories
    assert {"prefill", "decode"} <= set(fake.phase_peaks)


def test_the_planned_prompts_are_padded_where_a_batch_holds_several():
    assert [len(p) for p in planned_prompts(_spec(batch_size=4))] == [36, 35]
    assert [len(p) for p in planned_prompts(_spec(batch_size=2))] == [36]
