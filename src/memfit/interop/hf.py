"""A YAML or JSON of Hugging Face ``TrainingArguments``, TRL ``SFTConfig`` / ``DPOConfig`` arguments
and TRL's model arguments (``ModelConfig``: ``model_name_or_path``, ``use_peft``, ``lora_r``,
``load_in_4bit``...), as ``trl sft --config`` and scripts built on ``HfArgumentParser`` read it.

Keys and defaults from transformers' ``TrainingArguments`` (5.x) and TRL's ``trainer/*_config.py``
and ``scripts/utils.py`` at f2cd577 (2026-07). TRL's defaults apply where TRL has one (gradient
checkpointing on, bf16 unless fp16, ``max_length`` 1024, the model loaded in float32); TRL runs the
Hugging Face step, so the config is planned with the ``hf`` recipe.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from memfit.interop import grpo
from memfit.interop.common import (
    dora_rule,
    int_rule,
    model_rule,
    modules_to_save_rule,
    revision_rule,
    routing_rule,
    rslora_rule,
    targets_rule,
    use_reentrant_of,
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
    as_names,
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

GRPO_ONLY_KEYS = grpo.GRPO_ONLY_KEYS

#: TRL's own keys (ModelConfig, SFTConfig, DPOConfig, ScriptArguments; with names of TRL 0.x).
TRL_KEYS = frozenset(
    """
model_name_or_path model_revision dtype torch_dtype attn_implementation use_peft lora_r lora_alpha lora_dropout
lora_target_modules lora_target_parameters lora_modules_to_save lora_task_type use_rslora use_dora load_in_4bit load_in_8bit
bnb_4bit_quant_type bnb_4bit_quant_storage use_bnb_nested_quant trust_remote_code model_init_kwargs ref_model_init_kwargs
dataset_name dataset_config dataset_train_split dataset_test_split dataset_streaming datasets dataset_text_field
dataset_kwargs dataset_num_proc dataset_batch_size gradient_checkpointing_use_reentrant ignore_bias_buffers
max_length max_seq_length max_prompt_length max_completion_length packing packing_strategy padding_free eval_packing
pad_to_multiple_of pad_token eos_token completion_only_loss assistant_only_loss loss_type activation_offloading
chat_template_path shuffle_dataset truncation_mode router_aux_loss_coef beta label_smoothing loss_weights
precompute_ref_log_probs precompute_ref_batch_size ref_model_mixup_alpha ref_model_sync_steps sync_ref_model rpo_alpha
use_weighting discopop_tau f_alpha_divergence_coef f_divergence_type ld_alpha disable_dropout model_adapter_name
ref_adapter_name force_use_ref_model generate_during_eval use_logits_to_keep num_of_sequences chars_per_token env
use_liger_kernel liger_kernel_config simpo_gamma cpo_alpha temperature top_p top_k
""".split()
) | frozenset(GRPO_ONLY_KEYS)

#: Keys only a preference config has (DPOConfig, ORPOConfig, CPOConfig; a ``loss_type`` of theirs says so too).
_DPO_KEYS = (
    "beta",
    "precompute_ref_log_probs",
    "ref_model_mixup_alpha",
    "ref_model_sync_steps",
    "sync_ref_model",
    "rpo_alpha",
    "f_divergence_type",
    "max_prompt_length",
    "max_completion_length",
    "ref_adapter_name",
    "simpo_gamma",
    "cpo_alpha",
)
#: Keys only TRL's CPOConfig has: its trainer keeps no reference, as SimPO's.
_CPO_KEYS = ("simpo_gamma", "cpo_alpha")
#: Keys DPOConfig shares with CPOConfig: a config with these alone may be either.
_SHARED_PREFERENCE_KEYS = ("beta", "max_prompt_length", "max_completion_length")

#: The ``loss_type`` names of TRL 1.16's configs (``trainer/sft_config.py``, ``trainer/dpo_config.py``,
#: ``experimental/cpo/cpo_config.py``; the same at f2cd577): SFTConfig's (``chunked_nll``, the
#: default at f2cd577, is a deprecated alias of ``nll`` in 1.16), DPOConfig's (a list of them is
#: combined), CPOConfig's.
SFT_LOSSES = ("nll", "dft", "chunked_nll")
DPO_LOSSES = (
    "sigmoid",
    "hinge",
    "ipo",
    "exo_pair",
    "nca_pair",
    "robust",
    "bco_pair",
    "sppo_hard",
    "aot",
    "aot_unpaired",
    "apo_zero",
    "apo_down",
    "discopop",
    "sft",
    "sigmoid_norm",
)
CPO_LOSSES = ("sigmoid", "hinge", "ipo", "simpo", "alphapo")


#: Model and data arguments the Hugging Face example scripts (``run_clm.py``) have too: not TRL's alone.
SCRIPT_KEYS = frozenset(
    """
