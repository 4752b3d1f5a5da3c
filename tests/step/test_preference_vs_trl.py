"""memfit's preference losses equal TRL's: same tiny model, same pairs, same batch; loss, the logged
metrics (rewards, log-probs, DPO's mean logits, ORPO's log odds) and LoRA gradients within fp32
tolerance (DPOTrainer, ORPOTrainer, CPOTrainer with loss_type="simpo")."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from memfit.models.build import make_config  # noqa: E402
from memfit.spec import ObjectiveParams, make_spec  # noqa: E402
from memfit.step.batch import DOCUMENTS, PADDED  # noqa: E402
from memfit.step.builder import build_step  # noqa: E402
from memfit.step.labels import IGNORE_INDEX  # noqa: E402
from memfit.step.preference import summarize_metrics  # noqa: E402

TINY = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
}

TEXT_PAIRS = [
    {"prompt": "Q: What is 2 + 3?\nA:", "chosen": " 2 + 3 = 5.", "rejected": " No idea."},
    {"prompt": "Q: Reverse 'tiger'.\nA:", "chosen": " The reverse of 'tiger' is 'regit'.", "rejected": " 'tiger'."},
    {"prompt": "Q: Is 7 even or odd?\nA:", "chosen": " 7 is odd.", "rejected": " Whatever."},
]
CHAT_PAIRS = [
    {
        "prompt": [{"role": "user", "content": "What comes after Monday?"}],
        "chosen": [{"role": "assistant", "content": "The day after Monday is Tuesday."}],
        "rejected": [{"role": "assistant", "content": "Ask someone else."}],
    },
    {
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Opposite of hot?"}],
        "chosen": [{"role": "assistant", "content": "Cold."}],
        "rejected": [{"role": "assistant", "content": "Hot."}],
    },
]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from memfit.train.data import tiny_tokenizer_path

    return AutoTokenizer.from_pretrained(str(tiny_tokenizer_path()))


SPEC = make_spec(method="lora", rank=4, precision="fp32")


def _base_model():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(make_config(TINY), dtype=torch.float32)


def _lora_model():
    """A tiny Llama with memfit's LoRA adapters, their B matrices moved off zero (a policy away from its reference)."""
    from memfit.step.prepare import attach_lora

    model = attach_lora(_base_model(), SPEC)
    _move_adapters(model)
    return model


def _move_adapters(model) -> None:
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.05)


def _lora_config():
    """The LoraConfig memfit's attach_lora makes for SPEC, for TRL to attach itself."""
    from peft import LoraConfig

    return LoraConfig(
        r=SPEC.rank,
        lora_alpha=SPEC.lora_alpha,
        lora_dropout=0.0,
        target_modules="all-linear",
        bias="none",
        task_type="CAUSAL_LM",
    )


def _args(tmp_path, config_class, **kwargs):
    return config_class(
        output_dir=str(tmp_path / "trl"),
        per_device_train_batch_size=2,
        report_to=[],
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        disable_dropout=True,
        **kwargs,
    )


def _lora_grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


def _memfit_step(objective: str, layout: str, params: ObjectiveParams):
    spec = make_spec(
        method="lora",
        rank=4,
        precision="fp32",
        objective=objective,
        padding_free="on" if layout == DOCUMENTS else "off",
    )
    return build_step(spec, make_config(TINY), params)


def _memfit_loss(model, pairs, objective, layout, params):
    from memfit.step.attention import restore_attention, use_document_attention

    if layout == DOCUMENTS:
        use_document_attention(model)
    step = _memfit_step(objective, layout, params)
    batch = step.collate(pairs, pad_token_id=2)
    reference_pass = getattr(step.loss_fn, "reference_pass", None)
    if reference_pass is not None:
        batch = reference_pass(model, batch)
    loss, metrics = step.loss_fn(model, batch)
    loss.backward()
    restore_attention(model)
    return loss.detach(), summarize_metrics([metrics]), _lora_grads(model)


def _assert_close_grads(ours: dict, theirs: dict) -> None:
    assert ours.keys() == theirs.keys() and ours
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=2e-4, atol=2e-6, msg=name)


def _pair(prompt_ids, chosen_ids, rejected_ids):
    def seq(answer):
        return {"input_ids": list(prompt_ids) + list(answer), "labels": [IGNORE_INDEX] * len(prompt_ids) + list(answer)}

    return {"chosen": seq(chosen_ids), "rejected": seq(rejected_ids)}


# ------------------------------------------------------------------------------------------------
# DPO


