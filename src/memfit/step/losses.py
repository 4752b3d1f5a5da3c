"""The losses a step can take, and the one function that chooses among them.

:func:`choose_loss` is the only place that picks a loss: memfit's fused, chunked loss
(:func:`causal_lm_loss`) or, for the ``hf`` recipe, the model's own (:func:`model_loss`). The
trainer and the planner both take their loss from it (through :func:`memfit.step.builder.build_step`).

The fused loss removes the logits wall. A causal LM's loss needs ``hidden @ lm_head.T``:
``[tokens, vocab]`` logits, which the usual path upcasts to fp32 (4 bytes x 128k vocabulary =
512 KiB a token: 1 GiB per 2,048 tokens) and then holds again as their gradient.
:class:`ChunkedLinearCrossEntropy` fuses the output projection with the loss and works through the
tokens a chunk at a time: forward keeps only the per-token log-sum-exp, backward recomputes each
chunk's logits and turns them straight into gradients for the hidden states (and the projection,
when it trains). At most one chunk of logits exists at a time. Loss and gradients equal the
standard computation (fp32 logits, mean over labelled tokens).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial

import torch

from memfit.spec import RunSpec
from memfit.step import hf_losses
from memfit.step.autocast import active_autocast_dtype, autocast_dtype
from memfit.step.labels import IGNORE_INDEX
from memfit.step.seam import chunks_to_run
from memfit.step.vision_forward import model_forward, module_backbone

Batch = Mapping[str, torch.Tensor]
LossFn = Callable[[torch.nn.Module, Batch], torch.Tensor]

#: Tokens per chunk: with a 128k vocabulary, 1,024 tokens of fp32 logits are 512 MiB, small next to
#: the rest of a step, and large enough that each chunk's matmul keeps a GPU busy.
DEFAULT_CHUNK_TOKENS = 1024


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``hidden @ weight.T`` against ``labels``, computed ``chunk`` rows at a time.

    ``compute_dtype`` is the format the matmuls run in (None: the weight's). Under a mixed precision
    it is autocast's 16-bit format: the hidden states are kept for backward in it (what autocast's
    own matmul would keep), a 16-bit copy of an fp32 head exists while forward, and again while
    backward, works through the chunks, and the head's fp32 gradient accumulates from the fp32
    logits' gradient.
    """

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        chunk: int,
        compute_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        # hidden: [N, H]; weight: [V, H]; labels: [N] (IGNORE_INDEX where no loss is taken).
        compute = compute_dtype or weight.dtype
        # The casts are explicit, so nothing here depends on which ops a device's autocast casts.
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            kept, head = hidden.to(compute), weight.to(compute)  # no copies unless the formats differ
            valid = labels != IGNORE_INDEX
            count = valid.sum()
            wide = _wide(kept[:0]).dtype
            total = torch.zeros((), dtype=wide, device=hidden.device)
            lse = torch.empty(hidden.shape[0], dtype=wide, device=hidden.device)
            for start in chunks_to_run(hidden.shape[0], chunk, hidden):
                stop = min(start + chunk, hidden.shape[0])
                logits = _wide(kept[start:stop] @ head.t())
                chunk_lse = torch.logsumexp(logits, dim=-1)
                lse[start:stop] = chunk_lse
                target = labels[start:stop].clamp(min=0)
                picked = logits.gather(1, target.unsqueeze(1)).squeeze(1)
                total = total + ((chunk_lse - picked) * valid[start:stop]).sum()
                del logits
            del head
        ctx.save_for_backward(kept, weight, labels, lse, count)
        ctx.chunk, ctx.compute_dtype, ctx.hidden_dtype = chunk, compute, hidden.dtype
        return total / count.clamp(min=1)

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        hidden, weight, labels, lse, count = ctx.saved_tensors
        chunk, compute = ctx.chunk, ctx.compute_dtype
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        scale = grad_loss.to(lse.dtype) / count.clamp(min=1)
        head = weight.to(compute)
        grad_hidden = torch.empty(hidden.shape, dtype=ctx.hidden_dtype, device=hidden.device) if need_hidden else None
        # The head's gradient accumulates in the head's dtype: an fp32 buffer would cost 4 bytes per
        # head parameter (2 GiB for a 128k x 4096 head) on top of the gradient itself.
        grad_weight = torch.zeros_like(weight) if need_weight else None
        for start in chunks_to_run(hidden.shape[0], chunk, hidden):
            stop = min(start + chunk, hidden.shape[0])
            h = hidden[start:stop]
            # d loss / d logits = (softmax - one_hot(label)) / count, zero where no label.
            grad_logits = _wide(h @ head.t())
            grad_logits.sub_(lse[start:stop].unsqueeze(1)).exp_()
            target = labels[start:stop]
            valid = target != IGNORE_INDEX
            grad_logits.scatter_add_(1, target.clamp(min=0).unsqueeze(1), -valid.unsqueeze(1).to(lse.dtype))
            grad_logits.mul_((valid.to(lse.dtype) * scale).unsqueeze(1))
            # An fp32 head (mixed precision) takes its gradient from the fp32 logits' gradient.
            for_weight = grad_logits if need_weight and weight.dtype != compute else None
            # The matmuls run in the compute dtype, as the unfused path's do (its logits' gradient
            # is cast back to the head's dtype before the matmul): an fp32 copy of the head would
            # be a transient as large as the head again.
            grad_logits = grad_logits.to(compute)
            if need_hidden:
                grad_hidden[start:stop] = (grad_logits @ head).to(ctx.hidden_dtype)
            if need_weight:
                grad_weight.addmm_((grad_logits if for_weight is None else for_weight).t(), h.to(weight.dtype))
            del grad_logits, for_weight
        del head
        return grad_hidden, grad_weight, None, None, None


