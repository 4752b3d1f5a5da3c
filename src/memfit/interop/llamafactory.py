"""LLaMA-Factory's YAML (``llamafactory-cli train config.yaml``): its key map.

Keys and defaults from ``src/llamafactory/hparams/`` at ff6d4d1 (2026-08), with the Hugging Face
``Seq2SeqTrainingArguments`` it extends. LLaMA-Factory loads the checkpoint's dtype (bf16 for the
models of today; ``model/loader.py``) and computes in bf16 or fp16 (``bf16``, ``fp16``, or the one it
infers), turns gradient checkpointing on unless told not to, and casts the trained parameters to
fp32 unless ``pure_bf16`` (``model/adapter.py``): a full fine-tuning under ``bf16`` is mixed
precision (``bf16-mixed``), LoRA a 16-bit base with fp32 adapters. It trains with the Hugging
Face step, so the config is planned with the ``hf`` recipe.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from memfit.interop.common import (
    ROUTING_DOC,
    bool_rule,
    dora_rule,
    int_rule,
    model_rule,
    modules_to_save_rule,
    revision_rule,
    rslora_rule,
    targets_rule,
)
from memfit.interop.keys import (
    ABSENT,
    Choices,
    Found,
    KeyMap,
    KeyProblem,
    Planned,
    Rule,
    as_bool,
    as_float,
    as_int,
    not_modelled,
    one_of,
    truthy,
    value_of,
)
from memfit.interop.precision import settle_zero_precision, trainer_precision, zero_half
from memfit.interop.trainer import (
    TRAINER_QUIET_KEYS,
    adamw_impl_rule,
    attention,
    deepspeed_rule,
    fsdp_shard,
    liger_loss,
    lr_scheduler_choices,
    optimizer_rule,
)

_TYPES = one_of(
    {
        "lora": "lora",
        "full": "full",
        "freeze": Planned(
            "full",
            "freeze tuning trains the last layers only (freeze_trainable_layers): planned as full "
            "fine-tuning of every layer",
        ),
        "oft": Planned("lora", "OFT (orthogonal adapters): planned as LoRA adapters"),
    },
    "a finetuning_type LLaMA-Factory knows",
)


def _method(values: Mapping[str, Any], ctx: Any) -> Any:
    kind = value_of(values, "finetuning_type", _TYPES, "lora")
    # null (as `memfit fit --write` turns a quantized base off) is no quantization, like an absent key
    bits = value_of(values, "quantization_bit", as_int, None) if values["quantization_bit"] is not None else None
    how = str(values["quantization_method"]).lower() if values["quantization_method"] not in (ABSENT, None) else "bnb"
    if bits is None:
        return kind
    if bits not in (2, 3, 4, 5, 6, 8):
        raise KeyProblem("quantization_bit", f"{bits} is not a bit width LLaMA-Factory quantizes to (2, 3, 4, 5, 6, 8)")
    base = kind.value if isinstance(kind, Planned) else kind
    if base == "full":
        raise KeyProblem(
            "quantization_bit", "needs finetuning_type: lora (or oft): a quantized model is trained through adapters"
        )
    if bits == 4 and how in ("bnb", "bitsandbytes"):
        return "qlora"
    if bits == 8 and how in ("bnb", "bitsandbytes"):
        return "lora-8bit"
    return Planned("lora", f"a {bits}-bit base ({how}): planned as a 16-bit base")


def _write_method(method: str, values: Mapping[str, Any]) -> dict[str, Any]:
    if method == "qlora":
        return {"finetuning_type": "lora", "quantization_bit": 4}
    if method == "lora-8bit":
        return {"finetuning_type": "lora", "quantization_bit": 8}
    return {"finetuning_type": method, "quantization_bit": None}


def _moe_aux_loss(values: Mapping[str, Any], ctx: Any) -> Any:
    """``moe_aux_loss_coef``: LLaMA-Factory turns the MoE model's router logits on for training and sets
    its ``router_aux_loss_coef`` (``model/model_utils/moe.py``: ``configure_moe``); unset or 0: as the
    model's config says."""
    coef = value_of(values, "moe_aux_loss_coef", as_float, None)
    if not coef:
        return None
    if coef < 0:
        raise KeyProblem("moe_aux_loss_coef", f"{coef} is not a coefficient (a number of 0 or more)")
    return {"output_router_logits": True, "router_aux_loss_coef": coef}


