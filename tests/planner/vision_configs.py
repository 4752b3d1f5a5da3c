"""Tiny configs of the vision-language models transformers builds, one per model type: a language
model a few layers deep (of the kinds its family stacks: sliding and global attention, cross
attention), a vision tower of two or three blocks and its projector, and images a few patches wide."""

from __future__ import annotations

from typing import Any

_TEXT = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 1000,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
    "max_position_embeddings": 4096,
}
_QWEN_IDS = {"image_token_id": 990, "video_token_id": 991, "vision_start_token_id": 992, "vision_end_token_id": 993}
_MROPE = {"type": "mrope", "mrope_section": [2, 3, 3]}
_SIGLIP = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}

#: model_type -> a tiny config of it (its images: ``image_max_pixels`` 4096, a 64 x 64 image).
VISION_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen2_vl": {
        "text_config": {**_TEXT, "rope_scaling": _MROPE},
        "vision_config": {
            "depth": 3,
            "embed_dim": 32,
            "hidden_size": 64,
            "num_heads": 2,
            "mlp_ratio": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        **_QWEN_IDS,
    },
    "qwen2_5_vl": {
        "text_config": {**_TEXT, "rope_scaling": _MROPE},
        "vision_config": {
            "depth": 3,
            "hidden_size": 32,
            "intermediate_size": 64,
            "out_hidden_size": 64,
            "num_heads": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 56,
            "fullatt_block_indexes": [2],
        },
        **_QWEN_IDS,
    },
    "qwen3_vl": {
        "text_config": {
            **_TEXT,
            "rope_scaling": {"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True},
        },
        "vision_config": {
            "depth": 3,
            "hidden_size": 32,
            "intermediate_size": 64,
            "out_hidden_size": 64,
            "num_heads": 2,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "num_position_embeddings": 64,
            "deepstack_visual_indexes": [1],
        },
        **_QWEN_IDS,
    },
    "gemma3": {
        "text_config": {
            **_TEXT,
            "sliding_window": 16,
            "layer_types": ["sliding_attention", "full_attention"],
            "query_pre_attn_scalar": 16,
        },
        "vision_config": {**_SIGLIP, "image_size": 64, "patch_size": 16},
        "mm_tokens_per_image": 4,
        "image_token_index": 990,
        "boi_token_index": 991,
        "eoi_token_index": 992,
    },
    "llava": {
        "text_config": {**_TEXT, "model_type": "llama"},
        "vision_config": {
            **_SIGLIP,
            "model_type": "clip_vision_model",
            "image_size": 56,
            "patch_size": 14,
            "projection_dim": 32,
        },
        "image_token_index": 990,
        "vision_feature_layer": -2,
        "image_seq_length": 16,
    },
    "mistral3": {
        "text_config": {**_TEXT, "model_type": "mistral"},
        "vision_config": {**_SIGLIP, "model_type": "pixtral", "head_dim": 16, "image_size": 112, "patch_size": 14},
        "image_token_index": 990,
        "spatial_merge_size": 2,
        "vision_feature_layer": -1,
    },
    "idefics3": {
        "text_config": {**_TEXT, "model_type": "llama"},
        "vision_config": {**_SIGLIP, "image_size": 56, "patch_size": 14},
        "image_token_id": 990,
        "scale_factor": 2,
    },
    "smolvlm": {
        "text_config": {**_TEXT, "model_type": "llama"},
        "vision_config": {**_SIGLIP, "image_size": 64, "patch_size": 16},
        "image_token_id": 990,
        "scale_factor": 2,
    },
    "mllama": {
        "text_config": {
            **{k: v for k, v in _TEXT.items() if k != "head_dim"},
            "num_hidden_layers": 3,
            "cross_attention_layers": [1],
        },
        "vision_config": {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_global_layers": 1,
            "attention_heads": 2,
            "image_size": 28,
            "patch_size": 14,
            "max_num_tiles": 2,
            "vision_output_dim": 64,
            "intermediate_layers_indices": [0],
            "supported_aspect_ratios": [[1, 1], [1, 2], [2, 1]],
        },
        "image_token_index": 990,
    },
    "llama4": {
        "text_config": {
            **_TEXT,
            "intermediate_size_mlp": 128,
            "num_local_experts": 2,
            "num_experts_per_tok": 1,
            "interleave_moe_layer_step": 2,  # a dense layer, then a mixture of experts
            "no_rope_layer_interval": 2,
            "attention_chunk_size": 64,
        },
        # The tower's pixel shuffle (ratio 0.5) makes 4 x its width: intermediate_size; its adapter's
        # output (projector dims, vision_output_dim) is what the projector maps to the text width.
        "vision_config": {
            "hidden_size": 32,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": 56,
            "patch_size": 14,
            "pixel_shuffle_ratio": 0.5,
            "projector_input_dim": 64,
            "projector_output_dim": 64,
            "vision_output_dim": 64,
        },
        "image_token_index": 990,
        "boi_token_index": 991,
        "eoi_token_index": 992,
    },
}


def vision_config(model_type: str, layers: int | None = None) -> dict[str, Any]:
    """The tiny config of ``model_type`` (``layers``: its language model that many layers deep,
    its per-layer lists repeated to that depth)."""
    import copy

    config = copy.deepcopy(VISION_CONFIGS[model_type])
    config["model_type"] = model_type
    if layers is not None:
        text = config["text_config"]
        if "layer_types" in text:
            text["layer_types"] = [text["layer_types"][i % len(text["layer_types"])] for i in range(layers)]
        text["num_hidden_layers"] = layers
    return config
