"""Per-GPU memory of a data-parallel run, from the single-GPU simulation: pure arithmetic.

Every rank runs the same step on its own micro-batch, so activations and temporaries are those of
the single-GPU simulation. What changes is where the model states live (``--shard``):

=============  ==========  ===========  ==========  ==============================================
mode           weights     gradients    optimizer   extra buffers
=============  ==========  ===========  ==========  ==============================================
ddp            full        full         full        DDP's gradient buckets (a second copy of the
                                                    gradients: ``gradient_as_bucket_view=False``)
zero1          full        full         / N         the same buckets (gradients are all-reduced)
zero2          full        / N          / N         one layer's unsharded gradients plus the
                                                    reduce-scatter input, in backward
zero3, fsdp    / N         / N          / N         all-gather output of the current and the
                                                    prefetched layer, the root group (embeddings,
                                                    head) gathered through forward and backward,
                                                    reduce-scatter buffers in backward
fsdp-offload   host        host         host        as fsdp, plus the sharded inputs copied in
=============  ==========  ===========  ==========  ==============================================

Behaviour modelled (PyTorch's documentation of ``fully_shard`` and ``DistributedDataParallel``):

- FSDP2 shards each parameter on dim 0 with ``torch.chunk`` and pads every shard to the size of
  the first, so a rank holds ``ceil(dim0 / N)`` rows of every parameter (:meth:`ParamLayout.shard_bytes`).
- Before a layer's forward (and backward) its parameters are all-gathered into unsharded tensors,
  freed again by the post-forward (post-backward) hook; with the default prefetch the next layer's
  all-gather is issued while the current one computes, so two layers are unsharded at once.
- The root ``fully_shard`` (the whole model; its own parameters are the embeddings, the final norm
  and the output head) does not reshard after forward, so those stay unsharded through backward,
  and their gradients are reduce-scattered only when backward ends.
- Each layer's unsharded gradients are copied into one reduce-scatter input buffer; the buffer is
  kept until the next reduce-scatter is issued, so in backward one buffer and the next layer's fresh
  gradients coexist.
- DDP's ``gradient_as_bucket_view`` defaults to False: the buckets (``bucket_cap_mb=25``) are flat
  tensors allocated when the model is wrapped, as large as all the gradients together, beside
  ``param.grad``; the documentation of that flag says setting it saves "the total gradients size".
- memfit's trainer keeps QLoRA's packed 4-bit weights outside FSDP, whole on every rank (FSDP2
  would lose bitsandbytes' quantization state): they count in full on every rank and are never
  gathered, nor offloaded; the adapters, embeddings, norms and head shard as usual. The hf recipe's
  FSDP and ZeRO-3 (the 4-bit base stored in bf16, ``bnb_4bit_quant_storage``) shard, gather and
  offload the packed bytes as any weight (:func:`memfit.planner.layout.shards_4bit_base`);
  bitsandbytes' quantization state, beside the parameter, stays whole on every GPU in both.
- ``CPUOffloadPolicy`` keeps sharded parameters, gradients and optimizer states in pinned host
  memory and runs the optimizer step on the CPU; what FSDP does not manage stays on the GPU.

Where the extra buffers are counted: gathered parameters and reduce-scatter buffers are transient
tensors of the caching allocator (``temporaries``); DDP's buckets hold gradients for the whole run
(``gradients``); NCCL's own buffers are allocated outside PyTorch's allocator (``runtime``).
zero3 is planned as fsdp. A run that names a DeepSpeed config is planned with DeepSpeed's own
buffers instead (its reduce buckets, prefetch and reuse settings, offload: :mod:`memfit.planner.zero`,
passed here as ``zero``). No mode adds master weights of its own: the states are the ones memfit's
step keeps (pure bf16 AdamW: 2 + 2 + 4 bytes a parameter; bf16-mixed: fp32 weights, gradients and
states, 4 + 4 + 8). Under a mixed precision the fp32 weights are gathered as they are; autocast's
16-bit copies, made after the gather, are the step's own temporaries, counted whole on every rank
as the single-GPU simulation holds them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: Modes whose parameters are gathered a layer at a time (FSDP2 ``fully_shard`` per decoder layer).
GATHERING_MODES = ("zero3", "fsdp", "fsdp-offload")

#: DDP's default ``bucket_cap_mb``.
DDP_BUCKET_BYTES = 25 * 2**20

#: NCCL's device buffers per rank, an estimate: NCCL allocates them itself (not through PyTorch's
#: caching allocator). The figure is NCCL's documented default ``NCCL_BUFFSIZE`` (4 MiB) for the
#: send and the receive connection of each of up to 32 channels of a ring; LL/LL128 protocol
#: buffers, tree connections and NCCL's kernels are left out. Not measured; calibrate on a GPU.
NCCL_BUFFSIZE_BYTES = 4 * 2**20
NCCL_CHANNELS = 32
NCCL_RUNTIME_BYTES = NCCL_CHANNELS * 2 * NCCL_BUFFSIZE_BYTES

_STATES = ("weights", "trainable", "gradients", "optimizer")


@dataclass(frozen=True)
class ParamGroup:
    """``count`` parameters of one shape: ``dim0`` rows of ``row_bytes`` bytes each."""

    dim0: int
    row_bytes: int
    trainable: bool
    count: int = 1
    sharded: bool = True  # False: every rank keeps it whole (memfit's packed 4-bit QLoRA weights)

    def shard_bytes(self, gpus: int) -> int:
        """Bytes one rank holds: ``ceil(dim0 / gpus)`` rows (FSDP2 pads every chunk to the first)."""
        rows = -(-self.dim0 // gpus) if self.sharded else self.dim0
        return self.count * rows * self.row_bytes


@dataclass(frozen=True)
class ParamLayout:
    """The parameters of the whole model and the per-layer sizes the communication buffers need.

    Bytes are in the parameters' storage dtype (fp32 for full fine-tuning under a mixed precision:
    FSDP gathers the fp32 weights, autocast casts them afterwards).
    """

    groups: tuple[ParamGroup, ...]
    layer_param_bytes: int  # the largest decoder layer, every parameter
    layer_grad_bytes: int  # that layer's trainable parameters (its gradients)
    root_param_bytes: int  # parameters outside the decoder layers (embeddings, final norm, head)
    root_grad_bytes: int  # their trainable part

    def total_bytes(self, trainable: bool) -> int:
        return sum(g.count * g.dim0 * g.row_bytes for g in self.groups if g.trainable == trainable)

    def shard_bytes(self, trainable: bool, gpus: int) -> int:
        return sum(g.shard_bytes(gpus) for g in self.groups if g.trainable == trainable)

    def whole_bytes(self, trainable: bool) -> int:
        """Bytes every rank keeps whole, outside FSDP (on the GPU, even with offload)."""
        return sum(g.count * g.dim0 * g.row_bytes for g in self.groups if g.trainable == trainable and not g.sharded)

    def whole_ratio(self, trainable: bool) -> float:
        """The part of the bytes kept whole on every rank's GPU."""
        total = self.total_bytes(trainable)
        return self.whole_bytes(trainable) / total if total else 0.0

    def shard_ratio(self, trainable: bool, gpus: int) -> float:
        """Bytes one rank holds over the unsharded bytes: 1/N, a little more for padding."""
        total = self.total_bytes(trainable)
        return self.shard_bytes(trainable, gpus) / total if total else 1.0 / gpus