def _checkpointing(values: Mapping[str, Any], ctx: Any) -> Any:
    if value_of(values, "disable_gradient_checkpointing", as_bool, False):
        return "off"
    if value_of(values, "use_unsloth_gc", as_bool, False):
        return Planned(
            "offload",
            "Unsloth's offloaded checkpointing (layer inputs in host memory): planned as transformers' "
            "offloaded checkpointing",
            modelled=True,
        )
    return "on"  # LLaMA-Factory enables it unless disable_gradient_checkpointing


def _write_checkpointing(value: str, values: Mapping[str, Any]) -> dict[str, Any]:
    return {"disable_gradient_checkpointing": value == "off", "use_unsloth_gc": value == "offload"}


def _use_reentrant(values: Mapping[str, Any], ctx: Any) -> Any:
    if ctx.knobs.get("checkpointing") != "on":
        return None
    return "on" if value_of(values, "use_reentrant_gc", as_bool, True) else "off"  # LLaMA-Factory's default: true


def _precision(values: Mapping[str, Any], ctx: Any) -> Any:
    method = ctx.knobs.get("method", "lora")
    pure = value_of(values, "pure_bf16", as_bool, False)
    bf16 = value_of(values, "bf16", as_bool, False)
    fp16 = value_of(values, "fp16", as_bool, False)
    half = "bf16" if bf16 else "fp16" if fp16 else None  # the Trainer's autocast
    settle_zero_precision(ctx, half)
    zero3 = ctx.zero is not None and ctx.zero.stage == 3
    if pure and zero3:
        raise KeyProblem(
            "pure_bf16",
            f"true cannot be used with DeepSpeed ZeRO-3 ({ctx.zero.path}): LLaMA-Factory refuses "
            "the pair; drop pure_bf16 (ZeRO-3 keeps fp32 master weights anyway) or use stage 2",
        )
    compute = "bf16" if bf16 or pure else "fp16" if fp16 else None
    # model/adapter.py: the trained parameters are cast to fp32 unless pure_bf16 or BAdam, or (a
    # model that is not quantized) under ZeRO-3, whose fp32 partitions are the master copy.
    badam = truthy(ctx.raw.get("use_badam", False))
    cast = not (pure or badam or (zero3 and method != "qlora"))
    weights = compute or "bf16"
    if method == "full" and cast:
        weights = "fp32"
    elif method == "lora" and pure:
        ctx.approximated.append(
            Found(
                "pure_bf16",
                True,
                "pure_bf16 leaves LoRA's adapters as PEFT makes them: fp32 since PEFT 0.12 "
                "(autocast_adapter_dtype, which LLaMA-Factory leaves on), bf16 before: planned as fp32 adapters "
                "(adapter_dtype: compute plans bf16 ones)",
                "precision",
            )
        )
    if compute is None and method != "full" and zero_half(ctx) is None:
        return Planned(
            "bf16",
            "no bf16 or fp16: LLaMA-Factory computes in the dtype it infers (bf16 on GPUs that have it) "
            "on the checkpoint's: planned as bf16",
            modelled=True,
        )
    return trainer_precision(method, weights, half, ctx, where="the checkpoint's dtype")


def _padding_free(values: Mapping[str, Any], ctx: Any) -> Any:
    return attention(values["flash_attn"] if values["flash_attn"] not in (ABSENT, None) else "auto")


def _packing(values: Mapping[str, Any], ctx: Any) -> Any:
    if value_of(values, "neat_packing", as_bool, False):
        return True
    packing = value_of(values, "packing", as_bool, None)
    if packing is None and str(values["stage"]).lower() == "pt":
        return True  # pre-training packs by default
    return packing


