"""Axolotl's YAML: its key map.

Keys and defaults from Axolotl's config schema (``src/axolotl/utils/schemas/``, and the plugins'
``integrations/*/args.py``) at 067b021 (2026-07). Axolotl trains with the Hugging Face Trainer on
a model loaded in the training dtype (bf16 by default: ``bf16: auto``), so it is planned with the
``hf`` recipe.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from memfit.interop import grpo
from memfit.interop.common import (
    ROUTING_FIELDS,
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
from memfit.interop.hf import DPO_LOSSES
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
from memfit.interop.precision import HALVES, settle_zero_precision, trainer_precision, uses_fsdp
from memfit.interop.trainer import (
    adamw_impl_rule,
    attention,
    deepspeed_rule,
    fsdp_shard,
    lr_scheduler_choices,
    optimizer_rule,
)

_ADAPTERS = {
    "lora": "lora",
    "qlora": "qlora",
    "null": "full",
    "none": "full",
    "": "full",
    "llama-adapter": Planned("lora", "llama-adapter (adaption prompts): planned as LoRA adapters"),
    "ia3": Planned("lora", "IA3 (scaling vectors): planned as LoRA adapters"),
}


#: The adapters a refusal names (null: full fine-tuning, also spelled none or left empty).
_ADAPTER_NAMES = ("lora", "qlora", "llama-adapter", "ia3", "null")


def _method(values: Mapping[str, Any], ctx: Any) -> Any:
    adapter = values["adapter"]
    kind = (
        one_of(_ADAPTERS, "an adapter Axolotl knows", shown=_ADAPTER_NAMES)(adapter)
        if adapter is not ABSENT
        else "full"
    )
    four = value_of(values, "load_in_4bit", as_bool, False)
    eight = value_of(values, "load_in_8bit", as_bool, False)
    gptq = value_of(values, "gptq", as_bool, False)
    if kind == "full" and (four or eight):
        bad = "load_in_4bit" if four else "load_in_8bit"
        raise KeyProblem(
            bad, "true needs an adapter (adapter: qlora or lora): quantized weights are not trained in full"
        )
    if kind in ("lora", "qlora") and four:
        return "qlora"
    if kind == "qlora":
        return "qlora"
    if kind == "lora" and eight:
        return "lora-8bit"
    if kind == "lora" and gptq:
        return Planned("lora", "a GPTQ-quantized base: planned as a 16-bit base")
    return kind


def _write_method(method: str, values: Mapping[str, Any]) -> dict[str, Any]:
    if method == "qlora":
        return {"adapter": "qlora", "load_in_4bit": True, "load_in_8bit": False}
    if method == "lora-8bit":
        return {"adapter": "lora", "load_in_4bit": False, "load_in_8bit": True}
    if method == "lora":
        return {"adapter": "lora", "load_in_4bit": False, "load_in_8bit": False}
    return {"adapter": None, "load_in_4bit": False, "load_in_8bit": False}


def _grad_accum(values: Mapping[str, Any], ctx: Any) -> Any:
    accum = value_of(values, "gradient_accumulation_steps", as_int, None)
    if accum is not None:
        return accum
    total = value_of(values, "batch_size", as_int, None)
    if total is None:
        return 1
    micro = value_of(values, "micro_batch_size", as_int, 1)
    return max(total // micro, 1)  # Axolotl derives the accumulation from the total batch


_OFFLOADED = "layer inputs kept in host memory"


def _checkpointing(values: Mapping[str, Any], ctx: Any) -> Any:
    gc = values["gradient_checkpointing"]
    offload = values["activation_offloading"]
    if offload is not ABSENT and truthy(offload):
        kind = str(offload).lower()
        if kind not in ("true", "legacy", "disk", "hidden_states"):
            raise KeyProblem(
                "activation_offloading", f"{offload!r} is not one of true, false, legacy, disk, hidden_states"
            )
        return Planned(
            "offload", f"activation offloading ({kind}): planned as checkpointing with the {_OFFLOADED}", modelled=True
        )
    if gc is ABSENT or gc is None:
        return "off"
    if isinstance(gc, str) and gc.strip().lower() in ("offload", "offload_disk"):
        return Planned(
            "offload",
            f"gradient_checkpointing: {gc}: planned as transformers' offloaded checkpointing ({_OFFLOADED})",
            modelled=True,
        )
    try:
        return "on" if as_bool(gc) else "off"
    except ValueError:
        raise KeyProblem("gradient_checkpointing", f"{gc!r} is not one of true, false, offload, offload_disk") from None


def _use_reentrant(values: Mapping[str, Any], ctx: Any) -> Any:
    if ctx.knobs.get("checkpointing") != "on" or _is_grpo(ctx):  # (grpo: memfit's step)
        return None
    said = use_reentrant_of(values["gradient_checkpointing_kwargs"], "gradient_checkpointing_kwargs")
    if said is not None:
        return said
    # normalize_config (since 0.5) makes it use_reentrant: true for SFT; with rl or unfrozen_parameters
    # the trainer builder's false.
    return "off" if ctx.raw.get("rl") is not None or ctx.raw.get("unfrozen_parameters") is not None else "on"


def _write_checkpointing(value: str, values: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"gradient_checkpointing": {"off": False, "on": True, "offload": "offload"}[value]}
    if value != "offload" and values.get("activation_offloading", ABSENT) not in (ABSENT, None, False):
        out["activation_offloading"] = False
    return out


def _is_grpo(ctx: Any) -> bool:
    """Whether the config trains with Axolotl's GRPO trainer (``rl: grpo``)."""
    rl = ctx.raw.get("rl")
    return rl is not None and str(getattr(rl, "value", rl)).strip().lower() == "grpo"


def _trl_block(ctx: Any) -> Mapping[str, Any]:
    block = ctx.raw.get("trl")
    return block if isinstance(block, Mapping) else {}