model_name_or_path model_revision model_type config_overrides config_name tokenizer_name cache_dir use_fast_tokenizer token
trust_remote_code torch_dtype dtype low_cpu_mem_usage attn_implementation dataset_name dataset_config_name dataset_config
train_file validation_file max_train_samples max_eval_samples block_size streaming overwrite_cache validation_split_percentage
preprocessing_num_workers keep_linebreaks
""".split()
)


def _is_trl(ctx: Any) -> bool:
    """Whether the config has keys of TRL's own (TRL's defaults then apply), not only the Trainer's
    and the example scripts'."""
    return any(
        k in ctx.raw for k in TRL_KEYS - TRAINER_QUIET_KEYS - SCRIPT_KEYS - {"use_liger_kernel", "liger_kernel_config"}
    )


def _is_dpo(ctx: Any) -> bool:
    return not _is_grpo(ctx) and _dpo_values({k: ctx.raw.get(k, ABSENT) for k in _DPO_KEYS + ("loss_type",)})


def _is_grpo(ctx: Any) -> bool:
    """Whether the config is TRL's GRPOConfig (one of its own keys is set)."""
    return grpo.is_grpo(ctx.raw)


def _grpo_rule(knob: str) -> Rule:
    """A GRPOConfig key for grpo knob ``knob`` (TRL's default where absent), in a GRPO config only."""
    key = grpo.KNOB_KEYS[knob][0]

    def resolve(values: Mapping[str, Any], ctx: Any) -> Any:
        return grpo.knob_value(ctx.raw, knob) if _is_grpo(ctx) else None

    return Rule((key,), knob, resolve, doc=f"GRPOConfig's `{key}` (TRL's default {grpo.KNOB_KEYS[knob][2]!r})")


def _method(values: Mapping[str, Any], ctx: Any) -> Any:
    peft = value_of(values, "use_peft", as_bool, False)
    four = value_of(values, "load_in_4bit", as_bool, False)
    eight = value_of(values, "load_in_8bit", as_bool, False)
    if not peft:
        if four or eight:
            bad = "load_in_4bit" if four else "load_in_8bit"
            raise KeyProblem(bad, "true needs use_peft: true (TRL trains a quantized model through adapters only)")
        return "full"
    if four:
        return "qlora"
    if eight:
        return "lora-8bit"
    return "lora"


def _write_method(method: str, values: Mapping[str, Any]) -> dict[str, Any]:
    out = {"use_peft": method != "full", "load_in_4bit": method == "qlora"}
    if method == "lora-8bit" or truthy(values.get("load_in_8bit", False)):
        out["load_in_8bit"] = method == "lora-8bit"
    return out


def _targets(values: Mapping[str, Any], ctx: Any) -> Any:
    chosen = targets_rule(None, "lora_target_modules", doc="").resolve(values, ctx)
    weights = _target_parameters(values)
    if chosen is None and weights:
        return weights
    if chosen is None and ctx.knobs.get("method") in ("lora", "qlora", "lora-8bit"):
        return Planned(
            ("q_proj", "v_proj"),
            "no lora_target_modules: PEFT's default for the model type, planned as q_proj "
            "and v_proj (its default for Llama, Mistral, Qwen and Gemma)",
            modelled=True,
        )
    if not weights or chosen == ("all-linear",):  # all-linear adapts every expert weight already
        return chosen
    return tuple(dict.fromkeys((*chosen, *weights)))


