"""Plan equals run: ``memfit train``'s real steps, measured as the planner counts, next to the plan.

A plan is only as true as the path the trainer takes. :func:`measure` runs the trainer itself
(:func:`memfit.train.recipe.train`: its data, collate, loss, clipping, loss scaling, evaluation
between steps, resume) on the CPU with real tensors, and has its memory recorder measure the steps
with the planner's tracker under the planner's CUDA-parity rewrites (the ops whose memory differs
on CUDA, host copies counted as host memory). It then plans the same configuration and sets the
two peaks side by side: equal to the byte, or with the stated tolerance and its cause.

The data is made for the cell so that its micro-batches have the shapes the plan assumes: every
example ``seq_len`` tokens long (one row of ``batch_size x seq_len`` tokens without padding), and in
padded batches one example a token shorter in every micro-batch (so each carries a padding mask, as
the plan's worst case does). :data:`MATRIX` covers the knobs the trainer accepts on two tiny models
(Llama- and Qwen2-shaped), a state-space model (Mamba-2) and a hybrid (Falcon-H1: attention and
Mamba side by side in every layer) on transformers' PyTorch path, and a mixture-of-experts model of
each expert layout (Qwen3-MoE, Mixtral, gpt-oss, Llama 4, DeepSeek-V2) with LoRA on the experts,
4-bit experts and full fine-tuning; ``benchmarks/conformance.py`` writes the whole table. grpo's
cells compare each phase, the generation (transformers' ``generate`` with its KV cache, and the old
log-probs) and the training step, with its plan: prompts of unequal lengths in every generation
batch (:func:`write_prompts`), completions that run to their longest (a random model rarely samples
its end token, and a generation stops early only when every completion has).
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from memfit.json_form import JsonForm

#: Two tiny model shapes (the shipped tiny tokenizer's 512 tokens): grouped-query heads in both, an
#: untied head in the Llama one and a tied one in the Qwen2 one.
TINY_MODELS: dict[str, dict[str, Any]] = {
    "llama": {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 512,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
    },
    "qwen2": {
        "model_type": "qwen2",
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 512,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
    },
    "mamba2": {
        "model_type": "mamba2",
        "hidden_size": 64,
        "num_heads": 8,
        "head_dim": 16,
        "n_groups": 2,
        "state_size": 16,
        "num_hidden_layers": 3,
        "vocab_size": 512,
        "chunk_size": 16,
        "time_step_rank": 8,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
    },
    "falcon_h1": {
        "model_type": "falcon_h1",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 512,
        "max_position_embeddings": 2048,
        "mamba_d_ssm": 128,
        "mamba_n_heads": 8,
        "mamba_d_head": 16,
        "mamba_d_state": 16,
        "mamba_chunk_size": 16,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
    },
    # Mixture-of-experts models, one of each layout of the experts' weights: [experts, out, in] on
    # transformers' grouped matmuls (Qwen3-MoE with a dense first layer, Mixtral), [experts, in, out]
    # with biases and interleaved gate and up (gpt-oss), every expert on every token (Llama 4), and
    # multi-head latent attention beside shared experts (DeepSeek-V2).
    "qwen3_moe": {
        "model_type": "qwen3_moe",
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "mlp_only_layers": [0],
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 512,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
    },
    "mixtral": {
        "model_type": "mixtral",
        "hidden_size": 64,
        "intermediate_size": 64,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 512,
        "max_position_embeddings": 2048,
        "sliding_window": None,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
    },
    "gpt_oss": {
        "model_type": "gpt_oss",
        "hidden_size": 64,
        "intermediate_size": 64,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "sliding_window": 32,
        "vocab_size": 512,
        "max_position_embeddings": 2048,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
    },
    "llama4_text": {
        "model_type": "llama4_text",
        "hidden_size": 64,
        "intermediate_size": 64,
        "intermediate_size_mlp": 128,
        "num_local_experts": 4,
        "num_experts_per_tok": 1,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 512,
        "max_position_embeddings": 2048,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
    },
    "deepseek_v2": {
        "model_type": "deepseek_v2",
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "kv_lora_rank": 16,
        "q_lora_rank": None,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        "topk_method": "greedy",
        "n_group": 1,
        "topk_group": 1,
        "vocab_size": 512,
        "max_position_embeddings": 2048,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
    },
    # A vision-language model (LLaVA: a CLIP tower, its projector, a Llama), the shipped tokenizer
    # with the tiny processor's image token (512) added; examples/vlm-tiny.yaml trains the same shape.
    "llava": {
        "model_type": "llava",
        "text_config": {
            "model_type": "llama",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 513,
            "max_position_embeddings": 512,
            "bos_token_id": 0,
            "eos_token_id": 1,
            "pad_token_id": 2,
        },
        "vision_config": {
            "model_type": "clip_vision_model",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": 56,
            "patch_size": 14,
            "projection_dim": 32,
        },
        "image_token_index": 512,
        "image_seq_length": 16,
        "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
    },
}

#: Characters the tiny tokenizer keeps one token each (it learned no merge of them): texts of them
#: have exactly as many tokens as characters, plus the BOS and EOS the data pipeline adds.
_ONE_TOKEN_CHARS = "~#@|`"


@dataclass
class Cell(JsonForm):
    """One configuration: the plan's peak and the run's, and whether they agree."""

    name: str
    settings: dict[str, Any]
    planned_bytes: int = 0
    measured_bytes: int = 0
    planned_phase: str = ""
    measured_phase: str = ""
    planned_categories: dict[str, int] = field(default_factory=dict)
    measured_categories: dict[str, int] = field(default_factory=dict)
    tolerance_bytes: int = 0
    cause: str = ""  # why a tolerance is needed (empty: equal to the byte)
    #: grpo: each phase's peak, [planned, measured] (generation: generate and the old log-probs; training: the step)
    phase_bytes: dict[str, list[int]] = field(default_factory=dict)
    seconds: float = 0.0
    error: str = ""

    @property
    def difference_bytes(self) -> int:
        return self.measured_bytes - self.planned_bytes

    @property
    def agrees(self) -> bool:
        phases_agree = all(
            abs(measured - planned) <= self.tolerance_bytes for planned, measured in self.phase_bytes.values()
        )
        return not self.error and abs(self.difference_bytes) <= self.tolerance_bytes and phases_agree

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "difference_bytes": self.difference_bytes, "agrees": self.agrees}


# ------------------------------------------------------------------------------------------------
# The matrix


def _cell(name: str, **settings: Any) -> tuple[str, dict[str, Any]]:
    return name, settings


#: (name, settings): settings are training-config fields, plus ``model`` (a TINY_MODELS key) and the
#: harness's own ``resume`` (train half the steps, then measure the first steps after a resume).
MATRIX: list[tuple[str, dict[str, Any]]] = [
    _cell("llama lora bf16", model="llama", method="lora", precision="bf16"),
    _cell("llama lora fp32 no-ckpt", model="llama", method="lora", precision="fp32", checkpointing="off"),
    _cell("llama lora fp16 scaler", model="llama", method="lora", precision="fp16"),
    _cell("llama lora offload", model="llama", method="lora", precision="bf16", checkpointing="offload"),
    _cell("llama lora tiling", model="llama", method="lora", precision="fp32", tiling="on"),
    _cell("llama lora accum3", model="llama", method="lora", precision="bf16", grad_accum=3),
    _cell("llama lora no-clip", model="llama", method="lora", precision="bf16", max_grad_norm=None),
    _cell("llama lora padded", model="llama", method="lora", precision="bf16", padding_free="off", batch_size=2),
    _cell("llama lora padding-free b3", model="llama", method="lora", precision="fp32", batch_size=3),
    _cell("llama lora packing", model="llama", method="lora", precision="bf16", packing=True, batch_size=2),
    _cell("llama lora eval between steps", model="llama", method="lora", precision="bf16", eval_every=1),
    _cell("llama lora resume", model="llama", method="lora", precision="bf16", resume=True),
    _cell("llama qlora bf16", model="llama", method="qlora", precision="bf16"),
    _cell("llama qlora fp16 offload", model="llama", method="qlora", precision="fp16", checkpointing="offload"),
    _cell("llama full fp32", model="llama", method="full", precision="fp32"),
    _cell(
        "llama full bf16 no-ckpt accum3",
        model="llama",
        method="full",
        precision="bf16",
        checkpointing="off",
        grad_accum=3,
    ),
    _cell("llama full step-in-backward", model="llama", method="full", precision="fp32", step_in_backward=True),
    _cell(
        "llama full padded tiling",
        model="llama",
        method="full",
        precision="bf16",
        padding_free="off",
        batch_size=2,
        tiling="on",
    ),
    _cell("qwen2 lora bf16", model="qwen2", method="lora", precision="bf16"),
    _cell(
        "qwen2 lora fp32 padded no-clip",
        model="qwen2",
        method="lora",
        precision="fp32",
        padding_free="off",
        batch_size=2,
        max_grad_norm=None,
    ),
    _cell(
        "qwen2 qlora bf16 accum3 packing", model="qwen2", method="qlora", precision="bf16", grad_accum=3, packing=True
    ),
    _cell("qwen2 full bf16 offload", model="qwen2", method="full", precision="bf16", checkpointing="offload"),
    _cell("qwen2 full fp32 tiling resume", model="qwen2", method="full", precision="fp32", tiling="on", resume=True),
    _cell(
        "qwen2 full step-in-backward no-ckpt",
        model="qwen2",
        method="full",
        precision="bf16",
        step_in_backward=True,
        checkpointing="off",
    ),
    # Mixed precision: fp32 weights (a 16-bit frozen LoRA base), forward under autocast.
    _cell("llama full bf16-mixed", model="llama", method="full", precision="bf16-mixed"),
    _cell(
        "llama full fp16-mixed scaler accum3 no-ckpt",
        model="llama",
        method="full",
        precision="fp16-mixed",
        grad_accum=3,
        checkpointing="off",
    ),
    _cell(
        "llama full bf16-mixed step-in-backward",
        model="llama",
        method="full",
        precision="bf16-mixed",
        step_in_backward=True,
    ),
    _cell("llama lora bf16-mixed", model="llama", method="lora", precision="bf16-mixed"),
    _cell("llama lora fp16-mixed scaler", model="llama", method="lora", precision="fp16-mixed"),
    _cell(
        "qwen2 full bf16-mixed tiling offload",
        model="qwen2",
        method="full",
        precision="bf16-mixed",
        tiling="on",
        checkpointing="offload",
    ),
    _cell(
        "qwen2 qlora bf16-mixed padded",
        model="qwen2",
        method="qlora",
        precision="bf16-mixed",
        padding_free="off",
        batch_size=2,
    ),
    # Preference objectives: pairs of sequences in one forward; DPO's reference pass (adapters
    # disabled, or a frozen copy of the model), or log-probs precomputed before training.
    _cell(
        "llama dpo lora padded",
        model="llama",
        objective="dpo",
        method="lora",
        precision="fp32",
        padding_free="off",
        batch_size=2,
    ),
    _cell(
        "llama dpo lora padding-free bf16",
        model="llama",
        objective="dpo",
        method="lora",
        precision="bf16",
        batch_size=2,
    ),
    _cell("llama dpo full padding-free frozen copy", model="llama", objective="dpo", method="full", precision="fp32"),
    _cell(
        "llama dpo full padded bf16",
        model="llama",
        objective="dpo",
        method="full",
        precision="bf16",
        padding_free="off",
    ),
    _cell(
        "llama dpo lora precomputed accum3",
        model="llama",
        objective="dpo",
        method="lora",
        precision="bf16",
        precompute_reference=True,
        grad_accum=3,
    ),
    _cell(
        "qwen2 dpo qlora bf16-mixed padded",
        model="qwen2",
        objective="dpo",
        method="qlora",
        precision="bf16-mixed",
        padding_free="off",
    ),
    _cell(
        "llama orpo lora padded", model="llama", objective="orpo", method="lora", precision="fp32", padding_free="off"
    ),
    _cell(
        "qwen2 orpo full padding-free", model="qwen2", objective="orpo", method="full", precision="bf16", batch_size=2
    ),
    _cell(
        "llama simpo lora padding-free", model="llama", objective="simpo", method="lora", precision="bf16", batch_size=2
    ),
    _cell(
        "qwen2 simpo full padded no-ckpt",
        model="qwen2",
        objective="simpo",
        method="full",
        precision="fp32",
        padding_free="off",
        checkpointing="off",
    ),
    # grpo: each step's completions generated (transformers generate, a KV cache), then trained on;
    # the generation phase and the training phase each equal their plan. Padded rows: the prompts of
    # a generation batch are of unequal lengths, as the plan assumes.
    _cell(
        "llama grpo lora bf16 padded",
        model="llama",
        objective="grpo",
        method="lora",
        precision="bf16",
        padding_free="off",
    ),
    _cell(
        "llama grpo full fp32 beta top_p",
        model="llama",
        objective="grpo",
        method="full",
        precision="fp32",
        padding_free="off",
        beta=0.1,
        top_p=0.9,
        temperature=0.7,
    ),
    _cell(
        "qwen2 grpo qlora bf16 num_iterations 2",
        model="qwen2",
        objective="grpo",
        method="qlora",
        precision="bf16",
        padding_free="off",
        num_iterations=2,
    ),
    # The adapter options: DoRA, rsLoRA, modules trained whole (tied and untied), an 8-bit base.
    _cell("llama lora dora bf16", model="llama", method="lora", precision="bf16", dora=True),
    _cell(
        "llama lora dora fp32 no-ckpt accum3",
        model="llama",
        method="lora",
        precision="fp32",
        dora=True,
        checkpointing="off",
        grad_accum=3,
    ),
    _cell("llama lora rslora", model="llama", method="lora", precision="bf16", rslora=True),
    _cell(
        "llama lora embed+head saved",
        model="llama",
        method="lora",
        precision="bf16",
        modules_to_save=["embed_tokens", "lm_head"],
    ),
    _cell(
        "qwen2 lora tied head saved bf16-mixed",
        model="qwen2",
        method="lora",
        precision="bf16-mixed",
        modules_to_save=["lm_head"],
    ),
    _cell("llama lora-8bit bf16", model="llama", method="lora-8bit", precision="bf16"),
    _cell("llama lora-8bit fp16 offload", model="llama", method="lora-8bit", precision="fp16", checkpointing="offload"),
    _cell(
        "qwen2 lora-8bit padded accum3",
        model="qwen2",
        method="lora-8bit",
        precision="bf16",
        padding_free="off",
        batch_size=2,
        grad_accum=3,
    ),
    _cell(
        "qwen2 lora dora bf16-mixed padded",
        model="qwen2",
        method="lora",
        precision="bf16-mixed",
        dora=True,
        padding_free="off",
        batch_size=2,
    ),
    _cell(
        "qwen2 lora-8bit embed saved no-ckpt",
        model="qwen2",
        method="lora-8bit",
        precision="fp32",
        modules_to_save=["embed_tokens"],
        checkpointing="off",
    ),
    # Mamba layers (in_proj adapted, out_proj left to itself as PEFT requires), alone and beside
    # attention; their recurrence keeps a hybrid's batches padded.
    _cell("mamba2 lora bf16", model="mamba2", method="lora", precision="bf16"),
    _cell("mamba2 full fp32 no-ckpt", model="mamba2", method="full", precision="fp32", checkpointing="off"),
    _cell("falcon_h1 lora bf16 padded", model="falcon_h1", method="lora", precision="bf16", batch_size=2),
    _cell("falcon_h1 qlora bf16", model="falcon_h1", method="qlora", precision="bf16"),
    _cell("falcon_h1 full bf16 accum3", model="falcon_h1", method="full", precision="bf16", grad_accum=3),
    # Mixture-of-experts models: LoRA on every expert (PEFT's weight adapters), on attention alone,
    # 4-bit experts, full fine-tuning.
    _cell("qwen3_moe lora bf16", model="qwen3_moe", method="lora", precision="bf16"),
    _cell(
        "qwen3_moe lora fp32 experts padded",
        model="qwen3_moe",
        method="lora",
        precision="fp32",
        targets=["experts"],
        padding_free="off",
        batch_size=2,
    ),
    _cell("mixtral lora bf16-mixed accum3", model="mixtral", method="lora", precision="bf16-mixed", grad_accum=3),
    _cell("mixtral full bf16", model="mixtral", method="full", precision="bf16"),
    _cell(
        "mixtral lora fp32 routing loss padded",
        model="mixtral",
        method="lora",
        precision="fp32",
        padding_free="off",
        batch_size=2,
        model_overrides={"output_router_logits": True},
    ),
    _cell("gpt_oss lora bf16", model="gpt_oss", method="lora", precision="bf16", batch_size=2),
    _cell("llama4_text lora fp32", model="llama4_text", method="lora", precision="fp32"),
    _cell("deepseek_v2 lora bf16", model="deepseek_v2", method="lora", precision="bf16"),
    _cell("qwen3_moe qlora bf16", model="qwen3_moe", method="qlora", precision="bf16"),
    _cell(
        "mixtral qlora fp16 experts accum3",
        model="mixtral",
        method="qlora",
        precision="fp16",
        targets=["experts", "q_proj"],
        grad_accum=3,
    ),
    _cell("gpt_oss qlora bf16-mixed", model="gpt_oss", method="qlora", precision="bf16-mixed", batch_size=2),
    _cell("llama4_text qlora bf16", model="llama4_text", method="qlora", precision="bf16"),
    _cell(
        "deepseek_v2 qlora bf16 padded",
        model="deepseek_v2",
        method="qlora",
        precision="bf16",
        padding_free="off",
        batch_size=2,
    ),
    _cell("qwen3_moe qlora offload", model="qwen3_moe", method="qlora", precision="bf16", checkpointing="offload"),
    _cell("deepseek_v2 dpo lora", model="deepseek_v2", objective="dpo", method="lora", precision="bf16", batch_size=2),
    # A vision-language model: each example a picture and a conversation about it, through the
    # processor and the collate the planner's micro-batch takes; the tower frozen or trained.
    _cell("llava lora bf16 tower frozen", model="llava", method="lora", precision="bf16"),
    _cell(
        "llava lora fp32 tower trained padded",
        model="llava",
        method="lora",
        precision="fp32",
        freeze_vision=False,
        batch_size=2,
    ),
    _cell("llava full bf16 tower trained", model="llava", method="full", precision="bf16", freeze_vision=False),
]

#: The rest of a cell's settings, unless it says otherwise.
DEFAULTS: dict[str, Any] = {
    "batch_size": 1,
    "seq_len": 96,
    "grad_accum": 1,
    "rank": 8,
    "checkpointing": "on",
    "tiling": "off",
}

#: The rest of a grpo cell's settings: two prompts a step, two completions each, up to 16 tokens.
GRPO_DEFAULTS: dict[str, Any] = {
    "batch_size": 4,
    "num_generations": 2,
    "max_completion_length": 16,
    "seq_len": 40,
    "reward_funcs": ["length"],
}

#: Steps measured (the plan simulates two: the first creates the optimizer states).
STEPS = 3


# ------------------------------------------------------------------------------------------------
# One cell


def measure(name: str, settings: dict[str, Any], work_dir: str | Path) -> Cell:
    """Run the trainer for the cell in ``work_dir`` on the CPU, measure its steps, plan it, compare."""
    from memfit.models.vision import is_vision_config
    from memfit.planner.api import plan
    from memfit.train.config import model_config_dict, validate_config
    from memfit.train.recipe import train
    from memfit.watch.timeline import load_run

    started = time.perf_counter()
    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    options = {**DEFAULTS, **(GRPO_DEFAULTS if settings.get("objective") == "grpo" else {}), **settings}
    resume = bool(options.pop("resume", False))
    model = options.pop("model")
    config_path = work_dir / "config.json"
    config_path.write_text(json.dumps(TINY_MODELS[model]))
    knobs = dict(options)
    eval_every = int(knobs.get("eval_every", 0))
    if knobs.get("objective") == "grpo":
        data = write_prompts(
            work_dir / "data.jsonl",
            budget=int(knobs["seq_len"]) - int(knobs["max_completion_length"]),
            prompts=int(knobs["batch_size"]) * int(knobs["grad_accum"]) // int(knobs["num_generations"]),
            steps=2 * STEPS,
        )
    elif knobs.get("objective", "sft") != "sft":
        data = write_pairs(
            work_dir / "data.jsonl",
            seq_len=int(knobs["seq_len"]),
            batch_size=int(knobs["batch_size"]),
            grad_accum=int(knobs["grad_accum"]),
            steps=2 * STEPS,
            padded=knobs.get("padding_free") == "off",
        )
    elif is_vision_config(TINY_MODELS[model]):
        data = write_vision_data(
            work_dir / "data.jsonl",
            seq_len=int(knobs["seq_len"]),
            batch_size=int(knobs["batch_size"]),
            grad_accum=int(knobs["grad_accum"]),
            steps=2 * STEPS,
            padded=int(knobs["batch_size"]) > 1,
        )
    else:
        data = write_data(
            work_dir / "data.jsonl",
            seq_len=int(knobs["seq_len"]),
            batch_size=int(knobs["batch_size"]),
            grad_accum=int(knobs["grad_accum"]),
            steps=2 * STEPS,
            packing=bool(knobs.get("packing")),
            padded=_padded(TINY_MODELS[model], knobs),
        )
    common = {
        "model": str(config_path),
        "init": "random",
        "data": str(data),
        "device": "cpu",
        "output_dir": str(work_dir / "run"),
        "log_every": 1,
        "seed": 0,
        **knobs,
    }
    if eval_every:
        common["eval_split"] = 0.1
    cell = Cell(name=name, settings=dict(settings))
    try:
        if resume:
            # Half the steps, saved; then the steps after the resume are the ones measured.
            train(validate_config({**common, "max_steps": STEPS}), progress=False, console=_quiet_console())
            config = validate_config({**common, "max_steps": 2 * STEPS})
            train(config, resume=True, progress=False, console=_quiet_console(), conformance_steps=STEPS)
        else:
            config = validate_config({**common, "max_steps": STEPS})
            train(config, progress=False, console=_quiet_console(), conformance_steps=STEPS)
        attribution = load_run(work_dir / "run").timeline.attribution or {}
        cell.measured_bytes = int(attribution.get("peak_allocated_bytes", 0))
        cell.measured_phase = str(attribution.get("phase", ""))
        cell.measured_categories = dict(attribution.get("categories", {}))
        planned = plan(model_config_dict(config), context_bytes=0, cublas_workspace_bytes=0, **config.knobs())
        cell.planned_bytes, cell.planned_phase = planned.allocated_bytes, planned.phase
        cell.planned_categories = {k: v for k, v in planned.categories.items() if k not in ("allocator", "runtime")}
        if config.spec.is_grpo:
            # Each phase against its plan; the cell's peak is the larger phase's (allocated bytes).
            cell.phase_bytes = _grpo_phases(planned, attribution)
            cell.planned_phase, cell.planned_bytes = max(
                ((k, v[0]) for k, v in cell.phase_bytes.items()), key=lambda kv: kv[1]
            )
            cell.measured_phase, cell.measured_bytes = max(
                ((k, v[1]) for k, v in cell.phase_bytes.items()), key=lambda kv: kv[1]
            )
    except Exception as err:  # noqa: BLE001 - a cell that cannot run is a finding, reported with the others
        cell.error = f"{type(err).__name__}: {err}"
    cell.seconds = round(time.perf_counter() - started, 2)
    return cell


#: The run's phases that are grpo's generation (the others are the training step's).
GENERATION_PHASES = ("generation", "old_logps")


def _grpo_phases(planned: Any, attribution: dict[str, Any]) -> dict[str, list[int]]:
    """[planned, measured] peak allocated bytes of a grpo run's generation phase and training phase."""
    peaks = attribution.get("phase_peaks_allocated_bytes", {})
    measured_generation = max((v for k, v in peaks.items() if k in GENERATION_PHASES), default=0)
    measured_training = max((v for k, v in peaks.items() if k not in GENERATION_PHASES and k != "setup"), default=0)
    by_name = {p["name"]: p["allocated_bytes"] for p in planned.details.get("phases", [])}
    return {
        "generation": [int(by_name.get("generation", 0)), int(measured_generation)],
        "training": [int(by_name.get("training", 0)), int(measured_training)],
    }