def _grpo_rule(knob: str) -> Rule:
    """A key of the ``trl:`` block for grpo knob ``knob`` (TRL's default where absent), with ``rl: grpo`` only."""

    def resolve(values: Mapping[str, Any], ctx: Any) -> Any:
        return grpo.knob_value(_trl_block(ctx), knob, prefix="trl.") if _is_grpo(ctx) else None

    return Rule(
        ("trl",),
        knob,
        resolve,
        doc=f"`trl.{grpo.KNOB_KEYS[knob][0]}` with `rl: grpo` (TRL's default {grpo.KNOB_KEYS[knob][2]!r})",
    )


def _grpo_seq_len(values: Mapping[str, Any], ctx: Any) -> Any:
    """``rl: grpo``: Axolotl's prompt length (``max_prompt_len``, else ``sequence_len``: what it passes as TRL's
    ``max_prompt_length``) plus ``trl.max_completion_length``."""
    if not _is_grpo(ctx):
        return None
    prompt = ctx.raw.get("max_prompt_len") or ctx.raw.get("sequence_len") or 512
    return grpo.seq_len(_trl_block(ctx), prompt, prefix="trl.", prompt_key="max_prompt_len")


def _kbit_upcast(values: Mapping[str, Any], ctx: Any) -> Any:
    bits = {"qlora": "4-bit", "lora-8bit": "8-bit"}.get(ctx.knobs.get("method"))
    if bits is None or _is_grpo(ctx):  # grpo is planned with memfit's step, which never upcasts the base
        return None
    if uses_fsdp(ctx) or (ctx.zero is not None and ctx.zero.stage == 3):
        return False  # Axolotl skips PEFT's preparation: every parameter stays in one dtype
    return Planned(
        False,
        "Axolotl runs PEFT's prepare_model_for_kbit_training, which upcasts the parameters that are not "
        f"{bits} to fp32, then casts the norms, the embeddings and the output head back to the training "
        "dtype: planned with them in the compute dtype",
        modelled=True,
    )


def _adapter_dtype(values: Mapping[str, Any], ctx: Any) -> Any:
    # PEFT's autocast_adapter_dtype=False leaves the adapters in the dtype it gave them: the base
    # layer's (a 4-bit layer's compute dtype); over LLM.int8's integer weights they stay fp32.
    if value_of(values, "peft_autocast_adapter_dtype", as_bool, True):
        return None
    if _is_grpo(ctx) or ctx.knobs.get("method") not in ("lora", "qlora"):
        return None
    return "compute"


def _bf16_setting(value: Any) -> Any:
    """Axolotl's ``bf16``: true, false, ``auto`` (bf16 where the GPU has it) or ``full``."""
    if isinstance(value, str) and value.strip().lower() in ("auto", "full"):
        return value.strip().lower()
    return as_bool(value)


def _dtypes(values: Mapping[str, Any], ctx: Any) -> tuple[str, str | None]:
    """The dtype Axolotl loads the model in (its ``torch_dtype``) and the Trainer's autocast (bf16,
    fp16 or None), as ``utils/config``'s ``resolve_dtype`` and the trainer builder's
    ``_configure_precision_settings`` decide them. ``bf16: auto`` is bf16 unless ``fp16`` (memfit
    plans a GPU that has bf16; the plan says where it does not); ``bf16: full`` loads bf16 and
    trains without autocast (the Trainer's ``bf16_full_eval`` alone)."""
    fp16 = value_of(values, "fp16", as_bool, False)
    bf16 = value_of(values, "bf16", _bf16_setting, "auto")
    if bf16 == "auto":
        bf16 = not fp16
    bfloat16 = value_of(values, "bfloat16", as_bool, False)
    float16 = value_of(values, "float16", as_bool, False)
    if bf16 or bfloat16:
        loaded = "bf16"
    elif fp16 or float16 or truthy(ctx.raw.get("load_in_8bit", False)):
        loaded = "fp16"
    else:
        loaded = "fp32"
    if bf16 == "full":
        return loaded, None
    return loaded, "bf16" if bf16 or bfloat16 else "fp16" if fp16 else None


def _precision(values: Mapping[str, Any], ctx: Any) -> Any:
    method = ctx.knobs.get("method", "full")
    loaded, half = _dtypes(values, ctx)
    settle_zero_precision(ctx, half)
    fsdp = uses_fsdp(ctx)
    if method == "qlora" and fsdp and value_of(values, "float32", as_bool, False):
        ctx.not_modelled.append(
            Found(
                "float32",
                values["float32"],
                "under FSDP Axolotl loads QLoRA's parameters that are not 4-bit in fp32: planned in the compute dtype",
                "precision",
            )
        )
    value = trainer_precision(method, loaded, half, ctx, where="Axolotl's torch_dtype, float32")
    if method == "full" and value in HALVES and not fsdp and not _casts_back(ctx.raw):
        key = next((k for k in _ATTENTION_KEYS[:-2] if ctx.raw.get(k) not in (None, False)), None)
        ctx.not_modelled.append(
            Found(
                key or "attn_implementation (not set)",
                ctx.raw.get(key) if key else None,
                f"a full fine-tuning under sdpa or eager attention: Axolotl keeps the embeddings, "
                f"the output head and the norms in fp32 (with fp32 gradients and AdamW states; it "
                f"casts them back for other attention implementations, or Cut Cross-Entropy): "
                f"planned all in {value}",
                "precision",
            )
        )
    return value


def _casts_back(raw: Mapping[str, Any]) -> bool:
    """Whether Axolotl casts the embeddings, head and norms of a full fine-tuning, which it upcast
    to fp32 after loading, back to the training dtype (``loaders/model.py``,
    ``_configure_embedding_dtypes``: for an attention implementation other than sdpa or eager, or
    for Cut Cross-Entropy)."""
    try:
        name = _attention_name({k: raw.get(k, ABSENT) for k in _ATTENTION_KEYS})
    except ValueError:
        return True  # a bad attention flag: its own rule says so, and nothing is listed here
    return (name is not None and name.lower() not in ("sdpa", "eager")) or truthy(raw.get("cut_cross_entropy", False))


