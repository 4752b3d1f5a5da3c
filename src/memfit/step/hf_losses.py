"""The losses other trainers compute in place of the model's own, for the ``hf`` recipe.

``recipe: hf`` is the plain Hugging Face + PEFT step, the one Axolotl, LLaMA-Factory and TRL run.
Their default loss is the model's own (the whole ``[tokens, vocabulary]`` logits, upcast to fp32);
two options they offer compute the same loss without the whole logits, and ``hf_loss`` picks them so
that the planner runs the loss the trainer runs, tensor for tensor:

- ``liger``: Liger Kernel's fused linear cross-entropy (``use_liger_kernel`` in TRL and the Trainer,
  ``liger_fused_linear_cross_entropy`` in Axolotl, ``enable_liger_kernel`` in LLaMA-Factory),
  :class:`FusedLinearCrossEntropy`. It computes the loss *and* the gradients in forward, a chunk of
  tokens at a time, and keeps the hidden states' gradient until backward.
- ``chunked-nll``: TRL ``SFTTrainer``'s ``loss_type='chunked_nll'`` (its default since TRL 1.x),
  :func:`trl_chunked_nll`: the labelled tokens first, then 256 of them at a time through a
  checkpointed function that upcasts the chunk *and the output head* to fp32.
- ``chunked-output`` / ``chunked-output-compiled``: torchtune's ``CEWithChunkedOutputLoss``
  (:func:`torchtune_chunked_output_ce`): the output projection in 8 chunks of the sequence, every
  chunk's 16-bit logits kept until backward, each chunk's cross-entropy upcast to fp32, eagerly
  (torchtune's ``compile: false``: each chunk's fp32 log-probabilities kept too) or as
  ``torch.compile`` fuses it (``compile: true``: only per-token statistics kept).
- ``chunked-ce``: Axolotl's ``chunked_cross_entropy``, torchtune's compiled loss over the model's
  whole 16-bit logits (:func:`torchtune_chunked_output_ce` with ``whole_head``).
- ``model-4.46`` / ``model-4.45``: the model's own loss as transformers before 4.50 computed it
  (:func:`transformers_shifted_loss`): a shifted fp32 copy of the logits for the cross-entropy, and
  up to 4.45 fp32 logits returned by the model.

They are written after the libraries' own code (Liger Kernel's ``ops/fused_linear_cross_entropy.py``
at ead96b6, TRL's ``trainer/sft_trainer.py`` at f2cd577, torchtune's
``modules/loss/ce_chunked_output_loss.py`` at 1814feb17) with PyTorch operations in place of
generated kernels; where a kernel works in place or in registers, the note at that line says what
the simulated one allocates instead.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from memfit.step.labels import IGNORE_INDEX
from memfit.step.seam import chunks_to_run, token_count_known

#: TRL's ``_CHUNKED_LM_HEAD_CHUNK_SIZE``: labelled tokens per chunk of its chunked loss.
TRL_CHUNK_TOKENS = 256


def liger_chunk_tokens(tokens: int, hidden_size: int, vocab_size: int) -> int:
    """Tokens per chunk of Liger's fused linear cross-entropy: a chunk's logits about as large as the
    hidden states (``inc_factor = ceil(V / H)``, ``chunk = next_power_of_2(ceil(BT / inc_factor))``)."""
    inc_factor = -(-vocab_size // hidden_size)
    return 1 << max(math.ceil(math.log2(max(-(-tokens // inc_factor), 1))), 0)


class FusedLinearCrossEntropy(torch.autograd.Function):
    """Liger Kernel's fused linear cross-entropy: mean loss of ``hidden @ weight.T`` over labelled tokens.

    Forward works through :func:`liger_chunk_tokens` tokens at a time: a chunk's logits in the
    compute dtype, turned in place into their gradient, then into the chunk's rows of the hidden
    states' gradient (and the head's, when it trains). Both gradients are kept until backward,
    which only scales them. Liger's Triton kernel computes softmax in registers; here one chunk's
    logits are upcast to fp32 for it, a transient of ``4 x chunk x vocabulary`` bytes Liger does not
    allocate (about 4 to 8 bytes per hidden-state element of the micro-batch).
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        tokens, hidden_size = hidden.shape
        chunk = liger_chunk_tokens(tokens, hidden_size, weight.shape[0])
        valid = targets != IGNORE_INDEX
        count = valid.sum().clamp(min=1)
        grad_input = torch.zeros_like(hidden)
        grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        loss_1d = torch.zeros(tokens, dtype=torch.float32, device=hidden.device)
        for start in chunks_to_run(tokens, chunk, hidden):
            stop = min(start + chunk, tokens)
            h = hidden[start:stop]
            logits = h @ weight.t()
            target, keep = targets[start:stop], valid[start:stop]
            wide = logits.float()
            lse = torch.logsumexp(wide, dim=-1)
            picked = wide.gather(1, target.clamp(min=0).unsqueeze(1)).squeeze(1)
            loss_1d[start:stop] = (lse - picked) * keep
            # d loss / d logits = (softmax - one_hot(label)) / count, zero where no label: written
            # over the chunk's logits, as the kernel writes it.
            wide.sub_(lse.unsqueeze(1)).exp_()
            wide.scatter_add_(1, target.clamp(min=0).unsqueeze(1), -keep.unsqueeze(1).to(wide.dtype))
            wide.mul_((keep.to(wide.dtype) / count).unsqueeze(1))
            logits.copy_(wide)
            del wide
            grad_input[start:stop] = logits @ weight
            if grad_weight is not None:
                grad_weight.addmm_(logits.t().to(grad_weight.dtype), h.to(grad_weight.dtype))
            del logits
        ctx.save_for_backward(grad_input, grad_weight)
        return loss_1d.sum() / count

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_input, grad_weight = ctx.saved_tensors
        # Liger scales the kept gradients in place (its element_mul kernel; skipped when the
        # upstream gradient is 1, which changes no value).
        grad_input.mul_(grad_loss.to(grad_input.dtype))
        if grad_weight is not None:
            grad_weight.mul_(grad_loss.to(grad_weight.dtype))
        return grad_input, grad_weight, None


