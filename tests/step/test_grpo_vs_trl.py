"""memfit's grpo equals TRL's GRPOTrainer on the same completions and rewards: the advantages, the
loss (every loss type, with and without the KL term, at a sampling temperature), the logged
metrics (kl, entropy, clip ratios) and the LoRA gradients, within fp32 tolerance. TRL's generation
is replaced by fixed completions, so both score the same tokens."""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from memfit.models.build import make_config  # noqa: E402
from memfit.spec import ObjectiveParams, make_spec  # noqa: E402
from memfit.step.batch import DOCUMENTS, PADDED  # noqa: E402
from memfit.step.builder import build_step  # noqa: E402
from memfit.step.grpo import completion_example, group_advantages, summarize_metrics  # noqa: E402
from memfit.train.conformance import TINY_MODELS  # noqa: E402

TINY = TINY_MODELS["llama"]
GENERATIONS = 4
#: Two prompts of different lengths, four completions each of different lengths (EOS = 1 ends some).
PROMPTS = [[5, 9, 13, 17, 21], [6, 10, 14]]
COMPLETIONS = [
    [30, 31, 32, 1],
    [40, 41, 42, 43, 44, 45],
    [50, 1],
    [60, 61, 62, 63, 64],
    [70, 71, 72, 73, 74, 75],
    [80, 1],
    [90, 91, 92],
    [100, 101, 102, 103, 1],
]
MAX_COMPLETION = 6
REWARDS = [[1.0, 0.5], [0.0, 0.25], [2.0, float("nan")], [0.5, 0.0], [1.5, 1.0], [0.0, 0.0], [3.0, 0.5], [0.25, 2.0]]
WEIGHTS = [1.0, 0.5]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from memfit.train.data import tiny_tokenizer_path

    return AutoTokenizer.from_pretrained(str(tiny_tokenizer_path()))


def _lora_model():
    """A tiny Llama with memfit's LoRA adapters, their B matrices moved off zero (a policy away from its reference)."""
    from transformers import AutoModelForCausalLM

    from memfit.step.prepare import attach_lora

    torch.manual_seed(0)
    model = attach_lora(
        AutoModelForCausalLM.from_config(make_config(TINY), dtype=torch.float32),
        make_spec(method="lora", rank=4, precision="fp32"),
    )
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
    return model


def _grads(model) -> dict[str, torch.Tensor]:
    out = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return out


