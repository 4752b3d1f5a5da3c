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
    assert config.knobs == {
        "recipe": "hf",
        "method": "full",
        "seq_len": 1024,
        "batch_size": 8,
        "grad_accum": 1,
        "checkpointing": "on",
        "optimizer": "adamw",
        "precision": "bf16-mixed",
        "max_grad_norm": 1.0,
        "hf_loss": "chunked-nll",
    }
    assert config.not_modelled == []
    # The optimizer the Trainer picks depends on torch's version: the plan says which it assumed.
    assert [f.key for f in config.approximated] == ["optim (not set)", "loss_type (not set)"]
    assert "torch 2.8" in config.approximated[0].why and "adamw_torch" in config.approximated[0].why


def test_the_trainers_adamw_torch_is_planned_as_foreach_adamw(write_config):
    foreach = _read(write_config, "optim: adamw_torch\n")
    fused = _read(write_config, "optim: adamw_torch_fused\n")
    assert foreach.knobs["adamw_impl"] == "foreach" and "adamw_impl" not in fused.knobs
    assert "optim" not in {f.key for f in foreach.approximated + foreach.not_modelled}
    lora = _read(write_config, "use_peft: true\n")
    assert "adamw_impl" not in lora.knobs and not any(f.key.startswith("optim") for f in lora.approximated)


def test_an_sft_lora_config_maps_every_memory_key(write_config):
    config = _read(
        write_config,
        """
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
    """,
    )
    assert config.knobs == {
        "recipe": "hf",
        "method": "lora",
        "rank": 32,
        "alpha": 64.0,
        "dropout": 0.0,
        "targets": ("all-linear",),
        "seq_len": 4096,
        "batch_size": 2,
        "grad_accum": 4,
        "checkpointing": "on",
        "optimizer": "adamw8bit",
        "precision": "bf16",
        "max_grad_norm": 1.0,
        "padding_free": "on",
        "packing": True,
        "hf_loss": "liger",
    }
    assert config.not_modelled == [] and config.approximated == []


def test_qlora_and_peft_s_default_targets(write_config):
    config = _read(write_config, "use_peft: true\nload_in_4bit: true\ndtype: bfloat16\n")
    assert config.knobs["method"] == "qlora" and config.knobs["targets"] == ("q_proj", "v_proj")
    assert any(f.key == "lora_target_modules (not set)" for f in config.approximated)
    assert config.knobs["kbit_upcast"] is False and any("TRL since 0.22" in f.why for f in config.approximated)
    # TRL casts the adapters to bf16: planned so, not approximated.
    assert config.knobs["precision"] == "bf16" and config.knobs["adapter_dtype"] == "compute"
    assert not any("adapters" in f.why for f in config.approximated)


def test_an_8bit_base_and_the_adapter_options(write_config):
    config = _read(
        write_config,
        """
        use_peft: true
        load_in_8bit: true
        dtype: bfloat16
        lora_target_modules: all-linear
        lora_modules_to_save: [lm_head]
        use_dora: false
        use_rslora: true
    """,
    )
    knobs = config.knobs
    assert (knobs["method"], knobs["modules_to_save"], knobs["dora"], knobs["rslora"]) == (
        "lora-8bit",
        ("lm_head",),
        False,
        True,
    )
    assert knobs["kbit_upcast"] is False and any("not 8-bit in the compute dtype" in f.why for f in config.approximated)
    assert config.not_modelled == []
    assert _read(write_config, "use_peft: true\nuse_dora: true\n").knobs["dora"] is True


def test_a_dpo_config_is_planned_as_dpo(write_config):
    config = _read(write_config, "beta: 0.1\nmax_length: 1024\nuse_peft: true\ndtype: bfloat16\n")
    assert config.knobs["objective"] == "dpo" and config.not_modelled == []
    assert "hf_loss" not in config.knobs  # DPO's loss is the model's, over both completions
    spec = make_spec(**config.knobs)
    assert spec.reference == "disabled-adapters" and spec.recipe == "hf"


def test_dpo_precompute_ref_log_probs_is_precompute_reference(write_config):
    config = _read(write_config, "beta: 0.1\nprecompute_ref_log_probs: true\n")
    assert make_spec(**config.knobs).reference == "precomputed"  # full fine-tuning without its frozen copy


@pytest.mark.parametrize(
    "text, approximated", [("loss_type: simpo\nsimpo_gamma: 0.5\n", False), ("cpo_alpha: 1.0\n", True)]
)
def test_a_cpo_config_is_planned_as_simpo(write_config, text, approximated):
    config = _read(write_config, "use_peft: true\n" + text)
    assert config.knobs["objective"] == "simpo" and make_spec(**config.knobs).reference == "none"
    assert any("SimPO's step" in f.why for f in config.approximated) is approximated


