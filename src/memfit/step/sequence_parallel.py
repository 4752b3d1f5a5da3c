"""Sequence parallelism (DeepSpeed-Ulysses): one row's tokens spread over the ranks of a group.

With ``sequence_parallel: N`` the ranks of a group of N train the same examples, each 1/N of the
row's tokens: the embeddings, every decoder layer's projections, MLP and norms, and the loss run on
the rank's shard of the sequence. Attention needs the whole sequence, so before it an all-to-all
over heads gives each rank every token for 1/N of the heads (query, key and value), attention runs
per example over the full row (:mod:`memfit.step.attention`, the documents' bounds of the whole
row), and the inverse all-to-all gives each rank its tokens of every head back.

- :func:`shard_batch` turns a one-row micro-batch (:data:`memfit.step.batch.DOCUMENTS`) into a
  rank's shard: the row padded to a multiple of N with a filler example (no loss), the labels
  shifted *before* it is cut (``shift_labels``: the last token of shard i predicts the first token
  of shard i + 1), the global positions kept (rotary embeddings), the whole row's
  :class:`~memfit.step.batch.Documents` kept for attention.
- :func:`sequence_attention` is attention's side: the all-to-all, and back.
- :class:`SequenceGroup` is where a rank stands in its group; its ``group`` is the process group
  of the trainer, or None where one process stands for the group (the planner): the exchange then
  allocates what the collective does (its output, the size of its input; in backward, the same for
  the gradient) and copies instead of sending, so a plan holds the buffers of a run.

The loss of a shard is its mean over its own labelled tokens; the sharded step weights it by the
shard's share of every rank's labelled tokens (:func:`memfit.train.distributed.loss_weights`), so
the gradient and the logged loss equal those of one process over the whole row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from memfit.step.batch import DOCUMENTS, Documents
from memfit.step.labels import IGNORE_INDEX


@dataclass(frozen=True, eq=False)
class SequenceGroup:
    """Rank ``rank`` of ``degree`` ranks that share one row; ``group``: their process group (None:
    one process stands for them all, as the planner's does)."""

    degree: int
    rank: int = 0
    group: Any = None


# ------------------------------------------------------------------------------------------------
# What a model must be for it


def heads_problem(config: Any, degree: int, name: str = "--sequence-parallel") -> str | None:
    """Why ``degree`` ranks cannot split this model's attention heads (None when they can).

    Query heads split evenly; key / value heads split too, or, where there are fewer than ranks
    (grouped-query attention), each is repeated for the ranks whose query heads read it.
    """
    if degree <= 1:
        return None
    heads = getattr(config, "num_attention_heads", None)
    if not isinstance(heads, int):
        return f"{name} {degree}: the model's config names no num_attention_heads to split over ranks"
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % degree:
        fits = [n for n in range(2, heads + 1) if heads % n == 0 and _kv_fits(kv_heads, n)]
        return (
            f"{name} {degree}: the model's {heads} attention heads do not split over {degree} ranks; "
            f"use a degree that divides {heads} (e.g. {fits[-1] if fits else 1})"
        )
    if not _kv_fits(kv_heads, degree):
        return (
            f"{name} {degree}: the model's {kv_heads} key/value heads neither split over {degree} ranks nor repeat "
            f"evenly to them; use a degree that divides or is a multiple of {kv_heads}"
        )
    return None


def _kv_fits(kv_heads: int, degree: int) -> bool:
    return kv_heads % degree == 0 or degree % kv_heads == 0


def layout_problem(layout: str, degree: int, name: str = "--sequence-parallel") -> str | None:
    """Why a step of ``layout`` cannot cut its rows (None when it can): only one-row micro-batches,
    whose attention memfit runs itself, carry the documents' bounds across the whole row."""
    if degree <= 1 or layout == DOCUMENTS:
        return None
    return (
        f"{name} {degree}: needs micro-batches in one row (padding_free: auto or on, recipe: memfit) on a model "
        "whose attention memfit runs per example; this configuration pads its rows"
    )


# ------------------------------------------------------------------------------------------------
# The batch


def shard_batch(batch: dict[str, Any], group: SequenceGroup, pad_token_id: int) -> dict[str, Any]:
    """Rank ``group.rank``'s shard of a one-row micro-batch (see the module's docstring).

    Returns ``input_ids``, ``position_ids`` and ``shift_labels`` of the shard (``[1, tokens / N]``),
    ``documents`` of the whole (padded) row, ``sequence_group``, and ``input_tokens`` (the shard's
    tokens of the examples, its filler left out).
    """
    documents: Documents = batch["documents"]
    degree, total = group.degree, int(batch["input_ids"].shape[1])
    filler = -total % degree
    input_ids, labels, positions = batch["input_ids"], batch["labels"], batch["position_ids"]
    if filler:
        # A filler example at the end: its own positions, no loss, attention inside it alone.
        input_ids = torch.cat([input_ids, input_ids.new_full((1, filler), pad_token_id)], dim=1)
        labels = torch.cat([labels, labels.new_full((1, filler), IGNORE_INDEX)], dim=1)
        positions = torch.cat([positions, torch.arange(filler, dtype=positions.dtype)[None]], dim=1)
        lengths = documents.lengths + (filler,)
        cu_seqlens = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        cu_seqlens[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
        documents = Documents(cu_seqlens.to(documents.cu_seqlens.device), lengths)
    # Shifted before the row is cut: every token's label is the next token of the whole row.
    shifted = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    size = (total + filler) // degree
    part = slice(group.rank * size, (group.rank + 1) * size)
    return {
        "input_ids": input_ids[:, part],
        "shift_labels": shifted[:, part],
        "position_ids": positions[:, part],
        "documents": documents,
        "sequence_group": group,
        "input_tokens": max(0, min(size, total - group.rank * size)),  # the filler not counted
    }


def shard_tokens(batch: dict[str, Any]) -> int:
    """The labelled tokens a shard's loss is a mean over."""
    return int((batch["shift_labels"] != IGNORE_INDEX).sum())


# ------------------------------------------------------------------------------------------------
# Attention's all-to-all


class _Exchange(torch.autograd.Function):
    """All-to-all over dim 0 of a contiguous tensor (chunk j to rank j); its gradient goes back the
    same way. With no process group the output is a copy: the buffer the collective allocates."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _all_to_all(tensor, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all(grad.contiguous(), ctx.group), None


def _all_to_all(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    out = torch.empty_like(tensor)
    if group is None:
        out.copy_(tensor)
    else:
        import torch.distributed as dist

        dist.all_to_all_single(out, tensor, group=group)
    return out


def scatter_heads(x: torch.Tensor, group: SequenceGroup) -> torch.Tensor:
    """``[1, heads, tokens / N, d]`` (a rank's tokens, every head) -> ``[1, heads / N, tokens, d]``
    (every token, the rank's heads). Key / value heads fewer than ranks are repeated first."""
    degree = group.degree
    _, heads, shard, dim = x.shape
    if heads % degree:
        x = x.repeat_interleave(degree // heads, dim=1)  # each key / value head for the ranks that read it
        heads = degree
    parts = x[0].reshape(degree, heads // degree, shard, dim).contiguous()
    received = _Exchange.apply(parts, group.group)  # [ranks (sequence shards), heads / N, shard, d]
    return received.transpose(0, 1).reshape(1, heads // degree, degree * shard, dim)


def gather_heads(x: torch.Tensor, group: SequenceGroup) -> torch.Tensor:
    """The inverse of :func:`scatter_heads` for attention's output: ``[1, tokens, heads / N, d]`` ->
    ``[1, tokens / N, heads, d]``."""
    degree = group.degree
    _, tokens, heads, dim = x.shape
    parts = x[0].reshape(degree, tokens // degree, heads, dim).contiguous()
    received = _Exchange.apply(parts, group.group)  # [ranks (head groups), shard, heads / N, d]
    return received.transpose(0, 1).reshape(1, tokens // degree, degree * heads, dim)


def sequence_attention(attention, group: SequenceGroup, query, key, value, **kwargs: Any):
    """``attention(query, key, value, **kwargs)`` (transformers' attention interface, ``[1, heads,
    tokens, d]`` in, ``[1, tokens, heads, d]`` out) run on the whole row for this rank's heads, from
    and back to this rank's tokens."""
    out, weights = attention(
        scatter_heads(query, group), scatter_heads(key, group), scatter_heads(value, group), **kwargs
    )
    return gather_heads(out, group), weights
