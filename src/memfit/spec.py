"""One validated description of a fine-tuning run: every knob the planner and the trainer share.

``RunSpec`` is the single place that declares the knobs: each field's type (a ``Literal`` lists its
choices), default and help. Everything else is derived from it: the choice lists
(:func:`choices`), the command-line options of ``memfit plan``, ``fit`` and ``train``
(:mod:`memfit.options`), the knob fields of a training YAML (:mod:`memfit.train.config`). Adding a
knob means adding a field here, plus the code that uses it.

Bad values are all collected and raised at once as a :class:`SpecError` whose lines name the
field, the value and the fix, before anything expensive runs. Each message exists once and is
spelled as the user wrote the knob: ``--batch-size 4`` on a command line, ``batch_size: 4`` in a
training YAML (``make_spec(spelling=...)``).
"""

from __future__ import annotations

import difflib
import math
import re
import typing
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from memfit.errors import UserError, listed, shown

#: ``--tiling auto`` tiles the MLP from this many tokens a micro-batch: below it the MLP's
#: intermediates are small next to the rest of the step, and tiling would only add recomputation.
TILING_AUTO_TOKENS = 8192

#: The most tokens one micro-batch may hold (``batch_size x seq_len``), 16M: far beyond any real run
#: on one GPU, and about what a plan handles in a minute and 2 GB of host memory (it makes the
#: micro-batch's examples as the trainer does, token by token). The knobs' own bounds (``at_most``)
#: are chosen alike: a plan at the bound takes minutes at most, never an overflow or all the memory.
MAX_MICRO_BATCH_TOKENS = 2**24

#: ``--targets all-linear`` means every linear layer inside the decoder blocks (not the output head).
ALL_LINEAR = "all-linear"


def knob(
    default: Any,
    help: str,
    *,
    short: str | None = None,
    example: Any = None,
    planner_only: bool = False,
    at_most: int | None = None,
) -> Any:
    """A :class:`RunSpec` field: its default and help, and how it appears elsewhere.

    ``short``: a one-letter command-line alias (``-b``); ``example``: a good value to suggest in an
    error message; ``planner_only``: a knob the planner takes and the trainer does not (it is left
    out of the training YAML); ``at_most``: the largest value a whole-number knob takes (pydantic's
    ``le``), far above any real run, so that a slip of the keyboard is one clear error rather than
    an overflow deep in PyTorch or a plan that runs for hours.
    """
    extra = {"short": short, "example": example, "planner_only": planner_only}
    return Field(
        default,
        description=help,
        le=at_most,
        json_schema_extra={k: v for k, v in extra.items() if v not in (None, False)},
    )


class SpecError(UserError, ValueError):
    """One or more bad knobs. ``problems`` holds one line per problem, each naming field, value and fix."""

    heading = "invalid run configuration"

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__(listed(self.heading, problems))


