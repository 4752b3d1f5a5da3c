"""State-space and hybrid models (Mamba, Falcon-H1, Jamba, Granite 4.0-H...): they plan, with LoRA,
QLoRA and full fine-tuning, and what cannot run says so in one line."""

from __future__ import annotations

import json
from pathlib import Path

from ._case import Case

_IDS = {"vocab_size": 512, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}
_ATTENTION = {
    **_IDS,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}
_MAMBA2 = {"mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 16, "mamba_chunk_size": 16}
_DELTA_NET = {
    "head_dim": 16,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
}

#: File name -> the tiny config.json it holds.
CONFIGS = {
    "hybrid_falcon_h1.json": {
        **_ATTENTION,
        "model_type": "falcon_h1",
        "num_hidden_layers": 4,
        "head_dim": 16,
        "mamba_d_ssm": 128,
        **_MAMBA2,
    },
    "hybrid_jamba.json": {
        **_ATTENTION,
        "model_type": "jamba",
        "num_hidden_layers": 8,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
        "expert_layer_period": 2,
        "expert_layer_offset": 1,
        "mamba_d_state": 8,
        "mamba_dt_rank": 8,
    },
    "hybrid_mamba2.json": {
        **_IDS,
        "model_type": "mamba2",
        "hidden_size": 64,
        "num_heads": 8,
        "head_dim": 16,
        "n_groups": 2,
        "state_size": 16,
        "num_hidden_layers": 4,
        "chunk_size": 16,
        "time_step_rank": 8,
    },
    "hybrid_mamba.json": {
        **_IDS,
        "model_type": "mamba",
        "hidden_size": 64,
        "intermediate_size": 128,
        "state_size": 8,
        "num_hidden_layers": 4,
        "time_step_rank": 8,
    },
    "hybrid_granite.json": {
        **_ATTENTION,
        "model_type": "granitemoehybrid",
        "num_hidden_layers": 6,
        "layer_types": ["linear_attention"] * 3 + ["full_attention", "linear_attention", "full_attention"],
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "shared_intermediate_size": 64,
        **_MAMBA2,
    },
    "hybrid_qwen3_5.json": {
        "model_type": "qwen3_5",
        "text_config": {**_ATTENTION, "model_type": "qwen3_5_text", "num_hidden_layers": 4, **_DELTA_NET},
    },
    "hybrid_xlstm.json": {
        **_IDS,
        "model_type": "xlstm",
        "hidden_size": 64,
        "embedding_dim": 64,
        "num_hidden_layers": 4,
        "num_blocks": 4,
        "num_heads": 4,
        "qk_dim_factor": 1.0,
        "chunk_size": 16,
    },
    "hybrid_qwen4_exp.json": {
        **_ATTENTION,
        "model_type": "qwen4_exp_text",
        "num_hidden_layers": 5,
        **_DELTA_NET,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64,
        "hc_count": 2,
        "hc_lowrank": 8,
        "ple_embed_dim": 64,
        "ngram_vocab_size_base": 1000,
        "heads_per_ngram": 2,
        "split_ngram_parts": 8,
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 16,
        "indexer_budget": 16,
        "indexer_compress_ratio": 4,
    },
}

CASES = [
    # They plan: Falcon-H1 (attention and Mamba in every layer), Jamba, Mamba-2, Granite 4.0-H.
    Case("plan {d}/hybrid_falcon_h1.json --seq-len 64", 0),
    Case("plan {d}/hybrid_falcon_h1.json --seq-len 64 --method qlora", 0),
    Case("plan {d}/hybrid_falcon_h1.json --seq-len 64 --method full", 0),
    Case("plan {d}/hybrid_jamba.json --seq-len 64", 0),
    Case("plan {d}/hybrid_jamba.json --seq-len 64 --method full --full-sim", 0),
    Case("plan {d}/hybrid_mamba2.json --seq-len 64 --method qlora", 0),
    Case("plan {d}/hybrid_granite.json --seq-len 64 --batch-size 4", 0),
    # What PEFT refuses, what transformers' PyTorch path cannot do, what the planner cannot simulate.
    Case(
        "plan {d}/hybrid_mamba2.json --targets in_proj,out_proj",
        2,
        says=("--targets", "out_proj", "mamba2", "all-linear"),
    ),
    Case("plan {d}/hybrid_mamba.json --method qlora", 2, says=("--method qlora", "dt_proj", "--method lora")),
    Case(
        "plan {d}/hybrid_granite.json --seq-len 64 --packing",
        2,
        says=("packing", "linear_attention", "packing: false"),
        fast=True,
    ),
    Case(
        "plan {d}/hybrid_granite.json --seq-len 64 --padding-free on", 2, says=("padding_free: on", "linear_attention")
    ),
    Case("plan {d}/hybrid_qwen3_5.json", 2, says=("qwen3_5", "text_config", "qwen3_5_text"), fast=True),
    Case("plan {d}/hybrid_xlstm.json", 2, says=('"mode": "inference"', '"mode": "train"', "--precision fp32")),
    Case("plan {d}/hybrid_qwen4_exp.json --seq-len 32", 2, says=("qwen4_exp_text", "aten.nonzero")),
]


def make_inputs(root: Path) -> None:
    """The tiny config.json files the cases name."""
    for name, config in CONFIGS.items():
        (root / name).write_text(json.dumps(config))
