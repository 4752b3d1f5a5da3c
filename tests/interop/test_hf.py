"""TRL's and the Trainer's keys (SFTConfig, DPOConfig, ModelConfig, TrainingArguments), read into memfit's knobs."""

from __future__ import annotations

import textwrap

import pytest

from memfit.interop import read_tool_config
from memfit.spec import make_spec


def _read(write_config, text: str, name: str = "trl.yaml"):
    return read_tool_config(write_config(name, "model_name_or_path: org/model\n" + textwrap.dedent(text).lstrip("\n")))


def test_trl_defaults_are_planned_when_keys_are_absent(write_config):
    # TRL: checkpointing on, bf16 on a model loaded in float32 (mixed), 1,024 tokens, batch 8.
    config = _read(write_config, "dataset_name: trl-lib/Capybara\ndataset_text_field: text\n")
    assert config.knobs == {"recipe": "hf", "method": "full", "seq_len": 1024, "batch_size": 8, "grad_accum": 1,
                            "checkpointing": "on", "optimizer": "adamw", "precision": "fp32", "max_grad_norm": 1.0,
                            "hf_loss": "chunked-nll"}
    (mixed,) = config.not_modelled
    assert mixed.key == "bf16 (not set)"
    assert "float32" in mixed.why and "bf16-mixed" in mixed.why
    assert [f.key for f in config.approximated] == ["loss_type (not set)"]


def test_an_sft_lora_config_maps_every_memory_key(write_config):
    config = _read(write_config, """
        dtype: bfloat16
        attn_implementation: flash_attention_2
        use_peft: true
        lora_r: 32
        lora_alpha: 64
        lora_dropout: 0.0
        lora_target_modules: all-linear
        max_length: 4096
        packing: true
        padding_free: true
        per_device_train_batch_size: 2
        gradient_accumulation_steps: 4
        gradient_checkpointing: true
        bf16: true
        optim: adamw_8bit
        use_liger_kernel: true
    """)
    assert config.knobs == {
        "recipe": "hf", "method": "lora", "rank": 32, "alpha": 64.0, "dropout": 0.0, "targets": ("all-linear",),
        "seq_len": 4096, "batch_size": 2, "grad_accum": 4, "checkpointing": "on", "optimizer": "adamw8bit",
        "precision": "bf16", "max_grad_norm": 1.0, "padding_free": "on", "packing": True, "hf_loss": "liger",
    }
    assert config.not_modelled == [] and config.approximated == []


def test_qlora_and_peft_s_default_targets(write_config):
    config = _read(write_config, "use_peft: true\nload_in_4bit: true\ndtype: bfloat16\n")
    assert config.knobs["method"] == "qlora" and config.knobs["targets"] == ("q_proj", "v_proj")
    assert any(f.key == "lora_target_modules (not set)" for f in config.approximated)
    assert config.knobs["kbit_upcast"] is False and any("TRL since 0.26" in f.why for f in config.approximated)


def test_a_dpo_config_is_preference_training_not_modelled(write_config):
    config = _read(write_config, "beta: 0.1\nmax_length: 1024\nuse_peft: true\ndtype: bfloat16\n")
    assert any("preference training" in f.why and "objective" in f.why for f in config.not_modelled)
    assert "hf_loss" not in config.knobs  # DPO's loss is the model's, over both completions


def test_plain_training_arguments_json(write_config):
    # No TRL key but the model: the Trainer's own defaults (checkpointing off, no bf16), no length.
    config = read_tool_config(write_config("args.json", {
        "model_name_or_path": "org/model", "output_dir": "out", "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 2, "fsdp": "full_shard auto_wrap offload", "fsdp_config": {"fsdp_version": 2},
    }))
    assert config.tool == "trl" and config.shard == "fsdp-offload"
    assert config.knobs["checkpointing"] == "off" and config.knobs["precision"] == "fp32"
    assert "seq_len" not in config.knobs and any(f.key.startswith("max_length") for f in config.approximated)


@pytest.mark.parametrize(
    "text, knob, value",
    [
        ("activation_offloading: true\n", "checkpointing", "offload"),
        ("gradient_checkpointing: false\n", "checkpointing", "off"),
        ("max_seq_length: 512\n", "seq_len", 512),
        ("loss_type: nll\n", "hf_loss", "model"),
        ("use_peft: true\ndtype: float16\nfp16: true\n", "precision", "fp16"),
        ("max_length: 64\nuse_liger_kernel: true\nliger_kernel_config: {fused_linear_cross_entropy: false}\n", "hf_loss",
         "chunked-nll"),
        ("block_size: 256\n", "seq_len", 256),
        ("optim: lion_8bit\n", "optimizer", "adamw8bit"),
        ("optim: sgd\n", "optimizer", "sgd"),
    ],
)
def test_each_memory_key(write_config, text, knob, value):
    assert getattr(make_spec(**_read(write_config, text).knobs), knob) == value