def _target_parameters(values: Mapping[str, Any]) -> tuple[str, ...]:
    """PEFT's ``target_parameters`` (``lora_target_parameters``) as memfit's targets: a fused expert
    weight (``mlp.experts.gate_up_proj``) as ``experts.gate_up_proj``, a module's ``weight`` (a router)
    as the module's name."""
    names = value_of(values, "lora_target_parameters", as_names, None) or []
    out = []
    for name in names:
        module, _, weight = name.rpartition(".")
        short = module.rpartition(".")[2]
        if short == "experts":
            out.append(f"experts.{weight}")
        elif weight == "weight" and short:
            out.append(short)
        else:
            raise KeyProblem(
                "lora_target_parameters",
                f"{name!r} names no expert weight (…experts.<weight>) or module weight (<module>.weight)",
            )
    return tuple(out)


def _seq_len(values: Mapping[str, Any], ctx: Any) -> Any:
    if _is_grpo(ctx):
        return grpo.seq_len(ctx.raw)
    for name in ("max_length", "max_seq_length", "block_size"):
        if values[name] is not ABSENT and values[name] is not None:
            return value_of(values, name, as_int)
    if values["max_length"] is None:
        return Planned(
            None,
            "max_length: null (no truncation): planned at memfit's default length; pass --seq-len with the "
            "longest example's tokens",
        )
    if _is_trl(ctx):
        return 1024  # SFTConfig's and DPOConfig's default
    return Planned(
        None, "no sequence length in TrainingArguments: planned at memfit's default; pass --seq-len", modelled=True
    )


def _checkpointing(values: Mapping[str, Any], ctx: Any) -> Any:
    default = _is_trl(ctx)  # TRL turns it on by default, the Trainer off
    on = value_of(values, "activation_checkpointing", as_bool, ABSENT)
    if on is ABSENT:
        on = value_of(values, "gradient_checkpointing", as_bool, default)
    if value_of(values, "activation_offloading", as_bool, False):
        return Planned(
            "offload",
            "TRL's activation offloading: planned as checkpointing with the layer inputs in host memory "
            "(TRL offloads every saved activation it can)",
            modelled=True,
        )
    return "on" if on else "off"


def _use_reentrant(values: Mapping[str, Any], ctx: Any) -> Any:
    if ctx.knobs.get("checkpointing") != "on":
        return None
    for key in ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs"):
        said = use_reentrant_of(values[key], key)
        if said is not None:
            return said
    if ctx.knobs.get("method") != "lora-8bit":
        return None  # auto: transformers 5 and TRL since 0.27 non-reentrant, PEFT's k-bit preparation reentrant
    # The variant decides what LLM.int8 layers keep, and the versions differ: the plan says which it took.
    return Planned(
        "off",
        "not set: planned non-reentrant, as transformers 5 and TRL since 0.27 checkpoint, under which every 8-bit "
        "layer keeps its input until the end of backward (transformers 4.38 to 4.57 with TRL before 0.27 checkpoint "
        "reentrant, keeping none: set {use_reentrant: true} to plan that)",
        modelled=True,
    )


def _write_checkpointing(value: str, values: Mapping[str, Any]) -> dict[str, Any]:
    name = (
        "activation_checkpointing"
        if values.get("activation_checkpointing", ABSENT) is not ABSENT
        else "gradient_checkpointing"
    )
    out: dict[str, Any] = {name: value != "off"}
    if value == "offload" or values.get("activation_offloading", ABSENT) is not ABSENT:
        out["activation_offloading"] = value == "offload"
    return out


_DTYPES = one_of(
    {
        "float32": "fp32",
        "fp32": "fp32",
        "float": "fp32",
        "bfloat16": "bf16",
        "bf16": "bf16",
        "float16": "fp16",
        "fp16": "fp16",
        "half": "fp16",
        "auto": "auto",
        "null": "auto",
    },
    "a dtype",
    shown=("bfloat16", "float16", "float32", "auto"),
)

#: The keys that say how the model is loaded and trained: the Trainer's bf16 / fp16, TRL's dtype.
_PRECISION_KEYS = ("bf16", "fp16", "dtype", "torch_dtype", "model_init_kwargs")


def _half(values: Mapping[str, Any], ctx: Any) -> str | None:
    """The Trainer's autocast: ``bf16`` / ``fp16`` (TRL: bf16 unless fp16; the Trainer: off)."""
    fp16 = value_of(values, "fp16", as_bool, False)
    bf16 = value_of(values, "bf16", as_bool, None)
    if bf16 is None:
        bf16 = _is_trl(ctx) and not fp16
    return "bf16" if bf16 else "fp16" if fp16 else None


