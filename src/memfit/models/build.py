"""Build a causal LM from its config on the ``meta`` device, and give it storage.

Building runs without memory: the model exists on ``meta`` (shapes only). Preparing it for a
training method (4-bit layers, adapters, checkpointing, the memory-lean step) is
:mod:`memfit.step.prepare`'s job. The planner then materialises the prepared model inside
``FakeTensorMode`` (:func:`materialize`); the trainer loads real weights into the same structure.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from memfit.models.cutting import cut_config_data
from memfit.models.errors import ModelBuildError
from memfit.models.experts_nf4 import fill_random, nf4_expert_modules, unpacked_counts
from memfit.models.quantize import is_quantized_linear, quantize_fake_or_random
from memfit.models.vision import is_vision_config, language_config, nested_config

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def make_config(config_dict: dict[str, Any], num_layers: int | None = None, *, layers: Sequence[int] | None = None):
    """A transformers config from a config dict, optionally cut: to its first ``num_layers`` decoder
    layers, or to copies of the layers at the indices ``layers`` (:mod:`memfit.models.cutting`)."""
    config_dict = nested_config(config_dict)
    config = _config(config_dict)
    text = language_config(config)
    if num_layers is not None and layers is None:
        layers = range(min(int(num_layers), int(text.num_hidden_layers)))
    if layers is None:
        return config
    if is_vision_config(config_dict):
        # A vision-language model's decoder is its language model's: the cut is of text_config.
        cut_text = cut_config_data(config_dict["text_config"], text, layers)
        cut = _config({**config_dict, "text_config": cut_text})
    else:
        cut = _config(cut_config_data(config_dict, config, layers))
    if int(language_config(cut).num_hidden_layers) != len(layers):  # a config that ignored the depth it was given
        language_config(cut).num_hidden_layers = len(layers)
    return cut


def _config(config_dict: dict[str, Any]):
    from transformers import AutoConfig

    data = copy.deepcopy(config_dict)
    model_type = data.pop("model_type", None)
    try:
        return AutoConfig.for_model(model_type, **data)
    except (ValueError, KeyError, TypeError) as err:
        raise ModelBuildError(
            f"transformers cannot make a config for model_type {model_type!r}: {err}. "
            "Check the model_type field, or upgrade transformers if the architecture is new."
        ) from None


def build_meta_model(config, dtype: torch.dtype) -> nn.Module:
    """The causal LM of ``config`` on the ``meta`` device, in ``dtype``, with SDPA attention; a
    vision-language config's whole model (language model, vision tower and projector:
    ``AutoModelForImageTextToText``)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    if is_vision_config(config):
        AutoModelForCausalLM = AutoModelForImageTextToText

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


def materialize(model: nn.Module, device: str | torch.device, *, random_values: bool = False) -> nn.Module:
    """Give a meta model storage on ``device``; inside ``FakeTensorMode`` nothing is allocated.

    4-bit and 8-bit layers get the weight and quantization state that bitsandbytes would store, made
    by bitsandbytes' own quantization of a (fake) dense weight. ``random_values`` fills real
    storage with small random numbers (uninitialised memory could hold NaNs) and gives buffers the
    values their model computes for them (rotary frequencies, embedding scales); fake storage has no
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
        _init_buffers(model)
    for module in model.modules():
        if is_quantized_linear(module):
            quantize_fake_or_random(module, device, random_values=random_values)
    if random_values:
        for module in nf4_expert_modules(model):
            fill_random(module, device)
    return model


def _init_buffers(model: nn.Module) -> None:
    """Compute the buffers ``to_empty`` left uninitialised (:func:`compute_buffers`); garbage left
    in them (memory reused from earlier tensors) turns into NaNs that depend on what ran before. A
    buffer no initializer fills is zeroed, so a run never depends on leftover memory."""
    nf4 = {id(m) for m in nf4_expert_modules(model)}  # their buffers are quantization state, filled with their experts
    for module in model.modules():
        if id(module) in nf4:
            continue
        if any(b is not None for b in module._buffers.values()) and not compute_buffers(model, module):
            with torch.no_grad():
                for buffer in module._buffers.values():
                    if buffer is not None and buffer.is_floating_point():
                        buffer.nan_to_num_(0.0)


def compute_buffers(model: nn.Module, module: nn.Module) -> bool:
    """Give ``module``'s buffers (already holding storage) the values ``model`` computes for them,
    through the model's own ``_init_weights`` (rotary ``inv_freq``, Gemma's ``embed_scale``), and
    leave the parameters as they are (loaded weights stay). The initializer is run on ``module``,
    then, while its buffers still lack values, on each module above it (Falcon-H1's model fills its
    Mamba mixers' ``mup_vector``). Returns whether every buffer got a value: floating buffers start
    as NaN and must not end so; others start as zeros, which cannot be told from a value, so a
    module that has any is never reported computed.

    The values are worked out with dispatch modes off: the planner's real-tensor run materializes
    under its memory tracker, and the initializers' scratch tensors are no part of a training step
    (its fake-tensor run has no values to compute, and must record the same allocations).
    """
    from torch.utils._python_dispatch import _disable_current_modes

    init_weights = getattr(model, "_init_weights", None)
    buffers = [b for b in module._buffers.values() if b is not None]
    with torch.no_grad(), _disable_current_modes():
        for buffer in buffers:
            if buffer.is_floating_point():
                buffer.fill_(float("nan"))
            else:
                buffer.zero_()
        if init_weights is None:
            return False
        floating = [b for b in buffers if b.is_floating_point()]
        for owner in [module, *_ancestors(model, module)]:
            with _parameters_hidden(owner):
                init_weights(owner)
            if not any(bool(b.isnan().any()) for b in floating):
                break
        return len(floating) == len(buffers) and not any(bool(b.isnan().any()) for b in floating)


def _ancestors(model: nn.Module, module: nn.Module) -> list[nn.Module]:
    """The modules that hold ``module``, nearest first."""
    names = {id(m): name for name, m in model.named_modules()}
    name = names.get(id(module))
    if not name:
        return []
    parts = name.split(".")
    return [model.get_submodule(".".join(parts[:i])) for i in range(len(parts) - 1, -1, -1)]


@contextlib.contextmanager
def _parameters_hidden(owner: nn.Module):
    """Storage-less stand-ins for the parameters of ``owner`` and everything in it, while an
    initializer that would also draw them runs: the loaded weights stay as they are."""
    saved = [(m, m._parameters) for m in owner.modules()]
    for m, parameters in saved:
        m._parameters = {
            name: None
            if p is None
            else nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=False)
            for name, p in parameters.items()
        }
    try:
        yield
    finally:
        for m, parameters in saved:
            m._parameters = parameters


def _shared_parameter_slots(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Groups of (module, attribute) slots that hold one and the same Parameter (tied weights)."""
    slots: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                slots.setdefault(id(param), []).append((module, name))
    return [group for group in slots.values() if len(group) > 1]


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(total, trainable) parameter counts; 4-bit packed weights (linear layers' and experts') count as
    their unpacked elements (an int8 weight holds one element a byte: its count is its own)."""
    total = trainable = 0
    experts = unpacked_counts(model)  # 4-bit experts: the elements each packed tensor stands for
    for p in model.parameters():
        quant_state = getattr(p, "quant_state", None)
        n = int(torch.Size(quant_state.shape).numel()) if quant_state is not None else experts.get(id(p), p.numel())
        total += n
        if p.requires_grad:
            trainable += n
    return total, trainable
