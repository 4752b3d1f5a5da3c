"""Reading another tool's config: which tool, unknown keys, and one clear error per bad key."""

from __future__ import annotations

import json

import pytest

from memfit.errors import EXIT_BAD_INPUT
from memfit.interop import is_tool_config, read_tool_config
from memfit.interop.reading import ToolConfigError


@pytest.mark.parametrize(
    "name, text, tool",
    [
        ("a.yml", "base_model: org/model\nmicro_batch_size: 2\n", "axolotl"),
        ("l.yaml", "model_name_or_path: org/model\nstage: sft\nfinetuning_type: lora\n", "llama-factory"),
        ("t.yaml", "model_name_or_path: org/model\nuse_peft: true\nlora_r: 8\n", "trl"),
        # The Trainer's arguments alone (with a model): a plain TrainingArguments config.
        ("h.yaml", "model_name_or_path: org/model\nper_device_train_batch_size: 2\nlearning_rate: 1.0e-4\n", "trl"),
    ],
)
def test_the_tool_is_told_apart_by_its_own_keys(write_config, name, text, tool):
    assert read_tool_config(write_config(name, text)).tool == tool


def test_a_file_of_no_tool_is_refused_naming_the_file(write_config):
    path = write_config("mine.yaml", "epochs: 3\nmy_setting: 1\n")
    with pytest.raises(ToolConfigError) as err:
        read_tool_config(path)
    assert str(path) in str(err.value) and "cannot tell which tool" in str(err.value)
    assert err.value.exit_code == EXIT_BAD_INPUT


def test_memfit_s_own_training_config_is_told_apart_and_pointed_to_its_planner(write_config):
    from memfit.interop import is_memfit_config

    path = write_config("mine.yaml", "model: llama-3.2-1b\ndata: train.jsonl\nepochs: 3\n")
    with pytest.raises(
        ToolConfigError, match=r"is memfit's own training config .*memfit.train.config_plan.plan_train_config"
    ):
        read_tool_config(path)
    assert is_memfit_config({"model": "x", "data": "d"}) and is_memfit_config({"model": "x", "lr": 1e-4})
    # A tool's config names its model with its own key: a stray `model` key does not make it memfit's.
    assert not is_memfit_config({"model": "x", "base_model": "org/m"}) and not is_memfit_config({"data": "d"})


def test_a_deepspeed_json_passed_as_the_config_says_what_to_pass(write_config):
    path = write_config("ds.json", {"zero_optimization": {"stage": 2}})
    with pytest.raises(ToolConfigError, match="is a DeepSpeed config: pass the training config that names it"):
        read_tool_config(path)


def test_unknown_keys_are_reported_once_with_the_closest_known_key(write_config):
    config = read_tool_config(
        write_config(
            "a.yml",
            """
        base_model: org/model
        micro_batch_sise: 3
        my_own_note: hello
        wandb_project: runs
    """,
        )
    )
    assert config.unknown_keys == ["micro_batch_sise (did you mean micro_batch_size?)", "my_own_note"]
    assert config.knobs["batch_size"] == 1  # the typo'd key changed nothing


def test_every_bad_value_is_one_line_naming_its_key_and_the_file(write_config):
    path = write_config(
        "a.yml",
        """
        base_model: org/model
        optimizer: adamw_torhc
        micro_batch_size: two
        lora_dropout: 1.5
    """,
    )
    with pytest.raises(ToolConfigError) as err:
        read_tool_config(path)
    problems = err.value.problems
    assert str(path) in str(err.value)
    assert problems == [
        "lora_dropout: 1.5 must be in [0, 1)",
        "micro_batch_size: 'two' is not a whole number",
        "optimizer: 'adamw_torhc' is not an optimizer name the Trainer knows. Did you mean 'adamw_torch'?",
    ]


def test_a_config_without_a_model_says_which_key_names_it(write_config):
    with pytest.raises(ToolConfigError, match="model_name_or_path: not set"):
        read_tool_config(write_config("l.yaml", "stage: sft\nfinetuning_type: lora\n"))


def test_a_missing_deepspeed_file_names_the_key_and_the_file(write_config):
    path = write_config("l.yaml", "model_name_or_path: org/model\nfinetuning_type: full\ndeepspeed: ds_z9.json\n")
    with pytest.raises(ToolConfigError) as err:
        read_tool_config(path)
    assert str(path) in str(err.value)
    assert err.value.problems[0].startswith("deepspeed: 'ds_z9.json' does not exist")


def test_what_memfit_refuses_is_named_by_the_config_s_keys(write_config):
    # Full fine-tuning in pure fp16: memfit's own check, said with Axolotl's keys.
    path = write_config("a.yml", "base_model: org/model\nbf16: false\nfp16: true\n")
    with pytest.raises(ToolConfigError) as err:
        read_tool_config(path)
    assert err.value.problems[0].startswith("bf16, fp16 (memfit precision): fp16 is not supported for method: full")


def test_yaml_that_does_not_parse_names_the_line(write_config):
    with pytest.raises(ToolConfigError, match=r"is not valid YAML \(line 3\): mapping values are not allowed here"):
        read_tool_config(write_config("a.yml", "base_model: org/model\nlora_r: 8\n  lora_alpha: 16\n"))


def test_command_line_knobs_win_and_a_shard_mode_needs_several_gpus(write_config):
    ds = write_config("ds.json", {"zero_optimization": {"stage": 2}})
    config = read_tool_config(
        write_config("a.yml", f"base_model: org/model\nmicro_batch_size: 4\ndeepspeed: {ds.name}\n")
    )
    knobs, dropped = config.knobs_for({"batch_size": 2, "rank": None})
    assert knobs["batch_size"] == 2 and "shard" not in knobs
    assert [d.key for d in dropped] == ["deepspeed"] and "--gpus N" in dropped[0].why
    knobs, dropped = config.knobs_for({"gpus": 4})
    assert knobs["shard"] == "zero2" and dropped == []
    knobs, _ = config.knobs_for({"gpus": 4, "shard": "fsdp"})
    assert knobs["shard"] == "fsdp"


def test_a_model_config_json_is_a_model_not_a_tool_config(write_config, tiny_model):
    assert not is_tool_config(tiny_model / "config.json")
    assert not is_tool_config(str(tiny_model))
    assert not is_tool_config("meta-llama/Llama-3.1-8B")
    assert is_tool_config(write_config("args.json", {"model_name_or_path": "x", "per_device_train_batch_size": 1}))
    assert is_tool_config(write_config("a.yml", "base_model: x\n"))


def test_the_plan_json_of_a_config_holds_what_was_read(write_config):
    config = read_tool_config(write_config("a.yml", "base_model: org/model\ngptq: true\nadapter: lora\n"))
    data = json.loads(json.dumps(config.to_dict()))
    assert data["tool"] == "axolotl" and data["model"] == "org/model"
    assert data["knobs"]["method"] == "lora" and data["knobs"]["recipe"] == "hf"
    assert data["keys"]["method"] == ["adapter", "gptq"]
    assert [item["key"] for item in data["not_modelled"]] == ["adapter, gptq"]
    assert "GPTQ-quantized base" in data["not_modelled"][0]["why"]
