"""The cuts a plan simulates, and the arithmetic that adds them up to the full depth."""

from __future__ import annotations

from fractions import Fraction

from memfit.planner.shortcuts.depths import DepthPlan, _by_kind, _by_period, plan_depths

LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 512,
}
L, F = "linear_attention", "full_attention"


def test_a_model_of_one_kind_is_simulated_at_two_and_three_layers():
    plan = plan_depths(dict(LLAMA, num_hidden_layers=32))
    assert plan.samples == ((0, 1), (0, 1, 2))
    assert plan.combine([10, 13]) == 100  # 10 + 30 more layers of 3
    assert plan_depths(dict(LLAMA, num_hidden_layers=3)) is None  # small: simulated whole


def test_each_kind_is_counted_by_its_number_in_the_full_model():
    # Mamba (0) and attention (1): 8 layers, 2 of them attention, the first a Mamba layer.
    plan = _by_kind((0, 0, 0, 1, 0, 0, 0, 1))
    assert plan.samples[0] == (0, 1, 3)  # the first layer, then one ordinary layer of each kind
    assert plan.samples[1:] == ((0, 1, 1, 3), (0, 1, 3, 3))  # one more of a kind, in the middle
    assert plan.weights == (Fraction(4), Fraction(1))  # 6 Mamba layers, base 2; 2 attention layers, base 1
    base, more_mamba, more_attention = 100, 110, 130
    assert plan.combine([base, more_mamba, more_attention]) == 100 + 4 * 10 + 1 * 30


def test_a_kind_already_counted_in_full_needs_no_sample():
    # A first layer unlike the rest (RWKV's has an extra norm): only the ordinary kind grows.
    plan = _by_kind((0, 1, 1, 1, 1, 1))
    assert plan.samples == ((0, 1), (0, 1, 1))
    assert plan.weights == (Fraction(4),)


def test_a_periodic_pattern_falls_back_to_whole_periods():
    plan = _by_period((0, 1, 0, 2) * 8, 4)
    assert plan.samples == (tuple(range(8)), tuple(range(12)))
    assert plan.weights == (Fraction(32 - 8, 4),)
    assert _by_period((0, 0, 1) * 8 + (0, 0), 3) is None  # 26 layers are not whole periods of 3


def test_hybrid_configs_are_cut_by_kind():
    granite = {
        **LLAMA,
        "model_type": "granitemoehybrid",
        "num_hidden_layers": 8,
        "layer_types": [L, L, L, F, L, L, L, F],
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "shared_intermediate_size": 64,
        "mamba_n_heads": 8,
        "mamba_d_head": 16,
        "mamba_d_state": 16,
        "mamba_chunk_size": 16,
    }
    assert plan_depths(granite).samples == ((0, 1, 3), (0, 1, 1, 3), (0, 1, 3, 3))


def test_jamba_is_cut_by_whole_periods():
    """Jamba computes its kinds from the depth (attention every attn_layer_period layers): no other cut
    keeps them, so two and three periods are simulated."""
    jamba = {
        **LLAMA,
        "model_type": "jamba",
        "num_hidden_layers": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "attn_layer_period": 4,
        "attn_layer_offset": 2,
        "expert_layer_period": 2,
        "expert_layer_offset": 1,
        "mamba_d_state": 8,
        "mamba_dt_rank": 8,
    }
    assert plan_depths(jamba) == DepthPlan(samples=(tuple(range(8)), tuple(range(12))), weights=(Fraction(2),))


def test_layers_that_share_weights_are_simulated_whole():
    zamba = {
        **LLAMA,
        "model_type": "zamba",
        "num_hidden_layers": 7,
        "attn_layer_period": 3,
        "attn_layer_offset": 2,
        "num_key_value_heads": 4,
        "attention_head_dim": 32,
        "attention_hidden_size": 128,
        "n_mamba_heads": 2,
        "mamba_d_state": 8,
        "mamba_dt_rank": 8,
    }
    assert plan_depths(zamba) is None