def _padded(model_config: dict[str, Any], knobs: dict[str, Any]) -> bool:
    """Whether the cell's micro-batches are padded rows (padding_free off, or a model that cannot take
    one-row batches, such as a hybrid whose Mamba layers carry state across examples): its data then
    pads one example of each micro-batch, as the plan's worst case does."""
    from memfit.models.build import make_config
    from memfit.step.attention import unsupported_reason

    if int(knobs["batch_size"]) < 2 or knobs.get("packing"):
        return False
    return knobs.get("padding_free") == "off" or unsupported_reason(make_config(model_config)) is not None


def run_matrix(
    cells: list[tuple[str, dict[str, Any]]], work_dir: str | Path, progress: Callable[[Cell], None] | None = None
) -> list[Cell]:
    """:func:`measure` every cell, each in a folder of its own under ``work_dir``."""
    out = []
    for index, (name, settings) in enumerate(cells):
        cell = measure(name, settings, Path(work_dir) / f"cell-{index:02d}")
        out.append(cell)
        if progress is not None:
            progress(cell)
    return out


# ------------------------------------------------------------------------------------------------
# Data of exact lengths


def write_data(
    path: Path,
    *,
    seq_len: int,
    batch_size: int,
    grad_accum: int,
    steps: int,
    packing: bool,
    padded: bool,
    seed: int = 0,
) -> Path:
    """A JSONL of text records whose micro-batches take the shapes the plan assumes (see the module doc).

    Every example has ``seq_len`` tokens (BOS, characters, EOS); packed rows then hold one example
    each. With ``padded``, the batch order the trainer will draw (same seed) is reproduced, and one
    example of each micro-batch is a token shorter.
    """
    from memfit.train.data import BatchIterator

    count = batch_size * grad_accum * steps
    lengths = [seq_len] * count
    if padded:
        order = BatchIterator(list(range(count)), batch_size=batch_size, seed=seed)
        for _ in range(count // batch_size):
            lengths[next(order)[-1]] = seq_len - 1
    rng = random.Random(f"memfit-conformance-{seed}")
    with open(path, "w", encoding="utf-8") as handle:
        for length in lengths:
            text = "".join(rng.choice(_ONE_TOKEN_CHARS) for _ in range(length - 2))  # + BOS + EOS
            handle.write(json.dumps({"text": text}) + "\n")
    return path


def write_vision_data(
    path: Path, *, seq_len: int, batch_size: int, grad_accum: int, steps: int, padded: bool, seed: int = 0
) -> Path:
    """A JSONL in TRL's vision format (the tiny LLaVA's) whose micro-batches take the shapes the plan
    assumes: every record one picture (a PNG beside the file, of the tower's size) and a conversation of
    one-token characters, ``seq_len`` tokens through the tiny processor, and with ``padded`` one record
    of each micro-batch, in the order the trainer will draw them (same seed), a token shorter."""
    from PIL import Image

    from memfit.train.data import BatchIterator

    count = batch_size * grad_accum * steps
    short = set()
    if padded:
        order = BatchIterator(list(range(count)), batch_size=batch_size, seed=seed)
        short = {next(order)[-1] for _ in range(count // batch_size)}
    rng = random.Random(f"memfit-conformance-vision-{seed}")
    answer = seq_len - _vision_overhead_tokens() + 1  # the record of a one-character answer has the overhead
    with open(path, "w", encoding="utf-8") as handle:
        for index in range(count):
            name = f"image-{index}.png"
            Image.new("RGB", (56, 56), tuple(rng.randrange(256) for _ in range(3))).save(path.parent / name)
            text = "".join(rng.choice(_ONE_TOKEN_CHARS) for _ in range(answer - (1 if index in short else 0)))
            handle.write(json.dumps(_vision_record(text, name)) + "\n")
    return path


def _vision_record(answer: str, image: str) -> dict[str, Any]:
    """A picture, a question of one character and ``answer``, in TRL's vision format."""
    return {
        "messages": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "~"}]},
            {"role": "assistant", "content": answer},
        ],
        "images": [image],
    }


