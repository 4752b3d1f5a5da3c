"""The command line: what a user types, what they read. Bad input exits 2 with a message, no traceback."""

import json

from typer.testing import CliRunner

from memfit.cli import app

runner = CliRunner()


def test_plan_default_model_runs():
    result = runner.invoke(app, ["plan"])
    assert result.exit_code == 0, result.output
    assert "smollm2-135m" in result.output and "device total" in result.output


def test_plan_json(tmp_path):
    config = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 512}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    result = runner.invoke(app, ["plan", str(path), "--method", "lora", "--rank", "8", "--seq-len", "64", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["spec"]["rank"] == 8 and data["spec"]["method"] == "lora"
    assert sum(data["categories"].values()) == data["peak"]["device_total_bytes"]


def test_plan_against_gpu_says_fit():
    result = runner.invoke(app, ["plan", "smollm2-135m", "--method", "qlora", "--seq-len", "512", "--gpu", "rtx-4090"])
    assert result.exit_code == 0, result.output
    assert "fits rtx-4090" in result.output


def test_plan_bad_input_is_one_clear_error():
    result = runner.invoke(app, ["plan", "lama-3-8b", "--rank", "0"])
    assert result.exit_code == 2
    assert "Did you mean" in result.output and "--rank: 0 must be 1 or more" in result.output
    assert "Traceback" not in result.output


def test_plan_bad_choice():
    result = runner.invoke(app, ["plan", "--method", "lorra"])
    assert result.exit_code == 2
    assert "lorra" in result.output


def test_models_lists_catalogs():
    result = runner.invoke(app, ["models", "--json"])
    assert result.exit_code == 0
    data = json.loads(result.stdout)
    assert any(m["name"] == "llama-3.1-8b" for m in data["models"])
    assert any(g["name"] == "h100-80gb" for g in data["gpus"])