class ChunkedLinearLogProbs(torch.autograd.Function):
    """Per-token log-probabilities of ``targets`` under ``hidden @ weight.T``, ``chunk`` rows at a time.

    The preference objectives' and grpo's counterpart of :class:`ChunkedLinearCrossEntropy`, with the
    same structure: forward keeps the hidden states (in ``compute_dtype``) and the per-token
    log-sum-exp, never more than one chunk of ``[chunk, vocab]`` logits; backward recomputes each
    chunk's logits and turns them into gradients for the hidden states (and the head, when it trains).
    Returns ``[N]`` log-probs in at least fp32, 0 where the target is ``IGNORE_INDEX``. Under
    ``no_grad`` (a reference pass) nothing is kept once it returns.

    ``temperature``: the logits are divided by it first (grpo scores completions at the temperature
    they were sampled at, as TRL does). ``with_entropy``: also return each position's entropy of that
    distribution (``[N]``, no gradient: a metric), one more ``[chunk, vocab]`` transient per chunk.
    """

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        chunk: int,
        compute_dtype: torch.dtype | None = None,
        temperature: float = 1.0,
        with_entropy: bool = False,
    ):
        compute = compute_dtype or weight.dtype
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            kept, head = hidden.to(compute), weight.to(compute)
            valid = targets != IGNORE_INDEX
            wide = _wide(kept[:0]).dtype
            logps = torch.zeros(hidden.shape[0], dtype=wide, device=hidden.device)
            lse = torch.empty(hidden.shape[0], dtype=wide, device=hidden.device)
            entropy = torch.zeros(hidden.shape[0], dtype=wide, device=hidden.device) if with_entropy else None
            for start in chunks_to_run(hidden.shape[0], chunk, hidden):
                stop = min(start + chunk, hidden.shape[0])
                logits = _wide(kept[start:stop] @ head.t())
                if temperature != 1.0:
                    logits.div_(temperature)
                chunk_lse = torch.logsumexp(logits, dim=-1)
                lse[start:stop] = chunk_lse
                picked = logits.gather(1, targets[start:stop].clamp(min=0).unsqueeze(1)).squeeze(1)
                logps[start:stop] = (picked - chunk_lse) * valid[start:stop]
                if entropy is not None:
                    entropy[start:stop] = _entropy_(logits, chunk_lse) * valid[start:stop]
                del logits
            del head
        ctx.save_for_backward(kept, weight, targets, lse)
        ctx.chunk, ctx.compute_dtype, ctx.hidden_dtype, ctx.temperature = chunk, compute, hidden.dtype, temperature
        if entropy is None:
            return logps
        ctx.mark_non_differentiable(entropy)
        return logps, entropy

    @staticmethod
    def backward(ctx, grad_logps: torch.Tensor, grad_entropy: torch.Tensor | None = None):
        hidden, weight, targets, lse = ctx.saved_tensors
        chunk, compute, temperature = ctx.chunk, ctx.compute_dtype, ctx.temperature
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        head = weight.to(compute)
        grad_hidden = torch.empty(hidden.shape, dtype=ctx.hidden_dtype, device=hidden.device) if need_hidden else None
        grad_weight = torch.zeros_like(weight) if need_weight else None
        for start in chunks_to_run(hidden.shape[0], chunk, hidden):
            stop = min(start + chunk, hidden.shape[0])
            h = hidden[start:stop]
            target = targets[start:stop]
            # d logp / d logits = (one_hot(target) - softmax) / temperature, times the incoming
            # gradient; zero where no target.
            scale = grad_logps[start:stop].to(lse.dtype) * (target != IGNORE_INDEX).to(lse.dtype)
            if temperature != 1.0:
                scale = scale / temperature
            grad_logits = _wide(h @ head.t())
            if temperature != 1.0:
                grad_logits.div_(temperature)
            grad_logits.sub_(lse[start:stop].unsqueeze(1)).exp_()
            grad_logits.mul_(-scale.unsqueeze(1))
            grad_logits.scatter_add_(1, target.clamp(min=0).unsqueeze(1), scale.unsqueeze(1))
            for_weight = grad_logits if need_weight and weight.dtype != compute else None
            grad_logits = grad_logits.to(compute)
            if need_hidden:
                grad_hidden[start:stop] = (grad_logits @ head).to(ctx.hidden_dtype)
            if need_weight:
                grad_weight.addmm_((grad_logits if for_weight is None else for_weight).t(), h.to(weight.dtype))
            del grad_logits, for_weight, scale
        del head
        return grad_hidden, grad_weight, None, None, None, None, None