def _loaded(values: Mapping[str, Any], ctx: Any) -> tuple[str, str, Found | None]:
    """The dtype the model is loaded in, where that comes from (for the reasons given), and what to
    say when it is planned approximately. TRL loads in float32 unless ``dtype`` (or
    ``model_init_kwargs``' dtype) says otherwise; a script of the Trainer's arguments alone (such as
    transformers' run_clm.py) passes its ``dtype`` to ``from_pretrained``, which since transformers
    5 loads the checkpoint's dtype when none is given."""
    init = values["model_init_kwargs"] if isinstance(values["model_init_kwargs"], Mapping) else {}
    inner = next((n for n in ("dtype", "torch_dtype") if n in init), None)
    name = next((n for n in ("dtype", "torch_dtype") if values[n] is not ABSENT), None)
    if name is not None:
        loaded, key, value = value_of(values, name, _DTYPES), name, values[name]
    elif inner is not None:
        try:
            loaded = _DTYPES(init[inner])
        except ValueError as err:
            raise KeyProblem("model_init_kwargs", f"{inner}: {err}") from None
        key, value = "model_init_kwargs", {inner: init[inner]}
    elif _is_trl(ctx):
        return "fp32", "TRL's default dtype, float32", None
    else:
        return (
            "bf16",
            "the checkpoint's dtype",
            Found(
                "dtype (not set)",
                None,
                "no dtype: the script's from_pretrained loads the checkpoint's dtype (transformers 5; "
                "transformers 4 loaded float32): planned as bf16, the dtype of most checkpoints on the Hub",
                "precision",
            ),
        )
    where = f"{key}: {value}"
    if loaded != "auto":
        return loaded, where, None
    return (
        "bf16",
        where,
        Found(
            key,
            value,
            f"{where} loads the checkpoint's dtype: planned as bf16, the dtype of most checkpoints on the Hub",
            "precision",
        ),
    )


def _kbit_upcast(values: Mapping[str, Any], ctx: Any) -> Any:
    bits = {"qlora": "4-bit", "lora-8bit": "8-bit"}.get(ctx.knobs.get("method"))
    if bits is None or _is_grpo(ctx):  # grpo is planned with memfit's step, which never upcasts the base
        return None
    precision = {k: ctx.raw.get(k, ABSENT) for k in _PRECISION_KEYS}
    try:
        settle_zero_precision(ctx, _half(precision, ctx))
        loaded = _loaded(precision, ctx)[0]
    except ValueError:
        return None  # the precision rule names the bad value
    if zero_half(ctx) is not None:
        return False  # DeepSpeed casts the parameters that are not quantized to its 16-bit format
    if loaded == "fp32":
        return Planned(
            True,
            f"TRL loads the parameters that are not {bits} in float32 (its dtype): planned as PEFT's "
            "prepare_model_for_kbit_training leaves them, in fp32",
            modelled=True,
        )
    return Planned(
        False,
        f"TRL since 0.22 keeps the parameters that are not {bits} in the compute dtype; earlier versions "
        "ran PEFT's prepare_model_for_kbit_training, which upcasts them to fp32, then under bf16 cast the "
        "embeddings and output head back (pass --kbit-upcast to plan a model prepared so)",
        modelled=True,
    )


def _adapter_dtype(values: Mapping[str, Any], ctx: Any) -> Any:
    method = ctx.knobs.get("method")
    if not _is_trl(ctx) or _is_grpo(ctx) or method not in ("lora", "qlora", "lora-8bit"):
        return None
    half = ctx.knobs.get("precision") in ("bf16", "fp16")
    if method == "lora":
        zero3 = ctx.zero is not None and ctx.zero.stage == 3
        return "compute" if zero3 and half else None  # autocast_adapter_dtype=False: the base's dtype
    if half:
        return "compute"  # TRL casts a quantized model's adapters to bf16: as large as fp16 ones
    return Planned(
        None,
        "TRL casts a quantized model's adapters to bf16, with their gradients and AdamW states: planned as fp32 "
        "adapters, the compute dtype of this config",
        modelled=True,
    )


def _precision(values: Mapping[str, Any], ctx: Any) -> Any:
    method = ctx.knobs.get("method", "full")
    half = _half(values, ctx)
    settle_zero_precision(ctx, half)
    loaded, where, found = _loaded(values, ctx)
    if found is not None:
        ctx.approximated.append(found)
    if method == "qlora":
        _qlora_dtypes(loaded, half, ctx)
    return trainer_precision(method, loaded, half, ctx, where=where)


