"""Tiny configs of the state-space and hybrid causal LMs transformers builds, one per model type.

Each is a few layers deep with every kind of layer its family stacks (Mamba or linear attention,
attention, experts or dense MLPs), deep enough that plans cut it (a base of each kind plus one more
layer of a kind, shallower than the model).
"""

from __future__ import annotations

from typing import Any

L, F, S = "linear_attention", "full_attention", "sliding_attention"
_IDS = {"vocab_size": 512, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}
_ATTENTION = {**_IDS, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 512}
_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64}
_DELTA_NET = {"head_dim": 16, "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_key_heads": 2,
              "linear_num_value_heads": 4}
_KDA = {"num_key_value_heads": 4, "num_experts": 4, "num_experts_per_token": 2, "moe_intermediate_size": 64, "kv_lora_rank": 16,
        "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16, "linear_head_dim": 16, "linear_num_heads": 4,
        "layer_types": [L, L, F, L, L, F], "mlp_layer_types": ["dense"] + ["sparse"] * 5}

_INKLING = {**_ATTENTION, "head_dim": 16, "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2, "swa_head_dim": 16,
            "sliding_window_size": 16, "d_rel": 8, "rel_extent": 64, "moe_intermediate_size": 64, "n_routed_experts": 4,
            "num_experts_per_tok": 2}

