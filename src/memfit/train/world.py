"""One code path for one process and for N: the world a run trains in.

The recipe (:mod:`memfit.train.recipe`) asks its world for the device, the run folder, the model's
sharding, this process's micro-batches, the totals of a step, checkpoints and the outputs.
:class:`World` is one process, where most of this is the plain thing or nothing at all.
:class:`ShardedWorld` is one rank of the processes ``torchrun`` started: the model sharded with
FSDP2, each rank training its slice of every global batch, rank 0 printing and writing the run's
shared files (:mod:`memfit.train.distributed` holds the FSDP2 and process-group pieces).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from memfit.errors import UserError
from memfit.files import remove_if_empty
from memfit.step.batch import to_device
from memfit.step.builder import TrainingStep, root_forward
from memfit.train import checkpointing, distributed
from memfit.train.errors import TrainError
from memfit.train.examples import scored_count, unscored
from memfit.train.micro_batches import Collate, micro_batches
from memfit.train.run_folder import (
    check_run_dir,
    make_run_dir,
    output_dir,
    remove_stale_folders,
    write_outputs,
)


class World:
    """A run on one process: every collective is a no-op, every file is this process's to write."""

    def __init__(self, placement: distributed.Placement | None = None) -> None:
        self.placement = placement or distributed.Placement()

    @property
    def rank(self) -> int:
        return self.placement.rank

    @property
    def world_size(self) -> int:
        return self.placement.world_size

    @property
    def is_main(self) -> bool:
        """Rank 0 (or the only process) prints progress and writes the run's shared files."""
        return self.placement.rank == 0

    @property
    def distributed(self) -> bool:
        return False

    # -- joining and leaving ------------------------------------------------------------------

    def join(self, device_name: str, model: torch.nn.Module | None) -> torch.device:
        """The device this process trains on (a given model's own device)."""
        from memfit.train.loading import resolve_device

        return resolve_device(device_name) if model is None else next(model.parameters()).device

    def leave(self) -> None:
        """Undo :meth:`join` (nothing to undo for one process)."""

    def prepare_run_dir(self, run_dir: Path, resume: bool) -> list[Path]:
        """Refuse a folder that holds another run or cannot be written; create it for a new run.
        On resume, remove what interrupted saves left; return what was removed."""
        check_run_dir(run_dir, resume)
        self._created_folders = make_run_dir(run_dir, resume)
        return remove_stale_folders(run_dir) if resume else []

    def discard_run_dir(self) -> None:
        """After a failure: remove the run folder this process created, while nothing is in it."""
        remove_if_empty(getattr(self, "_created_folders", []))

    # -- the model and the step ---------------------------------------------------------------

    def load_device(self, spec, device: torch.device) -> torch.device:
        """Where the model's weights are loaded (the training device)."""
        return device

    def shard(self, model: torch.nn.Module, spec, device: torch.device, console: Any) -> torch.nn.Module:
        """The model as this process trains it (unchanged on one process)."""
        return model

    def training_step(self, step: TrainingStep, model: torch.nn.Module) -> TrainingStep:
        """The step as this process runs it (unchanged on one process)."""
        return step

    def global_batch_size(self, spec) -> int:
        """Examples in one micro-batch of the whole run (this process's micro-batch here)."""
        return spec.batch_size

    def micro_batches(self, batches, grad_accum: int, collate: Collate, device: torch.device) -> list[dict[str, Any]]:
        """This process's micro-batches of the next step, on ``device``."""
        return micro_batches(batches, grad_accum, collate, device)

    def step_totals(
        self, loss: torch.Tensor, tokens: int, stop_requested: bool, grad_norm: Any, device: torch.device
    ) -> tuple[float, int, bool, Any]:
        """(loss, tokens, stop, grad norm) of the step over every process.

        Reading the loss syncs with the device: once a step is cheap next to the step itself.
        """
        return float(loss), tokens, stop_requested, grad_norm

    def metric_totals(
        self, totals: list[dict[str, torch.Tensor]], device: torch.device
    ) -> list[dict[str, torch.Tensor]]:
        """A step's metric sums (a preference step's, over its pairs) over every process."""
        return totals

    def gather_objects(self, value: Any) -> list[Any]:
        """``value`` of every process, in rank order (every process must call it)."""
        return [value]

    def sum_over_ranks(self, values: list[float], device: torch.device) -> list[float]:
        """``values`` summed over every process (here: themselves)."""
        return values

    def root_forward(self, model: torch.nn.Module, name: str, fn) -> Any:
        """``batch -> fn(model, batch)``, run as the world runs a pass of the model outside its step
        (here: a plain call)."""
        return lambda batch: fn(model, batch)

    # -- memory records -----------------------------------------------------------------------

    @property
    def recorder_rank(self) -> int | None:
        """The rank stored in the memory records (None for a single process)."""
        return None

    @property
    def attributes_memory(self) -> bool:
        """Whether the category tracker can follow the model's tensors (plain tensors, not DTensors)."""
        return True

    def run_fields(self, spec) -> dict[str, Any]:
        """What ``run.json`` says about the processes (nothing for one)."""
        return {}

    # -- checkpoints and outputs --------------------------------------------------------------

    @property
    def saves_on_oom(self) -> bool:
        """Whether an emergency checkpoint can be saved after running out of memory."""
        return True

    def save_checkpoint(
        self,
        run_dir: Path,
        step: int,
        *,
        model,
        optimizer,
        scheduler,
        grad_scaler,
        data_state: dict[str, Any],
        rng_state: dict[str, Any],
        reason: str,
        keep: int,
    ) -> Path:
        return checkpointing.save_checkpoint(
            run_dir,
            step,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            grad_scaler=grad_scaler,
            data_state=data_state,
            rng_state=rng_state,
            reason=reason,
            keep=keep,
        )

    def load_checkpoint(self, path: Path, *, model, optimizer, scheduler, grad_scaler, device: torch.device):
        return checkpointing.load_checkpoint(
            path,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            grad_scaler=grad_scaler,
            device=device,
        )

    def save_outputs(self, model, tokenizer, run_dir: Path, adapters: bool) -> Path:
        """The deliverable: ``adapter/`` (PEFT format) or ``model/`` (full weights), with the tokenizer."""
        return write_outputs(model, tokenizer, run_dir, adapters)


