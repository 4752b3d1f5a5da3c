"""grpo's data in the run: each step's completions generated, scored and handed out as micro-batches.

:class:`CompletionBatches` stands where the other objectives' batch order stands (the loop takes a
step's micro-batches from it): before a step that starts a generation batch it draws the step's
prompts (``batch_size x grad_accum / num_generations`` of them, in the data's seeded order), has
:class:`Rollout` sample ``num_generations`` completions of each with the policy
(:mod:`memfit.step.rollout`, the function the planner simulates), score them with the reward
functions (:mod:`memfit.train.rewards`) and turn the rewards into advantages
(:func:`memfit.step.grpo.group_advantages`); the completions, shuffled as TRL shuffles a
generation batch, then make the step's micro-batches, ``num_iterations`` steps in a row. With
``num_iterations`` above 1 the old policy's log-probs are computed once, after generating
(``old_logps``). The memory recorder sees the generation as a phase of its own (``generation``).

The metrics of a generation batch are TRL's: ``reward``, ``reward_std``, ``rewards/<name>/mean`` and
``/std``, ``frac_reward_zero_std``, ``completions/mean_length`` (min, max, and of the completions
that ended: ``mean_terminated_length``...), ``completions/clipped_ratio``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from memfit.step.batch import to_device
from memfit.step.grpo import completion_example, group_advantages, nanstd, per_example
from memfit.step.rollout import Sampling, completion_lists, generate_completion_ids, prompt_batch
from memfit.train.rewards import Reward, score


@dataclass
class Rollout:
    """What makes a generation batch: the run's sampling, reward functions, advantage scaling, the
    tokenizer that decodes completions, the step (its layout, its old log-probs pass), the padding
    and end tokens."""

    sampling: Sampling
    rewards: Sequence[Reward]
    scale_rewards: str
    num_iterations: int
    tokenizer: Any
    step: Any
    pad_id: int
    eos_ids: list[int]
    micro_batch: int

    def __call__(
        self, model: Any, prompts: list[dict[str, Any]], device: torch.device, observer: Any
    ) -> tuple[list, dict]:
        """The completion examples of ``prompts`` (their advantages set) and the generation's metrics."""
        generations = self.sampling.num_generations
        observer.on_phase("generation")
        input_ids, mask = prompt_batch([p["input_ids"] for p in prompts], generations, self.pad_id, device)
        sampled = generate_completion_ids(
            model, input_ids, mask, self.sampling, pad_token_id=self.pad_id, eos_token_ids=self.eos_ids
        )
        del input_ids, mask
        completion_ids = completion_lists(sampled, self.eos_ids)
        del sampled
        rows = [p for p in prompts for _ in range(generations)]
        texts = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        completions = [
            [{"role": "assistant", "content": t}] if isinstance(r["prompt"], list) else t for r, t in zip(rows, texts)
        ]
        keys = sorted({key for r in rows for key in r.get("columns", {})})
        columns = {key: [r.get("columns", {}).get(key) for r in rows] for key in keys}
        per_function = score(self.rewards, [r["prompt"] for r in rows], completions, completion_ids, columns)
        advantages = group_advantages(per_function, [r.weight for r in self.rewards], generations, self.scale_rewards)
        tokens = sum(len(c) for c in completion_ids)
        examples = [
            completion_example(r["input_ids"], c, float(a), generation_tokens=tokens)
            for r, c, a in zip(rows, completion_ids, advantages.advantages)
        ]
        metrics = {**self._reward_metrics(per_function, advantages), **self._length_metrics(completion_ids)}
        del per_function, advantages  # host tensors: none is held while the policy scores the completions
        if self.num_iterations > 1:
            observer.on_phase("old_logps")
            self._old_logps(model, examples, device)
        order = torch.randperm(len(examples)).tolist()  # as TRL shuffles a generation batch (the run's seeded RNG)
        return [examples[i] for i in order], metrics

    def _old_logps(self, model: Any, examples: list[dict[str, Any]], device: torch.device) -> None:
        """The policy's log-probs of each completion now, kept with it (``old_logps``) for the
        ``num_iterations`` steps on this generation batch; a micro-batch at a time, no graph."""
        for start in range(0, len(examples), self.micro_batch):
            part = examples[start : start + self.micro_batch]
            batch = to_device(self.step.collate(part, self.pad_id), device)
            values = self.step.loss_fn.old_logps(model, batch)
            for example, row in zip(part, per_example(values.detach().cpu(), batch)):
                example["old_logps"] = row
            del batch, values

    def _reward_metrics(self, per_function: torch.Tensor, advantages) -> dict[str, float]:
        metrics = {}
        for index, reward in enumerate(self.rewards):
            metrics[f"rewards/{reward.name}/mean"] = float(torch.nanmean(per_function[:, index]))
            metrics[f"rewards/{reward.name}/std"] = float(nanstd(per_function[:, index]))
        metrics["reward"] = float(torch.nanmean(advantages.rewards))
        metrics["reward_std"] = float(nanstd(advantages.rewards))
        metrics["frac_reward_zero_std"] = float(advantages.zero_std.float().mean())
        return metrics

    def _length_metrics(self, completion_ids: list[list[int]]) -> dict[str, float]:
        lengths = [len(c) for c in completion_ids]
        ends = set(self.eos_ids) | {self.pad_id}
        ended = [len(c) for c in completion_ids if c and c[-1] in ends]
        terminated = ended or [0]
        return {
            "completions/mean_length": sum(lengths) / len(lengths),
            "completions/min_length": float(min(lengths)),
            "completions/max_length": float(max(lengths)),
            "completions/clipped_ratio": 1 - len(ended) / len(lengths),
            "completions/mean_terminated_length": sum(terminated) / len(terminated),
            "completions/min_terminated_length": float(min(terminated)),
            "completions/max_terminated_length": float(max(terminated)),
        }


