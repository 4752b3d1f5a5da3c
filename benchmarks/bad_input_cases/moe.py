"""Mixture-of-experts models (Mixtral, Llama 4, DeepSeek-V2, Qwen3-MoE): they plan with LoRA on their
experts, 4-bit experts and full fine-tuning; targets that name nothing, dropout or DoRA on expert
weights, and other tools' MoE keys of the wrong kind say so in one line."""

from __future__ import annotations

import json
from pathlib import Path

from ._case import Case

_IDS = {"vocab_size": 512, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}
_BASE = {
    **_IDS,
    "hidden_size": 64,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "num_hidden_layers": 4,
}

#: File name -> the tiny config.json it holds.
CONFIGS = {
    "moe_mixtral.json": {**_BASE, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2},
    "moe_llama4.json": {
        **_BASE,
        "model_type": "llama4_text",
        "num_local_experts": 4,
        "num_experts_per_tok": 1,
        "intermediate_size_mlp": 128,
        "head_dim": 16,
    },
    "moe_deepseek_v2.json": {
        **_BASE,
        "model_type": "deepseek_v2",
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "num_key_value_heads": 4,
        "kv_lora_rank": 16,
        "q_lora_rank": None,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 16,
        "v_head_dim": 8,
        "topk_method": "greedy",
        "n_group": 1,
        "topk_group": 1,
    },
}

#: File name -> the text of another tool's config (``{d}``: the inputs folder).
TOOL_CONFIGS = {
    "moe_lf_negative.yaml": "model_name_or_path: {d}/moe_mixtral.json\nstage: sft\nmoe_aux_loss_coef: -1\n",
    "moe_lf_routing.yaml": "model_name_or_path: {d}/moe_mixtral.json\nstage: sft\nmoe_aux_loss_coef: 0.01\ncutoff_len: 64\n",
    "moe_trl_bias.yaml": "model_name_or_path: {d}/moe_mixtral.json\nuse_peft: true\nlora_target_parameters: [mlp.down_proj.bias]\n",
    "moe_train_dropout.yaml": (
        "model: {d}/moe_mixtral.json\ninit: random\ndata: {d}/moe_data.jsonl\nmethod: lora\ndropout: 0.1\n"
        "seq_len: 64\nmax_steps: 1\ndevice: cpu\noutput_dir: {d}/moe_run\n"
    ),
}

CASES = [
    # They plan: LoRA on every expert, 4-bit experts, a router that is an nn.Linear, MLA beside shared experts.
    Case("plan {d}/moe_mixtral.json --seq-len 64", 0),
    Case("plan {d}/moe_mixtral.json --seq-len 64 --method qlora --targets experts,q_proj", 0),
    Case("plan {d}/moe_mixtral.json --seq-len 64 --method full", 0),
    Case("plan {d}/moe_llama4.json --seq-len 64 --targets router,experts", 0),
    Case("plan {d}/moe_deepseek_v2.json --seq-len 64 --method qlora", 0),
    Case("plan {d}/moe_lf_routing.yaml", 0),
    # Targets that name nothing; what PEFT's adapters on weights do not take.
    Case(
        "plan {d}/moe_mixtral.json --seq-len 64 --targets expert",
        2,
        says=("--targets", "expert", "experts.gate_up_proj", "all-linear"),
        fast=True,
    ),
    Case(
        "plan {d}/moe_mixtral.json --seq-len 64 --targets experts.up_proj",
        2,
        says=("--targets", "experts.up_proj", "experts.down_proj"),
    ),
    Case(
        "plan {d}/moe_mixtral.json --seq-len 64 --dropout 0.05",
        2,
        says=("--dropout 0.05", "takes no dropout", "--dropout 0"),
        fast=True,
    ),
    Case("plan {d}/moe_mixtral.json --seq-len 64 --targets experts --dora", 2, says=("--dora", "takes no DoRA")),
    Case("train {d}/moe_train_dropout.yaml", 2, says=("dropout: 0.1", "takes no dropout", "dropout: 0")),
    # Other tools' MoE keys of the wrong kind.
    Case("plan {d}/moe_lf_negative.yaml", 2, says=("moe_aux_loss_coef", "-1")),
    Case("plan {d}/moe_trl_bias.yaml", 2, says=("lora_target_parameters", "mlp.down_proj.bias")),
]


def make_inputs(root: Path) -> None:
    """The tiny config.json files and the tool configs the cases name, and a line of data."""
    for name, config in CONFIGS.items():
        (root / name).write_text(json.dumps(config))
    for name, text in TOOL_CONFIGS.items():
        (root / name).write_text(text.replace("{d}", str(root)))
    (root / "moe_data.jsonl").write_text(json.dumps({"text": "a line of data"}) + "\n")
