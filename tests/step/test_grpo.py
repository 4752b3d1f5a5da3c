"""grpo's micro-batches: completions with their advantages and old log-probs, laid out as the step
takes them (padded rows, or one row), and back; the micro-batch a plan simulates."""

from __future__ import annotations

import pytest
import torch

from memfit.spec import make_spec
from memfit.step.batch import DOCUMENTS, PADDED
from memfit.step.grpo import (
    collate_completions,
    completion_example,
    longest_completions,
    per_example,
    summarize_metrics,
)
from memfit.step.labels import IGNORE_INDEX


def _examples():
    return [
        completion_example([5, 6, 7], [8, 9], 1.5, generation_tokens=5, old_logps=[0.0, 0.0, -1.0, -2.0, 0.0]),
        completion_example([5], [8, 9, 10], -0.5, generation_tokens=5, old_logps=[-3.0, -4.0, -5.0, 0.0]),
    ]


def test_a_completion_is_its_prompt_then_its_tokens_labelled():
    example = _examples()[0]
    assert example["input_ids"] == [5, 6, 7, 8, 9]
    assert example["labels"] == [IGNORE_INDEX] * 3 + [8, 9]


@pytest.mark.parametrize("layout", [PADDED, DOCUMENTS])
def test_collated_values_come_back_per_example(layout):
    examples = _examples()
    batch = collate_completions(examples, pad_token_id=2, layout=layout)
    assert batch["advantages"].tolist() == [1.5, -0.5] and batch["generation_tokens"] == 5
    assert batch["old_logps"].shape[0] == batch["input_ids"].numel()
    assert per_example(batch["old_logps"], batch) == [e["old_logps"] for e in examples]


def test_the_planned_micro_batch_holds_the_longest_completions():
    spec = make_spec(
        objective="grpo", num_generations=2, batch_size=4, seq_len=40, max_completion_length=16, num_iterations=2
    )
    planned = longest_completions(spec, PADDED)
    assert [len(e["input_ids"]) for e in planned] == [40, 40, 40, 39]
    assert all(e["labels"][:24] == [IGNORE_INDEX] * 24 and len(e["old_logps"]) == len(e["input_ids"]) for e in planned)
    assert [len(e["input_ids"]) for e in longest_completions(spec, DOCUMENTS)] == [40] * 4


def test_metrics_are_the_mean_of_the_micro_batches():
    one = {"entropy": torch.tensor(2.0), "micro_batches": torch.tensor(1)}
    two = {"entropy": torch.tensor(4.0), "micro_batches": torch.tensor(1)}
    assert summarize_metrics([one, two]) == {"entropy": 3.0}