def test_liger_on_a_dpo_config_is_listed_not_planned_as_an_sft_loss(write_config):
    config = _read(write_config, "beta: 0.1\nuse_peft: true\nuse_liger_kernel: true\n")
    assert "hf_loss" not in config.knobs and config.knobs["objective"] == "dpo"
    assert any("Liger's fused preference loss" in f.why for f in config.not_modelled)
    make_spec(**config.knobs)  # a valid plan


def test_plain_training_arguments_json(write_config):
    # No TRL key but the model: the Trainer's own defaults (checkpointing off, no bf16), no length.
    config = read_tool_config(
        write_config(
            "args.json",
            {
                "model_name_or_path": "org/model",
                "output_dir": "out",
                "per_device_train_batch_size": 4,
                "gradient_accumulation_steps": 2,
                "fsdp": "full_shard auto_wrap offload",
                "fsdp_config": {"fsdp_version": 2},
            },
        )
    )
    assert config.tool == "trl" and config.shard == "fsdp-offload"
    # No bf16, and transformers 5 loads the checkpoint's dtype: planned as bf16, said so.
    assert config.knobs["checkpointing"] == "off" and config.knobs["precision"] == "bf16"
    assert any(f.key == "dtype (not set)" and "checkpoint's dtype" in f.why for f in config.approximated)
    assert "seq_len" not in config.knobs and any(f.key.startswith("max_length") for f in config.approximated)


@pytest.mark.parametrize(
    "text, knob, value",
    [
        ("activation_offloading: true\n", "checkpointing", "offload"),
        ("gradient_checkpointing: false\n", "checkpointing", "off"),
        ("max_length: 512\ngradient_checkpointing_kwargs: {use_reentrant: true}\n", "use_reentrant", "on"),
        (
            "gradient_checkpointing: true\nactivation_checkpointing_kwargs: {use_reentrant: false}\n",
            "use_reentrant",
            "off",
        ),
        ("use_peft: true\n", "use_reentrant", "auto"),  # transformers 5 and TRL since 0.27: non-reentrant
        ("max_seq_length: 512\n", "seq_len", 512),
        ("loss_type: nll\n", "hf_loss", "model"),
        ("use_peft: true\ndtype: float16\nfp16: true\n", "precision", "fp16"),
        (
            "max_length: 64\nuse_liger_kernel: true\nliger_kernel_config: {fused_linear_cross_entropy: false}\n",
            "hf_loss",
            "chunked-nll",
        ),
        ("block_size: 256\n", "seq_len", 256),
        ("optim: lion_8bit\n", "optimizer", "adamw8bit"),
        ("optim: sgd\n", "optimizer", "sgd"),
    ],
)
def test_each_memory_key(write_config, text, knob, value):
    assert getattr(make_spec(**_read(write_config, text).knobs), knob) == value


@pytest.mark.parametrize(
    "text, precision",
    [
        ("", "bf16-mixed"),  # TRL loads float32 and trains under bf16: fp32 weights, gradients and AdamW states
        ("fp16: true\n", "fp16-mixed"),
        ("bf16: false\n", "fp32"),
        ("dtype: bfloat16\n", "bf16"),  # pure bf16, forward under autocast
        ("model_init_kwargs: {dtype: bfloat16}\n", "bf16"),
        ("model_init_kwargs: {torch_dtype: float32}\nbf16: true\n", "bf16-mixed"),
        ("torch_dtype: float32\nbf16: true\n", "bf16-mixed"),
        ("dtype: bfloat16\nfsdp: full_shard auto_wrap\n", "bf16-mixed"),  # accelerate upcasts what FSDP trains
        ("dtype: bfloat16\nbf16: false\nfsdp: full_shard auto_wrap\n", "bf16"),  # no mixed precision, no upcast
    ],
)
def test_full_fine_tuning_precision_is_what_the_trainer_stores(write_config, text, precision):
    config = _read(write_config, "max_length: 512\n" + text)
    assert config.knobs["precision"] == precision
    assert not any(f.knob == "precision" for f in config.not_modelled)