def _trl_trainer(tmp_path, model, tokenizer, **kwargs):
    from trl import GRPOConfig, GRPOTrainer

    def reward_a(prompts, completions, **_):
        return [0.0] * len(prompts)

    def reward_b(prompts, completions, **_):
        return [0.0] * len(prompts)

    rows = len(COMPLETIONS)
    args = GRPOConfig(
        output_dir=str(tmp_path / "trl"),
        per_device_train_batch_size=rows,
        num_generations=GENERATIONS,
        max_completion_length=MAX_COMPLETION,
        report_to=[],
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        disable_dropout=True,
        reward_weights=WEIGHTS,
        **kwargs,
    )
    dataset = datasets.Dataset.from_list([{"prompt": "x"}] * rows)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = GRPOTrainer(
            model=model, reward_funcs=[reward_a, reward_b], args=args, train_dataset=dataset, processing_class=tokenizer
        )
    trainer.current_gradient_accumulation_steps = 1
    # Given a model with an adapter, TRL keeps a copy of it as the reference ("ref"); memfit's reference
    # (and TRL's for an adapter it attaches itself) is the base with the adapters disabled.
    if "ref" in model.peft_config:
        model.delete_adapter("ref")
    prompt_ids = [PROMPTS[i // GENERATIONS] for i in range(rows)]

    def fixed_generation(prompts):
        texts = [str(i) for i in range(rows)]
        return prompt_ids, [list(c) for c in COMPLETIONS], None, texts, None, {}, None, []

    def fixed_rewards(inputs, prompts, completions, completion_ids_list):
        return torch.tensor(REWARDS, dtype=torch.float32)

    trainer._generate = fixed_generation
    trainer._calculate_rewards = fixed_rewards
    return trainer, [{"prompt": str(i // GENERATIONS)} for i in range(rows)]


def _memfit(model, params: ObjectiveParams, layout: str, *, beta: float, temperature: float):
    from memfit.step.attention import restore_attention, use_document_attention

    spec = make_spec(
        method="lora",
        rank=4,
        precision="fp32",
        objective="grpo",
        num_generations=GENERATIONS,
        batch_size=len(COMPLETIONS),
        max_completion_length=MAX_COMPLETION,
        seq_len=64,
        beta=beta,
        temperature=temperature,
        padding_free="on" if layout == DOCUMENTS else "off",
    )
    step = build_step(spec, make_config(TINY), params)
    advantages = group_advantages(torch.tensor(REWARDS), WEIGHTS, GENERATIONS, params.scale_rewards).advantages
    tokens = sum(len(c) for c in COMPLETIONS)
    examples = [
        completion_example(PROMPTS[i // GENERATIONS], c, float(a), generation_tokens=tokens)
        for i, (c, a) in enumerate(zip(COMPLETIONS, advantages))
    ]
    if layout == DOCUMENTS:
        use_document_attention(model)
    batch = step.collate(examples, pad_token_id=2)
    if step.loss_fn.reference_pass is not None:
        batch = step.loss_fn.reference_pass(model, batch)
    loss, metrics = step.loss_fn(model, batch)
    loss.backward()
    restore_attention(model)
    return advantages, loss.detach(), summarize_metrics([metrics]), _grads(model)


@pytest.mark.parametrize(
    "loss_type, beta, temperature, layout",
    [
        ("dapo", 0.0, 1.0, PADDED),
        ("grpo", 0.04, 0.7, PADDED),
        ("bnpo", 0.0, 1.3, DOCUMENTS),
        ("dr_grpo", 0.1, 1.0, DOCUMENTS),
        ("dapo", 0.04, 0.9, DOCUMENTS),
    ],
)
def test_loss_advantages_and_gradients_equal_trls(tmp_path, tokenizer, loss_type, beta, temperature, layout):
    model = _lora_model()
    trainer, inputs = _trl_trainer(tmp_path, model, tokenizer, loss_type=loss_type, beta=beta, temperature=temperature)
    scored = trainer._generate_and_score_completions(inputs)
    trl_loss = trainer._compute_loss(trainer.model, scored)
    trl_loss.backward()
    trl_grads = _grads(model)
    trl_metrics = {name: values[-1] for name, values in trainer._metrics["train"].items()}

    params = ObjectiveParams(beta=beta, loss_type=loss_type)
    advantages, loss, metrics, grads = _memfit(model, params, layout, beta=beta, temperature=temperature)
    torch.testing.assert_close(advantages, scored["advantages"], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(loss, trl_loss.detach(), rtol=2e-5, atol=1e-7)
    assert grads.keys() == trl_grads.keys() and grads
    for name in grads:
        torch.testing.assert_close(
            grads[name], trl_grads[name], rtol=2e-4, atol=2e-7, msg=lambda m, name=name: f"{name}: {m}"
        )
    for name in ("entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean") + (
        ("kl",) if beta else ()
    ):
        assert metrics[name] == pytest.approx(trl_metrics[name], rel=1e-4, abs=1e-6), name
    assert trl_metrics["reward"] == pytest.approx(
        float(torch.nanmean(group_advantages(torch.tensor(REWARDS), WEIGHTS, GENERATIONS, "group").rewards)), rel=1e-6
    )


def test_a_step_away_from_the_old_policy_clips_as_trl_does(tmp_path, tokenizer):
    # num_iterations > 1: the completions carry the old policy's log-probs; moving the policy makes
    # ratios leave [1 - epsilon, 1 + epsilon_high] and the clipped shares count them.
    model = _lora_model()
    trainer, inputs = _trl_trainer(
        tmp_path, model, tokenizer, loss_type="grpo", num_iterations=2, epsilon=0.05, epsilon_high=0.1
    )
    scored = trainer._generate_and_score_completions(inputs)
    old = scored["old_per_token_logps"]
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name:
                p.mul_(3.0)
    trl_loss = trainer._compute_loss(trainer.model, scored)
    trl_loss.backward()
    trl_grads = _grads(model)
    trl_metrics = {name: values[-1] for name, values in trainer._metrics["train"].items()}

    params = ObjectiveParams(beta=0.0, loss_type="grpo", epsilon=0.05, epsilon_high=0.1)
    spec = make_spec(
        method="lora",
        rank=4,
        precision="fp32",
        objective="grpo",
        num_generations=GENERATIONS,
        batch_size=len(COMPLETIONS),
        max_completion_length=MAX_COMPLETION,
        seq_len=64,
        num_iterations=2,
        padding_free="off",
    )
    step = build_step(spec, make_config(TINY), params)
    examples = []
    for i, (c, a) in enumerate(zip(COMPLETIONS, scored["advantages"])):
        prompt = PROMPTS[i // GENERATIONS]
        # TRL's old log-probs are [completions, longest completion]; memfit's one per position.
        per_position = [0.0] * (len(prompt) - 1) + old[i, : len(c)].tolist() + [0.0]
        examples.append(completion_example(prompt, c, float(a), generation_tokens=1, old_logps=per_position))
    loss, metrics = step.loss_fn(model, step.collate(examples, pad_token_id=2))
    loss.backward()
    torch.testing.assert_close(loss.detach(), trl_loss.detach(), rtol=2e-5, atol=1e-7)
    for name, grad in _grads(model).items():
        torch.testing.assert_close(grad, trl_grads[name], rtol=2e-4, atol=2e-7, msg=name)
    metrics = summarize_metrics([metrics])
    assert trl_metrics["clip_ratio/region_mean"] > 0
    for name in (
        "clip_ratio/low_mean",
        "clip_ratio/high_mean",
        "clip_ratio/region_mean",
        "clip_ratio/low_min",
        "clip_ratio/high_max",
    ):
        assert metrics[name] == pytest.approx(trl_metrics[name], rel=1e-5, abs=1e-7), name


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_scale_as_trl_scales_them(scale):
    from trl.trainer.utils import nanstd as trl_nanstd

    rewards = torch.tensor(REWARDS)
    ours = group_advantages(rewards, WEIGHTS, GENERATIONS, scale)
    summed = (rewards * torch.tensor(WEIGHTS)).nansum(1)
    mean = summed.view(-1, GENERATIONS).mean(1).repeat_interleave(GENERATIONS)
    std = (
        trl_nanstd(summed.view(-1, GENERATIONS), dim=1).repeat_interleave(GENERATIONS)
        if scale == "group"
        else trl_nanstd(summed).expand_as(summed)
    )
    expected = summed - mean if scale == "none" else (summed - mean) / (std + 1e-4)
    torch.testing.assert_close(ours.advantages, expected)
