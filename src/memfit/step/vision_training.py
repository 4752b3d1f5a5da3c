"""What of a vision-language model trains: the language model by default, the vision tower when asked.

The vision tower and the projector are frozen by default (``freeze_vision``, LLaMA-Factory's
``freeze_vision_tower``): full fine-tuning trains the language model's weights, LoRA adapts the
language model's linear layers. ``freeze_vision: false`` trains them too: whole with full
fine-tuning; with LoRA, adapters on the tower's and projector's linear layers that ``targets``
names (``all-linear``: every one). The tower's activation checkpointing is its own knob
(``vision_checkpointing``): with checkpointing, transformers makes every sub-model's input
embeddings' output require a gradient (``enable_input_require_grads``), the tower's patch
embeddings among them, so even a frozen tower keeps its blocks' activations for backward unless
they are checkpointed.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from memfit.models.experts import routers
from memfit.models.layers import _is_linear, decoder_layers
from memfit.models.vision import vision_module_names, vision_parts
from memfit.spec import ALL_LINEAR, RunSpec


def is_vision_model(model: nn.Module) -> bool:
    """Whether ``model`` (PEFT's wrapper seen through) has a vision tower."""
    return bool(vision_parts(model))


def lora_module_names(model: nn.Module, spec: RunSpec) -> list[str]:
    """The qualified names of the linear modules LoRA adapts in a vision-language ``model``: the
    decoder layers' linear modules that ``spec.targets`` names, and, with ``freeze_vision: false``,
    the tower's and projector's. A mixture of experts' routers are not among them: as in a text
    model, a router is adapted only when ``targets`` names it, through its weight
    (:func:`memfit.step.lora_targets.lora_targets`), and Llama 4's router, a linear layer that returns
    its scores and logits, cannot take PEFT's linear adapter."""
    wanted = None if spec.targets == (ALL_LINEAR,) else set(spec.targets)
    layers = {id(m) for block in decoder_layers(model) for m in block.modules()}
    vision = vision_module_names(model) if not spec.freeze_vision else {}
    routed = set(routers(model))
    names = []
    for name, module in model.named_modules():
        if not _is_linear(module) or name in routed or (id(module) not in layers and name not in vision):
            continue
        if wanted is None or name.rsplit(".", 1)[-1] in wanted:
            names.append(name)
    return names


def vision_linear_names(model: nn.Module) -> list[str]:
    """Short names of the linear layers of the vision tower and projector (what ``targets`` may name
    with ``freeze_vision: false``)."""
    names = vision_module_names(model)
    return sorted(
        {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if name in names and _is_linear(module)}
    )


def freeze_vision(model: nn.Module, spec: RunSpec) -> None:
    """Full fine-tuning's frozen tower and projector (``freeze_vision``); nothing for a text model."""
    if not spec.freeze_vision:
        return
    for part in vision_parts(model).values():
        for p in part.parameters():
            p.requires_grad_(False)


def set_tower_checkpointing(model: nn.Module, spec: RunSpec, enable: Callable[[nn.Module], None]) -> None:
    """The tower's blocks checkpointed as ``vision_checkpointing`` says (auto: as the decoder's); the decoder's checkpointing is set already, ``enable`` turns transformers'
    checkpointing on (:func:`memfit.step.prepare.enable_checkpointing`)."""
    tower = vision_parts(model).get("tower")
    if tower is None:
        return
    wanted = spec.vision_checkpointing
    on = wanted == "on" or (wanted == "auto" and spec.checkpointing != "off")
    if on and not any(getattr(m, "gradient_checkpointing", False) for m in tower.modules()):
        enable(model)  # the whole model's (transformers' switch); the decoder's is set again below
        if spec.checkpointing == "off":
            for block in decoder_layers(model):
                _set(block, False)
    _set(tower, on)


def _set(module: nn.Module, on: bool) -> None:
    for m in module.modules():
        if hasattr(m, "gradient_checkpointing") and isinstance(m.gradient_checkpointing, bool):
            m.gradient_checkpointing = on
