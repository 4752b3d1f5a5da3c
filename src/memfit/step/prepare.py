"""Prepare a model for a training method: the one place that shapes what a step will run.

The order is always the same, for the trainer (real weights) and the planner (meta, then fake
storage): quantized layers swapped in (4-bit for qlora, 8-bit for lora-8bit), weights loaded, LoRA
adapters attached (with DoRA, rsLoRA and ``modules_to_save`` as the spec says), then the
memory-lean step (:func:`apply_lean_step`: LoRA inputs kept in the compute dtype, activation
checkpointing, offloaded or not, and MLPs and norms tiled over the sequence). Once the weights exist,
:func:`place_for_training` keeps frozen input embeddings in host memory where that applies.
``recipe: hf`` prepares the model the way the plain Hugging Face + PEFT stack does instead
(:func:`prepare_like_hf`), so plans can put the two side by side.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

from torch import nn

from memfit.errors import UserError
from memfit.models.build import DTYPES
from memfit.models.errors import ModelBuildError
from memfit.models.experts_nf4 import nf4_expert_modules, quantize_experts_on_meta
from memfit.models.layers import decoder_layers, linear_names_in_layers
from memfit.models.quantize import int8_linears_on_meta, quantize_linears_on_meta
from memfit.spec import ALL_LINEAR, RunSpec, spell, spell_setting
from memfit.step.attention import batch_layout, use_document_attention
from memfit.step.batch import DOCUMENTS
from memfit.step.host_embeddings import keep_input_embeddings_on_host
from memfit.step.lora_inputs import keep_lora_inputs_low_precision
from memfit.step.lora_targets import (
    LoraTargets,
    available_targets,
    lora_targets,
    parameter_targets_problem,
    unknown_targets,
)
from memfit.step.offload import enable_offloaded_checkpointing
from memfit.step.tiling import tile_mlps, tile_norms
from memfit.step.vision_training import (
    freeze_vision,
    is_vision_model,
    lora_module_names,
    set_tower_checkpointing,
    vision_linear_names,
)


class SetupError(UserError, ValueError):
    """The model is not, or cannot be, prepared the way the method says (wrapper, 4-bit base, counts)."""


def check_targets(model: nn.Module, spec: RunSpec, spelling: str = "flag") -> None:
    """Raise ModelBuildError when a ``--targets`` name matches nothing LoRA can adapt in the decoder
    (a linear layer, the experts or one of their weights, a router: :mod:`memfit.step.lora_targets`),
    names one PEFT refuses to adapt in this model, or asks PEFT for adapters on weights (the
    experts') with dropout or DoRA, which PEFT's weight adapters do not take (named ``--targets`` or
    ``targets``, as :func:`memfit.spec.spell` spells it)."""
    if not spec.uses_adapters:
        return
    if spec.targets != (ALL_LINEAR,):
        tower = vision_linear_names(model) if not spec.freeze_vision else []
        missing = [name for name in unknown_targets(model, spec.targets) if name not in tower]
        if missing:
            raise ModelBuildError(
                f"{spell('targets', spelling)}: {', '.join(missing)} match no linear layer, expert weight or router of this "
                f"model's decoder. Available: {', '.join(available_targets(model))} (or all-linear)."
            )
        refused = peft_refused_targets(model, spec.targets)
        if refused:
            model_type = getattr(getattr(model, "config", None), "model_type", None)
            raise ModelBuildError(
                f"{spell('targets', spelling)}: PEFT cannot put LoRA on {', '.join(refused)} in a {model_type} model (its "
                "Mamba kernels read those weights directly). Remove it; all-linear adapts every other linear layer."
            )
    targets = model_lora_targets(model, spec)
    blocked = parameter_targets_problem(targets, spec.dropout, spec.dora)
    if blocked:
        option = spell("dora", spelling) if spec.dora else spell_setting("dropout", spec.dropout, spelling)
        fix = "drop it" if spec.dora else f"set {spell_setting('dropout', 0, spelling)}"
        raise ModelBuildError(
            f"{option}: PEFT's LoRA on weights ({', '.join(targets.parameters)}) takes no {blocked}: {fix}, or give "
            f"{spell('targets', spelling)} without the experts and routers (e.g. {','.join(targets.modules[:4]) or 'q_proj'})."
        )


def model_lora_targets(model: nn.Module, spec: RunSpec) -> LoraTargets:
    """PEFT's targets for ``spec``'s adapters on ``model`` (:func:`memfit.step.lora_targets.lora_targets`)."""
    refused = peft_refused_targets(model, linear_names_in_layers(model)) if spec.targets == (ALL_LINEAR,) else []
    return lora_targets(model, spec.targets, spec.rank, spec.lora_alpha, refused)


def peft_refused_targets(model: nn.Module, names) -> list[str]:
    """The module names among ``names`` that PEFT refuses to adapt with LoRA in ``model``, by PEFT's
    own check: a Mamba mixer's ``out_proj`` (and ``conv1d``) in the model types whose fused kernels
    read those weights without calling the module (Mamba, Mamba-2, Falcon-Mamba, Falcon-H1, Nemotron-H)."""
    try:
        from peft import LoraConfig
        from peft.tuners.tuners_utils import _check_lora_target_modules_mamba as check
    except ImportError:  # a PEFT without the check refuses nothing
        return []
    probe = LoraConfig()
    refused = []
    for name in names:
        try:
            check(probe, model, name)
        except ValueError:
            refused.append(name)
    return refused


def all_linear_names(model: nn.Module) -> list[str]:
    """What ``all-linear`` adapts: the decoder's linear layers, less those PEFT refuses in this model."""
    names = linear_names_in_layers(model)
    refused = set(peft_refused_targets(model, names))
    return [name for name in names if name not in refused]


def modules_named(model: nn.Module, names: tuple[str, ...] | list[str]) -> dict[str, nn.Module]:
    """The modules PEFT's ``modules_to_save`` picks for ``names``: each module whose full name ends
    with one of them (PEFT's own rule, ``key.endswith(name)``), by full name."""
    return {key: module for key, module in model.named_modules() if key and any(key.endswith(name) for name in names)}


def check_modules_to_save(model: nn.Module, spec: RunSpec, spelling: str = "flag") -> None:
    """Raise ModelBuildError when a ``modules_to_save`` name matches no module of the model, or picks a
    module LoRA adapts (a module either gets adapters or is trained whole)."""
    if not spec.uses_adapters or not spec.modules_to_save:
        return
    problems = []
    missing = [name for name in spec.modules_to_save if not modules_named(model, [name])]
    if missing:
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        known = [
            key.rsplit(".", 1)[-1] for key, module in model.named_modules() if module is embeddings or module is head
        ]
        problems.append(
            f"{', '.join(missing)} match no module of this model (its embeddings and head: {', '.join(known) or 'none found'})"
        )
    adapted = set(all_linear_names(model)) if spec.targets == (ALL_LINEAR,) else set(spec.targets)
    layers = {id(m) for block in decoder_layers(model) for m in block.modules()}
    both = sorted(
        {
            key.rsplit(".", 1)[-1]
            for key, module in modules_named(model, spec.modules_to_save).items()
            if key.rsplit(".", 1)[-1] in adapted and (spec.targets != (ALL_LINEAR,) or id(module) in layers)
        }
    )
    if both:
        problems.append(
            f"{', '.join(both)} also get LoRA adapters ({spell('targets', spelling)}); a module either gets adapters or "
            "is trained whole: remove it from one of them"
        )
    if problems:
        raise ModelBuildError(f"{spell('modules_to_save', spelling)}: " + "; ".join(problems) + ".")


def ties_saved_modules(model: nn.Module, names: tuple[str, ...] | list[str]) -> bool:
    """Whether ``modules_to_save`` picks the input embeddings or the output head of a model that ties
    them (one tensor, ``tie_word_embeddings``). memfit then keeps them tied: PEFT's
    ``ensure_weight_tying`` makes one trainable copy that both use, so the trained model is tied as
    the base is (PEFT's default would train two copies apart and untie them)."""
    if not names or not hasattr(model, "get_input_embeddings") or not hasattr(model, "get_output_embeddings"):
        return False
    embeddings, head = model.get_input_embeddings(), model.get_output_embeddings()
    if embeddings is None or head is None or getattr(embeddings, "weight", None) is not getattr(head, "weight", 0):
        return False
    chosen = modules_named(model, names).values()
    return any(module is embeddings or module is head for module in chosen)


def attach_lora(model: nn.Module, spec: RunSpec) -> nn.Module:
    """Wrap ``model`` with PEFT LoRA adapters as ``spec`` says (works on meta and on real models):
    rank, alpha, dropout and targets, DoRA (``use_dora``), rsLoRA (``use_rslora``) and the modules
    trained whole (``modules_to_save``, kept tied where the model ties them: :func:`ties_saved_modules`)."""
    from peft import LoraConfig, get_peft_model

    targets = model_lora_targets(model, spec)
    # all-linear without experts is PEFT's own (every linear layer but the head); the few PEFT
    # refuses in this model (a Mamba mixer's out_proj) are left out rather than failing the whole run.
    refused = peft_refused_targets(model, linear_names_in_layers(model)) if targets.modules == ALL_LINEAR else []
    modules = targets.modules if isinstance(targets.modules, str) else list(targets.modules)
    if is_vision_model(model):
        # The language model's linear layers (and the tower's when it trains), by their full names:
        # a short name alone would put adapters on the tower's layers of that name too.
        modules, refused = lora_module_names(model, spec), []
    config = LoraConfig(
        r=spec.rank,
        lora_alpha=spec.lora_alpha,
        lora_dropout=spec.dropout,
        target_modules=modules or None,
        target_parameters=list(targets.parameters) or None,
        rank_pattern=dict(targets.rank_pattern),
        alpha_pattern=dict(targets.alpha_pattern),
        exclude_modules=refused or None,
        bias="none",
        task_type="CAUSAL_LM",
        use_dora=spec.dora,
        use_rslora=spec.rslora,
        modules_to_save=list(spec.modules_to_save) or None,
        ensure_weight_tying=ties_saved_modules(model, spec.modules_to_save),
    )
    if nf4_expert_modules(model):
        # Imported here: it subclasses PEFT's wrapper, whose import a plan without 4-bit weights
        # makes without bitsandbytes (memfit.planner.exact.simulate.bitsandbytes_only_if_used).
        from memfit.step.expert_adapters import register as register_expert_adapters

        register_expert_adapters(config)
    with warnings.catch_warnings():
        # PEFT checks rank and alpha patterns against the modules it adapts, not the weights: the
        # fused gate_up_proj's patterns, which it does apply, would be reported as ignored.
        warnings.filterwarnings("ignore", message=r"The following (rank|alpha)_pattern keys did not match")
        return get_peft_model(model, config)


def quantize_base(model: nn.Module, spec: RunSpec) -> None:
    """Swap the decoder's linear layers for bitsandbytes' quantized ones, as ``spec.method`` says (on
    meta); with 4 bits, every expert of the fused experts modules in NF4 too
    (:mod:`memfit.models.experts_nf4`)."""
    if spec.base_bits == 4:
        quantize_linears_on_meta(model, DTYPES[spec.weight_precision])
        quantize_experts_on_meta(model, DTYPES[spec.weight_precision])
    elif spec.base_bits == 8:
        int8_linears_on_meta(model)


def enable_checkpointing(model: nn.Module, *, offload: bool = False) -> None:
    """Activation checkpointing on every decoder layer (non-reentrant, so frozen inputs are fine).

    ``offload`` keeps each layer's saved input in host memory until its recomputation, copied on a
    side stream and prefetched one layer ahead in backward (:mod:`memfit.step.offload`).
    """
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    elif offload:
        raise ModelBuildError("--checkpointing offload needs transformers 5 or newer: pip install -U transformers")
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if offload:
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
    """Quantize (qlora, lora-8bit), load, attach adapters, then the memory-lean step (:func:`apply_lean_step`).

    ``model`` is a meta model from :func:`memfit.models.build.build_meta_model`. ``load_weights`` (the trainer's) gives
    it real weights after quantized layers are swapped in and before adapters are attached, so that PEFT
    creates the adapters on the weights' device; the planner passes None and materialises later.
    ``spec.recipe == "hf"`` prepares it the plain Hugging Face way instead (:func:`prepare_like_hf`).
    """
    if spec.recipe == "hf":
        return prepare_like_hf(model, spec, load_weights)
    check_targets(model, spec)
    check_modules_to_save(model, spec)
    quantize_base(model, spec)
    if load_weights is not None:
        load_weights(model)
    if spec.uses_adapters:
        model = attach_lora(model, spec)
    else:
        for p in model.parameters():
            p.requires_grad_(True)
        freeze_vision(model, spec)
    apply_lean_step(model, spec)
    return model


def apply_lean_step(model: nn.Module, spec: RunSpec) -> None:
    """The memory-lean pieces of memfit's step that shape the model (docs/memory-lean.md), after
    adapters exist: attention kept inside each example of a one-row micro-batch (where the batches
    take that layout), LoRA inputs kept in the compute dtype, checkpointing (offloaded or not),
    tiled MLPs and norms. The trainer and the planner both come through here."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    # Training never reads a cache; a model asked for one would keep its states besides the step's
    # (a hybrid's convolution and recurrent states), with checkpointing off as with it on.
    base.config.use_cache = False
    if batch_layout(spec, base.config) == DOCUMENTS:
        use_document_attention(model)
    if spec.uses_adapters:
        keep_lora_inputs_low_precision(model)
    if spec.checkpointing != "off":
        enable_checkpointing(model, offload=spec.checkpointing == "offload")
    set_tower_checkpointing(model, spec, enable_checkpointing)
    if spec.tiles_sequence:
        tile_mlps(model)
        tile_norms(model)


def lean_step_changes(model: nn.Module, before: RunSpec, after: RunSpec) -> list[str]:
    """Change a prepared model from ``before``'s memory-lean step to ``after``'s, in the leaner
    direction only (checkpointing off -> on -> offload, tiling on), which a run takes when a step
    runs out of memory; the weights and adapters stay as they are. Returns what changed."""
    changed = []
    order = ("off", "on", "offload")
    if order.index(after.checkpointing) < order.index(before.checkpointing):
        raise ValueError(
            f"checkpointing {before.checkpointing} -> {after.checkpointing}: a running model only gets leaner"
        )
    if after.checkpointing != before.checkpointing:
        enable_checkpointing(model, offload=after.checkpointing == "offload")
        changed.append(f"checkpointing {after.checkpointing}")
    if after.tiles_sequence and not before.tiles_sequence:
        tile_mlps(model)
        tile_norms(model)
        changed.append("tiling on")
    elif before.tiles_sequence and not after.tiles_sequence:
        raise ValueError("tiling on -> off: a running model only gets leaner")
    return changed


def place_for_training(model: nn.Module, spec: RunSpec) -> bool:
    """Placement once the weights exist: frozen, untied input embeddings go to host memory for
    LoRA/QLoRA on one GPU (:mod:`memfit.step.host_embeddings`). The trainer calls it after loading,
    the planner after materialising, so both place the same tensors. True if the embeddings moved."""
    if spec.recipe == "hf" or not spec.uses_adapters or spec.gpus > 1:
        return False
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return keep_input_embeddings_on_host(base)


def prepare_like_hf(
    model: nn.Module,
    spec: RunSpec,
    load_weights: Callable[[nn.Module], None] | None = None,
) -> nn.Module:
    """Prepare ``model`` the way the plain Hugging Face + PEFT stack does (``--recipe hf``).

    The planner uses it to put memfit's step next to the usual one on the same configuration. What
    differs from :func:`prepare_for_method`: QLoRA and lora-8bit go through PEFT's
    ``prepare_model_for_kbit_training``, which upcasts every parameter that is not quantized (embeddings,
    norms, the output head) to fp32 and enables checkpointing with torch's default (reentrant)
    variant (unless ``kbit_upcast`` is off: the trainers that skip it keep them in the compute dtype;
    ``use_reentrant`` names the variant either way);
    LoRA and full fine-tuning use transformers' own checkpointing (``offload`` is
    transformers' synchronous ``save_on_cpu`` offload); nothing is tiled. With ``padding_free: on``
    (flash attention) each example's attention runs on its own tokens, as memfit's does.
    """
    check_targets(model, spec)
    check_modules_to_save(model, spec)
    quantize_base(model, spec)
    if load_weights is not None:
        load_weights(model)
    # torch's variant named, as the stack being planned runs it (spec.reentrant_checkpointing).
    variant = {"use_reentrant": spec.reentrant_checkpointing}
    if spec.base_bits is not None and spec.kbit_upcast:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=spec.checkpointing != "off", gradient_checkpointing_kwargs=variant
        )
        if spec.checkpointing == "offload":
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=variant, offload=True)
    elif spec.checkpointing != "off":
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs=variant, offload=spec.checkpointing == "offload"
        )
    if getattr(model, "config", None) is not None:
        model.config.use_cache = False
        if batch_layout(spec, model.config) == DOCUMENTS:
            use_document_attention(model)  # flash attention's varlen path (padding_free: on)
    if spec.uses_adapters:
        model = attach_lora(model, spec)
        if spec.adapter_dtype == "compute":
            # PEFT made them fp32 (autocast_adapter_dtype); the stacks that train them in the compute
            # dtype cast them back (or build them in it, as torchtune does).
            for p in model.parameters():
                if p.requires_grad:
                    p.data = p.data.to(DTYPES[spec.weight_precision])
    else:
        for p in model.parameters():
            p.requires_grad_(True)
    return model


def prepare_given_model(model: nn.Module, spec: RunSpec) -> nn.Module:
    """Prepare a model the caller built (``train(model=...)``): refuse wrappers, then adapters and
    checkpointing as ``spec`` says (a PeftModel is taken as already adapted)."""
    from peft import PeftModel

    refuse_wrapped_model(model)
    for bits in (4, 8):
        if (
            spec.base_bits == bits
            and not getattr(model, f"is_loaded_in_{bits}bit", False)
            and not isinstance(model, PeftModel)
        ):
            raise SetupError(
                f"method: {spec.method} needs {bits}-bit base weights; let memfit load the model (model: <folder>) "
                "or pass a PeftModel"
            )
    if spec.uses_adapters and not isinstance(model, PeftModel):
        model = attach_lora(model, spec)
    elif not spec.uses_adapters:
        for p in model.parameters():
            p.requires_grad_(True)
    apply_lean_step(model, spec)
    place_for_training(model, spec)
    model.train()
    return model


def refuse_wrapped_model(model: nn.Module) -> None:
    """Raise SetupError unless ``model`` is a plain transformers PreTrainedModel or a PeftModel.

    A custom ``nn.Module`` around the model hides it from ``gradient_checkpointing_enable`` and from
    PEFT's layer matching, and is the usual way memory optimisations are silently lost.
    """
    from peft import PeftModel
    from transformers import PreTrainedModel

    if isinstance(model, (PreTrainedModel, PeftModel)):
        return
    inner = [type(m).__name__ for m in model.modules() if isinstance(m, (PreTrainedModel, PeftModel))]
    found = f" It wraps a {inner[0]}; pass that object instead." if inner else ""
    raise SetupError(
        f"model: a {type(model).__name__} is not a transformers PreTrainedModel or a PEFT PeftModel.{found} "
        "memfit turns on activation checkpointing and attaches adapters through these classes; behind a "
        "custom wrapper both can silently stop applying (and memory use jumps). Unwrap the model, or "
        "put custom logic in a loss function instead."
    )


def trained_copies(model: nn.Module) -> list[dict]:
    """The copies PEFT trains for ``modules_to_save``, one entry per copy: the modules that use it
    (two where tied modules share one copy) and its parameter count."""
    copies: dict[int, dict] = {}
    for name, module in model.named_modules():
        saved = getattr(module, "modules_to_save", None)
        if not isinstance(saved, nn.ModuleDict) or not hasattr(module, "original_module"):
            continue
        for copy in saved.values():
            params = list(copy.parameters())
            key = id(params[0]) if params else id(copy)
            entry = copies.setdefault(key, {"modules": [], "parameters": sum(p.numel() for p in params)})
            entry["modules"].append(name.removeprefix("base_model.model."))
    return list(copies.values())


def adapted_modules(model: nn.Module) -> list[str]:
    """Short names of what carries LoRA adapters (``q_proj``, ``in_proj``...), sorted; an adapter on a
    weight that is not a module's only one says which (``experts.gate_up_proj``), a router's or a
    linear layer's adapted through its weight by its module's name."""
    names = set()
    for name, module in model.named_modules():
        if not hasattr(module, "lora_A"):
            continue
        short = name.replace(".base_layer", "").rsplit(".", 1)[-1]
        parameter = getattr(module, "parameter_name", None)
        names.add(f"{short}.{parameter}" if parameter not in (None, "weight") else short)
    return sorted(names)


def expected_adapter_parameters(model: nn.Module) -> int:
    """Parameters the adapters train, worked out from the layers themselves: r x (in + out) for each
    LoRA layer (for each expert of a fused expert weight: PEFT's ``ParamWrapper`` holds one pair per
    expert), plus out (one magnitude per output row) where it has DoRA, plus every element of the
    copies PEFT trains for ``modules_to_save`` (a copy shared by tied modules counted once)."""
    total = 0
    copies: dict[int, int] = {}
    for module in model.modules():
        saved = getattr(module, "modules_to_save", None)
        if isinstance(saved, nn.ModuleDict) and hasattr(module, "original_module"):
            for copy in saved.values():
                copies.update({id(p): p.numel() for p in copy.parameters()})
        lora_a = getattr(module, "lora_A", None)
        lora_b = getattr(module, "lora_B", None)
        if not isinstance(lora_a, nn.ModuleDict) or not isinstance(lora_b, nn.ModuleDict):
            continue
        magnitudes = getattr(module, "lora_magnitude_vector", None) or {}
        experts = int(getattr(module, "num_experts", 1) or 1) if hasattr(module, "parameter_name") else 1
        for key in lora_a:
            rank = module.r[key]
            total += experts * rank * (module.in_features + module.out_features)
            if key in magnitudes:
                total += module.out_features
    return total + sum(copies.values())


def checkpointed_layers(model: nn.Module) -> tuple[int, int]:
    """(decoder layers with activation checkpointing on, decoder layers)."""
    layers = decoder_layers(model)
    on = sum(1 for layer in layers if getattr(layer, "gradient_checkpointing", False))
    return on, len(layers)
