"""The step a configuration runs: built here, once, for the planner and for the trainer.

:func:`build_step` turns a configuration into a :class:`TrainingStep`: the layout of its
micro-batches and the function that makes them (:mod:`memfit.step.batch`), the loss
(:func:`memfit.step.losses.choose_loss`, under autocast for a mixed precision), gradient clipping
and fp16's loss scaling around :func:`memfit.step.train_step.train_step`. The trainer runs it on real tensors, one process or each
rank of a sharded run (:meth:`TrainingStep.sharded`); the planner runs the same object under fake
tensors. Neither picks a loss or wraps the step anywhere else.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, replace
from typing import Any, Iterable, Sequence

import torch

from memfit.spec import ObjectiveParams, RunSpec
from memfit.step import train_step as train_step_module
from memfit.step.attention import batch_layout
from memfit.step.batch import PADDED, collate
from memfit.step.losses import Batch, LossFn, choose_loss
from memfit.step.preference import choose_preference_loss, collate_pairs


@dataclass(frozen=True)
class TrainingStep:
    """One optimizer step as a configuration runs it.

    ``loss_fn`` maps (model, batch) to the mean loss of the batch (its forward under autocast for
    a mixed precision); ``max_grad_norm`` clips the global gradient norm (None: no clipping);
    ``scales_loss``: fp16 and fp16-mixed need a ``GradScaler`` (:meth:`grad_scaler` makes it; bf16
    and fp32 have the range and need none).
    """

    loss_fn: LossFn
    max_grad_norm: float | None = None
    scales_loss: bool = False
    layout: str = PADDED
    pairs: bool = False  # a preference objective: examples are chosen / rejected pairs

    def collate(self, examples: Sequence[dict[str, Any]], pad_token_id: int) -> dict[str, Any]:
        """One micro-batch of ``examples`` in this step's layout (see :func:`memfit.step.batch.collate`;
        pairs: :func:`memfit.step.preference.collate_pairs`)."""
        if self.pairs:
            return collate_pairs(examples, pad_token_id, layout=self.layout)
        return collate(examples, pad_token_id, layout=self.layout)

    def grad_scaler(self, device: torch.device) -> "torch.amp.GradScaler | None":
        """The loss scaler this step needs on ``device``, or None."""
        return torch.amp.GradScaler(device.type) if self.scales_loss else None

    def __call__(
        self,
        model: torch.nn.Module,
        micro_batches: Iterable[Batch],
        optimizer: torch.optim.Optimizer,
        *,
        grad_scaler: "torch.amp.GradScaler | None" = None,
        observer: Any = None,
        metrics: list | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the step (see :func:`memfit.step.train_step.train_step`); returns (loss, grad_norm).
        A preference step appends each micro-batch's per-pair metrics to ``metrics``."""
        # Looked up on the module at each call, so that tests can stand in for the step function.
        return train_step_module.train_step(
            model, micro_batches, optimizer, loss_fn=self.loss_fn, max_grad_norm=self.max_grad_norm,
            grad_scaler=grad_scaler, observer=observer, metrics=metrics,
        )

    def loss(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        """The mean loss of one batch (evaluation uses it, under ``no_grad``), its reference pass included."""
        reference_pass = getattr(self.loss_fn, "reference_pass", None)
        if reference_pass is not None:
            batch = reference_pass(model, batch)
        output = self.loss_fn(model, batch)
        return output[0] if isinstance(output, tuple) else output

    def sharded(self, model: torch.nn.Module) -> "TrainingStep":
        """This step for one rank of an FSDP2-sharded ``model``.

        The loss runs as a forward method of the FSDP root, so that the root's hooks gather the
        embeddings and the output head around it (memfit's fused loss calls the decoder stack and
        reads the head's weight directly, which would skip them); and each micro-batch's loss is
        weighted by its ``loss_weight`` (its share of the global batch's labelled tokens), so that
        averaged gradients equal those of one process on the whole batch.
        """
        from torch.distributed.fsdp import register_fsdp_forward_method

        loss_fn = self.loss_fn

        def memfit_loss(self_model, batch):
            return loss_fn(self_model, batch)

        model.memfit_loss = types.MethodType(memfit_loss, model)
        register_fsdp_forward_method(model, "memfit_loss")
        return replace(self, loss_fn=_weighted(_root_forward))


def _root_forward(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    return model.memfit_loss(batch)


def _weighted(loss_fn: LossFn) -> LossFn:
    """``loss_fn`` times the batch's ``loss_weight``, when it has one."""

    def run(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        loss = loss_fn(model, batch)
        weight = batch.get("loss_weight") if hasattr(batch, "get") else None
        return loss if weight is None else loss * weight

    return run


def build_step(spec: RunSpec, model_config: Any, objective_params: ObjectiveParams | None = None) -> TrainingStep:
    """The step ``spec`` runs on the model of ``model_config`` (a transformers config): its loss
    (:func:`memfit.step.losses.choose_loss`: forward under autocast for a mixed precision; a
    preference objective's, with ``objective_params``, by :func:`memfit.step.preference.choose_preference_loss`),
    clipping at ``spec.max_grad_norm``, fp16's loss scaling, and the layout of its micro-batches
    (:func:`memfit.step.attention.batch_layout`: one row per micro-batch, attention inside each
    example, where the model allows it). A plan passes no ``objective_params``: they change the
    loss's value, not its memory.

    Raises ValueError when ``spec`` asks for a layout the model cannot run (packing on a model
    whose attention cannot keep examples apart)."""
    loss_fn = choose_preference_loss(spec, objective_params) if spec.is_preference else choose_loss(spec)
    return TrainingStep(
        loss_fn=loss_fn,
        max_grad_norm=spec.max_grad_norm,
        scales_loss=spec.scales_loss,
        layout=batch_layout(spec, model_config),
        pairs=spec.is_preference,
    )
