"""Examples into device batches: for the training step and for evaluation.

One process takes ``grad_accum`` whole micro-batches a step (:func:`micro_batches`); each rank of a
sharded run takes its slice of every global micro-batch (:meth:`memfit.train.world.ShardedWorld.micro_batches`).
"""

from __future__ import annotations

from typing import Any

import torch


def collate_batch(examples: list, pad_id: int) -> dict[str, torch.Tensor]:
    """Pad ``examples`` into one batch of tensors on the host (see :func:`memfit.train.data.collate`)."""
    from memfit.train.data import collate

    return collate(examples, pad_token_id=pad_id)


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def micro_batches(batches, grad_accum: int, pad_id: int, device: torch.device) -> list[dict[str, Any]]:
    """The next ``grad_accum`` micro-batches of ``batches``, on ``device``."""
    return [to_device(collate_batch(next(batches), pad_id), device) for _ in range(grad_accum)]


def count_tokens(batches: list[dict[str, Any]]) -> int:
    """Input tokens of a step's micro-batches, padding not counted."""
    return sum(int(b["attention_mask"].sum()) if "attention_mask" in b else b["input_ids"].numel() for b in batches)


def labelled_tokens(labels: torch.Tensor) -> int:
    """Tokens a causal LM loss scores in a batch: labels shifted by one, those marked ignored left out."""
    from memfit.step.labels import IGNORE_INDEX

    return int((labels[:, 1:] != IGNORE_INDEX).sum())


@torch.no_grad()
def evaluate(model, examples: list, batch_size: int, pad_id: int, device: torch.device, loss) -> float:
    """Mean loss over every trained token of ``examples`` (dropout off, no gradients).

    ``loss`` is the step's loss (:meth:`memfit.step.builder.TrainingStep.loss`).
    """
    was_training = model.training
    model.eval()
    total_loss = 0.0
    total_tokens = 0
    for start in range(0, len(examples), batch_size):
        batch = to_device(collate_batch(examples[start : start + batch_size], pad_id), device)
        n = labelled_tokens(batch["labels"])
        if n == 0:
            continue
        total_loss += float(loss(model, batch)) * n
        total_tokens += n
    if was_training:
        model.train()
    return total_loss / max(total_tokens, 1)
