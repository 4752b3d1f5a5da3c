"""The merge arithmetic, written to give the same bits as PEFT's merge on the CPU.

PEFT (0.17 to 0.21) loads adapter weights in float32 (`autocast_adapter_dtype=True` upcasts
bf16/fp16 LoRA weights), so for a Linear or Conv1D layer it computes

    delta = transpose(B32 @ A32, fan_in_fan_out) * scale         # float32
    W += delta                                                      # in place, W in its own dtype

and the in-place add promotes to float32 and rounds once into W's dtype. For an Embedding layer
it rounds the delta to W's dtype first and then adds (`W += delta.to(W.dtype)`), so the result is
rounded twice. Both orders are kept here; the float32 add is commutative, so adding W into the
delta buffer (which saves one weight-sized float32 temporary) gives identical bits.
"""

from __future__ import annotations


def lora_delta(a, b, scale: float, transpose: bool, device):
    """`transpose(B @ A) * scale` in float32 on `device`, in PEFT's operation order."""
    import torch

    product = b.to(device=device, dtype=torch.float32) @ a.to(device=device, dtype=torch.float32)
    if transpose:
        product = product.T
    return product * scale


def add_linear_delta(weight, delta):
    """Linear / Conv1D merge: float32 sum, one rounding to the weight's dtype."""
    return delta.add_(weight.to(delta.device)).to(weight.dtype)


def add_embedding_delta(weight, delta):
    """Embedding merge: delta rounded to the weight's dtype, then added in that dtype."""
    return weight.to(delta.device) + delta.to(weight.dtype)


def apply_deltas(weight, deltas, tensors, device):
    """Apply `deltas` (plan.Delta, in PEFT's order) to `weight`, returning a new tensor on `device`."""
    for item in deltas:
        delta = lora_delta(tensors[item.pair.a_key], tensors[item.pair.b_key], item.pair.scale, item.transpose, device)
        if item.pair.kind == "embedding":
            weight = add_embedding_delta(weight, delta)
        else:
            weight = add_linear_delta(weight, delta)
        del delta  # free the float32 buffer before the next delta on this tensor
    return weight
