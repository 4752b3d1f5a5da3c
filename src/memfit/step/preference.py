"""Preference training (DPO, ORPO, SimPO) in memfit's step: the same memory-lean path as SFT.

A micro-batch of ``batch_size`` pairs is one forward of ``2 x batch_size`` sequences, every chosen
answer first and then every rejected one (as TRL orders them), in the step's layout: padded rows,
or one row with attention kept inside each sequence (:mod:`memfit.step.batch`). Each sequence's
log-probability is the sum of its answer tokens' log-probs, which come from the fused, chunked
path (:class:`memfit.step.losses.ChunkedLinearLogProbs`): no ``[tokens x vocab]`` logits exist
whole, in fp32 or otherwise.

The reference (DPO) never costs a second copy for adapters: LoRA and QLoRA take it from the base
with the adapters disabled (PEFT's ``disable_adapter()``); full fine-tuning keeps a frozen copy of
the starting weights (:func:`keep_reference_copy`: planned in ``weights``) or reads log-probs that
one pass before training computed (``precompute_reference``). The reference pass runs under
``no_grad`` before the policy's forward, so its transients are gone before the policy's activations
exist; :func:`memfit.step.train_step.train_step` names it as its own phase (``reference``).

The ``hf`` recipe (planner only) runs the plain stack's step instead: the policy's whole logits,
upcast to fp32 for the log-softmax, then the reference pass on top of the activations the policy
holds, as TRL's DPOTrainer did before its fused head (and its ORPO and CPO trainers still do).
"""

from __future__ import annotations

import contextlib
import copy
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
from memfit.step.seam import memory_attribute
from memfit.step.vision_forward import model_forward

#: Where a full fine-tuning model keeps its frozen reference copy (not a submodule: it is neither
#: trained, nor saved, nor in ``parameters()``; the memory tracker marks it as weights).
REFERENCE_ATTR = "_memfit_reference"

#: PEFT's switch on its adapter layers and on the wrappers of ``modules_to_save``, which
#: ``disable_adapter()`` flips for the reference pass: with it on, a layer runs its base alone.
ADAPTERS_DISABLED = memory_attribute("_disable_adapters")

#: What a preference step reports, under TRL's metric names: each a mean over the step's pairs.
PAIR_METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)
#: What DPO reports besides (TRL's DPOTrainer): the mean logit over the vocabulary, averaged over the answer tokens.
DPO_METRICS = ("logits/chosen", "logits/rejected")
#: What ORPO reports besides (TRL's ORPOTrainer): ``nll_loss`` and the mean log odds ratio, and its log-sigmoid.
ORPO_METRICS = ("nll_loss", "log_odds_ratio", "log_odds_chosen")


# ------------------------------------------------------------------------------------------------
# Pairs as the step takes them


