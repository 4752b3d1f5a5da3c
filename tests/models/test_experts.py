"""Experts and routers are found in every expert layout: weights [experts, out, in] or [experts, in,
out] (with biases), routers as modules of their own or as nn.Linear subclasses returning tuples."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memfit.models.build import DTYPES, build_meta_model, make_config
from memfit.models.experts import expert_modules, expert_parameter_count, expert_weights, routers
from memfit.models.layers import linear_names_in_layers
from memfit.models.quantize import quantize_linears_on_meta
from memfit.train.conformance import TINY_MODELS

MOE = ["qwen3_moe", "mixtral", "gpt_oss", "llama4_text", "deepseek_v2"]


def _meta(name: str) -> nn.Module:
    return build_meta_model(make_config(TINY_MODELS[name]), DTYPES["bf16"])


@pytest.mark.parametrize("name", MOE)
def test_every_moe_layer_has_one_experts_module_and_one_router(name):
    model = _meta(name)
    config = TINY_MODELS[name]
    dense = len(config.get("mlp_only_layers", [])) + int(config.get("first_k_dense_replace", 0))
    moe_layers = config["num_hidden_layers"] - dense
    assert len(expert_modules(model)) == moe_layers
    assert len(routers(model)) == moe_layers
    assert all(name.rsplit(".", 1)[-1] in ("gate", "router") for name in routers(model))


@pytest.mark.parametrize(
    "name, transposed, biases", [("mixtral", False, False), ("gpt_oss", True, True), ("llama4_text", True, False)]
)
def test_expert_weights_say_their_orientation_and_features(name, transposed, biases):
    model = _meta(name)
    config = TINY_MODELS[name]
    experts = next(iter(expert_modules(model).values()))
    weights = {w.name: w for w in expert_weights(experts)}
    assert set(weights) == {"gate_up_proj", "down_proj"}
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    assert (weights["gate_up_proj"].in_features, weights["gate_up_proj"].out_features) == (hidden, 2 * inner)
    assert (weights["down_proj"].in_features, weights["down_proj"].out_features) == (inner, hidden)
    assert {w.transposed for w in weights.values()} == {transposed}
    assert all((w.bias is not None) == biases for w in weights.values())


def test_expert_parameter_count_is_every_expert_weight_and_bias():
    model = _meta("gpt_oss")
    counted = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    assert expert_parameter_count(model) == counted > 0


def test_a_router_that_is_an_nn_linear_is_no_linear_layer_to_adapt_or_quantize():
    # Llama 4's router subclasses nn.Linear and returns (scores, logits): PEFT's lora.Linear and a
    # 4-bit layer would both break the tuple.
    model = _meta("llama4_text")
    router = next(iter(routers(model).values()))
    assert isinstance(router, nn.Linear)
    assert "router" not in linear_names_in_layers(model)
    with torch.device("meta"):
        quantize_linears_on_meta(model, torch.bfloat16)
    assert next(iter(routers(model).values())) is router
    assert type(model.model.layers[0].feed_forward.shared_expert.up_proj).__name__ == "Linear4bit"