def _qlora_dtypes(loaded: str, half: str | None, ctx: Any) -> None:
    """What TRL's QLoRA holds in other dtypes than memfit plans: the 4-bit layers' compute dtype
    (TRL's dtype) and the adapters, which SFTTrainer and DPOTrainer cast to bf16."""
    if loaded == "fp32" and half is not None and zero_half(ctx) is None:
        named = next((k for k in _PRECISION_KEYS[2:] if k in ctx.raw), None)
        ctx.approximated.append(
            Found(
                named or "dtype (not set)",
                ctx.raw.get(named) if named else None,
                f"4-bit layers dequantize to float32 (bnb_4bit_compute_dtype is TRL's dtype) and "
                f"{half} autocast computes their matmuls: planned dequantizing to {half}",
                "precision",
            )
        )


def _fsdp(values: Mapping[str, Any], ctx: Any) -> Any:
    fsdp, config = values["fsdp"], values["fsdp_config"]
    if fsdp in (ABSENT, None, "", [], False):
        return None
    if ctx.knobs.get("shard") is not None:
        raise KeyProblem("fsdp", "set together with deepspeed: a run shards with one of them; drop one")
    if isinstance(config, str) and config.strip():
        import json

        path = Path(config).expanduser()
        path = (
            path if path.is_absolute() else (ctx.folder / path if (ctx.folder / path).exists() else Path.cwd() / path)
        )
        if path.is_dir():
            raise KeyProblem(
                "fsdp_config", f"{config!r} is a folder ({str(path)!r}); an FSDP config file (JSON) is expected"
            )
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise KeyProblem("fsdp_config", f"{str(path)!r} cannot be read as JSON: {err}") from None
    try:
        return fsdp_shard(fsdp, config)
    except ValueError as err:
        raise KeyProblem("fsdp", str(err)) from None


def _padding_free(values: Mapping[str, Any], ctx: Any) -> Any:
    chosen = attention(values["attn_implementation"]) if values["attn_implementation"] not in (ABSENT, None) else None
    if value_of(values, "padding_free", as_bool, False):
        return "on"  # TRL's padding-free batches (flash attention's varlen path)
    packing = value_of(values, "packing", as_bool, False)
    strategy = str(values["packing_strategy"]).lower() if values["packing_strategy"] not in (ABSENT, None) else "bfd"
    if packing and strategy.startswith("bfd") and chosen == "on":
        return "on"
    return chosen


def _hf_loss(values: Mapping[str, Any], ctx: Any) -> Any:
    config = values["liger_kernel_config"] if isinstance(values["liger_kernel_config"], Mapping) else {}
    liger = liger_loss(
        value_of(values, "use_liger_kernel", as_bool, False), config.get("fused_linear_cross_entropy", ABSENT)
    )
    if liger and _is_dpo(ctx):
        return Planned(
            None,
            "Liger's fused preference loss (DPOTrainer with use_liger_kernel): planned as the trainer's "
            "log-probs over the whole logits",
        )
    if liger:
        return liger
    if not _is_trl(ctx) or _is_dpo(ctx) or _is_grpo(ctx) or ctx.knobs.get("objective"):
        return None
    loss = values["loss_type"]
    if loss in (ABSENT, None):
        return Planned(
            "chunked-nll", "SFTTrainer's default, chunked_nll (TRL 1.x; nll before)", modelled=True, key="loss_type"
        )
    return {"chunked_nll": "chunked-nll", "nll": "model"}.get(
        str(loss).lower(), Planned("model", f"loss_type {loss}: planned as the model's loss")
    )


def _objective(values: Mapping[str, Any], ctx: Any) -> Any:
    """dpo for a DPOConfig (any of its loss types: each scores both completions against the reference);
    simpo for a CPOConfig (``loss_type: simpo``, or CPO's own losses, planned as SimPO's step: no
    reference, the chosen answers' NLL); grpo for a GRPOConfig."""
    if _is_grpo(ctx):
        return "grpo"
    if not _dpo_values(values):
        return None
    loss = values["loss_type"]
    losses = [] if loss in (ABSENT, None) else [str(x).lower() for x in (loss if isinstance(loss, list) else [loss])]
    if "simpo" in losses:
        return "simpo"
    if any(values[k] is not ABSENT for k in _CPO_KEYS):
        return Planned(
            "simpo",
            f"CPOConfig's loss_type {', '.join(losses) or 'sigmoid'}: planned as SimPO's step (no "
            "reference, the same log-probs and NLL term)",
            modelled=True,
        )
    return "dpo"


