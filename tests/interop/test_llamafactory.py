"""LLaMA-Factory's keys, as its argument reference documents them, read into memfit's knobs."""

from __future__ import annotations

import textwrap

import pytest

from memfit.interop import read_tool_config
from memfit.interop.reading import ToolConfigError
from memfit.spec import make_spec


def _read(write_config, text: str):
    return read_tool_config(
        write_config("lf.yaml", "model_name_or_path: org/model\nstage: sft\n" + textwrap.dedent(text).lstrip("\n"))
    )


def test_llama_factory_defaults_are_planned_when_keys_are_absent(write_config):
    # LoRA r=8 on every linear layer, 2,048 tokens, the Trainer's batch of 8, checkpointing on.
    config = _read(write_config, "")
    assert (
        make_spec(**config.knobs).knobs()
        == make_spec(
            recipe="hf",
            method="lora",
            rank=8,
            targets="all-linear",
            seq_len=2048,
            batch_size=8,
            grad_accum=1,
            checkpointing="on",
            use_reentrant="on",  # use_reentrant_gc: true
            optimizer="adamw",
            precision="bf16",
            max_grad_norm=1.0,
        ).knobs()
    )
    assert [f.key for f in config.approximated] == ["bf16 (not set)", "flash_attn (not set)"]


def test_a_qlora_config_maps_every_memory_key(write_config):
    config = _read(
        write_config,
        """
        finetuning_type: lora
        quantization_bit: 4
        quantization_method: bnb
        lora_rank: 16
        lora_alpha: 32
        lora_dropout: 0.1
        lora_target: q_proj,v_proj
        cutoff_len: 4096
        per_device_train_batch_size: 2
        gradient_accumulation_steps: 8
        optim: paged_adamw_8bit
        bf16: true
        flash_attn: fa2
        neat_packing: true
        enable_liger_kernel: true
    """,
    )
    assert config.knobs == {
        "recipe": "hf",
        "method": "qlora",
        "rank": 16,
        "alpha": 32.0,
        "dropout": 0.1,
        "targets": ("q_proj", "v_proj"),
        "seq_len": 4096,
        "batch_size": 2,
        "grad_accum": 8,
        "checkpointing": "on",
        "optimizer": "paged-adamw8bit",
        "precision": "bf16",
        "max_grad_norm": 1.0,
        "padding_free": "on",
        "packing": True,
        "hf_loss": "liger",
        "kbit_upcast": False,  # LLaMA-Factory does not run PEFT's prepare_model_for_kbit_training
        "use_reentrant": "on",
    }
    assert config.not_modelled == []


@pytest.mark.parametrize(
    "text, knob, value",
    [
        ("disable_gradient_checkpointing: true\n", "checkpointing", "off"),
        ("use_unsloth_gc: true\n", "checkpointing", "offload"),
        ("finetuning_type: lora\n", "use_reentrant", "on"),  # use_reentrant_gc: true by default
        ("use_reentrant_gc: false\n", "use_reentrant", "off"),
        ("disable_gradient_checkpointing: true\n", "use_reentrant", "auto"),
        ("lora_target: all\n", "targets", ("all-linear",)),
        ("flash_attn: sdpa\n", "padding_free", "auto"),
        ("packing: true\n", "packing", True),
    ],
)
def test_each_memory_key(write_config, text, knob, value):
    assert getattr(make_spec(**_read(write_config, text).knobs), knob) == value


@pytest.mark.parametrize(
    "text, precision",
    [
        ("finetuning_type: full\nbf16: true\n", "bf16-mixed"),  # the trained parameters cast to fp32, bf16 autocast
        ("finetuning_type: full\nfp16: true\n", "fp16-mixed"),
        ("finetuning_type: full\n", "fp32"),  # cast to fp32, no autocast
        ("finetuning_type: full\npure_bf16: true\n", "bf16"),
        ("finetuning_type: full\npure_bf16: true\nbf16: true\n", "bf16"),
        ("bf16: true\n", "bf16"),  # LoRA: a 16-bit base, fp32 adapters
        ("fp16: true\n", "fp16"),
        ("quantization_bit: 4\nbf16: true\n", "bf16"),
    ],
)
def test_precision_is_what_llama_factory_stores(write_config, text, precision):
    config = _read(write_config, text)
    assert config.knobs["precision"] == precision and config.not_modelled == []


