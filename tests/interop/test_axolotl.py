"""Axolotl's keys, as its config reference documents them, read into memfit's knobs."""

from __future__ import annotations

import pytest

from memfit.interop import read_tool_config
from memfit.interop.axolotl import ALL_KEYS, KEYMAP
from memfit.interop.reading import ToolConfigError


def _read(write_config, text: str):
    import textwrap

    return read_tool_config(write_config("axolotl.yml", "base_model: org/model\n" + textwrap.dedent(text).lstrip("\n")))


def test_axolotl_defaults_are_planned_when_keys_are_absent(write_config):
    config = _read(write_config, "")
    assert config.knobs == {
        "recipe": "hf",
        "method": "full",
        "seq_len": 512,
        "batch_size": 1,
        "grad_accum": 1,
        "checkpointing": "off",
        "optimizer": "adamw",
        "precision": "bf16",
        "max_grad_norm": 1.0,
    }
    # No attention named: transformers' sdpa, under which Axolotl keeps the embeddings, head and norms in fp32.
    assert [f.key for f in config.not_modelled] == ["attn_implementation (not set)"] and config.unknown_keys == []


def test_a_qlora_config_maps_every_memory_key(write_config):
    config = _read(
        write_config,
        """
        load_in_4bit: true
        adapter: qlora
        lora_r: 32
        lora_alpha: 16
        lora_dropout: 0.05
        lora_target_modules: [gate_proj, down_proj, up_proj, q_proj, v_proj, k_proj, o_proj]
        sequence_len: 4096
        sample_packing: true
        micro_batch_size: 2
        gradient_accumulation_steps: 4
        optimizer: paged_adamw_8bit
        bf16: auto
        tf32: false
        gradient_checkpointing: true
        gradient_checkpointing_kwargs:
          use_reentrant: false
        attn_implementation: flash_attention_2
        max_grad_norm: 0.5
    """,
    )
    assert config.knobs == {
        "recipe": "hf",
        "method": "qlora",
        "rank": 32,
        "alpha": 16.0,
        "dropout": 0.05,
        "targets": ("gate_proj", "down_proj", "up_proj", "q_proj", "v_proj", "k_proj", "o_proj"),
        "seq_len": 4096,
        "batch_size": 2,
        "grad_accum": 4,
        "checkpointing": "on",
        "optimizer": "paged-adamw8bit",
        "precision": "bf16",
        "max_grad_norm": 0.5,
        "padding_free": "on",
        "packing": True,
        "kbit_upcast": False,
        "use_reentrant": "off",
    }
    assert config.sources["method"] == ("adapter", "load_in_4bit")
    assert config.not_modelled == []


@pytest.mark.parametrize(
    "text, knob, value",
    [
        ("adapter: lora\nlora_target_linear: true\n", "targets", ("all-linear",)),
        ("adapter: lora\nload_in_4bit: true\n", "method", "qlora"),
        ("adapter: lora\nload_in_8bit: true\n", "method", "lora-8bit"),
        ("adapter: lora\npeft_use_dora: true\n", "dora", True),
        ("adapter: lora\npeft_use_rslora: true\n", "rslora", True),
        ("adapter: lora\nlora_modules_to_save: [lm_head]\n", "modules_to_save", ("lm_head",)),
        ("batch_size: 32\nmicro_batch_size: 4\n", "grad_accum", 8),
        ("gradient_checkpointing: offload\n", "checkpointing", "offload"),
        ("activation_offloading: true\ngradient_checkpointing: true\n", "checkpointing", "offload"),
        ("bf16: false\nfp16: false\n", "precision", "fp32"),
        ("bfloat16: true\nbf16: false\n", "precision", "bf16"),
        ("bf16: full\nflash_attention: true\n", "precision", "bf16"),
        ("adapter: lora\nfp16: true\n", "precision", "fp16"),  # bf16: auto gives way to fp16
        ("adapter: lora\nbf16: false\nfp16: false\n", "precision", "fp32"),
        ("attn_implementation: flash_attention_2\n", "precision", "bf16"),
        ("flash_attention: true\n", "padding_free", "on"),
        ("batch_flattening: true\n", "padding_free", "on"),
        ("max_grad_norm: 0\n", "max_grad_norm", None),
        ("optimizer: adamw_8bit\n", "optimizer", "adamw8bit"),
        # Axolotl's normalize_config: reentrant for SFT unless the kwargs say otherwise.
        ("gradient_checkpointing: true\n", "use_reentrant", "on"),
        (
            "gradient_checkpointing: true\ngradient_checkpointing_kwargs: {use_reentrant: false}\n",
            "use_reentrant",
            "off",
        ),
        ("gradient_checkpointing: true\nunfrozen_parameters: [lm_head]\n", "use_reentrant", "off"),
        ("gradient_checkpointing: false\n", "use_reentrant", "auto"),
        (
            "plugins: [axolotl.integrations.liger.LigerPlugin]\nliger_fused_linear_cross_entropy: true\n",
            "hf_loss",
            "liger",
        ),
    ],
)
def test_each_memory_key(write_config, text, knob, value):
    from memfit.spec import make_spec

    config = _read(write_config, text)
    assert getattr(make_spec(**config.knobs), knob) == value