class RunSpec(BaseModel):
    """The knobs of a fine-tuning run that decide its memory.

    Sizes are per GPU: ``batch_size`` is the micro-batch one GPU processes in one forward pass;
    ``grad_accum`` micro-batches make one optimizer step.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Literal["full", "lora", "qlora", "lora-8bit"] = knob(
        "lora",
        "Fine-tuning method: full (every weight), lora (adapters on the frozen base), qlora (adapters on a 4-bit NF4 "
        "base) or lora-8bit (adapters on an 8-bit LLM.int8 base: load_in_8bit with adapter: lora in Axolotl).",
    )
    rank: int = knob(16, "LoRA rank r (lora, qlora, lora-8bit).", example=16, at_most=65536)
    alpha: float | None = knob(None, "LoRA alpha (default: 2 x rank).", example=32)
    dropout: float = knob(0.0, "LoRA dropout probability.", example=0.05)
    targets: tuple[str, ...] = knob(
        (ALL_LINEAR,), "Modules LoRA attaches to: comma-separated names, or all-linear.", example="q_proj,v_proj"
    )
    dora: bool = knob(
        False,
        "DoRA (PEFT's use_dora): a trained magnitude per output row of each adapted layer, and each forward "
        "recomputes the norm of every adapted weight with its update (weight-sized temporaries).",
    )
    rslora: bool = knob(
        False, "Rank-stabilized LoRA (PEFT's use_rslora): the update is scaled by alpha/sqrt(rank), not alpha/rank."
    )
    modules_to_save: tuple[str, ...] = knob(
        (),
        "Modules trained whole beside the adapters (PEFT's modules_to_save), comma-separated, e.g. embed_tokens,lm_head: "
        "PEFT trains a copy of each (the frozen original stays), with its gradients and optimizer states. On a model whose "
        "embeddings and head are one tensor, one copy serves both.",
        example="embed_tokens,lm_head",
    )
    precision: Literal["bf16", "fp16", "fp32", "bf16-mixed", "fp16-mixed"] = knob(
        "bf16",
        "bf16 / fp16: pure 16-bit weights, gradients and optimizer states. bf16-mixed / fp16-mixed: fp32 weights and "
        "optimizer states, 16-bit autocast (HF Trainer bf16=True / fp16=True); a frozen LoRA base stays 16-bit. fp32. "
        "LoRA adapters are fp32 in all.",
    )
    optimizer: Literal["adamw", "adamw8bit", "paged-adamw8bit", "sgd"] = knob(
        "adamw", "Optimizer (8-bit and paged states need bitsandbytes)."
    )
    batch_size: int = knob(
        1, "Micro-batch size per GPU (sequences in one forward pass).", short="-b", example=4, at_most=65536
    )
    seq_len: int = knob(
        2048,
        "Tokens per sequence, a vision-language model's image tokens included (plan: without it, such a model's "
        "rows hold its images beside 2048 tokens of text).",
        short="-s",
        example=2048,
        at_most=MAX_MICRO_BATCH_TOKENS,
    )
    # A plan makes and holds a step's micro-batches as the trainer does: 4096 of them take minutes.
    grad_accum: int = knob(1, "Micro-batches per optimizer step.", example=8, at_most=4096)
    checkpointing: Literal["off", "on", "offload"] = knob(
        "on", "Activation checkpointing (offload: the saved layer inputs in host memory)."
    )
    gpus: int = knob(1, "GPUs the run uses (memory is planned per GPU).", example=2, at_most=65536)
    shard: Literal["none", "ddp", "zero1", "zero2", "zero3", "fsdp", "fsdp-offload"] = knob(
        "none", "Sharding across GPUs."
    )
    sequence_parallel: int = knob(
        1,
        "Sequence parallelism (DeepSpeed-Ulysses): groups of this many GPUs share each row, each holding 1/N of its "
        "tokens outside attention and all of them for 1/N of the heads inside it; data-parallel degree gpus / N.",
        example=2,
        at_most=65536,
    )
    tiling: Literal["auto", "on", "off"] = knob(
        "auto", f"Sequence-tiled MLPs and norms (auto: from {TILING_AUTO_TOKENS:,} tokens a micro-batch)."
    )
    step_in_backward: bool = knob(False, "Full fine-tuning: each parameter's optimizer step runs inside backward.")
    packing: bool = knob(
        False, "Concatenate examples into rows of exactly seq_len tokens (attention kept inside each example)."
    )
    padding_free: Literal["auto", "on", "off"] = knob(
        "auto",
        "The examples of a micro-batch in one row, attention kept inside each example, no padding (auto: where the model's attention allows it; the hf recipe only with on: flash attention's varlen path).",
    )
    max_grad_norm: float | None = knob(1.0, "Clip gradients to this L2 norm (none: no clipping).", example=1.0)
    objective: Literal["sft", "dpo", "orpo", "simpo", "grpo"] = knob(
        "sft",
        "Training objective: sft (next-token loss), or a preference objective on chosen / rejected pairs: dpo (against "
        "a reference model: the base with adapters disabled, or a frozen copy for full), orpo or simpo (no reference). "
        "batch_size then counts pairs. grpo: online RL (TRL's GRPOTrainer): completions generated from prompts, scored "
        "by reward functions; batch_size then counts completions.",
    )
    beta: float | None = knob(
        None,
        "The objective's beta (TRL's name): dpo, orpo, simpo: their loss weight (default 0.1); grpo: the KL coefficient "
        "(default 0.0: no reference model; above 0 a reference pass in every step, the base with adapters disabled, or a "
        "frozen copy for full).",
        example=0.04,
    )
    num_generations: int = knob(
        8,
        "grpo: completions sampled per prompt (TRL GRPOConfig num_generations); batch_size x grad_accum (the "
        "generation batch) holds whole groups of them.",
        example=8,
        at_most=4096,
    )
    max_completion_length: int = knob(
        512,
        "grpo: the longest completion generated, in tokens (TRL GRPOConfig max_completion_length); seq_len is the "
        "prompt's budget plus this.",
        example=256,
        at_most=MAX_MICRO_BATCH_TOKENS,
    )
    num_iterations: int = knob(
        1,
        "grpo: optimizer steps taken on each generation batch (TRL's num_iterations, mu); above 1 the old policy's "
        "log-probs are computed once after generating, and clipping applies.",
        example=1,
        at_most=1024,
    )
    temperature: float = knob(
        1.0, "grpo: sampling temperature; the log-probs are taken at it too (TRL GRPOConfig temperature).", example=1.0
    )
    top_p: float = knob(
        1.0, "grpo: nucleus sampling's probability mass (TRL GRPOConfig top_p; 1.0: every token).", example=1.0
    )
    use_vllm: bool = knob(
        False,
        "grpo: generate with vLLM as TRL does (planned from vLLM's rules, not simulated; memfit "
        "train generates with transformers).",
        planner_only=True,
    )
    vllm_mode: Literal["colocate", "server"] = knob(
        "colocate",
        "grpo with use_vllm: colocate (vLLM in the training process, on the same GPU) or server (a vLLM server "
        "on GPUs of its own).",
        planner_only=True,
    )
    vllm_gpu_memory_utilization: float = knob(
        0.3,
        "grpo with use_vllm colocate: the share of the GPU's memory vLLM takes (TRL's vllm_gpu_memory_utilization; "
        "vLLM's gpu_memory_utilization).",
        example=0.3,
        planner_only=True,
    )
    vllm_enable_sleep_mode: bool = knob(
        False,
        "grpo with use_vllm colocate: vLLM sleeps while the policy trains (its weights to host memory, its KV "
        "cache freed; TRL's vllm_enable_sleep_mode).",
        planner_only=True,
    )
    precompute_reference: bool = knob(
        False,
        "dpo: the reference log-probs in one pass before training (kept in the run folder) instead of a reference pass "
        "in every step; full fine-tuning then keeps no frozen copy of the model.",
    )
    # Vision-language models (memfit.models.vision); a text model takes none of them.
    images: int = knob(
        1,
        "Vision-language models: images in each example (the plan's examples hold this many).",
        example=4,
        at_most=1024,
    )
    image_max_pixels: int = knob(
        768 * 768,
        "Vision-language models: the most pixels an image keeps after the processor resizes it (LLaMA-Factory's "
        "image_max_pixels; Qwen's max_pixels); its tokens follow from the model's processor rules.",
        example=589824,
        at_most=2**28,
    )
    freeze_vision: bool = knob(
        True,
        "Vision-language models: the vision tower and projector frozen (LLaMA-Factory's freeze_vision_tower); false: "
        "trained (whole with full, LoRA where targets name their modules).",
    )
    vision_checkpointing: Literal["auto", "on", "off"] = knob(
        "auto",
        "Vision-language models: activation checkpointing of the vision tower's blocks (auto: as checkpointing; with "
        "checkpointing even a frozen tower keeps its activations unless its blocks are checkpointed too).",
    )
    recipe: Literal["memfit", "hf"] = knob(
        "memfit", "memfit's step, or hf: the plain Hugging Face + PEFT step, for comparison.", planner_only=True
    )
    kbit_upcast: bool = knob(
        True,
        "The hf recipe's QLoRA and lora-8bit through PEFT's prepare_model_for_kbit_training, which upcasts every parameter that is not quantized to fp32 (as TRL before 0.22 prepared it); off: they stay in the compute dtype (LLaMA-Factory, TRL since 0.22, and Axolotl, which casts them back after PEFT's upcast).",
        planner_only=True,
    )
    use_reentrant: Literal["auto", "on", "off"] = knob(
        "auto",
        "The hf recipe's activation checkpointing: on is torch's reentrant variant (the layer's forward under no_grad, "
        "nothing an autograd function keeps on its own outlives it; transformers before 5, PEFT's "
        "prepare_model_for_kbit_training, LLaMA-Factory's use_reentrant_gc), off the non-reentrant one (LLM.int8 layers "
        "then keep every layer's inputs); auto: as the hf recipe prepares the model (on through "
        "prepare_model_for_kbit_training, else off). memfit's step is always off.",
        planner_only=True,
    )
    adapter_dtype: Literal["fp32", "compute"] = knob(
        "fp32",
        "The hf recipe's adapter weights, and so their gradients and optimizer states: fp32 (PEFT's autocast_adapter_dtype, its default, as memfit's step keeps them) or compute (the compute dtype, bf16 or fp16: torchtune's LoRA and QLoRA, TRL's adapters on a quantized base, PEFT's autocast_adapter_dtype=False over a 16-bit or 4-bit base).",
        planner_only=True,
    )
    adamw_impl: Literal["fused", "foreach"] = knob(
        "fused",
        "The hf recipe's AdamW implementation: fused (PyTorch's fused kernel, updating in place: the Trainer's adamw_torch_fused, its default optim from torch 2.8, and memfit's step) or foreach (torch.optim.AdamW's default on CUDA, the Trainer's adamw_torch, its default before torch 2.8: its step holds a temporary as large as the trainable parameters).",
        planner_only=True,
    )
    hf_loss: Literal[
        "model",
        "liger",
        "chunked-nll",
        "chunked-output",
        "chunked-output-compiled",
        "chunked-ce",
        "model-4.46",
        "model-4.45",
    ] = knob(
        "model",
        "The hf recipe's loss: model (the model's own, over the whole logits, as transformers 4.50 and later compute it), model-4.46 (transformers 4.46 to 4.49: a shifted fp32 copy of the logits besides), model-4.45 (transformers 4.45 and before: the model returns fp32 logits, and the shifted copy), liger (Liger Kernel's fused linear cross-entropy), chunked-nll (TRL SFTTrainer's chunked loss), chunked-output (torchtune's CEWithChunkedOutputLoss: 8 chunks of 16-bit logits kept, each chunk's fp32 log-probabilities too), chunked-output-compiled (the same under torchtune's compile: true, whose fused cross-entropy keeps no fp32 copy) or chunked-ce (Axolotl's chunked_cross_entropy: that compiled loss over the model's whole 16-bit logits).",
        planner_only=True,
    )

    @field_validator("targets", "modules_to_save", mode="before")
    @classmethod
    def _split_names(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, str):
            if info.field_name == "modules_to_save" and _means_none(value):
                return ()
            value = [part.strip() for part in value.split(",") if part.strip()]
        names = value if isinstance(value, (list, tuple)) else ()
        for name in names:
            if isinstance(name, str) and (len(name) > MAX_MODULE_NAME_CHARS or any(c.isspace() for c in name)):
                # No module is named so: a list written with spaces, or a paste gone wrong. (The
                # message already shows the value when it is this one name.)
                which = "not" if len(names) == 1 else f"{shown(name)} is not"
                raise ValueError(f"{which} a module name; separate names with commas (e.g. q_proj,v_proj)")
        return value

    @model_validator(mode="after")
    def _check_combinations(self, info: ValidationInfo) -> RunSpec:
        name, setting = _spellers((info.context or {}).get("spelling", "flag"))
        problems = []
        if self.method == "qlora" and self.precision == "fp32":
            problems.append(
                f"{name('precision')}: fp32 cannot be used with {setting('method', 'qlora')}: 4-bit weights are dequantized "
                f"to a 16-bit compute dtype. Use {setting('precision', 'bf16')} (or fp16 on cards without bf16)."
            )
        if self.method == "full" and self.precision == "fp16":
            problems.append(
                f"{name('precision')}: fp16 is not supported for {setting('method', 'full')}: pure fp16 weights and "
                f"optimizer states overflow and underflow. Use {setting('precision', 'fp16-mixed')} (fp32 weights, fp16 "
                f"compute, loss scaling), bf16 or fp32."
            )
        if self.step_in_backward and self.scales_loss:
            problems.append(
                f"{name('step_in_backward')} cannot be used with {setting('precision', self.precision)}: fp16's loss scaler "
                f"must unscale and check every gradient before any update, and the step in backward updates each at once. "
                f"Use {setting('precision', 'bf16-mixed')} (or bf16), or drop {name('step_in_backward')}."
            )
        # The optimizer step in backward updates each parameter as soon as its gradient exists:
        # nothing may need all gradients first (accumulation here; clipping in the training config).
        if self.step_in_backward and self.method != "full":
            problems.append(
                f"{name('step_in_backward')}: only for {setting('method', 'full')} (got {setting('method', self.method)}): adapters' "
                f"gradients are small, there is nothing to save. Drop {name('step_in_backward')}."
            )
        if self.step_in_backward and self.grad_accum != 1:
            problems.append(
                f"{name('step_in_backward')}: needs {setting('grad_accum', 1)} (got {self.grad_accum}): each parameter is "
                "updated as soon as its gradient exists, so gradients cannot accumulate over micro-batches."
            )
        if self.step_in_backward and self.max_grad_norm is not None:
            problems.append(
                f"{setting('max_grad_norm', self.max_grad_norm)} cannot be used with {name('step_in_backward')}: each parameter "
                f"is updated before the global gradient norm exists. Use {setting('max_grad_norm', 'none')}, or drop "
                f"{name('step_in_backward')}."
            )
        if not self.kbit_upcast and self.recipe != "hf":
            problems.append(
                f"{name('kbit_upcast')}: off is a choice of the hf recipe's QLoRA and lora-8bit (memfit's step never upcasts the base). "
                f"Use {setting('recipe', 'hf')}, or drop it."
            )
        if self.adapter_dtype != "fp32" and (self.recipe != "hf" or not self.uses_adapters):
            problems.append(
                f"{setting('adapter_dtype', self.adapter_dtype)} is a choice of the hf recipe's adapters (memfit's step keeps "
                f"them in fp32). Use {setting('recipe', 'hf')} with {setting('method', 'lora')}, qlora or lora-8bit, or "
                f"drop {name('adapter_dtype')}."
            )
        if self.use_reentrant == "on" and self.recipe != "hf":
            problems.append(
                f"{setting('use_reentrant', 'on')} is a choice of the hf recipe (memfit's step checkpoints non-reentrant). "
                f"Use {setting('recipe', 'hf')}, or drop {name('use_reentrant')}."
            )
        if self.adamw_impl != "fused" and (self.recipe != "hf" or self.optimizer != "adamw"):
            problems.append(
                f"{name('adamw_impl')}: {self.adamw_impl} is an AdamW of the hf recipe (memfit's step always runs the fused "
                f"one). Use {setting('recipe', 'hf')} with {setting('optimizer', 'adamw')}, or drop {name('adamw_impl')}."
            )
        if self.hf_loss != "model" and self.recipe != "hf":
            problems.append(
                f"{name('hf_loss')}: {self.hf_loss} is a loss of the hf recipe (memfit's step always runs its own fused, "
                f"chunked loss). Use {setting('recipe', 'hf')}, or drop {name('hf_loss')}."
            )
        problems.extend(_adapter_problems(self, name, setting))
        # A pair is two sequences (chosen and rejected) in the same forward.
        sequences_per_example = 2 if self.is_preference else 1
        tokens = self.batch_size * sequences_per_example * self.seq_len
        if tokens > MAX_MICRO_BATCH_TOKENS:
            fewer = max(MAX_MICRO_BATCH_TOKENS // (sequences_per_example * self.seq_len), 1)
            pairs = " pairs (two sequences each)" if self.is_preference else ""
            problems.append(
                f"{setting('batch_size', self.batch_size)}{pairs} with {setting('seq_len', self.seq_len)} is {tokens:,} tokens a "
                f"micro-batch: must be at most {MAX_MICRO_BATCH_TOKENS:,} (e.g. {setting('batch_size', fewer)} with "
                f"{name('grad_accum')} to keep the examples per step)."
            )
        problems.extend(_objective_combinations(self, name, setting))
        problems.extend(_sequence_parallel_problems(self, name, setting))
        if self.shard != "none" and self.gpus < 2:
            problems.append(
                f"{name('shard')}: {self.shard} needs {setting('gpus', 2)} or more (got {setting('gpus', self.gpus)})."
            )
        if problems:
            raise ValueError("\n".join(problems))
        return self

    @property
    def weight_precision(self) -> str:
        """The format the model's parameters are stored in (see :func:`weight_precision`)."""
        return weight_precision(self.method, self.precision)

    @property
    def autocast_precision(self) -> str | None:
        """The 16-bit format forward runs in under autocast, or None (see :func:`autocast_precision`)."""
        return autocast_precision(self.precision, self.recipe)

    @property
    def scales_loss(self) -> bool:
        """Whether the step scales its loss (fp16's ``GradScaler``): fp16 and fp16-mixed."""
        return self.precision in ("fp16", "fp16-mixed")

    @property
    def precision_regime(self) -> str:
        """What ``precision`` means for this run, in words (see :func:`precision_regime`)."""
        return precision_regime(self.method, self.precision, self.recipe, self.kbit_upcast, self.adapter_dtype)

    @property
    def reentrant_checkpointing(self) -> bool:
        """Whether activation checkpointing runs torch's reentrant variant: ``use_reentrant`` as set, or on auto
        the hf recipe's way (PEFT's ``prepare_model_for_kbit_training`` calls it without ``use_reentrant``,
        which torch takes as reentrant); memfit's step never does."""
        if self.recipe != "hf" or self.checkpointing == "off":
            return False
        if self.use_reentrant == "auto":
            return self.base_bits is not None and self.kbit_upcast
        return self.use_reentrant == "on"

    @property
    def lora_alpha(self) -> float:
        """LoRA alpha in effect (2 x rank unless set)."""
        return float(self.alpha) if self.alpha is not None else 2.0 * self.rank

    @property
    def lora_scale(self) -> float:
        """What the LoRA update is multiplied by: alpha / rank, or alpha / sqrt(rank) with rsLoRA (PEFT's arithmetic)."""
        return self.lora_alpha / math.sqrt(self.rank) if self.rslora else self.lora_alpha / self.rank

    @property
    def uses_adapters(self) -> bool:
        """Whether the base is frozen and adapters train (lora, qlora, lora-8bit)."""
        return self.method in ADAPTER_METHODS

    @property
    def base_bits(self) -> int | None:
        """Bits a frozen base weight of the decoder's linear layers is stored in: 4 (qlora), 8 (lora-8bit), or None."""
        return QUANTIZED_BASE_BITS.get(self.method)

    @property
    def is_preference(self) -> bool:
        """Whether the step trains on chosen / rejected pairs (dpo, orpo, simpo) rather than next tokens."""
        return self.objective in PREFERENCE_OBJECTIVES

    @property
    def reference(self) -> str:
        """Where the step's reference log-probs come from (see :func:`reference_source`)."""
        return reference_source(self.objective, self.method, self.precompute_reference, self.kl_beta)

    @property
    def is_grpo(self) -> bool:
        """Whether the run is online RL (grpo): completions generated, scored and trained on."""
        return self.objective == "grpo"

    @property
    def kl_beta(self) -> float:
        """``beta`` in effect: as given, or the objective's default (0.0 for grpo, 0.1 for the others)."""
        if self.beta is not None:
            return float(self.beta)
        return 0.0 if self.objective == "grpo" else DEFAULT_BETA

    @property
    def prompt_budget(self) -> int:
        """grpo: the tokens a prompt may take (``seq_len`` less ``max_completion_length``)."""
        return self.seq_len - self.max_completion_length

    @property
    def generation_batch(self) -> int:
        """grpo: completions generated at once on one device (TRL's generation batch: ``batch_size x grad_accum``)."""
        return self.batch_size * self.grad_accum

    @property
    def tiles_sequence(self) -> bool:
        """Whether the decoder MLPs and norms run over chunks of the sequence (``tiling`` resolved)."""
        return tiles_sequence(self.tiling, self.recipe, self.batch_size * self.seq_len)

    def knobs(self) -> dict[str, Any]:
        """Every knob with its resolved value, as plain JSON types."""
        data = self.model_dump()
        data["targets"] = list(self.targets)
        data["modules_to_save"] = list(self.modules_to_save)
        data["alpha"] = self.lora_alpha
        return data


