"""Tiny configs of the mixture-of-experts causal LMs transformers builds, one per model type: each
a few layers deep, with the kinds of layer its family stacks (dense first layers, shared experts,
multi-head latent attention, sliding windows)."""

from __future__ import annotations

from typing import Any

_IDS = {"vocab_size": 512, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}
_BASE = {
    **_IDS,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "num_hidden_layers": 4,
}
_MLA = {
    "num_key_value_heads": 4,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 8,
    "n_group": 1,
    "topk_group": 1,
}

#: model_type -> a tiny config of it.
MOE_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen2_moe": {
        **_BASE,
        "model_type": "qwen2_moe",
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64,
    },
    "qwen3_moe": {
        **_BASE,
        "model_type": "qwen3_moe",
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "head_dim": 16,
        "mlp_only_layers": [0],
    },
    "mixtral": {**_BASE, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2},
    "gpt_oss": {
        **_BASE,
        "model_type": "gpt_oss",
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "head_dim": 16,
        "sliding_window": 16,
    },
    "deepseek_v2": {
        **_BASE,
        **_MLA,
        "model_type": "deepseek_v2",
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "q_lora_rank": None,
        "topk_method": "greedy",
    },
    "deepseek_v3": {
        **_BASE,
        **_MLA,
        "model_type": "deepseek_v3",
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "q_lora_rank": 24,
    },
    "olmoe": {**_BASE, "model_type": "olmoe", "num_experts": 4, "num_experts_per_tok": 2},
    "granitemoe": {**_BASE, "model_type": "granitemoe", "num_local_experts": 4, "num_experts_per_tok": 2},
    "phimoe": {**_BASE, "model_type": "phimoe", "num_local_experts": 4, "num_experts_per_tok": 2},
    "llama4_text": {
        **_BASE,
        "model_type": "llama4_text",
        "num_local_experts": 4,
        "num_experts_per_tok": 1,
        "intermediate_size_mlp": 128,
        "head_dim": 16,
        "interleave_moe_layer_step": 1,
    },
    "glm4_moe": {
        **_BASE,
        "model_type": "glm4_moe",
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "head_dim": 16,
        "n_group": 1,
        "topk_group": 1,
    },
    "qwen3_next": {
        **_BASE,
        "model_type": "qwen3_next",
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64,
        "head_dim": 16,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "layer_types": ["linear_attention", "full_attention"] * 2,
    },
}
