"""LoRA on mixture-of-experts models: what each ``targets`` adapts, told to PEFT so that what trains is
what the plan counts, and what PEFT builds again from the saved adapter."""

from __future__ import annotations

import pytest
import torch

from memfit.models.build import DTYPES, build_meta_model, make_config
from memfit.models.errors import ModelBuildError
from memfit.spec import make_spec
from memfit.step.lora_targets import available_targets, lora_targets, peft_claimed_names
from memfit.step.prepare import adapted_modules, check_targets, expected_adapter_parameters, prepare_for_method
from memfit.train.conformance import TINY_MODELS


def _meta(name: str):
    return build_meta_model(make_config(TINY_MODELS[name]), DTYPES["bf16"])


def _adapted(name: str, **knobs) -> tuple[list[str], torch.nn.Module]:
    with torch.device("meta"):
        model = prepare_for_method(_meta(name), make_spec(method="lora", checkpointing="off", **knobs))
    return adapted_modules(model), model


def test_all_linear_adapts_every_linear_layer_and_every_expert_but_not_the_router():
    adapted, _ = _adapted("qwen3_moe")
    # Layer 0 is a dense MLP (mlp_only_layers): its projections are adapted too.
    assert adapted == [
        "down_proj",
        "experts.down_proj",
        "experts.gate_up_proj",
        "gate_proj",
        "k_proj",
        "o_proj",
        "q_proj",
        "up_proj",
        "v_proj",
    ]


@pytest.mark.parametrize("name", ["mixtral", "gpt_oss", "llama4_text", "deepseek_v2"])
def test_all_linear_adapts_the_experts_in_every_layout(name):
    adapted, model = _adapted(name)
    assert {"experts.gate_up_proj", "experts.down_proj"} <= set(adapted)
    assert not {"gate", "router"} & set(adapted)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert trainable == expected_adapter_parameters(model) > 0


def test_targets_name_the_experts_their_weights_and_routers():
    assert _adapted("mixtral", targets=("experts",))[0] == ["experts.down_proj", "experts.gate_up_proj"]
    assert _adapted("mixtral", targets=("experts.down_proj", "q_proj"))[0] == ["experts.down_proj", "q_proj"]
    assert _adapted("mixtral", targets=("gate",))[0] == ["gate"]
    # Llama 4's router is an nn.Linear returning a tuple: adapted through its weight, it still runs.
    adapted, model = _adapted("llama4_text", targets=("router",))
    assert adapted == ["router"]
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == expected_adapter_parameters(model)


def test_a_fused_gate_and_up_takes_twice_the_rank_and_alpha():
    # Two projections in one weight: each keeps rank r and the scale alpha / r (PEFT's rule when it
    # fuses adapters of the unfused layout).
    targets = lora_targets(_meta("mixtral"), ("experts",), rank=8, alpha=16.0, refused=[])
    assert targets.parameters == ("experts.down_proj", "experts.gate_up_proj")
    assert targets.rank_pattern == {r".*\.experts\.gate_up_proj": 16}
    assert targets.alpha_pattern == {r".*\.experts\.gate_up_proj": 32.0}
    config = TINY_MODELS["mixtral"]
    _, model = _adapted("mixtral", targets=("experts",), rank=8)
    hidden, inner, experts, layers = (
        config["hidden_size"],
        config["intermediate_size"],
        config["num_local_experts"],
        config["num_hidden_layers"],
    )
    per_expert = 16 * (hidden + 2 * inner) + 8 * (inner + hidden)
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == layers * experts * per_expert


def test_a_dense_layer_peft_would_give_to_the_experts_is_adapted_through_its_weight():
    # PEFT on transformers 5 turns down_proj in target_modules into the experts' down_proj for the
    # DeepSeek types (and Qwen3-MoE...): the dense first layer and the shared experts would lose
    # their adapters; their weights are named instead.
    model = _meta("deepseek_v2")
    assert {"down_proj", "gate_proj", "up_proj"} <= peft_claimed_names(
        model, ["down_proj", "gate_proj", "up_proj", "q_proj"]
    )
    targets = lora_targets(model, ("down_proj", "q_proj"), rank=8, alpha=16.0, refused=[])
    assert targets.modules == ("q_proj",) and targets.parameters == ("down_proj.weight",)
    adapted, prepared = _adapted("deepseek_v2", targets=("down_proj",))
    assert adapted == ["down_proj"]
    wrapped = [m for m in prepared.modules() if hasattr(m, "lora_A")]
    # one dense MLP and two shared experts (layers 1 and 2)
    assert len(wrapped) == 3 and all(getattr(m, "parameter_name", None) == "weight" for m in wrapped)


def test_unknown_targets_name_what_the_model_has():
    model = _meta("qwen3_moe")
    assert {"experts", "experts.gate_up_proj", "experts.down_proj", "gate", "q_proj"} <= set(available_targets(model))
    with pytest.raises(
        ModelBuildError,
        match=r"--targets: expert match no linear layer, expert weight or router.*experts\.gate_up_proj",
    ):
        check_targets(model, make_spec(method="lora", targets=("expert",)))


def test_dropout_and_dora_are_refused_on_expert_weights_with_the_fix():
    model = _meta("mixtral")
    with pytest.raises(
        ModelBuildError,
        match=r"--dropout 0.05: PEFT's LoRA on weights .*takes no dropout: set --dropout 0, or give "
        r"--targets without the experts and routers \(e\.g\. ",
    ):
        check_targets(model, make_spec(method="lora", dropout=0.05))
    with pytest.raises(ModelBuildError, match=r"dora: .*takes no DoRA"):
        check_targets(model, make_spec(method="lora", targets=("experts",), dora=True), spelling="key")
    check_targets(model, make_spec(method="lora", targets=("q_proj", "v_proj"), dropout=0.05))  # no experts: fine
