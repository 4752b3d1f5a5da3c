"""LoRA adapters that do not keep an fp32 copy of their input.

PEFT keeps adapter weights in fp32 (small, and precise for small updates) and casts each LoRA
layer's input to fp32 before ``lora_A``. Autograd then keeps that fp32 copy of the input for
``lora_A``'s weight gradient, once per adapted projection: for attention's q, k, v and o
projections that is four fp32 copies of ``[tokens, hidden]`` per layer (Llama-3.1-8B at 100k
tokens: 1.6 GB each) held through the layer's backward, while the input itself, in the compute
dtype, is kept anyway.

:func:`keep_lora_inputs_low_precision` turns PEFT's cast off and gives each ``lora_A`` a linear
whose autograd function saves the input as it comes (bf16) and casts it to the adapter's dtype
inside forward, and again, one layer at a time, inside backward. The arithmetic is PEFT's:
``lora_A(x.to(fp32))`` forward, the same fp32 matmuls backward, so outputs and gradients are
equal. Only the instances' ``forward`` changes: parameter names and adapter files are untouched.
Under autocast (mixed precision) the adapter computes in the 16-bit format from the input as it
comes, as autocast runs any linear layer: no fp32 copy exists there either.

DoRA layers keep PEFT's cast: DoRA computes its weight norms in the dtype of the input it is given
(the frozen weight and the update are cast to it), so an input left in bf16 would change its
arithmetic, not only its memory.
"""

from __future__ import annotations

import types

import torch
from torch import nn

_PATCHED_ATTR = "_memfit_low_precision_input"


class UpcastInputLinear(torch.autograd.Function):
    """``linear(x.to(weight.dtype), weight, bias)`` that saves ``x`` in its own dtype."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return nn.functional.linear(x.to(weight.dtype), weight, bias)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad_weight = grad_bias = None
        flat_grad = grad_out.reshape(-1, grad_out.shape[-1])
        if ctx.needs_input_grad[0]:
            grad_x = (grad_out @ weight).to(x.dtype)
        if ctx.needs_input_grad[1]:
            wide = x.reshape(-1, x.shape[-1]).to(weight.dtype)  # the only fp32 copy, for this matmul
            grad_weight = flat_grad.t() @ wide
            del wide
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = flat_grad.sum(0)
        return grad_x, grad_weight, grad_bias


def _forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if torch.is_autocast_enabled(x.device.type):
        # Mixed precision: autocast runs the adapter in its 16-bit format from the input as it
        # comes, so there is no fp32 copy to avoid (and none to make).
        return nn.functional.linear(x, self.weight, self.bias)
    if x.dtype == self.weight.dtype or not torch.is_grad_enabled():
        return nn.functional.linear(x.to(self.weight.dtype), self.weight, self.bias)
    return UpcastInputLinear.apply(x, self.weight, self.bias)


def keep_lora_inputs_low_precision(model: nn.Module) -> int:
    """Stop PEFT's LoRA layers from keeping fp32 copies of their inputs; returns the layers changed.

    Idempotent; a model without LoRA layers is left as it is (returns 0).
    """
    changed = 0
    for module in model.modules():
        lora_a = getattr(module, "lora_A", None)
        if not isinstance(lora_a, nn.ModuleDict) or not hasattr(module, "base_layer"):
            continue
        linears = [m for m in lora_a.values() if type(m) is nn.Linear]
        if not linears or len(getattr(module, "lora_magnitude_vector", None) or ()) > 0:
            continue
        # PEFT's own switch (peft.helpers.disable_input_dtype_casting flips the same attribute).
        module.cast_input_dtype_enabled = False
        for linear in linears:
            if not linear.__dict__.get(_PATCHED_ATTR):
                linear.forward = types.MethodType(_forward, linear)
                linear.__dict__[_PATCHED_ATTR] = True
        changed += 1
    return changed
