"""Evaluation: the eval loss and, for a preference objective, its metrics under TRL's eval_ names."""

from __future__ import annotations

import pytest
import torch

from memfit.models.build import make_config
from memfit.spec import ObjectiveParams, make_spec
from memfit.step.builder import build_step
from memfit.step.labels import IGNORE_INDEX
from memfit.step.preference import summarize_metrics
from memfit.train.evaluation import evaluate, evaluation_metrics

CPU = torch.device("cpu")


def _pair(prompt, chosen, rejected):
    def seq(answer):
        return {"input_ids": prompt + answer, "labels": [IGNORE_INDEX] * len(prompt) + answer}

    return {"chosen": seq(chosen), "rejected": seq(rejected)}


PAIRS = [
    _pair([5, 6, 7], [8, 9], [10]),
    _pair([11, 12], [13, 14, 15], [16, 17]),
    _pair([3], [4, 5, 6, 7], [8]),
    _pair([9, 10, 11], [12], [13, 14]),
]


def _model(tiny_llama):
    from transformers import AutoModelForCausalLM

    from memfit.step.prepare import attach_lora

    torch.manual_seed(0)
    model = attach_lora(
        AutoModelForCausalLM.from_config(make_config(tiny_llama), dtype=torch.float32),
        make_spec(method="lora", rank=4, precision="fp32"),
    )
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # adapters away from zero: the policy is not its reference
        for name, p in sorted(model.named_parameters()):
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
    return model


@pytest.mark.parametrize(
    "objective, extra",
    [("dpo", ["logits/chosen", "logits/rejected"]), ("orpo", ["nll_loss", "log_odds_ratio", "log_odds_chosen"])],
)
def test_preference_evaluation_gives_the_steps_metrics_over_every_pair_under_eval_names(tiny_llama, objective, extra):
    step = build_step(
        make_spec(method="lora", rank=4, precision="fp32", objective=objective, padding_free="off"),
        make_config(tiny_llama),
        ObjectiveParams(beta=0.2),
    )
    model = _model(tiny_llama).train()

    def collate(examples):
        return step.collate(examples, 0)

    got = evaluation_metrics(model, PAIRS, 2, collate, CPU, step.loss_and_metrics)  # two batches of two pairs
    assert model.training  # put back as it was
    with torch.no_grad():
        model.eval()
        halves = [step.loss_and_metrics(model, collate(PAIRS[i : i + 2])) for i in (0, 2)]
    want = summarize_metrics([metrics for _, metrics in halves])
    names = [
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
    ]
    assert list(got) == ["eval_loss"] + [f"eval_{name}" for name in names + extra]
    for name, value in want.items():
        assert got[f"eval_{name}"] == pytest.approx(value, rel=1e-12), name
    assert got["eval_loss"] == pytest.approx(sum(float(loss) for loss, _ in halves) / 2, rel=1e-6)
    assert evaluate(model, PAIRS, 2, collate, CPU, step.loss) == got["eval_loss"]


def test_a_next_token_evaluation_gives_the_eval_loss_alone(tiny_llama):
    step = build_step(make_spec(method="lora", rank=4, precision="fp32"), make_config(tiny_llama))
    examples = [pair["chosen"] for pair in PAIRS]
    got = evaluation_metrics(
        _model(tiny_llama), examples, 2, lambda batch: step.collate(batch, 0), CPU, step.loss_and_metrics
    )
    assert list(got) == ["eval_loss"] and got["eval_loss"] > 0
