"""Loading the model to talk to: a run folder as the run loaded it, a model with an adapter, refusals."""

from __future__ import annotations

import json
import shutil

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from memfit.infer.loading import ChatError, adapter_mismatch, load_chat_model  # noqa: E402


def _copy_run(demo_run, tmp_path, **changes):
    """A copy of the demo run whose run.json has ``changes`` (dotted keys reach into config)."""
    run = tmp_path / "run"
    shutil.copytree(demo_run, run)
    record = json.loads((run / "run.json").read_text())
    for key, value in changes.items():
        if key.startswith("config."):
            record["config"][key.removeprefix("config.")] = value
        else:
            record[key] = value
    (run / "run.json").write_text(json.dumps(record))
    return run


def _eval_loss(chat_model, run_dir):
    """The run's evaluation loss, computed with the loaded model as the trainer computes it."""
    from memfit.models.build import make_config
    from memfit.step.builder import build_step
    from memfit.train.config import validate_config
    from memfit.train.evaluation import evaluate
    from memfit.train.examples import pad_token_id, prepare_examples

    record = json.loads((run_dir / "run.json").read_text())
    config = validate_config(record["config"])
    _, eval_examples = prepare_examples(config, chat_model.tokenizer)
    step = build_step(config.spec, make_config(record["model_config"]))
    pad_id = pad_token_id(chat_model.tokenizer)
    return evaluate(
        chat_model.model,
        eval_examples,
        config.batch_size,
        lambda batch: step.collate(batch, pad_id),
        chat_model.device,
        step.loss,
    )


def test_a_random_init_run_is_rebuilt_exactly_as_it_trained(demo_run):
    # The base weights of an init: random run were never saved: they are drawn again from the run's
    # seed. The run's own last evaluation loss comes out to the last bit.
    chat_model = load_chat_model(str(demo_run), device="cpu")
    recorded = [json.loads(line) for line in (demo_run / "metrics.jsonl").read_text().splitlines()]
    last_eval = [r["eval_loss"] for r in recorded if "eval_loss" in r][-1]
    assert _eval_loss(chat_model, demo_run) == last_eval
    assert not chat_model.model.training
    assert "random weights from seed 0" in chat_model.description


def test_another_seed_gives_another_model(demo_run, tmp_path):
    # The check above can fail: with the seed changed the base is another one, and so is the loss.
    run = _copy_run(demo_run, tmp_path, **{"config.seed": 1})
    chat_model = load_chat_model(str(run), device="cpu")
    recorded = [json.loads(line) for line in (demo_run / "metrics.jsonl").read_text().splitlines()]
    assert _eval_loss(chat_model, run) != [r["eval_loss"] for r in recorded if "eval_loss" in r][-1]


def test_a_run_without_its_adapter_says_what_it_lacks_and_what_to_do_in_one_line(demo_run, tmp_path):
    run = _copy_run(demo_run, tmp_path, status="interrupted", step=2, total_steps=4)
    shutil.rmtree(run / "adapter")
    with pytest.raises(ChatError) as err:
        load_chat_model(str(run), device="cpu")
    assert str(err.value) == (
        f"{run} has no adapter saved yet: the run has not reached a save (the adapter is written when it completes; its "
        f"status is 'interrupted', step 2 of 4). To chat with it, finish it first: memfit train CONFIG -o {run} --resume."
    )
    shutil.rmtree(run / "checkpoints")  # nothing to resume: --resume is not advised
    with pytest.raises(
        ChatError, match="To chat with it, train it again: it saved no checkpoint to resume from"
    ) as err:
        load_chat_model(str(run), device="cpu")
    assert "--resume" not in str(err.value) and "\n" not in str(err.value)


def test_a_completed_run_whose_adapter_is_gone_is_not_told_to_train_until_it_completes(demo_run, tmp_path):
    run = _copy_run(demo_run, tmp_path)
    shutil.rmtree(run / "adapter")
    with pytest.raises(ChatError) as err:
        load_chat_model(str(run), device="cpu")
    assert str(err.value) == (
        f"{run} has no adapter/ although the run completed: its adapter was moved or deleted. Put it "
        f"back in {run / 'adapter'}, or pass the base model with --adapter FOLDER."
    )


def test_a_full_fine_tune_without_its_model_folder_says_so(tmp_path):
    from memfit.infer.loading import missing_output

    record = {"status": "running", "step": 1, "total_steps": 4, "spec": {"method": "full"}}
    line = missing_output(tmp_path, record, tmp_path / "model", adapters=False)
    assert line == (
        f"{tmp_path} has no model/ yet: a full fine-tune saves its whole model there when the run completes, and "
        "this one has not (its status is 'running', step 1 of 4). To chat with it, if it is still training, wait "
        "for it to end; otherwise train it again: it saved no checkpoint to resume from."
    )