#: Axolotl's attention keys: ``attn_implementation``, its older flags, and what runs beside them.
_ATTENTION_KEYS = (
    "attn_implementation",
    "flash_attention",
    "sdp_attention",
    "xformers_attention",
    "eager_attention",
    "flex_attention",
    "sage_attention",
    "s2_attention",
    "batch_flattening",
)

#: Axolotl's older attention flags, in the order it reads them (``LEGACY_ATTN_FLAG_TO_IMPL``).
_ATTENTION_FLAGS = (
    ("xformers_attention", "xformers"),
    ("sage_attention", "sage"),
    ("flex_attention", "flex_attention"),
    ("flash_attention", "flash_attention_2"),
    ("sdp_attention", "sdpa"),
    ("eager_attention", "eager"),
)


def _attention_name(values: Mapping[str, Any]) -> str | None:
    """The attention implementation a config names: ``attn_implementation``, or its first older
    flag set; None where it names none."""
    name = values["attn_implementation"]
    if name is not ABSENT and name is not None:
        return str(name).strip()
    return next((impl for key, impl in _ATTENTION_FLAGS if value_of(values, key, as_bool, False)), None)


def _attention(values: Mapping[str, Any], ctx: Any) -> Any:
    name = _attention_name(values)
    if name is not None and name.lower() == "fp8":
        return Planned(
            None,
            "Axolotl's fp8 attention (the model loaded with sdpa, its attention patched to fp8 kernels): "
            "planned as SDPA with padded batches",
        )
    if name is not None:
        return attention(name)
    if value_of(values, "s2_attention", as_bool, False):
        return Planned(
            "on",
            "shifted sparse attention (LongLoRA): planned as flash attention over the whole sequence",
            modelled=True,
        )
    if values["batch_flattening"] is not ABSENT and truthy(values["batch_flattening"]):
        return "on"  # the micro-batch's examples in one row, as flash attention's varlen path takes them
    return None


def _hf_loss(values: Mapping[str, Any], ctx: Any) -> Any:
    plugins = [str(p) for p in (values["plugins"] if isinstance(values["plugins"], list) else [])]
    if any("liger" in p.lower() for p in plugins) and value_of(
        values, "liger_fused_linear_cross_entropy", as_bool, False
    ):
        return "liger"
    if value_of(values, "cut_cross_entropy", as_bool, False):
        return Planned(
            "liger",
            "Cut Cross-Entropy (the loss a block of the vocabulary at a time, no whole logits): planned as "
            "Liger's fused linear cross-entropy, which keeps a little more",
            modelled=True,
        )
    # Axolotl patches the causal-LM loss: SFT only (the preference trainers take log-probs themselves).
    if value_of(values, "chunked_cross_entropy", as_bool, False) and not truthy(ctx.raw.get("rl")):
        chunks = value_of(values, "chunked_cross_entropy_num_chunks", as_int, 8)
        if chunks != 8:
            return Planned(
                "chunked-ce",
                f"{chunks} chunks planned as 8: the chunks' gradients are joined whole either way, only a "
                "chunk's transients change",
                modelled=True,
            )
        return "chunked-ce"
    return None


def _fsdp(values: Mapping[str, Any], ctx: Any) -> Any:
    fsdp, config, version = values["fsdp"], values["fsdp_config"], values["fsdp_version"]
    if ctx.knobs.get("shard") is not None and (fsdp not in (ABSENT, None, [], "") or config not in (ABSENT, None, {})):
        raise KeyProblem("fsdp", "set together with deepspeed: a run shards with one of them; drop one")
    if fsdp in (ABSENT, None, [], "") and (config in (ABSENT, None) or not config):
        return None
    try:
        return fsdp_shard(fsdp if fsdp not in (ABSENT, None, [], "") else ["full_shard"], config, version)
    except ValueError as err:
        raise KeyProblem("fsdp", str(err)) from None


def _dropout(value: Any) -> float:
    number = float(value) if not isinstance(value, bool) else -1.0
    if not 0.0 <= number < 1.0:
        raise ValueError(f"{value!r} must be in [0, 1)")
    return number


def _max_grad_norm(values: Mapping[str, Any], ctx: Any) -> Any:
    value = values["max_grad_norm"]
    if value is ABSENT:
        return 1.0  # the Trainer's default
    if value in (None, 0, 0.0):
        return "none"
    return as_float(value)


#: Axolotl's ``rl`` trainers: its ``RLType`` (``utils/schemas/enums.py`` at 067b021).
RL_TYPES = ("dpo", "gdpo", "grpo", "ipo", "orpo", "kto", "simpo", "ebft")
#: Axolotl's ``attn_implementation`` names (``CANONICAL_ATTN_IMPLS`` at 067b021; a Hub kernel's path
#: with a "/" too; the short forms flash, flex, sdp are refused).
ATTENTION_NAMES = (
    "eager",
    "sdpa",
    "flash_attention_2",
    "flash_attention_3",
    "flex_attention",
    "xformers",
    "sage",
    "fp8",
)

#: Axolotl's ``rl`` trainers memfit plans; ipo is DPO's step with another loss.
_RL_OBJECTIVES = {"dpo": "dpo", "ipo": "dpo", "orpo": "orpo", "simpo": "simpo", "grpo": "grpo"}


def _objective(values: Mapping[str, Any], ctx: Any) -> Any:
    rl = values["rl"]
    if rl is ABSENT or not truthy(rl):
        return None
    name = str(getattr(rl, "value", rl)).lower()
    if name in _RL_OBJECTIVES:
        return _RL_OBJECTIVES[name]
    return Planned(
        None,
        f"rl: {name} trains with another trainer (its own completions, reward or reference models): "
        "planned as supervised fine-tuning",
    )