def test_full_fine_tuning_under_deepspeed_half_is_mixed_whatever_the_model_is_loaded_in(write_config):
    write_config("ds.json", {"bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 2}})
    for dtype in ("bfloat16", "float32"):
        config = _read(write_config, f"max_length: 512\ndeepspeed: ds.json\ndtype: {dtype}\n")
        assert config.zero.bf16 is True and config.knobs["precision"] == "bf16-mixed"


def test_lora_on_a_float32_base_is_planned_as_fp32_and_listed(write_config):
    # TRL's default: the frozen base in fp32 under bf16 autocast; memfit keeps a base in 16 bits under autocast.
    config = _read(write_config, "use_peft: true\n")
    assert config.knobs["precision"] == "fp32"
    (found,) = [f for f in config.not_modelled if f.knob == "precision"]
    assert "LoRA base kept in fp32 (TRL's default dtype, float32)" in found.why
    # DeepSpeed's bf16 casts the base: a 16-bit base, as memfit plans it.
    write_config("ds.json", {"bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 2}})
    assert _read(write_config, "use_peft: true\ndeepspeed: ds.json\n").knobs["precision"] == "bf16"
    assert _read(write_config, "use_peft: true\nbf16: false\n").knobs["precision"] == "fp32"


def test_qlora_on_trl_s_float32_default_keeps_the_other_parameters_in_fp32(write_config):
    config = _read(write_config, "use_peft: true\nload_in_4bit: true\n")
    assert config.knobs["precision"] == "bf16" and config.knobs["kbit_upcast"] is True
    found = {(f.knob, f.key): f.why for f in config.approximated}
    assert "not 4-bit in float32" in found["kbit_upcast", "load_in_4bit"]
    assert "dequantize to float32" in found["precision", "dtype (not set)"]
    assert config.knobs["adapter_dtype"] == "compute"
    assert config.not_modelled == []


def test_trl_keeps_adapters_in_the_base_dtype_under_zero3_and_plain_lora_in_fp32(write_config):
    write_config("z3.json", {"bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 3}})
    assert _read(write_config, "use_peft: true\ndeepspeed: z3.json\n").knobs["adapter_dtype"] == "compute"
    assert "adapter_dtype" not in _read(write_config, "use_peft: true\ndtype: bfloat16\n").knobs
    # fp32 compute (no bf16): TRL's bf16 adapters planned in fp32, and said.
    fp32 = _read(write_config, "use_peft: true\nload_in_8bit: true\nbf16: false\n")
    assert "adapter_dtype" not in fp32.knobs
    assert any(f.knob == "adapter_dtype" and "planned as fp32 adapters" in f.why for f in fp32.approximated)


def test_dtype_auto_is_planned_as_bf16_and_said(write_config):
    config = _read(write_config, "max_length: 512\ndtype: auto\n")
    assert config.knobs["precision"] == "bf16"
    assert any(f.key == "dtype" and "checkpoint's dtype" in f.why for f in config.approximated)


def test_a_bad_dtype_names_its_key(write_config):
    from memfit.interop.reading import ToolConfigError

    with pytest.raises(ToolConfigError, match=r"model_init_kwargs: dtype: 'float8' is not a dtype"):
        _read(write_config, "max_length: 512\nmodel_init_kwargs: {dtype: float8}\n")
    with pytest.raises(ToolConfigError, match=r"dtype: 'bfloat61' is not a dtype.*Did you mean 'bfloat16'"):
        _read(write_config, "max_length: 512\nuse_peft: true\nload_in_4bit: true\ndtype: bfloat61\n")


def test_a_bad_use_reentrant_names_its_key(write_config):
    from memfit.interop.reading import ToolConfigError

    with pytest.raises(
        ToolConfigError, match=r"gradient_checkpointing_kwargs: use_reentrant: 'maybe' is not true or false"
    ):
        _read(write_config, "max_length: 512\ngradient_checkpointing_kwargs: {use_reentrant: maybe}\n")
    with pytest.raises(ToolConfigError, match=r"gradient_checkpointing_kwargs: 'yes' is not a mapping"):
        _read(write_config, "max_length: 512\ngradient_checkpointing_kwargs: 'yes'\n")


def test_an_8bit_config_says_which_checkpointing_variant_it_was_planned_with(write_config):
    config = _read(write_config, "max_length: 512\nuse_peft: true\nload_in_8bit: true\n")
    assert config.knobs["use_reentrant"] == "off"
    found = [f for f in config.approximated if f.knob == "use_reentrant"]
    assert len(found) == 1 and "planned non-reentrant" in found[0].why
    assert found[0].key == "activation_checkpointing_kwargs (not set)"
    said = _read(
        write_config,
        "max_length: 512\nuse_peft: true\nload_in_8bit: true\ngradient_checkpointing_kwargs: {use_reentrant: true}\n",
    )
    assert said.knobs["use_reentrant"] == "on" and not [f for f in said.approximated if f.knob == "use_reentrant"]