#: model_type -> a tiny config of it.
HYBRID_CONFIGS: dict[str, dict[str, Any]] = {
    # State-space models: Mamba layers only.
    "mamba": {**_IDS, "model_type": "mamba", "hidden_size": 64, "intermediate_size": 128, "state_size": 8,
              "num_hidden_layers": 4, "time_step_rank": 8},
    "falcon_mamba": {**_IDS, "model_type": "falcon_mamba", "hidden_size": 64, "intermediate_size": 128, "state_size": 8,
                     "num_hidden_layers": 4, "time_step_rank": 8},
    "mamba2": {**_IDS, "model_type": "mamba2", "hidden_size": 64, "num_heads": 8, "head_dim": 16, "n_groups": 2,
               "state_size": 16, "num_hidden_layers": 4, "chunk_size": 16, "time_step_rank": 8},
    # Mamba beside attention.
    "falcon_h1": {**_ATTENTION, "model_type": "falcon_h1", "num_hidden_layers": 4, "head_dim": 16, "mamba_d_ssm": 128,
                  "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 16, "mamba_chunk_size": 16},
    "jamba": {**_ATTENTION, "model_type": "jamba", "num_hidden_layers": 8, "num_experts": 4, "num_experts_per_tok": 2,
              "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1,
              "mamba_d_state": 8, "mamba_dt_rank": 8},
    "bamba": {**_ATTENTION, "model_type": "bamba", "num_hidden_layers": 6, "attn_layer_indices": [3, 5], "mamba_n_heads": 8,
              "mamba_d_head": 16, "mamba_d_state": 16, "mamba_chunk_size": 16},
    "granitemoehybrid": {**_ATTENTION, "model_type": "granitemoehybrid", "num_hidden_layers": 6, "layer_types": [L, L, L, F, L, F],
                         "num_local_experts": 4, "num_experts_per_tok": 2, "shared_intermediate_size": 64, "mamba_n_heads": 8,
                         "mamba_d_head": 16, "mamba_d_state": 16, "mamba_chunk_size": 16},
    "nemotron_h": {**_ATTENTION, "model_type": "nemotron_h", "head_dim": 16, "layers_block_type": [L, "mlp", L, "moe", F, "mlp", L],
                   "ssm_state_size": 16, "mamba_num_heads": 8, "mamba_head_dim": 16, "n_groups": 2, "chunk_size": 16,
                   "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                   "moe_shared_expert_intermediate_size": 64},
    "zamba": {**_ATTENTION, "model_type": "zamba", "num_hidden_layers": 7, "attn_layer_period": 3, "attn_layer_offset": 2,
              "num_key_value_heads": 4, "attention_head_dim": 32, "attention_hidden_size": 128, "n_mamba_heads": 2,
              "mamba_d_state": 8, "mamba_dt_rank": 8},
    "zamba2": {**_ATTENTION, "model_type": "zamba2", "num_hidden_layers": 6, "layers_block_type": [L, L, "hybrid", L, "hybrid", L],
               "num_key_value_heads": 4, "n_mamba_heads": 8, "mamba_headdim": 16, "mamba_d_state": 16, "chunk_size": 16,
               "num_mem_blocks": 2, "adapter_rank": 8},
    # Short convolutions beside attention.
    "lfm2": {**_ATTENTION, "model_type": "lfm2", "num_hidden_layers": 5, "layer_types": ["conv", "conv", F, "conv", "conv"]},
    "lfm2_moe": {**_ATTENTION, "model_type": "lfm2_moe", "num_hidden_layers": 6, "layer_types": ["conv", "conv", F, "conv", F, "conv"],
                 **_MOE, "num_dense_layers": 1},
    "lfm3": {**_ATTENTION, "model_type": "lfm3", "num_hidden_layers": 6, "head_dim": 16, "sliding_window": 16,
             "layer_types": ["conv", S, F, "conv", S, "conv"]},
    # Gated delta rule, lightning and Kimi delta attention beside attention.
    "qwen3_next": {**_ATTENTION, "model_type": "qwen3_next", "num_hidden_layers": 5, **_DELTA_NET, **_MOE,
                   "shared_expert_intermediate_size": 64, "layer_types": [L, L, F, L, L]},
    "qwen3_5_text": {**_ATTENTION, "model_type": "qwen3_5_text", "num_hidden_layers": 5, **_DELTA_NET, "layer_types": [L, L, F, L, L]},
    "qwen3_5_moe_text": {**_ATTENTION, "model_type": "qwen3_5_moe_text", "num_hidden_layers": 5, **_DELTA_NET, **_MOE,
                         "shared_expert_intermediate_size": 64, "layer_types": [L, L, F, L, L]},
    "olmo_hybrid": {**_ATTENTION, "model_type": "olmo_hybrid", "num_hidden_layers": 5, "layer_types": [L, L, F, L, L],
                    "linear_num_key_heads": 2, "linear_num_value_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 32},
    "lara_mini": {**_ATTENTION, "model_type": "lara_mini", "num_hidden_layers": 6, **_DELTA_NET, **_MOE, "sliding_window": 16,
                  "shared_expert_intermediate_size": 64, "layer_types": [L, S, F, L, S, L]},
    "minimax": {**_ATTENTION, "model_type": "minimax", "num_hidden_layers": 5, "layer_types": [L, L, F, L, L], "num_local_experts": 4,
                "num_experts_per_tok": 2, "block_size": 16, "head_dim": 16},
    "kimi_linear": {**_ATTENTION, "model_type": "kimi_linear", "num_hidden_layers": 6, **_KDA},
    "bailing_hybrid": {**_ATTENTION, "model_type": "bailing_hybrid", "num_hidden_layers": 6, **_KDA, "num_expert_group": 1,
                       "topk_group": 1, "head_dim": 16, "num_nextn_predict_layers": 0},
    "qwen4_exp_text": {**_ATTENTION, "model_type": "qwen4_exp_text", "num_hidden_layers": 5, **_DELTA_NET, **_MOE,
                       "shared_expert_intermediate_size": 64, "hc_count": 2, "hc_lowrank": 8, "ple_embed_dim": 64,
                       "ngram_vocab_size_base": 1000, "heads_per_ngram": 2, "split_ngram_parts": 8, "indexer_n_heads": 2,
                       "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 16, "indexer_compress_ratio": 4},
    # Short convolutions inside attention layers, sliding beside global (Inkling).
    "inkling_text": {**_INKLING, "model_type": "inkling_text", "num_hidden_layers": 5, "n_shared_experts": 1,
                     "layer_types": ["hybrid", "hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid"],
                     "mlp_layer_types": ["dense"] + ["sparse"] * 4},
    "inkling2_text": {**_INKLING, "model_type": "inkling2_text", "num_hidden_layers": 6, "unpadded_vocab_size": 500,
                      "n_layers_per_attn_res_block": 2},
    "inkling2_loop_text": {**_INKLING, "model_type": "inkling2_loop_text", "num_hidden_layers": 6, "unpadded_vocab_size": 500,
                           "n_layers_per_attn_res_block": 2, "loop_layer_index_start": 2, "loop_layer_index_end": 4,
                           "loop_num_passes": 2, "loop_gate_rank": 8},
    # Recurrent networks.
    "recurrent_gemma": {**_ATTENTION, "model_type": "recurrent_gemma", "num_hidden_layers": 5, "num_key_value_heads": 4,
                        "head_dim": 16, "lru_width": 64, "attention_window_size": 16},
    "rwkv": {**_IDS, "model_type": "rwkv", "hidden_size": 64, "attention_hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 4, "context_length": 512},
    "xlstm": {**_IDS, "model_type": "xlstm", "hidden_size": 64, "embedding_dim": 64, "num_hidden_layers": 4, "num_blocks": 4,
              "num_heads": 4, "qk_dim_factor": 1.0, "chunk_size": 16, "mode": "train"},
}