def _objective(values: Mapping[str, Any], ctx: Any) -> Any:
    """``stage: dpo`` by its ``pref_loss``: orpo and simpo as such, DPO's losses (sigmoid, hinge, ipo,
    kto_pair) as dpo (LLaMA-Factory's reference: the base with the adapters disabled for LoRA, a
    copy of the model for full fine-tuning)."""
    stage = str(values["stage"]).lower() if values["stage"] not in (ABSENT, None) else "sft"
    if stage in ("sft", "pt"):
        return None
    if stage != "dpo":
        return Planned(
            None,
            f"stage: {stage} trains with another trainer (reward or value models, unpaired examples): "
            "planned as supervised fine-tuning",
        )
    loss = str(values["pref_loss"]).lower() if values["pref_loss"] not in (ABSENT, None) else "sigmoid"
    return {"orpo": "orpo", "simpo": "simpo"}.get(loss, "dpo")


def _stage_matters(values: Mapping[str, Any]) -> bool:
    return str(values["stage"]).lower() not in ("sft", "pt") if values["stage"] not in (ABSENT, None) else False


def _dropout(value: Any) -> float:
    number = float(value) if not isinstance(value, bool) else -1.0
    if not 0.0 <= number < 1.0:
        raise ValueError(f"{value!r} must be in [0, 1)")
    return number


def _max_grad_norm(values: Mapping[str, Any], ctx: Any) -> Any:
    value = values["max_grad_norm"]
    if value is ABSENT:
        return 1.0
    if value in (None, 0, 0.0):
        return "none"
    return as_float(value)


def _fsdp(values: Mapping[str, Any], ctx: Any) -> Any:
    fsdp = values["fsdp"]
    if fsdp in (ABSENT, None, "", []):
        return None
    if ctx.knobs.get("shard") is not None:
        raise KeyProblem("fsdp", "set together with deepspeed: a run shards with one of them; drop one")
    try:
        return fsdp_shard(fsdp, values["fsdp_config"])
    except ValueError as err:
        raise KeyProblem("fsdp", str(err)) from None


