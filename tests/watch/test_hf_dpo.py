"""MemoryCallback on TRL's DPOTrainer: the reference (adapters disabled, or a frozen copy of the model)
raises no false alarm: no leak, no stray device, no frozen weights with gradients."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from memfit.watch.hf import MemoryCallback  # noqa: E402

PAIRS = [
    {"prompt": f"Q: What is {a} + {b}?\nA:", "chosen": f" {a} + {b} = {a + b}.", "rejected": " No idea."}
    for a in range(1, 5)
    for b in range(1, 5)
]


def _dpo_run(out, tiny_llama_config, *, lora: bool, steps: int = 6):
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    from memfit.train.data import tiny_tokenizer_path

    config = tiny_llama_config
    config.vocab_size = 512  # the shipped tokenizer's
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_tokenizer_path()))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    ref_model = None
    if not lora:  # full fine-tuning: TRL's frozen reference copy
        torch.manual_seed(0)
        ref_model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    args = DPOConfig(
        output_dir=str(out),
        max_steps=steps,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        use_cpu=True,
        bf16=False,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        max_length=64,
    )
    callback = MemoryCallback(check_every=2, attribute_steps=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = DPOTrainer(
            model=model,
            ref_model=ref_model,
            args=args,
            train_dataset=datasets.Dataset.from_list(PAIRS),
            processing_class=tokenizer,
            callbacks=[callback],
            peft_config=LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM") if lora else None,
        )
        trainer.train()
    return callback


@pytest.mark.parametrize("lora", [True, False], ids=["lora, adapters disabled", "full, frozen copy"])
def test_a_dpo_trainer_run_raises_no_false_alarm(tmp_path, tiny_llama_config, lora):
    from memfit.watch.doctor import diagnose
    from memfit.watch.timeline import load_run

    callback = _dpo_run(tmp_path, tiny_llama_config, lora=lora)
    errors = [f for f in callback.findings if f.severity == "error"]
    assert errors == [], [f.message for f in errors]
    # The reference pass (disabled adapters, or TRL's copy of the model) is none of these.
    false_alarms = {
        "leak",
        "stray_device",
        "frozen_gradients",
        "frozen_trainable",
        "trainable_count",
        "checkpointing_inactive",
    }
    assert not [f.message for f in callback.findings if f.code in false_alarms]
    run = load_run(tmp_path)
    assert len(run.timeline.steps) == 6 and run.timeline.attribution is not None
    diagnosis = diagnose(tmp_path)
    assert not diagnosis.has_errors, [f.message for f in diagnosis.findings]
    # TRL's metrics come through under their own names.
    metrics = (tmp_path / "metrics.jsonl").read_text()
    assert "rewards/accuracies" in metrics and "rewards/margins" in metrics
