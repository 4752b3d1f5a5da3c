"""Quantized frozen base weights: 4-bit NF4 (QLoRA) and 8-bit LLM.int8 (``method: lora-8bit``).

One place for the settings memfit uses: the QLoRA paper's (NF4, double quantization, 64-element
blocks, uint8 storage) and LLM.int8's as transformers' ``load_in_8bit`` applies them (int8 weights
with one fp32 scale per output row, inputs above 6.0 kept in 16 bits). Layers are swapped on
``meta`` (:func:`quantize_linears_on_meta`, :func:`int8_linears_on_meta`), a materialised fake or
random model is quantized by bitsandbytes' own functions (:func:`memfit.models.build.materialize`),
and a real weight is quantized on its device as it is loaded (:func:`quantize_on_device`).
bitsandbytes is imported only here, and only when called.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from memfit.models.experts import router_ids
from memfit.models.layers import decoder_layers

#: bitsandbytes NF4 settings memfit uses for QLoRA (the QLoRA paper's: NF4, double quantization,
#: 64-element blocks, uint8 storage).
NF4_BLOCKSIZE = 64
#: bitsandbytes' block of the double-quantized absmax (``quantize_4bit(compress_statistics=True)``).
ABSMAX_BLOCKSIZE = 256

#: LLM.int8's outlier threshold: input features above it take the 16-bit path (transformers'
#: ``BitsAndBytesConfig.llm_int8_threshold`` default, which Axolotl's ``load_in_8bit`` uses).
INT8_THRESHOLD = 6.0


def is_linear4bit(module: nn.Module) -> bool:
    """True for bitsandbytes' Linear4bit, checked without importing bitsandbytes (slow to import)."""
    return any(c.__name__ == "Linear4bit" and c.__module__.startswith("bitsandbytes") for c in type(module).__mro__)


def is_linear8bit(module: nn.Module) -> bool:
    """True for bitsandbytes' Linear8bitLt, checked without importing bitsandbytes."""
    return any(c.__name__ == "Linear8bitLt" and c.__module__.startswith("bitsandbytes") for c in type(module).__mro__)


def is_quantized_linear(module: nn.Module) -> bool:
    """A bitsandbytes 4-bit or 8-bit linear layer (its weight is quantized as it is loaded)."""
    return is_linear4bit(module) or is_linear8bit(module)


def _swap_decoder_linears(model: nn.Module, quantized: Callable[[nn.Linear], nn.Module]) -> int:
    """Replace every ``nn.Linear`` of the decoder blocks (the set transformers quantizes: all but
    the output head) by ``quantized(linear)``, built on meta. Returns the number swapped. A
    mixture-of-experts router that is an ``nn.Linear`` subclass (Phi-3.5-MoE, Llama 4) keeps its
    weights: its forward returns the routing, which a quantized linear layer would not."""
    swapped = 0
    routers = router_ids(model)
    for block in decoder_layers(model):
        for name, module in list(block.named_modules()):
            if not isinstance(module, nn.Linear) or id(module) in routers:
                continue
            parent_name, _, child = name.rpartition(".")
            parent = block.get_submodule(parent_name) if parent_name else block
            with torch.device("meta"):
                layer = quantized(module)
            setattr(parent, child, layer)
            swapped += 1
    return swapped