def _precompute_reference(values: Mapping[str, Any], ctx: Any) -> Any:
    if ctx.knobs.get("objective") != "dpo":
        return None
    return value_of(values, "precompute_ref_log_probs", as_bool, None)


def _dpo_values(values: Mapping[str, Any]) -> bool:
    loss = values["loss_type"]
    losses = [] if loss in (ABSENT, None) else loss if isinstance(loss, list) else [loss]
    return any(values[k] is not ABSENT for k in _DPO_KEYS) or any(str(x).lower() not in SFT_LOSSES for x in losses)


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


def _loss_names(raw: Mapping[str, Any]) -> tuple[tuple[str, ...], str]:
    """The ``loss_type`` names of the config TRL would parse this as: a GRPOConfig's or a CPOConfig's
    (their own keys), a DPOConfig's (its own keys; with only the keys it shares with CPOConfig,
    either's), or any of the three (no preference key: SFTConfig's, or a preference loss that makes it one)."""
    if grpo.is_grpo(raw):
        return grpo.GRPO_LOSSES, "a loss_type TRL's GRPOConfig takes"
    if any(k in raw for k in _CPO_KEYS):
        return CPO_LOSSES, "a loss_type TRL's CPOConfig takes"
    own = [k for k in _DPO_KEYS if k in raw and k not in _CPO_KEYS]
    if own and any(k not in _SHARED_PREFERENCE_KEYS for k in own):
        return DPO_LOSSES, "a loss_type TRL's DPOConfig takes"
    if own:
        return tuple(dict.fromkeys(DPO_LOSSES + CPO_LOSSES)), "a loss_type TRL's DPOConfig or CPOConfig takes"
    return tuple(
        dict.fromkeys(SFT_LOSSES + DPO_LOSSES + CPO_LOSSES)
    ), "a loss_type TRL's SFTConfig, DPOConfig or CPOConfig takes"


#: Keys whose values TRL (1.16) and the Trainer check against names.
CHOICES: tuple[Choices, ...] = (
    Choices(
        "loss_type",
        _loss_names,
        many=True,
        doc="SFTConfig's `nll`, `dft`, `chunked_nll`; DPOConfig's `sigmoid`, `hinge`, `ipo`... (a list of them); "
        "CPOConfig's `sigmoid`, `hinge`, `ipo`, `simpo`, `alphapo`; GRPOConfig's `grpo`, `dr_grpo`, `dapo`, "
        "`bnpo`... (TRL 1.16), as the config's other keys say which it is",
    ),
    Choices(
        "f_divergence_type",
        ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence"),
        "an f-divergence TRL's DPOConfig takes",
        "TRL 1.16's `DPOConfig`",
    ),
    Choices(
        "packing_strategy",
        ("bfd", "bfd_split", "wrapped"),
        "a packing strategy TRL's SFTConfig takes",
        "TRL 1.16's `SFTConfig`",
    ),
    Choices(
        "attn_implementation",
        (
            "eager",
            "sdpa",
            "flash_attention_2",
            "flash_attention_3",
            "flash_attention_4",
            "flex_attention",
            "paged|eager",
        ),
        "an attention implementation transformers knows",
        "transformers 5.24's `AttentionInterface`, a `paged|` one, or a Hub kernel's path",
        also=lambda name: "/" in name or name.startswith("paged|"),
    ),
    lr_scheduler_choices(),
)