def _precompute_reference(values: Mapping[str, Any], ctx: Any) -> Any:
    if ctx.knobs.get("objective") != "dpo":
        return None
    return value_of(values, "precompute_ref_log_probs", as_bool, None)


def _image_pixels(value: Any) -> int:
    """Pixels of an image resized to Axolotl's ``image_size``: a side (a padded square) or ``[width, height]``."""
    if isinstance(value, (list, tuple)):
        if len(value) != 2:
            raise ValueError(f"{value!r} is not a size; give one side (512) or [width, height]")
        return as_int(value[0]) * as_int(value[1])
    return as_int(value) ** 2


def _freeze_vision(values: Mapping[str, Any], ctx: Any) -> Any:
    """Whether a vision-language config leaves the tower and projector frozen (None: not one)."""
    if value_of(values, "freeze_mm_modules", as_bool, False):
        return True
    if not truthy(values["processor_type"]) and not truthy(values["image_size"]):
        return None  # a text model: nothing to freeze
    if not truthy(values["adapter"]) or str(values["adapter"]).lower() in ("none", "null"):
        return False  # a full fine-tuning trains every parameter
    if value_of(values, "lora_target_linear", as_bool, False):
        return False  # every linear layer's name, the tower's among them
    targets = values["lora_target_modules"]
    if isinstance(targets, str) and "language_model" in targets:
        return True  # a pattern on the language model's modules alone
    return False if truthy(targets) else None


def _other_overrides(values: Mapping[str, Any]) -> bool:
    """Whether the model config overrides hold more than the routing loss's fields (read as such)."""
    config = values["overrides_of_model_config"]
    others = set(config) - set(ROUTING_FIELDS) if isinstance(config, Mapping) else set()
    return bool(others) or truthy(values["overrides_of_model_kwargs"]) or truthy(values["rope_scaling"])


