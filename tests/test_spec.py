"""Every bad knob is reported at once, naming the field, the value and the fix."""

import pytest

from memfit.spec import RunSpec, SpecError, make_spec


def test_defaults():
    spec = make_spec()
    assert spec.method == "lora" and spec.rank == 16 and spec.lora_alpha == 32.0
    assert spec.checkpointing == "on" and spec.targets == ("all-linear",)


def test_targets_from_comma_string():
    assert make_spec(targets="q_proj, v_proj").targets == ("q_proj", "v_proj")


@pytest.mark.parametrize(
    "knobs, expected",
    [
        (
            {"modules_to_save": ",,"},
            "--modules-to-save: ',,' has an empty item (two commas in a row, or one at an end)",
        ),
        ({"modules_to_save": "lm_head,"}, "--modules-to-save: 'lm_head,' has an empty item"),
        ({"targets": "q_proj,,v_proj"}, "--targets: 'q_proj,,v_proj' has an empty item"),
        ({"targets": ","}, "--targets: ',' has an empty item"),
        (
            {"targets": " "},
            "--targets: ' ' names no module: write module names separated by commas, e.g. --targets q_proj,v_proj",
        ),
        ({"targets": []}, "--targets: [] names no module"),
        ({"targets": ["q_proj", ""]}, "--targets: ['q_proj', ''] has an empty item"),
    ],
)
def test_a_list_of_module_names_with_an_empty_item_is_refused(knobs, expected):
    # Dropping the empty item would plan another run than the one typed (",," would be no module at all).
    with pytest.raises(SpecError) as err:
        make_spec(**knobs)
    assert expected in str(err.value) and len(err.value.problems) == 1


def test_an_empty_list_of_modules_to_save_is_none():
    assert make_spec(spelling="field", modules_to_save=[]).modules_to_save == ()
    with pytest.raises(
        SpecError, match="modules_to_save: 'a,,b' has an empty item .* e.g. modules_to_save: embed_tokens,lm_head"
    ):
        make_spec(spelling="field", modules_to_save="a,,b")


@pytest.mark.parametrize(
    ("knobs", "expected"),
    [
        ({"rank": 0}, "--rank: 0 must be 1 or more"),
        ({"batch_size": -2}, "--batch-size: -2 must be 1 or more"),
        ({"seq_len": 0}, "--seq-len: 0 must be 1 or more"),
        ({"seq_len": "long"}, "--seq-len: 'long' is not a whole number"),
        ({"method": "lorra"}, "Did you mean 'lora'?"),
        ({"optimizer": "adam"}, "--optimizer: 'adam' is not one of"),
        ({"alpha": -1}, "--alpha: -1 must be a positive number"),
        ({"dropout": 1.5}, "--dropout: 1.5 must be in [0, 1)"),
        ({"method": "qlora", "precision": "fp32"}, "fp32 cannot be used with --method qlora"),
        ({"method": "full", "precision": "fp16"}, "fp16 is not supported for --method full"),
        ({"seqlen": 10}, "unknown knob 'seqlen'. Did you mean 'seq_len'?"),
    ],
)
def test_bad_knobs(knobs, expected):
    with pytest.raises(SpecError) as info:
        make_spec(**knobs)
    assert expected in str(info.value)


def test_all_problems_at_once():
    with pytest.raises(SpecError) as info:
        make_spec(rank=0, batch_size=0, method="x")
    assert len(info.value.problems) == 3


def test_knobs_are_json_ready():
    knobs = make_spec(method="qlora", rank=8).knobs()
    assert knobs["alpha"] == 16.0 and knobs["targets"] == ["all-linear"] and knobs["method"] == "qlora"
    assert set(knobs) == set(RunSpec.model_fields)


@pytest.mark.parametrize(
    ("knobs", "expected"),
    [
        ({"tiling": "maybe"}, "--tiling: 'maybe' is not one of auto, on, off"),
        ({"recipe": "hugging"}, "--recipe: 'hugging' is not one of memfit, hf"),
        ({"method": "lora", "step_in_backward": True}, "--step-in-backward: only for --method full"),
        ({"method": "full", "step_in_backward": True, "grad_accum": 4}, "--step-in-backward: needs --grad-accum 1"),
    ],
)
def test_bad_lean_step_knobs(knobs, expected):
    with pytest.raises(SpecError) as info:
        make_spec(**knobs)
    assert expected in str(info.value)


