"""The objective knob and the preference objectives' loss parameters, declared in memfit.spec."""

from __future__ import annotations

import pytest

from memfit.spec import KNOBS, ObjectiveParams, SpecError, choices, make_spec, objective_problems, reference_source


def test_objective_is_a_knob_with_trl_objectives_and_sft_by_default():
    assert "objective" in KNOBS and "precompute_reference" in KNOBS
    assert choices("objective") == ("sft", "dpo", "orpo", "simpo", "grpo")
    spec = make_spec()
    assert spec.objective == "sft" and not spec.is_preference and spec.reference == "none"
    assert make_spec(objective="DPO").objective == "dpo"


@pytest.mark.parametrize(
    "objective, method, precompute, source",
    [
        ("dpo", "lora", False, "disabled-adapters"),
        ("dpo", "qlora", False, "disabled-adapters"),
        ("dpo", "full", False, "frozen-copy"),
        ("dpo", "full", True, "precomputed"),
        ("dpo", "lora", True, "precomputed"),
        ("orpo", "full", False, "none"),
        ("simpo", "lora", False, "none"),
        ("sft", "full", False, "none"),
    ],
)
def test_where_the_reference_comes_from(objective, method, precompute, source):
    assert reference_source(objective, method, precompute) == source


def test_what_a_preference_objective_rules_out_is_said_in_the_users_spelling():
    with pytest.raises(SpecError) as err:
        make_spec(objective="simpo", precompute_reference=True, packing=True)
    text = str(err.value)
    assert "--precompute-reference: only --objective dpo has a reference model" in text
    assert "--packing cannot be used with --objective simpo" in text
    # Several GPUs are a preference run's as they are SFT's: each rank trains its share of the pairs.
    assert make_spec(objective="orpo", gpus=2, shard="ddp", spelling="field").gpus == 2
    assert make_spec(objective="dpo", method="full", gpus=4, shard="fsdp").reference == "frozen-copy"
    with pytest.raises(SpecError, match="is not one of sft, dpo, orpo, simpo, grpo. Did you mean 'dpo'"):
        make_spec(objective="dop")


def test_loss_parameters_have_trls_names_and_defaults_and_are_checked():
    params = ObjectiveParams()
    assert (params.beta, params.loss_type, params.simpo_gamma, params.cpo_alpha) == (0.1, "sigmoid", 0.5, 0.0)
    assert objective_problems("dpo", ObjectiveParams(loss_type="ipo"), {"loss_type"}) == []
    problems = objective_problems(
        "orpo", ObjectiveParams(beta=0.0, simpo_gamma=0.3, cpo_alpha=-1.0), {"beta", "simpo_gamma", "cpo_alpha"}
    )
    assert any(p.startswith("simpo_gamma: applies to objective: simpo") for p in problems)
    assert any(p.startswith("beta: 0.0 must be a positive number") for p in problems)
    assert any(p.startswith("cpo_alpha: -1.0 must be 0 or more") for p in problems)
    assert objective_problems("sft", ObjectiveParams(beta=0.2), {"beta"})[0].startswith(
        "beta: applies to objective: dpo or orpo or simpo or grpo"
    )
    # A default value does no harm: a run's whole recorded config (run.json) validates again.
    assert objective_problems("sft", ObjectiveParams(), {"beta", "loss_type", "simpo_gamma", "cpo_alpha"}) == []