def _vision_overhead_tokens() -> int:
    """The tokens of a record with a one-character answer through the tiny LLaVA's processor."""
    from memfit.models.build import make_config
    from memfit.train.processor import tiny_processor

    processor = tiny_processor(make_config(TINY_MODELS["llava"]))
    text = processor.apply_chat_template(_vision_record("~", "")["messages"], tokenize=False)
    picture = _blank_picture()
    return len(processor(text=[text], images=[picture], add_special_tokens=False)["input_ids"][0])


def _blank_picture():
    from PIL import Image

    return Image.new("RGB", (56, 56))


def write_pairs(
    path: Path, *, seq_len: int, batch_size: int, grad_accum: int, steps: int, padded: bool, seed: int = 0
) -> Path:
    """A JSONL of text preference pairs whose micro-batches take the shapes the plan assumes
    (:func:`memfit.step.preference.longest_pairs`): every chosen and rejected sequence ``seq_len``
    tokens (BOS, a prompt and an answer of one-token characters, EOS), and with ``padded`` the
    rejected sequence of each micro-batch's last pair, in the order the trainer will draw them (same
    seed), a token shorter."""
    from memfit.train.data import BatchIterator

    count = batch_size * grad_accum * steps
    short = set()
    if padded:
        order = BatchIterator(list(range(count)), batch_size=batch_size, seed=seed)
        for _ in range(count // batch_size):
            short.add(next(order)[-1])
    rng = random.Random(f"memfit-conformance-pairs-{seed}")

    def text(n: int) -> str:
        return "".join(rng.choice(_ONE_TOKEN_CHARS) for _ in range(n))

    prompt_chars = (seq_len - 2) // 2
    with open(path, "w", encoding="utf-8") as handle:
        for index in range(count):
            answer = seq_len - 2 - prompt_chars
            chosen = text(answer)
            rejected = text(answer - (1 if index in short else 0))
            while rejected == chosen:
                rejected = text(len(rejected))
            handle.write(json.dumps({"prompt": text(prompt_chars), "chosen": chosen, "rejected": rejected}) + "\n")
    return path


def write_prompts(path: Path, *, budget: int, prompts: int, steps: int, seed: int = 0) -> Path:
    """A JSONL of grpo prompts whose generation batches take the shapes the plan assumes
    (:func:`memfit.planner.exact.generation.planned_prompts`): in the order the trainer will draw them
    (same seed), each step's first prompt the budget long in tokens (BOS and one-token characters), the
    others a token shorter, so that every generation batch is left-padded."""
    from memfit.train.data import BatchIterator

    count = prompts * steps
    order = BatchIterator(list(range(count)), batch_size=prompts, seed=seed)
    long = {next(order)[0] for _ in range(steps)}
    rng = random.Random(f"memfit-conformance-prompts-{seed}")
    with open(path, "w", encoding="utf-8") as handle:
        for index in range(count):
            chars = budget - 1 - (0 if index in long or prompts == 1 else 1)  # + BOS
            handle.write(json.dumps({"prompt": "".join(rng.choice(_ONE_TOKEN_CHARS) for _ in range(chars))}) + "\n")
    return path


def _quiet_console():
    from rich.console import Console

    return Console(stderr=True, quiet=True)
