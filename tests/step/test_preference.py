"""memfit's preference step: chunked per-token log-probs, pairs in one forward, the reference, the losses."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from memfit.models.build import build_meta_model, make_config
from memfit.spec import ObjectiveParams, make_spec
from memfit.step.batch import DOCUMENTS, PADDED
from memfit.step.labels import IGNORE_INDEX
from memfit.step.losses import chunked_token_logps
from memfit.step.preference import (
    SequenceLogps,
    collate_pairs,
    keep_reference_copy,
    longest_pairs,
    objective_loss,
    reference_logps,
    reference_model,
    sequence_logps,
    summarize_metrics,
)


def _reference_token_logps(hidden, weight, targets):
    logits = hidden.reshape(-1, hidden.shape[-1]) @ weight.t()
    logits = logits if logits.dtype == torch.float64 else logits.float()
    picked = logits.log_softmax(-1).gather(1, targets.clamp(min=0).unsqueeze(1)).squeeze(1)
    return picked * (targets != IGNORE_INDEX)


@pytest.mark.parametrize("chunk", [1, 5, 1000])
@pytest.mark.parametrize("train_head", [False, True])
def test_chunked_token_logps_and_gradients_equal_the_log_softmax(chunk, train_head):
    torch.manual_seed(0)
    hidden = torch.randn(2, 9, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(40, 16, dtype=torch.float64, requires_grad=train_head)
    targets = torch.randint(0, 40, (18,))
    targets[[0, 3, 17]] = IGNORE_INDEX
    upstream = torch.randn(18, dtype=torch.float64)
    ours = chunked_token_logps(hidden, weight, targets, chunk=chunk)
    (ours * upstream).sum().backward()
    got = (hidden.grad.clone(), weight.grad.clone() if train_head else None)
    hidden.grad = weight.grad = None
    ref = _reference_token_logps(hidden, weight, targets)
    (ref * upstream).sum().backward()
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[0], hidden.grad, rtol=1e-10, atol=1e-12)
    if train_head:
        torch.testing.assert_close(got[1], weight.grad, rtol=1e-10, atol=1e-12)
    assert ours[[0, 3, 17]].abs().sum() == 0  # no target: no log-prob


def _pair(prompt, chosen, rejected):
    def seq(answer):
        return {"input_ids": prompt + answer, "labels": [IGNORE_INDEX] * len(prompt) + answer}

    return {"chosen": seq(chosen), "rejected": seq(rejected)}


PAIRS = [_pair([5, 6, 7], [8, 9], [10]), _pair([11, 12], [13, 14, 15], [16, 17])]


def test_pairs_collate_chosen_first_padded_and_in_one_row():
    padded = collate_pairs(PAIRS, pad_token_id=0, layout=PADDED)
    assert padded["pairs"] == 2
    assert padded["input_ids"].tolist() == [
        [5, 6, 7, 8, 9],
        [11, 12, 13, 14, 15],
        [5, 6, 7, 10, 0],
        [11, 12, 16, 17, 0],
    ]
    assert padded["attention_mask"].tolist()[2] == [1, 1, 1, 1, 0]
    row = collate_pairs(PAIRS, pad_token_id=0, layout=DOCUMENTS)
    assert row["documents"].lengths == (5, 5, 4, 4)
    assert row["input_ids"].shape == (1, 18)
    with_reference = collate_pairs([dict(PAIRS[0], ref_logps=(-1.5, -2.5)), dict(PAIRS[1], ref_logps=(-3.0, -4.0))], 0)
    assert with_reference["ref_logps"].tolist() == [-1.5, -3.0, -2.5, -4.0]
    with pytest.raises(ValueError, match="not a preference pair"):
        collate_pairs([{"input_ids": [1], "labels": [1]}], 0)


def _tiny_model(config, dtype=torch.float64):
    from memfit.models.build import materialize

    torch.manual_seed(0)
    model = materialize(build_meta_model(make_config(config), dtype), "cpu", random_values=True)
    return model.eval()


def test_sequence_logps_are_the_same_padded_and_in_one_row(tiny_llama):
    from memfit.step.attention import use_document_attention

    model = _tiny_model(tiny_llama)
    padded = sequence_logps(model, collate_pairs(PAIRS, 0, layout=PADDED))
    # The whole logits' log-softmax gives the same answers' log-probs.
    full = sequence_logps(model, collate_pairs(PAIRS, 0, layout=PADDED), full_logits=True)
    torch.testing.assert_close(padded.answer, full.answer, rtol=1e-10, atol=1e-10)
    use_document_attention(model)
    row = sequence_logps(model, collate_pairs(PAIRS, 0, layout=DOCUMENTS), all_tokens=True)
    torch.testing.assert_close(padded.answer, row.answer, rtol=1e-10, atol=1e-10)
    assert padded.answer_tokens.tolist() == [2, 3, 1, 2]
    # Every token but each sequence's first is scored with all_tokens (ORPO's NLL, as TRL's).
    assert row.every_tokens.tolist() == [4, 4, 3, 3]
    assert padded.logits is None and row.logits is None  # asked for only (DPO's logits/*)


def test_answer_mean_logits_are_the_whole_logits_averaged_over_the_answers(tiny_llama):
    from memfit.step.attention import use_document_attention

    model = _tiny_model(tiny_llama)
    batch = collate_pairs(PAIRS, 0, layout=PADDED)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    # Position t predicts token t + 1: the positions before each answer token, summed per sequence.
    answer = torch.nn.functional.pad(batch["labels"][:, 1:], (0, 1), value=IGNORE_INDEX) != IGNORE_INDEX
    want = (logits.mean(-1) * answer).sum(1)
    padded = sequence_logps(model, batch, mean_logits=True)
    full = sequence_logps(model, batch, full_logits=True, mean_logits=True)
    use_document_attention(model)
    row = sequence_logps(model, collate_pairs(PAIRS, 0, layout=DOCUMENTS), mean_logits=True)
    for got in (padded, full, row):
        torch.testing.assert_close(got.logits, want.float(), rtol=1e-6, atol=1e-7)
        assert not got.logits.requires_grad


def _logps(chosen, rejected, counts=(1.0, 1.0, 1.0, 1.0), every=None, every_tokens=None):
    answer = torch.tensor(chosen + rejected, dtype=torch.float64)
    return SequenceLogps(
        answer=answer,
        answer_tokens=torch.tensor(counts, dtype=torch.float64),
        every=None if every is None else torch.tensor(every, dtype=torch.float64),
        every_tokens=None if every_tokens is None else torch.tensor(every_tokens, dtype=torch.float64),
    )


def test_dpo_losses_as_trl_writes_them():
    logps = _logps([-2.0, -3.0], [-4.0, -1.0], counts=(2.0, 4.0, 1.0, 2.0))
    ref = torch.tensor([-2.5, -3.0, -3.0, -2.0], dtype=torch.float64)
    beta = 0.2
    chosen_ratio = torch.tensor([0.5, 0.0])
    rejected_ratio = torch.tensor([-1.0, 1.0])
    margin = chosen_ratio - rejected_ratio
    loss, metrics = objective_loss("dpo", ObjectiveParams(beta=beta), logps, ref)
    assert loss.item() == pytest.approx(float(-F.logsigmoid(beta * margin).mean()))
    assert metrics["rewards/chosen"].item() == pytest.approx(0.1)  # summed over the pairs
    assert metrics["logps/rejected"].item() == -5.0 and metrics["pairs"].item() == 2
    hinge, _ = objective_loss("dpo", ObjectiveParams(beta=beta, loss_type="hinge"), logps, ref)
    assert hinge.item() == pytest.approx(float(torch.relu(1 - beta * margin).mean()))
    ipo, _ = objective_loss("dpo", ObjectiveParams(beta=beta, loss_type="ipo"), logps, ref)
    per_token = chosen_ratio / torch.tensor([2.0, 4.0]) - rejected_ratio / torch.tensor([1.0, 2.0])
    assert ipo.item() == pytest.approx(float(((per_token - 1 / (2 * beta)) ** 2).mean()))
    summary = summarize_metrics([metrics])
    assert summary["rewards/accuracies"] == 0.5  # pair 1 prefers chosen (0.1 > -0.2), pair 2 not (0 < 0.2)
    assert summary["rewards/margins"] == pytest.approx(float(beta * margin.mean()))
    assert not any(name.startswith("logits/") for name in summary)  # no mean logits were given


def test_dpo_mean_logits_are_a_mean_over_answer_tokens_and_micro_batches_average_as_trls_batches():
    ref = torch.zeros(4, dtype=torch.float64)
    first = _logps([-2.0, -3.0], [-4.0, -1.0], counts=(2.0, 4.0, 1.0, 2.0))
    first.logits = torch.tensor([0.2, 0.4, -0.3, 0.3], dtype=torch.float64)  # sums over each answer
    _, one = objective_loss("dpo", ObjectiveParams(), first, ref)
    assert summarize_metrics([one])["logits/chosen"] == pytest.approx(0.6 / 6)  # 6 chosen tokens in all
    assert summarize_metrics([one])["logits/rejected"] == pytest.approx(0.0 / 3)
    second = _logps([-1.0, -1.0], [-1.0, -1.0], counts=(1.0, 1.0, 1.0, 1.0))
    second.logits = torch.tensor([1.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    _, two = objective_loss("dpo", ObjectiveParams(), second, ref)
    # Two micro-batches of two pairs: the mean of their values, as TRL averages its batches' values.
    assert summarize_metrics([one, two])["logits/chosen"] == pytest.approx((0.1 + 1.0) / 2)


def test_orpo_and_simpo_losses():
    logps = _logps(
        [-2.0, -3.0],
        [-4.0, -1.0],
        counts=(2.0, 3.0, 2.0, 1.0),
        every=[-5.0, -6.0, -7.0, -2.0],
        every_tokens=[4.0, 5.0, 4.0, 2.0],
    )
    mean_c, mean_r = torch.tensor([-1.0, -1.0]), torch.tensor([-2.0, -1.0])
    orpo, metrics = objective_loss("orpo", ObjectiveParams(beta=0.1), logps)
    log_odds = (mean_c - mean_r) - (torch.log1p(-torch.exp(mean_c)) - torch.log1p(-torch.exp(mean_r)))
    nll = 11.0 / 9.0
    assert orpo.item() == pytest.approx(float(nll - 0.1 * F.logsigmoid(log_odds).mean()))
    summary = summarize_metrics([metrics])
    assert summary["nll_loss"] == pytest.approx(nll)
    # TRL's names: log_odds_chosen is the mean log odds ratio, log_odds_ratio the mean of its log-sigmoid.
    assert summary["log_odds_chosen"] == pytest.approx(float(log_odds.mean()))
    assert summary["log_odds_ratio"] == pytest.approx(float(F.logsigmoid(log_odds).mean()))
    simpo, metrics = objective_loss("simpo", ObjectiveParams(beta=2.0, simpo_gamma=0.5), logps)
    assert simpo.item() == pytest.approx(float(-F.logsigmoid(2.0 * ((mean_c - mean_r) - 0.25)).mean()))
    assert "nll_loss" not in metrics and summarize_metrics([metrics])["rewards/chosen"] == -2.0
    assert "log_odds_ratio" not in metrics
    cpo, _ = objective_loss("simpo", ObjectiveParams(beta=2.0, simpo_gamma=0.5, cpo_alpha=1.0), logps)
    assert cpo.item() == pytest.approx(simpo.item() + 5.0 / 5.0)


def test_lora_reference_is_the_base_with_adapters_disabled(tiny_llama):
    from memfit.step.prepare import attach_lora

    spec = make_spec(method="lora", precision="fp32", rank=4)
    model = attach_lora(_tiny_model(tiny_llama, torch.float32), spec)
    batch = collate_pairs(PAIRS, 0)
    base = reference_logps(model, batch, "disabled-adapters")
    for module in model.modules():  # move the adapters away from zero: the policy now differs
        if hasattr(module, "lora_B"):
            torch.nn.init.normal_(module.lora_B["default"].weight)
    assert not torch.allclose(sequence_logps(model, batch).answer, base)
    torch.testing.assert_close(reference_logps(model, batch, "disabled-adapters"), base)
    assert not any(p.grad is not None for p in model.parameters())


def test_full_fine_tuning_keeps_a_frozen_copy_outside_the_parameters(tiny_llama):
    model = _tiny_model(tiny_llama, torch.float32).train()
    count = len(list(model.parameters()))
    reference = keep_reference_copy(model)
    assert reference_model(model) is reference and keep_reference_copy(model) is reference
    assert len(list(model.parameters())) == count and not any(p.requires_grad for p in reference.parameters())
    assert not reference.training and "_memfit_reference" not in model.state_dict()
    batch = collate_pairs(PAIRS, 0)
    before = reference_logps(model, batch, "frozen-copy")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1)
    torch.testing.assert_close(reference_logps(model, batch, "frozen-copy"), before)


def test_the_step_runs_the_reference_pass_as_a_phase_and_reports_metrics(tiny_llama):
    from memfit.step.builder import build_step
    from memfit.step.optim import build_optimizer
    from memfit.step.prepare import attach_lora

    spec = make_spec(method="lora", precision="fp32", rank=4, objective="dpo", padding_free="off")
    model = attach_lora(_tiny_model(tiny_llama, torch.float32), spec).train()
    step = build_step(spec, make_config(tiny_llama), ObjectiveParams(beta=0.5))
    phases = []

    class Observer:
        def on_phase(self, name):
            phases.append(name)

    metrics: list = []
    optimizer = build_optimizer(model.parameters(), "adamw", lr=1e-2)
    loss, _ = step(
        model, [step.collate(PAIRS, 0), step.collate(PAIRS[:1], 0)], optimizer, observer=Observer(), metrics=metrics
    )
    assert phases[:3] == ["reference", "forward", "backward"] and phases.count("reference") == 2
    # A fresh adapter (LoRA B is zero) is the reference: every reward 0, the loss log 2.
    assert loss.item() == pytest.approx(math.log(2), rel=1e-6)
    summary = summarize_metrics(metrics)
    assert summary["rewards/chosen"] == 0.0 and summary["rewards/accuracies"] == 0.0
    assert len(metrics) == 1 and metrics[0]["pairs"].item() == 3  # summed over the step's micro-batches
    eval_loss = step.loss(model, step.collate(PAIRS, 0))  # evaluation runs the reference pass too
    assert eval_loss.ndim == 0 and math.isfinite(eval_loss.item())


def test_planned_pairs_are_the_longest_and_padded_where_rows_are():
    spec = make_spec(objective="dpo", batch_size=2, seq_len=10)
    padded = longest_pairs(spec, PADDED)
    assert [[len(s["input_ids"]) for s in (p["chosen"], p["rejected"])] for p in padded] == [[10, 10], [10, 9]]
    assert [len(p["rejected"]["input_ids"]) for p in longest_pairs(spec, DOCUMENTS)] == [10, 10]
    precomputed = longest_pairs(make_spec(objective="dpo", precompute_reference=True, seq_len=10), DOCUMENTS)
    assert "ref_logps" in precomputed[0]
