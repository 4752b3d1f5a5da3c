"""Config dicts cut to chosen decoder layers: every way a config says a layer's kind follows the cut."""

from __future__ import annotations

from memfit.models.build import make_config
from memfit.models.cutting import cut_config_data, per_layer_names

SMALL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
}


def test_per_layer_lists_are_found_stored_or_computed():
    granite = make_config(
        {
            **SMALL,
            "model_type": "granitemoehybrid",
            "num_hidden_layers": 3,
            "layer_types": ["linear_attention", "full_attention", "linear_attention"],
        }
    )
    assert "layer_types" in per_layer_names(granite)
    jamba = make_config({**SMALL, "model_type": "jamba", "num_hidden_layers": 4})
    assert {"layers_block_type", "layers_num_experts"} <= set(per_layer_names(jamba))  # properties of the depth


def test_dense_layers_before_the_experts_are_counted_in_the_cut():
    deepseek = {
        **SMALL,
        "model_type": "deepseek_v3",
        "num_hidden_layers": 6,
        "first_k_dense_replace": 3,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "kv_lora_rank": 16,
        "q_lora_rank": 16,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
        "v_head_dim": 16,
        "n_group": 1,
        "topk_group": 1,
    }
    full = make_config(deepseek)
    assert cut_config_data(deepseek, full, [0, 1, 4])["first_k_dense_replace"] == 2
    assert cut_config_data(deepseek, full, [0, 1, 2, 4])["first_k_dense_replace"] == 3


def test_the_depth_is_written_under_every_name_a_config_keeps_it():
    nemotron = {
        **SMALL,
        "model_type": "nemotron_h",
        "head_dim": 16,
        "layers_block_type": ["linear_attention", "mlp", "full_attention"],
        "mamba_num_heads": 8,
        "mamba_head_dim": 16,
        "n_groups": 2,
        "ssm_state_size": 16,
    }
    data = cut_config_data(nemotron, make_config(nemotron), [0, 2])
    assert data["layers_block_type"] == ["linear_attention", "full_attention"] and data["num_hidden_layers"] == 2
    xlstm = {
        "model_type": "xlstm",
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_blocks": 4,
        "num_heads": 4,
        "vocab_size": 256,
    }
    cut = make_config(xlstm, layers=[0, 1])
    assert (cut.num_hidden_layers, cut.num_blocks) == (2, 2)