def _mark_quantized(model: nn.Module) -> None:
    """Flag the model's configs as transformers flags a model it loaded quantized: models that read a
    linear layer's weight directly (a Mamba mixer's ``dt_proj``) call the layer instead when flagged."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(module, "get_input_embeddings"):
            config._is_quantized = True


def quantize_linears_on_meta(model: nn.Module, compute_dtype: torch.dtype) -> int:
    """Swap every linear layer of the decoder blocks for a bitsandbytes NF4 ``Linear4bit`` (on meta).

    This is the set transformers quantizes for ``load_in_4bit`` (every linear except the output
    head). Returns the number of layers swapped.
    """
    import bitsandbytes as bnb

    def nf4(module: nn.Linear) -> nn.Module:
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
        q.weight.data = torch.empty(
            packed_nf4_shape(module.out_features, module.in_features), dtype=torch.uint8, device="meta"
        )
        q.weight.requires_grad_(False)
        if q.bias is not None:
            q.bias.requires_grad_(False)
        return q

    swapped = _swap_decoder_linears(model, nf4)
    model.is_loaded_in_4bit = True  # PEFT reads this to pick its 4-bit LoRA layers
    _mark_quantized(model)
    return swapped


def int8_linears_on_meta(model: nn.Module) -> int:
    """Swap every linear layer of the decoder blocks for a bitsandbytes LLM.int8 ``Linear8bitLt`` (on meta).

    The set transformers quantizes for ``load_in_8bit`` (every linear but the output head), frozen
    int8 weights (``has_fp16_weights=False``) and outliers above :data:`INT8_THRESHOLD`. Biases keep
    the model's dtype. Returns the number of layers swapped.
    """
    import bitsandbytes as bnb

    def int8(module: nn.Linear) -> nn.Module:
        q = bnb.nn.Linear8bitLt(
            module.in_features,
            module.out_features,
            bias=module.bias is not None,
            has_fp16_weights=False,
            threshold=INT8_THRESHOLD,
        )
        # The int8 weight's shape from the start, so that materialising never allocates dense weights.
        empty = torch.empty(module.out_features, module.in_features, dtype=torch.int8, device="meta")
        scales = torch.empty(module.out_features, dtype=torch.float32, device="meta")
        q.weight = bnb.nn.Int8Params(empty, requires_grad=False, has_fp16_weights=False, CB=empty, SCB=scales)
        if q.bias is not None:
            q.bias = nn.Parameter(torch.empty_like(module.bias, device="meta"), requires_grad=False)
        q.compute_dtype = module.weight.dtype  # what the weight is dequantized to when loaded or drawn
        return q

    swapped = _swap_decoder_linears(model, int8)
    model.is_loaded_in_8bit = True  # PEFT reads this to pick its 8-bit LoRA layers
    _mark_quantized(model)
    _drop_int8_cast_warning()
    return swapped


class _Int8CastWarning(logging.Filter):
    """Drops bitsandbytes' "inputs will be cast ... to float16" line: LLM.int8 always quantizes
    from fp16 (docs/train.md says so once), and the line came with every 8-bit matmul of a run."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("MatMul8bitLt: inputs will be cast")


def _drop_int8_cast_warning() -> None:
    log = logging.getLogger("bitsandbytes.autograd._functions")
    if not any(isinstance(f, _Int8CastWarning) for f in log.filters):
        log.addFilter(_Int8CastWarning())


def nf4_quant_state_bytes(elements: int) -> int:
    """Bytes of the quantization state bitsandbytes keeps beside an NF4 weight of ``elements`` values
    (double quantization): each 64-value block's absmax in 8 bits, the absmax's own fp32 absmax per
    256 blocks, and its fp32 offset. The two code tables are shared by every weight (not counted)."""
    blocks = -(-elements // NF4_BLOCKSIZE)
    return blocks + 4 * -(-blocks // ABSMAX_BLOCKSIZE) + 4


def packed_nf4_shape(out_features: int, in_features: int) -> tuple[int, int]:
    """Shape of the uint8 tensor bitsandbytes packs an ``[out, in]`` weight into (two 4-bit values a byte)."""
    return ((out_features * in_features + 1) // 2, 1)


def quantize_on_device(module: nn.Module, dense: torch.Tensor, device: torch.device) -> nn.Parameter:
    """Quantize ``dense`` (already on ``device``) for the 4-bit or 8-bit layer ``module``; the new weight.

    Only this layer's dense weight exists while it runs: bitsandbytes replaces ``.data`` with the
    packed uint8 (NF4) or int8 tensor and the dense one is freed when the caller drops it.
    """
    import bitsandbytes as bnb

    if is_linear8bit(module):
        # LLM.int8 quantizes from fp16 (bitsandbytes casts to it), one absmax scale per output row.
        return bnb.nn.Int8Params(dense, requires_grad=False, has_fp16_weights=False)._quantize(device)
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
    """Give a materialised 4-bit or 8-bit layer the weight and quantization state bitsandbytes stores.

    Made by bitsandbytes' own quantization of a dense weight (fake under ``FakeTensorMode``, so
    nothing is allocated; random when ``random_values``).
    """
    import bitsandbytes.functional as bnbf

    dense = torch.empty(module.out_features, module.in_features, dtype=module.compute_dtype, device=device)
    if random_values:
        dense.normal_(0.0, 0.02)
    if is_linear8bit(module):
        # What Int8Params._quantize does; the parameter object stays (an Int8Params cannot hold a fake
        # tensor) and holds the int8 rows and their scales as an Int8Params does.
        rows, scales, _ = bnbf.int8_vectorwise_quant(dense.contiguous().to(torch.float16))
        del dense
        weight = module.weight
        weight.data = rows
        weight.CB, weight.SCB, weight.has_fp16_weights = rows, scales, False
        return
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