def test_what_is_not_modelled_is_listed_with_why(write_config):
    config = _read(
        write_config,
        """
        adapter: lora
        gptq: true
        rl: dpo
        torch_compile: true
        liger_rms_norm: true
        eager_attention: true
        tensor_parallel_size: 1
    """,
    )
    found = {f.key: f.why for f in config.not_modelled}
    assert set(found) == {"adapter, gptq", "torch_compile", "liger_rms_norm", "eager_attention"}
    assert "GPTQ-quantized base" in found["adapter, gptq"]
    assert config.knobs["objective"] == "dpo"  # rl: dpo is memfit's objective
    assert config.knobs["method"] == "lora" and "padding_free" not in config.knobs  # eager: planned as SDPA


def test_the_adapter_options_set_memfits_knobs(write_config):
    # Axolotl's own 8B LoRA example: an 8-bit base, embed_tokens and lm_head trained whole; with DoRA and rsLoRA.
    config = _read(
        write_config,
        """
        adapter: lora
        load_in_8bit: true
        lora_modules_to_save: [embed_tokens, lm_head]
        peft_ensure_weight_tying: true
        peft_use_dora: false
        peft_use_rslora: true
    """,
    )
    assert config.knobs["method"] == "lora-8bit" and config.knobs["kbit_upcast"] is False
    assert (config.knobs["modules_to_save"], config.knobs["dora"], config.knobs["rslora"]) == (
        ("embed_tokens", "lm_head"),
        False,
        True,
    )
    assert config.sources["method"] == ("adapter", "load_in_8bit") and config.not_modelled == []
    found = {f.key: f.why for f in config.approximated}
    assert "not 8-bit to fp32" in found["load_in_8bit"]  # PEFT's k-bit preparation, then Axolotl's cast back
    assert "lora_modules_to_save, peft_ensure_weight_tying" not in found  # one shared copy, as memfit trains it
    assert _read(write_config, "adapter: lora\npeft_use_dora: true\n").knobs["dora"] is True


def test_a_tied_embedding_and_head_trained_whole_without_weight_tying_is_listed(write_config):
    config = _read(write_config, "adapter: lora\nlora_modules_to_save: embed_tokens, lm_head\n")
    assert config.knobs["modules_to_save"] == ("embed_tokens", "lm_head")
    found = {f.key: f.why for f in config.approximated}
    assert "trains a copy of each: planned as one shared copy" in found["lora_modules_to_save"]
    assert "peft_ensure_weight_tying: true" in found["lora_modules_to_save"]


def test_adapter_options_of_a_full_fine_tuning_config_mean_nothing(write_config):
    # Axolotl reads them only with an adapter: without one they are not knobs memfit would refuse.
    config = _read(write_config, "lora_modules_to_save: [lm_head]\npeft_use_dora: true\npeft_use_rslora: true\n")
    assert config.knobs["method"] == "full"
    assert not {"modules_to_save", "dora", "rslora"} & set(config.knobs)


def test_approximations_are_listed(write_config):
    config = _read(write_config, "cut_cross_entropy: true\nactivation_offloading: legacy\noptimizer: adamw_torch\n")
    found = {f.key: f.why for f in config.approximated}
    assert set(found) == {"cut_cross_entropy", "activation_offloading"}
    assert config.knobs["hf_loss"] == "liger" and config.knobs["checkpointing"] == "offload"
    # The Trainer's adamw_torch is PyTorch's foreach AdamW, planned as such (not approximated).
    assert config.knobs["optimizer"] == "adamw" and config.knobs["adamw_impl"] == "foreach"


def test_chunked_cross_entropy_is_torchtune_s_compiled_loss_over_the_model_s_logits(write_config):
    config = _read(write_config, "chunked_cross_entropy: true\n")
    assert config.knobs["hf_loss"] == "chunked-ce" and config.approximated == []
    other = _read(write_config, "chunked_cross_entropy: true\nchunked_cross_entropy_num_chunks: 16\n")
    assert other.knobs["hf_loss"] == "chunked-ce"
    assert [f.why.split(":")[0] for f in other.approximated] == ["16 chunks planned as 8"]
    # A preference run's log-probs are TRL's own: Axolotl's patch leaves them alone.
    assert "hf_loss" not in _read(write_config, "chunked_cross_entropy: true\nrl: dpo\n").knobs


