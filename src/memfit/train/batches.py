"""Examples into device batches: for the training step and for evaluation.

A micro-batch is made by the step's own ``collate`` (:meth:`memfit.step.builder.TrainingStep.collate`:
padded rows, or every example in one row), so the trainer feeds the step exactly the layout the
planner planned. One process takes ``grad_accum`` micro-batches a step (:func:`micro_batches`);
each rank of a sharded run takes its slice of every global micro-batch
(:meth:`memfit.train.world.ShardedWorld.micro_batches`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from memfit.step.batch import count_tokens, labelled_tokens, to_device

#: Examples -> one host batch (the step's collate with the tokenizer's padding id).
Collate = Callable[[list], dict[str, Any]]

__all__ = ["Collate", "count_step_tokens", "evaluate", "micro_batches", "to_device"]


def micro_batches(batches, grad_accum: int, collate: Collate, device: torch.device) -> list[dict[str, Any]]:
    """The next ``grad_accum`` micro-batches of ``batches``, on ``device``."""
    return [to_device(collate(next(batches)), device) for _ in range(grad_accum)]


def count_step_tokens(batches: list[dict[str, Any]]) -> int:
    """Input tokens of a step's micro-batches, padding not counted."""
    return sum(count_tokens(b) for b in batches)


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