RULES: tuple[Rule, ...] = (
    model_rule("model_name_or_path"),
    revision_rule("model_revision"),
    deepspeed_rule(),
    Rule(
        ("fsdp", "fsdp_config"),
        "shard",
        _fsdp,
        doc="FSDP through the Trainer's `fsdp` (LLaMA-Factory's accelerate configs are not read)",
    ),
    Rule(
        ("finetuning_type", "quantization_bit", "quantization_method"),
        "method",
        _method,
        _write_method,
        doc="the method: `finetuning_type` (LLaMA-Factory's default lora; freeze planned as full, oft as lora), "
        "`quantization_bit: 4` with bitsandbytes `qlora`, `quantization_bit: 8` `lora-8bit` (LLM.int8); other bit "
        "widths planned as a 16-bit base and listed",
    ),
    Rule(
        ("quantization_bit",),
        "kbit_upcast",
        lambda v, ctx: False if ctx.knobs.get("method") in ("qlora", "lora-8bit") else None,
        doc="LLaMA-Factory quantizes without PEFT's prepare_model_for_kbit_training: the parameters that are not quantized "
        "stay in the compute dtype",
    ),
    not_modelled("upcast_layernorm", why="norm weights upcast to fp32 (a few MiB)"),
    Rule(
        ("moe_aux_loss_coef",),
        "model_config",
        _moe_aux_loss,
        doc=ROUTING_DOC
        + ": `moe_aux_loss_coef` turns router logits on and sets the coefficient, as LLaMA-Factory does",
    ),
    int_rule("lora_rank", "rank", 8, doc="LoRA rank (LLaMA-Factory's default 8)"),
    Rule(
        ("lora_alpha",),
        "alpha",
        lambda v, ctx: value_of(v, "lora_alpha", as_float, None),
        doc="LoRA alpha (default 2 x rank)",
    ),
    Rule(("lora_dropout",), "dropout", lambda v, ctx: value_of(v, "lora_dropout", _dropout, None), doc="LoRA dropout"),
    targets_rule(
        None, "lora_target", doc="LoRA targets: `all` (the default) is every linear layer, or the modules listed"
    ),
    modules_to_save_rule("additional_target"),
    dora_rule("use_dora"),
    rslora_rule("use_rslora"),
    int_rule("cutoff_len", "seq_len", 2048, doc="tokens per sequence (default 2048); memfit plans the longest"),
    # Vision-language models (docs/vlm.md)
    int_rule(
        "image_max_pixels",
        "image_max_pixels",
        doc="the most pixels an image keeps (LLaMA-Factory's default 768 x 768 is memfit's)",
    ),
    bool_rule(
        "freeze_vision_tower",
        "freeze_vision",
        doc="the vision tower frozen (the default); false trains it, with its projector",
    ),
    not_modelled(
        "freeze_multi_modal_projector",
        why="a projector trained while the tower stays frozen: memfit freezes or trains the tower and the projector "
        "together (freeze_vision)",
        when=lambda v: not truthy(v),
    ),
    int_rule(
        "per_device_train_batch_size",
        "batch_size",
        8,
        doc="sequences per GPU in one forward pass (the Trainer's default 8)",
    ),
    int_rule("gradient_accumulation_steps", "grad_accum", 1, doc="micro-batches per optimizer step"),
    Rule(
        ("disable_gradient_checkpointing", "use_unsloth_gc"),
        "checkpointing",
        _checkpointing,
        _write_checkpointing,
        doc="checkpointing `on` unless `disable_gradient_checkpointing`; `use_unsloth_gc` as `offload`",
    ),
    Rule(
        ("use_reentrant_gc",),
        "use_reentrant",
        _use_reentrant,
        doc="the hf recipe's `use_reentrant` (`on` unless `use_reentrant_gc: false`): reentrant checkpointing runs each "
        "layer's forward under no_grad, so LLM.int8 layers keep no inputs of their own",
    ),
    optimizer_rule("optim"),
    adamw_impl_rule("optim"),
    Rule(
        ("bf16", "fp16", "pure_bf16"),
        "precision",
        _precision,
        doc="`bf16` / `fp16`: LoRA on a 16-bit base with fp32 adapters; full fine-tuning as `bf16-mixed` / `fp16-mixed` "
        "(LLaMA-Factory casts the trained parameters to fp32), without either as `fp32`; `pure_bf16` as `bf16` "
        "(pure: weights, gradients and AdamW states in bf16; under DeepSpeed ZeRO-1 or 2, whose fp32 partitions are "
        "master weights, `bf16-mixed`; with ZeRO-3 refused, as LLaMA-Factory refuses it)",
    ),
    Rule(("max_grad_norm",), "max_grad_norm", _max_grad_norm, doc="gradient clipping (0 or null: none)"),
    Rule(
        ("flash_attn",),
        "padding_free",
        _padding_free,
        doc="`flash_attn: fa2` / `fa3` as `padding_free: on` (no [seq x seq] mask); `sdpa`, and `auto` (chosen at run "
        "time), as padded batches; `disabled` (eager) listed",
    ),
    Rule(
        ("packing", "neat_packing", "stage"),
        "packing",
        _packing,
        doc="packed rows of `cutoff_len` tokens (`packing`, `neat_packing`; pre-training packs by default)",
    ),
    Rule(
        ("enable_liger_kernel", "use_liger_kernel"),
        "hf_loss",
        lambda v, ctx: liger_loss(
            value_of(v, "enable_liger_kernel", as_bool, False) or value_of(v, "use_liger_kernel", as_bool, False)
        ),
        doc="Liger Kernel: its fused linear cross-entropy as `hf_loss: liger`",
    ),
    Rule(
        ("stage", "pref_loss"),
        "objective",
        _objective,
        matters=_stage_matters,
        unmodelled="a stage other than supervised fine-tuning (dpo, kto, rm, ppo): preference pairs, a reference or value "
        "model; planned as supervised fine-tuning",
        doc="`stage: dpo` is preference training: `pref_loss` orpo and simpo as such, DPO's losses (sigmoid, hinge, ipo, "
        "kto_pair) as `dpo`; other stages (kto, rm, ppo) listed and planned as supervised fine-tuning; "
        "`per_device_train_batch_size` counts pairs",
    ),
    not_modelled(
        "ref_model",
        why="a reference model of its own beside the policy (a second model in memory): planned with "
        "the reference memfit takes (the disabled adapters, or a frozen copy)",
    ),
    not_modelled("use_unsloth", why="Unsloth's kernels and its own step"),
    not_modelled(
        "use_galore",
        "use_apollo",
        "use_badam",
        "use_adam_mini",
        "use_muon",
        why="an optimizer memfit does not plan (projected, block-wise or per-layer states): planned as the optim named",
    ),
    not_modelled(
        "mixture_of_depths",
        "shift_attn",
        "use_llama_pro",
        "train_from_scratch",
        why="changes the model or which layers run",
    ),
    not_modelled("rope_scaling", why="changes the model's config.json, which is planned as published"),
    not_modelled(
        "use_kt",
        "use_mca",
        "use_megatron_bridge",
        "use_hyper_parallel",
        "use_v1_kernels",
        "fp8",
        why="another trainer or kernels (KTransformers, Megatron, fp8)",
    ),
    not_modelled("torch_compile", why="a compiled step fuses kernels and keeps other tensors for backward"),
    not_modelled("optim_target_modules", why="GaLore / APOLLO projected optimizer states on these modules"),
)

