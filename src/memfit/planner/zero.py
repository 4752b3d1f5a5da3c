"""DeepSpeed ZeRO's own buffers per rank, from the DeepSpeed config a run names: pure arithmetic.

:mod:`memfit.planner.sharding` plans ``zero1``, ``zero2`` and ``zero3`` as PyTorch shards them
(DDP's buckets, FSDP2's gathered layers). A run that names a DeepSpeed JSON
(:class:`memfit.interop.deepspeed.ZeroSettings`) is planned with DeepSpeed's buffers instead, each
a named term per rank (:func:`zero_terms`), read from DeepSpeed's ``runtime/zero/stage_1_and_2.py``
and ``stage3.py`` (at edaa722):

- stages 1 and 2: with ``contiguous_gradients`` (the default) each gradient is copied into a
  reduce bucket of ``reduce_bucket_size`` elements as backward makes it (two buckets with
  ``overlap_comm``), allocated when backward starts and freed when it ends; the updated weights
  are all-gathered in place (``all_gather_into_tensor``), so ``allgather_bucket_size`` allocates
  nothing; with ``offload_optimizer`` a device buffer as large as the largest trained parameter
  stages gradients for the copy to the host, for the whole run;
- stage 3: one reduce bucket, allocated with the optimizer and kept; in forward and backward the
  current layer's weights gathered, and up to ``stage3_prefetch_bucket_size`` elements fetched
  ahead; at the turn from forward to backward the last layers stay gathered where their next use
  is within ``stage3_max_reuse_distance`` elements; all of it at most ``stage3_max_live_parameters``.

Approximations (named in the plan): weights are gathered a decoder layer at a time (DeepSpeed
fetches each module, so the current fetch is usually smaller); parameters below
``stage3_param_persistence_threshold`` stay whole (norms: not counted); the embeddings and head
are gathered through forward and backward, as FSDP's root group is planned.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memfit.json_form import JsonForm

#: memfit shard modes a DeepSpeed config maps to (:func:`memfit.interop.deepspeed.shard_mode`).
ZERO_MODES = ("zero1", "zero2", "zero3", "fsdp-offload")
_STEP_PHASES = ("forward", "backward")


@dataclass(frozen=True)
class Term(JsonForm):
    """One DeepSpeed buffer on a rank: ``nbytes`` in ``category`` during ``phases`` (() for the whole run)."""

    name: str
    nbytes: int
    phases: tuple[str, ...]
    category: str
    why: str

    def live_in(self, phase: str) -> bool:
        return not self.phases or phase in self.phases

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "bytes": self.nbytes,
            "when": list(self.phases) or "whole run",
            "category": self.category,
            "why": self.why,
        }


def uses_zero(zero: Any, shard: str) -> bool:
    """Whether a rank is planned with DeepSpeed's buffers: a DeepSpeed config and a ZeRO mode."""
    return zero is not None and zero.stage > 0 and shard in ZERO_MODES


def zero_terms(
    zero: Any,
    *,
    gpus: int,
    layout: Any,
    num_layers: int,
    itemsize: int,
    trainable_itemsize: int,
    reference_pass: bool = False,
) -> list[Term]:
    """DeepSpeed's buffers on one of ``gpus`` ranks. ``zero``: resolved settings (no ``"auto"`` left);
    ``itemsize``: bytes of an element in DeepSpeed's buffers (2 with bf16 or fp16, 4 otherwise);
    ``trainable_itemsize``: bytes of an element of the trained parameters as planned.
    ``reference_pass``: the step has DPO's reference pass (the model with its adapters disabled, or
    TRL's reference model, which ZeRO-3 shards like the model): under ZeRO-3 it gathers as forward does."""
    if zero.stage in (1, 2):
        return _stage_1_2_terms(zero, layout=layout, itemsize=itemsize, trainable_itemsize=trainable_itemsize)
    if zero.stage != 3:
        return []
    gathering = (("reference",) if reference_pass else ()) + _STEP_PHASES
    return _stage_3_terms(zero, gpus=gpus, layout=layout, num_layers=num_layers, itemsize=itemsize, gathering=gathering)


def _stage_1_2_terms(zero: Any, *, layout: Any, itemsize: int, trainable_itemsize: int) -> list[Term]:
    """Stages 1 and 2: the reduce bucket(s) backward copies gradients into, the all-gather bucket
    (nothing: the gather is in place), and with ``offload_optimizer`` the gradients' staging buffer."""
    count = 2 if zero.overlaps_comm else 1
    if zero.contiguous_gradients:
        bucket_bytes = count * zero.reduce_bucket_elements * itemsize
        bucket_why = (
            f"{count} reduce bucket{'s' if count > 1 else ''} of {zero.reduce_bucket_elements:,} elements"
            + (" (overlap_comm)" if count > 1 else "")
            + ", the gradients copied in as backward makes them"
        )
    else:
        bucket_bytes = 0
        bucket_why = "contiguous_gradients: false: gradients reduced where they are, no bucket"
    terms = [
        Term("reduce_bucket_size", bucket_bytes, ("backward",), "temporaries", bucket_why),
        Term(
            "allgather_bucket_size",
            0,
            (),
            "temporaries",
            "the updated weights are all-gathered in place (all_gather_into_tensor): no bucket is allocated",
        ),
    ]
    if zero.offload_optimizer:
        # The buffer holds DeepSpeed's elements, as many as the largest trained parameter has.
        largest = max((g.dim0 * g.row_bytes for g in layout.groups if g.trainable), default=0)
        terms.append(
            Term(
                "offload_optimizer",
                largest * itemsize // max(trainable_itemsize, 1),
                (),
                "gradients",
                "a device buffer as large as the largest trained parameter stages gradients for the host",
            )
        )
    return terms


