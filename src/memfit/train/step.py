"""The training step: one optimizer step of memfit's trainer, and nothing else.

This function is the one the trainer calls in its loop and the one the planner runs under fake
tensors to predict peak memory, so the plan is made from the code that will actually run. Keep it
free of logging, device moves and anything that allocates memory a real run would not.
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping, Protocol

import torch

Batch = Mapping[str, torch.Tensor]
LossFn = Callable[[torch.nn.Module, Batch], torch.Tensor]


class StepObserver(Protocol):
    """Told where the step is; the planner's tracker uses it to attribute memory to phases."""

    def on_phase(self, name: str) -> None: ...


class _NoObserver:
    def on_phase(self, name: str) -> None:
        pass


def causal_lm_loss(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """Mean next-token cross-entropy over the tokens whose label is not -100.

    When the model's output head is a plain linear layer, the head and the loss run fused and a
    chunk of tokens at a time (:mod:`memfit.train.losses`), so the ``[tokens, vocabulary]`` logits
    never exist whole; otherwise (soft-capped or scaled logits, an adapter on the head) the model
    computes its own loss. Both give the same number.
    """
    parts = backbone_and_head(model)
    if parts is None:
        return model_loss(model, batch)
    from memfit.train.losses import chunked_cross_entropy

    backbone, head = parts
    hidden = backbone(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"), use_cache=False).last_hidden_state
    return chunked_cross_entropy(hidden, head.weight, batch["labels"])


def model_loss(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """The model's own loss: called with ``labels=``, as plain Hugging Face training does.

    transformers computes the whole ``[tokens, vocabulary]`` logits and upcasts them to fp32 for the
    loss; the planner's ``--recipe hf`` uses this to show the plain stack's memory.
    """
    out = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"), labels=batch["labels"], use_cache=False)
    return out.loss


def loss_for_recipe(recipe: str) -> LossFn:
    """The loss a recipe's step uses: memfit's fused loss, or the model's own (``hf``)."""
    return model_loss if recipe == "hf" else causal_lm_loss


#: Config fields that change logits after the head: with any of them set, the model's own loss runs.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def backbone_and_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Linear] | None:
    """(decoder stack, output head) of a causal LM whose logits are just ``hidden @ head.weight.T``."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    prefix = getattr(base, "base_model_prefix", None)
    backbone = getattr(base, prefix, None) if prefix else None
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if config is None or not isinstance(backbone, torch.nn.Module) or type(head) is not torch.nn.Linear or head.bias is not None:
        return None
    if any(getattr(config, name, None) not in (None, 1, 1.0) for name in _LOGIT_TRANSFORMS):
        return None
    return backbone, head


def train_step(
    model: torch.nn.Module,
    micro_batches: Iterable[Batch],
    optimizer: torch.optim.Optimizer,
    *,
    loss_fn: LossFn = causal_lm_loss,
    max_grad_norm: float | None = None,
    grad_scaler: "torch.amp.GradScaler | None" = None,
    observer: StepObserver | None = None,
) -> tuple[float | torch.Tensor, torch.Tensor | None]:
    """Run one optimizer step over ``micro_batches`` (gradient accumulation) and return (loss, grad_norm).

    The loss returned is the mean over micro-batches, detached (a tensor: reading it with ``.item()``
    is left to the caller, so that the step itself never forces a device sync).
    """
    observer = observer or _NoObserver()
    batches = list(micro_batches)
    if not batches:
        raise ValueError("train_step needs at least one micro-batch")
    total_loss = None
    for batch in batches:
        observer.on_phase("forward")
        # Each micro-batch's loss is divided by their count so that accumulated gradients equal the
        # gradient of the mean loss over the whole effective batch.
        loss = loss_fn(model, batch) / len(batches)
        observer.on_phase("backward")
        (grad_scaler.scale(loss) if grad_scaler is not None else loss).backward()
        total_loss = loss.detach() if total_loss is None else total_loss + loss.detach()
        # Drop the graph's last reference now: its activations are already freed by backward.
        del loss

    observer.on_phase("optimizer")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grad_norm = None
    if grad_scaler is not None:
        grad_scaler.unscale_(optimizer)
    if max_grad_norm is not None:
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    if grad_scaler is not None:
        grad_scaler.step(optimizer)
        grad_scaler.update()
    else:
        optimizer.step()
    # Free gradients now rather than at the next backward: the next forward's activations can then
    # use that memory.
    optimizer.zero_grad(set_to_none=True)
    observer.on_phase("idle")
    return total_loss, grad_norm
