"""Multi-GPU training: one process per device, started by ``torchrun``, sharded with FSDP2.

``torchrun --nproc-per-node N -m memfit train run.yaml`` starts N copies of the trainer; each reads
its place from the environment torchrun sets (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``), joins the
process group (NCCL on CUDA, gloo on CPU) and trains its own slice of every global batch. The
model is sharded with PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``), one group per
decoder layer and one for the rest, as ``shard`` says:

- ``zero3`` / ``fsdp``: parameters, gradients and optimizer states sharded; each layer's weights
  are gathered for its forward and freed again after it (``reshard_after_forward=True``);
- ``zero2``: the same, but gathered weights stay until the backward is done (less communication,
  more memory);
- ``fsdp-offload``: ``fsdp`` with the shards, gradients and optimizer step on the host
  (``CPUOffloadPolicy``);
- ``ddp``: every rank holds everything and gradients are averaged (FSDP2 over a mesh whose shard
  dimension is 1, so the model keeps its class and memfit's fused loss still applies).

Gradients average over ranks; each rank's loss is weighted by its share of the global batch's
labelled tokens, so the update equals the single-process update of the same global batch.
Everything that is arithmetic (the slices, the weights, the checks) is a pure function here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from memfit.errors import UserError
from memfit.spec import TRAINED_SHARD_MODES


class DistributedError(UserError, ValueError):
    """The multi-process setup does not match the config (world size, shard, launch)."""


@dataclass(frozen=True)
class Placement:
    """Where this process stands: ``rank`` of ``world_size`` processes, ``local_rank`` on its node."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0 prints progress and writes the run's shared files."""
        return self.rank == 0


# ------------------------------------------------------------------------------------------------
# Pure pieces


def placement_from_env(env: Mapping[str, str] | None = None) -> Placement:
    """The :class:`Placement` torchrun describes in ``env`` (default ``os.environ``); one process when unset."""
    env = os.environ if env is None else env

    def number(name: str, default: int) -> int:
        text = env.get(name)
        if text is None or text == "":
            return default
        try:
            return int(text)
        except ValueError:
            raise DistributedError(f"environment: {name}={text!r} is not a whole number (torchrun sets it)") from None

    placement = Placement(
        rank=number("RANK", 0), local_rank=number("LOCAL_RANK", 0), world_size=number("WORLD_SIZE", 1)
    )
    if placement.world_size < 1 or not 0 <= placement.rank < placement.world_size:
        raise DistributedError(f"environment: RANK={placement.rank} does not fit WORLD_SIZE={placement.world_size}")
    return placement


def check_world(gpus: int, shard: str, world: Placement) -> None:
    """Raise :class:`DistributedError` unless ``gpus`` processes were started (and sharding set)."""
    if gpus != world.world_size:
        if world.world_size == 1:
            raise DistributedError(
                f"gpus: {gpus}, but this is a single process (WORLD_SIZE is not set). Start one process per GPU: "
                f"torchrun --nproc-per-node {gpus} -m memfit train <config>, or memfit train <config> --nproc {gpus}; "
                "or set gpus: 1 to train on one device."
            )
        raise DistributedError(
            f"gpus: {gpus}, but torchrun started {world.world_size} processes (WORLD_SIZE={world.world_size}). "
            f"Set gpus: {world.world_size} in the config (--set gpus={world.world_size}), or launch with "
            f"--nproc-per-node {gpus}."
        )
    if world.distributed and shard not in TRAINED_SHARD_MODES:
        raise DistributedError(
            f"shard: {shard!r} cannot train on {world.world_size} processes; use one of {', '.join(TRAINED_SHARD_MODES)} "
            "(zero3 = fsdp)."
        )


def fsdp_settings(shard: str) -> dict[str, Any]:
    """How ``shard`` maps onto FSDP2: ``reshard_after_forward``, ``offload`` (host), ``replicate`` (ddp)."""
    if shard not in TRAINED_SHARD_MODES:
        raise DistributedError(f"shard: {shard!r} is not one of {', '.join(TRAINED_SHARD_MODES)}")
    return {
        "reshard_after_forward": shard in ("zero3", "fsdp", "fsdp-offload"),
        "offload": shard == "fsdp-offload",
        "replicate": shard == "ddp",
    }


def rank_slice(examples: Sequence[Any], rank: int, world_size: int) -> list[Any]:
    """This rank's share of one global micro-batch: every ``world_size``-th example from ``rank``.

    Strided rather than contiguous, so that a short last batch of an epoch still spreads over the
    ranks; a rank may get nothing when the batch holds fewer examples than there are ranks.
    """
    return list(examples[rank::world_size])