def _stage_3_terms(
    zero: Any, *, gpus: int, layout: Any, num_layers: int, itemsize: int, gathering: tuple[str, ...]
) -> list[Term]:
    """Stage 3: the kept reduce bucket, the gathered weights (:func:`_stage_3_live_parameter_terms`),
    the root group, a layer's fresh gradients, and with ``offload_param`` the shard copied in."""
    terms = [
        Term(
            "reduce_bucket_size",
            zero.reduce_bucket_elements * itemsize if zero.contiguous_gradients else 0,
            (),
            "gradients",
            f"one reduce bucket of {zero.reduce_bucket_elements:,} elements, kept from the optimizer's creation on",
        )
    ]
    terms += _stage_3_live_parameter_terms(
        zero, layout=layout, num_layers=num_layers, itemsize=itemsize, gathering=gathering
    )
    terms.append(
        Term(
            "root group",
            layout.root_param_bytes,
            gathering,
            "temporaries",
            "the embeddings and the output head, gathered (planned through forward and backward)",
        )
    )
    terms.append(
        Term(
            "fresh gradients",
            layout.layer_grad_bytes + layout.root_grad_bytes,
            ("backward",),
            "temporaries",
            "a layer's gradients (and the root group's) before they are copied into the bucket",
        )
    )
    if zero.offload_param:
        terms.append(
            Term(
                "offload_param",
                -(-layout.layer_param_bytes // gpus),
                gathering,
                "temporaries",
                "the rank's shard of the layer copied in from the host before it is gathered",
            )
        )
    return terms


def _stage_3_live_parameter_terms(
    zero: Any, *, layout: Any, num_layers: int, itemsize: int, gathering: tuple[str, ...]
) -> list[Term]:
    """The weights stage 3 holds gathered, which share ``stage3_max_live_parameters``, taken in this
    order: the layer computing, the prefetch, the last layers kept from forward into backward."""
    layer = layout.layer_param_bytes
    live_cap = zero.max_live_parameters * itemsize
    current = min(layer, live_cap)
    prefetch = min(zero.prefetch_bucket_elements * itemsize, max(live_cap - current, 0))
    # Between the forward and the backward of the i-th layer from the end run i layers' forward, the
    # root group and i layers' backward: it stays gathered when that many elements are in the distance.
    layer_elements = max(layer // max(itemsize, 1), 1)
    head_elements = layout.root_param_bytes // max(itemsize, 1)
    kept_layers = sum(1 for i in range(num_layers) if 2 * i * layer_elements + head_elements < zero.max_reuse_distance)
    kept = min(kept_layers * layer, max(live_cap - current - prefetch, 0))
    return [
        Term(
            "gathered layer",
            current,
            gathering,
            "temporaries",
            "the weights of the layer computing, all-gathered (planned a decoder layer at a time)",
        ),
        Term(
            "stage3_prefetch_bucket_size",
            prefetch,
            gathering,
            "temporaries",
            f"up to {zero.prefetch_bucket_elements:,} elements of the next modules' weights fetched ahead",
        ),
        Term(
            "stage3_max_reuse_distance",
            kept,
            ("backward",),
            "temporaries",
            f"{kept_layers} last layer{'s' if kept_layers != 1 else ''} kept gathered from forward into backward: "
            f"used again within {zero.max_reuse_distance:,} elements",
        ),
    ]


def zero_ratios(zero: Any, ratios: dict[str, float]) -> dict[str, float]:
    """The mode's ratios of model states on a rank's GPU, with DeepSpeed's offload: optimizer
    states (and from stage 2 on, the gradients' partition) to the host with ``offload_optimizer``;
    weights to the host with ``offload_param``."""
    out = dict(ratios)
    if zero.offload_optimizer:
        out["optimizer"] = 0.0
        if zero.stage >= 2:
            out["gradients"] = 0.0
    if zero.offload_param:
        out["weights"] = out["trainable"] = 0.0
    return out


@dataclass(frozen=True)
class ZeroPlan(JsonForm):
    """A DeepSpeed config's settings (resolved) and the buffers they give one rank."""

    settings: Any
    terms: tuple[Term, ...]

    def to_dict(self) -> dict[str, Any]:
        return {**self.settings.to_dict(), "terms": [t.to_dict() for t in self.terms]}


def extra_bytes(terms: tuple[Term, ...] | list[Term], phase: str) -> dict[str, int]:
    """Bytes the terms add to each category at a moment of ``phase``."""
    extra: dict[str, int] = {}
    for term in terms:
        if term.live_in(phase):
            extra[term.category] = extra.get(term.category, 0) + term.nbytes
    return extra