def _adapter_problems(spec: RunSpec, name, setting) -> list[str]:
    """Adapter options on a run without adapters, and module lists PEFT cannot take."""
    problems = []
    if not spec.uses_adapters:
        for knob_name, on in (
            ("dora", spec.dora),
            ("rslora", spec.rslora),
            ("modules_to_save", bool(spec.modules_to_save)),
        ):
            if on:
                problems.append(
                    f"{name(knob_name)}: only with adapters ({setting('method', 'lora')}, qlora or lora-8bit); "
                    f"{setting('method', spec.method)} trains every weight already. Drop {name(knob_name)}."
                )
    if spec.dora and spec.base_bits is not None:
        # 4-bit: PEFT measures DoRA's norms on a deep copy of each layer, and bitsandbytes' Params4bit
        # cannot be copied without its data (the planner's model has none: it is built on meta).
        # 8-bit: PEFT moves the weight after dequantizing it, and bitsandbytes' Int8Params drops its
        # scales when moved (the next forward fails on a CPU); and DoRA's path depends on the weight's
        # Python class, which a fake tensor cannot take, so no plan could follow it.
        why = (
            "PEFT copies each 4-bit layer to measure DoRA's norms, which bitsandbytes cannot do on the weightless "
            "model memfit plans with"
            if spec.base_bits == 4
            else "PEFT's DoRA on bitsandbytes' 8-bit layers loses their scales when the weight is moved, and its path "
            "depends on the weight's class, which the planner's fake weights cannot have"
        )
        problems.append(
            f"{name('dora')}: not with {setting('method', spec.method)}: {why}. Use {name('dora')} with "
            f"{setting('method', 'lora')}, or {spec.method} without {name('dora')}."
        )
    if ALL_LINEAR in spec.modules_to_save:
        problems.append(
            f"{name('modules_to_save')}: all-linear names LoRA targets, not modules to train whole: list module names, "
            f"e.g. {setting('modules_to_save', 'embed_tokens,lm_head')}."
        )
    both = sorted((set(spec.modules_to_save) & set(spec.targets)) - {ALL_LINEAR})
    if both:
        problems.append(
            f"{name('modules_to_save')}: {', '.join(both)} is also in {name('targets')}: a module either gets LoRA adapters "
            "or is trained whole (PEFT does not do both). Remove it from one of them."
        )
    return problems


