"""Build a causal LM from its config on the ``meta`` device, and prepare it for a training method.

Everything here runs without memory: the model is built on ``meta`` (shapes only), quantized
layers are swapped in on ``meta``, and PEFT attaches adapters on ``meta``. The planner then
materialises the result inside ``FakeTensorMode`` (:func:`materialize`), the trainer loads real
weights into the same structure. The order is always the trainer's: quantize, attach adapters,
enable checkpointing.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
from torch import nn

from memfit.spec import ALL_LINEAR, RunSpec

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

#: bitsandbytes NF4 settings memfit uses for QLoRA (the QLoRA paper's: NF4, double quantization,
#: 64-element blocks, uint8 storage).
NF4_BLOCKSIZE = 64


class ModelBuildError(ValueError):
    """transformers cannot build a causal LM from this config, or a knob does not fit the model."""


def make_config(config_dict: dict[str, Any], num_layers: int | None = None):
    """A transformers config from a config dict, optionally cut to ``num_layers`` decoder layers."""
    from transformers import AutoConfig

    data = copy.deepcopy(config_dict)
    model_type = data.pop("model_type", None)
    try:
        config = AutoConfig.for_model(model_type, **data)
    except (ValueError, KeyError, TypeError) as err:
        raise ModelBuildError(
            f"transformers cannot make a config for model_type {model_type!r}: {err}. "
            "Check the model_type field, or upgrade transformers if the architecture is new."
        ) from None
    if num_layers is not None:
        config.num_hidden_layers = num_layers
        layer_types = getattr(config, "layer_types", None)
        if layer_types:
            config.layer_types = list(layer_types[:num_layers])
    return config


def layer_period(config) -> int:
    """Smallest number of decoder layers after which the layer pattern repeats (1 if uniform).

    Models such as Gemma-2 alternate sliding-window and global attention; a partial simulation must
    contain whole periods for the extrapolation to hold. Returns 0 when there is no period.
    """
    layer_types = list(getattr(config, "layer_types", None) or [])
    if not layer_types:
        return 1
    n = len(layer_types)
    for period in range(1, n + 1):
        if all(layer_types[i] == layer_types[i % period] for i in range(n)):
            return period if period <= n // 3 or period == 1 else 0
    return 0


def build_meta_model(config, dtype: torch.dtype) -> nn.Module:
    """The causal LM of ``config`` on the ``meta`` device, in ``dtype``, with SDPA attention."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    except ValueError as err:
        message = str(err).lower()
        if "sdpa" not in message and "scaled_dot_product_attention" not in message:
            raise ModelBuildError(f"transformers cannot build a causal LM for {config.model_type!r}: {err}") from None
        with torch.device("meta"):  # architectures without SDPA support use their eager attention
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager")
    return model


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The ModuleList of decoder blocks (the longest ModuleList in the model)."""
    best = None
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and (best is None or len(module) > len(best)):
            best = module
    if best is None:
        raise ModelBuildError(f"{type(model).__name__} has no list of decoder layers")
    return best


def linear_names_in_layers(model: nn.Module) -> list[str]:
    """Short names of the linear layers inside the decoder blocks (``q_proj``, ``down_proj``, ...)."""
    names = set()
    for block in decoder_layers(model):
        for name, module in block.named_modules():
            if _is_linear(module) and name:
                names.add(name.rsplit(".", 1)[-1])
    return sorted(names)


def _is_linear(module: nn.Module) -> bool:
    if isinstance(module, nn.Linear):
        return True
    # GPT-2 style models use transformers' Conv1D (a linear layer with transposed weight).
    return type(module).__name__ == "Conv1D"


def check_targets(model: nn.Module, spec: RunSpec) -> None:
    """Raise ModelBuildError when a ``--targets`` name matches no linear layer of the decoder."""
    if not spec.uses_adapters or spec.targets == (ALL_LINEAR,):
        return
    available = linear_names_in_layers(model)
    missing = [t for t in spec.targets if t not in available]
    if missing:
        raise ModelBuildError(
            f"--targets: {', '.join(missing)} match no linear layer of this model's decoder. "
            f"Available: {', '.join(available)} (or all-linear)."
        )


def quantize_linears_on_meta(model: nn.Module, compute_dtype: torch.dtype) -> int:
    """Swap every linear layer of the decoder blocks for a bitsandbytes NF4 ``Linear4bit`` (on meta).

    This is the set transformers quantizes for ``load_in_4bit`` (every linear except the output
    head). Returns the number of layers swapped.
    """
    import bitsandbytes as bnb

    swapped = 0
    for block in decoder_layers(model):
        for name, module in list(block.named_modules()):
            if not isinstance(module, nn.Linear):
                continue
            parent_name, _, child = name.rpartition(".")
            parent = block.get_submodule(parent_name) if parent_name else block
            with torch.device("meta"):
                q = bnb.nn.Linear4bit(
                    module.in_features,
                    module.out_features,
                    bias=module.bias is not None,
                    compute_dtype=compute_dtype,
                    compress_statistics=True,
                    quant_type="nf4",
                    quant_storage=torch.uint8,
                )
            # Hold the packed shape already, so that materialising the model never allocates the
            # dense weights of every layer at once (a real 4-bit load does not either).
            q.weight.data = torch.empty(packed_nf4_shape(module.out_features, module.in_features), dtype=torch.uint8, device="meta")
            q.weight.requires_grad_(False)
            if q.bias is not None:
                q.bias.requires_grad_(False)
            setattr(parent, child, q)
            swapped += 1
    model.is_loaded_in_4bit = True  # PEFT reads this to pick its 4-bit LoRA layers
    return swapped


def packed_nf4_shape(out_features: int, in_features: int) -> tuple[int, int]:
    """Shape of the uint8 tensor bitsandbytes packs an ``[out, in]`` weight into (two 4-bit values a byte)."""
    return ((out_features * in_features + 1) // 2, 1)


def attach_lora(model: nn.Module, spec: RunSpec) -> nn.Module:
    """Wrap ``model`` with PEFT LoRA adapters as ``spec`` says (works on meta and on real models)."""
    from peft import LoraConfig, get_peft_model

    targets: str | list[str] = ALL_LINEAR if spec.targets == (ALL_LINEAR,) else list(spec.targets)
    config = LoraConfig(
        r=spec.rank,
        lora_alpha=spec.lora_alpha,
        lora_dropout=spec.dropout,
        target_modules=targets,
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


def enable_checkpointing(model: nn.Module, *, offload: bool = False) -> None:
    """Activation checkpointing on every decoder layer (non-reentrant, so frozen inputs are fine).

    ``offload`` keeps each layer's saved input in host memory until its recomputation, copied on a
    side stream and prefetched one layer ahead in backward (:mod:`memfit.train.offload`).
    """
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    elif offload:
        raise ModelBuildError("--checkpointing offload needs transformers 5 or newer: pip install -U transformers")
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if offload:
        from memfit.train.offload import enable_offloaded_checkpointing

        enable_offloaded_checkpointing(model)
    # With use_cache=True, transformers turns checkpointing off with a warning; training never
    # needs the KV cache.
    if getattr(model, "config", None) is not None:
        model.config.use_cache = False


def prepare_for_method(
    model: nn.Module,
    spec: RunSpec,
    load_weights: Callable[[nn.Module], None] | None = None,
) -> nn.Module:
    """Quantize (qlora), load, attach adapters, then the memory-lean step (:func:`apply_lean_step`).

    ``model`` is a meta model from :func:`build_meta_model`. ``load_weights`` (the trainer's) gives
    it real weights after 4-bit layers are swapped in and before adapters are attached, so that PEFT
    creates the adapters on the weights' device; the planner passes None and materialises later.
    ``spec.recipe == "hf"`` prepares it the plain Hugging Face way instead (:func:`prepare_like_hf`).
    """
    if spec.recipe == "hf":
        return prepare_like_hf(model, spec, load_weights)
    check_targets(model, spec)
    if spec.method == "qlora":
        quantize_linears_on_meta(model, DTYPES[spec.precision])
    if load_weights is not None:
        load_weights(model)
    if spec.uses_adapters:
        model = attach_lora(model, spec)
    else:
        for p in model.parameters():
            p.requires_grad_(True)
    apply_lean_step(model, spec)
    return model


def apply_lean_step(model: nn.Module, spec: RunSpec) -> None:
    """The memory-lean pieces of memfit's step that shape the model (docs/memory-lean.md), after
    adapters exist: LoRA inputs kept in the compute dtype, checkpointing (offloaded or not), tiled
    MLPs and norms. The trainer and the planner both come through here."""
    if spec.uses_adapters:
        from memfit.train.lora_inputs import keep_lora_inputs_low_precision

        keep_lora_inputs_low_precision(model)
    if spec.checkpointing != "off":
        enable_checkpointing(model, offload=spec.checkpointing == "offload")
    if spec.tiles_mlp:
        from memfit.train.tiling import tile_mlps, tile_norms

        tile_mlps(model)
        tile_norms(model)


def place_for_training(model: nn.Module, spec: RunSpec) -> bool:
    """Placement once the weights exist: frozen, untied input embeddings go to host memory for
    LoRA/QLoRA on one GPU (:mod:`memfit.train.host_embeddings`). The trainer calls it after loading,
    the planner after materialising, so both place the same tensors. True if the embeddings moved."""
    if spec.recipe == "hf" or not spec.uses_adapters or spec.gpus > 1:
        return False
    from memfit.train.host_embeddings import keep_input_embeddings_on_host

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return keep_input_embeddings_on_host(base)


def prepare_like_hf(
    model: nn.Module,
    spec: RunSpec,
    load_weights: Callable[[nn.Module], None] | None = None,
) -> nn.Module:
    """Prepare ``model`` the way the plain Hugging Face + PEFT stack does (``--recipe hf``).

    The planner uses it to put memfit's step next to the usual one on the same configuration. What
    differs from :func:`prepare_for_method`: QLoRA goes through PEFT's
    ``prepare_model_for_kbit_training``, which upcasts every parameter that is not 4-bit (embeddings,
    norms, the output head) to fp32 and enables checkpointing with torch's default (reentrant)
    variant; LoRA and full fine-tuning use transformers' own checkpointing (``offload`` is
    transformers' synchronous ``save_on_cpu`` offload); nothing is tiled.
    """
    check_targets(model, spec)
    if spec.method == "qlora":
        quantize_linears_on_meta(model, DTYPES[spec.precision])
    if load_weights is not None:
        load_weights(model)
    if spec.method == "qlora":
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=spec.checkpointing != "off")
        if spec.checkpointing == "offload":
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={}, offload=True)
    elif spec.checkpointing != "off":
        model.activation_checkpointing_enable(offload=spec.checkpointing == "offload")
    if getattr(model, "config", None) is not None:
        model.config.use_cache = False
    if spec.uses_adapters:
        model = attach_lora(model, spec)
    else:
        for p in model.parameters():
            p.requires_grad_(True)
    return model


def materialize(model: nn.Module, device: str | torch.device, *, random_values: bool = False) -> nn.Module:
    """Give a meta model storage on ``device``; inside ``FakeTensorMode`` nothing is allocated.

    4-bit layers get the packed weight and quantization state that bitsandbytes would store, made by
    bitsandbytes' own ``quantize_4bit`` on a (fake) dense weight. ``random_values`` fills real
    storage with small random numbers (uninitialised memory could hold NaNs); fake storage has no
    values to fill.
    """
    shared = _shared_parameter_slots(model)
    model.to_empty(device=device)
    # to_empty makes a new Parameter for every slot, so tied weights (an embedding shared with the
    # output head) would come out as two tensors; tie them again, as loading real weights does.
    for (first_module, first_name), *others in shared:
        tied = first_module._parameters[first_name]
        for module, name in others:
            module._parameters[name] = tied
    if random_values:
        with torch.no_grad():
            for p in model.parameters():
                if p.is_floating_point():
                    p.normal_(0.0, 0.02)
    quantized = [m for m in model.modules() if _is_bnb_linear4bit(m)]
    if not quantized:
        return model
    import bitsandbytes.functional as bnbf

    for module in quantized:
        dense = torch.empty(module.out_features, module.in_features, dtype=module.compute_dtype, device=device)
        if random_values:
            dense.normal_(0.0, 0.02)
        packed, quant_state = bnbf.quantize_4bit(
            dense,
            blocksize=NF4_BLOCKSIZE,
            compress_statistics=True,
            quant_type="nf4",
            quant_storage=torch.uint8,
        )
        del dense
        weight = module.weight
        weight.data = packed
        weight.quant_state = quant_state
        weight.quant_type = "nf4"
        weight.compress_statistics = True
        weight.bnb_quantized = True
    return model


def _shared_parameter_slots(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Groups of (module, attribute) slots that hold one and the same Parameter (tied weights)."""
    slots: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                slots.setdefault(id(param), []).append((module, name))
    return [group for group in slots.values() if len(group) > 1]


def _is_bnb_linear4bit(module: nn.Module) -> bool:
    """True for bitsandbytes' Linear4bit, checked without importing bitsandbytes (slow to import)."""
    return any(c.__name__ == "Linear4bit" and c.__module__.startswith("bitsandbytes") for c in type(module).__mro__)


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(total, trainable) parameter counts; 4-bit packed weights count as their unpacked elements."""
    total = trainable = 0
    for p in model.parameters():
        quant_state = getattr(p, "quant_state", None)
        n = int(torch.Size(quant_state.shape).numel()) if quant_state is not None else p.numel()
        total += n
        if p.requires_grad:
            trainable += n
    return total, trainable
