"""grpo's data: prompts, tokenized as TRL's GRPOTrainer tokenizes them, kept with their other fields.

A prompt of text is tokenized as the tokenizer does by default (its special tokens included, as
TRL's ``processing_class(text=prompts)``); a list of messages is rendered with the chat template and
its generation prompt (:func:`memfit.train.generation.prompt_token_ids`, as TRL's
``apply_chat_template(add_generation_prompt=True)``). A prompt longer than its budget
(``seq_len - max_completion_length``) keeps its last tokens, as TRL's ``max_prompt_length`` cut them
(from the left), and :class:`PromptStats` says how many were cut.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from memfit.json_form import JsonForm


@dataclass
class PromptStats(JsonForm):
    """What tokenizing a grpo run's prompts found: how many, the longest, how many were cut to the budget."""

    prompts: int
    longest: int
    truncated: int
    budget: int

    def to_dict(self) -> dict[str, Any]:
        """What ``run.json`` keeps (``prompts``)."""
        return {"prompts": self.prompts, "longest": self.longest, "truncated": self.truncated, "budget": self.budget}

    def summary(self) -> str:
        cut = (
            (
                f"; {self.truncated} longer than the prompt budget of {self.budget} tokens (seq_len - max_completion_length) "
                "keep their last tokens"
            )
            if self.truncated
            else ""
        )
        return f"{self.prompts} prompts, the longest {self.longest} tokens{cut}"


def tokenize_prompts(
    records: Sequence[dict[str, Any]], tokenizer: Any, budget: int
) -> tuple[list[dict[str, Any]], PromptStats]:
    """The prompt examples of ``records`` (normalized prompt records): ``input_ids`` (at most ``budget``
    tokens), the ``prompt`` as written (the reward functions see it) and its ``columns``."""
    from memfit.train.generation import prompt_token_ids

    examples, longest, truncated = [], 0, 0
    for record in records:
        rollout = record["rollout"]
        prompt = rollout["prompt"]
        ids = prompt_token_ids(tokenizer, prompt) if isinstance(prompt, list) else list(tokenizer(prompt)["input_ids"])
        longest = max(longest, len(ids))
        if len(ids) > budget:
            ids, truncated = ids[-budget:], truncated + 1
        examples.append(
            {"input_ids": ids, "prompt": prompt, "columns": dict(rollout["columns"]), "source": record.get("source")}
        )
    return examples, PromptStats(prompts=len(examples), longest=longest, truncated=truncated, budget=budget)


def is_prompt(example: dict[str, Any]) -> bool:
    """Whether ``example`` is a grpo prompt (not a sequence to train on)."""
    return "prompt" in example and "labels" not in example
