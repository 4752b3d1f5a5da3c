"""memfit plan CONFIG and memfit fit CONFIG --write: what a user of Axolotl, LLaMA-Factory or TRL types and reads."""

from __future__ import annotations

import json
import textwrap

import pytest
from typer.testing import CliRunner

from memfit.cli import app

runner = CliRunner()


@pytest.fixture
def model_folder(tmp_path, tiny_llama):
    folder = tmp_path / "tiny"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(tiny_llama))
    return folder


def _write(tmp_path, name: str, text: str):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return path


def test_plan_says_which_tool_s_config_it_read_and_what_is_not_modelled(tmp_path, model_folder):
    config = _write(
        tmp_path,
        "sft.yaml",
        f"""
        model_name_or_path: {model_folder}
        use_peft: true
        lora_r: 4
        use_dora: true
        torch_compile: true
        max_length: 64
        dtype: float32
        bf16: false
        per_device_train_batch_size: 1
        my_setting: 3
    """,
    )
    result = runner.invoke(app, ["plan", str(config), "--no-cache"])
    assert result.exit_code == 0, result.output
    assert f"read TRL / Hugging Face TrainingArguments config {config}" in result.output
    assert "not modelled: torch_compile" in result.output and "unknown key, ignored: my_setting" in result.output
    assert "lora r=4 DoRA" in result.output  # use_dora is planned
    data = json.loads(runner.invoke(app, ["plan", str(config), "--json", "--no-cache"]).stdout)
    assert data["details"]["config"]["tool"] == "trl" and data["spec"]["recipe"] == "hf" and data["spec"]["rank"] == 4
    assert data["spec"]["dora"] is True and data["details"]["config"]["not_modelled"][0]["key"] == "torch_compile"


@pytest.mark.parametrize(
    "text, expected",
    [
        (
            "base_model: {model}\noptimizer: adamw_torhc\n",
            "optimizer: 'adamw_torhc' is not an optimizer name the Trainer knows. Did you mean 'adamw_torch'?",
        ),
        (
            "model_name_or_path: {model}\nfinetuning_type: full\ndeepspeed: nowhere.json\n",
            "deepspeed: 'nowhere.json' does not exist",
        ),
        ("epochs: 3\nmy_setting: 1\n", "cannot tell which tool this config is for"),
        (
            "model_name_or_path: {model}\nstage: dpo\npref_loss: unknownloss\n",
            "pref_loss: 'unknownloss' is not a pref_loss LLaMA-Factory knows (sigmoid, hinge, ipo, kto_pair, orpo, simpo). Did you "
            "mean 'orpo'?",
        ),
        ("base_model: {model}\nadapter: lora\nrl: dpoo\n", "rl: 'dpoo' is not an RL trainer Axolotl knows"),
        (
            "model_name_or_path: {model}\nuse_peft: true\nloss_type: bogus\n",
            "loss_type: 'bogus' is not a loss_type TRL's",
        ),
        ("model_name_or_path: {model}\nfinetuning_type: full\ndeepspeed: {model}\n", "is a folder"),
    ],
    ids=[
        "typo-value",
        "missing-deepspeed",
        "unknown-tool",
        "lf-pref-loss",
        "axolotl-rl",
        "trl-loss-type",
        "deepspeed-folder",
    ],
)
def test_bad_configs_are_one_clear_error_naming_the_key_and_the_file(tmp_path, model_folder, text, expected):
    config = _write(tmp_path, "run.yaml", text.format(model=model_folder))
    for command in (["plan", str(config)], ["fit", str(config), "--gpu", "rtx-4090"]):
        result = runner.invoke(app, command)
        assert result.exit_code == 2, result.output
        assert f"error: cannot plan {config}" in result.output and expected in " ".join(result.output.split())
        assert "Traceback" not in result.output


def test_fit_write_refuses_the_input_as_output(tmp_path, model_folder):
    config = _write(tmp_path, "axolotl.yml", f"base_model: {model_folder}\nadapter: lora\n")
    before = config.read_text()
    for extra in ([], ["--overwrite"]):
        result = runner.invoke(app, ["fit", str(config), "--budget", "2GiB", "--write", str(config), *extra])
        assert result.exit_code == 2 and "plan 1" not in result.output  # before any search
        assert "is the config being fitted, which this command reads" in " ".join(result.stderr.split())
    assert config.read_text() == before


