"""GRPO in memfit's step: completions scored token by token, TRL's clipped policy loss and KL term.

A grpo micro-batch holds ``batch_size`` completions, each one sequence: its prompt, then the
completion the policy generated (:mod:`memfit.step.rollout`), labels -100 on the prompt; in the
step's layout (padded rows, or one row with attention kept inside each sequence:
:mod:`memfit.step.batch`). Beside the tokens it carries each completion's advantage (from the
rewards of its group: :func:`group_advantages`) and, where the run takes several optimizer steps
on one generation batch (``num_iterations``), the log-probs the policy gave the completion when it
was generated. Every per-token quantity is a dense ``[tokens]`` vector over the micro-batch's
positions (0 where no completion token is scored), so nothing depends on the values of a tensor
for its shape: the planner runs this loss under fake tensors.

The policy's per-token log-probs come from the fused, chunked path
(:class:`memfit.step.losses.ChunkedLinearLogProbs`, the logits divided by the sampling
``temperature`` as TRL does): no ``[completions x length x vocab]`` logits exist, in fp32 or
otherwise. The reference (``beta`` above 0) is the base with its adapters disabled, or a frozen
copy for full fine-tuning, run under ``no_grad`` before the policy's forward as a phase of its own
(``reference``), like DPO's.

:func:`grpo_loss` is TRL's ``GRPOTrainer._compute_loss`` for the loss types grpo, bnpo, dr_grpo and
dapo, token-level importance sampling, with the same aggregation and metrics (``kl``, ``entropy``,
``clip_ratio/*``); a test compares loss, advantages and gradients with TRL's on the same
completions and rewards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from memfit.spec import ObjectiveParams, RunSpec
from memfit.step.autocast import autocast_dtype
from memfit.step.batch import PADDED, collate
from memfit.step.labels import IGNORE_INDEX
from memfit.step.losses import Batch, _model_inputs, _wide, backbone_and_head, chunked_token_logps
from memfit.step.preference import _per_sequence, _shift, reference_model, summarize_metrics as summarize_pair_metrics
from memfit.step.vision_forward import model_forward

#: What a grpo step reports from its loss, under TRL's names: each the mean over the step's
#: micro-batches of the micro-batch's value (``kl`` only with ``beta`` above 0).
STEP_METRICS = (
    "kl",
    "entropy",
    "clip_ratio/low_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_mean",
    "clip_ratio/high_max",
    "clip_ratio/region_mean",
)

#: TRL's floor under a group's reward standard deviation when advantages are scaled by it.
STD_FLOOR = 1e-4


# ------------------------------------------------------------------------------------------------
# Completions as the step takes them


def completion_example(
    prompt_ids: Sequence[int],
    completion_ids: Sequence[int],
    advantage: float,
    *,
    generation_tokens: int,
    old_logps: Sequence[float] | None = None,
) -> dict[str, Any]:
    """One completion as a training example: ``input_ids`` (prompt, then completion), ``labels``
    (-100 on the prompt), its ``advantage``, the completion tokens of its whole generation batch
    (dapo's normalizer) and, with ``num_iterations`` above 1, ``old_logps``: one value per position,
    the log-prob of the token that follows it (0 on the prompt), as the step's log-probs are laid out."""
    ids = [int(t) for t in prompt_ids] + [int(t) for t in completion_ids]
    example: dict[str, Any] = {
        "input_ids": ids,
        "labels": [IGNORE_INDEX] * len(prompt_ids) + ids[len(prompt_ids) :],
        "advantage": float(advantage),
        "generation_tokens": int(generation_tokens),
    }
    if old_logps is not None:
        example["old_logps"] = [float(v) for v in old_logps]
    return example


def collate_completions(
    examples: Sequence[dict[str, Any]], pad_token_id: int, *, layout: str = PADDED
) -> dict[str, Any]:
    """One micro-batch of completions (:func:`completion_example`) in ``layout``
    (:func:`memfit.step.batch.collate`), with ``advantages`` (``[completions]`` fp32),
    ``generation_tokens`` and, when every example carries them, ``old_logps`` (``[tokens]`` fp32,
    laid out as the tokens are)."""
    if not examples:
        raise ValueError("collate_completions got an empty batch")
    batch = collate(
        [{"input_ids": e["input_ids"], "labels": e["labels"]} for e in examples], pad_token_id, layout=layout
    )
    batch["advantages"] = torch.tensor([float(e["advantage"]) for e in examples], dtype=torch.float32)
    batch["generation_tokens"] = int(examples[0]["generation_tokens"])
    if all("old_logps" in e for e in examples):
        rows = [torch.tensor(e["old_logps"], dtype=torch.float32) for e in examples]
        if layout == PADDED:
            longest = batch["input_ids"].shape[1]
            batch["old_logps"] = torch.stack([F.pad(r, (0, longest - r.shape[0])) for r in rows]).reshape(-1)
        else:
            batch["old_logps"] = torch.cat(rows)
    return batch


def per_example(values: torch.Tensor, batch: Batch) -> list[list[float]]:
    """Dense ``[tokens]`` values of a collated micro-batch back into one list per example, one value
    per position of its ``input_ids`` (how :func:`completion_example` keeps ``old_logps``)."""
    documents = batch.get("documents")
    if documents is not None:
        return [part.tolist() for part in values.split(list(documents.lengths))]
    rows, seq = batch["input_ids"].shape
    mask = batch.get("attention_mask")
    lengths = mask.sum(1).tolist() if mask is not None else [seq] * rows
    return [row[: int(n)].tolist() for row, n in zip(values.reshape(rows, seq), lengths)]


def longest_completions(spec: RunSpec, layout: str) -> list[dict[str, Any]]:
    """The micro-batch a plan simulates: ``batch_size`` completions of ``max_completion_length``
    tokens after prompts of the rest of ``seq_len``. In padded rows the last completion is a token
    shorter, so that the batch carries the padding mask that completions of unequal lengths do. With
    ``num_iterations`` above 1 each carries its old log-probs, as the trainer's do."""
    prompt, completion = spec.prompt_budget, spec.max_completion_length
    examples = []
    for index in range(spec.batch_size):
        length = (
            completion - 1 if layout == PADDED and index == spec.batch_size - 1 and spec.batch_size > 1 else completion
        )
        old = [0.0] * (prompt + length) if spec.num_iterations > 1 else None
        examples.append(
            completion_example(
                [0] * prompt, [0] * length, 0.0, generation_tokens=spec.generation_batch * completion, old_logps=old
            )
        )
    return examples


# ------------------------------------------------------------------------------------------------
# Advantages


def nanstd(values: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The standard deviation of ``values`` ignoring NaNs, with Bessel's correction (TRL's ``nanstd``)."""
    keep = dim is not None
    mean = torch.nanmean(values, dim=dim, keepdim=True) if keep else torch.nanmean(values)
    variance = (
        torch.nanmean((values - mean) ** 2, dim=dim, keepdim=True) if keep else torch.nanmean((values - mean) ** 2)
    )
    count = torch.sum(~torch.isnan(values), dim=dim, keepdim=True) if keep else torch.sum(~torch.isnan(values))
    count = count.to(values.dtype)
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(count, float("nan")))
    std = torch.sqrt(variance * correction)
    return std.squeeze(dim) if keep else std


@dataclass(frozen=True)
class Advantages:
    """What the rewards of a generation batch make: each completion's ``advantages`` and
    ``rewards`` (the weighted sum of its reward functions'), and whether its group's rewards were all
    equal (``zero_std``, for ``frac_reward_zero_std``)."""

    advantages: torch.Tensor  # [completions]
    rewards: torch.Tensor  # [completions], NaN where no reward function scored it
    zero_std: torch.Tensor  # [completions], bool


def group_advantages(
    rewards_per_func: torch.Tensor, weights: Sequence[float], num_generations: int, scale_rewards: str
) -> Advantages:
    """TRL's advantages (``multi_objective_aggregation="sum_then_normalize"``): the weighted sum of
    each completion's rewards (``[completions, functions]``, NaN where a function returned None),
    less its group's mean, divided by the group's (``group``) or the batch's (``batch``) standard
    deviation plus :data:`STD_FLOOR`, or not (``none``); a completion no function scored gets 0."""
    weight = torch.tensor(list(weights), dtype=rewards_per_func.dtype)
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    rewards = (rewards_per_func * weight.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable] = torch.nan
    grouped = rewards.view(-1, num_generations)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)
    if scale_rewards == "batch":
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    else:
        std = nanstd(grouped, dim=1).repeat_interleave(num_generations)
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + STD_FLOOR)
    zero_std = torch.isclose(std, torch.zeros_like(std))
    return Advantages(advantages=torch.nan_to_num(advantages, nan=0.0), rewards=rewards, zero_std=zero_std)


# ------------------------------------------------------------------------------------------------
# Per-token log-probs


def token_logps(
    model: torch.nn.Module, batch: Batch, *, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[tokens]`` log-probs of every completion token of ``batch`` under ``model`` at
    ``temperature`` (0 elsewhere), laid out as the batch's positions (position ``t`` scores the token
    at ``t + 1``); with ``with_entropy`` also each position's entropy (no gradient). The fused chunked
    path where the model's head allows it, else the model's own logits."""
    targets = _shift(batch["labels"]).reshape(-1)
    parts = backbone_and_head(model)
    if parts is None:
        return _logps_from_model_logits(model, batch, targets, temperature, with_entropy)
    backbone, head = parts
    hidden = backbone(**_model_inputs(batch), use_cache=False).last_hidden_state
    out = chunked_token_logps(hidden, head.weight, targets, temperature=temperature, with_entropy=with_entropy)
    return out if with_entropy else (out, None)


def _logps_from_model_logits(
    model: torch.nn.Module, batch: Batch, targets: torch.Tensor, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The plain path (soft-capped or scaled heads): the model's whole logits, upcast to fp32 and
    divided by ``temperature``, then the log-softmax."""
    outputs = model_forward(model, _model_inputs(batch), use_cache=False)
    logits = _wide(outputs.logits).reshape(targets.shape[0], -1) / temperature
    log_probs = logits.log_softmax(-1)
    valid = targets != IGNORE_INDEX
    picked = log_probs.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1) * valid
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = -(log_probs.exp() * log_probs).sum(-1) * valid
    return picked, entropy


# ------------------------------------------------------------------------------------------------
# The loss


def _rows_of(values: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Per-completion ``values`` (``[completions]``) spread over the batch's positions (``[tokens]``)."""
    documents = batch.get("documents")
    if documents is not None:
        lengths = torch.tensor(documents.lengths, device=values.device)
        return torch.repeat_interleave(values, lengths, output_size=documents.total)
    rows, seq = batch["input_ids"].shape
    return values.unsqueeze(1).expand(rows, seq).reshape(-1)


def grpo_loss(
    params: ObjectiveParams,
    logps: torch.Tensor,
    batch: Batch,
    *,
    entropy: torch.Tensor | None = None,
    ref: torch.Tensor | None = None,
    grad_accum: int = 1,
    max_completion_length: int = 1,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The micro-batch's loss as memfit's step takes it (its share of the step: the step divides it
    by ``grad_accum``), and its metrics (TRL's names, each the micro-batch's value; ``micro_batches``
    counts 1).

    TRL's ``_compute_loss``: the ratio to the old policy's log-probs (the batch's ``old_logps``, else
    the log-probs themselves, detached: a ratio of 1) clipped to ``[1 - epsilon, 1 + epsilon_high]``,
    ``-min(ratio x A, clipped x A)`` per token, plus ``beta`` x the k3 estimate of the KL to the
    reference times the ratio (TRL's default ``use_bias_correction_kl``); aggregated by ``loss_type``: grpo (each completion's token mean, then their mean),
    bnpo (the micro-batch's token mean), dr_grpo (over completions x ``max_completion_length``), dapo
    (over the generation batch's completion tokens, shared by its ``grad_accum`` micro-batches)."""
    mask = (_shift(batch["labels"]).reshape(-1) != IGNORE_INDEX).to(logps.dtype)
    advantages = _rows_of(batch["advantages"].to(logps.dtype), batch)
    old = batch.get("old_logps")
    old = logps.detach() if old is None else old.to(logps.dtype)
    coef_1 = torch.exp(logps - old)
    coef_2 = torch.clamp(coef_1, 1 - params.epsilon, 1 + params.clip_high)
    per_token = -torch.min(coef_1 * advantages, coef_2 * advantages)
    kl = None
    if params.beta != 0.0:
        if ref is None:
            raise ValueError("grpo with beta above 0: the batch carries no reference log-probs (ref_logps)")
        ref = ref.to(logps.dtype)
        # TRL's default use_bias_correction_kl: the KL times the ratio (1 in value on-policy, not in
        # gradient), which makes its gradient the unbiased reverse-KL gradient.
        kl = (torch.exp(ref - logps) - (ref - logps) - 1) * coef_1
        per_token = per_token + params.beta * kl
    loss = _aggregate(
        params.loss_type,
        per_token * mask,
        mask,
        batch,
        grad_accum=grad_accum,
        max_completion_length=max_completion_length,
    )
    return loss, _metrics(
        coef_1.detach(), advantages, mask, batch, params, entropy=entropy, kl=None if kl is None else kl.detach()
    )


def _aggregate(
    loss_type: str,
    losses: torch.Tensor,
    mask: torch.Tensor,
    batch: Batch,
    *,
    grad_accum: int,
    max_completion_length: int,
) -> torch.Tensor:
    """The masked per-token ``losses`` reduced as ``loss_type`` says (see :func:`grpo_loss`)."""
    completions = batch["advantages"].shape[0]
    if loss_type == "grpo":
        return (_per_sequence(losses, batch) / _per_sequence(mask, batch).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return losses.sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return losses.sum() / (completions * max_completion_length)
    if loss_type == "dapo":
        # TRL divides each micro-batch by the generation batch's tokens; the step divides by grad_accum.
        return losses.sum() * grad_accum / max(float(batch["generation_tokens"]), 1.0)
    raise ValueError(f"loss_type: {loss_type!r} is not a grpo loss")


def _metrics(
    coef_1: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    batch: Batch,
    params: ObjectiveParams,
    *,
    entropy: torch.Tensor | None,
    kl: torch.Tensor | None,
) -> dict[str, torch.Tensor]:
    """TRL's metrics of one micro-batch: masked token means (``kl``, ``entropy``, the clipped shares),
    and the lowest / highest completion's share clipped below / above."""
    tokens = mask.sum().clamp(min=1.0)

    def mean(x: torch.Tensor) -> torch.Tensor:
        return (x * mask).sum() / tokens

    low = ((coef_1 < 1 - params.epsilon) & (advantages < 0)).to(mask.dtype)
    high = ((coef_1 > 1 + params.clip_high) & (advantages > 0)).to(mask.dtype)
    counts = _per_sequence(mask, batch)
    metrics = {
        "entropy": mean(entropy) if entropy is not None else torch.zeros((), device=mask.device),
        "clip_ratio/low_mean": mean(low),
        "clip_ratio/high_mean": mean(high),
        "clip_ratio/region_mean": mean(torch.maximum(low, high)),
        "clip_ratio/low_min": (_per_sequence(low * mask, batch) / counts).nan_to_num(nan=float("inf")).min(),
        "clip_ratio/high_max": (_per_sequence(high * mask, batch) / counts).nan_to_num(nan=float("-inf")).max(),
        "micro_batches": torch.ones((), dtype=torch.int64, device=mask.device),
    }
    if kl is not None:
        metrics["kl"] = mean(kl)
    return {name: value.detach() for name, value in metrics.items()}


def summarize_metrics(totals: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """A step's grpo metrics from the sums its micro-batches reported (:func:`grpo_loss`): each the
    mean of the micro-batches' values, as TRL's logs average them. One read of the device."""
    return summarize_pair_metrics(totals, count="micro_batches")


@dataclass(frozen=True)
class GRPOLoss:
    """The loss of a grpo step: ``(model, batch) -> (loss, metrics)`` (:func:`grpo_loss`), its
    :meth:`reference_pass` where ``beta`` is above 0, under autocast to ``dtype`` for a mixed precision."""

    params: ObjectiveParams
    reference: str = "none"
    dtype: torch.dtype | None = None
    temperature: float = 1.0
    grad_accum: int = 1
    max_completion_length: int = 1

    @property
    def reference_pass(self):
        """The step's reference pass (batch -> batch with ``ref_logps``), or None without a reference."""
        return self._with_reference if self.reference in ("disabled-adapters", "frozen-copy") else None

    @torch.no_grad()
    def _with_reference(self, model: torch.nn.Module, batch: Batch) -> dict[str, Any]:
        with self._autocast(batch), _reference(model, self.reference) as scorer:
            return {**batch, "ref_logps": token_logps(scorer, batch, temperature=self.temperature)[0]}

    @torch.no_grad()
    def old_logps(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        """``[tokens]`` log-probs of the batch's completions under the policy as it is now, without a
        graph: the old policy's, which ``num_iterations`` above 1 keeps for the steps that follow."""
        with self._autocast(batch):
            return token_logps(model, batch, temperature=self.temperature)[0]

    def __call__(self, model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        with self._autocast(batch):
            logps, entropy = token_logps(model, batch, temperature=self.temperature, with_entropy=True)
        return grpo_loss(
            self.params,
            logps,
            batch,
            entropy=entropy,
            ref=batch.get("ref_logps"),
            grad_accum=self.grad_accum,
            max_completion_length=self.max_completion_length,
        )

    def _autocast(self, batch: Batch):
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=batch["input_ids"].device.type, dtype=self.dtype)


@contextlib.contextmanager
def _reference(model: torch.nn.Module, source: str):
    """The model that scores the reference: ``model`` with its adapters disabled, or its frozen copy."""
    if source == "disabled-adapters":
        with model.disable_adapter():
            yield model
        return
    copy = reference_model(model)
    if copy is None:
        raise RuntimeError(
            "full fine-tuning grpo with beta above 0 needs its frozen reference copy: call "
            "keep_reference_copy(model) before training"
        )
    yield copy


def choose_grpo_loss(spec: RunSpec, params: ObjectiveParams | None = None) -> GRPOLoss:
    """The loss of a grpo ``spec``: its parameters (a plan's: the defaults, beta as the spec says),
    where its reference comes from, the sampling temperature, autocast for a mixed precision."""
    params = params or ObjectiveParams(beta=spec.kl_beta, loss_type="dapo")
    return GRPOLoss(
        params=params,
        reference=spec.reference,
        dtype=autocast_dtype(spec),
        temperature=spec.temperature,
        grad_accum=spec.grad_accum,
        max_completion_length=spec.max_completion_length,
    )
