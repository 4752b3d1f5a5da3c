"""Attention kept inside each example of a one-row micro-batch, with no ``[seq, seq]`` tensor.

A padding-free micro-batch (:data:`memfit.step.batch.DOCUMENTS`) holds several examples in one row.
Plain causal attention over the row would let an example see the ones before it; transformers'
answer, a block-diagonal ``[batch, 1, seq, seq]`` mask, costs memory quadratic in the row and keeps
SDPA off its flash kernel. :func:`document_attention` instead runs causal attention over each
example alone:

- on CUDA with bf16 / fp16 and a GPU with flash attention (compute capability 8.0 or newer), in one
  call of PyTorch's variable-length flash kernel (the one ``torch.nn.attention.varlen_attn`` uses),
  which takes the examples' bounds (``cu_seqlens``) and keeps per token only the output and the
  log-sum-exp;
- elsewhere, example by example, with the key / value heads expanded for the kernel: CPU flash
  attention, or on CUDA (fp32, older GPUs) the memory-efficient kernel, never the math one that
  would hold ``[heads, seq, seq]`` scores.

Either way it is one op, ``memfit::document_attention`` (and its backward), whose outputs are
those of the flash kernel, plus in backward a workspace that stands for the one the flash kernel
allocates for itself: the planner's fake implementation allocates exactly these, and a CPU run under
the memory tracker sees exactly these too (what an implementation allocates inside the op is
invisible to both, as a kernel's registers are).

The model reaches it through transformers' attention interface: :func:`use_document_attention` sets
the model's attention implementation to ``memfit_documents``, which runs :func:`document_attention`
when the batch says where its examples are (``memfit_documents=`` passed through the model's
forward). transformers makes no mask for an implementation it has no mask function for, so no
``[seq, seq]`` mask is ever made; once trained, the model gets its own attention back
(:func:`restore_attention`), for padded batches and generation.
"""

from __future__ import annotations

from typing import Any

import torch

from memfit.step.autocast import active_autocast_dtype
from memfit.step.batch import DOCUMENTS, PADDED, Documents

#: The name of memfit's attention implementation in transformers' attention interface.
IMPLEMENTATION = "memfit_documents"


# ------------------------------------------------------------------------------------------------
# Which models, which layout


def unsupported_reason(config: Any) -> str | None:
    """Why document attention cannot run this model's attention (None when it can).

    Read from the config alone, so that plans and config checks answer before any model exists.
    """
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    from memfit.models.vision import is_vision_config

    if is_vision_config(config):
        # Image tokens are placed, and Qwen's positions made, by the padded rows' layout.
        return f"{config.model_type} is a vision-language model (its batches are padded rows)"
    try:
        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        return f"{config.model_type} is not a causal LM transformers knows"
    if not getattr(model_class, "_supports_attention_backend", False):
        return (
            f"{model_class.__name__} computes its attention itself (it does not take transformers' attention backends)"
        )
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return f"{config.model_type} soft-caps its attention logits"
    layer_types = list(getattr(config, "layer_types", None) or [])
    sliding = any("sliding" in str(t) for t in layer_types) or (
        getattr(config, "sliding_window", None) is not None
        and getattr(config, "use_sliding_window", True)
        and not layer_types
    )
    if sliding:
        return f"{config.model_type} uses sliding-window attention"
    recurrent = _recurrent_layers(config)
    if recurrent:
        return f"{config.model_type}'s {recurrent} layers carry their state from one example into the next"
    if float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0.0:
        return f"its attention_dropout is {config.attention_dropout} (document attention runs without dropout)"
    return None


#: layer_types entries of layers that carry a state along the sequence (Mamba, short convolution,
#: gated delta rule, RG-LRU: transformers calls them all linear_attention, or by their own name).
RECURRENT_LAYER_TYPES = ("linear_attention", "mamba", "conv", "hybrid", "recurrent")


def _recurrent_layers(config: Any) -> str | None:
    """The kinds of the model's layers that run a recurrence along the row (None when none does)."""
    from memfit.models.mixer_kernels import mixer_kernels

    kinds = sorted({str(t) for t in (getattr(config, "layer_types", None) or [])} & set(RECURRENT_LAYER_TYPES))
    if kinds:
        return "/".join(kinds)
    return "state-space" if mixer_kernels(config) else None


