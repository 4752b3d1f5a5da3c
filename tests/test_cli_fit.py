"""`memfit fit` end to end: the table, JSON, and a --write YAML that `memfit train` runs unchanged."""

import json

from typer.testing import CliRunner

from memfit.cli import app

runner = CliRunner()

TINY = {
    "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 512,
    "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
}


def test_fit_json_and_write_trains(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY))
    out = tmp_path / "best.yaml"
    result = runner.invoke(app, ["fit", str(config), "--budget", "2GiB", "--batch-size", "2", "--seq-len", "64",
                                 "--method", "lora", "--json", "--write", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["fits"] and data["max_seq_len"]["lora"] == 512  # capped by max_position_embeddings
    assert out.exists()

    from memfit.train.config import load_config
    from memfit.train.recipe import train

    cfg = load_config(out, overrides={"max_steps": 2, "device": "cpu", "output_dir": str(tmp_path / "run"),
                                      "precision": "fp32", "budget": None})
    assert cfg.method == "lora" and cfg.batch_size * cfg.grad_accum == 2
    train(cfg, progress=False)
    assert (tmp_path / "run" / "adapter" / "adapter_config.json").exists()


def test_write_refuses_to_overwrite(tmp_path):
    out = tmp_path / "best.yaml"
    out.write_text("mine\n")
    result = runner.invoke(app, ["fit", "smollm2-135m", "--budget", "4GiB", "--batch-size", "1", "--seq-len", "128",
                                 "--method", "qlora", "--write", str(out)])
    assert result.exit_code == 2
    assert "exists" in result.output
    assert out.read_text() == "mine\n"


def test_fit_without_target_is_a_clear_error():
    result = runner.invoke(app, ["fit", "smollm2-135m"])
    assert result.exit_code == 2 and "--gpu NAME or --budget SIZE" in result.output