def data_parallel_place(rank: int, world_size: int, sequence_parallel: int) -> tuple[int, int, int]:
    """(data-parallel rank, data-parallel degree, rank in its sequence-parallel group) of ``rank``.

    Sequence-parallel groups are ``sequence_parallel`` consecutive ranks (on one node, where the
    all-to-all is fastest); each group trains one data-parallel slice of every global batch.
    """
    if sequence_parallel < 1 or world_size % sequence_parallel:
        raise DistributedError(
            f"sequence_parallel: {sequence_parallel} does not divide the {world_size} processes started; "
            f"set sequence_parallel to a divisor of {world_size}"
        )
    return rank // sequence_parallel, world_size // sequence_parallel, rank % sequence_parallel


def loss_weights(local_tokens: Sequence[int], global_tokens: Sequence[int], world_size: int) -> list[float]:
    """Factor for each micro-batch's mean loss on this rank.

    The single-process loss of a global micro-batch is ``sum of token losses / global tokens``;
    gradients are averaged over ``world_size`` ranks. So rank r scales its mean loss by
    ``world_size * local / global``: averaged over ranks this is exactly the global mean.
    """
    return [world_size * local / total if total else 0.0 for local, total in zip(local_tokens, global_tokens)]


# ------------------------------------------------------------------------------------------------
# The process group


