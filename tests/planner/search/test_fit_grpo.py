"""memfit fit of a grpo run: the effective batch counts completions (whole groups), the micro-batch
and checkpointing are searched, and the longest sequence is the longest completion after the prompt."""

from __future__ import annotations

from memfit.planner.search.driver import fit
from memfit.planner.search.request import FitRequest
from memfit.train.conformance import TINY_MODELS

TINY = dict(TINY_MODELS["llama"], _name_or_path="tiny-llama")


def test_a_grpo_fit_searches_the_split_and_the_longest_completion():
    result = fit(
        FitRequest(
            TINY,
            budget="600MiB",
            seq_len=48,
            methods=("lora",),
            workers=1,
            knobs=dict(objective="grpo", num_generations=4, max_completion_length=16),
        )
    )
    assert result.fits
    for found in result.fits:
        spec = found.spec
        assert spec["batch_size"] * spec["grad_accum"] == 4  # the default effective batch: one group of num_generations
        assert {p["name"] for p in found.plan.details["phases"]} == {"generation", "training"}
    longest = result.to_dict()["details"]["max_seq_len_specs"]["lora"]
    # The prompt's budget stays 32 tokens: a longer sequence is a longer completion.
    assert longest["seq_len"] - longest["max_completion_length"] == 32 and longest["max_completion_length"] > 16