# ------------------------------------------------------------------------------------------------
# What is derived from the fields


#: Every knob, in declaration order.
KNOBS: tuple[str, ...] = tuple(RunSpec.model_fields)

#: Methods that freeze the base and train adapters.
ADAPTER_METHODS: tuple[str, ...] = ("lora", "qlora", "lora-8bit")

#: Methods whose frozen base layers are quantized, and the bits a weight takes.
QUANTIZED_BASE_BITS: dict[str, int] = {"qlora": 4, "lora-8bit": 8}

#: The knobs a training run takes (a training YAML's knob fields).
TRAINED_KNOBS: tuple[str, ...] = tuple(
    name for name, info in RunSpec.model_fields.items() if not (info.json_schema_extra or {}).get("planner_only")
)


def choices(name: str) -> tuple[str, ...]:
    """The allowed values of knob ``name`` (from its ``Literal`` type), or () for a free value."""
    annotation = RunSpec.model_fields[name].annotation
    if typing.get_origin(annotation) is Literal:
        return tuple(typing.get_args(annotation))
    return ()


#: ``shard`` values the trainer runs on several processes, least communication first. ``none`` is
#: one process; ``zero1`` (optimizer states sharded, weights and gradients whole) is planned but not
#: trained: zero2 costs the same communication and less memory.
TRAINED_SHARD_MODES: tuple[str, ...] = ("ddp", "zero2", "zero3", "fsdp", "fsdp-offload")


def default(name: str) -> Any:
    """The default of knob ``name``."""
    return RunSpec.model_fields[name].default


