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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from memfit.spec import ObjectiveParams, RunSpec
from memfit.step import train_step as train_step_module
from memfit.step.attention import batch_layout
from memfit.step.batch import PADDED, collate
from memfit.step.grpo import choose_grpo_loss, collate_completions
from memfit.step.losses import Batch, LossFn, choose_loss
from memfit.step.preference import choose_preference_loss, collate_pairs, reference_model
from memfit.step.sequence_parallel import SequenceGroup, heads_problem, layout_problem, shard_batch
from memfit.step.vision import vision_collate


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
    completions: bool = False  # grpo: examples are completions with their advantages
    vision: Any = None  # a vision-language model's collate (memfit.step.vision.VisionCollate)
    sequence: SequenceGroup | None = None  # sequence parallelism: each micro-batch is this rank's shard of its row

    def collate(self, examples: Sequence[dict[str, Any]], pad_token_id: int) -> dict[str, Any]:
        """One micro-batch of ``examples`` in this step's layout (see :func:`memfit.step.batch.collate`;
        pairs: :func:`memfit.step.preference.collate_pairs`; completions:
        :func:`memfit.step.grpo.collate_completions`)."""
        if self.pairs:
            return collate_pairs(examples, pad_token_id, layout=self.layout)
        if self.completions:
            return collate_completions(examples, pad_token_id, layout=self.layout)
        if self.vision is not None:
            return self.vision.collate(examples, pad_token_id)
        batch = collate(examples, pad_token_id, layout=self.layout)
        if self.sequence is None:
            return batch
        return shard_batch(batch, self.sequence, pad_token_id)

    def in_sequence_group(self, rank: int, group: Any) -> TrainingStep:
        """This step for rank ``rank`` of its sequence-parallel process group ``group`` (unchanged
        without sequence parallelism)."""
        if self.sequence is None:
            return self
        return replace(self, sequence=SequenceGroup(self.sequence.degree, rank, group))

    def grad_scaler(self, device: torch.device) -> torch.amp.GradScaler | None:
        """The loss scaler this step needs on ``device``, or None."""
        return torch.amp.GradScaler(device.type) if self.scales_loss else None

    def __call__(
        self,
        model: torch.nn.Module,
        micro_batches: Iterable[Batch],
        optimizer: torch.optim.Optimizer,
        *,
        grad_scaler: torch.amp.GradScaler | None = None,
        observer: Any = None,
        metrics: list | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the step (see :func:`memfit.step.train_step.train_step`); returns (loss, grad_norm).
        A preference step appends each micro-batch's per-pair metrics to ``metrics``."""
        # Looked up on the module at each call, so that tests can stand in for the step function.
        return train_step_module.train_step(
            model,
            micro_batches,
            optimizer,
            loss_fn=self.loss_fn,
            max_grad_norm=self.max_grad_norm,
            grad_scaler=grad_scaler,
            observer=observer,
            metrics=metrics,
        )

    def loss(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        """The mean loss of one batch (evaluation uses it, under ``no_grad``), its reference pass included."""
        return self.loss_and_metrics(model, batch)[0]

    def loss_and_metrics(
        self, model: torch.nn.Module, batch: Batch
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor] | None]:
        """:meth:`loss`, and the metrics a preference loss sums over the batch's pairs (None for the
        others; :func:`memfit.step.preference.summarize_metrics` averages them)."""
        reference_pass = getattr(self.loss_fn, "reference_pass", None)
        if reference_pass is not None:
            batch = reference_pass(model, batch)
        output = self.loss_fn(model, batch)
        return output if isinstance(output, tuple) else (output, None)

    def sharded(self, model: torch.nn.Module) -> TrainingStep:
        """This step for one rank of an FSDP2-sharded ``model``.

        The loss runs as a forward method of the FSDP root, so that the root's hooks gather the
        embeddings and the output head around it (memfit's fused loss calls the decoder stack and
        reads the head's weight directly, which would skip them); and each micro-batch's loss is
        weighted by its ``loss_weight`` (its share of the global batch's labelled tokens, or of its
        pairs), so that averaged gradients equal those of one process on the whole batch. A DPO
        step's reference pass runs as a forward method of the root it reads: the model's own (its
        adapters disabled), or the frozen copy's, sharded as a model of its own.
        """
        loss_fn = self.loss_fn
        run_loss = root_forward(model, "memfit_loss", loss_fn)
        reference_pass = getattr(loss_fn, "reference_pass", None)
        sharded_reference = None
        if reference_pass is not None:
            root = reference_model(model) or model
            sharded_reference = _RootCall(
                root_forward(root, "memfit_reference", lambda _root, batch: reference_pass(model, batch))
            )
        return replace(self, loss_fn=_WeightedLoss(run_loss, sharded_reference))


def root_forward(root: torch.nn.Module, name: str, fn) -> Any:
    """``fn(root, batch)`` as a forward method ``name`` of the FSDP2 root ``root``: the root's hooks
    gather its own parameters (embeddings, final norm, head) around the call, and let them go after
    it as the root says. Returns ``batch -> fn(root, batch)``; call it outside a step.

    FSDP2 takes a gathered parameter's ``requires_grad`` from its shard, and PEFT's
    ``disable_adapter()`` sets it on the tensors a layer holds at the moment: the gathered ones,
    where a layer keeps them after its forward (``ddp``, ``zero2``). The shards of the parameters
    that train are made trainable again after every call, or the next gather would freeze them.
    """
    from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.reshard()  # what a pass left gathered: the layers then hold their shards
    trainable = [p for p in root.parameters() if p.requires_grad]

    def method(self_root, batch):
        return fn(self_root, batch)

    setattr(root, name, types.MethodType(method, root))
    register_fsdp_forward_method(root, name)
    bound = getattr(root, name)

    def call(batch):
        try:
            return bound(batch)
        finally:
            for param in trainable:
                if not param.requires_grad:
                    param.requires_grad_(True)

    return call


@dataclass(frozen=True)
class _RootCall:
    """A pass that runs through a root's forward method: ``(model, batch) -> method(batch)``."""

    method: Any

    def __call__(self, model: torch.nn.Module, batch: Batch) -> Any:
        return self.method(batch)


@dataclass(frozen=True)
class _WeightedLoss:
    """A sharded step's loss: the root's forward method, its loss times the batch's ``loss_weight``
    (when it has one), and the reference pass, where the objective has one to run.

    A slice whose weight is 0 holds nothing of the global batch (a rank's filler at the end of an
    epoch): its metrics (a preference loss's sums over pairs) count nothing either."""

    run: Any
    reference_pass: Any = None

    def __call__(self, model: torch.nn.Module, batch: Batch) -> Any:
        output = self.run(batch)
        loss, metrics = output if isinstance(output, tuple) else (output, None)
        weight = batch.get("loss_weight") if hasattr(batch, "get") else None
        if weight is None:
            return output
        if metrics is not None and weight == 0:
            metrics = {name: value * 0 for name, value in metrics.items()}
        loss = loss * weight
        return loss if metrics is None else (loss, metrics)


def build_step(spec: RunSpec, model_config: Any, objective_params: ObjectiveParams | None = None) -> TrainingStep:
    """The step ``spec`` runs on the model of ``model_config`` (a transformers config): its loss
    (:func:`memfit.step.losses.choose_loss`: forward under autocast for a mixed precision; a
    preference objective's, with ``objective_params``, by :func:`memfit.step.preference.choose_preference_loss`),
    clipping at ``spec.max_grad_norm``, fp16's loss scaling, and the layout of its micro-batches
    (:func:`memfit.step.attention.batch_layout`: one row per micro-batch, attention inside each
    example, where the model allows it). A plan passes no ``objective_params``: they change the
    loss's value, not its memory.

    Raises ValueError when ``spec`` asks for a layout the model cannot run (packing on a model
    whose attention cannot keep examples apart), or sequence parallelism it cannot split (heads,
    padded rows). With ``sequence_parallel`` the step's micro-batches are rank 0's shards
    (:mod:`memfit.step.sequence_parallel`) until :meth:`TrainingStep.in_sequence_group` places it."""
    if spec.is_preference:
        loss_fn = choose_preference_loss(spec, objective_params)
    elif spec.is_grpo:
        loss_fn = choose_grpo_loss(spec, objective_params)
    else:
        loss_fn = choose_loss(spec)
    layout = batch_layout(spec, model_config)
    degree = spec.sequence_parallel
    problem = layout_problem(layout, degree, "sequence_parallel:") or heads_problem(
        model_config, degree, "sequence_parallel:"
    )
    if problem:
        raise ValueError(problem)
    return TrainingStep(
        loss_fn=loss_fn,
        max_grad_norm=spec.max_grad_norm,
        scales_loss=spec.scales_loss,
        layout=layout,
        pairs=spec.is_preference,
        completions=spec.is_grpo,
        vision=vision_collate(model_config, spec.weight_precision),
        sequence=SequenceGroup(degree) if degree > 1 else None,
    )
