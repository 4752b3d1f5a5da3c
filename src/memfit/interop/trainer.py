"""The Hugging Face Trainer's keys, shared by every tool that runs it.

Axolotl, LLaMA-Factory and TRL all train with ``transformers.Trainer``; what they pass it (an
optimizer name, a DeepSpeed JSON, an FSDP setting, Liger, bf16) means the same in each, and is
read here once. Names and defaults are transformers' ``TrainingArguments`` (5.x, with the 4.x
names still seen in configs).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from memfit.interop.deepspeed import DeepSpeedError, load_deepspeed, read_zero, shard_mode
from memfit.interop.keys import (
    ABSENT,
    Choices,
    KeyProblem,
    Planned,
    Rule,
    one_of,
    truthy,
    value_of,
)

_ADAMW = "adamw"
_NOT_ADAMW = "planned as AdamW (two fp32 states a trainable parameter)"


def _other(what: str) -> Planned:
    return Planned(_ADAMW, f"{what}: not an optimizer memfit plans; {_NOT_ADAMW}")


#: The Trainer's ``optim`` names, as memfit plans each: a memfit optimizer, or one planned in its place.
OPTIMIZERS: dict[str, Any] = {
    "adamw_torch_fused": _ADAMW,
    "adamw_torch": _ADAMW,  # foreach: adamw_impl_rule
    "adamw_hf": _ADAMW,
    "adamw_apex_fused": _ADAMW,
    "adamw_torch_xla": _ADAMW,
    "adamw_torch_npu_fused": _ADAMW,
    "adamw_anyprecision": Planned(
        _ADAMW, "AnyPrecisionAdamW keeps its states in the dtype it is given: planned as AdamW", modelled=True
    ),
    "adamw_bnb_8bit": "adamw8bit",
    "adamw_8bit": "adamw8bit",
    "paged_adamw_8bit": "paged-adamw8bit",
    "adamw_torch_8bit": Planned(
        "adamw8bit",
        "torchao's 8-bit AdamW: planned as bitsandbytes' (both keep two 8-bit states with block scales)",
        modelled=True,
    ),
    "adamw_torch_4bit": Planned(
        "adamw8bit", "torchao's 4-bit AdamW keeps half of 8-bit AdamW's states: planned as bitsandbytes' 8-bit AdamW"
    ),
    "paged_adamw_32bit": Planned(
        _ADAMW,
        "bitsandbytes' paged 32-bit AdamW keeps its states in CUDA unified memory: planned as AdamW on the device",
    ),
    "sgd": "sgd",
    "adafactor": _other("Adafactor (factored second moments)"),
    "adagrad": _other("Adagrad (one state)"),
    "rmsprop": _other("RMSprop (one state)"),
    "rmsprop_bnb": _other("bitsandbytes RMSprop"),
    "rmsprop_bnb_8bit": Planned(
        "adamw8bit", "bitsandbytes' 8-bit RMSprop (one 8-bit state): planned as 8-bit AdamW (two)"
    ),
    "rmsprop_bnb_32bit": _other("bitsandbytes' 32-bit RMSprop (one state)"),
    "lion_8bit": Planned("adamw8bit", "bitsandbytes' 8-bit Lion (one 8-bit state): planned as 8-bit AdamW (two)"),
    "lion_32bit": _other("Lion (one state)"),
    "paged_lion_8bit": Planned("paged-adamw8bit", "paged 8-bit Lion (one state): planned as paged 8-bit AdamW (two)"),
    "paged_lion_32bit": _other("paged Lion (one state, unified memory)"),
    "ademamix": _other("AdEMAMix (three states)"),
    "ademamix_8bit": Planned("adamw8bit", "8-bit AdEMAMix (three 8-bit states): planned as 8-bit AdamW (two)"),
    "paged_ademamix_8bit": Planned(
        "paged-adamw8bit", "paged 8-bit AdEMAMix (three states): planned as paged 8-bit AdamW (two)"
    ),
    "paged_ademamix_32bit": _other("paged AdEMAMix (three states, unified memory)"),
    "galore_adamw": _other("GaLore (low-rank projected states)"),
    "galore_adamw_8bit": _other("8-bit GaLore"),
    "galore_adafactor": _other("GaLore Adafactor"),
    "galore_adamw_layerwise": _other("layer-wise GaLore (optimizer step in backward)"),
    "galore_adamw_8bit_layerwise": _other("layer-wise 8-bit GaLore"),
    "galore_adafactor_layerwise": _other("layer-wise GaLore Adafactor"),
    "apollo_adamw": _other("APOLLO (low-rank projected states)"),
    "apollo_adamw_layerwise": _other("layer-wise APOLLO"),
    "lomo": _other("LOMO (fused update in backward, no states)"),
    "adalomo": _other("AdaLomo"),
    "grokadamw": _other("GrokAdamW"),
    "schedule_free_radam": _other("schedule-free RAdam"),
    "schedule_free_adamw": Planned(_ADAMW, "schedule-free AdamW keeps a third state (z): planned as AdamW"),
    "schedule_free_sgd": _other("schedule-free SGD"),
    "stable_adamw": Planned(_ADAMW, "StableAdamW keeps AdamW's two states", modelled=True),
}


def optimizer_rule(name: str, extra: Mapping[str, Any] | None = None, default: str = "adamw_torch_fused") -> Rule:
    """The optimizer key ``name`` (the Trainer's ``optim``; Axolotl's ``optimizer``), with a tool's
    own optimizers ``extra``. A DeepSpeed config with its own ``optimizer`` block wins, as in the
    Trainer (DeepSpeed builds that optimizer and ignores ``optim``)."""
    table = dict(OPTIMIZERS, **(extra or {}))
    read = one_of(table, "an optimizer name the Trainer knows")

    def resolve(values: Mapping[str, Any], ctx: Any) -> Any:
        if ctx.zero is not None and ctx.zero.optimizer_type:
            kind = ctx.zero.optimizer_type.lower()
            if kind in ("adam", "adamw", "fusedadam", "cpuadam", "deepspeedcpuadam"):
                return Planned(
                    _ADAMW,
                    f"DeepSpeed's {ctx.zero.optimizer_type} (from {ctx.zero.path}): AdamW's two fp32 states",
                    modelled=True,
                )
            return Planned(
                _ADAMW,
                f"DeepSpeed's {ctx.zero.optimizer_type} (from {ctx.zero.path}): not an optimizer memfit plans; {_NOT_ADAMW}",
            )
        return value_of(values, name, read, table[default])

    def write(value: str, values: Mapping[str, Any]) -> dict[str, Any]:
        # Keep the user's spelling where it already plans as the chosen optimizer.
        current = values.get(name, ABSENT)
        if current is not ABSENT and _planned_value(table.get(str(current).lower())) == value:
            return {}
        return {name: WRITE_OPTIMIZER[value]}

    return Rule(
        (name,),
        "optimizer",
        resolve,
        write,
        doc="the optimizer: AdamW variants as `adamw` (foreach AdamW's step temporary noted), bitsandbytes' 8-bit "
        "and paged 8-bit AdamW as `adamw8bit` / `paged-adamw8bit`, `sgd`; any other optimizer is planned as the "
        "closest one and listed",
    )


#: The Trainer's ``optim`` names that build ``torch.optim.AdamW`` without naming an implementation
#: (PyTorch runs foreach on CUDA); ``adamw_hf``, transformers' own AdamW, is now that one too.
FOREACH_OPTIMIZERS = ("adamw_torch", "adamw_hf")

#: The Trainer's default ``optim`` from torch 2.8 (``TrainingArguments``: ``adamw_torch`` before it).
TRAINER_DEFAULT_OPTIM = "adamw_torch_fused"


def adamw_impl_rule(name: str, tool_default: str | None = None) -> Rule:
    """The AdamW implementation the optimizer key ``name`` runs (the knob ``adamw_impl``): foreach for
    the Trainer's ``adamw_torch``, fused for ``adamw_torch_fused`` and DeepSpeed's FusedAdam. Without
    the key the Trainer's default is planned, and said: ``adamw_torch_fused`` since torch 2.8, which
    full fine-tuning feels (for adapters the difference is their own small size). ``tool_default``: a
    tool that sets the key itself when it is absent (Axolotl: ``adamw_torch_fused``), so that no
    version decides it."""

    def resolve(values: Mapping[str, Any], ctx: Any) -> Any:
        if ctx.knobs.get("optimizer", _ADAMW) != _ADAMW or (ctx.zero is not None and ctx.zero.optimizer_type):
            return None
        value = values[name]
        if (value is ABSENT or value is None) and tool_default is not None:
            value = tool_default
        if value is ABSENT or value is None:
            if ctx.knobs.get("method") != "full":
                return None
            return Planned(
                None,
                f"{name} not set: planned as the Trainer's default with torch 2.8 or later "
                f"({TRAINER_DEFAULT_OPTIM}); with an older torch the default is adamw_torch, PyTorch's foreach "
                f"AdamW, whose step holds a temporary as large as the trained parameters: set {name}: "
                "adamw_torch to plan that",
                modelled=True,
                key=name,
            )
        return "foreach" if str(value).lower() in FOREACH_OPTIMIZERS else None

    return Rule(
        (name,),
        "adamw_impl",
        resolve,
        doc="the AdamW implementation: `adamw_torch` (the Trainer's default before torch 2.8) as PyTorch's foreach "
        "AdamW (`adamw_impl: foreach`, a step temporary as large as the trained parameters), the fused ones as "
        "`fused`; unset, the default of torch 2.8 and later (`adamw_torch_fused`) is planned and said",
    )


#: The Trainer's name for each memfit optimizer (``memfit fit --write``).
WRITE_OPTIMIZER = {
    "adamw": "adamw_torch_fused",
    "adamw8bit": "adamw_bnb_8bit",
    "paged-adamw8bit": "paged_adamw_8bit",
    "sgd": "sgd",
}


def _planned_value(entry: Any) -> Any:
    return entry.value if isinstance(entry, Planned) else entry


def deepspeed_rule(name: str = "deepspeed") -> Rule:
    """The DeepSpeed JSON a config names (a path relative to the config, then to the working
    directory; or inline): its ZeRO stage is the shard mode, and its settings go to the planner."""

    def resolve(values: Mapping[str, Any], ctx: Any) -> Any:
        value = values[name]
        if value is ABSENT or value is None or (isinstance(value, str) and not value.strip()):
            return None
        try:
            data, where = load_deepspeed(value, ctx.folder)
            ctx.zero = read_zero(data, where)
        except DeepSpeedError as err:
            raise KeyProblem(name, str(err)) from None
        for key, setting, why in ctx.zero.unmodelled:
            ctx.not_modelled_found(f"{name}: {key}", setting, why)
        for key in ctx.zero.unknown:
            ctx.unknown_keys.append(f"{name}: {key}")
        return shard_mode(ctx.zero)

    return Rule(
        (name,),
        "shard",
        resolve,
        doc="a DeepSpeed JSON (relative to the config, then to the working directory): ZeRO stage 1, 2, 3 as "
        "`zero1`, `zero2`, `zero3` (stage 3 with parameters and optimizer offloaded as `fsdp-offload`), optimizer "
        "offload, and the bucket sizes (`reduce_bucket_size`, `allgather_bucket_size`, "
        '`stage3_prefetch_bucket_size`, "auto" resolved as transformers resolves it) as named buffers per GPU',
    )


def fsdp_shard(value: Any, fsdp_config: Any, version: Any = ABSENT) -> Any:
    """memfit's shard mode for the Trainer's ``fsdp`` (``"full_shard auto_wrap offload"`` or a list)
    and ``fsdp_config``; None without FSDP."""
    if value is ABSENT or value is None or value is False or value == "" or value == []:
        return None
    if value is True:
        words = ["full_shard"]
    elif isinstance(value, str):
        words = value.split()
    elif isinstance(value, (list, tuple)):
        words = [str(w) for w in value]
    else:
        raise ValueError(f'{value!r} is not an FSDP setting (e.g. "full_shard auto_wrap")')
    known = {"full_shard", "shard_grad_op", "hybrid_shard", "hybrid_shard_zero2", "no_shard", "offload", "auto_wrap"}
    bad = [w for w in words if w.lower() not in known]
    if bad:
        raise ValueError(
            f"{bad[0]!r} is not an FSDP option (full_shard, shard_grad_op, hybrid_shard, hybrid_shard_zero2, "
            "no_shard, offload, auto_wrap)"
        )
    words = [w.lower() for w in words]
    config = fsdp_config if isinstance(fsdp_config, Mapping) else {}
    offload = "offload" in words or truthy(config.get("offload_params", config.get("fsdp_offload_params", False)))
    reshard = config.get("reshard_after_forward", config.get("fsdp_reshard_after_forward", True))
    strategy = str(config.get("sharding_strategy", config.get("fsdp_sharding_strategy", ""))).upper()
    if "no_shard" in words or strategy == "NO_SHARD":
        return "ddp"
    if offload:
        return "fsdp-offload"
    if (
        "shard_grad_op" in words
        or "hybrid_shard_zero2" in words
        or strategy == "SHARD_GRAD_OP"
        or reshard in (False, "false")
    ):
        return Planned(
            "zero2",
            "FSDP without resharding after forward (SHARD_GRAD_OP): weights whole through the step, "
            "gradients and optimizer states sharded: planned as zero2",
            modelled=True,
        )
    if "hybrid_shard" in words or strategy == "HYBRID_SHARD":
        return Planned(
            "fsdp",
            "hybrid sharding shards within a node and replicates across nodes: planned as fsdp over the "
            "GPUs given (--gpus: the GPUs of one node)",
            modelled=True,
        )
    return "fsdp"


def liger_loss(on: bool, fused_linear: Any = ABSENT) -> Any:
    """``hf_loss`` for Liger Kernel switched on (``use_liger_kernel``): its fused linear
    cross-entropy, unless the config turns that kernel off."""
    if not on:
        return None
    if fused_linear is not ABSENT and not truthy(fused_linear):
        return None
    return "liger"


#: The Trainer's keys that do not decide a step's memory (transformers 5.x, and 4.x names).
TRAINER_QUIET_KEYS = frozenset(
    """