def help_text(name: str) -> str:
    """The help of knob ``name``."""
    return RunSpec.model_fields[name].description or ""


def short_flag(name: str) -> str | None:
    """The one-letter command-line alias of knob ``name`` (``-b``), if it has one."""
    return (RunSpec.model_fields[name].json_schema_extra or {}).get("short")


def flag(name: str) -> str:
    """How knob ``name`` is spelled on the command line: ``--batch-size``."""
    return "--" + name.replace("_", "-")


#: How a message names a knob: as a command-line flag (``--batch-size 4``) or as a training YAML
#: field (``batch_size: 4``).
SPELLINGS = ("flag", "field")


def spell(name: str, spelling: str = "flag") -> str:
    """Knob ``name`` as the user wrote it: ``--batch-size`` (flag) or ``batch_size`` (field)."""
    return flag(name) if spelling == "flag" else name


def spell_setting(name: str, value: Any, spelling: str = "flag") -> str:
    """Knob ``name`` set to ``value`` as the user would write it: ``--rank 16`` or ``rank: 16``."""
    return f"{flag(name)} {value}" if spelling == "flag" else f"{name}: {value}"


def _spellers(spelling: str):
    if spelling not in SPELLINGS:
        raise ValueError(f"spelling: {spelling!r} is not one of {', '.join(SPELLINGS)}")
    return (lambda name: spell(name, spelling)), (lambda name, value: spell_setting(name, value, spelling))


def _example(name: str) -> Any:
    return (RunSpec.model_fields[name].json_schema_extra or {}).get("example")


def upper_bound(name: str) -> int | None:
    """The largest value knob ``name`` takes (its ``at_most``), or None when it has no bound."""
    for constraint in RunSpec.model_fields[name].metadata:
        bound = getattr(constraint, "le", None)
        if bound is not None:
            return bound
    return None


def value_kind(name: str) -> str:
    """``int`` (a whole number, 1 or more, at most :func:`upper_bound`), ``float``, ``bool``, ``choice`` or ``other``."""
    annotation = RunSpec.model_fields[name].annotation
    if choices(name):
        return "choice"
    for kind in (bool, int, float):  # bool first: it is an int too
        if annotation is kind or kind in typing.get_args(annotation):
            return kind.__name__
    return "other"


#: The mixed precisions, and the 16-bit format each runs forward in under autocast.
MIXED_PRECISIONS = {"bf16-mixed": "bf16", "fp16-mixed": "fp16"}


def weight_precision(method: str, precision: str) -> str:
    """The format (bf16, fp16 or fp32) a run of ``method`` stores its model's parameters in.

    Under a mixed precision full fine-tuning keeps every weight in fp32 (the master weights that
    the optimizer updates). LoRA and QLoRA keep the frozen base in the 16-bit format: it is never
    updated, so an fp32 copy would cost 2 bytes a parameter and buy nothing (autocast computes in 16
    bits anyway); their adapters are fp32 under every precision (PEFT's default).
    """
    half = MIXED_PRECISIONS.get(precision)
    if half is None:
        return precision
    return "fp32" if method == "full" else half


def autocast_precision(precision: str, recipe: str = "memfit") -> str | None:
    """The 16-bit format forward runs in under ``torch.autocast``, or None (no autocast).

    Mixed precisions run forward under autocast. So does the ``hf`` recipe in bf16 or fp16, as the
    Hugging Face ``Trainer`` runs it with ``bf16=True`` / ``fp16=True`` on a 16-bit model.
    """
    if precision in MIXED_PRECISIONS:
        return MIXED_PRECISIONS[precision]
    if recipe == "hf" and precision in ("bf16", "fp16"):
        return precision
    return None


def precision_regime(
    method: str, precision: str, recipe: str = "memfit", kbit_upcast: bool = True, adapter_dtype: str = "fp32"
) -> str:
    """What ``precision`` means for a run of ``method``, in words: which number format holds what.

    Full fine-tuning in bf16: "pure bf16: weights, gradients and optimizer states in bf16"; in
    bf16-mixed: "bf16 mixed: fp32 weights, gradients and optimizer states, bf16 autocast"; LoRA in
    bf16: "bf16 base, fp32 adapters". A plan shows it on a line of its own.
    """
    half = MIXED_PRECISIONS.get(precision, precision)
    autocast = autocast_precision(precision, recipe)
    tail = (f", {autocast} autocast" if autocast else "") + (", loss scaling" if half == "fp16" else "")
    if method == "full":
        if precision in MIXED_PRECISIONS:
            return f"{half} mixed: fp32 weights, gradients and optimizer states{tail}"
        pure = "pure " if precision != "fp32" else ""
        return f"{pure}{precision}: weights, gradients and optimizer states in {precision}{tail}"
    base = weight_precision(method, precision)
    # PEFT's k-bit preparation (the hf recipe) upcasts every weight that is not quantized to fp32.
    kept = ", other weights fp32" if recipe == "hf" and kbit_upcast else ""
    adapters = f"{base if adapter_dtype == 'compute' else 'fp32'} adapters"
    if method == "qlora":
        return f"4-bit base ({base} compute{kept}), {adapters}{tail}"
    if method == "lora-8bit":
        return f"8-bit base (LLM.int8 matmuls, {base} around them{kept}), {adapters}{tail}"
    return f"{base} base, {adapters}{tail}"


def precision_regime_of(spec: Mapping[str, Any]) -> str:
    """:func:`precision_regime` of a plan's spec as JSON holds it (keys a plan before them lacks: defaults)."""
    return precision_regime(
        spec["method"],
        spec["precision"],
        spec.get("recipe", "memfit"),
        spec.get("kbit_upcast", True),
        spec.get("adapter_dtype", "fp32"),
    )


def tiles_sequence(tiling: str, recipe: str, tokens: int) -> bool:
    """``--tiling`` resolved for a micro-batch of ``tokens`` tokens (the hf recipe never tiles)."""
    if recipe == "hf" or tiling == "off":
        return False
    return tiling == "on" or tokens >= TILING_AUTO_TOKENS


# ------------------------------------------------------------------------------------------------
# Preference objectives

#: The objectives that train on chosen / rejected pairs.
PREFERENCE_OBJECTIVES = ("dpo", "orpo", "simpo")

#: ``beta``'s default for dpo, orpo and simpo (TRL's); grpo's is 0.0 (no reference model).
DEFAULT_BETA = 0.1

#: The knobs only grpo takes (each refused for another objective unless it holds its default).
GRPO_KNOBS = (
    "num_generations",
    "max_completion_length",
    "num_iterations",
    "temperature",
    "top_p",
    "use_vllm",
    "vllm_mode",
    "vllm_gpu_memory_utilization",
    "vllm_enable_sleep_mode",
)

#: Where a step's reference log-probs come from (:func:`reference_source`).
REFERENCE_SOURCES = ("none", "disabled-adapters", "frozen-copy", "precomputed")