def batch_layout(spec: Any, config: Any) -> str:
    """The layout of the step's micro-batches (:mod:`memfit.step.batch`) for ``spec`` on this model.

    ``documents`` (one row, attention inside each example) for ``packing`` and, unless
    ``padding_free: off``, wherever the model allows it; ``padded`` otherwise. The ``hf`` recipe
    keeps the plain stack's padded batches unless ``padding_free: on``: transformers with flash
    attention, which runs each example's attention on its own tokens (varlen: padding-free and
    packed batches with their positions, or padded ones it unpads), as memfit's one-row batches do.
    Raises ValueError when ``packing`` or ``padding_free: on`` asks for what the model cannot do.
    """
    if spec.recipe == "hf" and spec.padding_free != "on":
        return PADDED
    wanted = spec.packing or spec.padding_free == "on"
    if not wanted and spec.padding_free == "off":
        return PADDED
    reason = unsupported_reason(config)
    if reason is None:
        return DOCUMENTS
    if spec.packing:
        raise ValueError(
            f"packing: examples packed in one row need attention kept inside each example, and {reason}. "
            "Set packing: false (batches are then padded)."
        )
    if spec.padding_free == "on":
        raise ValueError(
            f"padding_free: on needs attention kept inside each example, and {reason}. Use padding_free: auto or off."
        )
    return PADDED


def use_document_attention(model: torch.nn.Module) -> None:
    """Run ``model``'s attention through :func:`attention_forward` (registered with transformers),
    for training; :func:`restore_attention` gives the model its own attention back."""
    _register()
    for config in _configs(model):
        if config._attn_implementation != IMPLEMENTATION:
            config.__dict__["_memfit_attention_before"] = config._attn_implementation
            config._attn_implementation = IMPLEMENTATION


def restore_attention(model: torch.nn.Module) -> None:
    """Give a trained model its own attention implementation back: used as usual (padded batches,
    generation) it needs the padding masks that document attention does without."""
    for config in _configs(model):
        before = config.__dict__.pop("_memfit_attention_before", None)
        if before is not None:
            config._attn_implementation = before


def _configs(model: torch.nn.Module) -> list:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return [base.config] + [getattr(base.config, name) for name in ("text_config",) if hasattr(base.config, name)]


_REGISTERED = False


def _register() -> None:
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers.modeling_utils import AttentionInterface

    # No mask function: transformers then makes no mask at all (and does not look for packed rows in
    # the positions, which would only cost memory): the documents' bounds keep attention apart.
    AttentionInterface.register(IMPLEMENTATION, attention_forward)
    _REGISTERED = True


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: ``[batch, heads, seq, head_dim]`` in, ``[batch, seq, heads,
    head_dim]`` out. With ``memfit_documents`` (a :class:`~memfit.step.batch.Documents`), attention
    stays inside each example; a single row without is one document; several rows without (no
    padding: transformers makes no mask for this implementation) run plain causal SDPA per row.
    With ``memfit_sequence_group`` (sequence parallelism) the inputs are this rank's tokens of every
    head, and attention runs on the whole row for its share of the heads
    (:func:`memfit.step.sequence_parallel.sequence_attention`)."""
    group = kwargs.pop("memfit_sequence_group", None)
    if group is not None:
        from memfit.step.sequence_parallel import sequence_attention

        def whole_row(q, k, v, **rest):
            return attention_forward(module, q, k, v, attention_mask, dropout, scaling, **rest)

        return sequence_attention(whole_row, group, query, key, value, **kwargs)
    documents = kwargs.pop("memfit_documents", None)
    batch, _heads, seq, head_dim = query.shape
    if documents is None and (batch != 1 or seq == 1):
        # Not a training row (several unpadded rows, decoding): plain causal attention per row.
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, None, dropout=dropout, scaling=scaling, **kwargs)
    if kwargs.get("softcap") is not None or kwargs.get("sliding_window") is not None:
        raise ValueError("document attention does not do soft-capped or sliding-window attention")
    if documents is None:
        documents = Documents(torch.tensor([0, seq], dtype=torch.int32, device=query.device), (seq,))
    if batch != 1 or documents.total != seq:
        raise ValueError(
            f"document attention needs one row of {documents.total} tokens, got a batch of shape {tuple(query.shape)}"
        )
    scale = float(scaling) if scaling is not None else head_dim**-0.5
    dtype = active_autocast_dtype(query.device.type)
    if dtype is not None:
        # Under autocast, as SDPA would be: the kernel computes in the 16-bit format (rotary
        # embeddings leave the query and key in fp32 when the residual stream is fp32).
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    value_dim = value.shape[-1]
    if value_dim > head_dim:
        raise ValueError(f"document attention needs values no wider than queries, got {value_dim} > {head_dim}")
    if value_dim < head_dim:
        # Multi-head latent attention (DeepSeek-V2/V3): values narrower than queries and keys. The
        # kernels take one head size, so the values are padded to it and the output cut back, as
        # transformers does for flash attention.
        value = torch.nn.functional.pad(value, (0, head_dim - value_dim))
    out = document_attention(
        query[0].transpose(0, 1),
        key[0].transpose(0, 1),
        value[0].transpose(0, 1),
        documents.cu_seqlens,
        list(documents.lengths),
        scale,
    )
    return out.unsqueeze(0)[..., :value_dim], None


def document_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    lengths: list[int],
    scale: float,
) -> torch.Tensor:
    """Causal attention inside each of the documents ``lengths`` of ``[tokens, heads, head_dim]``
    inputs (key / value may have fewer heads: grouped-query attention). Returns ``[tokens, heads, head_dim]``."""
    out, _, _ = torch.ops.memfit.document_attention(query, key, value, cu_seqlens, lengths, scale)
    return out


# ------------------------------------------------------------------------------------------------
# The op: forward, backward, and what each allocates


def _uses_flash(query: torch.Tensor) -> bool:
    """PyTorch's variable-length flash kernel: CUDA, bf16 / fp16, compute capability 8.0 or newer."""
    if not query.is_cuda or query.dtype not in (torch.bfloat16, torch.float16) or query.shape[-1] > 256:
        return False
    major, _ = torch.cuda.get_device_capability(query.device)
    return major >= 8