#: LLaMA-Factory's own arguments (``hparams/``), beside the Trainer's.
_OWN_KEYS = frozenset(
    """
adapter_folder adapter_name_or_path add_special_tokens add_tokens additional_target apollo_layerwise apollo_proj
apollo_proj_type apollo_rank apollo_scale apollo_scale_front apollo_scale_type apollo_target apollo_update_interval asft_alpha
audio_sampling_rate badam_mask_mode badam_mode badam_start_block badam_switch_interval badam_switch_mode badam_update_ratio
badam_verbose batch_size block_diag_attn buffer_size cache_dir compute_accuracy compute_dtype create_new_adapter
crop_to_patches cutoff_len data_shared_file_system dataset dataset_dir default_system device_map disable_gradient_checkpointing
disable_shuffling do_sample double_quantization download_mode dpo_label_smoothing eaft_alpha early_stopping_steps
enable_liger_kernel enable_thinking enable_torch_profiler eval_dataset eval_num_beams eval_on_each_dataset export_device
export_dir export_hub_model_id export_legacy_format export_quantization_bit export_quantization_dataset
export_quantization_maxlen export_quantization_nsamples export_size finetuning_type flash_attn fp8 fp8_backend
fp8_enable_fsdp_float8_all_gather freeze_extra_modules freeze_language_model freeze_multi_modal_projector
freeze_trainable_layers freeze_trainable_modules freeze_vision_tower galore_layerwise galore_proj_type galore_rank galore_scale
galore_target galore_update_interval hf_hub_token hyper_parallel_args hyper_parallel_cp_size ignore_pad_token_for_loss
image_do_pan_and_scan image_max_pixels image_min_pixels include_effective_tokens_per_second infer_backend infer_dtype
init_special_tokens interleave_probs kt_cpu_activation kt_expert_checkpoint_path kt_lora_expert_intermediate_size
kt_lora_expert_num kt_non_expert_weight_path kt_use_lora_experts kt_weight_path kto_chosen_weight kto_rejected_weight lang
ld_alpha length_penalty lora_alpha lora_dropout lora_rank lora_target loraplus_lr_embedding loraplus_lr_ratio
low_cpu_mem_usage mask_history master_addr master_port max_length max_new_tokens max_samples media_dir megatron_bridge_args
mix_strategy mixture_of_depths model_max_length model_name_or_path model_revision module_dropout moe_aux_loss_coef
ms_hub_token n_shot neat_packing new_special_tokens_config num_beams offload_folder oft_block_size oft_rank oft_target
om_hub_token overwrite_cache overwrite_output_dir packing pissa_convert pissa_init pissa_iter plot_loss ppo_buffer_size
ppo_epochs ppo_score_norm ppo_target ppo_whiten_rewards pref_bco_weight pref_beta pref_ftx pref_loss preprocessing_batch_size
preprocessing_num_workers preserve_thinking print_param_status profile_modules profiler_active_steps profiler_output_dir
profiler_profile_memory profiler_record_shapes profiler_repeat profiler_wait_steps profiler_warmup_steps profiler_with_stack
pure_bf16 quantization_bit quantization_device_map quantization_method quantization_type ray_init_kwargs ray_num_workers
ref_model ref_model_adapters ref_model_quantization_bit repetition_penalty resize_vocab reward_model reward_model_adapters
reward_model_quantization_bit reward_model_type rope_scaling save_dir seed sglang_config sglang_lora_backend sglang_maxlen
sglang_mem_fraction sglang_tp_size shift_attn simpo_gamma skip_special_tokens split_special_tokens stage streaming
swanlab_api_key swanlab_lark_secret swanlab_lark_webhook_url swanlab_logdir swanlab_mode swanlab_project swanlab_run_name
swanlab_workspace task task_dir temperature template tokenized_path tool_format top_k top_p train_from_scratch train_on_prompt
trust_remote_code upcast_layernorm upcast_lmhead_output use_adam_mini use_apollo use_asft_loss use_audio_in_video use_badam
use_dft_loss use_dora use_eaft_loss use_fast_tokenizer use_galore use_hyper_parallel use_kt use_kv_cache use_llama_pro use_mca
use_megatron_bridge use_muon use_reentrant_gc use_rslora use_swanlab use_unsloth use_unsloth_gc use_v1_kernels val_size
video_fps video_max_pixels video_maxlen video_min_pixels vllm_config vllm_enforce_eager vllm_gpu_util vllm_max_lora_rank
vllm_maxlen
""".split()
)