accelerator_config adam_beta1 adam_beta2 adam_epsilon auto_find_batch_size average_tokens_across_devices batch_eval_metrics
bf16_full_eval data_seed dataloader_drop_last dataloader_in_order dataloader_multiprocessing_context dataloader_num_workers
dataloader_persistent_workers dataloader_pin_memory dataloader_prefetch_factor ddp_backend ddp_broadcast_buffers
ddp_bucket_cap_mb ddp_find_unused_parameters ddp_static_graph ddp_timeout debug disable_tqdm do_eval do_predict do_train
enable_jit_checkpoint eval_accumulation_steps eval_delay eval_do_concat_batches eval_on_start eval_steps eval_strategy
eval_use_gather_object fp16_full_eval full_determinism generation_config generation_max_length generation_num_beams
greater_is_better hub_always_push hub_model_id hub_private_repo hub_revision hub_strategy hub_token ignore_data_skip
include_for_metrics include_num_input_tokens_seen label_names label_smoothing_factor learning_rate length_column_name
load_best_model_at_end local_rank log_level log_level_replica log_on_each_node logging_first_step logging_nan_inf_filter
logging_steps logging_strategy lr_scheduler_kwargs lr_scheduler_type max_steps metric_for_best_model neftune_noise_alpha
num_train_epochs optim_args output_dir per_device_eval_batch_size predict_with_generate prediction_loss_only project
push_to_hub remove_unused_columns report_to restore_callback_states_from_checkpoint resume_from_checkpoint run_name
save_on_each_node save_only_model save_steps save_strategy save_total_limit seed skip_memory_metrics sortish_sampler tf32
torch_compile_backend torch_compile_mode torch_empty_cache_steps trackio_bucket_id trackio_space_id trackio_static_space_id
train_sampling_strategy use_cache use_cpu warmup_steps weight_decay
overwrite_output_dir evaluation_strategy per_gpu_train_batch_size per_gpu_eval_batch_size logging_dir no_cuda use_mps_device
group_by_length fp16_opt_level fp16_backend half_precision_backend save_safetensors jit_mode_eval use_ipex torchdynamo
ray_scope push_to_hub_model_id push_to_hub_organization push_to_hub_token include_tokens_per_second warmup_ratio
tpu_num_cores tpu_metrics_debug past_index use_legacy_prediction_loop xpu_backend mp_parameters split_batches
include_inputs_for_metrics dispatch_batches gradient_checkpointing_use_reentrant adafactor
eval_batch_size logging_steps save_steps eval_steps hub_model_id
""".split()
)


#: The Trainer's ``lr_scheduler_type`` names: transformers' ``SchedulerType`` (``trainer_utils.py``, 5.24).
LR_SCHEDULERS = (
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "constant_with_warmup",
    "inverse_sqrt",
    "reduce_lr_on_plateau",
    "cosine_with_min_lr",
    "cosine_warmup_with_min_lr",
    "warmup_stable_decay",
    "greedy",
)


def lr_scheduler_choices(
    key: str = "lr_scheduler_type", tool: str = "the Trainer", extra: tuple[str, ...] = ()
) -> Choices:
    """``key`` takes the Trainer's schedulers (and a tool's own, ``extra``): another name is refused
    as the Trainer refuses it (``SchedulerType(value)``), though a schedule decides no memory."""
    source = "transformers 5.24's `SchedulerType`" + (
        f", and {tool}'s own {', '.join(f'`{e}`' for e in extra)}" if extra else ""
    )
    return Choices(
        key,
        LR_SCHEDULERS + extra,
        f"a learning-rate scheduler {tool} knows",
        source,
        doc=f"the Trainer's schedulers ({source}: `linear`, `cosine`...)",
    )


#: Attention implementations by name (transformers' ``attn_implementation`` and the tools' own
#: spellings) -> what memfit plans: flash attention's varlen path (``padding_free: on``: each
#: example's attention on its own tokens, no [seq x seq] mask), or SDPA with padded batches (None).
ATTENTION: dict[str, Any] = {
    "flash_attention_2": "on",
    "flash_attention_3": "on",
    "fa2": "on",
    "fa3": "on",
    "kernels-community/flash-attn2": "on",
    "kernels-community/flash-attn3": "on",
    "kernels-community/vllm-flash-attn3": "on",
    "xformers": Planned(
        "on", "xformers' memory-efficient attention: planned as flash attention (no [seq x seq] scores)", modelled=True
    ),
    "sage": Planned("on", "SageAttention: planned as flash attention (no [seq x seq] scores)", modelled=True),
    "flex_attention": Planned(
        "on", "FlexAttention with a block mask: planned as flash attention (no [seq x seq] scores)", modelled=True
    ),
    "sdpa": None,
    "auto": Planned(None, "attention chosen at run time: planned as SDPA with padded batches", modelled=True),
    "eager": Planned(
        None,
        "eager attention materialises the [batch x heads x seq x seq] scores and keeps their softmax "
        "for backward: planned as SDPA",
    ),
    "disabled": Planned(
        None,
        "eager attention materialises the [batch x heads x seq x seq] scores and keeps their softmax "
        "for backward: planned as SDPA",
    ),
}


def attention(value: Any) -> Any:
    """``padding_free`` for an attention implementation's name (see :data:`ATTENTION`; transformers'
    ``paged|`` prefix, paged KV caches for generation, changes nothing in training)."""
    name = str(value).strip().removeprefix("paged|")
    if name.lower() in ATTENTION:
        return ATTENTION[name.lower()]
    if "flash" in name.lower():  # a Hub kernel of flash attention (kernels-community/...)
        return "on"
    raise ValueError(
        f"{value!r} is not an attention implementation (flash_attention_2, sdpa, eager, flex_attention...)"
    )