def effective_shard(shard: str, gpus: int) -> str:
    """The mode planned: ``none`` on several GPUs is plain data parallel, i.e. ddp."""
    return "ddp" if gpus > 1 and shard == "none" else shard


def state_ratios(shard: str, gpus: int, layout: ParamLayout, zero=None, reference: str = "none") -> dict[str, float]:
    """Fraction of each model-state category that stays on a rank's GPU (1 where not sharded);
    ``zero`` (a :class:`memfit.planner.zero.ZeroPlan`): DeepSpeed's offload moves states to the host.
    ``reference``: where a DPO step's reference comes from (:func:`memfit.spec.reference_source`); a
    frozen copy is the ``weights`` of full fine-tuning, placed as :func:`reference_ratio` says."""
    from memfit.planner.zero import uses_zero, zero_ratios

    ratios = _mode_ratios(shard, gpus, layout)
    settings = getattr(zero, "settings", None)
    deepspeed = uses_zero(settings, effective_shard(shard, gpus))
    if deepspeed:
        ratios = zero_ratios(settings, ratios)
    if reference == "frozen-copy":
        ratios["weights"] = reference_ratio(shard, gpus, layout, settings if deepspeed else None)
    return ratios


def reference_ratio(shard: str, gpus: int, layout: ParamLayout, deepspeed=None) -> float:
    """Fraction of full fine-tuning's frozen reference copy (DPO) on a rank's GPU.

    memfit's trainer shards the copy with FSDP2 as it shards the model, a layer at a time, and lets
    each layer go after its forward (it has no backward): whole with ``ddp``, a shard with ``zero2``,
    ``zero3`` and ``fsdp`` (padded as the model's, whose layout it has), on the host with
    ``fsdp-offload``. ``zero1`` is planned as TRL runs it with DeepSpeed, whose
    ``prepare_deepspeed`` shards the reference only under ZeRO-3 and keeps it whole on every GPU
    otherwise (stage 0); ``deepspeed`` (a DeepSpeed config's settings) plans it so for every stage,
    with ZeRO-3's ``offload_param`` on the host.
    """
    shard = effective_shard(shard, gpus)
    if deepspeed is not None:
        if deepspeed.stage != 3:
            return 1.0
        return 0.0 if deepspeed.offload_param else layout.shard_ratio(True, gpus)
    if shard == "fsdp-offload":
        return 0.0
    if shard in ("zero2",) + GATHERING_MODES:
        return layout.shard_ratio(True, gpus)
    return 1.0


