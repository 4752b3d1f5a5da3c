"""The training step: one optimizer step of memfit's trainer, and nothing else.

This function is the one the trainer calls in its loop and the one the planner runs under fake
tensors to predict peak memory, so the plan is made from the code that will actually run. Both get
it, with the loss and the settings of their configuration, from :func:`memfit.step.builder.build_step`.
Keep it free of logging, device moves and anything that allocates memory a real run would not.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Protocol

import torch

from memfit.step.losses import Batch, LossFn
from memfit.step.seam import run_micro_batch


class StepObserver(Protocol):
    """Told where the step is; the planner's tracker uses it to attribute memory to phases."""

    def on_phase(self, name: str) -> None: ...


class _NoObserver:
    def on_phase(self, name: str) -> None:
        pass


def train_step(
    model: torch.nn.Module,
    micro_batches: Iterable[Batch],
    optimizer: torch.optim.Optimizer,
    *,
    loss_fn: LossFn,
    max_grad_norm: float | None = None,
    grad_scaler: torch.amp.GradScaler | None = None,
    observer: StepObserver | None = None,
    metrics: list | None = None,
) -> tuple[float | torch.Tensor, torch.Tensor | None]:
    """Run one optimizer step over ``micro_batches`` (gradient accumulation) and return (loss, grad_norm).

    The loss returned is the mean over micro-batches, detached (a tensor: reading it with ``.item()``
    is left to the caller, so that the step itself never forces a device sync).

    A loss function may return ``(loss, metrics)`` (the preference objectives: detached sums over a
    micro-batch's pairs), and may have a ``reference_pass`` (batch -> batch with the reference
    log-probs), run before each micro-batch's forward as the ``reference`` phase. The metrics,
    summed over the micro-batches, are appended to ``metrics`` when it is given.
    """
    observer = observer or _NoObserver()
    batches = list(micro_batches)
    if not batches:
        raise ValueError("train_step needs at least one micro-batch")
    micro_batch = functools.partial(_micro_batch, loss_fn, getattr(loss_fn, "reference_pass", None), grad_scaler)
    total_loss = None
    # Summed in place over the micro-batches, whether the caller asks for them or not: a plan
    # (which does not read them) and a run (which does) hold the same tensors, and the step holds as
    # many after two micro-batches as after twenty.
    totals = None
    for batch in batches:
        loss, totals = run_micro_batch(model, micro_batch, batch, totals, len(batches), observer)
        total_loss = loss if total_loss is None else total_loss + loss
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
    if metrics is not None and totals is not None:
        metrics.append(totals)
    return total_loss, grad_norm


def _micro_batch(
    loss_fn: LossFn,
    reference_pass,
    grad_scaler,
    model: torch.nn.Module,
    batch: Batch,
    totals,
    count: int,
    observer: StepObserver,
):
    """One micro-batch of ``count``: its reference pass, forward and backward, gradients accumulated
    into the parameters; returns (its loss over ``count``, detached; the metrics summed so far)."""
    if reference_pass is not None:
        observer.on_phase("reference")
        batch = reference_pass(model, batch)
    observer.on_phase("forward")
    output = loss_fn(model, batch)
    loss, step_metrics = output if isinstance(output, tuple) else (output, None)
    del output, batch
    if step_metrics is not None:
        if totals is None:
            totals = step_metrics
        else:
            for name, value in step_metrics.items():
                totals[name].add_(value)
    del step_metrics
    # Each micro-batch's loss is divided by their count so that accumulated gradients equal the
    # gradient of the mean loss over the whole effective batch.
    loss = loss / count
    observer.on_phase("backward")
    (grad_scaler.scale(loss) if grad_scaler is not None else loss).backward()
    # The graph's last reference goes with ``loss``: its activations are already freed by backward.
    return loss.detach(), totals