def liger_fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token loss from hidden states ``[..., H]`` and the head ``[V, H]``, as Liger's
    ``LigerForCausalLMLoss`` computes it: hidden states and labels shifted, then flattened."""
    shifted = hidden[..., :-1, :].contiguous().reshape(-1, hidden.shape[-1])
    targets = labels[..., 1:].contiguous().reshape(-1)
    return FusedLinearCrossEntropy.apply(shifted, weight, targets)


def _trl_chunk(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """One chunk of TRL's chunked loss, with the token accuracy and entropy TRL computes beside it."""
    logits = h.float() @ w.float().t()
    log_p = F.log_softmax(logits, dim=-1)
    loss = F.nll_loss(log_p, labels, ignore_index=IGNORE_INDEX, reduction="sum")
    valid = labels != IGNORE_INDEX
    correct = ((logits.argmax(dim=-1) == labels) & valid).sum().float()
    entropy = (-(log_p.exp() * log_p).sum(dim=-1) * valid).sum()
    return loss, correct, entropy


def trl_chunked_nll(
    hidden_states: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int = TRL_CHUNK_TOKENS
) -> torch.Tensor:
    """Mean next-token loss as TRL's ``_chunked_cross_entropy_loss`` computes it: labelled tokens
    moved to the front (a copy of the hidden states), then ``chunk`` of them at a time through a
    non-reentrant checkpoint, so that a chunk's fp32 logits (and the fp32 head it makes) exist only
    while that chunk runs, in forward and again in backward.

    Where the number of labelled tokens cannot be read (:func:`memfit.step.seam.token_count_known`)
    every token is taken as labelled, the most a micro-batch can have.
    """
    hidden = hidden_states[..., :-1, :].reshape(-1, hidden_states.size(-1))
    targets = labels[..., 1:].reshape(-1)
    valid = targets != IGNORE_INDEX
    order = valid.to(torch.int8).argsort(descending=True, stable=True)
    hidden, targets = hidden[order], targets[order]
    count = valid.sum()
    labelled = int(count) if token_count_known(count) else hidden.shape[0]
    if labelled == 0:
        # No labelled token: a zero loss still connected to every input, as TRL returns it.
        return (hidden_states.float().sum() + weight.float().sum()) * 0.0
    loss = hidden.new_zeros((), dtype=torch.float32)
    for start in chunks_to_run(-(-labelled // chunk) * chunk, chunk, hidden):
        part, _, _ = torch.utils.checkpoint.checkpoint(
            _trl_chunk, hidden[start : start + chunk], weight, targets[start : start + chunk], use_reentrant=False
        )
        loss = loss + part
    return loss / count.clamp(min=1)


#: torchtune's ``CEWithChunkedOutputLoss.num_output_chunks``: chunks of the sequence its output head
#: and loss run in.
TORCHTUNE_OUTPUT_CHUNKS = 8
#: Rows of a chunk the simulated compiled cross-entropy upcasts at a time. Inductor's kernels reduce
#: each row in registers and never hold a chunk in fp32; this block of ``rows x vocabulary x 4`` bytes
#: (16 MiB for Llama 3's vocabulary) is the transient the simulation allocates in their place.
COMPILED_CE_ROWS = 32


class CompiledChunkCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of one chunk's 16-bit logits ``[N, V]``, as ``torch.compile`` runs
    torchtune's ``F.cross_entropy(logits.float(), ...)``: the forward reduces each row to its
    log-sum-exp, the backward writes the 16-bit gradient in one pass. Kept for backward: the logits
    (the graph's input) and one fp32 statistic per row, nothing as large as the logits in fp32."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        valid = targets != IGNORE_INDEX
        picked_targets = targets.clamp(min=0).unsqueeze(1)
        lse = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        loss = logits.new_zeros((), dtype=torch.float32)
        for start in chunks_to_run(logits.shape[0], COMPILED_CE_ROWS, logits):
            rows = slice(start, start + COMPILED_CE_ROWS)
            wide = logits[rows].float()
            lse[rows] = torch.logsumexp(wide, dim=-1)
            picked = wide.gather(1, picked_targets[rows]).squeeze(1)
            loss = loss + ((lse[rows] - picked) * valid[rows]).sum()
            del wide
        ctx.save_for_backward(logits, targets, lse)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        logits, targets, lse = ctx.saved_tensors
        valid = (targets != IGNORE_INDEX).to(torch.float32)
        picked_targets = targets.clamp(min=0).unsqueeze(1)
        grad = torch.empty_like(logits)
        for start in chunks_to_run(logits.shape[0], COMPILED_CE_ROWS, logits):
            rows = slice(start, start + COMPILED_CE_ROWS)
            # d loss / d logits = (softmax - one_hot(label)) * upstream, zero where no label.
            wide = logits[rows].float().sub_(lse[rows].unsqueeze(1)).exp_()
            wide.scatter_add_(1, picked_targets[rows], -torch.ones_like(lse[rows]).unsqueeze(1))
            wide.mul_((valid[rows] * grad_loss).unsqueeze(1))
            grad[rows] = wide
            del wide
        return grad, None


def torchtune_chunked_output_ce(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    compiled: bool,
    chunks: int = TORCHTUNE_OUTPUT_CHUNKS,
    whole_head: bool = False,
) -> torch.Tensor:
    """Mean next-token loss as torchtune's recipes compute it with ``CEWithChunkedOutputLoss``:
    labels shifted left (an ignored label appended, torchtune's ``ignore_labels_cache``), the output
    head applied to ``chunks`` chunks of the sequence (``TransformerDecoder.chunked_output``; every
    chunk's logits live until the loss returns, and are what the compiled loss keeps), then each
    chunk's summed cross-entropy in fp32 (``compiled``: as ``torch.compile`` fuses it; otherwise
    eagerly, which keeps each chunk's fp32 log-probabilities for backward).

    ``whole_head``: Axolotl's ``chunked_cross_entropy``, the same loss (its copy of torchtune's,
    compiled) over the model's own logits: the head applied to the whole sequence, then chunked,
    so backward joins the chunks' gradients into one before the head's."""
    ignored = labels.new_full((*labels.shape[:-1], 1), IGNORE_INDEX)
    targets = torch.cat((labels[..., 1:], ignored), dim=-1)
    if whole_head:
        logits = F.linear(hidden_states, weight).chunk(chunks, dim=1)
    else:
        logits = [F.linear(part, weight) for part in hidden_states.chunk(chunks, dim=1)]
    count = (targets != IGNORE_INDEX).sum()
    loss = 0.0
    for part, target in zip(logits, targets.chunk(chunks, dim=1)):
        part, target = part.reshape(-1, part.shape[-1]), target.reshape(-1)
        if compiled:
            loss = loss + CompiledChunkCrossEntropy.apply(part, target)
        else:
            loss = loss + F.cross_entropy(part.float(), target, ignore_index=IGNORE_INDEX, reduction="sum")
    return loss / count


def transformers_shifted_loss(
    hidden_states: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, fp32_logits: bool
) -> torch.Tensor:
    """Mean next-token loss as transformers before 4.50 computes it in a causal LM's forward: the
    logits upcast to fp32, then a shifted fp32 copy of them (``logits[..., :-1, :].contiguous()``)
    for the cross-entropy. ``fp32_logits``: transformers 4.45 and before, whose forward upcasts the
    logits it returns, so the fp32 logits are the model's output; from 4.46 the loss function upcasts
    them, and the output keeps the 16-bit ones. Either way both live until the trainer drops the
    output, after the loss returns and before backward."""
    logits = F.linear(hidden_states, weight)
    if fp32_logits:
        logits = logits.float()
    wide = logits.float()
    shifted = wide[..., :-1, :].contiguous()
    targets = labels[..., 1:].contiguous()
    return F.cross_entropy(shifted.view(-1, shifted.shape[-1]), targets.view(-1), ignore_index=IGNORE_INDEX)
