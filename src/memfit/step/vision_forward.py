"""A vision-language forward run module by module, where transformers' own cannot finish.

transformers 5.24's ``Llama4ForConditionalGeneration.forward`` runs the vision tower, the projector
and the language model, then builds its output from a field its language model's output does not
have (``image_outputs``) and fails. For such a model the step runs the same modules in the same
order as that forward does: the tokens' embeddings, the tower's features of the pixels
(``get_image_features``), the projector, the projected features scattered into the image tokens'
places (``get_placeholder_mask``), then the language model on those embeddings. The planner and the
trainer both take this path (:mod:`memfit.step.losses`, :mod:`memfit.step.preference`,
:mod:`memfit.step.grpo`), so a plan is the run's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

#: The vision-language model types whose own forward transformers cannot finish (see the module doc).
FORWARD_BY_MODULES = frozenset({"llama4"})


def _base(model: nn.Module) -> nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def runs_by_modules(model: nn.Module) -> bool:
    """Whether ``model`` (PEFT's wrapper seen through) is one whose forward memfit runs module by module."""
    base = _base(model)
    model_type = getattr(getattr(base, "config", None), "model_type", None)
    return model_type in FORWARD_BY_MODULES and isinstance(getattr(base, "language_model", None), nn.Module)


def merged_embeddings(model: nn.Module, input_ids: torch.Tensor, pixel_values: torch.Tensor | None) -> torch.Tensor:
    """The language model's input embeddings of ``input_ids`` with the projected image features of
    ``pixel_values`` in the image tokens' places, as ``Llama4ForConditionalGeneration.forward`` makes them."""
    base = _base(model)
    embeds = base.get_input_embeddings()(input_ids)
    if pixel_values is None:
        return embeds
    features = base.get_image_features(pixel_values=pixel_values, return_dict=True).last_hidden_state
    flat = features.view(-1, features.size(-1))
    projected = base.multi_modal_projector(flat).to(embeds.device, embeds.dtype)
    mask = base.get_placeholder_mask(input_ids, inputs_embeds=embeds, image_features=projected)
    return embeds.masked_scatter(mask, projected)


def module_backbone(model: nn.Module) -> Callable[..., Any] | None:
    """For a model whose forward runs module by module, its backbone: called as a decoder is (the
    batch's inputs), it returns the language model's decoder output (``last_hidden_state``) on the
    merged embeddings; None for any other model."""
    if not runs_by_modules(model):
        return None
    base = _base(model)
    decoder = (
        base.language_model.model
    )  # its decoder stack (the causal LM's get_decoder finds no "language_model" in it)

    def backbone(input_ids: torch.Tensor, pixel_values: torch.Tensor | None = None, **inputs: Any) -> Any:
        return decoder(inputs_embeds=merged_embeddings(model, input_ids, pixel_values), **inputs)

    return backbone


def model_forward(model: nn.Module, inputs: dict[str, Any], **options: Any) -> Any:
    """``model(**inputs, **options)`` (its output: ``logits``, ``loss`` with ``labels=``), or, for a
    model whose own forward cannot finish, its language model's output on the merged embeddings
    (the same logits and loss: the language model computes them as the whole model's forward does)."""
    if not runs_by_modules(model):
        return model(**inputs, **options)
    rest = {key: value for key, value in inputs.items() if key not in ("input_ids", "pixel_values")}
    embeds = merged_embeddings(model, inputs["input_ids"], inputs.get("pixel_values"))
    return _base(model).language_model(inputs_embeds=embeds, **rest, **options)
