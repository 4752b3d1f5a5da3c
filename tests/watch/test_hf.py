"""MemoryCallback inside a real Hugging Face Trainer on CPU (tiny llama, tiny dataset)."""

from __future__ import annotations

import logging

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from memfit.watch.hf import MemoryCallback  # noqa: E402
from memfit.watch.timeline import load_run  # noqa: E402

LEAK_BYTES_PER_STEP = 3 * 2**20


class TinyData(torch.utils.data.Dataset):
    def __init__(self, n=16, seq_len=32, vocab=256):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, seq_len), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}


class Leaky(transformers.TrainerCallback):
    """The bug being caught: a callback that keeps a few MiB per step (a metrics buffer that grows)."""

    def __init__(self):
        self.kept = []

    def on_step_end(self, args, state, control, **kwargs):
        self.kept.append(torch.empty(LEAK_BYTES_PER_STEP, dtype=torch.uint8).fill_(1))


def run_trainer(out, config, steps, extra_callbacks=(), training_args=None, pretrained=False, **callback_kwargs):
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    if pretrained:  # as users load models: from_pretrained returns the model in eval mode
        model.save_pretrained(out / "base")
        model = AutoModelForCausalLM.from_pretrained(out / "base", attn_implementation="sdpa")
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=steps,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        use_cpu=True,
        report_to=[],
        logging_steps=10,
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        **(training_args or {}),
    )
    callback = MemoryCallback(**callback_kwargs)
    trainer = Trainer(model=model, args=args, train_dataset=TinyData(), callbacks=[callback, *extra_callbacks])
    trainer.train()
    return callback


def test_leak_in_a_trainer_is_found_at_its_rate(tmp_path, tiny_llama_config, caplog):
    with caplog.at_level(logging.WARNING, logger="memfit.watch"):
        callback = run_trainer(tmp_path, tiny_llama_config, 100, extra_callbacks=[Leaky()])
    [leak] = [f for f in callback.findings if f.code == "leak"]
    assert leak.data["bytes_per_step"] == pytest.approx(LEAK_BYTES_PER_STEP, rel=0.2)
    assert any("MiB per step" in r.getMessage() for r in caplog.records)
    folder = load_run(tmp_path)
    assert folder.timeline.start["source"] == "hf-trainer" and folder.timeline.expected_devices == ["cpu"]
    assert len(folder.timeline.steps) == 100 and folder.timeline.end is not None


def test_clean_trainer_run_of_200_steps_raises_nothing(tmp_path, tiny_llama_config):
    callback = run_trainer(tmp_path, tiny_llama_config, 200)
    assert callback.findings == []
    folder = load_run(tmp_path)
    assert [r["step"] for r in folder.timeline.steps] == list(range(1, 201))
    phases = [p["phase"] for p in folder.timeline.steps[5]["phases"]]
    assert phases == ["forward", "backward", "optimizer", "idle"]
    # The first steps were attributed; the loss went to metrics.jsonl every logging step.
    assert folder.timeline.attribution["categories"]["optimizer"] > 0
    assert [m["step"] for m in folder.metrics if "loss" in m][:3] == [10, 20, 30]


def test_bad_argument():
    with pytest.raises(ValueError, match="attribute_steps"):
        MemoryCallback(attribute_steps=-1)


def test_checkpointing_trainer_is_inspected_as_it_trains_and_raises_no_alarm(tmp_path, tiny_llama_config):
    # A plain Trainer(gradient_checkpointing=True) on a from_pretrained model: the model is still in
    # eval mode at on_train_begin (the Trainer calls model.train() inside its first step), and
    # checkpointing is on as it trains.
    from typer.testing import CliRunner

    from memfit.cli import app

    callback = run_trainer(
        tmp_path, tiny_llama_config, 3, training_args={"gradient_checkpointing": True}, pretrained=True
    )
    assert [f.code for f in callback.findings if f.code == "checkpointing_inactive"] == []
    folder = load_run(tmp_path)
    assert folder.timeline.start["spec"]["checkpointing"] == "on"
    # The Trainer's settings under their own names, for memfit report's configuration table.
    config = folder.timeline.start["config"]
    assert config["model"] == str(tmp_path / "base") and config["trainable parameters"] == config["parameters"] > 0
    assert {k: config[k] for k in ("per_device_train_batch_size", "learning_rate", "max_steps", "seed")} == {
        "per_device_train_batch_size": 2,
        "learning_rate": 1e-3,
        "max_steps": 3,
        "seed": 42,
    }
    assert config.get("activation_checkpointing", config.get("gradient_checkpointing")) is True
    assert [f.code for f in folder.timeline.findings] == []
    result = CliRunner().invoke(app, ["doctor", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "checkpointing_inactive" not in result.output


def test_checkpointing_switched_off_while_training_is_still_found(tmp_path, tiny_llama_config):
    # The check still sees what matters: checkpointing asked for, but off in the model that trains.
    class TurnsItOff(transformers.TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            model.gradient_checkpointing_disable()

    callback = run_trainer(
        tmp_path,
        tiny_llama_config,
        2,
        extra_callbacks=[TurnsItOff()],
        training_args={"gradient_checkpointing": True},
        pretrained=True,
    )
    assert [f.code for f in callback.findings if f.code == "checkpointing_inactive"] == ["checkpointing_inactive"]