@dataclass
class CompletionBatches:
    """grpo's batch order (see the module docstring): the prompts' seeded order, and the current
    generation batch handed out ``batch_size`` completions at a time."""

    order: Any  # memfit.train.data.BatchIterator over the prompts, a step's prompts a batch
    rollout: Rollout
    batch_size: int  # completions a micro-batch
    num_iterations: int = 1
    grad_accum: int = 1
    buffer: list = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    uses: int = 0
    position: int = 0
    handed_out: int = 0

    @property
    def examples(self) -> list:
        return self.order.examples

    def before_step(self, model: Any, device: torch.device, observer: Any) -> dict[str, float]:
        """Make the next step's completions ready (a new generation batch every ``num_iterations``
        steps); returns the metrics of the generation batch the step trains on."""
        if not self.buffer or self.uses >= self.num_iterations:
            self.buffer, self.metrics = self.rollout(model, next(self.order), device, observer)
            self.uses = 0
        self.uses += 1
        self.position = 0
        return dict(self.metrics)

    def __iter__(self):
        return self

    def __next__(self) -> list[dict[str, Any]]:
        part = self.buffer[self.position : self.position + self.batch_size]
        if not part:
            raise RuntimeError("no completions left in this generation batch: call before_step first")
        self.position += len(part)
        self.handed_out += len(part)
        return part

    def batches_per_epoch(self) -> int:
        """Micro-batches an epoch of prompts makes (each step's prompts, ``num_iterations`` steps each)."""
        return self.order.batches_per_epoch() * self.grad_accum * self.num_iterations

    def epochs_done(self) -> float:
        return self.order.epochs_done()

    def state_dict(self) -> dict[str, Any]:
        """The prompts' order; a resumed run generates anew from there (as TRL regenerates on resume)."""
        return self.order.state_dict()

    def load_state_dict(self, state: dict[str, Any], *, rebatch: bool = False) -> None:
        self.order.load_state_dict(state, rebatch=rebatch)
        self.buffer, self.uses = [], 0


def longest_sequence(micro_batches: Sequence[dict[str, Any]]) -> int:
    """The longest prompt and completion of a step's micro-batches, in tokens."""
    longest = 0
    for batch in micro_batches:
        documents = batch.get("documents")
        if documents is not None:
            longest = max(longest, documents.max_length)
        elif "attention_mask" in batch:
            longest = max(longest, int(batch["attention_mask"].sum(1).max()))
        else:
            longest = max(longest, int(batch["input_ids"].shape[1]))
    return longest


def metric_names(rewards: Sequence[Reward]) -> list[str]:
    """The names a grpo run logs beside the loss (for the report's charts)."""
    return ["reward", "reward_std"] + [f"rewards/{r.name}/mean" for r in rewards]


def prompts_per_step(spec: Any) -> int:
    """The prompts a grpo step draws: its generation batch over ``num_generations``."""
    return spec.generation_batch // spec.num_generations