def test_deepspeed_keeps_fp32_master_weights_of_a_full_fine_tuning(write_config):
    write_config("z2.json", {"bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 2}})
    write_config("z3.json", {"bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 3}})
    # ZeRO-3: LLaMA-Factory leaves the parameters in bf16 and DeepSpeed keeps the fp32 master copy.
    assert (
        _read(write_config, "finetuning_type: full\nbf16: true\ndeepspeed: z3.json\n").knobs["precision"]
        == "bf16-mixed"
    )
    # pure_bf16 under ZeRO-2: DeepSpeed's fp32 partitions are master weights all the same.
    assert (
        _read(write_config, "finetuning_type: full\npure_bf16: true\ndeepspeed: z2.json\n").knobs["precision"]
        == "bf16-mixed"
    )
    with pytest.raises(ToolConfigError, match="pure_bf16: true cannot be used with DeepSpeed ZeRO-3"):
        _read(write_config, "finetuning_type: full\npure_bf16: true\ndeepspeed: z3.json\n")


def test_pure_bf16_lora_adapters_are_listed(write_config):
    config = _read(write_config, "pure_bf16: true\n")
    assert config.knobs["precision"] == "bf16"
    assert any(f.key == "pure_bf16" and "fp32 since PEFT 0.12" in f.why for f in config.approximated)


def test_what_is_not_modelled_is_listed(write_config):
    config = read_tool_config(
        write_config(
            "lf.yaml",
            textwrap.dedent("""
        model_name_or_path: org/model
        stage: dpo
        pref_loss: sigmoid
        finetuning_type: lora
        quantization_bit: 8
        quantization_method: hqq
        use_unsloth: true
        use_galore: true
    """),
        )
    )
    found = {f.key: f.why for f in config.not_modelled}
    assert set(found) == {"finetuning_type, quantization_bit, quantization_method", "use_unsloth", "use_galore"}
    assert "8-bit base (hqq)" in found["finetuning_type, quantization_bit, quantization_method"]
    assert config.knobs["objective"] == "dpo"  # stage: dpo is memfit's objective
    assert config.knobs["method"] == "lora"


def test_the_adapter_options_set_memfits_knobs(write_config):
    config = read_tool_config(
        write_config(
            "lf.yaml",
            textwrap.dedent("""
        model_name_or_path: org/model
        finetuning_type: lora
        quantization_bit: 8
        additional_target: embed_tokens,lm_head
        use_dora: false
        use_rslora: true
    """),
        )
    )
    knobs = config.knobs
    assert (knobs["method"], knobs["kbit_upcast"]) == (
        "lora-8bit",
        False,
    )  # LLaMA-Factory skips PEFT's k-bit preparation
    assert (knobs["modules_to_save"], knobs["dora"], knobs["rslora"]) == (("embed_tokens", "lm_head"), False, True)
    assert config.not_modelled == []
    found = {f.key: f.why for f in config.approximated}
    assert (
        "PEFT without ensure_weight_tying trains a copy of each: planned as one shared copy"
        in found["additional_target"]
    )
    dora = read_tool_config(
        write_config("d.yaml", "model_name_or_path: org/model\nuse_dora: true\nadditional_target: lm_head\n")
    )
    assert dora.knobs["dora"] is True and dora.knobs["modules_to_save"] == ("lm_head",)
    assert "additional_target" not in {f.key for f in dora.approximated}  # one module named: one copy either way


def test_dora_on_a_4bit_base_is_refused_naming_the_keys(write_config):
    with pytest.raises(ToolConfigError, match=r"use_dora \(memfit dora\): not with method: qlora"):
        read_tool_config(write_config("q.yaml", "model_name_or_path: org/model\nquantization_bit: 4\nuse_dora: true\n"))


def test_a_quantized_full_fine_tuning_is_refused(write_config):
    with pytest.raises(ToolConfigError, match="quantization_bit: needs finetuning_type: lora"):
        _read(write_config, "finetuning_type: full\nquantization_bit: 4\n")


def test_a_deepspeed_file_next_to_the_config_is_read(write_config):
    write_config(
        "ds/ds_z2_offload.json",
        {
            "bf16": {"enabled": "auto"},
            "zero_optimization": {
                "stage": 2,
                "offload_optimizer": {"device": "cpu", "pin_memory": True},
                "allgather_bucket_size": 5e8,
                "reduce_bucket_size": 5e8,
                "overlap_comm": False,
            },
        },
    )
    config = _read(write_config, "finetuning_type: full\ndeepspeed: ds/ds_z2_offload.json\nbf16: true\n")
    assert config.shard == "zero2"
    assert (
        config.zero.offload_optimizer and config.zero.reduce_bucket_elements == 500_000_000 and config.zero.bf16 is True
    )


@pytest.mark.parametrize(
    "pref_loss, objective", [("sigmoid", "dpo"), ("ipo", "dpo"), ("orpo", "orpo"), ("simpo", "simpo")]
)
def test_a_dpo_stage_is_planned_as_its_objective(write_config, pref_loss, objective):
    config = read_tool_config(
        write_config("lf.yaml", f"model_name_or_path: org/model\nstage: dpo\npref_loss: {pref_loss}\n")
    )
    assert config.knobs["objective"] == objective and config.not_modelled == []
    assert make_spec(**config.knobs).reference == ("disabled-adapters" if objective == "dpo" else "none")


def test_other_stages_and_a_reference_model_of_its_own_are_listed(write_config):
    config = read_tool_config(write_config("lf.yaml", "model_name_or_path: org/model\nstage: kto\n"))
    assert "objective" not in config.knobs and "stage: kto" in config.not_modelled[0].why
    config = read_tool_config(
        write_config("lf.yaml", "model_name_or_path: org/model\nstage: dpo\nref_model: org/other\n")
    )
    assert [f.key for f in config.not_modelled] == ["ref_model"]


def test_vision_keys_set_the_image_size_and_the_tower(write_config):
    config = _read(write_config, "image_max_pixels: 262144\nfreeze_vision_tower: false\n")
    assert config.knobs["image_max_pixels"] == 262144 and config.knobs["freeze_vision"] is False
    assert config.not_modelled == []
    projector = _read(write_config, "freeze_multi_modal_projector: false\n")
    assert [found.key for found in projector.not_modelled] == ["freeze_multi_modal_projector"]
