"""A step's micro-batches: the next examples of the run's order, collated by the step, on the device.

A micro-batch is made by the step's own ``collate`` (:meth:`memfit.step.builder.TrainingStep.collate`:
padded rows, or every example in one row), so the trainer feeds the step exactly the layout the
planner planned. One process takes ``grad_accum`` micro-batches a step (:func:`micro_batches`);
each rank of a sharded run takes its slice of every global micro-batch
(:meth:`memfit.train.world.ShardedWorld.micro_batches`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from memfit.step.batch import count_tokens, to_device

#: Examples -> one host batch (the step's collate with the tokenizer's padding id).
Collate = Callable[[list], dict[str, Any]]

__all__ = ["Collate", "count_step_tokens", "micro_batches", "to_device"]


def micro_batches(batches, grad_accum: int, collate: Collate, device: torch.device) -> list[dict[str, Any]]:
    """The next ``grad_accum`` micro-batches of ``batches``, on ``device``."""
    return [to_device(collate(next(batches)), device) for _ in range(grad_accum)]


def count_step_tokens(batches: list[dict[str, Any]]) -> int:
    """Input tokens of a step's micro-batches, padding not counted (nor a sequence-parallel shard's
    filler: its ``input_tokens``)."""
    return sum(b["input_tokens"] if "input_tokens" in b else count_tokens(b) for b in batches)