def test_fsdp_settings_are_the_shard_mode(write_config):
    offload = _read(
        write_config,
        """
        fsdp: [full_shard, auto_wrap]
        fsdp_config:
          fsdp_offload_params: true
          fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer
    """,
    )
    assert offload.shard == "fsdp-offload"
    assert _read(write_config, "fsdp_version: 2\nfsdp_config:\n  reshard_after_forward: true\n").shard == "fsdp"
    assert _read(write_config, "fsdp_version: 2\nfsdp_config:\n  reshard_after_forward: false\n").shard == "zero2"


def test_deepspeed_and_fsdp_together_are_refused(write_config):
    write_config("ds.json", {"zero_optimization": {"stage": 2}})
    with pytest.raises(ToolConfigError, match="fsdp: set together with deepspeed"):
        _read(write_config, "deepspeed: ds.json\nfsdp: [full_shard]\n")


def test_full_fine_tuning_with_deepspeed_bf16_is_mixed_precision(write_config):
    write_config("ds.json", {"bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 3}})
    config = _read(write_config, "deepspeed: ds.json\nbf16: true\n")
    assert config.zero.bf16 is True  # "auto" filled from bf16: true, as the Trainer fills it
    # DeepSpeed casts every parameter to bf16 and keeps fp32 master weights: nothing stays in fp32 beside them.
    assert config.knobs["precision"] == "bf16-mixed" and config.not_modelled == []


def test_full_fine_tuning_under_fsdp_is_mixed_precision(write_config):
    # accelerate upcasts the trained parameters to fp32 when FSDP runs under bf16.
    config = _read(write_config, "fsdp_version: 2\nfsdp_config:\n  reshard_after_forward: true\nbf16: true\n")
    assert config.knobs["precision"] == "bf16-mixed" and config.not_modelled == []
    lora = _read(write_config, "adapter: lora\nfsdp: [full_shard, auto_wrap]\nbf16: true\n")
    assert lora.shard == "fsdp" and lora.knobs["precision"] == "bf16"  # a frozen base is not upcast


@pytest.mark.parametrize(
    "attention, listed",
    [
        ("attn_implementation: sdpa\n", "attn_implementation"),
        ("sdp_attention: true\n", "sdp_attention"),
        ("attn_implementation: flash_attention_2\n", None),
        ("flex_attention: true\n", None),
        ("cut_cross_entropy: true\n", None),
    ],
)
def test_full_fine_tuning_keeps_embeddings_head_and_norms_in_fp32_under_sdpa(write_config, attention, listed):
    config = _read(write_config, attention)
    assert config.knobs["precision"] == "bf16"
    found = [f for f in config.not_modelled if f.knob == "precision"]
    if listed is None:
        assert found == []
    else:
        assert [f.key for f in found] == [listed] and "embeddings, the output head and the norms in fp32" in found[
            0
        ].why


def test_float32_is_listed_for_qlora_under_fsdp_only(write_config):
    fsdp = "fsdp: [full_shard, auto_wrap]\n"
    config = _read(write_config, "adapter: qlora\nload_in_4bit: true\nfloat32: true\n" + fsdp)
    assert [f.key for f in config.not_modelled] == ["float32"] and config.knobs["precision"] == "bf16"
    assert _read(write_config, "adapter: qlora\nload_in_4bit: true\nfloat32: true\n").not_modelled == []


def test_the_key_list_is_the_schema_s():
    # Every key the map reads is one Axolotl has; quiet keys are the rest of the schema.
    assert KEYMAP.memory_keys <= ALL_KEYS
    assert "wandb_project" in KEYMAP.quiet_keys and "micro_batch_size" not in KEYMAP.quiet_keys


def test_qlora_norms_embeddings_and_head_end_in_the_training_dtype(write_config):
    # PEFT's preparation upcasts them, then Axolotl casts them back; under ZeRO-3 it skips both.
    config = _read(write_config, "adapter: qlora\nload_in_4bit: true\n")
    assert config.knobs["kbit_upcast"] is False
    assert any("casts the norms, the embeddings and the output head back" in f.why for f in config.approximated)
    write_config("ds.json", {"zero_optimization": {"stage": 3}})
    zero3 = _read(write_config, "adapter: qlora\nload_in_4bit: true\ndeepspeed: ds.json\n")
    assert zero3.knobs["kbit_upcast"] is False and not any(f.knob == "kbit_upcast" for f in zero3.approximated)


@pytest.mark.parametrize(
    "method, expected",
    [
        ("adapter: lora\n", "compute"),
        ("adapter: qlora\nload_in_4bit: true\n", "compute"),
        ("adapter: lora\nload_in_8bit: true\n", "fp32"),
    ],
)
def test_adapters_left_in_the_compute_dtype_by_peft_autocast_adapter_dtype_false(write_config, method, expected):
    # PEFT then keeps them in the base layer's dtype (a 4-bit layer's compute dtype); LLM.int8's
    # integer weights have none, so there they stay fp32.
    config = _read(write_config, method + "peft_autocast_adapter_dtype: false\n")
    assert config.knobs.get("adapter_dtype", "fp32") == expected
    assert "peft_autocast_adapter_dtype" not in [f.key for f in config.not_modelled]
    assert "adapter_dtype" not in _read(write_config, method + "peft_autocast_adapter_dtype: true\n").knobs
    with pytest.raises(ToolConfigError, match="peft_autocast_adapter_dtype"):
        _read(write_config, method + "peft_autocast_adapter_dtype: sometimes\n")


def test_a_bad_attention_flag_is_one_problem(write_config):
    with pytest.raises(ToolConfigError) as err:
        _read(write_config, "flash_attention: maybe\n")
    assert [p.split(":")[0] for p in err.value.problems] == ["flash_attention"]


@pytest.mark.parametrize("rl, objective", [("dpo", "dpo"), ("ipo", "dpo"), ("orpo", "orpo"), ("simpo", "simpo")])
def test_preference_trainers_are_planned_as_their_objective(write_config, rl, objective):
    from memfit.spec import make_spec

    config = _read(write_config, f"adapter: lora\nrl: {rl}\nprecompute_ref_log_probs: true\n")
    spec = make_spec(**config.knobs)
    assert spec.objective == objective and not config.not_modelled
    # Only DPO has a reference to precompute.
    assert spec.precompute_reference is (objective == "dpo")


def test_other_rl_trainers_are_listed_and_planned_as_sft(write_config):
    config = _read(write_config, "adapter: lora\nrl: kto\n")
    assert "objective" not in config.knobs
    assert [f.key for f in config.not_modelled] == ["rl"] and "rl: kto" in config.not_modelled[0].why


def test_sequence_parallel_degree_is_listed_with_what_memfit_does_instead(write_config):
    config = _read(write_config, "adapter: lora\nsequence_parallel_degree: 4\n")
    (found,) = config.not_modelled
    assert found.key == "sequence_parallel_degree" and "whole rows on each GPU" in found.why
    assert "--sequence-parallel" in found.why and "sequence_parallel" not in config.knobs
    assert _read(write_config, "adapter: lora\nsequence_parallel_degree: 1\n").not_modelled == []


@pytest.mark.parametrize(
    "text, frozen",
    [
        ("processor_type: AutoProcessor\nadapter: lora\nlora_target_linear: true\n", False),
        ("processor_type: AutoProcessor\nadapter: lora\nlora_target_modules: [q_proj, v_proj]\n", False),
        (
            "processor_type: AutoProcessor\nadapter: lora\n"
            "lora_target_modules: 'model.language_model.layers.[\\d]+.(mlp|self_attn).(up|down|gate|q|k|v|o)_proj'\n",
            True,
        ),
        ("processor_type: AutoProcessor\nadapter: lora\nlora_target_linear: true\nfreeze_mm_modules: true\n", True),
        ("processor_type: AutoProcessor\n", False),  # a full fine-tuning trains every parameter
        ("adapter: lora\nlora_target_linear: true\n", None),  # a text model: nothing said of a tower
    ],
)
def test_a_vision_language_config_trains_the_tower_as_axolotl_does(write_config, text, frozen):
    config = _read(write_config, text)
    assert config.knobs.get("freeze_vision") is frozen


@pytest.mark.parametrize("size, pixels", [("512", 512 * 512), ("[640, 480]", 640 * 480)])
def test_the_image_size_is_the_most_pixels_an_image_keeps(write_config, size, pixels):
    config = _read(write_config, f"processor_type: AutoProcessor\nimage_size: {size}\n")
    assert config.knobs["image_max_pixels"] == pixels


def test_a_bad_image_size_is_one_problem_naming_the_key(write_config):
    with pytest.raises(ToolConfigError) as err:
        _read(write_config, "image_size: [1, 2, 3]\n")
    assert "image_size" in str(err.value) and "[width, height]" in str(err.value)