def init_distributed(world: Placement, device_name: str):
    """Join the process group and return this rank's device (``cuda:LOCAL_RANK``, or ``cpu``).

    NCCL on CUDA, gloo on CPU. ``device_name`` is the config's ``device``: ``auto`` takes CUDA when
    there is one; ``cuda:N`` is replaced by the local rank's device (one GPU per process).
    """
    import torch
    import torch.distributed as dist

    wanted = str(device_name).strip().lower()
    use_cuda = wanted != "cpu" and torch.cuda.is_available()
    if wanted.startswith("cuda") and not torch.cuda.is_available():
        raise DistributedError(
            f"device: {device_name!r} asked for, but this PyTorch sees no CUDA device; use device: cpu"
        )
    if use_cuda:
        count = torch.cuda.device_count()
        if world.local_rank >= count:
            raise DistributedError(
                f"LOCAL_RANK {world.local_rank} has no GPU: this node has {count}. Start at most {count} processes per node."
            )
        device = torch.device("cuda", world.local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        backend = "nccl" if use_cuda else "gloo"
        kwargs = {"device_id": device} if use_cuda else {}
        dist.init_process_group(backend=backend, rank=world.rank, world_size=world.world_size, **kwargs)
    return device


def teardown() -> None:
    """Leave the process group (a no-op when none was joined)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def sequence_groups(world: Placement, sequence_parallel: int):
    """This rank's sequence-parallel process group: its ``sequence_parallel`` consecutive ranks
    (every rank makes every group, as ``new_group`` requires)."""
    import torch.distributed as dist

    mine = None
    for start in range(0, world.world_size, sequence_parallel):
        group = dist.new_group(list(range(start, start + sequence_parallel)))
        if start <= world.rank < start + sequence_parallel:
            mine = group
    return mine


def all_reduce_sum(values: Sequence[float], device) -> list[float]:
    """Sum ``values`` over every rank (one collective); returns them unchanged on one process."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return [float(v) for v in values]
    tensor = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor.tolist()


def all_reduce_tensors(values: dict[str, Any]) -> dict[str, Any]:
    """Tensors (one device, scalars) summed over every rank in one collective, as float64; unchanged
    on one process."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or not values:
        return values
    names = list(values)
    stacked = torch.stack([values[name].detach().double().reshape(()) for name in names])
    dist.all_reduce(stacked, op=dist.ReduceOp.SUM)
    return dict(zip(names, stacked.unbind()))


def gather_objects(value: Any) -> list[Any]:
    """``value`` of every rank, in rank order (a collective); ``[value]`` on one process."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def first_error(message: str | None) -> str | None:
    """The first rank's error message, if any rank has one (every rank gets the same answer)."""
    return next((m for m in gather_objects(message) if m), None)


# ------------------------------------------------------------------------------------------------
# Sharding the model


def _is_4bit_weight(module, name: str) -> bool:
    return name == "weight" and any(c.__name__ == "Linear4bit" for c in type(module).__mro__)


def frozen_4bit_params(model) -> set:
    """The packed NF4 weights of a QLoRA model: kept whole on every rank, outside FSDP.

    bitsandbytes' ``Params4bit`` carries its quantization state beside the tensor; FSDP2 would
    shard the packed bytes and lose that state. The weights are frozen (nothing to synchronise) and
    a quarter of their bf16 size, so each rank keeps its own copy; the adapters and everything
    else are sharded. 4-bit experts (:mod:`memfit.models.experts_nf4`) are kept whole alike: their
    quantization state is buffers beside the packed bytes, which FSDP does not shard.
    """
    from memfit.models.experts_nf4 import nf4_expert_modules

    packed = {module.weight for module in model.modules() if _is_4bit_weight(module, "weight")}
    return packed | {getattr(m, w.name) for m in nf4_expert_modules(model) for w in m.expert_weights}


def load_device(spec, device):
    """Where a rank loads the whole model before sharding it: host memory, not the GPU.

    ``fully_shard`` moves a module's host tensors to the GPU one decoder layer at a time and keeps
    only this rank's shard, so a model larger than one card (LoRA of 70B: 140 GB of bf16 weights)
    never exists whole on a GPU. The price is host memory: every rank holds the whole model there
    until it is sharded. QLoRA loads on the device: its 4-bit weights stay outside FSDP (see
    :func:`frozen_4bit_params`), are quantized on the GPU, and are a quarter of the bf16 size.
    """
    import torch

    if device.type != "cuda" or spec.method == "qlora":
        return device
    return torch.device("cpu")


def check_placed(model, device) -> None:
    """Raise if a parameter or buffer of the sharded model (or of its reference copy) is not on ``device`` (a sharding gap)."""
    from memfit.step.preference import reference_model

    reference = reference_model(model)
    modules = [("", model)] + ([("reference.", reference)] if reference is not None else [])
    stray = sorted(
        {
            prefix + name
            for prefix, module in modules
            for name, t in list(module.named_parameters()) + list(module.named_buffers())
            if _local(t).device != device
        }
    )
    if stray:
        raise DistributedError(
            f"after sharding, {len(stray)} tensors are not on {device} (e.g. {', '.join(stray[:3])}); "
            "this model has modules FSDP does not manage: report it with the model's config"
        )


def _local(tensor):
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def shard_model(model, spec, device, world: Placement):
    """Shard ``model`` with FSDP2 as ``spec.shard`` says and return it (the same object, now an FSDPModule).

    Each decoder layer (:func:`memfit.models.build.decoder_layers`) becomes one FSDP group, then the
    root takes what is left (embeddings, final norm, output head); a DPO run's frozen reference copy
    is sharded alike, apart (:func:`memfit.step.preference.reference_model`). Parameters keep the run's dtype
    (pure bf16, or fp32 master weights under a mixed precision, whose forward runs under autocast
    after the gather, as on one GPU); gradients of 16-bit weights are reduced in fp32.
    """
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    from memfit.models.build import DTYPES
    from memfit.models.layers import decoder_layers
    from memfit.step.preference import reference_model

    settings = fsdp_settings(spec.shard)
    dtype = DTYPES[spec.weight_precision]
    if settings["replicate"]:
        # A 2-D mesh (replicate, shard=1): FSDP2's hybrid mode with nothing to shard is plain data parallelism.
        mesh = init_device_mesh(device.type, (world.world_size, 1), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(device.type, (world.world_size,), mesh_dim_names=("shard",))
    mp_policy = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32 if dtype != torch.float32 else None)
    # Host offload only means something for a device other than the host.
    offload = CPUOffloadPolicy() if settings["offload"] and device.type == "cuda" else OffloadPolicy()
    ignored = frozen_4bit_params(model) or None
    common = dict(mesh=mesh, mp_policy=mp_policy, offload_policy=offload, ignored_params=ignored)
    for layer in decoder_layers(model):
        fully_shard(layer, reshard_after_forward=settings["reshard_after_forward"], **common)
    # The root's weights are needed again right at the start of backward (the output head): keep them.
    fully_shard(model, reshard_after_forward=False, **common)
    reference = reference_model(model)
    if reference is not None:
        # DPO's frozen copy (full fine-tuning) is sharded as a model of its own, a layer at a time,
        # each gathered for its forward and let go right after: it has no backward to keep them for.
        for layer in decoder_layers(reference):
            fully_shard(layer, reshard_after_forward=True, **common)
        fully_shard(reference, reshard_after_forward=True, **common)
    return model


def full_state_dict(model, *, trainable_only: bool) -> dict[str, Any]:
    """The whole (unsharded) state dict on rank 0's host; every rank must call it (a collective).

    Other ranks get an empty dict. ``trainable_only`` gathers just the trainable parameters
    (the adapters of a LoRA run).
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only)
    return get_model_state_dict(model, options=options)


def local_value(tensor) -> Any:
    """A DTensor's full value (a collective), or the tensor itself."""
    full = getattr(tensor, "full_tensor", None)
    return full() if callable(full) else tensor