@pytest.mark.parametrize("rows", [TEXT_PAIRS, CHAT_PAIRS], ids=["text", "chat"])
def test_pairs_tokenize_as_dpo_trainer_tokenizes_them(tmp_path, tokenizer, rows):
    from trl import DPOConfig, DPOTrainer

    from memfit.train.data.formats import load_records
    from memfit.train.data.pairs import tokenize_pairs

    path = tmp_path / "pairs.jsonl"
    import json

    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    records, _ = load_records(path)
    ours, _ = tokenize_pairs(records, tokenizer, seq_len=256)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = DPOTrainer(
            model=_lora_model(),
            args=_args(tmp_path, DPOConfig, max_length=None),
            train_dataset=datasets.Dataset.from_list(rows),
            processing_class=tokenizer,
        )
    for mine, theirs in zip(ours, trainer.train_dataset):
        assert mine == _pair(theirs["prompt_ids"], theirs["chosen_ids"], theirs["rejected_ids"])


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge"])
@pytest.mark.parametrize("layout", [PADDED, DOCUMENTS], ids=["padded", "padding-free"])
def test_dpo_loss_rewards_and_lora_gradients_equal_dpo_trainers(tmp_path, tokenizer, loss_type, layout):
    from trl import DPOConfig, DPOTrainer

    from memfit.step.prepare import attach_lora

    beta = 0.3
    # TRL attaches its own adapters (a PeftModel given to it would be its own reference, as an
    # adapter trained further); both then get the same adapter weights, away from the base.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = DPOTrainer(
            model=_base_model(),
            args=_args(tmp_path, DPOConfig, beta=beta, loss_type=[loss_type], max_length=None),
            train_dataset=datasets.Dataset.from_list(TEXT_PAIRS),
            processing_class=tokenizer,
            peft_config=_lora_config(),
        )
    _move_adapters(trainer.model)
    ours_model = attach_lora(_base_model(), SPEC)
    ours_model.load_state_dict({k: v for k, v in trainer.model.state_dict().items() if "lora_" in k}, strict=False)
    assert all(torch.equal(a, b) for a, b in zip(ours_model.parameters(), trainer.model.parameters()))
    rows = [trainer.train_dataset[i] for i in range(len(TEXT_PAIRS))]
    trainer.model.train()
    theirs = trainer.compute_loss(trainer.model, trainer.data_collator(rows))
    theirs.backward()
    logged = {name: values[-1] for name, values in trainer._metrics["train"].items()}
    pairs = [_pair(r["prompt_ids"], r["chosen_ids"], r["rejected_ids"]) for r in rows]
    ours_model.train()
    loss, metrics, grads = _memfit_loss(
        ours_model, pairs, "dpo", layout, ObjectiveParams(beta=beta, loss_type=loss_type)
    )
    assert loss.item() == pytest.approx(theirs.item(), rel=1e-5, abs=1e-6)
    names = (
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
        "logits/chosen",
        "logits/rejected",
    )
    assert set(names) <= set(metrics)
    for name in names:
        # The mean logits of a tiny random model are near 0 (about 0.01): held to a tighter floor.
        assert metrics[name] == pytest.approx(
            logged[name], rel=1e-5, abs=1e-8 if name.startswith("logits/") else 1e-6
        ), name
    assert metrics["logits/chosen"] != metrics["logits/rejected"]  # two answers, two means: not a constant
    _assert_close_grads(grads, _lora_grads(trainer.model))


# ------------------------------------------------------------------------------------------------
# ORPO and SimPO (TRL's experimental trainers, which tokenize on their own: the same batch is given)


def _trainer_batch(trainer, count):
    rows = [trainer.train_dataset[i] for i in range(count)]
    batch = trainer.data_collator(rows)
    pairs = [
        {
            "chosen": {"input_ids": r["chosen_input_ids"], "labels": r["chosen_labels"]},
            "rejected": {"input_ids": r["rejected_input_ids"], "labels": r["rejected_labels"]},
        }
        for r in rows
    ]
    return batch, pairs


@pytest.mark.parametrize(
    "objective, extra",
    [
        ("orpo", {"beta": 0.2}),
        ("simpo", {"beta": 2.0, "simpo_gamma": 0.5, "cpo_alpha": 0.0}),
        ("simpo", {"beta": 2.5, "simpo_gamma": 0.3, "cpo_alpha": 1.0}),
    ],
    ids=["orpo", "simpo", "cpo-simpo"],
)
@pytest.mark.parametrize("layout", [PADDED, DOCUMENTS], ids=["padded", "padding-free"])
def test_orpo_and_simpo_equal_trls_trainers(tmp_path, tokenizer, objective, extra, layout):
    from trl.experimental.cpo import CPOConfig, CPOTrainer
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    policy = _lora_model()
    ours_model = copy.deepcopy(policy)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if objective == "orpo":
            args = _args(tmp_path, ORPOConfig, beta=extra["beta"], max_length=256)
            trainer = ORPOTrainer(
                model=policy,
                args=args,
                train_dataset=datasets.Dataset.from_list(TEXT_PAIRS),
                processing_class=tokenizer,
            )
        else:
            args = _args(tmp_path, CPOConfig, loss_type="simpo", max_length=256, **extra)
            trainer = CPOTrainer(
                model=policy,
                args=args,
                train_dataset=datasets.Dataset.from_list(TEXT_PAIRS),
                processing_class=tokenizer,
            )
    batch, pairs = _trainer_batch(trainer, len(TEXT_PAIRS))
    trainer.model.train()
    theirs, logged = trainer.get_batch_loss_metrics(trainer.model, batch)
    theirs.backward()
    ours_model.train()
    loss, metrics, grads = _memfit_loss(ours_model, pairs, objective, layout, ObjectiveParams(**extra))
    assert loss.item() == pytest.approx(theirs.item(), rel=1e-5, abs=1e-6)
    names = [
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
    ]
    if objective == "orpo":
        names += ["log_odds_ratio", "log_odds_chosen"]
    if objective == "orpo" or extra["cpo_alpha"] > 0:
        names.append("nll_loss")
    for name in names:
        assert metrics[name] == pytest.approx(float(logged[name]), rel=1e-5, abs=1e-6), name
    # TRL's ORPO and CPO logits/* average every position of the padded batch, padding included: a
    # figure of the padding, which memfit does not log.
    assert not any(name.startswith("logits/") for name in metrics)
    _assert_close_grads(grads, _lora_grads(trainer.model))