def _lse_dtype(query: torch.Tensor) -> torch.dtype:
    """The log-sum-exp is kept in fp32 (fp64 for fp64 inputs, which only CPU kernels take)."""
    return torch.float64 if query.dtype == torch.float64 else torch.float32


def _spans(lengths: list[int]):
    start = 0
    for length in lengths:
        yield start, start + length
        start += length


def _heads_first(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``[n, kv_heads, d]`` -> ``[1, heads, n, d]``, each key / value head repeated for its query
    heads: the per-example kernels take as many key / value heads as query heads."""
    x = x.transpose(0, 1)
    if x.shape[0] != heads:
        x = x.repeat_interleave(heads // x.shape[0], dim=0)
    return x.unsqueeze(0)


def _fold_heads(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradient of :func:`_heads_first`: ``[1, heads, n, d]`` -> ``[n, kv_heads, d]``."""
    heads, n, d = grad.shape[1:]
    return grad[0].reshape(kv_heads, heads // kv_heads, n, d).sum(1).transpose(0, 1)


def flash_backward_workspace_bytes(
    *,
    batch: int,
    q_len: int,
    kv_len: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    itemsize: int,
    documents: int | None = None,
) -> int:
    """Device memory PyTorch's flash attention takes for itself in backward (pure arithmetic).

    From PyTorch's flash attention backward (``mha_bwd``, and ``mha_varlen_bwd`` for ``documents``
    packed in one row of ``q_len`` tokens): the fp32 softmax statistics and the fp32 accumulator of
    the query gradient (head size rounded up to 32, or 64 above 128; the padded kernel rounds the
    sequence up to 128, the variable-length one leaves 128 rows between documents), and, with
    grouped-query heads, the key and value gradients of every query head before they are summed
    per key / value head.
    """
    head_dim_rounded = -(-head_dim // (32 if head_dim <= 128 else 64)) * (32 if head_dim <= 128 else 64)
    rows = q_len + 128 * documents if documents is not None else batch * (-(-q_len // 128) * 128)
    total = 4 * heads * rows + 4 * rows * heads * head_dim_rounded
    if kv_heads != heads:
        total += 2 * batch * kv_len * heads * head_dim * itemsize
    return total


@torch.library.custom_op("memfit::document_attention", mutates_args=())
def _forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    lengths: list[int],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if _uses_flash(query):
        out, lse, rng_state, _, _ = torch.ops.aten._flash_attention_forward(
            query,
            key,
            value,
            cu_seqlens,
            cu_seqlens,
            max(lengths),
            max(lengths),
            0.0,
            True,
            False,
            scale=scale,
        )
        return out, lse, rng_state
    # Example by example, with the kernel of the device: CPU flash, or CUDA's memory-efficient one
    # (fp32, older GPUs); each keeps its log-sum-exp, which backward uses.
    heads = query.shape[1]
    out = torch.empty_like(query)
    lse = torch.empty(heads, query.shape[0], dtype=_lse_dtype(query), device=query.device)
    for begin, end in _spans(lengths):
        q = query[begin:end].transpose(0, 1).unsqueeze(0)
        k, v = _heads_first(key[begin:end], heads), _heads_first(value[begin:end], heads)
        if query.is_cuda:
            o, doc_lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
                q, k, v, None, True, 0.0, True, scale=scale
            )
        else:
            o, doc_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
        out[begin:end] = o[0].transpose(0, 1)
        lse[:, begin:end] = doc_lse[0, :, : end - begin]
    # The flash kernel's RNG state for dropout (none here), kept so that every path allocates alike.
    rng_state = torch.zeros(2, dtype=torch.uint64, device=query.device)
    return out, lse, rng_state


@_forward.register_fake
def _forward_fake(query, key, value, cu_seqlens, lengths, scale):
    return (
        torch.empty_like(query),
        query.new_empty((query.shape[1], query.shape[0]), dtype=_lse_dtype(query)),
        query.new_empty((2,), dtype=torch.uint64),
    )


@torch.library.custom_op("memfit::document_attention_backward", mutates_args=())
def _backward_op(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    rng_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    lengths: list[int],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad query, grad key, grad value, workspace). The workspace stands for what the flash kernel
    allocates for itself (:func:`flash_backward_workspace_bytes`); it is dropped at once, so a plan
    counts it for the moment of the kernel, as CUDA's caching allocator holds it."""
    if _uses_flash(query):
        unused = torch.empty(0, device=query.device)
        grad_query, grad_key, grad_value = torch.ops.aten._flash_attention_backward(
            grad_out.contiguous(),
            query,
            key,
            value,
            out,
            lse,
            cu_seqlens,
            cu_seqlens,
            max(lengths),
            max(lengths),
            0.0,
            True,
            rng_state,
            unused,
            scale=scale,
        )
        return grad_query, grad_key, grad_value, unused  # the kernel's own workspace is already freed
    heads, kv_heads = query.shape[1], key.shape[1]
    workspace = _workspace_like(query, key, lengths)
    grad_query, grad_key, grad_value = torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)
    for begin, end in _spans(lengths):
        q = query[begin:end].transpose(0, 1).unsqueeze(0)
        k, v = _heads_first(key[begin:end], heads), _heads_first(value[begin:end], heads)
        o = out[begin:end].transpose(0, 1).unsqueeze(0)
        g = grad_out[begin:end].transpose(0, 1).unsqueeze(0)
        doc_lse = lse[:, begin:end].unsqueeze(0)
        if query.is_cuda:
            rows = -(-(end - begin) // 32) * 32  # the memory-efficient kernel keeps its log-sum-exp padded to 32
            padded = doc_lse.new_zeros((1, heads, rows))
            padded[..., : end - begin] = doc_lse
            seed = offset = torch.zeros((), dtype=torch.int64, device=query.device)
            dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
                g,
                q,
                k,
                v,
                torch.empty(0, device=query.device),
                o,
                padded,
                seed,
                offset,
                0.0,
                [True, True, True, False],
                True,
                scale=scale,
            )
        else:
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                g, q, k, v, o, doc_lse, 0.0, True, scale=scale
            )
        grad_query[begin:end] = dq[0].transpose(0, 1)
        grad_key[begin:end] = _fold_heads(dk, kv_heads)
        grad_value[begin:end] = _fold_heads(dv, kv_heads)
    return grad_query, grad_key, grad_value, workspace


def _workspace_like(query: torch.Tensor, key: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    tokens, heads, head_dim = (int(n) for n in query.shape)
    nbytes = flash_backward_workspace_bytes(
        batch=1,
        q_len=tokens,
        kv_len=tokens,
        heads=heads,
        kv_heads=int(key.shape[1]),
        head_dim=head_dim,
        itemsize=query.element_size(),
        documents=len(lengths),
    )
    return query.new_empty((nbytes,), dtype=torch.uint8)


@_backward_op.register_fake
def _backward_fake(grad_out, query, key, value, out, lse, rng_state, cu_seqlens, lengths, scale):
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value), _workspace_like(query, key, lengths)


def _setup_context(ctx, inputs, output) -> None:
    query, key, value, cu_seqlens, lengths, scale = inputs
    out, lse, rng_state = output
    ctx.save_for_backward(query, key, value, out, lse, rng_state, cu_seqlens)
    ctx.lengths, ctx.scale = lengths, scale


def _backward(ctx, grad_out, grad_lse, grad_rng):
    query, key, value, out, lse, rng_state, cu_seqlens = ctx.saved_tensors
    grad_query, grad_key, grad_value, workspace = torch.ops.memfit.document_attention_backward(
        grad_out,
        query,
        key,
        value,
        out,
        lse,
        rng_state,
        cu_seqlens,
        ctx.lengths,
        ctx.scale,
    )
    del workspace
    return grad_query, grad_key, grad_value, None, None, None


_forward.register_autograd(_backward, setup_context=_setup_context)
