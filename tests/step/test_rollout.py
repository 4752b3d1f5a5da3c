"""grpo's generation as the run does it: prompts repeated and left-padded, completions cut after
their end token, the model in generation mode while it samples."""

from __future__ import annotations

import torch

from memfit.step.rollout import Sampling, completion_lists, generate_completion_ids, prompt_batch


def test_each_prompt_is_repeated_and_left_padded():
    input_ids, mask = prompt_batch([[5, 6, 7], [8]], 2, pad_token_id=0)
    assert input_ids.tolist() == [[5, 6, 7], [5, 6, 7], [0, 0, 8], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [1, 1, 1], [0, 0, 1], [0, 0, 1]]


def test_a_completion_keeps_its_first_end_token_and_nothing_after():
    assert completion_lists(torch.tensor([[4, 1, 2, 2], [4, 5, 6, 7], [3, 9, 1, 2]]), [1, 9]) == [
        [4, 1],
        [4, 5, 6, 7],
        [3, 9],
    ]


def test_the_policy_samples_completions_and_goes_back_to_training(tiny_llama):
    from transformers import AutoModelForCausalLM

    from memfit.models.build import make_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(make_config(tiny_llama))
    model.train()
    input_ids, mask = prompt_batch([[5, 6, 7], [8, 9]], 3, pad_token_id=2)
    out = generate_completion_ids(
        model,
        input_ids,
        mask,
        Sampling(num_generations=3, max_completion_length=5, top_p=0.9),
        pad_token_id=2,
        eos_token_ids=[1],
    )
    assert out.shape[0] == 6 and 1 <= out.shape[1] <= 5
    assert model.training