def _mode_ratios(shard: str, gpus: int, layout: ParamLayout) -> dict[str, float]:
    shard = effective_shard(shard, gpus)
    frozen, trainable = layout.shard_ratio(False, gpus), layout.shard_ratio(True, gpus)
    ratios = dict.fromkeys(_STATES, 1.0)
    if shard == "zero1":
        ratios["optimizer"] = trainable
    elif shard == "zero2":
        ratios.update(gradients=trainable, optimizer=trainable)
    elif shard in ("zero3", "fsdp"):
        ratios.update(weights=frozen, trainable=trainable, gradients=trainable, optimizer=trainable)
    elif shard == "fsdp-offload":
        ratios = dict.fromkeys(_STATES, 0.0)
        ratios["weights"] = layout.whole_ratio(False)  # what FSDP does not manage stays on the GPU
    return ratios


def extra_buffers(
    shard: str, gpus: int, phase: str, layout: ParamLayout, zero=None, reference: str = "none"
) -> dict[str, int]:
    """Device bytes a mode adds to a rank at a moment of ``phase``, by the category they count in
    (DeepSpeed's buffers in place of PyTorch's with ``zero``, a :class:`memfit.planner.zero.ZeroPlan`).

    A DPO step's ``reference`` phase is a forward under ``no_grad``: the model's own with its
    adapters disabled, or the frozen copy's, whose layers and root group have the model's sizes. Its
    weights are gathered as in forward where the mode gathers them, and for a frozen copy
    (:func:`reference_ratio`) with ``zero2`` too."""
    from memfit.planner.zero import extra_bytes, uses_zero

    shard = effective_shard(shard, gpus)
    extra = {"gradients": 0, "temporaries": 0, "runtime": 0}
    if shard == "none":
        return extra
    extra["runtime"] = NCCL_RUNTIME_BYTES
    if uses_zero(getattr(zero, "settings", None), shard):
        for category, nbytes in extra_bytes(zero.terms, phase).items():
            extra[category] = extra.get(category, 0) + nbytes
        return extra
    if shard in ("ddp", "zero1"):
        extra["gradients"] = ddp_bucket_bytes(layout.total_bytes(True))
    if phase == "reference":
        if shard in GATHERING_MODES or (shard == "zero2" and reference == "frozen-copy"):
            extra["temporaries"] += _gathered_bytes(shard, gpus, layout)
        return extra
    if phase not in ("forward", "backward"):
        return extra  # the optimizer step runs on sharded (or whole, local) tensors: no collectives
    if shard in GATHERING_MODES:
        extra["temporaries"] += _gathered_bytes(shard, gpus, layout)
    if phase == "backward" and shard in ("zero2",) + GATHERING_MODES:
        # A layer's fresh unsharded gradients, the previous layer's reduce-scatter input, and the
        # root group's unsharded gradients (reduced when backward ends).
        extra["temporaries"] += 2 * layout.layer_grad_bytes + layout.root_grad_bytes
        if shard == "fsdp-offload":
            extra["temporaries"] += -(-layout.layer_grad_bytes // gpus)  # the output, before its copy out
    return extra


def _gathered_bytes(shard: str, gpus: int, layout: ParamLayout) -> int:
    """What a forward holds gathered: the current and the prefetched layer, and the root group (which
    stays gathered until backward ends); with ``fsdp-offload`` the host shards copied in as inputs."""
    gathered = 2 * layout.layer_param_bytes + layout.root_param_bytes
    if shard == "fsdp-offload":
        gathered += 2 * -(-layout.layer_param_bytes // gpus)
    return gathered


def ddp_bucket_bytes(gradient_bytes: int, bucket_bytes: int = DDP_BUCKET_BYTES) -> int:
    """Bytes of DDP's gradient buckets: all gradients, in buckets of ``bucket_bytes`` (512-byte blocks)."""
    if gradient_bytes <= 0:
        return 0
    full, rest = divmod(gradient_bytes, bucket_bytes)
    block = lambda n: -(-n // 512) * 512  # noqa: E731 - the allocator's block rounding
    return full * block(bucket_bytes) + (block(rest) if rest else 0)


def per_rank_categories(
    categories: dict[str, int],
    phase: str,
    *,
    shard: str,
    gpus: int,
    layout: ParamLayout,
    zero=None,
    reference: str = "none",
) -> dict[str, int]:
    """One rank's live bytes by category, from the single-GPU categories at a moment of ``phase``
    (``reference``: where a DPO step's reference comes from)."""
    if gpus <= 1:
        return dict(categories)
    ratios = state_ratios(shard, gpus, layout, zero, reference)
    out = {}
    for name, value in categories.items():
        out[name] = math.ceil(value * ratios[name]) if name in ratios else int(value)
    for name, value in extra_buffers(shard, gpus, phase, layout, zero, reference).items():
        out[name] = out.get(name, 0) + value
    return out


def model_state_bytes(
    categories: dict[str, int], *, shard: str, gpus: int, layout: ParamLayout, zero=None, reference: str = "none"
) -> dict[str, int]:
    """Model states (weights, trainable, all gradients, optimizer) before and after sharding.

    ``categories`` are the single-GPU categories at its peak (optimizer states are in place then);
    gradients are counted whole (as large as the trainable parameters), whenever they exist. A DPO
    run's frozen reference copy is in ``weights`` (``reference``: where the reference comes from).
    """
    states = {
        "weights": categories.get("weights", 0),
        "trainable": categories.get("trainable", 0),
        "gradients": layout.total_bytes(True),
        "optimizer": categories.get("optimizer", 0),
    }
    before = sum(states.values())
    if effective_shard(shard, gpus) == "fsdp-offload":
        kept = 0.0 if reference == "frozen-copy" else layout.whole_ratio(False)
        device = int(states["weights"] * kept)
        host = sum(int(v * r) for v, r in zip(states.values(), _sharded_ratios(gpus, layout, reference))) - device
        return {"before_bytes": before, "per_rank_device_bytes": device, "per_rank_host_bytes": host}
    ratios = state_ratios(shard, gpus, layout, zero, reference)
    after = sum(int(states[name] * ratios[name]) for name in states)
    # What DeepSpeed's offload moves to the host: the rank's share of those states.
    sharded = state_ratios(shard, gpus, layout, reference=reference)
    if reference == "frozen-copy" and _zero_run(zero, shard, gpus):
        # TRL keeps the reference whole on every GPU below ZeRO-3; ZeRO-3 shards it (to the host with offload_param).
        sharded["weights"] = 1.0 if zero.settings.stage != 3 else layout.shard_ratio(True, gpus)
    host = sum(int(states[name] * (sharded[name] - ratios[name])) for name in states)
    return {"before_bytes": before, "per_rank_device_bytes": after, "per_rank_host_bytes": host}


def _zero_run(zero, shard: str, gpus: int) -> bool:
    from memfit.planner.zero import uses_zero

    return uses_zero(getattr(zero, "settings", None), effective_shard(shard, gpus))


def _sharded_ratios(gpus: int, layout: ParamLayout, reference: str = "none") -> tuple[float, float, float, float]:
    trainable = layout.shard_ratio(True, gpus)
    # A frozen reference copy has the layout of the model it copies, whose every parameter trains.
    weights = trainable if reference == "frozen-copy" else layout.shard_ratio(False, gpus)
    return weights, trainable, trainable, trainable


def mode_problems(shard: str, gpus: int, optimizer: str, spell=None) -> list[str]:
    """Combinations that cannot run; each line names the knobs and the fix. ``spell(knob, value)``:
    how the line names a knob the user set (default: its flag, ``--shard fsdp-offload``)."""
    spell = spell or (lambda knob, value: f"--{knob} {value}")
    if effective_shard(shard, gpus) == "fsdp-offload" and optimizer in ("adamw8bit", "paged-adamw8bit"):
        return [
            f"{spell('shard', 'fsdp-offload')} with {spell('optimizer', optimizer)}: the optimizer step runs on the CPU "
            "(CPUOffloadPolicy) and bitsandbytes' 8-bit optimizers need GPU tensors. "
            "Use --optimizer adamw, or --shard fsdp."
        ]
    return []
