"""Where things are inside a causal LM: its decoder layers and the linear layers in them.

Structure queries shared by every layer above (quantizing, adapters, tiling, sharding, checks);
they read module types and names only, never tensor values.
"""

from __future__ import annotations

from torch import nn

from memfit.models.errors import ModelBuildError
from memfit.models.experts import router_ids


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The ModuleList of decoder blocks (the longest ModuleList in the model; in a vision-language
    model, in its language model: a vision tower's blocks may be more)."""
    from memfit.models.vision import language_model

    best = None
    for module in language_model(model).modules():
        if isinstance(module, nn.ModuleList) and (best is None or len(module) > len(best)):
            best = module
    if best is None:
        raise ModelBuildError(f"{type(model).__name__} has no list of decoder layers")
    return best


def linear_names_in_layers(model: nn.Module) -> list[str]:
    """Short names of the linear layers inside the decoder blocks (``q_proj``, ``down_proj``, ...);
    a mixture-of-experts router is none, even where it is an ``nn.Linear`` subclass (its forward
    returns the routing, not a linear map: :mod:`memfit.models.experts`)."""
    names = set()
    skipped = router_ids(model)
    for block in decoder_layers(model):
        for name, module in block.named_modules():
            if _is_linear(module) and name and id(module) not in skipped:
                names.add(name.rsplit(".", 1)[-1])
    return sorted(names)


def _is_linear(module: nn.Module) -> bool:
    if isinstance(module, nn.Linear):
        return True
    # GPT-2 style models use transformers' Conv1D (a linear layer with transposed weight).
    return type(module).__name__ == "Conv1D"
