"""The merge arithmetic, written to give the same bits as PEFT's merge on the CPU.

PEFT (0.17 to 0.21) loads adapter weights in float32 (`autocast_adapter_dtype=True` upcasts
bf16/fp16 LoRA weights), so for a Linear or Conv1D layer it computes

    delta = transpose(B32 @ A32, fan_in_fan_out) * scale         # float32
    W += delta                                                      # in place, W in its own dtype

and the in-place add promotes to float32 and rounds once into W's dtype. For an Embedding layer
it rounds the delta to W's dtype first and then adds (`W += delta.to(W.dtype)`), so the result is
rounded twice. Both orders are kept here; the float32 add is commutative, so adding W into the
delta buffer (which saves one weight-sized float32 temporary) gives identical bits.

DoRA (PEFT's ``DoraLinearVariant.merge_unsafe``) takes the same float32 sum ``W + delta``, the
float32 L2 norm of each output row of it, and writes ``(m / norm) * (W + delta)`` rounded once to
W's dtype; the multiply is done in place in the sum's buffer (the same bits as PEFT's new tensor).

An adapter on a weight (``target_parameters``: a fused expert weight, a router, a linear layer's
weight; PEFT's ``ParamWrapper``) rounds its float32 update to the weight's dtype before adding it,
as an embedding's does (:func:`weight_delta`, :func:`add_weight_delta`).
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


def apply_dora(weight, delta, magnitude, transpose: bool):
    """DoRA merge: each output row of ``W + delta`` scaled to its magnitude, in PEFT's dtypes and order.

    ``transpose``: the weight is stored ``[in, out]`` (GPT-2 Conv1D), so its output rows are columns.
    PEFT loads the magnitude in float32 (``autocast_adapter_dtype``), as it does LoRA's weights.
    """
    import torch

    summed = delta.add_(weight.to(delta.device))  # float32: W promoted, one rounding-free sum
    if transpose:
        # PEFT's sum of the two transposed views is laid out as the stored weight; the norm's
        # reduction order follows the layout, so the bits do too.
        summed = summed.contiguous()
    rows = summed.T if transpose else summed
    norm = torch.linalg.norm(rows, dim=1).to(rows.dtype)
    factor = (magnitude.to(device=summed.device, dtype=torch.float32) / norm).view(-1, 1)
    summed.mul_(factor.T if transpose else factor)
    return summed.to(weight.dtype)


def weight_delta(item, tensors, device):
    """The update of PEFT's adapter on a weight (``ParamWrapper.get_delta_weight``), in float32 on
    ``device``: ``B @ A * scale`` for a single weight; for a fused expert weight the einsum PEFT
    computes over its experts (``"o r e, e r i -> e o i"``, ``"e i o"`` where it did not swap the
    weight's sizes), here over the one expert the tensor holds, cut to that tensor's rows when the
    checkpoint stores gate and up apart. Computed expert by expert, it gives the bits of the whole."""
    import torch

    pair = item.pair
    a = tensors[pair.a_key].to(device=device, dtype=torch.float32)
    b = tensors[pair.b_key].to(device=device, dtype=torch.float32)
    if pair.experts == 1:
        return (b @ a) * pair.scale
    a = a.reshape(pair.experts, -1, a.shape[-1])
    b = b.reshape(b.shape[0], -1, pair.experts)
    if item.expert is not None:
        a, b = a[item.expert : item.expert + 1], b[:, :, item.expert : item.expert + 1]
    delta = torch.einsum("o r e, e r i -> e o i" if pair.swapped else "o r e, e r i -> e i o", b, a) * pair.scale
    if item.expert is None:
        return delta
    rows = delta.shape[1] // item.parts
    return delta[0, item.part * rows : (item.part + 1) * rows]


def add_weight_delta(weight, delta):
    """PEFT's merge of a weight adapter: the update rounded to the weight's dtype, then added in it."""
    return weight.to(delta.device) + delta.to(weight.dtype)


def apply_deltas(weight, deltas, tensors, device):
    """Apply `deltas` (plan.Delta, in PEFT's order) to `weight`, returning a new tensor on `device`."""
    for item in deltas:
        if item.pair.parameter is not None:
            weight = add_weight_delta(weight, weight_delta(item, tensors, device))
            continue
        delta = lora_delta(tensors[item.pair.a_key], tensors[item.pair.b_key], item.pair.scale, item.transpose, device)
        if item.pair.magnitude_key is not None:
            weight = apply_dora(weight, delta, tensors[item.pair.magnitude_key], item.transpose)
        elif item.pair.kind == "embedding":
            weight = add_embedding_delta(weight, delta)
        else:
            weight = add_linear_delta(weight, delta)
        del delta  # free the float32 buffer before the next delta on this tensor
    return weight