def _entropy_(logits: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Each row's entropy from its logits and their log-sum-exp: ``-sum(p log p)``, with ``log p`` the
    logits less the log-sum-exp. The logits are shifted in place (the caller is done with them);
    ``p`` is the one ``[rows, vocab]`` transient."""
    log_p = logits.sub_(lse.unsqueeze(1))
    p = log_p.exp()
    return -(p.mul_(log_p).sum(-1))


def chunked_token_logps(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk: int = DEFAULT_CHUNK_TOKENS,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
):
    """``[N]`` log-probs of ``targets`` (``[N]``, already shifted: position ``t`` holds the token that
    follows it, or -100) from hidden states ``[..., H]`` and the output projection ``[V, H]``, a chunk
    of tokens at a time (:class:`ChunkedLinearLogProbs`). Under autocast the matmuls run in its 16-bit
    format. ``temperature`` divides the logits; ``with_entropy`` returns ``(log-probs, entropy)``."""
    compute = active_autocast_dtype(hidden.device.type)
    return ChunkedLinearLogProbs.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, targets, chunk, compute, temperature, with_entropy
    )


def _wide(x: torch.Tensor) -> torch.Tensor:
    """Logits in at least fp32 (bf16 / fp16 logits lose the loss's precision), fp64 kept as is."""
    return x if x.dtype == torch.float64 else x.float()


def chunked_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int = DEFAULT_CHUNK_TOKENS
) -> torch.Tensor:
    """Next-token loss from final hidden states ``[..., H]`` and the output projection ``[V, H]``.

    ``labels`` are the input ids (or -100): like transformers' loss, position ``t`` predicts label
    ``t + 1``. The labels are shifted (the last position gets none), not the hidden states, so no
    copy of the hidden states is made. Under autocast the matmuls run in its 16-bit format.
    """
    targets = torch.nn.functional.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX).reshape(-1)
    compute = active_autocast_dtype(hidden.device.type)
    return ChunkedLinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, targets, chunk, compute)