def pair_sequences(example: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(chosen, rejected) of a pair example: each ``{"input_ids", "labels"}`` (labels -100 on the prompt)."""
    return example["chosen"], example["rejected"]


def is_pair(example: dict[str, Any]) -> bool:
    """Whether ``example`` is a preference pair (``chosen`` and ``rejected`` sequences) rather than one sequence."""
    return "chosen" in example and "rejected" in example


def example_lengths(example: dict[str, Any]) -> list[int]:
    """Token counts of the sequences an example puts in a micro-batch: one, or a pair's two."""
    if is_pair(example):
        return [len(seq["input_ids"]) for seq in pair_sequences(example)]
    return [len(example["input_ids"])]


def collate_pairs(pairs: Sequence[dict[str, Any]], pad_token_id: int, *, layout: str = PADDED) -> dict[str, Any]:
    """One micro-batch of ``pairs``: their ``2 x len(pairs)`` sequences, every chosen one first, in
    ``layout`` (:func:`memfit.step.batch.collate`), with ``pairs`` (the count) and, when the pairs
    carry them, the precomputed reference log-probs ``ref_logps`` (``[2 x pairs]`` fp32, same order)."""
    if not pairs:
        raise ValueError("collate_pairs got an empty batch")
    for row, pair in enumerate(pairs):
        if not is_pair(pair):
            raise ValueError(f"example {row} is not a preference pair (it has no 'chosen' and 'rejected' sequences)")
    sequences = [pair["chosen"] for pair in pairs] + [pair["rejected"] for pair in pairs]
    batch = collate(sequences, pad_token_id, layout=layout)
    batch["pairs"] = len(pairs)
    if all("ref_logps" in pair for pair in pairs):
        values = [float(pair["ref_logps"][0]) for pair in pairs] + [float(pair["ref_logps"][1]) for pair in pairs]
        batch["ref_logps"] = torch.tensor(values, dtype=torch.float32)
    return batch


def longest_pairs(spec: RunSpec, layout: str) -> list[dict[str, Any]]:
    """The micro-batch a plan simulates: ``batch_size`` pairs whose chosen and rejected sequences are
    ``seq_len`` tokens each, the answer taking the second half. In padded rows the last rejected
    sequence is a token shorter, so that the batch carries the padding mask that pairs of unequal
    lengths do (and the model the ``[rows, 1, seq, seq]`` mask it builds from it). With
    ``precompute_reference`` each pair carries its reference log-probs, as the trainer's do."""
    pairs = []
    for index in range(spec.batch_size):
        lengths = [spec.seq_len, spec.seq_len]
        if layout == PADDED and index == spec.batch_size - 1:
            lengths[1] -= 1
        chosen, rejected = (_planned_sequence(n) for n in lengths)
        pair: dict[str, Any] = {"chosen": chosen, "rejected": rejected}
        if spec.reference == "precomputed":
            pair["ref_logps"] = (0.0, 0.0)
        pairs.append(pair)
    return pairs


def _planned_sequence(length: int) -> dict[str, list[int]]:
    prompt = length // 2
    ids = [0] * length
    return {"input_ids": ids, "labels": [IGNORE_INDEX] * prompt + ids[prompt:]}


# ------------------------------------------------------------------------------------------------
# Per-sequence log-probabilities


@dataclass
class SequenceLogps:
    """Per-sequence sums over a micro-batch's ``2 x pairs`` sequences (chosen first): the answer
    tokens' log-probs and their count; with ``all_tokens``, also every token's (prompt included);
    with ``mean_logits``, the answer tokens' mean logits (each the mean over the vocabulary of the
    logits at the position that predicts the token), detached."""

    answer: torch.Tensor  # [sequences], fp32
    answer_tokens: torch.Tensor  # [sequences]
    every: torch.Tensor | None = None
    every_tokens: torch.Tensor | None = None
    logits: torch.Tensor | None = None  # [sequences], fp32


def sequence_logps(
    model: torch.nn.Module,
    batch: Batch,
    *,
    all_tokens: bool = False,
    full_logits: bool = False,
    mean_logits: bool = False,
) -> SequenceLogps:
    """The per-sequence log-probs of ``batch``'s answers under ``model`` (the fused chunked path where
    the model's head allows it; ``full_logits``: the model's own logits, as the plain stack computes them).

    ``all_tokens``: score every token of each sequence (the first and padding excepted), as ORPO's
    NLL term does in TRL, and report the answers' share apart. ``mean_logits``: also sum each
    answer's mean logits (DPO's ``logits/*``), a few small reductions with no graph.
    """
    answer_targets = _shift(batch["labels"])
    targets = _every_token_targets(batch) if all_tokens else answer_targets
    answer_mask = (answer_targets != IGNORE_INDEX).reshape(-1)
    parts = None if full_logits else backbone_and_head(model)
    if parts is None:
        token_logps, token_logits = _logps_from_model_logits(model, batch, targets, mean_logits=mean_logits)
    else:
        backbone, head = parts
        hidden = backbone(**_model_inputs(batch), use_cache=False).last_hidden_state
        token_logps = chunked_token_logps(hidden, head.weight, targets.reshape(-1))
        token_logits = _mean_logits(hidden, head.weight) if mean_logits else None
    logits = _per_sequence(token_logits * answer_mask, batch) if token_logits is not None else None
    if all_tokens:
        every_mask = (targets != IGNORE_INDEX).reshape(-1)
        return SequenceLogps(
            answer=_per_sequence(token_logps * answer_mask, batch),
            answer_tokens=_per_sequence(answer_mask, batch),
            every=_per_sequence(token_logps, batch),
            every_tokens=_per_sequence(every_mask, batch),
            logits=logits,
        )
    return SequenceLogps(
        answer=_per_sequence(token_logps, batch), answer_tokens=_per_sequence(answer_mask, batch), logits=logits
    )


@torch.no_grad()
def _mean_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``[tokens]``: each position's logits averaged over the vocabulary, without the logits: the mean
    of ``hidden @ weight.T`` over the rows of ``weight`` is ``hidden @ mean(weight rows)``, so it
    costs one ``[hidden]`` vector and one ``[tokens]`` product, in the hidden states' dtype (autocast
    off: it would cast a copy of every hidden state)."""
    center = weight.mean(0).to(hidden.dtype)
    with torch.autocast(device_type=hidden.device.type, enabled=False):
        return (hidden.reshape(-1, hidden.shape[-1]) @ center).float()


def _shift(labels: torch.Tensor) -> torch.Tensor:
    """Position ``t`` scores the token at ``t + 1`` (the last position scores none)."""
    return F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)


def _every_token_targets(batch: Batch) -> torch.Tensor:
    """Every next token of each sequence as a target: not padding, not across a sequence's end."""
    targets = _shift(batch["input_ids"])
    mask = batch.get("attention_mask")
    if mask is not None:
        targets = targets.masked_fill(_shift(mask) == 0, IGNORE_INDEX)
    documents = batch.get("documents")
    if documents is not None:
        ends = torch.tensor(documents.lengths, device=targets.device).cumsum(0) - 1
        targets = targets.clone()
        targets[0, ends] = IGNORE_INDEX
    return targets


