"""grpo's generation phase at the planned length and full depth: any completion length written from
two short generations equals the whole generation; depth extrapolated equals the whole depth."""

from __future__ import annotations

import pytest

from memfit.planner.exact.generation import simulate_generation, whole_generation
from memfit.planner.shortcuts.generation import check_same_steps, estimate_generation, trace_at
from memfit.spec import make_spec
from memfit.train.conformance import TINY_MODELS

LLAMA = TINY_MODELS["llama"]


def _spec(**knobs):
    base = dict(objective="grpo", num_generations=2, batch_size=4, seq_len=48, max_completion_length=12)
    return make_spec(**{**base, **knobs})


@pytest.mark.parametrize(
    "knobs",
    [dict(method="lora", precision="bf16", top_p=0.9), dict(method="qlora", precision="bf16", num_iterations=2)],
    ids=["lora top_p", "qlora old logps"],
)
def test_any_completion_length_is_written_exactly_from_two_short_generations(knobs):
    spec = _spec(max_completion_length=14, **knobs)
    short, long = simulate_generation(LLAMA, spec, new_tokens=4), simulate_generation(LLAMA, spec, new_tokens=5)
    check_same_steps(short, long)
    written = trace_at(short, long, 14)
    whole = whole_generation(LLAMA, spec, new_tokens=14)
    assert written.peak.allocated_bytes == whole.peak.allocated_bytes
    assert written.peak.categories == whole.peak.categories
    assert {k: v for k, v in written.phase_peaks.items() if k != "idle"} == {
        k: v for k, v in whole.phase_peaks.items() if k != "idle"
    }


def test_the_kv_cache_grows_with_the_completion_length_and_is_named():
    shorter = estimate_generation(LLAMA, _spec(method="lora", precision="bf16", max_completion_length=8), exact=True)
    longer = estimate_generation(
        LLAMA, _spec(method="lora", precision="bf16", max_completion_length=40, seq_len=76), exact=True
    )
    # The decode step's cache: 2 (keys, values) x 2 layers x 4 completions x 2 heads x 16 dims x 2 bytes a token.
    per_token = 2 * 2 * 4 * 2 * 16 * 2
    assert longer.phase_peaks["decode"] - shorter.phase_peaks["decode"] >= 32 * per_token
    assert longer.categories["activations"] > 0  # the KV cache, held from token to token


def test_depth_is_extrapolated_exactly():
    deep = dict(LLAMA, num_hidden_layers=6)
    spec = _spec(method="lora", precision="bf16", max_completion_length=20, seq_len=64, top_p=0.9)
    extrapolated, whole = estimate_generation(deep, spec), estimate_generation(deep, spec, exact=True)
    assert extrapolated.simulated_layers == [2, 3] and whole.simulated_layers == [6]
    assert extrapolated.allocated_bytes == whole.allocated_bytes
    assert extrapolated.categories == whole.categories
    assert extrapolated.phase_peaks == whole.phase_peaks