RULES: tuple[Rule, ...] = (
    model_rule(
        "base_model_config",
        "base_model",
        doc="the model: `base_model` (a Hub id or a folder); its config.json from `base_model_config` when set",
    ),
    revision_rule("revision_of_model"),
    deepspeed_rule(),
    Rule(
        ("fsdp", "fsdp_config", "fsdp_version"),
        "shard",
        _fsdp,
        doc="FSDP (`fsdp: [full_shard, auto_wrap]`, `fsdp_version: 2` with `fsdp_config`): `fsdp`; `offload_params` as "
        "`fsdp-offload`; `reshard_after_forward: false` as `zero2`",
    ),
    Rule(
        ("adapter", "load_in_4bit", "load_in_8bit", "gptq"),
        "method",
        _method,
        _write_method,
        doc="the method: no adapter is `full`, `lora`, `qlora` (or `lora` with `load_in_4bit`); `lora` with `load_in_8bit` "
        "is `lora-8bit` (bitsandbytes LLM.int8); a GPTQ base is planned as a 16-bit one and listed",
    ),
    Rule(
        ("load_in_4bit", "load_in_8bit"),
        "kbit_upcast",
        _kbit_upcast,
        doc="4-bit and 8-bit weights go through PEFT's prepare_model_for_kbit_training (not with FSDP or ZeRO-3), which "
        "upcasts the parameters that are not quantized to fp32; Axolotl then casts the norms, the embeddings and the output head back "
        "to the training dtype (`loaders/model.py`): planned as `kbit_upcast: false`",
    ),
    Rule(
        ("peft_autocast_adapter_dtype",),
        "adapter_dtype",
        _adapter_dtype,
        doc="`false`: LoRA's adapters in the compute dtype, with their gradients and optimizer states (PEFT's "
        "`autocast_adapter_dtype`; over an 8-bit base they stay fp32)",
    ),
    Rule(
        ("lora_r", "lora_rank"),
        "rank",
        lambda v, ctx: value_of(v, "lora_r", as_int, None) or value_of(v, "lora_rank", as_int, None),
        doc="LoRA rank",
    ),
    Rule(("lora_alpha",), "alpha", lambda v, ctx: value_of(v, "lora_alpha", as_float, None), doc="LoRA alpha"),
    Rule(("lora_dropout",), "dropout", lambda v, ctx: value_of(v, "lora_dropout", _dropout, None), doc="LoRA dropout"),
    targets_rule(
        "lora_target_linear",
        "lora_target_modules",
        doc="LoRA targets: `lora_target_linear: true` is every linear layer (`all-linear`), or the modules listed",
    ),
    modules_to_save_rule(
        "lora_modules_to_save",
        "peft_ensure_weight_tying",
        doc="modules trained whole (often embed_tokens and lm_head): PEFT's trainable copies, with their "
        "gradients and optimizer states; a tied embedding and head named both: one shared copy "
        "(`peft_ensure_weight_tying: true`; without it PEFT trains two, listed)",
    ),
    dora_rule("peft_use_dora"),
    rslora_rule("peft_use_rslora"),
    int_rule(
        "sequence_len", "seq_len", 512, doc="tokens per sequence (Axolotl's default 512); memfit plans the longest"
    ),
    Rule(
        ("max_prompt_len",),
        "seq_len",
        _grpo_seq_len,
        doc="`rl: grpo`: the prompt's length (`max_prompt_len`, else `sequence_len`) plus `trl.max_completion_length`",
    ),
    int_rule("micro_batch_size", "batch_size", 1, doc="sequences per GPU in one forward pass"),
    Rule(
        ("gradient_accumulation_steps", "batch_size", "micro_batch_size"),
        "grad_accum",
        _grad_accum,
        lambda v, values: {"gradient_accumulation_steps": int(v)},
        doc="micro-batches per optimizer step (or `batch_size` / `micro_batch_size`)",
    ),
    Rule(
        ("gradient_checkpointing", "activation_offloading"),
        "checkpointing",
        _checkpointing,
        _write_checkpointing,
        doc="`gradient_checkpointing: true` is `on`; `offload` / `offload_disk` and `activation_offloading` are `offload` "
        "(layer inputs in host memory)",
    ),
    Rule(
        ("gradient_checkpointing_kwargs",),
        "use_reentrant",
        _use_reentrant,
        doc="`use_reentrant` as the hf recipe's `use_reentrant` (unset: `on`, Axolotl's default for SFT; `off` with `rl` "
        "or `unfrozen_parameters`); reentrant checkpointing runs each layer's forward under no_grad, so LLM.int8 "
        "layers keep no inputs of their own",
    ),
    optimizer_rule(
        "optimizer",
        {
            "optimi_adamw": Planned("adamw", "optimi's AdamW keeps AdamW's two states", modelled=True),
            "ao_adamw_8bit": Planned(
                "adamw8bit", "torchao's 8-bit AdamW: planned as bitsandbytes' (two 8-bit states)", modelled=True
            ),
            "ao_adamw_4bit": Planned("adamw8bit", "torchao's 4-bit AdamW (two 4-bit states): planned as 8-bit AdamW"),
            "ao_adamw_fp8": Planned(
                "adamw8bit", "torchao's fp8 AdamW (two fp8 states): planned as 8-bit AdamW", modelled=True
            ),
            "adopt_adamw": Planned("adamw", "ADOPT keeps AdamW's two states", modelled=True),
            "came_pytorch": Planned("adamw", "CAME (factored states): planned as AdamW"),
            "muon": Planned("adamw", "Muon (one momentum state for matrices): planned as AdamW"),
            "dion": Planned("adamw", "Dion (low-rank momentum): planned as AdamW"),
            "sinkgd": Planned("adamw", "SinkGD: planned as AdamW"),
            "flash_adamw": Planned("adamw", "FlashAdamW (compressed states): planned as AdamW"),
            "flash_adam": Planned("adamw", "FlashAdam (compressed states): planned as AdamW"),
            "flash_sgd": Planned("sgd", "FlashSGD: planned as SGD", modelled=True),
            "flash_sgdw": Planned("sgd", "FlashSGDW: planned as SGD", modelled=True),
            "flash_lion": Planned("adamw", "FlashLion (one state): planned as AdamW"),
            "q_galore_adamw8bit": Planned(
                "adamw8bit", "Q-GaLore (low-rank projected 8-bit states): planned as 8-bit AdamW"
            ),
        },
    ),
    adamw_impl_rule("optimizer", tool_default="adamw_torch_fused"),
    Rule(
        ("bf16", "fp16", "bfloat16", "float16", "float32"),
        "precision",
        _precision,
        doc="the dtype Axolotl loads the model in: bf16 (`bf16: true`, `auto` (unless `fp16`), `full`, or `bfloat16`), "
        "fp16, otherwise fp32; the Trainer's autocast on it (`bf16: full` without). A full fine-tuning trains that "
        "dtype: `bf16` is pure bf16 (weights, gradients and AdamW states; the embeddings, head and norms Axolotl "
        "keeps in fp32 under sdpa or eager attention are listed), `bf16-mixed` under DeepSpeed (fp32 master "
        "weights) and FSDP (which upcasts trained parameters to fp32); LoRA and QLoRA a base in that dtype with "
        "fp32 adapters; `float32` matters only to QLoRA under FSDP (listed); `tf32` does not change memory",
    ),
    Rule(("max_grad_norm",), "max_grad_norm", _max_grad_norm, doc="gradient clipping (0 or null: none)"),
    Rule(
        _ATTENTION_KEYS,
        "padding_free",
        _attention,
        doc="attention: flash attention (and xformers, sage, flex; `batch_flattening`) as `padding_free: on` (each "
        "example's attention on its own tokens, no [seq x seq] mask); sdpa as padded batches; eager and fp8 listed",
    ),
    Rule(
        ("sample_packing",),
        "packing",
        lambda v, ctx: value_of(v, "sample_packing", as_bool, None),
        doc="packed rows of `sequence_len` tokens (planned full)",
    ),
    Rule(
        (
            "plugins",
            "liger_fused_linear_cross_entropy",
            "cut_cross_entropy",
            "chunked_cross_entropy",
            "chunked_cross_entropy_num_chunks",
        ),
        "hf_loss",
        _hf_loss,
        doc="the loss: Liger's fused linear cross-entropy (the Liger plugin with `liger_fused_linear_cross_entropy`) as "
        "`hf_loss: liger`; Cut Cross-Entropy planned as Liger's; `chunked_cross_entropy` (SFT) as `chunked-ce`, "
        "torchtune's compiled chunked loss over the model's logits",
    ),
    not_modelled(
        "liger_rms_norm",
        "liger_glu_activation",
        "liger_swiglu",
        "liger_rope",
        "liger_layer_norm",
        "liger_cross_entropy",
        "liger_rms_norm_gated",
        why="Liger's fused RMSNorm / SwiGLU / RoPE / cross-entropy kernels keep less for backward than the model's "
        "own modules, which are planned",
    ),
    Rule(
        ("rl",),
        "objective",
        _objective,
        matters=lambda values: truthy(values["rl"]),
        unmodelled="preference training runs chosen and rejected completions, and for DPO a reference pass; planned as "
        "supervised fine-tuning",
        doc="preference training: `rl: dpo` (and `ipo`, DPO's loss on the same step) as `dpo`, `orpo`, `simpo`; `rl: "
        "grpo` as `grpo` (its `trl:` block's GRPOConfig keys, `micro_batch_size` counting completions, planned with "
        "memfit's step); other trainers (`kto`, `gdpo`, `ebft`) listed and planned as supervised fine-tuning; "
        "`micro_batch_size` counts pairs",
    ),
    Rule(
        ("rl",),
        "recipe",
        lambda values, ctx: Planned("memfit", grpo.RECIPE_NOTE, modelled=True) if _is_grpo(ctx) else None,
        doc="`rl: grpo` planned with memfit's step",
    ),
    *(_grpo_rule(knob) for knob in grpo.KNOB_KEYS),
    Rule(
        ("precompute_ref_log_probs",),
        "precompute_reference",
        _precompute_reference,
        doc="DPO's reference log-probs computed once before training: no reference pass, and no frozen copy for full "
        "fine-tuning",
    ),
    not_modelled(
        "dpo_use_liger_kernel",
        why="Liger's fused preference loss: planned as the trainer's log-probs over the whole logits",
    ),
    not_modelled("dpo_padding_free", why="a preference batch in one row without padding: planned as padded rows"),
    not_modelled(
        "kd_trainer",
        "reward_model",
        "process_reward_model",
        why="a trainer other than supervised, preference or GRPO fine-tuning (distillation, reward modelling)",
    ),
    not_modelled("torch_compile", why="a compiled step fuses kernels and keeps other tensors for backward"),
    not_modelled(
        "tiled_mlp",
        why="Axolotl's tiled MLP runs the MLP a chunk of tokens at a time (memfit's step has its own, the "
        "hf recipe none)",
    ),
    not_modelled(
        "lora_mlp_kernel",
        "lora_qkv_kernel",
        "lora_o_kernel",
        "lora_embedding_kernel",
        why="Axolotl's fused LoRA kernels keep less for backward than PEFT's layers, which are planned",
    ),
    not_modelled(
        "use_kernels",
        "use_scattermoe",
        "use_sonicmoe",
        "fused_attn_kernel",
        "flash_attn_fuse_mlp",
        "flash_attn_rms_norm",
        "flash_attn_cross_entropy",
        "use_dsv4_kernels",
        "use_glm_dsa_kernels",
        why="custom kernels in place of the model's modules",
    ),
    not_modelled(
        "fp8",
        "fp8_enable_fsdp_float8_all_gather",
        "qat",
        "model_quantization_config",
        "quantize_moe_experts",
        "nonexpert_quantization",
        "use_onebitllms",
        why="fp8 or quantization-aware training: other weight and activation dtypes",
    ),
    not_modelled(
        "tensor_parallel_size",
        "context_parallel_size",
        "expert_parallel_size",
        "dp_shard_size",
        "dp_replicate_size",
        when=lambda v: truthy(v) and str(v) not in ("1", "1.0"),
        why="tensor, context, sequence or expert parallelism splits the model or the sequence across GPUs",
    ),
    not_modelled(
        "sequence_parallel_degree",
        when=lambda v: truthy(v) and str(v) not in ("1", "1.0"),
        # memfit's own sequence parallelism needs its one-row micro-batches (recipe memfit); an Axolotl
        # config is planned as the hf recipe runs it, which pads its rows.
        why="Axolotl's ring attention shares each row among that many GPUs; planned with whole rows on each GPU (memfit "
        "plans an Axolotl config on the hf recipe, which its sequence_parallel does not run); memfit's own: "
        "memfit plan MODEL --gpus N --sequence-parallel N",
    ),
    not_modelled(
        "relora",
        "lisa_n_layers",
        "unfrozen_parameters",
        "peft_layers_to_transform",
        "lora_target_parameters",
        "spectrum_top_fraction",
        "lora_rank_pattern",
        "lora_alpha_pattern",
        "peft_layer_replication",
        "use_mora",
        "optim_target_modules",
        why="trains another set of parameters than the method's (some layers, some modules, experts, or with another "
        "rank)",
    ),
    not_modelled(
        "layer_offloading",
        "lora_on_cpu",
        "max_memory",
        "gpu_memory_limit",
        "device_map",
        when=lambda v: truthy(v) and str(v).lower() not in ("auto",),
        why="places parts of the model in host memory or on other devices",
    ),
    not_modelled(
        "embeddings_skip_upcast",
        "fp32_norms",
        "fp32_norm_classes",
        when=lambda v: v is not None,
        why="keeps other modules in another dtype than the training dtype",
    ),
    Rule(
        ("image_size",),
        "image_max_pixels",
        lambda v, ctx: value_of(v, "image_size", _image_pixels, None),
        doc="vision-language models: the size images are resized to (`512`: a padded 512 x 512 square; `[width, "
        "height]`), planned as the most pixels an image keeps",
    ),
    Rule(
        ("freeze_mm_modules", "processor_type", "image_size", "adapter", "lora_target_linear", "lora_target_modules"),
        "freeze_vision",
        _freeze_vision,
        doc="vision-language models (a `processor_type` or an `image_size`): the tower and projector frozen with "
        "`freeze_mm_modules: true`; otherwise trained as Axolotl trains them: whole by a full fine-tuning, with "
        "LoRA where `lora_target_linear: true` or the modules listed name their layers (a pattern on "
        "`language_model` alone leaves them frozen)",
    ),
    routing_rule("overrides_of_model_config"),
    Rule(
        ("overrides_of_model_config", "overrides_of_model_kwargs", "rope_scaling"),
        None,
        matters=_other_overrides,
        unmodelled="changes the model's config.json, which is planned as published (but for the routing loss's fields)",
    ),
    not_modelled(
        "selective_checkpointing",
        "dynamic_checkpoint",
        why="checkpoints some of the layers: planned with every layer as gradient_checkpointing says",
    ),
    not_modelled(
        "deepcompile",
        "relora_cpu_offload",
        "llmcompressor",
        "diffusion",
        "ebft",
        "dense_mixer",
        "mora",
        "lisa_layers_attribute",
        "moe_grouped_backend",
        "moe_dequant_chunk_size",
        "expert_backend",
        "experts_implementation",
        why="changes the step in ways memfit does not simulate",
    ),
)

