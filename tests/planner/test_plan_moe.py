"""Mixture-of-experts models plan: every family transformers builds, LoRA and QLoRA; the plan says
what the experts are (total and active parameters, storage, routing) and what LoRA trains on them;
the catalog's MoE models plan as users train them (Qwen3-30B-A3B QLoRA on a 24 GB card, experts in 4 bits)."""

from __future__ import annotations

import pytest
from moe_configs import MOE_CONFIGS

import memfit
from memfit.models.catalog import load_catalog_config
from memfit.planner.report import expert_lines
from memfit.units import format_bytes

KNOBS = {"seq_len": 64, "batch_size": 2, "budget": "10GiB", "cache": False}


@pytest.mark.slow
@pytest.mark.parametrize("model_type", sorted(MOE_CONFIGS))
@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_every_moe_family_plans_lora_and_qlora_on_its_experts(model_type, method):
    plan = memfit.plan(MOE_CONFIGS[model_type], method=method, **KNOBS)
    experts = plan.details["experts"]
    assert experts["storage"] == ("nf4" if method == "qlora" else "bf16")
    assert experts["adapters"]["weights"] == ["experts.down_proj", "experts.gate_up_proj"]
    assert {"experts.down_proj", "experts.gate_up_proj"} <= set(plan.details["adapters"]["modules"])
    assert not {"gate", "router"} & set(plan.details["adapters"]["modules"])
    assert 0 < experts["adapters"]["trainable_params"] < plan.details["trainable_params"]


def test_the_plan_counts_active_parameters_and_balanced_tokens():
    config = MOE_CONFIGS["mixtral"]
    plan = memfit.plan(config, method="qlora", targets="experts", **KNOBS)
    experts = plan.details["experts"]
    hidden, inner, count, layers = (
        config["hidden_size"],
        config["intermediate_size"],
        config["num_local_experts"],
        config["num_hidden_layers"],
    )
    in_experts = layers * count * 3 * hidden * inner
    assert experts["expert_params"] == in_experts
    assert experts["active_params"] == experts["total_params"] - in_experts + in_experts * 2 // count
    assert (experts["moe_layers"], experts["experts_per_layer"], experts["top_k"]) == (layers, count, 2)
    assert experts["tokens_per_micro_batch"] == 128 and experts["tokens_per_expert"] == 128 * 2 // count
    assert experts["imbalance_bytes"] == 0
    # r 16: gate_up at rank 32 (two projections), down_proj at 16, each expert its own pair
    assert (
        experts["adapters"]["trainable_params"]
        == plan.details["trainable_params"]
        == layers * count * (32 * (hidden + 2 * inner) + 16 * (inner + hidden))
    )
    assert experts["router_aux_loss"] == {"coef": 0.001, "on": False, "asked": False}
    lines = expert_lines(experts)
    assert lines[0].startswith(f"experts: {layers} layers of {count}, top 2 a token:") and "stored in NF4" in lines[0]
    assert "an imbalanced batch adds no memory" in lines[1]
    assert lines[2].startswith("routing loss: router_aux_loss_coef 0.001, off")


def test_the_plan_says_what_the_experts_adapters_cost_as_its_categories_count_them():
    plan = memfit.plan(MOE_CONFIGS["mixtral"], method="lora", targets="all-linear", **KNOBS)
    adapters, categories = plan.details["experts"]["adapters"], plan.categories
    experts, rest = adapters["bytes"], adapters["rest"]["bytes"]
    assert adapters["trainable_params"] + adapters["rest"]["trainable_params"] == plan.details["trainable_params"]
    assert 0 < adapters["rest"]["trainable_params"] < adapters["trainable_params"]
    # every trainable parameter sits on the experts or in the rest; the peak (in backward) holds every
    # weight and optimizer state, each in its own allocator block (fp32 adapters: 4 bytes an element at least)
    assert experts["weights"] + rest["weights"] == categories["trainable"]
    assert experts["optimizer"] + rest["optimizer"] == categories["optimizer"]
    assert experts["weights"] >= 4 * adapters["trainable_params"] and experts["gradients"] == experts["weights"]
    assert 2 * experts["weights"] <= experts["optimizer"]  # AdamW's two states (and its step counters)
    line = expert_lines(plan.details["experts"])[-1]
    assert format_bytes(sum(experts.values())) in line and format_bytes(rest["optimizer"]) in line
    # the full depth's figures are the simulations' extrapolated: those of the whole model simulated
    exact = memfit.plan(MOE_CONFIGS["mixtral"], method="lora", targets="all-linear", exact=True, **KNOBS)
    assert exact.details["experts"]["adapters"] == adapters


@pytest.mark.slow
def test_qwen3_30b_a3b_lora_on_every_linear_map_keeps_more_in_its_experts_adapters_than_in_attentions():
    plan = memfit.plan("qwen3-30b-a3b", method="lora", rank=16, targets="all-linear", seq_len=2048, cache=False)
    adapters = plan.details["experts"]["adapters"]
    assert 0.8e9 < plan.details["trainable_params"] < 1.0e9
    # every MLP of Qwen3-30B-A3B is a mixture of experts and all-linear adapts no router: the rest is attention
    config, rank = load_catalog_config("qwen3-30b-a3b"), 16
    heads, kv_heads, head_dim, hidden = (
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["head_dim"],
        config["hidden_size"],
    )
    per_layer = rank * (2 * (hidden + heads * head_dim) + 2 * (hidden + kv_heads * head_dim))
    assert adapters["rest"]["trainable_params"] == config["num_hidden_layers"] * per_layer
    assert sum(adapters["bytes"].values()) > 10 * sum(adapters["rest"]["bytes"].values())


