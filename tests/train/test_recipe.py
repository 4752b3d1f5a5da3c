"""The training loop end to end on CPU with tiny models."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from trainer_helpers import (  # noqa: E402
    REPO,
    read_metrics,
    save_tiny_pretrained,
    step_losses,
    tiny_config,
)

from memfit.step import train_step as step_module  # noqa: E402
from memfit.step.prepare import SetupError  # noqa: E402
from memfit.train.checkpointing import latest_checkpoint  # noqa: E402
from memfit.train.config import load_config  # noqa: E402
from memfit.train.recipe import OutOfMemory, TrainError, train  # noqa: E402


def _mean(values):
    values = list(values)
    return sum(values) / len(values)


def test_demo_config_trains_and_loss_decreases(tmp_path):
    config = load_config(
        REPO / "examples" / "tiny.yaml",
        {"output_dir": str(tmp_path / "run"), "max_steps": 50, "eval_every": 25, "log_every": 1},
    )
    result = train(config, progress=False)
    assert result.status == "completed" and result.step == 50
    losses = [loss for _, loss in result.losses]
    assert _mean(losses[-10:]) < _mean(losses[:10]) - 0.5, losses
    assert [s for s, _ in result.eval_losses] == [25, 50]
    assert result.eval_losses[-1][1] < result.eval_losses[0][1]
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 51))
    first = records[0]
    assert first["tokens_per_second"] > 0 and first["rss_bytes"] > 0 and first["lr"] > 0
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["status"] == "completed" and run["step"] == 50
    assert run["config"]["method"] == "lora" and run["model_config"]["num_hidden_layers"] == 2
    assert run["preflight"]["target"] is None and run["plan"] is None  # CPU without gpu/budget: no plan
    assert run["setup"]["trainable_params"] == run["setup"]["expected_trainable_params"]
    adapter = tmp_path / "run" / "adapter"
    assert (adapter / "adapter_config.json").is_file() and (adapter / "adapter_model.safetensors").is_file()
    assert (adapter / "tokenizer.json").is_file()


def test_adapter_loads_unchanged_with_peft(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base_dir = save_tiny_pretrained(tmp_path / "base")
    config = tiny_config(
        tmp_path / "run", model=str(base_dir), init="pretrained", model_overrides={}, dropout=0.1, max_steps=4
    )
    result = train(config, progress=False)
    trained = result.model.eval()
    reloaded = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(str(base_dir)), str(result.output_dir)
    ).eval()
    ids = torch.randint(0, 512, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = trained(input_ids=ids).logits
        got = reloaded(input_ids=ids).logits
        base_logits = AutoModelForCausalLM.from_pretrained(str(base_dir))(input_ids=ids).logits
    assert torch.allclose(expected, got, atol=1e-6, rtol=0)
    assert not torch.allclose(expected, base_logits, atol=1e-4)  # the adapter did learn something
    saved = {n.replace(".default", "") for n, p in trained.named_parameters() if p.requires_grad}
    from safetensors.torch import load_file

    assert set(load_file(str(result.output_dir / "adapter_model.safetensors"))) == saved


def test_full_fine_tuning_saves_a_loadable_model(tmp_path):
    from transformers import AutoModelForCausalLM

    config = tiny_config(tmp_path / "run", method="full", max_steps=8, lr=2e-3, batch_size=8)
    result = train(config, progress=False)
    assert result.setup["trainable_params"] == result.setup["total_params"]
    losses = [loss for _, loss in result.losses]
    assert losses[-1] < losses[0]
    reloaded = AutoModelForCausalLM.from_pretrained(str(result.output_dir)).eval()
    ids = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(result.model.eval()(input_ids=ids).logits, reloaded(input_ids=ids).logits, atol=1e-6)


def test_qlora_trains_on_cpu(tmp_path):
    pytest.importorskip("bitsandbytes")
    from rich.console import Console

    console = Console(stderr=True, record=True, width=200)
    config = tiny_config(tmp_path / "run", method="qlora", precision="bf16", max_steps=8, lr=1e-2, batch_size=8)
    result = train(config, progress=False, console=console)
    # It says once, before the run, that the CPU is the slow place for QLoRA, and what to use instead.
    said = console.export_text()
    assert said.count("method: qlora on the CPU") == 1
    assert said.index("method: qlora on the CPU") < said.index("model: ")
    assert "use method: lora" in said
    losses = [loss for _, loss in result.losses]
    assert all(map(lambda x: x == x, losses))
    assert _mean(losses[-3:]) < _mean(losses[:3])
    assert (result.output_dir / "adapter_model.safetensors").is_file()


def test_fp16_uses_a_grad_scaler_and_checkpoints_it(tmp_path):
    config = tiny_config(tmp_path / "run", precision="fp16", max_steps=3)
    result = train(config, progress=False)
    assert result.status == "completed"
    state = torch.load(latest_checkpoint(tmp_path / "run") / "state.pt", weights_only=True)
    assert state["grad_scaler"] is not None and state["grad_scaler"]["scale"] > 0


def test_gradient_accumulation_and_packing(tmp_path):
    config = tiny_config(tmp_path / "run", grad_accum=2, packing=True, max_steps=3, eval_split=0.1)
    result = train(config, progress=False)
    records = read_metrics(tmp_path / "run")
    tokens = [r["tokens"] for r in records if "loss" in r]
    # packed rows are seq_len tokens long: 2 micro-batches x 4 rows x 64 tokens
    assert tokens == [512, 512, 512]
    assert result.eval_losses


def test_out_of_memory_saves_the_step_before_and_explains(tmp_path, monkeypatch):
    calls = {"n": 0}
    real_step = step_module.train_step

    def flaky_step(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return real_step(*args, **kwargs)

    monkeypatch.setattr(step_module, "train_step", flaky_step)
    # on_oom: stop (the default continues one configuration down: tests/train/test_fitting.py)
    config = tiny_config(tmp_path / "run", max_steps=5, batch_size=4, on_oom="stop")
    with pytest.raises(OutOfMemory) as info:
        train(config, progress=False)
    message = str(info.value)
    assert "out of device memory at step 3" in message
    assert "batch_size: 2, grad_accum: 2" in message and "--resume" in message
    assert info.value.plan is not None  # planned on the spot, to show where the memory goes
    checkpoint = info.value.checkpoint
    assert checkpoint.name == "step-00000002"
    assert json.loads((checkpoint / "meta.json").read_text())["reason"] == "oom"
    assert json.loads((tmp_path / "run" / "run.json").read_text())["status"] == "oom"

    # the emergency checkpoint replays step 3: the run then matches one that never failed
    monkeypatch.setattr(step_module, "train_step", real_step)
    resumed = train(config, resume=True, progress=False)
    assert resumed.status == "completed"
    train(tiny_config(tmp_path / "clean", max_steps=5, batch_size=4, on_oom="stop"), progress=False)
    got, want = step_losses(tmp_path / "run"), step_losses(tmp_path / "clean")
    assert got.keys() == want.keys() == set(range(1, 6))
    assert all(abs(got[k] - want[k]) <= 1e-6 for k in want)


def test_custom_wrapper_models_are_refused(tmp_path):
    from trainer_helpers import tiny_model_dict
    from transformers import AutoModelForCausalLM

    from memfit.models.build import make_config

    class Wrapper(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = AutoModelForCausalLM.from_config(make_config(tiny_model_dict()))

    with pytest.raises(SetupError, match="not a transformers PreTrainedModel"):
        train(tiny_config(tmp_path / "run"), model=Wrapper(), progress=False)


def test_a_given_pretrained_model_is_prepared_and_trained(tmp_path):
    from trainer_helpers import tiny_model_dict
    from transformers import AutoModelForCausalLM

    from memfit.models.build import make_config

    model = AutoModelForCausalLM.from_config(make_config(tiny_model_dict()))
    result = train(tiny_config(tmp_path / "run", max_steps=2), model=model, progress=False)
    assert result.status == "completed"
    assert result.setup["checkpointed_layers"] == 2
    assert 0 < result.setup["trainable_params"] < result.setup["total_params"]


def test_an_existing_run_is_never_overwritten(tmp_path):
    config = tiny_config(tmp_path / "run", max_steps=1)
    train(config, progress=False)
    with pytest.raises(TrainError, match="already holds files"):
        train(config, progress=False)
    with pytest.raises(TrainError, match="holds no run to resume"):
        train(tiny_config(tmp_path / "other", max_steps=1), resume=True, progress=False)


def test_tokenizer_larger_than_the_model_vocab_fails_before_loading(tmp_path, monkeypatch):
    from memfit.train import loading

    def must_not_load(*args, **kwargs):
        raise AssertionError("weights were loaded before the vocabulary check")

    monkeypatch.setattr(loading, "load_model", must_not_load)
    overrides = dict(tiny_config(tmp_path / "x").model_overrides, vocab_size=100)
    with pytest.raises(TrainError, match="vocab_size is 100"):
        train(tiny_config(tmp_path / "run", model_overrides=overrides), progress=False)


def test_a_nonfinite_loss_stops_the_run_with_advice(tmp_path, monkeypatch):
    real_step = step_module.train_step

    def diverging(*args, **kwargs):
        real_step(*args, **kwargs)
        return torch.tensor(float("nan")), None

    monkeypatch.setattr(step_module, "train_step", diverging)
    with pytest.raises(TrainError, match="the loss is nan at step 1: training diverged. Lower lr"):
        train(tiny_config(tmp_path / "run", max_steps=3), progress=False)
    assert json.loads((tmp_path / "run" / "run.json").read_text())["status"] == "diverged"
    assert latest_checkpoint(tmp_path / "run").name == "step-00000001"


@pytest.mark.parametrize(
    ("lean", "plain"),
    [
        (dict(method="full", step_in_backward=True, max_grad_norm=None), dict(method="full", max_grad_norm=None)),
        (dict(checkpointing="offload", tiling="on"), dict(checkpointing="on", tiling="off")),
    ],
    ids=["step-in-backward", "offload-and-tiling"],
)
def test_memory_lean_settings_train_the_same_run(tmp_path, lean, plain):
    lean_run = train(tiny_config(tmp_path / "lean", max_steps=4, **lean), progress=False)
    plain_run = train(tiny_config(tmp_path / "plain", max_steps=4, **plain), progress=False)
    assert lean_run.status == plain_run.status == "completed"
    lean_losses = [loss for _, loss in lean_run.losses]
    plain_losses = [loss for _, loss in plain_run.losses]
    assert lean_losses == pytest.approx(plain_losses, rel=1e-5)
    # The steps moved the weights the same way too (the losses of later steps depend on them).
    assert len(lean_losses) == 4 and lean_losses[-1] != lean_losses[0]


def test_step_in_backward_refuses_gradient_clipping(tmp_path):
    from memfit.train.config import ConfigError

    with pytest.raises(ConfigError, match=r"max.grad.norm: 1.0 cannot be used with .*step.in.backward"):
        tiny_config(tmp_path / "run", method="full", step_in_backward=True, max_grad_norm=1.0)
    # Left out, clipping is off with the step in backward (it is on by default otherwise).
    assert tiny_config(tmp_path / "run", method="full", step_in_backward=True).spec.max_grad_norm is None
    assert tiny_config(tmp_path / "run", method="full").spec.max_grad_norm == 1.0


def test_packing_on_a_model_whose_attention_cannot_keep_examples_apart_is_refused_first(tmp_path, monkeypatch):
    from memfit.train import loading

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr(loading, "load_model", no_loading)
    gemma2 = {
        "model_type": "gemma2",
        "num_hidden_layers": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "vocab_size": 512,
    }
    (tmp_path / "gemma2.json").write_text(__import__("json").dumps(gemma2))
    config = tiny_config(tmp_path / "run", model=str(tmp_path / "gemma2.json"), model_overrides={}, packing=True)
    with pytest.raises(
        TrainError,
        match="packing: examples packed in one row need attention kept inside each example, "
        "and gemma2 soft-caps its attention logits. Set packing: false",
    ):
        train(config, progress=False)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_padded_and_padding_free_runs_train_the_same(tmp_path):
    # The same examples, one row of documents or padded rows: the same losses, step after step.
    padded = train(tiny_config(tmp_path / "padded", padding_free="off", max_steps=4), progress=False)
    one_row = train(tiny_config(tmp_path / "one-row", padding_free="on", max_steps=4), progress=False)
    for (step, a), (_, b) in zip(padded.losses, one_row.losses):
        assert abs(a - b) <= 1e-4 * abs(a), (step, a, b)


def test_lora_on_cpu_gets_no_warning_about_qlora(tmp_path):
    from rich.console import Console

    console = Console(stderr=True, record=True, width=200)
    train(tiny_config(tmp_path / "run", max_steps=1), progress=False, console=console)
    assert "qlora" not in console.export_text()


def test_metrics_log_the_learning_rate_each_step_used(tmp_path):
    from memfit.train.config import lr_factor

    result = train(
        tiny_config(tmp_path / "run", max_steps=6, warmup_steps=3, lr=6e-3, schedule="cosine"), progress=False
    )
    assert result.status == "completed"
    logged = {r["step"]: r["lr"] for r in read_metrics(tmp_path / "run") if "lr" in r}
    assert logged[1] == 6e-3 * (1 / 3)  # the first warmup step takes a third of the peak, not two thirds
    for step, lr in logged.items():  # step k ran with the schedule's value after k - 1 steps
        assert lr == pytest.approx(6e-3 * lr_factor(step - 1, total=6, warmup=3, schedule="cosine"), rel=1e-12), step


def test_every_record_carries_the_trainers_fractional_epoch(tmp_path):
    lines = (REPO / "src" / "memfit" / "assets" / "data" / "tiny-instruct.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "ten.jsonl").write_text("".join(lines[:10]))
    (tmp_path / "held-out.jsonl").write_text("".join(lines[10:12]))
    # 10 examples in batches of 4: 3 batches an epoch (4, 4, 2), so 2 epochs are 6 steps.
    config = tiny_config(
        tmp_path / "run",
        data=[str(tmp_path / "ten.jsonl")],
        eval_data=[str(tmp_path / "held-out.jsonl")],
        max_steps=None,
        epochs=2,
        batch_size=4,
        eval_every=2,
        log_every=1,
        eval_prompts=["Hi"],
        eval_max_new_tokens=2,
    )
    result = train(config, progress=False)
    assert result.status == "completed" and result.step == 6
    records = read_metrics(tmp_path / "run")
    kinds = {"train": "loss", "eval": "eval_loss", "replies": "generations", "end": "train_runtime"}
    assert {kind: sum(key in r for r in records) for kind, key in kinds.items()} == {
        "train": 6,
        "eval": 3,
        "replies": 3,
        "end": 1,
    }
    for record in records:
        # The Trainer's epoch + (batch + 1) / batches_per_epoch, after the step's last batch.
        step = record["step"]
        assert list(record)[:2] == ["step", "epoch"], record
        assert record["epoch"] == pytest.approx((step - 1) // 3 + ((step - 1) % 3 + 1) / 3, rel=1e-12), record
    assert records[-1]["epoch"] == 2.0


def test_a_completed_run_ends_with_the_trainers_end_of_run_record(tmp_path):
    ticks: list[float] = []

    def clock():  # a clock that moves 2.5 s a reading, however fast the machine
        ticks.append(2.5 * len(ticks))
        return ticks[-1]

    config = tiny_config(tmp_path / "run", max_steps=5, batch_size=4, grad_accum=2, log_every=2)
    result = train(config, progress=False, clock=clock)
    records = read_metrics(tmp_path / "run")
    last = records[-1]
    runtime = ticks[-1] - ticks[0]
    assert runtime > 0 and last["train_runtime"] == runtime
    # 5 steps of 4 x 2 examples in that time, rounded as the Trainer's speed_metrics rounds them.
    assert last["train_samples_per_second"] == round(5 * 8 / runtime, 3)
    assert last["train_steps_per_second"] == round(5 / runtime, 3)
    # The mean over every step, logged or not (log_every=2 logs steps 2, 4 and the last).
    assert [r["step"] for r in records if "loss" in r] == [2, 4, 5]
    assert last["train_loss"] == pytest.approx(_mean(loss for _, loss in result.losses), rel=1e-12)
    assert len(result.losses) == 5
    assert "total_flos" not in last  # no honest count of what these steps compute
    assert result.metrics == {k: v for k, v in last.items() if k not in ("step", "epoch")}
    assert last["step"] == 5 and list(last)[:2] == ["step", "epoch"]
    # elapsed_s reads the same clock: since the loop began.
    assert all(r["elapsed_s"] in [t - ticks[0] for t in ticks] for r in records if "loss" in r)


def test_an_interrupted_run_writes_no_end_of_run_record(tmp_path, monkeypatch):
    import os
    import signal

    real_step = step_module.train_step

    def step_then_signal(*args, **kwargs):
        out = real_step(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGINT)
        return out

    monkeypatch.setattr(step_module, "train_step", step_then_signal)
    result = train(tiny_config(tmp_path / "run", max_steps=3, log_every=1), progress=False)
    assert result.status == "interrupted" and result.metrics == {}
    assert not any("train_runtime" in r for r in read_metrics(tmp_path / "run"))
