"""Mixture-of-experts weights in 4 bits: every expert of a fused experts module quantized to NF4.

transformers 5 with bitsandbytes quantizes ``nn.Linear`` layers only, and the experts of a
mixture-of-experts model are 3-D parameters: a QLoRA run would keep them in 16 bits, nearly all of
the model. Here each expert's weight is quantized on its own with bitsandbytes' functional API,
with the settings of memfit's 4-bit linear layers (:mod:`memfit.models.quantize`: NF4, 64-element
blocks, double-quantized absmax): exactly what a ``Linear4bit`` holding that expert would store.
A module keeps its experts' packed bytes ``[experts, bytes]`` under the weight's own name and the
quantization state beside them (``<weight>_absmax``, ``_absmax2``, ``_offset``, the absmax code).

The forward is transformers' grouped one (tokens sorted by expert, one matmul per expert's rows,
weighted and summed back per token), with each expert's weight dequantized for its matmul and
dropped after it, in forward and again in backward: one op, ``memfit::nf4_experts_mm`` (and its
backward), whose outputs are the product and a workspace standing for what the op dequantizes
into (one expert's absmax and weight). On CUDA the op dequantizes into that workspace; elsewhere
what it allocates inside is invisible to the memory tracker, as a kernel's is: the planner's fake
implementation and a real run then count the same bytes, whatever the routing (the product is
``[tokens x top-k, out]`` however the tokens are spread over the experts). LoRA on these experts
(PEFT's layout: per expert a pair, :mod:`memfit.step.expert_adapters`) is added in its low-rank
form, ``x A_e^T B_e^T``, by grouped matmuls over the same sorted tokens.

Llama 4's experts run every token through every expert (``[experts, tokens, in]``): the same op, with
equal groups.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from memfit.models.experts import ExpertWeight, expert_modules, expert_weights
from memfit.models.quantize import ABSMAX_BLOCKSIZE, NF4_BLOCKSIZE

#: The absmax code every expert shares (bitsandbytes' dynamic map: 256 fp32 values).
ABSMAX_CODE = "absmax_code"


def storage_shapes(weight: ExpertWeight) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The tensors that hold ``weight`` in NF4, by suffix of its name: the packed bytes, each block's
    quantized absmax, the absmax's own absmax and its offset, one row (or value) per expert."""
    elements = weight.in_features * weight.out_features
    blocks = -(-elements // NF4_BLOCKSIZE)
    return {
        "": ((weight.num_experts, (elements + 1) // 2), torch.uint8),
        "_absmax": ((weight.num_experts, blocks), torch.uint8),
        "_absmax2": ((weight.num_experts, -(-blocks // ABSMAX_BLOCKSIZE)), torch.float32),
        "_offset": ((weight.num_experts,), torch.float32),
    }


class NF4Experts:
    """The 4-bit form of a fused experts module (a class made for each experts class: see
    :func:`quantize_experts_on_meta`). ``expert_weights`` says what the packed tensors stand for,
    ``compute_dtype`` what they are dequantized to, ``lora_factors`` the adapters in force while an
    adapter wrapper calls the module (weight name -> (A, B, scale, whether PEFT swapped the weight's
    in and out: :func:`_lora_update`))."""

    expert_weights: list[ExpertWeight]
    compute_dtype: torch.dtype
    lora_factors: dict[str, tuple[torch.Tensor, torch.Tensor, float, bool]]

    def forward(
        self,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor | None = None,
        top_k_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if top_k_index is None:
            return _every_expert_forward(self, hidden_states)
        return _routed_forward(self, hidden_states, top_k_index, top_k_weights)


_CLASSES: dict[type, type] = {}


def _nf4_class(cls: type) -> type:
    """``cls`` with :class:`NF4Experts`'s forward (one class per experts class)."""
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"NF4{cls.__name__}", (NF4Experts, cls), {"__module__": __name__})
    return _CLASSES[cls]


def is_nf4_experts(module: nn.Module) -> bool:
    return isinstance(module, NF4Experts)


def unsupported_reason(module: nn.Module) -> str | None:
    """Why the experts of ``module`` cannot run in 4 bits here (None when they can): the forwards
    are transformers' grouped one (the experts classes made with ``use_experts_implementation``)
    and Llama 4's every-expert one."""
    names = {w.name for w in expert_weights(module)}
    if hasattr(module, "has_gate") and names <= {"gate_up_proj", "up_proj", "down_proj"}:
        return None
    if type(module).__name__ == "Llama4TextExperts":
        return None
    return f"{type(module).__name__} computes its experts in a way memfit does not run in 4 bits"


def quantize_experts_on_meta(model: nn.Module, compute_dtype: torch.dtype) -> int:
    """Give every fused experts module of ``model`` (on meta) the NF4 storage of its weights, and the
    4-bit forward; biases stay as they are. Returns the modules changed; a module whose forward has
    no 4-bit form (:func:`unsupported_reason`) keeps its 16-bit weights."""
    changed = 0
    for module in expert_modules(model).values():
        if is_nf4_experts(module) or unsupported_reason(module) is not None:
            continue
        weights = expert_weights(module)
        for weight in weights:
            del module._parameters[weight.name]
            for suffix, (shape, dtype) in storage_shapes(weight).items():
                tensor = torch.empty(shape, dtype=dtype, device="meta")
                if suffix:
                    module.register_buffer(weight.name + suffix, tensor, persistent=False)
                else:
                    module.register_parameter(weight.name, nn.Parameter(tensor, requires_grad=False))
        module.register_buffer(ABSMAX_CODE, torch.empty(256, dtype=torch.float32, device="meta"), persistent=False)
        module.__class__ = _nf4_class(type(module))
        module.expert_weights, module.compute_dtype, module.lora_factors = weights, compute_dtype, {}
        changed += 1
    return changed


def nf4_expert_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if is_nf4_experts(m)]


def unpacked_counts(model: nn.Module) -> dict[int, int]:
    """``id()`` of each packed expert tensor -> the elements it stands for (for parameter counts)."""
    return {id(getattr(m, w.name)): w.numel for m in nf4_expert_modules(model) for w in m.expert_weights}


# ------------------------------------------------------------------------------------------------
# Quantizing


def quantize_expert(module: nn.Module, name: str, index: int, dense: torch.Tensor) -> None:
    """Quantize expert ``index``'s weight ``name`` from ``dense`` (as the 16-bit module stores it:
    ``[out, in]``, or ``[in, out]`` for a transposed layout) into the module's NF4 storage, on
    ``dense``'s device; storage still on meta is given memory there first."""
    import bitsandbytes.functional as bnbf

    weight = next(w for w in module.expert_weights if w.name == name)
    _give_storage(module, weight, dense.device)
    if weight.transposed:
        dense = dense.t()
    packed, state = bnbf.quantize_4bit(
        dense.contiguous().to(module.compute_dtype),
        blocksize=NF4_BLOCKSIZE,
        compress_statistics=True,
        quant_type="nf4",
        quant_storage=torch.uint8,
    )
    with torch.no_grad():
        getattr(module, name)[index].copy_(packed.view(-1))
        getattr(module, f"{name}_absmax")[index].copy_(state.absmax)
        getattr(module, f"{name}_absmax2")[index].copy_(state.state2.absmax)
        getattr(module, f"{name}_offset")[index].copy_(state.offset)
        getattr(module, ABSMAX_CODE).copy_(state.state2.code)


def _give_storage(module: nn.Module, weight: ExpertWeight, device: torch.device) -> None:
    for suffix, (shape, dtype) in storage_shapes(weight).items():
        key = weight.name + suffix
        tensor = module._parameters.get(key) if not suffix else module._buffers[key]
        if tensor is not None and tensor.is_meta:
            fresh = torch.zeros(shape, dtype=dtype, device=device)
            if suffix:
                module._buffers[key] = fresh
            else:
                module._parameters[key] = nn.Parameter(fresh, requires_grad=False)
    code = module._buffers[ABSMAX_CODE]
    if code.is_meta:
        module._buffers[ABSMAX_CODE] = torch.zeros(256, dtype=torch.float32, device=device)


def fill_random(
    module: nn.Module,
    device: torch.device | str | None = None,
    generator: torch.Generator | None = None,
    std: float = 0.02,
) -> None:
    """Quantize a random dense weight (normal, ``std``) into every expert of ``module``'s storage, on
    ``device`` (default: where the storage is); a fake module (the planner's) has no values to fill."""
    from torch._subclasses.fake_tensor import FakeTensor

    for weight in module.expert_weights:
        packed = getattr(module, weight.name)
        if isinstance(packed, FakeTensor):
            continue
        where = torch.device(device) if device is not None else packed.device
        shape = (
            (weight.in_features, weight.out_features)
            if weight.transposed
            else (weight.out_features, weight.in_features)
        )
        for index in range(weight.num_experts):
            dense = torch.empty(shape, dtype=module.compute_dtype, device=where).normal_(0.0, std, generator=generator)
            quantize_expert(module, weight.name, index, dense)


def dequantized(module: nn.Module, name: str) -> torch.Tensor:
    """The 16-bit weight ``name`` of every expert as the 16-bit module stores it (for tests and
    checks; the forward never holds more than one expert's)."""
    weight = next(w for w in module.expert_weights if w.name == name)
    rows = [_dequantize_expert(module, weight, index) for index in range(weight.num_experts)]
    stacked = torch.stack(rows)
    return stacked.transpose(1, 2) if weight.transposed else stacked


def _dequantize_expert(module: nn.Module, weight: ExpertWeight, index: int) -> torch.Tensor:
    ops = torch.ops.bitsandbytes
    absmax = ops.dequantize_blockwise.default(
        getattr(module, f"{weight.name}_absmax")[index],
        getattr(module, f"{weight.name}_absmax2")[index],
        getattr(module, ABSMAX_CODE),
        ABSMAX_BLOCKSIZE,
        torch.float32,
    )
    absmax = absmax + getattr(module, f"{weight.name}_offset")[index]
    return ops.dequantize_4bit.default(
        getattr(module, weight.name)[index],
        absmax,
        NF4_BLOCKSIZE,
        "nf4",
        [weight.out_features, weight.in_features],
        module.compute_dtype,
    )


# ------------------------------------------------------------------------------------------------
# Forward


def _compute_dtype(module: nn.Module, device: torch.device) -> torch.dtype:
    """The dtype the experts compute in: autocast's where it is on (mixed precision), else the
    module's compute dtype."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return module.compute_dtype


def _routed_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers' grouped experts forward (``grouped_mm_experts_forward``), its matmuls in 4 bits."""
    device = hidden_states.device
    num_top_k = top_k_index.size(-1)
    num_tokens, hidden_dim = hidden_states.shape
    expert_ids_g, perm = torch.sort(top_k_index.reshape(-1))
    selected = hidden_states[perm // num_top_k]
    sample_weights_g = top_k_weights.reshape(-1)[perm]
    histc_input = expert_ids_g.float() if device.type in ("cpu", "mps") else expert_ids_g.int()
    tokens_per_expert = torch.histc(histc_input, bins=self.num_experts, min=0, max=self.num_experts - 1)
    offsets = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)
    first = "gate_up_proj" if self.has_gate else "up_proj"
    out = _linear(self, first, selected, offsets, expert_ids_g)
    out = self._apply_gate(out) if self.has_gate else self.act_fn(out)
    out = _linear(self, "down_proj", out, offsets, expert_ids_g)
    if getattr(self, "has_post_expert_norm", False):
        out = self.post_expert_norm(out)
    weighted = out * sample_weights_g.unsqueeze(-1)
    inv_perm = torch.empty_like(perm)
    inv_perm[perm] = torch.arange(perm.size(0), device=device)
    weighted = weighted[inv_perm]
    return weighted.view(num_tokens, num_top_k, hidden_dim).sum(dim=1).to(hidden_states.dtype)


def _every_expert_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """Llama 4's experts forward (every expert on its ``[tokens, hidden]`` slice of the input), its
    matmuls in 4 bits."""
    num_experts = self.num_experts
    rows = hidden_states.shape[0] // num_experts
    offsets = torch.arange(1, num_experts + 1, dtype=torch.int32, device=hidden_states.device) * rows
    gate_up = _linear(self, "gate_up_proj", hidden_states, offsets, None)
    gate, up = gate_up.chunk(2, dim=-1)
    return _linear(self, "down_proj", up * self.act_fn(gate), offsets, None)


def _linear(
    self: nn.Module, name: str, x: torch.Tensor, offsets: torch.Tensor, expert_ids: torch.Tensor | None
) -> torch.Tensor:
    """Each expert's rows of ``x`` (grouped by ``offsets``) times that expert's 4-bit weight ``name``,
    plus its bias and its LoRA update where it has them."""
    weight = next(w for w in self.expert_weights if w.name == name)
    dtype = _compute_dtype(self, x.device)
    x = x.to(dtype)
    out = nf4_experts_mm(x, self, weight, offsets, dtype)
    if weight.bias is not None:
        out = out + getattr(self, weight.bias)[expert_ids].to(dtype)
    factors = self.lora_factors.get(name)
    if factors is not None:
        out = out + _lora_update(x, offsets, weight, *factors)
    return out


def _lora_update(
    x: torch.Tensor,
    offsets: torch.Tensor,
    weight: ExpertWeight,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scale: float,
    swapped: bool,
) -> torch.Tensor:
    """The LoRA update of each expert's rows, as PEFT's ``ParamWrapper`` applies it to the 16-bit
    weight (A ``[r x experts, a]``, B ``[b, r x experts]``): ``scale * x A_e^T B_e^T``, or ``scale * x
    B_e A_e`` where PEFT took a transposed weight without the flag for one (Llama 4's: ``swapped``),
    by two grouped matmuls in ``x``'s dtype (PEFT folds the update into the weight in its dtype).
    The rank is padded with zeros to a multiple of 16 bytes, the row alignment grouped matmuls take."""
    experts = weight.num_experts
    a = lora_a.to(x.dtype).reshape(experts, -1, lora_a.shape[-1])  # [experts, r, a]
    b = lora_b.to(x.dtype).reshape(lora_b.shape[0], -1, experts).permute(2, 1, 0)  # [experts, r, b]
    first, second = (b, a) if weight.transposed and swapped else (a, b)  # [experts, r, in], [experts, r, out]
    rank = first.shape[1]
    align = 16 // x.dtype.itemsize
    if rank % align:
        pad = align - rank % align
        first = torch.nn.functional.pad(first, (0, 0, 0, pad))
        second = torch.nn.functional.pad(second, (0, 0, 0, pad))
    low = torch.nn.functional.grouped_mm(x, first.contiguous().transpose(1, 2), offs=offsets)
    return torch.nn.functional.grouped_mm(low, second.contiguous(), offs=offsets) * scale


# ------------------------------------------------------------------------------------------------
# The op


def nf4_experts_mm(
    x: torch.Tensor, module: nn.Module, weight: ExpertWeight, offsets: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``x``'s rows of each expert (``offsets``: where each expert's rows end) times that expert's
    dequantized weight, transposed: ``[rows, in] -> [rows, out]``."""
    out, workspace = torch.ops.memfit.nf4_experts_mm(
        x,
        getattr(module, weight.name),
        getattr(module, f"{weight.name}_absmax"),
        getattr(module, f"{weight.name}_absmax2"),
        getattr(module, f"{weight.name}_offset"),
        getattr(module, ABSMAX_CODE),
        offsets,
        weight.out_features,
    )
    del workspace
    return out


def workspace_bytes(out_features: int, in_features: int, dtype: torch.dtype) -> int:
    """What the op dequantizes one expert into: the absmax (fp32, a value per 64-element block,
    rounded up to 16 bytes) and the weight in ``dtype``."""
    blocks = -(-out_features * in_features // NF4_BLOCKSIZE)
    return -(-blocks * 4 // 16) * 16 + out_features * in_features * dtype.itemsize


def _workspace(x: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    return x.new_empty((workspace_bytes(out_features, in_features, x.dtype),), dtype=torch.uint8)


def _expert_weight_into(
    workspace: torch.Tensor,
    index: int,
    packed,
    absmax,
    absmax2,
    offset,
    code,
    out_features: int,
    in_features: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Expert ``index``'s weight ``[out, in]`` in ``dtype``; on CUDA dequantized into ``workspace``."""
    ops = torch.ops.bitsandbytes
    blocks = absmax.shape[1]
    if packed.is_cuda:
        start = -(-blocks * 4 // 16) * 16
        scales = workspace[: blocks * 4].view(torch.float32)
        dense = workspace[start:].view(dtype).view(out_features, in_features)
        ops.dequantize_blockwise.out(absmax[index], absmax2[index], code, ABSMAX_BLOCKSIZE, torch.float32, out=scales)
        scales.add_(offset[index])
        ops.dequantize_4bit.out(
            packed[index], scales, NF4_BLOCKSIZE, "nf4", [out_features, in_features], dtype, out=dense
        )
        return dense
    scales = (
        ops.dequantize_blockwise.default(absmax[index], absmax2[index], code, ABSMAX_BLOCKSIZE, torch.float32)
        + offset[index]
    )
    return ops.dequantize_4bit.default(packed[index], scales, NF4_BLOCKSIZE, "nf4", [out_features, in_features], dtype)


def _groups(offsets: torch.Tensor):
    start = 0
    for index, end in enumerate(offsets.tolist()):  # one device-to-host copy, as CUDA's grouped fallback makes
        if end > start:
            yield index, start, end
        start = end


def _each_expert(
    rows: torch.Tensor, state: tuple, offsets: torch.Tensor, out_features: int, in_features: int, backward: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each expert's ``rows`` times its dequantized weight ``[out, in]`` (``state``: the packed bytes and
    quantization state): transposed forward (``[rows, in] -> [rows, out]``), as it is in backward
    (``[rows, out] -> [rows, in]``). Returns the product and the workspace each expert is dequantized into."""
    result = rows.new_empty((rows.shape[0], in_features if backward else out_features))
    workspace = _workspace(rows, out_features, in_features)
    for index, start, end in _groups(offsets):
        dense = _expert_weight_into(workspace, index, *state, out_features, in_features, rows.dtype)
        torch.mm(rows[start:end], dense if backward else dense.t(), out=result[start:end])
        del dense
    return result, workspace


@torch.library.custom_op("memfit::nf4_experts_mm", mutates_args=())
def _forward(
    x: torch.Tensor,
    packed: torch.Tensor,
    absmax: torch.Tensor,
    absmax2: torch.Tensor,
    offset: torch.Tensor,
    code: torch.Tensor,
    offsets: torch.Tensor,
    out_features: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _each_expert(x, (packed, absmax, absmax2, offset, code), offsets, out_features, x.shape[1], backward=False)


@_forward.register_fake
def _forward_fake(x, packed, absmax, absmax2, offset, code, offsets, out_features):
    return x.new_empty((x.shape[0], out_features)), _workspace(x, out_features, x.shape[1])


@torch.library.custom_op("memfit::nf4_experts_mm_backward", mutates_args=())
def _backward_op(
    grad: torch.Tensor,
    packed: torch.Tensor,
    absmax: torch.Tensor,
    absmax2: torch.Tensor,
    offset: torch.Tensor,
    code: torch.Tensor,
    offsets: torch.Tensor,
    in_features: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _each_expert(
        grad, (packed, absmax, absmax2, offset, code), offsets, grad.shape[1], in_features, backward=True
    )


@_backward_op.register_fake
def _backward_fake(grad, packed, absmax, absmax2, offset, code, offsets, in_features):
    return grad.new_empty((grad.shape[0], in_features)), _workspace(grad, grad.shape[1], in_features)


def _setup_context(ctx: Any, inputs, output) -> None:
    x, packed, absmax, absmax2, offset, code, offsets, _ = inputs
    ctx.save_for_backward(packed, absmax, absmax2, offset, code, offsets)
    ctx.in_features = x.shape[1]


def _backward(ctx: Any, grad_out: torch.Tensor, grad_workspace: torch.Tensor | None):
    packed, absmax, absmax2, offset, code, offsets = ctx.saved_tensors
    grad_x, workspace = torch.ops.memfit.nf4_experts_mm_backward(
        grad_out.contiguous(), packed, absmax, absmax2, offset, code, offsets, ctx.in_features
    )
    del workspace
    return grad_x, None, None, None, None, None, None, None


_forward.register_autograd(_backward, setup_context=_setup_context)