def test_fit_write_keeps_a_json_config_s_bytes_and_writes_the_format_its_name_says(tmp_path, model_folder):
    text = (
        f'{{"model_name_or_path": "{model_folder}", "use_peft": true, "learning_rate": 2e-5, "max_length": 64, '
        '"bf16": false, "gradient_checkpointing": true, "per_device_train_batch_size": 1, "gradient_accumulation_steps": 4}\n'
    )
    config = tmp_path / "trl.json"
    config.write_text(text)
    out = tmp_path / "not" / "yet" / "fitted.json"  # a folder that does not exist yet is made
    result = runner.invoke(app, ["fit", str(config), "--budget", "4GiB", "--write", str(out), "--no-cache"])
    assert result.exit_code == 0, result.output
    written = out.read_text()
    assert written.count("\n") == 1 and '"learning_rate": 2e-5' in written  # one line, 2e-5 as written
    assert written == text.replace('"per_device_train_batch_size": 1', '"per_device_train_batch_size": 4').replace(
        '"gradient_accumulation_steps": 4', '"gradient_accumulation_steps": 1'
    ).replace('"gradient_checkpointing": true', '"gradient_checkpointing": false'), written
    yaml_config = _write(
        tmp_path, "axolotl.yml", f"base_model: {model_folder}\nadapter: lora\nsequence_len: 64\nbf16: false\n"
    )
    result = runner.invoke(
        app, ["fit", str(yaml_config), "--budget", "4GiB", "--write", str(tmp_path / "axolotl.json"), "--no-cache"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "axolotl.json").read_text())["adapter"] == "lora"  # JSON in the .json file


def test_fit_write_prints_the_diff_and_writes_the_tool_s_config(tmp_path, model_folder):
    config = _write(
        tmp_path,
        "axolotl.yml",
        f"""
        base_model: {model_folder}   # local
        adapter: lora
        lora_r: 8
        sequence_len: 64
        micro_batch_size: 1
        gradient_accumulation_steps: 4
        gradient_checkpointing: true
        bf16: false
    """,
    )
    out = tmp_path / "fitted.yml"
    result = runner.invoke(app, ["fit", str(config), "--budget", "4GiB", "--write", str(out), "--no-cache"])
    assert result.exit_code == 0, result.output
    assert f"--- {config}" in result.output and f"+++ {out}" in result.output
    assert "+micro_batch_size: 4" in result.output and "+gradient_accumulation_steps: 1" in result.output
    assert "# local" in out.read_text() and "micro_batch_size: 4" in out.read_text()


def test_plan_and_fit_take_memfit_s_own_training_yaml(tmp_path):
    import yaml

    from memfit.train.config import demo_dataset_path

    config = tmp_path / "run.yaml"
    config.write_text(
        "# my run\n"
        + yaml.safe_dump(
            {
                "model": "smollm2-135m",
                "init": "random",
                "data": str(demo_dataset_path()),
                "method": "lora",
                "rank": 4,
                "precision": "fp32",
                "batch_size": 8,
                "grad_accum": 1,
                "seq_len": 128,
                "checkpointing": "on",
                "model_overrides": {
                    "num_hidden_layers": 2,
                    "hidden_size": 32,
                    "intermediate_size": 64,
                    "num_attention_heads": 4,
                    "num_key_value_heads": 2,
                    "vocab_size": 512,
                    "max_position_embeddings": 256,
                },
            },
            sort_keys=False,
        )
    )
    result = runner.invoke(app, ["plan", str(config), "--no-cache"])
    assert result.exit_code == 0, result.output
    assert f"read memfit training config {config}: model smollm2-135m with model_overrides" in result.output
    assert (
        "data: " in result.output
        and "training examples read; planned at the data's longest micro-batch" in result.output
    )
    out = tmp_path / "fitted.yaml"
    # With room to spare, the fastest fit recomputes nothing: checkpointing off, the effective batch kept.
    result = runner.invoke(app, ["fit", str(config), "--budget", "2GiB", "--write", str(out), "--no-cache"])
    assert result.exit_code == 0, result.output
    assert (
        f"--- {config}" in result.output and "-checkpointing: 'on'\n+checkpointing: 'off'" in result.output
    )  # quoted as written
    assert out.read_text().startswith("# my run")
    before, after = yaml.safe_load(config.read_text()), yaml.safe_load(out.read_text())
    assert {k for k in before if before[k] != after[k]} == {"checkpointing"}


def test_model_plans_another_model_in_place_of_the_config_s(tmp_path, model_folder):
    config = _write(
        tmp_path,
        "sft.yaml",
        "model_name_or_path: org/elsewhere\nuse_peft: true\ndtype: float32\nbf16: false\n"
        "max_length: 64\nper_device_train_batch_size: 1\n",
    )
    result = runner.invoke(app, ["plan", str(config), "--model", str(model_folder), "--json", "--no-cache"])
    assert result.exit_code == 0, result.output
    read = json.loads(result.stdout)["details"]["config"]
    assert read["model"] == str(model_folder) and read["replaced"] == "org/elsewhere" and read["given_model"]
    result = runner.invoke(app, ["plan", "smollm2-135m", "--model", str(model_folder)])
    assert result.exit_code == 2 and "--model: replaces the model of a training config" in result.output