class ShardedWorld(World):
    """One rank of a multi-process run: the model sharded with FSDP2, collectives over every rank."""

    @property
    def distributed(self) -> bool:
        return True

    def join(self, device_name: str, model: torch.nn.Module | None) -> torch.device:
        """Join the process group (unless the caller did) and take this rank's device."""
        import torch.distributed as dist

        if model is not None:
            raise TrainError(
                "train(model=...): a given model trains on one process only; let memfit load it for gpus > 1"
            )
        self._owns_group = not dist.is_initialized()
        return distributed.init_distributed(self.placement, device_name)

    def leave(self) -> None:
        if getattr(self, "_owns_group", False):
            distributed.teardown()

    def prepare_run_dir(self, run_dir: Path, resume: bool) -> list[Path]:
        """Every rank checks the folder before rank 0 writes into it; the first error stops them all."""
        problem = None
        try:
            check_run_dir(run_dir, resume)
        except UserError as err:  # the folder holds another run, or cannot be written
            problem = str(err)
        problem = distributed.first_error(problem)
        if problem:
            raise TrainError(problem)
        removed = []
        if self.is_main:
            self._created_folders = make_run_dir(run_dir, resume)
            removed = remove_stale_folders(run_dir) if resume else []
        distributed.barrier()
        return removed

    def load_device(self, spec, device: torch.device) -> torch.device:
        return distributed.load_device(spec, device)

    def shard(self, model: torch.nn.Module, spec, device: torch.device, console: Any) -> torch.nn.Module:
        model = distributed.shard_model(model, spec, device, self.placement)
        distributed.check_placed(model, device)
        if distributed.frozen_4bit_params(model):
            console.print(
                "note: the 4-bit base weights stay whole on every rank; adapters and the rest are sharded",
                highlight=False,
            )
        return model

    def training_step(self, step: TrainingStep, model: torch.nn.Module) -> TrainingStep:
        """The step of this rank: its loss through the FSDP root, weighted; with sequence
        parallelism, its micro-batches this rank's shards and attention's all-to-all in its group."""
        self._sequence_parallel = step.sequence.degree if step.sequence is not None else 1
        sharded = step.sharded(model)
        if step.sequence is None:
            return sharded
        _, _, rank = distributed.data_parallel_place(self.rank, self.world_size, self._sequence_parallel)
        groups = self.__dict__.setdefault("_sequence_groups", {})
        if self._sequence_parallel not in groups:
            groups[self._sequence_parallel] = distributed.sequence_groups(self.placement, self._sequence_parallel)
        return sharded.in_sequence_group(rank, groups[self._sequence_parallel])

    def _data_parallel(self) -> tuple[int, int]:
        """(this rank's data-parallel slice, the number of slices): every rank of a sequence-parallel
        group trains the same examples."""
        dp_rank, dp_size, _ = distributed.data_parallel_place(
            self.rank, self.world_size, getattr(self, "_sequence_parallel", 1)
        )
        return dp_rank, dp_size

    def global_batch_size(self, spec) -> int:
        # One global micro-batch of batch_size x (world_size / sequence_parallel) examples; each
        # data-parallel slice takes its share.
        return spec.batch_size * (self.world_size // spec.sequence_parallel)

    def micro_batches(self, batches, grad_accum: int, collate: Collate, device: torch.device) -> list[dict[str, Any]]:
        """This rank's slices of the next ``grad_accum`` global micro-batches, each with its ``loss_weight``.

        Every rank draws the same global batches (same seed and position) and keeps its slice (whole
        pairs: a pair is one example); the labelled-token counts (of a preference batch: the pairs,
        whose mean its loss is) are summed over ranks so each slice's loss is weighted by its share.
        """
        slices, local = [], []
        dp_rank, dp_size = self._data_parallel()
        for _ in range(grad_accum):
            examples = distributed.rank_slice(next(batches), dp_rank, dp_size)
            if not examples:  # fewer examples than ranks at the end of an epoch: a slice that scores nothing
                examples = [unscored(next(iter(batches.examples)))]
            slices.append(collate(examples))
            local.append(scored_count(examples, slices[-1]))
        total = distributed.all_reduce_sum(local, device)
        weights = distributed.loss_weights(local, total, self.world_size)
        out = []
        for batch, weight in zip(slices, weights):
            moved = to_device(batch, device)
            moved["loss_weight"] = weight
            out.append(moved)
        return out

    def step_totals(self, loss, tokens, stop_requested, grad_norm, device):
        # Rank losses are pre-weighted (see distributed.loss_weights): their mean is the global loss.
        # The stop flag travels along, so that every rank stops after the same step.
        summed = distributed.all_reduce_sum([float(loss), tokens, 1.0 if stop_requested else 0.0], device)
        norm = distributed.local_value(grad_norm) if grad_norm is not None else None
        return summed[0] / self.world_size, int(summed[1]), bool(summed[2]), norm

    def gather_objects(self, value: Any) -> list[Any]:
        return distributed.gather_objects(value)

    def sum_over_ranks(self, values: list[float], device: torch.device) -> list[float]:
        return distributed.all_reduce_sum(values, device)

    def root_forward(self, model: torch.nn.Module, name: str, fn) -> Any:
        # A forward method of the FSDP root: its hooks gather the embeddings and the head around it.
        return root_forward(model, name, fn)

    def metric_totals(self, totals, device):
        # Sums over every rank's pairs (its count among them): their means are over the global batch's
        # pairs, as TRL gathers its metrics from every process before it averages them.
        return [distributed.all_reduce_tensors(t) for t in totals]

    @property
    def recorder_rank(self) -> int | None:
        return self.rank

    @property
    def attributes_memory(self) -> bool:
        return False

    def run_fields(self, spec) -> dict[str, Any]:
        fields = {"world_size": self.world_size, "shard": spec.shard}
        return fields if spec.sequence_parallel == 1 else {**fields, "sequence_parallel": spec.sequence_parallel}

    @property
    def saves_on_oom(self) -> bool:
        # A sharded emergency checkpoint needs every rank, and the others are stuck in a collective:
        # no checkpoint then (torchrun stops them when this rank exits).
        return False

    def save_checkpoint(
        self, run_dir, step, *, model, optimizer, scheduler, grad_scaler, data_state, rng_state, reason, keep
    ):
        return checkpointing.save_sharded_checkpoint(
            run_dir,
            step,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            data_state=data_state,
            rng_state=rng_state,
            reason=reason,
            keep=keep,
            rank=self.rank,
            world_size=self.world_size,
        )

    def load_checkpoint(self, path, *, model, optimizer, scheduler, grad_scaler, device):
        return checkpointing.load_sharded_checkpoint(
            path,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            rank=self.rank,
            world_size=self.world_size,
        )

    def save_outputs(self, model, tokenizer, run_dir: Path, adapters: bool) -> Path:
        """Every rank helps gather the full state dict onto rank 0's host; rank 0 writes the folder."""
        state = distributed.full_state_dict(model, trainable_only=adapters)
        if self.is_main:
            write_outputs(model, tokenizer, run_dir, adapters, state_dict=state)
        del state
        distributed.barrier()
        return output_dir(run_dir, adapters)


def make_world(env: Mapping[str, str] | None = None) -> World:
    """The world ``torchrun`` describes in the environment: one process unless WORLD_SIZE > 1."""
    placement = distributed.placement_from_env(env)
    return ShardedWorld(placement) if placement.distributed else World(placement)