def reference_source(objective: str, method: str, precompute_reference: bool = False, beta: float = 0.0) -> str:
    """Where the reference log-probs of an ``objective`` step come from.

    ``none``: the objective has no reference (sft, orpo, simpo, and grpo with ``beta`` 0);
    ``precomputed``: read from the batch (one pass before training computed them);
    ``disabled-adapters``: LoRA and QLoRA take them from the base model, the adapters switched off
    (PEFT's ``disable_adapter()``), with no second copy; ``frozen-copy``: full fine-tuning keeps a
    frozen copy of the starting weights.
    """
    if objective == "grpo" and beta > 0:
        return "frozen-copy" if method == "full" else "disabled-adapters"
    if objective != "dpo":
        return "none"
    if precompute_reference:
        return "precomputed"
    return "frozen-copy" if method == "full" else "disabled-adapters"


def _sequence_parallel_problems(spec: RunSpec, name, setting) -> list[str]:
    """What ``sequence_parallel`` asks of the other knobs: GPUs it divides, rows it can cut, the sft
    objective on memfit's one-row micro-batches."""
    degree, problems = spec.sequence_parallel, []
    if degree <= 1:
        return problems
    what = setting("sequence_parallel", degree)
    if spec.gpus % degree:
        problems.append(
            f"{what} does not divide {setting('gpus', spec.gpus)}: each group of {degree} GPUs shares a row. "
            f"Use {setting('gpus', degree * max(1, spec.gpus // degree))} or a {name('sequence_parallel')} that divides {spec.gpus}."
        )
    if spec.seq_len % degree or spec.seq_len < degree:
        problems.append(
            f"{setting('seq_len', spec.seq_len)} cannot be cut into {degree} equal shards ({what}). "
            f"Use a multiple of {degree}, e.g. {setting('seq_len', max(degree, spec.seq_len - spec.seq_len % degree))}."
        )
    if spec.objective != "sft" or spec.recipe != "memfit" or spec.padding_free == "off":
        got = setting("objective", spec.objective) if spec.objective != "sft" else ""
        got = got or (setting("recipe", spec.recipe) if spec.recipe != "memfit" else setting("padding_free", "off"))
        problems.append(
            f"{what} runs the sft objective on memfit's one-row micro-batches (got {got}). "
            f"Use {setting('objective', 'sft')} with {setting('recipe', 'memfit')} and {name('padding_free')} auto or on, "
            f"or drop {name('sequence_parallel')}."
        )
    return problems


def _objective_combinations(spec: RunSpec, name, setting) -> list[str]:
    """What a preference objective rules out, spelled as the user wrote the knobs."""
    problems = []
    if spec.precompute_reference and spec.objective != "dpo":
        problems.append(
            f"{name('precompute_reference')}: only {setting('objective', 'dpo')} has a reference model "
            f"(got {setting('objective', spec.objective)}). Drop {name('precompute_reference')}."
        )
    if spec.objective != "sft" and spec.packing:
        what = "a completion is scored" if spec.is_grpo else "a pair's chosen and rejected answers are scored"
        held = "completions" if spec.is_grpo else "pairs"
        problems.append(
            f"{name('packing')} cannot be used with {setting('objective', spec.objective)}: {what} as whole sequences, not "
            f"cut into packed rows. Drop {name('packing')} ({name('padding_free')} keeps a micro-batch's {held} in one row "
            "without padding)."
        )
    problems.extend(_grpo_combinations(spec, name, setting))
    if spec.beta is not None and spec.objective == "sft":
        problems.append(
            f"{name('beta')}: applies to the preference objectives and grpo (got {setting('objective', 'sft')}). "
            f"Drop {name('beta')}."
        )
    elif spec.beta is not None and spec.is_preference and not (math.isfinite(spec.beta) and spec.beta > 0):
        problems.append(
            f"{name('beta')}: {spec.beta!r} must be a positive number (e.g. {setting('beta', DEFAULT_BETA)})"
        )
    if spec.objective != "sft" and spec.hf_loss != "model":
        problems.append(
            f"{name('hf_loss')}: {spec.hf_loss} is an sft loss; the hf recipe's {setting('objective', spec.objective)} "
            f"takes log-probs from the model's whole logits, as TRL's preference trainers do. Drop {name('hf_loss')}."
        )
    return problems


def _grpo_combinations(spec: RunSpec, name, setting) -> list[str]:
    """What grpo needs of the other knobs, and grpo's knobs given to another objective."""
    if not spec.is_grpo:
        given = [knob for knob in GRPO_KNOBS if getattr(spec, knob) != default(knob)]
        return [
            f"{name(knob)}: applies to {setting('objective', 'grpo')} (got {setting('objective', spec.objective)}). "
            f"Drop {name(knob)}, or set {setting('objective', 'grpo')}."
            for knob in given
        ]
    problems = []
    if spec.num_generations < 2:
        problems.append(
            f"{setting('num_generations', spec.num_generations)}: grpo needs 2 or more completions of each prompt "
            f"to compare them (e.g. {setting('num_generations', 8)})."
        )
    elif spec.generation_batch % spec.num_generations:
        problems.append(
            f"{setting('batch_size', spec.batch_size)} x {setting('grad_accum', spec.grad_accum)} = {spec.generation_batch} "
            f"completions a step must hold whole groups of {setting('num_generations', spec.num_generations)} (TRL's "
            f"generation batch): e.g. {setting('batch_size', spec.num_generations)}, or {name('grad_accum')} "
            f"{spec.num_generations // math.gcd(spec.num_generations, spec.batch_size)}."
        )
    if spec.prompt_budget < 1:
        problems.append(
            f"{setting('seq_len', spec.seq_len)} leaves no room for a prompt beside "
            f"{setting('max_completion_length', spec.max_completion_length)}: seq_len is the prompt's budget plus the "
            f"completion (e.g. {setting('seq_len', spec.max_completion_length + 512)})."
        )
    if spec.gpus != 1:
        problems.append(
            f"{setting('objective', 'grpo')}: planned and trained on one GPU (got {setting('gpus', spec.gpus)}); "
            f"a vLLM server on GPUs of its own is {setting('vllm_mode', 'server')}."
        )
    if spec.step_in_backward:
        problems.append(
            f"{name('step_in_backward')}: not with {setting('objective', 'grpo')} (its optimizer states are "
            f"planned as held between steps, while it generates). Drop {name('step_in_backward')}."
        )
    if spec.recipe == "hf":
        problems.append(
            f"{setting('recipe', 'hf')}: plans sft and the preference objectives; grpo runs memfit's step. "
            f"Drop {name('recipe')}."
        )
    if not (math.isfinite(spec.temperature) and spec.temperature > 0):
        problems.append(
            f"{name('temperature')}: {spec.temperature!r} must be more than 0 (e.g. {setting('temperature', 1.0)})"
        )
    if not (math.isfinite(spec.top_p) and 0 < spec.top_p <= 1):
        problems.append(f"{name('top_p')}: {spec.top_p!r} must be in (0, 1] (e.g. {setting('top_p', 1.0)})")
    if not 0 < spec.vllm_gpu_memory_utilization <= 1:
        problems.append(
            f"{name('vllm_gpu_memory_utilization')}: {spec.vllm_gpu_memory_utilization!r} must be in (0, 1] "
            f"(e.g. {setting('vllm_gpu_memory_utilization', 0.3)})"
        )
    if spec.beta is not None and not (math.isfinite(spec.beta) and spec.beta >= 0):
        problems.append(f"{name('beta')}: {spec.beta!r} must be 0 or more for grpo (e.g. {setting('beta', 0.04)})")
    for knob_name in ("vllm_mode", "vllm_gpu_memory_utilization", "vllm_enable_sleep_mode"):
        if not spec.use_vllm and getattr(spec, knob_name) != default(knob_name):
            problems.append(
                f"{name(knob_name)}: applies with {name('use_vllm')}. Add {name('use_vllm')}, or drop {name(knob_name)}."
            )
    return problems