def test_a_model_without_experts_has_no_expert_details(tiny_llama):
    assert memfit.plan(tiny_llama, method="lora", **KNOBS).details["experts"] is None


@pytest.mark.slow
def test_qwen3_30b_a3b_qlora_on_attention_fits_a_24_gb_card_with_its_experts_in_4_bits():
    plan = memfit.plan(
        "qwen3-30b-a3b",
        method="qlora",
        rank=16,
        targets="q_proj,k_proj,v_proj,o_proj",
        seq_len=2048,
        gpu="rtx-4090",
        cache=False,
    )
    assert plan.fits
    experts = plan.details["experts"]
    assert experts["storage"] == "nf4" and experts["experts_per_layer"] == 128 and experts["top_k"] == 8
    assert 3.2e9 < experts["active_params"] < 3.4e9 and 30.4e9 < experts["total_params"] < 30.6e9


@pytest.mark.slow
def test_mixtral_qlora_keeps_its_weights_under_a_byte_a_parameter():
    plan = memfit.plan(
        "mixtral-8x7b", method="qlora", seq_len=512, targets="q_proj,v_proj", budget="80GiB", cache=False
    )
    assert plan.categories["weights"] / plan.details["experts"]["total_params"] < 0.6


def test_gpt_oss_says_its_mxfp4_experts_are_dequantized_as_transformers_does_for_training():
    config = {**MOE_CONFIGS["gpt_oss"], "quantization_config": {"quant_method": "mxfp4"}}
    plan = memfit.plan(config, method="lora", **KNOBS)
    assert any("MXFP4" in note and "Mxfp4Config(dequantize=True)" in note for note in plan.details["notes"])


@pytest.mark.parametrize("method, sharded", [("lora", True), ("qlora", False)])
def test_fsdp_shards_16_bit_experts_and_keeps_4_bit_experts_whole_on_each_rank(method, sharded):
    from memfit.planner.layout import param_layout
    from memfit.spec import make_spec

    config = MOE_CONFIGS["mixtral"]
    layout = param_layout(config, make_spec(method=method, gpus=2, shard="fsdp"))
    hidden, inner, experts = config["hidden_size"], config["intermediate_size"], config["num_local_experts"]
    # a row of a stack is one expert: 16-bit bytes of its matrix, or half a byte an element packed
    per_element = 2 if method == "lora" else 0.5
    rows = {int(2 * inner * hidden * per_element), int(hidden * inner * per_element)}
    stacks = [g for g in layout.groups if g.dim0 == experts and g.row_bytes in rows]
    assert {g.row_bytes for g in stacks} == rows and {g.sharded for g in stacks} == {sharded}
    plan = memfit.plan(config, method=method, gpus=2, shard="fsdp", **KNOBS)
    assert plan.details["per_rank"] and plan.details["experts"]["storage"] == ("nf4" if method == "qlora" else "bf16")


@pytest.mark.parametrize("model_type", ["nemotron_h", "granitemoehybrid", "jamba"])
def test_hybrids_with_experts_plan_their_experts_in_fp32(model_type):
    # Nemotron-H's experts run transformers' grouped matmul, whose fake implementation takes bf16 only.
    from hybrid_configs import HYBRID_CONFIGS

    plan = memfit.plan(HYBRID_CONFIGS[model_type], method="lora", precision="fp32", seq_len=64, cache=False)
    assert plan.details["experts"]["storage"] == "fp32" and plan.details["experts"]["adapters"]["trainable_params"] > 0


def test_the_routing_loss_is_on_where_the_config_asks_for_it_and_the_step_is_supervised():
    config = {**MOE_CONFIGS["mixtral"], "output_router_logits": True}
    sft = memfit.plan(config, method="lora", **KNOBS).details["experts"]["router_aux_loss"]
    dpo = memfit.plan(config, method="lora", objective="dpo", **KNOBS).details["experts"]
    assert sft == {"coef": 0.001, "on": True, "asked": True}
    assert dpo["router_aux_loss"] == {"coef": 0.001, "on": False, "asked": True}
    assert "the preference objectives' losses leave it out" in expert_lines(dpo)[2]


def test_a_model_without_experts_is_built_once_to_find_none(monkeypatch):
    from memfit.models import build
    from memfit.planner.experts import expert_details
    from memfit.spec import make_spec

    built = []
    real = build.build_meta_model
    monkeypatch.setattr(build, "build_meta_model", lambda *a, **k: built.append(1) or real(*a, **k))
    dense = {**load_catalog_config("llama-3.2-1b"), "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128}
    spec = make_spec(method="lora")
    assert expert_details(dense, spec) is None and not built  # its config names no experts: nothing to build
    named = {**dense, "num_experts": 0, "_memfit_marker": id(built)}  # names experts, holds none; this test's alone
    assert expert_details(named, spec) is None and expert_details(named, spec) is None
    assert len(built) == 1
    assert expert_details(named, spec, remember=False) is None and len(built) == 2  # an exact plan looks again
    moe = MOE_CONFIGS[sorted(MOE_CONFIGS)[0]]
    assert expert_details(moe, spec) is not None and expert_details(moe, spec) is not None
    assert len(built) == 4  # a model with experts is read every time (its details depend on the knobs)
