"""The eval loss: the step's own loss over held-out examples, batched as the step batches them."""

from __future__ import annotations

import torch

from memfit.step.batch import labelled_tokens, to_device
from memfit.train.micro_batches import Collate


@torch.no_grad()
def evaluate(model, examples: list, batch_size: int, collate: Collate, device: torch.device, loss) -> float:
    """Mean loss over every trained token (every pair, for a preference objective) of ``examples``
    (dropout off, no gradients).

    ``loss`` is the step's loss (:meth:`memfit.step.builder.TrainingStep.loss`); batches are made as
    the step makes them.
    """
    was_training = model.training
    model.eval()
    total_loss = 0.0
    total_tokens = 0
    for start in range(0, len(examples), batch_size):
        batch = to_device(collate(examples[start : start + batch_size]), device)
        # A preference loss is a mean over pairs; a next-token loss a mean over labelled tokens.
        n = batch["pairs"] if "pairs" in batch else labelled_tokens(batch["labels"])
        if n == 0:
            continue
        total_loss += float(loss(model, batch)) * n
        total_tokens += n
    if was_training:
        model.train()
    return total_loss / max(total_tokens, 1)
