"""4-bit NF4 weights (QLoRA): the settings memfit uses, and where they are applied.

One place for the QLoRA paper's settings (NF4, double quantization, 64-element blocks, uint8
storage): layers are swapped on ``meta`` (:func:`quantize_linears_on_meta`), a materialised fake or
random model is quantized by bitsandbytes' own ``quantize_4bit``
(:func:`memfit.models.build.materialize`), and a real weight is quantized on its device as it is
loaded (:func:`quantize_on_device`). bitsandbytes is imported only here, and only when called.
"""

from __future__ import annotations

import torch
from torch import nn

from memfit.models.layers import decoder_layers

#: bitsandbytes NF4 settings memfit uses for QLoRA (the QLoRA paper's: NF4, double quantization,
#: 64-element blocks, uint8 storage).
NF4_BLOCKSIZE = 64



def is_linear4bit(module: nn.Module) -> bool:
    """True for bitsandbytes' Linear4bit, checked without importing bitsandbytes (slow to import)."""
    return any(c.__name__ == "Linear4bit" and c.__module__.startswith("bitsandbytes") for c in type(module).__mro__)


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



def quantize_on_device(module: nn.Module, dense: torch.Tensor, device: torch.device) -> nn.Parameter:
    """NF4-quantize ``dense`` (already on ``device``) for 4-bit layer ``module``; the packed weight.

    Only this layer's dense weight exists while it runs: bitsandbytes replaces ``.data`` with the
    packed uint8 tensor and the dense one is freed when the caller drops it.
    """
    import bitsandbytes as bnb

    param = bnb.nn.Params4bit(
        dense.to(module.compute_dtype or torch.bfloat16),
        requires_grad=False,
        compress_statistics=True,
        quant_type="nf4",
        quant_storage=torch.uint8,
        blocksize=NF4_BLOCKSIZE,
        module=module,
    )
    return param._quantize(device)


def quantize_fake_or_random(module: nn.Module, device: str | torch.device, *, random_values: bool) -> None:
    """Give a materialised 4-bit layer the packed weight and quantization state bitsandbytes stores.

    Made by bitsandbytes' own ``quantize_4bit`` on a dense weight (fake under ``FakeTensorMode``,
    so nothing is allocated; random when ``random_values``).
    """
    import bitsandbytes.functional as bnbf

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