class ObjectiveParams(BaseModel):
    """The loss parameters of the preference objectives and of grpo, under TRL's names and defaults.

    They change the loss value, not the memory of a step: they are training-config fields
    (``loss_type: ipo`` in a training YAML, ``--loss-type`` on ``memfit train``), not :class:`RunSpec`
    knobs, and plans do not depend on them. ``beta`` is the exception, a knob (grpo's reference pass
    exists only when it is above 0): a training config holds it as the knob and passes it here
    resolved (:attr:`RunSpec.kl_beta`). :func:`objective_problems` checks them against the objective.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    beta: float = Field(
        DEFAULT_BETA,
        description="dpo: how far the policy may move from the reference (TRL DPOConfig beta; for loss_type ipo, its "
        "tau); orpo: the odds-ratio weight lambda (TRL ORPOConfig beta); simpo: the reward scale (TRL CPOConfig beta); "
        "grpo: the KL coefficient (TRL GRPOConfig beta, default 0.0).",
    )
    loss_type: Literal["sigmoid", "ipo", "hinge", "grpo", "dr_grpo", "dapo", "bnpo"] = Field(
        "sigmoid",
        description="dpo's loss (TRL DPOConfig loss_type): sigmoid (DPO), ipo (IPO, per-token averages), hinge "
        "(SLiC); grpo's (TRL GRPOConfig loss_type, default dapo): grpo (each completion's token mean), dr_grpo (over "
        "completions x max_completion_length), dapo (over the generation batch's tokens), bnpo (over the micro-batch's tokens).",
    )
    simpo_gamma: float = Field(0.5, description="simpo: the target reward margin gamma (TRL CPOConfig simpo_gamma).")
    cpo_alpha: float = Field(
        0.0,
        description="simpo: weight of an NLL term on the chosen answers (TRL CPOConfig cpo_alpha; 0 is SimPO as its paper "
        "defines it, TRL's own default 1.0 is CPO-SimPO).",
    )
    epsilon: float = Field(
        0.2, description="grpo: the ratio's lower clipping bound, 1 - epsilon (TRL GRPOConfig epsilon)."
    )
    epsilon_high: float | None = Field(
        None,
        description="grpo: the ratio's upper clipping bound, 1 + epsilon_high (TRL GRPOConfig epsilon_high; default: epsilon).",
    )
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group",
        description="grpo: advantages divided by the standard deviation of the rewards of their group, of the "
        "whole generation batch, or not at all (TRL GRPOConfig scale_rewards).",
    )

    @field_validator("scale_rewards", mode="before")
    @classmethod
    def _scale_words(cls, value: Any) -> Any:
        return {True: "group", False: "none"}.get(value, value) if isinstance(value, bool) else value

    @property
    def clip_high(self) -> float:
        """The upper clipping epsilon in effect (``epsilon_high``, else ``epsilon``)."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


#: The fields of :class:`ObjectiveParams`, and the objectives each one applies to.
OBJECTIVE_PARAMS: dict[str, tuple[str, ...]] = {
    "beta": PREFERENCE_OBJECTIVES + ("grpo",),
    "loss_type": ("dpo", "grpo"),
    "simpo_gamma": ("simpo",),
    "cpo_alpha": ("simpo",),
    "epsilon": ("grpo",),
    "epsilon_high": ("grpo",),
    "scale_rewards": ("grpo",),
}

#: ``loss_type``'s choices by objective, the first its default.
LOSS_TYPES = {"dpo": ("sigmoid", "ipo", "hinge"), "grpo": ("dapo", "grpo", "dr_grpo", "bnpo")}


def objective_problems(
    objective: str, params: ObjectiveParams, given: set[str] | frozenset[str] = frozenset(), *, check_beta: bool = True
) -> list[str]:
    """One line per problem with ``params`` for ``objective``, named as training-config fields.

    ``given``: the fields the user set; one that does not apply to the objective is refused rather
    than silently ignored, unless it holds its default (a run's whole recorded config, run.json's,
    validates again). ``check_beta``: False where ``beta`` was checked already as the knob it is.
    """
    problems = []
    for field in sorted(given & set(OBJECTIVE_PARAMS) - (set() if check_beta else {"beta"})):
        applies = OBJECTIVE_PARAMS[field]
        if objective not in applies and getattr(params, field) != ObjectiveParams.model_fields[field].default:
            problems.append(
                f"{field}: applies to objective: {' or '.join(applies)}, and this run's objective is {objective}. "
                f"Remove {field}, or set objective: {applies[0]}."
            )
    if objective in LOSS_TYPES and params.loss_type not in LOSS_TYPES[objective]:
        problems.append(
            f"loss_type: {params.loss_type!r} is not a loss of objective: {objective}; use one of "
            f"{', '.join(LOSS_TYPES[objective])}"
        )
    if objective == "grpo":
        problems.extend(_grpo_param_problems(params, check_beta))
    elif check_beta and not (math.isfinite(params.beta) and params.beta > 0):
        problems.append(f"beta: {params.beta!r} must be a positive number (e.g. beta: 0.1)")
    if not math.isfinite(params.simpo_gamma):
        problems.append(f"simpo_gamma: {params.simpo_gamma!r} must be a number (e.g. simpo_gamma: 0.5)")
    if not (math.isfinite(params.cpo_alpha) and params.cpo_alpha >= 0):
        problems.append(f"cpo_alpha: {params.cpo_alpha!r} must be 0 or more (e.g. cpo_alpha: 0)")
    return problems


def _grpo_param_problems(params: ObjectiveParams, check_beta: bool = True) -> list[str]:
    problems = []
    if check_beta and not (math.isfinite(params.beta) and params.beta >= 0):
        problems.append(f"beta: {params.beta!r} must be 0 or more (e.g. beta: 0.04)")
    if not (math.isfinite(params.epsilon) and 0 < params.epsilon < 1):
        problems.append(f"epsilon: {params.epsilon!r} must be in (0, 1) (e.g. epsilon: 0.2)")
    if params.epsilon_high is not None and not (math.isfinite(params.epsilon_high) and params.epsilon_high > 0):
        problems.append(f"epsilon_high: {params.epsilon_high!r} must be more than 0 (e.g. epsilon_high: 0.28)")
    return problems


# ------------------------------------------------------------------------------------------------
# Validation