def test_a_pretrained_run_whose_base_is_gone_is_refused(demo_run, tmp_path):
    run = _copy_run(demo_run, tmp_path, **{"config.init": "pretrained", "config.model": str(tmp_path / "moved-away")})
    with pytest.raises(
        ChatError, match=r"its base model '.*moved-away' is not on this machine; put the base model back"
    ):
        load_chat_model(str(run), device="cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_a_random_init_gpu_run_is_refused_without_a_gpu(demo_run, tmp_path):
    run = _copy_run(demo_run, tmp_path, device="cuda:0")
    with pytest.raises(ChatError, match=r"drawn on a GPU; the same seed draws other numbers on a CPU"):
        load_chat_model(str(run), device="cpu")


def test_run_folder_options_that_do_not_apply_are_refused(demo_run):
    with pytest.raises(ChatError, match=r"--adapter: .* is a run folder"):
        load_chat_model(str(demo_run), adapter=str(demo_run / "adapter"))
    with pytest.raises(ChatError, match=r"--dtype: .* loaded in the precision it trained in"):
        load_chat_model(str(demo_run), dtype="bf16")


def _save_model(folder, **sizes):
    """A tiny Llama saved as a Hugging Face folder (safetensors and the shipped tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from memfit.models.build import make_config
    from memfit.models.catalog import load_catalog_config
    from memfit.train.data import tiny_tokenizer_path

    config = dict(
        load_catalog_config("smollm2-135m"),
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    config.update(sizes)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(make_config(config), dtype=torch.float32)
    model.save_pretrained(str(folder))
    AutoTokenizer.from_pretrained(str(tiny_tokenizer_path())).save_pretrained(str(folder))
    return folder


def test_a_model_with_an_adapter_is_the_peft_model(tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    base = _save_model(tmp_path / "base")
    peft_model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(str(base)), LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    )
    for name, param in peft_model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.5)  # a trained adapter: B is no longer zero
    peft_model.save_pretrained(str(tmp_path / "adapter"))

    chat_model = load_chat_model(str(base), adapter=str(tmp_path / "adapter"), device="cpu")
    assert isinstance(chat_model.model, PeftModel) and not chat_model.model.training
    ids = torch.tensor([[0, 5, 9, 33, 80]])
    reference = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(str(base)), str(tmp_path / "adapter")
    ).eval()
    plain = AutoModelForCausalLM.from_pretrained(str(base)).eval()
    with torch.no_grad():
        got = chat_model.model(input_ids=ids).logits
        assert torch.equal(got, reference(input_ids=ids).logits)
        assert not torch.allclose(got, plain(input_ids=ids).logits)  # the adapter is on


def test_an_adapter_for_another_model_is_refused(demo_run, tmp_path):
    other = _save_model(tmp_path / "wider", hidden_size=96, intermediate_size=192)
    with pytest.raises(
        ChatError,
        match=r"--adapter .*: made for another model than .*wider \(.*lora_[AB].weight has shape "
        r"\(\d+, \d+\), but model\.layers\.0\.\S+ is \d+ -> \d+\); pass the base model",
    ):
        load_chat_model(str(other), adapter=str(demo_run / "adapter"), device="cpu")
    same = _save_model(tmp_path / "same")
    from transformers import AutoModelForCausalLM

    assert adapter_mismatch(AutoModelForCausalLM.from_pretrained(str(same)), demo_run / "adapter") is None
    deeper = _save_model(tmp_path / "one-layer", num_hidden_layers=1)
    assert "model.layers.1." in adapter_mismatch(
        AutoModelForCausalLM.from_pretrained(str(deeper)), demo_run / "adapter"
    )


def test_sources_that_are_not_models_are_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ChatError, match="a folder without config.json or run.json"):
        load_chat_model(str(tmp_path / "empty"))
    with pytest.raises(ChatError, match="is not a run folder, a model folder or a Hugging Face Hub id"):
        load_chat_model(str(tmp_path / "missing"))
    base = _save_model(tmp_path / "base")
    with pytest.raises(ChatError, match=r"--adapter .* has no adapter_config.json"):
        load_chat_model(str(base), adapter=str(tmp_path / "empty"))
    with pytest.raises(ChatError, match=r"--dtype 'int8': use one of bf16, fp16, fp32"):
        load_chat_model(str(base), dtype="int8")


def test_a_full_fine_tuning_run_is_its_model_folder(tmp_path):
    from chat_helpers import EVAL_MAX_NEW_TOKENS, train_demo

    from memfit.train.generation import Sampling, generate_reply

    run = train_demo(tmp_path / "full", method="full", max_steps=2, eval_every=0)
    chat_model = load_chat_model(str(run), device="cpu")
    assert f"{run} (full fine-tuning, {run / 'model'})" in chat_model.description
    assert next(chat_model.model.parameters()).dtype == torch.float32  # the run's precision
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in metrics if "generations" in r][-1]
    for generation in last["generations"]:
        reply = generate_reply(
            chat_model.model,
            chat_model.tokenizer,
            generation["messages"],
            Sampling(max_new_tokens=EVAL_MAX_NEW_TOKENS),
            chat_model.device,
        )
        assert reply.text == generation["generation"]
