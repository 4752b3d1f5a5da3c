"""The command line of preference training: --objective on plan, fit and train; its errors in one line."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from memfit.cli import app

runner = CliRunner()

TINY = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 512,
}


def test_plan_objective_dpo_names_the_reference(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    result = runner.invoke(
        app, ["plan", str(path), "--objective", "dpo", "--method", "full", "--seq-len", "32", "--json"]
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["spec"]["objective"] == "dpo" and "frozen copy" in data["details"]["reference"]
    shown = runner.invoke(app, ["plan", str(path), "--objective", "dpo", "--seq-len", "32"])
    assert (
        "dpo (batch counts pairs)" in shown.output
        and "reference: the base model with its LoRA adapters disabled" in shown.output
    )


def test_a_bad_objective_combination_is_one_line_and_exit_2():
    result = runner.invoke(app, ["plan", "smollm2-135m", "--objective", "orpo", "--precompute-reference"])
    assert result.exit_code == 2
    assert "--precompute-reference: only --objective dpo has a reference model" in result.output
    assert "Traceback" not in result.output


def test_fit_and_train_take_the_objective_and_train_its_loss_parameters():
    fit_help = runner.invoke(app, ["fit", "--help"]).output
    assert "--objective" in fit_help and "--precompute-reference" in fit_help
    train_help = runner.invoke(app, ["train", "--help"]).output
    for option in ("--objective", "--beta", "--loss-type", "--simpo-gamma", "--cpo-alpha"):
        assert option in train_help, option


def test_train_refuses_a_loss_parameter_of_another_objective_before_any_work(tmp_path):
    data = tmp_path / "pairs.jsonl"
    data.write_text(json.dumps({"prompt": "Hi", "chosen": " a", "rejected": " b"}) + "\n")
    config = tmp_path / "run.yaml"
    config.write_text(f"model: smollm2-135m\ninit: random\ndata: {data}\nobjective: orpo\nloss_type: ipo\n")
    result = runner.invoke(app, ["train", str(config), "--beta", "-1"])
    assert result.exit_code == 2
    assert (
        "loss_type: applies to objective: dpo" in result.output
        and "beta: -1.0 must be a positive number" in result.output
    )
    assert not (tmp_path / "runs").exists()