RULES: tuple[Rule, ...] = (
    model_rule("model_name_or_path"),
    revision_rule("model_revision"),
    deepspeed_rule(),
    Rule(
        ("fsdp", "fsdp_config"),
        "shard",
        _fsdp,
        doc="FSDP (`fsdp: full_shard auto_wrap`, `fsdp_config`): `fsdp`; `offload` as `fsdp-offload`; `shard_grad_op` "
        "as `zero2`; `hybrid_shard` as `fsdp`",
    ),
    Rule(
        ("use_peft", "load_in_4bit", "load_in_8bit"),
        "method",
        _method,
        _write_method,
        doc="the method: `use_peft` is `lora`, with `load_in_4bit` `qlora`, with `load_in_8bit` `lora-8bit` (LLM.int8), "
        "otherwise `full`",
    ),
    Rule(
        ("load_in_4bit", "load_in_8bit") + _PRECISION_KEYS[2:],
        "kbit_upcast",
        _kbit_upcast,
        doc="QLoRA (and an 8-bit base) without PEFT's prepare_model_for_kbit_training, as SFTTrainer runs it since TRL 0.22 (earlier: "
        "`--kbit-upcast`): the parameters that are not 4-bit stay in `dtype`, so in fp32 with TRL's default float32 "
        "(planned as `kbit_upcast`), and in DeepSpeed's 16-bit format under its bf16 or fp16",
    ),
    int_rule("lora_r", "rank", 16, doc="LoRA rank (TRL's default 16)"),
    Rule(
        ("lora_alpha",),
        "alpha",
        lambda v, ctx: value_of(v, "lora_alpha", as_float, 32.0),
        doc="LoRA alpha (TRL's default 32)",
    ),
    Rule(
        ("lora_dropout",),
        "dropout",
        lambda v, ctx: value_of(v, "lora_dropout", _dropout, 0.05),
        doc="LoRA dropout (0.05)",
    ),
    Rule(
        ("lora_target_modules", "lora_target_parameters"),
        "targets",
        _targets,
        doc="LoRA targets: the modules listed, `all-linear`; none: PEFT's default for the model type (q_proj, v_proj); "
        "`lora_target_parameters` adds PEFT's adapters on weights: `mlp.experts.gate_up_proj` as `experts.gate_up_proj`, "
        "a router's `gate.weight` as `gate`",
    ),
    routing_rule("model_init_kwargs"),
    modules_to_save_rule("lora_modules_to_save"),
    dora_rule("use_dora"),
    rslora_rule("use_rslora"),
    Rule(
        ("max_length", "max_seq_length", "block_size"),
        "seq_len",
        _seq_len,
        lambda v, values: {
            next(
                (k for k in ("max_seq_length", "block_size") if k in values and "max_length" not in values),
                "max_length",
            ): int(v)
        },
        doc="tokens per sequence (SFTConfig / DPOConfig `max_length`, 1024 by default; `max_seq_length` before; `block_size` "
        "of transformers' run_clm.py); memfit plans the longest",
    ),
    int_rule(
        "per_device_train_batch_size",
        "batch_size",
        8,
        doc="sequences per GPU in one forward pass (the Trainer's default 8)",
    ),
    int_rule("gradient_accumulation_steps", "grad_accum", 1, doc="micro-batches per optimizer step"),
    Rule(
        (
            "gradient_checkpointing",
            "activation_checkpointing",
            "activation_offloading",
        ),
        "checkpointing",
        _checkpointing,
        _write_checkpointing,
        doc="checkpointing `on` (TRL's default; the Trainer's is off); TRL's `activation_offloading` as `offload`",
    ),
    Rule(
        ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs"),
        "use_reentrant",
        _use_reentrant,
        doc="`use_reentrant` as the hf recipe's `use_reentrant`; unset, as transformers 5 and TRL since 0.27 run it "
        "(non-reentrant), or reentrant through PEFT's prepare_model_for_kbit_training (`kbit_upcast`)",
    ),
    optimizer_rule("optim"),
    adamw_impl_rule("optim"),
    Rule(
        _PRECISION_KEYS,
        "precision",
        _precision,
        doc="`bf16` / `fp16` (TRL: bf16 unless fp16; the Trainer: off) is autocast on the dtype the model is loaded in "
        "(`dtype`: TRL's default float32; a script of the Trainer's arguments alone, the checkpoint's, planned as "
        "bf16). Full fine-tuning of fp32 weights is `bf16-mixed` / `fp16-mixed`, of 16-bit weights `bf16` / `fp16` "
        "(mixed under DeepSpeed, whose ZeRO keeps fp32 master weights, and under FSDP, which upcasts trained "
        "parameters to fp32); LoRA on a 16-bit base `bf16` / `fp16`, on an fp32 base `fp32` without autocast "
        "(listed); QLoRA in the compute dtype; `tf32` does not change memory",
    ),
    Rule(
        ("load_in_4bit", "load_in_8bit", "deepspeed"),
        "adapter_dtype",
        _adapter_dtype,
        doc="TRL's SFT and DPO trainers cast a quantized model's adapters to bf16, and keep a 16-bit base's "
        "adapters in its dtype under ZeRO-3 (`autocast_adapter_dtype=False`): `adapter_dtype: compute`, their "
        "gradients and AdamW states with them",
    ),
    Rule(("max_grad_norm",), "max_grad_norm", _max_grad_norm, doc="gradient clipping (0 or null: none)"),
    Rule(
        ("attn_implementation", "padding_free", "packing_strategy", "packing"),
        "padding_free",
        _padding_free,
        doc="flash attention (`attn_implementation: flash_attention_2`), TRL's `padding_free` and `bfd` packing on flash "
        "attention as `padding_free: on`; sdpa as padded batches; eager listed",
    ),
    Rule(
        ("packing",),
        "packing",
        lambda v, ctx: value_of(v, "packing", as_bool, None),
        doc="packed rows of `max_length` tokens",
    ),
    Rule(
        ("use_liger_kernel", "liger_kernel_config", "loss_type"),
        "hf_loss",
        _hf_loss,
        doc="the loss: `use_liger_kernel` as Liger's fused linear cross-entropy; SFT's `loss_type: chunked_nll` (TRL 1.x's "
        "default) as `chunked-nll`, `nll` as the model's loss",
    ),
    Rule(
        _DPO_KEYS + ("loss_type", "num_generations"),
        "objective",
        _objective,
        matters=_dpo_values,
        unmodelled="preference training (DPO) runs the chosen and the rejected completion of each example, and a reference "
        "pass; planned as supervised fine-tuning",
        doc="a preference config is preference training: DPOConfig's keys or a DPO `loss_type` as `dpo` (the reference "
        "from the disabled adapters with `use_peft`, else a frozen copy), CPOConfig's (`simpo_gamma`, `cpo_alpha`) "
        "as `simpo` (`loss_type: simpo`; CPO's own losses planned as SimPO's step); `per_device_train_batch_size` "
        "counts pairs. A GRPOConfig (`num_generations`, `use_vllm`, `num_iterations`...) is `grpo`, its "
        "`per_device_train_batch_size` counting completions, planned with memfit's step (TRL's GRPOTrainer's fused "
        "LM head keeps no whole logits either)",
    ),
    Rule(
        ("num_generations",),
        "recipe",
        lambda values, ctx: Planned("memfit", grpo.RECIPE_NOTE, modelled=True) if _is_grpo(ctx) else None,
        doc="a GRPOConfig planned with memfit's step",
    ),
    *(_grpo_rule(knob) for knob in grpo.KNOB_KEYS),
    not_modelled(
        "generation_batch_size",
        "steps_per_generation",
        why="a generation batch other than per_device_train_batch_size x gradient_accumulation_steps: planned as that",
    ),
    Rule(
        ("precompute_ref_log_probs",),
        "precompute_reference",
        _precompute_reference,
        doc="DPO's reference log-probs computed once before training: no reference pass, and no frozen copy for full "
        "fine-tuning",
    ),
    not_modelled(
        "force_use_ref_model",
        why="a reference model loaded beside the PEFT policy (a second copy of the base): planned with the adapters "
        "disabled as the reference",
    ),
    not_modelled("torch_compile", why="a compiled step fuses kernels and keeps other tensors for backward"),
    not_modelled("optim_target_modules", why="GaLore / APOLLO projected optimizer states on these modules"),
    not_modelled(
        "parallelism_config", why="tensor or context parallelism splits the model or the sequence across GPUs"
    ),
)

#: The Trainer's keys and TRL's: everything a config of this kind may hold.
ALL_KEYS = TRAINER_QUIET_KEYS | TRL_KEYS | SCRIPT_KEYS | frozenset(k for rule in RULES for k in rule.keys)

KEYMAP = KeyMap(
    tool="trl",
    title="TRL / Hugging Face TrainingArguments",
    rules=RULES,
    quiet_keys=ALL_KEYS - frozenset(k for rule in RULES for k in rule.keys),
    docs_url="https://huggingface.co/docs/trl/sft_trainer",
    generic=True,
    choices=CHOICES,
)