def make_spec(*, spelling: str = "flag", **knobs: Any) -> RunSpec:
    """Build a :class:`RunSpec` from keyword knobs, or raise :class:`SpecError` listing every problem.

    Values may be given as text (as the command line gives them). Unknown knob names get a "did you
    mean" suggestion; ``None`` values mean "use the default". ``spelling`` says how the messages
    name knobs: ``"flag"`` (``--rank 0 must be...``, for command lines) or ``"field"`` (``rank: 0
    must be...``, for a training YAML).
    """
    _spellers(spelling)  # a bad spelling is a bug in the caller: fail before any message is made
    problems: list[str] = []
    clean: dict[str, Any] = {}
    for name, value in knobs.items():
        if value is None:
            continue
        key = name.replace("-", "_")
        if key not in RunSpec.model_fields:
            close = difflib.get_close_matches(key, KNOBS, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else f" Known knobs: {', '.join(sorted(KNOBS))}."
            problems.append(f"unknown knob {name!r}.{hint}")
            continue
        problem, value = _check_value(key, value, spelling)
        if problem:
            problems.append(problem)
        else:
            clean[key] = value  # None here is an explicit "none" (switched off), not "the default"
    if problems:
        raise SpecError(problems)
    if clean.get("step_in_backward") and "max_grad_norm" not in clean:
        # Clipping needs every gradient before the first update: with the step in backward, the
        # default is no clipping (asking for both is refused).
        clean["max_grad_norm"] = None
    if clean.get("objective") == "grpo" and "batch_size" not in clean:
        # A micro-batch of whole groups by default (TRL's per_device_train_batch_size 8 holds one group
        # of its num_generations 8); with grad_accum given, the fewest completions that make whole groups.
        generations, accum = clean.get("num_generations", default("num_generations")), clean.get("grad_accum", 1)
        if isinstance(generations, int) and isinstance(accum, int) and generations > 0:
            clean["batch_size"] = generations // math.gcd(generations, accum)
    try:
        return RunSpec.model_validate(clean, context={"spelling": spelling})
    except ValidationError as err:
        raise SpecError(_pydantic_problems(err, spelling)) from None


def _check_value(key: str, value: Any, spelling: str = "flag") -> tuple[str | None, Any]:
    """(problem, value): the value converted to the knob's type, or the line that says what is wrong."""
    kind, name, example = value_kind(key), spell(key, spelling), _example(key)
    good = spell_setting(key, example, spelling)
    if kind == "choice":
        allowed = choices(key)
        text = str(value).strip().lower() if isinstance(value, str) else value
        if text not in allowed:
            close = difflib.get_close_matches(str(text), allowed, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            return f"{name}: {value!r} is not one of {', '.join(allowed)}.{hint}", value
        return None, text
    if kind == "int":
        number = whole_number_value(value)
        if number is None:
            return f"{name}: {value!r} is not a whole number. Use e.g. {good}.", value
        # A number with more digits than Python reads (thousands) is named by its text, cut.
        said = number if isinstance(number, int) else shown(value)
        if number < 1:
            return f"{name}: {said} must be 1 or more (e.g. {good}).", value
        most = upper_bound(key)
        if most is not None and number > most:
            return f"{name}: {said} must be at most {most} (e.g. {good}).", value
        return None, number
    if kind == "float":
        if isinstance(value, bool):  # a YAML true where a number belongs is a mistake, not 1.0
            return f"{name}: {str(value).lower()} is true or false, not a number: write a number (e.g. {good})", value
        if _means_none(value) and RunSpec.model_fields[key].default is not None:
            return None, None  # "none": switched off (a None value means "the default" to make_spec)
        number = _as_float(value)
        if key == "alpha" and (number is None or not math.isfinite(number) or number <= 0):
            return f"{name}: {value!r} must be a positive number (e.g. {good}).", value
        if key == "max_grad_norm" and (number is None or not math.isfinite(number) or number <= 0):
            return f"{name}: {value!r} must be a positive number, or none for no clipping (e.g. {good}).", value
        if key == "dropout" and (number is None or not 0.0 <= number < 1.0):
            return f"{name}: {value!r} must be in [0, 1) (e.g. {good}).", value
        if number is None:
            return f"{name}: {value!r} is not a number (e.g. {good}).", value
        return None, number
    if kind == "bool" and isinstance(value, str):
        text = value.strip().lower()
        if text not in ("true", "false", "yes", "no", "on", "off", "1", "0"):
            return f"{name}: {value!r} is not true or false.", value
        return None, text in ("true", "yes", "on", "1")
    if key in NAME_LISTS:
        return _names_problem(key, value, spelling), value
    return None, value


#: The knobs that take a list of module names (comma-separated on a command line).
NAME_LISTS = ("targets", "modules_to_save")


def _names_problem(key: str, value: Any, spelling: str) -> str | None:
    """What is wrong with a list of module names: an empty item (``q_proj,,v_proj``, a comma at an
    end) is a slip of the keyboard, never "no module"; a list of none is ``none`` for
    ``modules_to_save`` and nothing at all for ``targets``."""
    if key == "modules_to_save" and _means_none(value):
        return None
    if isinstance(value, str):
        items: list[Any] = value.split(",")
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        return None  # not a list: the type check names it
    name, good = spell(key, spelling), spell_setting(key, _example(key), spelling)
    none = f", or {spell_setting(key, 'none', spelling)}" if key == "modules_to_save" else f", or {ALL_LINEAR}"
    if not items and key == "modules_to_save":
        return None  # an empty YAML list: none
    if not items or (isinstance(value, str) and not value.strip()):
        return f"{name}: {value!r} names no module: write module names separated by commas, e.g. {good}{none}."
    if any(isinstance(item, str) and not item.strip() for item in items):
        return (
            f"{name}: {value!r} has an empty item (two commas in a row, or one at an end): write module names "
            f"separated by commas, e.g. {good}{none}."
        )
    return None


#: The longest module name ``targets`` and ``modules_to_save`` take (a dotted path's tail is far shorter).
MAX_MODULE_NAME_CHARS = 256

#: How "off" is written for a knob whose None is a value (``--max-grad-norm none``).
NONE_WORDS = ("none", "null", "off")


def _means_none(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() in NONE_WORDS


_WHOLE_NUMBER = re.compile(r"[+-]?[0-9]+")
#: Digits past which a whole number is read as infinitely large: more than any bound, and fewer than
#: Python's limit on converting text to int (4,300), which would raise.
_MOST_DIGITS = 64


def whole_number_value(value: Any) -> int | float | None:
    """``value`` (an int, an integral float, or text in ASCII digits with an optional sign) as an
    int; ``inf`` or ``-inf`` for text of more than :data:`_MOST_DIGITS` digits (out of any range);
    None when it is not a whole number (text in other scripts' digits, ``²``, ``1_000``, ``--5`` too)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value) if value.is_integer() else None
    if not isinstance(value, str) or not _WHOLE_NUMBER.fullmatch(value.strip()):
        return None
    text = value.strip()
    if len(text.lstrip("+-")) > _MOST_DIGITS:
        return -math.inf if text.startswith("-") else math.inf
    return int(text)


def _as_float(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            return None
    return None


def _pydantic_problems(err: ValidationError, spelling: str = "flag") -> list[str]:
    problems = []
    for item in err.errors():
        loc = [str(part) for part in item.get("loc", ()) if part != "__root__"]
        message = str(item.get("msg", "")).removeprefix("Value error, ")
        if loc:
            field = spell(loc[0], spelling) if loc[0] in RunSpec.model_fields else loc[0]
            problems.append(f"{field}: {item.get('input')!r}: {message}")
        else:
            problems.extend(line for line in message.splitlines() if line)
    return problems