#: Every top-level key of Axolotl's config (the schema and its plugins' arguments at 067b021).
ALL_KEYS = frozenset(
    """
accelerator_config activation_offloading adam_beta1 adam_beta2 adam_beta3 adam_epsilon adam_epsilon2 adapter
added_tokens_overrides api_key attn_implementation auto_find_batch_size auto_resume_from_checkpoints axolotl_config_path
backend base_model base_model_config base_url batch_flattening batch_size bench_dataset bench_split bf16 bfloat16
bnb_config_kwargs capabilities center_rewards_coefficient chat_template chat_template_jinja chat_template_kwargs
chunked_cross_entropy chunked_cross_entropy_num_chunks cls_model_config comet_api_key comet_experiment_config
comet_experiment_key comet_mode comet_online comet_project_name comet_workspace context_parallel_size cosine_constant_lr_ratio
cosine_min_lr_ratio cpo_alpha curriculum_sampling cut_cross_entropy dataloader_drop_last dataloader_num_workers
dataloader_pin_memory dataloader_prefetch_factor dataset_exact_deduplication dataset_keep_in_memory dataset_num_proc
dataset_prepared_path dataset_processes dataset_shard_idx dataset_shard_num datasets ddp ddp_broadcast_buffers
ddp_bucket_cap_mb ddp_find_unused_parameters ddp_timeout deepcompile deepspeed default_system_message dense_mixer device
device_map diffusion dion_lr dion_momentum dion_rank_fraction dion_rank_multiple_of do_bench_eval do_causal_lm_eval
dp_replicate_size dp_shard_size dpo_beta dpo_generate_during_eval dpo_label_smoothing dpo_loss_type dpo_loss_weights
dpo_norm_loss dpo_padding_free dpo_use_liger_kernel dpo_use_logits_to_keep dpo_use_weighting dsv4_bf16_all
dsv4_fp4_grouped_mode dsv4_fp8_lora_kernel dsv4_fp8_nonexpert_mode dsv4_shared_mlp_lora_kernel dynamic_checkpoint eaft_alpha
eaft_k eager_attention early_stopping_patience ebft embedding_lr embedding_lr_scale embeddings_skip_upcast env_capabilities
eot_tokens eps eval_batch_size eval_causal_lm_metrics eval_max_new_tokens eval_sample_packing eval_sequence_len eval_steps
eval_strategy eval_table_size evals_per_epoch evaluation_strategy excess_length_strategy experimental_skip_move_to_device
expert_backend expert_parallel_backend expert_parallel_fallback_on_unsupported expert_parallel_num_nvl_bytes
expert_parallel_num_rdma_bytes expert_parallel_size expert_parallel_token_capacity experts_implementation fix_untrained_tokens
flash_attention flash_attn_cross_entropy flash_attn_d512 flash_attn_fuse_mlp flash_attn_rms_norm flash_optimum flex_attention
flex_attn_compile_kwargs float16 float32 fp16 fp32_norm_classes fp32_norms fp8 fp8_enable_fsdp_float8_all_gather freeze_mm_modules
fsdp fsdp_config fsdp_final_state_dict_type fsdp_version fused_attn_kernel future_timeout gc_collect_steps gc_steps
gemma4_fp8_nonexpert gemma4_hybrid_attn_impl gemma4_nf4_nonexpert generate_samples generation_do_sample generation_interval
generation_max_length generation_max_new_tokens generation_prompt_ratio generation_steps generation_temperature
generation_top_k generation_top_p gptq gpu_memory_limit gradient_accumulation_steps gradient_checkpointing
gradient_checkpointing_kwargs gradio_max_new_tokens gradio_server_name gradio_server_port gradio_share gradio_temperature
gradio_title greater_is_better grokfast_alpha grokfast_lamb group_by_length hatchery heads_k_stride hf_mlflow_log_artifacts
hf_use_auth_token hub_model_id hub_revision hub_strategy image_resize_algorithm image_size importance_weighting include_tkps
include_tokens_per_second is_falcon_derived_model is_llama_derived_model is_mistral_derived_model is_preprocess
is_qwen_derived_model jagged_restart_anneal_steps jagged_restart_steps jagged_restart_warmup_steps kd_alpha kd_beta kd_ce_alpha
kd_normalize_topk kd_online_server kd_online_server_base_url kd_online_timeout kd_online_topk kd_temperature kd_temperature_min
kd_trainer kto_desirable_weight kto_undesirable_weight large_head_attention layer_offloading learning_rate
liger_cross_entropy liger_fused_linear_cross_entropy liger_glu_activation liger_layer_norm liger_rms_norm liger_rms_norm_gated
liger_rope liger_swiglu liger_use_token_scaling lisa_layers_attribute lisa_n_layers lisa_step_interval
llama4_linearized_experts llmcompressor lm_eval_batch_size lm_eval_model lm_eval_post_train lm_eval_tasks
load_best_model_at_end load_in_4bit load_in_8bit local_rank logging_steps lora_alpha lora_alpha_pattern lora_dropout
lora_embedding_kernel lora_fan_in_fan_out lora_mlp_kernel lora_model_dir lora_modules_to_save lora_o_kernel lora_on_cpu
lora_qkv_kernel lora_r lora_rank lora_rank_pattern lora_target_linear lora_target_modules lora_target_parameters
loraplus_lr_embedding loraplus_lr_ratio loss_fn loss_fn_config loss_watchdog_patience loss_watchdog_threshold
low_cpu_mem_usage lr_div_factor lr_groups lr_quadratic_warmup lr_scheduler lr_scheduler_kwargs mask_token_id mask_token_str
max_grad_norm max_mask_ratio max_memory max_packed_sequence_len max_prompt_len max_sample_tokens max_steps
mean_resizing_embeddings merge_lora merge_method metric_for_best_model micro_batch_size min_mask_ratio min_sample_len
mlflow_experiment_name mlflow_run_name mlflow_tracking_uri model_config model_kwargs model_quantization_config
model_quantization_config_kwargs model_revision model_type moe_bnb_fast moe_dequant_chunk_size moe_grouped_backend mora
mora_type multipack_real_batches neftune_noise_alpha nemo_gym_auto_clone nemo_gym_auto_start nemo_gym_config_paths
nemo_gym_datasets nemo_gym_dir nemo_gym_enabled nemo_gym_head_port nemo_gym_max_turns nemo_gym_model_name
nemo_gym_multi_turn nemo_gym_run_timeout nemo_gym_server_timeout nemo_gym_verify_timeout noise_schedule noisy_embedding_alpha
nonexpert_quantization num_dataset_shards_to_save num_diffusion_steps num_epochs num_generation_samples num_labels num_samples
nvfp4_merge_aware nvfp4_merge_aware_start_step optim_args optim_target_modules optimizer orpo_alpha otel_metrics_host
otel_metrics_port output_dir overrides_of_model_config overrides_of_model_kwargs pad_to_multiple_of pad_to_sequence_len peft
peft_autocast_adapter_dtype peft_ensure_weight_tying peft_init_lora_weights peft_layer_replication peft_layers_pattern
peft_layers_to_transform peft_trainable_token_indices peft_use_dora peft_use_rslora pipeline plugins pose_max_context_len
pose_num_chunks pose_split_on_token_ids precompute_ref_log_probs preprocess_iterable pretrain_multipack_attn
pretrain_multipack_buffer_size pretraining_dataset pretraining_sample_concatenation process_reward_model processor_kwargs
processor_type profiler_steps profiler_steps_start project_id push_dataset_to_hub qat qgalore_cos_threshold qgalore_gamma_proj
qgalore_proj_bits qgalore_proj_group_size qgalore_proj_quant qgalore_proj_type qgalore_queue_size qgalore_rank qgalore_scale
qgalore_update_proj_gap qlora_sharded_model_loading quantization quantize_moe_experts ray_num_workers ray_run_name recipe
reinit_weights relora relora_cpu_offload relora_prune_method relora_prune_ratio remove_unused_columns
resize_token_embeddings_to_32x resources_per_worker resume_from_checkpoint revision_of_model reward_funcs reward_model
ring_attn_func rl rl_beta role_boundaries rope_scaling rpo_alpha s2_attention sage_attention sample_packing
sample_packing_bin_size sample_packing_eff_est sample_packing_group_size sample_packing_mp_start_method
sample_packing_sequentially sample_temperature save_compressed save_first_step save_name_prefix save_only_model
save_safetensors save_steps save_strategy save_total_limit saves_per_epoch scaling_softmax scaling_softmax_bias
scaling_softmax_factor sdp_attention sdpa_varlen seed selective_checkpointing sequence_len sequence_parallel_degree
shrink_embeddings shuffle_before_merging_datasets shuffle_merged_datasets simpo_gamma skip_prepare_dataset special_tokens
spectrum_model_name spectrum_top_fraction streaming streaming_multipack_buffer_size strict swanlab_api_host swanlab_api_key
swanlab_completion_log_interval swanlab_completion_max_buffer swanlab_description swanlab_experiment_name swanlab_lark_secret
swanlab_lark_webhook_url swanlab_log_completions swanlab_log_model swanlab_mode swanlab_project swanlab_web_host
swanlab_workspace tensor_parallel_size test_datasets tf32 tiled_mlp tiled_mlp_num_shards tiled_mlp_use_original_mlp
tokenizer_config tokenizer_legacy tokenizer_save_jinja_files tokenizer_type tokenizer_use_fast tokenizer_use_mistral_common
tokens torch_compile torch_compile_backend torch_compile_mode torch_compile_options torch_empty_cache_steps torchdistx_path
total_num_tokens total_supervised_tokens trackio_project_name trackio_run_name trackio_space_id train_attn train_mlp
train_on_inputs train_unembed trainer_cls trl trust_remote_code type_of_model unfrozen_parameters use_comet use_dsv4_kernels
use_eaft use_glm_dsa_kernels use_kernels use_mlflow use_mora use_onebitllms use_otel_metrics use_pose use_ray use_scattermoe
use_sonicmoe use_swanlab use_tensorboard use_trackio use_wandb val_set_size vllm wandb_entity wandb_log_model wandb_mode
wandb_name wandb_project wandb_run_id wandb_watch warmup_ratio warmup_steps weight_decay world_size xformers_attention
""".split()
)

#: Keys whose values Axolotl checks against names (its config schema at 067b021).
CHOICES: tuple[Choices, ...] = (
    Choices("rl", RL_TYPES, "an RL trainer Axolotl knows", "Axolotl's `RLType`, 067b021"),
    Choices(
        "dpo_loss_type",
        DPO_LOSSES,
        "a DPO loss_type TRL's DPOConfig takes",
        "TRL 1.16's `DPOConfig.loss_type`, which Axolotl passes on",
        many=True,
    ),
    Choices(
        "attn_implementation",
        ATTENTION_NAMES,
        "an attention implementation Axolotl takes",
        "Axolotl's `CANONICAL_ATTN_IMPLS`, 067b021, or a Hub kernel's path",
        also=lambda name: "/" in name,
    ),
    lr_scheduler_choices("lr_scheduler", "Axolotl", ("one_cycle", "rex")),
)

KEYMAP = KeyMap(
    tool="axolotl",
    title="Axolotl",
    rules=RULES,
    quiet_keys=ALL_KEYS - frozenset(k for rule in RULES for k in rule.keys),
    docs_url="https://docs.axolotl.ai/docs/config-reference.html",
    choices=CHOICES,
)
