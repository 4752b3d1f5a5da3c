"""PyTorch's AdamW left to choose its implementation, planned as CUDA runs it (foreach)."""

from __future__ import annotations

import pytest
import torch

import memfit
from memfit.planner.exact.cuda_parity import optimizer_defaults_as_cuda
from memfit.planner.exact.simulate import simulate
from memfit.spec import SpecError, make_spec


def test_the_choice_is_pytorchs_again_after_the_mode():
    import torch.optim.adam as adam

    before = adam._default_to_fused_or_foreach
    with optimizer_defaults_as_cuda():
        assert adam._default_to_fused_or_foreach([torch.zeros(1)], False) == (False, True)
        assert adam._default_to_fused_or_foreach([torch.zeros(1)], False, use_fused=True) == (True, False)
    assert adam._default_to_fused_or_foreach is before


def test_the_hf_recipes_foreach_adamw_adds_its_temporary_to_the_optimizer_step(tiny_llama):
    knobs = dict(method="full", seq_len=32, batch_size=1, recipe="hf", precision="bf16")
    fused = simulate(tiny_llama, make_spec(**knobs)).tracker
    foreach = simulate(tiny_llama, make_spec(adamw_impl="foreach", **knobs)).tracker
    trained = fused.peak.categories["trainable"]
    # The fused kernel holds nothing beside the states; foreach holds sqrt(exp_avg_sq) of every parameter.
    assert foreach.phase_peaks["optimizer"] - fused.phase_peaks["optimizer"] >= 0.9 * trained
    assert foreach.peak.phase == "optimizer"


def test_a_foreach_plan_extrapolated_from_a_few_layers_is_the_whole_models(tiny_llama):
    config = dict(tiny_llama, num_hidden_layers=6)
    knobs = dict(
        method="full", seq_len=32, batch_size=1, recipe="hf", precision="bf16", adamw_impl="foreach", cache=False
    )
    fast, whole = memfit.plan(config, **knobs), memfit.plan(config, exact=True, **knobs)
    assert fast.phase == whole.phase == "optimizer"
    assert fast.allocated_bytes == whole.allocated_bytes
    # (The allocator's overhead is not extrapolated: the larger of the sampled depths' is added.)
    assert {k: v for k, v in fast.categories.items() if k != "allocator"} == {
        k: v for k, v in whole.categories.items() if k != "allocator"
    }


@pytest.mark.parametrize("knobs", [dict(recipe="memfit"), dict(recipe="hf", optimizer="adamw8bit")])
def test_foreach_is_the_hf_recipes_adamw_only(knobs):
    with pytest.raises(SpecError, match="adamw-impl"):
        make_spec(adamw_impl="foreach", **knobs)