def test_tiling_auto_follows_the_tokens_of_a_micro_batch():
    from memfit.spec import TILING_AUTO_TOKENS

    assert not make_spec(seq_len=TILING_AUTO_TOKENS // 2).tiles_sequence
    assert make_spec(seq_len=TILING_AUTO_TOKENS // 2, batch_size=2).tiles_sequence
    assert make_spec(seq_len=512, tiling="on").tiles_sequence
    assert not make_spec(seq_len=65536, tiling="off").tiles_sequence
    assert not make_spec(seq_len=65536, recipe="hf").tiles_sequence


@pytest.mark.parametrize(
    ("knobs", "expected"),
    [
        (
            {"method": "full", "precision": "fp16"},
            "Use --precision fp16-mixed (fp32 weights, fp16 compute, loss scaling), bf16 or fp32",
        ),
        ({"method": "qlora", "precision": "fp32"}, "fp32 cannot be used with --method qlora"),
        (
            {"method": "full", "precision": "fp16-mixed", "step_in_backward": True},
            "--step-in-backward cannot be used with --precision fp16-mixed: fp16's loss scaler must unscale",
        ),
        ({"precision": "bf16mixed"}, "Did you mean 'bf16-mixed'?"),
    ],
)
def test_precision_combinations_that_cannot_run(knobs, expected):
    with pytest.raises(SpecError) as info:
        make_spec(**knobs)
    assert expected in str(info.value)


def test_precision_problems_are_spelled_as_a_training_yaml_writes_them():
    with pytest.raises(SpecError) as info:
        make_spec(spelling="field", method="full", precision="fp16")
    assert "Use precision: fp16-mixed" in str(info.value)


@pytest.mark.parametrize("method", ["full", "lora", "qlora"])
@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16-mixed"])
def test_mixed_precision_runs_with_every_method(method, precision):
    assert make_spec(method=method, precision=precision).precision == precision


def test_what_each_precision_stores_its_weights_in_and_computes_in():
    def formats(**knobs):
        spec = make_spec(**knobs)
        return spec.weight_precision, spec.autocast_precision, spec.scales_loss

    assert formats(method="full", precision="bf16") == ("bf16", None, False)  # pure bf16
    assert formats(method="full", precision="bf16-mixed") == ("fp32", "bf16", False)  # fp32 master weights
    assert formats(method="full", precision="fp16-mixed") == ("fp32", "fp16", True)
    # A frozen base is never updated: it stays 16-bit under a mixed precision (adapters are fp32).
    assert formats(method="lora", precision="bf16-mixed") == ("bf16", "bf16", False)
    assert formats(method="qlora", precision="fp16-mixed") == ("fp16", "fp16", True)
    assert formats(method="lora", precision="fp16") == ("fp16", None, True)
    assert formats(method="lora", precision="fp32") == ("fp32", None, False)
    # The hf recipe runs its 16-bit precisions under autocast, as the Trainer does with bf16=True.
    assert formats(method="lora", precision="bf16", recipe="hf") == ("bf16", "bf16", False)


def test_the_precision_regime_in_words():
    def regime(**knobs):
        return make_spec(**knobs).precision_regime

    assert regime(method="full", precision="bf16") == "pure bf16: weights, gradients and optimizer states in bf16"
    assert (
        regime(method="full", precision="bf16-mixed")
        == "bf16 mixed: fp32 weights, gradients and optimizer states, bf16 autocast"
    )
    assert regime(method="full", precision="fp32") == "fp32: weights, gradients and optimizer states in fp32"
    assert regime(method="lora", precision="bf16") == "bf16 base, fp32 adapters"
    assert regime(method="lora", precision="bf16-mixed") == "bf16 base, fp32 adapters, bf16 autocast"
    assert (
        regime(method="qlora", precision="fp16-mixed")
        == "4-bit base (fp16 compute), fp32 adapters, fp16 autocast, loss scaling"
    )
    assert (
        regime(method="qlora", precision="bf16", recipe="hf")
        == "4-bit base (bf16 compute, other weights fp32), fp32 adapters, bf16 autocast"
    )


# ------------------------------------------------------------------------------------------------
# Adapter options: DoRA, rsLoRA, modules trained whole, an 8-bit base


def test_adapter_options_from_flags_and_yaml():
    spec = make_spec(method="lora-8bit", dora="false", rslora="true", modules_to_save="embed_tokens, lm_head")
    assert (spec.dora, spec.rslora, spec.modules_to_save) == (False, True, ("embed_tokens", "lm_head"))
    assert spec.uses_adapters and spec.base_bits == 8 and make_spec(method="qlora").base_bits == 4
    assert make_spec().base_bits is None and make_spec(modules_to_save="none").modules_to_save == ()
    assert make_spec(spelling="field", modules_to_save=["lm_head"]).knobs()["modules_to_save"] == ["lm_head"]


def test_rslora_scales_by_the_square_root_of_the_rank_as_peft_does():
    from memfit.merge.adapter import lora_scale  # the merge's copy of PEFT's arithmetic

    assert make_spec(rank=7, alpha=3, rslora=True).lora_scale == lora_scale(3.0, 7, use_rslora=True)
    assert make_spec(rank=16, alpha=32).lora_scale == 2.0
    assert make_spec(rank=16, alpha=32, rslora=True).lora_scale == 32 / 16**0.5 == 8.0
    assert make_spec(rank=7, alpha=3, rslora=True).lora_scale == 3 / 7**0.5


@pytest.mark.parametrize(
    ("knobs", "expected"),
    [
        (
            {"method": "full", "dora": True},
            "--dora: only with adapters (--method lora, qlora or lora-8bit); --method full trains every weight already",
        ),
        ({"method": "full", "modules_to_save": "lm_head"}, "--modules-to-save: only with adapters"),
        ({"method": "full", "rslora": True}, "--rslora: only with adapters"),
        ({"method": "qlora", "dora": True}, "--dora: not with --method qlora: PEFT copies each 4-bit layer"),
        (
            {"method": "lora-8bit", "dora": True},
            "--dora: not with --method lora-8bit: PEFT's DoRA on bitsandbytes' 8-bit layers",
        ),
        (
            {"modules_to_save": "all-linear"},
            "--modules-to-save: all-linear names LoRA targets, not modules to train whole",
        ),
        (
            {"targets": "q_proj,lm_head", "modules_to_save": "lm_head"},
            "--modules-to-save: lm_head is also in --targets",
        ),
        ({"dora": "sometimes"}, "--dora: 'sometimes' is not true or false"),
    ],
)
def test_adapter_options_that_cannot_run(knobs, expected):
    with pytest.raises(SpecError) as info:
        make_spec(**knobs)
    assert expected in str(info.value)
    assert len(info.value.problems) == 1


def test_adapter_problems_are_spelled_as_a_training_yaml_writes_them():
    with pytest.raises(SpecError) as info:
        make_spec(spelling="field", method="qlora", dora=True)
    assert "dora: not with method: qlora" in str(info.value) and "Use dora with method: lora" in str(info.value)


def test_the_precision_regime_of_an_8bit_base():
    assert (
        make_spec(method="lora-8bit").precision_regime
        == "8-bit base (LLM.int8 matmuls, bf16 around them), fp32 adapters"
    )
    assert make_spec(method="lora-8bit", recipe="hf").precision_regime.startswith(
        "8-bit base (LLM.int8 matmuls, bf16 around them, other weights fp32)"
    )


@pytest.mark.parametrize(
    ("knobs", "expected"),
    [
        ({"rank": "99999999999999999999"}, "--rank: 99999999999999999999 must be at most 65536 (e.g. --rank 16)."),
        ({"batch_size": 10**20}, "--batch-size: 100000000000000000000 must be at most 65536 (e.g. --batch-size 4)."),
        ({"seq_len": 2**24 + 1}, "--seq-len: 16777217 must be at most 16777216 (e.g. --seq-len 2048)."),
        ({"grad_accum": "4097"}, "--grad-accum: 4097 must be at most 4096 (e.g. --grad-accum 8)."),
        ({"gpus": 1e20}, "--gpus: 100000000000000000000 must be at most 65536 (e.g. --gpus 2)."),
    ],
)
def test_whole_numbers_have_an_upper_bound(knobs, expected):
    # Far beyond any real run: one line with the fix, not an OverflowError deep in PyTorch.
    with pytest.raises(SpecError) as info:
        make_spec(**knobs)
    assert str(info.value) == f"invalid run configuration: {expected}"


def test_every_whole_number_knob_declares_its_bound():
    from memfit.spec import KNOBS, upper_bound, value_kind

    unbounded = [name for name in KNOBS if value_kind(name) == "int" and upper_bound(name) is None]
    assert unbounded == []
    assert (
        make_spec(rank=upper_bound("rank"), grad_accum=upper_bound("grad_accum")).rank == 65536
    )  # the bound itself is allowed


def test_bounds_are_spelled_as_a_training_yaml_writes_them():
    with pytest.raises(SpecError) as info:
        make_spec(spelling="field", rank=10**20, seq_len=1.0e20)
    assert info.value.problems == [
        "rank: 100000000000000000000 must be at most 65536 (e.g. rank: 16).",
        "seq_len: 100000000000000000000 must be at most 16777216 (e.g. seq_len: 2048).",
    ]


def test_a_micro_batch_holds_at_most_16m_tokens():
    from memfit.spec import MAX_MICRO_BATCH_TOKENS

    assert make_spec(batch_size=2048, seq_len=8192).batch_size == 2048  # 2**24 tokens: the limit itself
    with pytest.raises(SpecError) as info:
        make_spec(batch_size=4096, seq_len=8192)
    assert info.value.problems == [
        f"--batch-size 4096 with --seq-len 8192 is 33,554,432 tokens a micro-batch: must be at most {MAX_MICRO_BATCH_TOKENS:,} "
        "(e.g. --batch-size 2048 with --grad-accum to keep the examples per step)."
    ]