def _per_sequence(values: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Per-token ``values`` (``[tokens]``) summed over each sequence of the batch, in fp32."""
    values = values.float() if values.dtype != torch.float64 else values
    documents = batch.get("documents")
    if documents is not None:
        return torch.stack([part.sum() for part in values.split(list(documents.lengths))])
    rows = batch["input_ids"].shape[0]
    return values.reshape(rows, -1).sum(1)


def _logps_from_model_logits(
    model: torch.nn.Module, batch: Batch, targets: torch.Tensor, *, mean_logits: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs from the model's whole ``[rows, seq, vocab]`` logits, upcast to fp32 for the
    log-softmax: the plain path (soft-capped or scaled heads; the ``hf`` recipe). With
    ``mean_logits``, also each position's logits averaged over the vocabulary (fp32, detached)."""
    logits = model_forward(model, _model_inputs(batch), use_cache=False).logits
    picked = _wide(logits).log_softmax(-1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    token_logps = (picked * (targets != IGNORE_INDEX)).reshape(-1)
    del picked
    means = logits.detach().mean(-1, dtype=torch.float32).reshape(-1) if mean_logits else None
    return token_logps, means


# ------------------------------------------------------------------------------------------------
# The reference


def keep_reference_copy(model: torch.nn.Module) -> torch.nn.Module:
    """Keep a frozen copy of ``model`` (full fine-tuning's DPO reference), made now, before any
    update: every weight copied once more on the model's device, no gradient, eval mode (no dropout,
    no checkpointing: it runs under ``no_grad``). Returns the copy; :func:`reference_model` finds it."""
    if reference_model(model) is not None:
        return reference_model(model)
    reference = copy.deepcopy(model)
    reference.requires_grad_(False)
    reference.eval()
    model.__dict__[REFERENCE_ATTR] = reference
    return reference


def reference_model(model: torch.nn.Module) -> torch.nn.Module | None:
    """The frozen reference copy :func:`keep_reference_copy` keeps for ``model``, or None."""
    return model.__dict__.get(REFERENCE_ATTR)


def needs_reference_copy(spec: RunSpec) -> bool:
    """Whether a run of ``spec`` keeps a frozen copy of its model (DPO, or grpo with beta above 0, in
    full fine-tuning, the reference not precomputed)."""
    return spec.reference == "frozen-copy"


@torch.no_grad()
def reference_logps(model: torch.nn.Module, batch: Batch, source: str, *, full_logits: bool = False) -> torch.Tensor:
    """``[2 x pairs]`` reference log-probs of the batch's answers: from the base with its adapters
    disabled (``disabled-adapters``), or from the frozen copy (``frozen-copy``). No graph is kept."""
    if source == "disabled-adapters":
        with model.disable_adapter():
            return sequence_logps(model, batch, full_logits=full_logits).answer
    if source == "frozen-copy":
        reference = reference_model(model)
        if reference is None:
            raise RuntimeError(
                "full fine-tuning DPO needs its frozen reference copy: call keep_reference_copy(model) before training"
            )
        return sequence_logps(reference, batch, full_logits=full_logits).answer
    raise ValueError(f"no reference pass for reference source {source!r}")


@torch.no_grad()
def starting_logps(
    model: torch.nn.Module, batch: Batch, *, adapters: bool, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``[2 x pairs]`` log-probs of the batch's answers under the model as training starts (what
    ``precompute_reference`` stores): the base with its adapters disabled, or the model itself (full
    fine-tuning, before any update); under autocast to ``dtype`` when given."""
    autocast = (
        torch.autocast(device_type=batch["input_ids"].device.type, dtype=dtype)
        if dtype is not None
        else contextlib.nullcontext()
    )
    with autocast, model.disable_adapter() if adapters else contextlib.nullcontext():
        return sequence_logps(model, batch).answer


# ------------------------------------------------------------------------------------------------
# The objectives


@dataclass(frozen=True)
class PreferenceLoss:
    """The loss of a preference step: ``(model, batch) -> (loss, metrics)``.

    ``metrics`` holds detached sums over the micro-batch's pairs under TRL's names
    (:data:`PAIR_METRICS`; DPO's :data:`DPO_METRICS`, ORPO's :data:`ORPO_METRICS`, ``nll_loss``
    where the objective has an NLL term) and their count (``pairs``), for :func:`summarize_metrics`. :meth:`reference_pass`, where the objective
    has a reference the step computes, adds ``ref_logps`` to a batch; the training step calls it
    before the policy's forward (memfit's recipe). ``dtype``: the forward runs under autocast to it.
    """

    objective: str
    params: ObjectiveParams
    reference: str = "none"
    dtype: torch.dtype | None = None
    full_logits: bool = False  # the hf recipe: whole logits, and the reference after the policy

    @property
    def reference_pass(self):
        """The step's reference pass (batch -> batch with ``ref_logps``), or None where there is none to run."""
        if self.reference in ("disabled-adapters", "frozen-copy") and not self.full_logits:
            return self._with_reference
        return None

    def _with_reference(self, model: torch.nn.Module, batch: Batch) -> dict[str, Any]:
        with self._autocast(batch):
            return {**batch, "ref_logps": reference_logps(model, batch, self.reference)}

    def __call__(self, model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        with self._autocast(batch):
            logps = sequence_logps(
                model,
                batch,
                all_tokens=self.objective == "orpo",
                full_logits=self.full_logits,
                mean_logits=self.objective == "dpo",
            )
            ref = None
            if self.objective == "dpo":
                ref = batch.get("ref_logps")
                if ref is None and self.reference in ("disabled-adapters", "frozen-copy"):
                    ref = reference_logps(model, batch, self.reference, full_logits=self.full_logits)
                if ref is None:
                    raise ValueError(
                        "dpo with precompute_reference: the batch carries no reference log-probs (ref_logps)"
                    )
        return objective_loss(self.objective, self.params, logps, ref)

    def _autocast(self, batch: Batch):
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=batch["input_ids"].device.type, dtype=self.dtype)


def objective_loss(
    objective: str, params: ObjectiveParams, logps: SequenceLogps, ref: torch.Tensor | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The mean loss over a micro-batch's pairs, and its metrics summed over them (pure tensor arithmetic).

    dpo (TRL DPOTrainer): ``-logsigmoid(beta x margin)`` (sigmoid), ``relu(1 - beta x margin)``
    (hinge), or ``(per-token margin - 1 / (2 beta))^2`` (ipo), the margin being the difference of
    the chosen and rejected log-ratios to the reference; rewards ``beta x log-ratio``; with
    ``logps.logits``, ``logits/chosen`` and ``logits/rejected``.
    orpo (TRL ORPOTrainer): the NLL of the chosen sequences (prompt and answer) minus ``beta x
    logsigmoid(log odds ratio)`` of the answers' per-token log-probs, with ``log_odds_ratio`` and
    ``log_odds_chosen``; simpo (TRL CPOTrainer, ``loss_type="simpo"``): ``-logsigmoid(beta x (chosen
    - rejected per-token log-probs) - gamma)``, plus ``cpo_alpha`` x the chosen answers' NLL. Their
    rewards are ``beta x`` the per-token log-probs.

    A metric TRL computes over the micro-batch as a whole (``nll_loss``, ``logits/*``: means over its
    tokens) enters the sums as its value times the pairs, so that :func:`summarize_metrics` gives the
    mean of the micro-batches' values, as TRL's logs average its batches' values.
    """
    beta = params.beta
    chosen, rejected = logps.answer.chunk(2)
    metrics: dict[str, torch.Tensor] = {}
    if objective == "dpo":
        ref_chosen, ref_rejected = ref.to(chosen.dtype).chunk(2)
        chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
        if params.loss_type == "ipo":
            counts_chosen, counts_rejected = logps.answer_tokens.clamp(min=1).chunk(2)
            losses = (chosen_ratio / counts_chosen - rejected_ratio / counts_rejected - 1 / (2 * beta)) ** 2
        elif params.loss_type == "hinge":
            losses = torch.relu(1 - beta * (chosen_ratio - rejected_ratio))
        else:
            losses = -F.logsigmoid(beta * (chosen_ratio - rejected_ratio))
        loss = losses.mean()
        rewards = (beta * chosen_ratio.detach(), beta * rejected_ratio.detach())
        shown = (chosen.detach(), rejected.detach())
        if logps.logits is not None:
            metrics.update(_answer_logits(logps))
    else:
        counts_chosen, counts_rejected = logps.answer_tokens.clamp(min=1).chunk(2)
        mean_chosen, mean_rejected = chosen / counts_chosen, rejected / counts_rejected
        if objective == "orpo":
            every_chosen, _ = logps.every.chunk(2)
            tokens_chosen, _ = logps.every_tokens.chunk(2)
            nll = -every_chosen.sum() / tokens_chosen.sum().clamp(min=1)
            log_odds = (mean_chosen - mean_rejected) - (_log1mexp(mean_chosen) - _log1mexp(mean_rejected))
            ratio = F.logsigmoid(log_odds)
            loss = nll - (beta * ratio).mean()
            metrics["nll_loss"] = nll.detach() * chosen.shape[0]
            # Under TRL's names: log_odds_ratio is the log-sigmoid of the log odds ratio, log_odds_chosen the ratio itself.
            metrics["log_odds_ratio"], metrics["log_odds_chosen"] = ratio.detach(), log_odds.detach()
        elif objective == "simpo":
            logits = (mean_chosen - mean_rejected) - params.simpo_gamma / beta
            loss = (-F.logsigmoid(beta * logits)).mean()
            if params.cpo_alpha > 0:
                nll = -chosen.sum() / counts_chosen.sum()
                loss = loss + params.cpo_alpha * nll
                metrics["nll_loss"] = nll.detach() * chosen.shape[0]
        else:
            raise ValueError(f"objective: {objective!r} is not a preference objective")
        rewards = (beta * mean_chosen.detach(), beta * mean_rejected.detach())
        shown = (mean_chosen.detach(), mean_rejected.detach())
    return loss, {
        "rewards/chosen": rewards[0].sum(),
        "rewards/rejected": rewards[1].sum(),
        "rewards/accuracies": (rewards[0] > rewards[1]).sum(),
        "rewards/margins": (rewards[0] - rewards[1]).sum(),
        "logps/chosen": shown[0].sum(),
        "logps/rejected": shown[1].sum(),
        **{name: value.sum() for name, value in metrics.items()},
        "pairs": torch.full((), chosen.shape[0], dtype=torch.int64, device=chosen.device),
    }


def _answer_logits(logps: SequenceLogps) -> dict[str, torch.Tensor]:
    """``logits/chosen`` and ``logits/rejected`` as :func:`objective_loss` sums them: the micro-batch's
    mean logit over its chosen (rejected) answer tokens, as TRL's DPOTrainer logs it, times the pairs."""
    sums, tokens = logps.logits.chunk(2), logps.answer_tokens.chunk(2)
    pairs = sums[0].shape[0]
    return {
        f"logits/{side}": total.sum() / count.sum().clamp(min=1) * pairs
        for side, total, count in zip(("chosen", "rejected"), sums, tokens)
    }


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, stable on both sides of ``-log 2`` (as TRL computes it)."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def summarize_metrics(totals: list[dict[str, torch.Tensor]], count: str = "pairs") -> dict[str, float]:
    """A step's (or an evaluation's) preference metrics, each a mean over its pairs, from the sums its
    micro-batches reported (:func:`objective_loss`): :data:`PAIR_METRICS`, ``rewards/accuracies``
    being the share of pairs whose chosen reward is the higher and ``rewards/margins`` chosen minus
    rejected reward; then DPO's :data:`DPO_METRICS`, ORPO's :data:`ORPO_METRICS`, or SimPO's
    ``nll_loss`` (with ``cpo_alpha``). One read of the device for all of them. ``count``: the total
    every sum is divided by (grpo's metrics are means over micro-batches: ``micro_batches``)."""
    if not totals:
        return {}
    names = [name for name in totals[0] if name != count]
    stacked = torch.stack([sum(t[name].double() for t in totals) for name in names + [count]]).cpu()
    total = float(stacked[-1])
    return {name: float(value) / total for name, value in zip(names, stacked[:-1])}


def choose_preference_loss(spec: RunSpec, params: ObjectiveParams | None = None) -> PreferenceLoss:
    """The loss of a preference ``spec``: its objective, where its reference comes from, autocast for
    a mixed precision, and the plain stack's whole logits for the ``hf`` recipe."""
    return PreferenceLoss(
        objective=spec.objective,
        params=params or ObjectiveParams(),
        reference=spec.reference,
        dtype=autocast_dtype(spec),
        full_logits=spec.recipe == "hf",
    )
