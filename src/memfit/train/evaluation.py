"""The eval loss: the step's own loss over held-out examples, batched as the step batches them; for a
preference objective also its metrics, under TRL's evaluation names (``eval_rewards/chosen``...)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from memfit.step.batch import labelled_tokens, to_device
from memfit.step.preference import summarize_metrics
from memfit.step.sequence_parallel import shard_tokens
from memfit.train.micro_batches import Collate

#: A step's loss and metrics of one batch (:meth:`memfit.step.builder.TrainingStep.loss_and_metrics`).
LossAndMetrics = Callable[[Any, dict[str, Any]], tuple[torch.Tensor, dict[str, torch.Tensor] | None]]


@torch.no_grad()
def evaluation_metrics(
    model,
    examples: list,
    batch_size: int,
    collate: Collate,
    device: torch.device,
    loss_and_metrics: LossAndMetrics,
    sum_over_ranks: Callable[[list[float]], list[float]] | None = None,
) -> dict[str, float]:
    """``eval_loss``, the mean loss over every trained token (every pair, for a preference objective)
    of ``examples`` (dropout off, no gradients), and, for a preference objective, each of its metrics
    as a mean over the pairs, named as TRL names them in evaluation: ``eval_`` before the training
    name (``eval_rewards/accuracies``, ``eval_logps/chosen``...).

    ``loss_and_metrics`` is the step's (:meth:`memfit.step.builder.TrainingStep.loss_and_metrics`);
    batches are made as the step makes them. ``sum_over_ranks`` sums the loss and its count over
    the ranks of a run (every rank evaluates every example, or with sequence parallelism its shard
    of each row: the sums then hold every token once per data-parallel group, their ratio the mean).
    """
    was_training = model.training
    model.eval()
    total_loss = 0.0
    total_count = 0
    sums: list[dict[str, torch.Tensor]] = []  # each batch's metric sums, read once at the end
    for start in range(0, len(examples), batch_size):
        batch = to_device(collate(examples[start : start + batch_size]), device)
        # A preference loss is a mean over pairs; a next-token loss a mean over labelled tokens.
        n = batch["pairs"] if "pairs" in batch else _scored_tokens(batch)
        if n == 0 and "sequence_group" not in batch:  # a shard's forward is a collective: every rank runs it
            continue
        loss, metrics = loss_and_metrics(model, batch)
        total_loss += float(loss) * n
        total_count += n
        if metrics is not None:
            sums.append(metrics)
    if was_training:
        model.train()
    if sum_over_ranks is not None:
        total_loss, total_count = sum_over_ranks([total_loss, total_count])
    return {
        "eval_loss": total_loss / max(total_count, 1),
        **{f"eval_{name}": value for name, value in summarize_metrics(sums).items()},
    }


def _scored_tokens(batch: dict[str, Any]) -> int:
    if "shift_labels" in batch:  # a sequence-parallel shard: its labels already shifted
        return shard_tokens(batch)
    return labelled_tokens(batch["labels"])


def evaluate(model, examples: list, batch_size: int, collate: Collate, device: torch.device, loss) -> float:
    """Mean loss over every trained token (every pair, for a preference objective) of ``examples``
    (dropout off, no gradients): :func:`evaluation_metrics`' ``eval_loss``.

    ``loss`` is the step's loss (:meth:`memfit.step.builder.TrainingStep.loss`); batches are made as
    the step makes them.
    """
    return evaluation_metrics(model, examples, batch_size, collate, device, lambda m, b: (loss(m, b), None))[
        "eval_loss"
    ]