ALL_KEYS = (
    _OWN_KEYS
    | TRAINER_QUIET_KEYS
    | frozenset(k for rule in RULES for k in rule.keys)
    | frozenset(
        {
            "deepspeed",
            "fsdp",
            "fsdp_config",
            "optim",
            "bf16",
            "fp16",
            "max_grad_norm",
            "per_device_train_batch_size",
            "gradient_accumulation_steps",
            "torch_compile",
            "optim_target_modules",
            "gradient_checkpointing_kwargs",
            "use_liger_kernel",
        }
    )
)

#: Keys whose values LLaMA-Factory checks against names (``hparams/`` and ``extras/constants.py`` at ff6d4d1).
CHOICES: tuple[Choices, ...] = (
    Choices(
        "stage",
        ("pt", "sft", "rm", "ppo", "dpo", "kto"),
        "a stage LLaMA-Factory knows",
        "LLaMA-Factory's `FinetuningArguments.stage`, ff6d4d1",
    ),
    Choices(
        "pref_loss",
        ("sigmoid", "hinge", "ipo", "kto_pair", "orpo", "simpo"),
        "a pref_loss LLaMA-Factory knows",
        "LLaMA-Factory's `RLHFArguments.pref_loss`, ff6d4d1",
    ),
    Choices(
        "flash_attn",
        ("auto", "disabled", "sdpa", "fa2", "fa3"),
        "an attention LLaMA-Factory knows",
        "LLaMA-Factory's `AttentionFunction`, ff6d4d1",
    ),
    Choices(
        "quantization_method",
        ("bnb", "gptq", "awq", "aqlm", "quanto", "eetq", "hqq", "mxfp4", "fp8"),
        "a quantization method LLaMA-Factory knows",
        "LLaMA-Factory's `QuantizationMethod`, ff6d4d1",
    ),
    lr_scheduler_choices(),
)

KEYMAP = KeyMap(
    tool="llama-factory",
    title="LLaMA-Factory",
    rules=RULES,
    quiet_keys=ALL_KEYS - frozenset(k for rule in RULES for k in rule.keys),
    docs_url="https://llamafactory.readthedocs.io/en/latest/advanced/arguments.html",
    choices=CHOICES,
)