def causal_lm_loss(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """Mean next-token cross-entropy over the tokens whose label is not -100.

    When the model's output head is a plain linear layer, the head and the loss run fused and a
    chunk of tokens at a time (:class:`ChunkedLinearCrossEntropy`), so the ``[tokens, vocabulary]`` logits
    never exist whole; otherwise (soft-capped or scaled logits, an adapter on the head) the model
    computes its own loss. Both give the same number.
    """
    parts = backbone_and_head(model)
    if parts is None:
        return model_loss(model, batch)
    backbone, head = parts
    outputs = backbone(**_model_inputs(batch), use_cache=False)
    shifted = batch.get("shift_labels")
    if shifted is None:
        loss = chunked_cross_entropy(outputs.last_hidden_state, head.weight, batch["labels"])
    else:  # a sequence-parallel shard: its labels were shifted over the whole row before it was cut
        hidden = outputs.last_hidden_state
        compute = active_autocast_dtype(hidden.device.type)
        loss = ChunkedLinearCrossEntropy.apply(
            hidden.reshape(-1, hidden.shape[-1]), head.weight, shifted.reshape(-1), DEFAULT_CHUNK_TOKENS, compute
        )
    return with_routing_loss(model, loss, outputs, batch)


def with_routing_loss(model: torch.nn.Module, loss: torch.Tensor, outputs, batch: Batch) -> torch.Tensor:
    """``loss`` plus a mixture-of-experts model's auxiliary load-balancing loss, as the model's own
    forward adds it: where its config turns ``output_router_logits`` on, ``router_aux_loss_coef``
    times its ``load_balancing_loss_func`` of every MoE layer's router logits (with the batch's
    padding mask). Models that define none (DeepSeek, Llama 4) and configs that leave it off: ``loss``."""
    import sys

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    logits = getattr(outputs, "router_logits", None)
    balance = getattr(sys.modules.get(type(base).__module__), "load_balancing_loss_func", None)
    if (
        not logits
        or balance is None
        or not getattr(base.config, "output_router_logits", False)
        or not hasattr(base, "num_experts")
    ):
        return loss
    aux = balance(logits, base.num_experts, base.num_experts_per_tok, batch.get("attention_mask"))
    return loss + base.router_aux_loss_coef * aux.to(loss.device)


def model_loss(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """The model's own loss: called with ``labels=``, as plain Hugging Face training does.

    transformers computes the whole ``[tokens, vocabulary]`` logits and upcasts them to fp32 for the
    loss; the planner's ``--recipe hf`` uses this to show the plain stack's memory.
    """
    shifted = {"shift_labels": batch["shift_labels"]} if batch.get("shift_labels") is not None else {}
    labels = batch["labels"] if not shifted else batch["shift_labels"]
    return model_forward(model, _model_inputs(batch), labels=labels, use_cache=False, **shifted).loss


def _model_inputs(batch: Batch) -> dict:
    """What the model's forward takes from a batch of :func:`memfit.step.batch.collate`: the ids,
    and where present the padding mask, the positions and the bounds of the examples in a row."""
    from memfit.step.vision import IMAGE_KEYS

    inputs = {"input_ids": batch["input_ids"]}
    for key, argument in (
        ("attention_mask", "attention_mask"),
        ("position_ids", "position_ids"),
        ("documents", "memfit_documents"),
        *((key, key) for key in IMAGE_KEYS),  # a vision-language batch's images
        ("sequence_group", "memfit_sequence_group"),
    ):
        if batch.get(key) is not None:
            inputs[argument] = batch[key]
    return inputs


#: Config fields that change logits after the head: with any of them set, the model's own loss runs.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def backbone_and_head(model: torch.nn.Module) -> tuple[Callable, torch.nn.Linear] | None:
    """(decoder stack, output head) of a causal LM whose logits are just ``hidden @ head.weight.T``
    (a vision-language model's decoder stack takes its images too)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    prefix = getattr(base, "base_model_prefix", None)
    backbone = getattr(base, prefix, None) if prefix else None
    if not isinstance(backbone, torch.nn.Module):
        backbone = module_backbone(base)  # Llama 4: its forward run module by module (memfit.step.vision_forward)
    head = trained_head(base.get_output_embeddings()) if hasattr(base, "get_output_embeddings") else None
    if config is None or backbone is None or type(head) is not torch.nn.Linear or head.bias is not None:
        return None
    from memfit.models.vision import language_config

    # A vision-language model's logit transforms are its language model's (Gemma 3's text_config).
    for holder in {id(c): c for c in (config, language_config(config))}.values():
        if any(getattr(holder, name, None) not in (None, 1, 1.0) for name in _LOGIT_TRANSFORMS):
            return None
    return backbone, head


def trained_head(head: torch.nn.Module | None) -> torch.nn.Module | None:
    """The module that computes the logits: ``head`` itself, or, where PEFT trains a copy of it
    (``modules_to_save``: a ``ModulesToSaveWrapper``), the active copy, which its forward calls."""
    saved = getattr(head, "modules_to_save", None)
    if not isinstance(saved, torch.nn.ModuleDict) or not hasattr(head, "original_module"):
        return head
    active = list(getattr(head, "active_adapters", None) or [])
    if getattr(head, "disable_adapters", False) or not active or active[0] not in saved:
        return head.original_module
    return saved[active[0]]


def _head_loss(model: torch.nn.Module, batch: Batch, *, loss: Callable) -> torch.Tensor:
    """``loss(hidden_states, head_weight, labels)`` over the decoder stack's last hidden states and the
    output head's weight, in place of the model's own loss; a model whose logits are more than
    ``hidden @ head.T`` (soft-capped, scaled, an adapter on the head) computes its own."""
    parts = backbone_and_head(model)
    if parts is None:
        return model_loss(model, batch)
    backbone, head = parts
    hidden = backbone(**_model_inputs(batch), use_cache=False).last_hidden_state
    return loss(hidden, head.weight, batch["labels"])


def _on_head(loss: Callable) -> LossFn:
    """The hf recipe's loss that runs ``loss`` (:mod:`memfit.step.hf_losses`) on the head (:func:`_head_loss`)."""
    return partial(_head_loss, loss=loss)


#: The ``hf`` recipe's losses by ``hf_loss`` (what each library computes: :mod:`memfit.step.hf_losses`).
HF_LOSSES: dict[str, LossFn] = {
    "model": model_loss,
    # Liger Kernel's fused linear cross-entropy.
    "liger": _on_head(hf_losses.liger_fused_linear_cross_entropy),
    # TRL SFTTrainer's loss_type='chunked_nll'.
    "chunked-nll": _on_head(hf_losses.trl_chunked_nll),
    # torchtune's CEWithChunkedOutputLoss, compile: false and compile: true.
    "chunked-output": _on_head(partial(hf_losses.torchtune_chunked_output_ce, compiled=False)),
    "chunked-output-compiled": _on_head(partial(hf_losses.torchtune_chunked_output_ce, compiled=True)),
    # Axolotl's chunked_cross_entropy: torchtune's compiled loss over the model's whole logits.
    "chunked-ce": _on_head(partial(hf_losses.torchtune_chunked_output_ce, compiled=True, whole_head=True)),
    # The model's own loss as transformers 4.45 and before, and 4.46 to 4.49, computed it.
    "model-4.45": _on_head(partial(hf_losses.transformers_shifted_loss, fp32_logits=True)),
    "model-4.46": _on_head(partial(hf_losses.transformers_shifted_loss, fp32_logits=False)),
}


def choose_loss(spec: RunSpec) -> LossFn:
    """The loss a configuration's step takes: memfit's fused chunked loss (every layout of the
    batch: padded or one row), or the ``hf`` recipe's (``hf_loss``: the model's own over the whole
    logits, Liger's or TRL's chunked one); under a mixed precision (and the hf recipe's 16-bit ones)
    with its forward under autocast (:func:`autocast_loss`)."""
    loss = HF_LOSSES[spec.hf_loss] if spec.recipe == "hf" else causal_lm_loss
    dtype = autocast_dtype(spec)
    return loss if dtype is None else partial(autocast_loss, loss_fn=loss, dtype=dtype)


def autocast_loss(model: torch.nn.Module, batch: Batch, *, loss_fn: LossFn, dtype: torch.dtype) -> torch.Tensor:
    """``loss_fn`` with the forward under autocast to ``dtype``, as the Hugging Face ``Trainer`` runs it
    with ``bf16=True`` / ``fp16=True``: matmuls and attention compute in 16 bits from fp32 (or
    16-bit) parameters. The loss it returns is differentiated outside autocast."""
    with torch.autocast(device_type=batch["input_ids"].device.type, dtype=dtype):
        return loss_fn(model, batch)
