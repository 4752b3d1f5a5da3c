"""Decoder layers grouped by kind, and cuts of a model that keep each layer's kind."""

from __future__ import annotations

from memfit.models.build import make_config
from memfit.models.layer_kinds import covering_layers, cut_keeps_kinds, layer_pattern

ATTENTION = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "pad_token_id": 0,
}
MAMBA2 = {"mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 16, "mamba_chunk_size": 16}
L, F = "linear_attention", "full_attention"
FALCON_H1 = {
    **ATTENTION,
    "model_type": "falcon_h1",
    "num_hidden_layers": 4,
    "head_dim": 16,
    "mamba_d_ssm": 128,
    **MAMBA2,
}
BAMBA = {**ATTENTION, "model_type": "bamba", "num_hidden_layers": 6, "attn_layer_indices": [3, 5], **MAMBA2}


def test_falcon_h1_cuts_though_its_layer_types_are_read_only():
    """Falcon-H1's layer_types is a property (every layer "hybrid": attention and Mamba side by side)."""
    config = make_config(FALCON_H1, num_hidden_layers := 2)
    assert config.num_hidden_layers == num_hidden_layers
    assert list(config.layer_types) == ["hybrid", "hybrid"]
    assert layer_pattern(FALCON_H1).kinds == (0, 0, 0, 0)


def test_index_lists_are_remapped_to_the_cut():
    cut = make_config(BAMBA, layers=[0, 3, 1, 5])  # Mamba, attention, Mamba, attention
    assert cut.attn_layer_indices == [1, 3]
    assert list(cut.layers_block_type) == [L, F, L, F]
    assert layer_pattern(BAMBA).kinds == (0, 0, 0, 1, 0, 1)
    assert cut_keeps_kinds(BAMBA, [0, 3, 1, 5])


def test_per_layer_lists_and_leading_counts_follow_the_cut():
    lfm2_moe = {
        **ATTENTION,
        "model_type": "lfm2_moe",
        "num_hidden_layers": 6,
        "layer_types": ["conv", "conv", F, "conv", F, "conv"],
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "num_dense_layers": 2,
    }
    cut = make_config(lfm2_moe, layers=[0, 2, 3])
    assert list(cut.layer_types) == ["conv", F, "conv"]
    assert cut.num_dense_layers == 1  # of the cut's layers, only the first copies a dense one
    pattern = layer_pattern(lfm2_moe)
    assert pattern.kinds == (0, 0, 1, 2, 1, 2)  # conv with a dense MLP, attention with experts, conv with experts
    assert pattern.names == ("conv (Lfm2MoeMLP)", F, "conv (Lfm2MoeExperts)")
    assert cut_keeps_kinds(lfm2_moe, [0, 1, 2, 3])
    assert not cut_keeps_kinds(lfm2_moe, [0, 3, 1])  # a dense layer after an expert one: no count says so


def test_a_cycle_of_kinds_is_written_out_for_the_cut():
    gemma = {
        **ATTENTION,
        "model_type": "recurrent_gemma",
        "num_hidden_layers": 6,
        "num_key_value_heads": 4,
        "head_dim": 16,
        "lru_width": 64,
        "attention_window_size": 16,
    }
    cut = make_config(gemma, layers=[0, 1, 1, 2])  # recurrent, recurrent, recurrent, attention
    assert list(cut.block_types) == ["recurrent", "recurrent", "recurrent", "attention"]
    assert cut_keeps_kinds(gemma, [0, 1, 1, 2])


def test_a_rule_of_the_depth_keeps_only_prefix_cuts():
    jamba = {
        **ATTENTION,
        "model_type": "jamba",
        "num_hidden_layers": 8,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "attn_layer_period": 4,
        "attn_layer_offset": 2,
        "expert_layer_period": 2,
        "expert_layer_offset": 1,
        "mamba_d_state": 8,
        "mamba_dt_rank": 8,
    }
    pattern = layer_pattern(jamba)
    assert pattern.kinds == (0, 1, 2, 1, 0, 1, 2, 1) and pattern.period() == 4
    assert not cut_keeps_kinds(jamba, [0, 2, 1])  # the attention layer would land where the rule puts Mamba
    assert cut_keeps_kinds(jamba, [0, 1, 2, 3])
    assert covering_layers(jamba) == [0, 1, 2]


def test_kinds_are_named_by_the_config_and_counted():
    pattern = layer_pattern(BAMBA)
    assert pattern.names == (L, F)
    assert pattern.counts() == {0: 4, 1: 2}
    assert covering_layers(BAMBA) == [0, 3]


def test_layers_that_share_weights_are_coupled():
    zamba = {
        **ATTENTION,
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
    assert layer_pattern(zamba).coupled
    assert not layer_pattern(BAMBA).coupled


def test_a_model_of_one_kind_differs_nowhere():
    llama = {**ATTENTION, "model_type": "llama", "num_hidden_layers": 5}
    assert layer_pattern(llama).kinds == (0,) * 5
    assert layer_pattern(llama).period() == 1
