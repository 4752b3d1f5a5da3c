"""Preparing a model for the adapter options: which modules PEFT trains whole, tied copies, counts."""

from __future__ import annotations

import warnings

import pytest
import torch

from memfit.models.build import DTYPES, build_meta_model, make_config
from memfit.models.errors import ModelBuildError
from memfit.spec import make_spec
from memfit.step.prepare import (
    attach_lora,
    check_modules_to_save,
    expected_adapter_parameters,
    modules_named,
    prepare_for_method,
    ties_saved_modules,
    trained_copies,
)


def _meta(config: dict, tie: bool = False):
    return build_meta_model(make_config(dict(config, tie_word_embeddings=tie)), DTYPES["bf16"])


@pytest.mark.parametrize(
    "names", [["lm_head"], ["embed_tokens", "lm_head"], ["norm"], ["head"], ["layers.0.input_layernorm"]]
)
def test_modules_to_save_picks_what_peft_picks(tiny_llama, names):
    import peft

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = peft.get_peft_model(
            _meta(tiny_llama), peft.LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=names)
        )
    wrapped = {
        name.removeprefix("base_model.model.")
        for name, m in model.named_modules()
        if type(m).__name__ == "ModulesToSaveWrapper"
    }
    assert set(modules_named(_meta(tiny_llama), names)) == wrapped


def test_a_tied_model_keeps_one_trainable_copy_for_embeddings_and_head(tiny_llama):
    assert ties_saved_modules(_meta(tiny_llama, tie=True), ["lm_head"])
    assert ties_saved_modules(_meta(tiny_llama, tie=True), ["embed_tokens"])
    assert not ties_saved_modules(_meta(tiny_llama, tie=False), ["lm_head"])
    assert not ties_saved_modules(_meta(tiny_llama, tie=True), ["norm"])
    spec = make_spec(modules_to_save="lm_head", rank=4)
    model = attach_lora(_meta(tiny_llama, tie=True), spec)
    assert model.peft_config["default"].ensure_weight_tying is True
    assert [sorted(c["modules"]) for c in trained_copies(model)] == [["lm_head", "model.embed_tokens"]]
    untied = attach_lora(_meta(tiny_llama, tie=False), make_spec(modules_to_save="embed_tokens,lm_head", rank=4))
    assert untied.peft_config["default"].ensure_weight_tying is False
    assert sorted(c["modules"][0] for c in trained_copies(untied)) == ["lm_head", "model.embed_tokens"]


@pytest.mark.parametrize(
    "knobs",
    [
        dict(dora=True),
        dict(modules_to_save="embed_tokens,lm_head"),
        dict(dora=True, modules_to_save="lm_head", targets="q_proj,v_proj"),
        dict(rslora=True),
    ],
)
def test_expected_adapter_parameters_are_what_trains(tiny_llama, knobs):
    spec = make_spec(rank=4, checkpointing="off", **knobs)
    model = prepare_for_method(_meta(tiny_llama, tie=True), spec)
    trains = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert expected_adapter_parameters(model) == trains
    if spec.rslora:
        assert model.base_model.model.model.layers[0].self_attn.q_proj.scaling["default"] == spec.lora_scale


def test_modules_to_save_the_model_lacks_or_that_lora_adapts_are_named(tiny_llama):
    model = _meta(tiny_llama)
    with pytest.raises(
        ModelBuildError,
        match=r"--modules-to-save: wte match no module of this model \(its embeddings and head: "
        r"embed_tokens, lm_head\)",
    ):
        check_modules_to_save(model, make_spec(modules_to_save="wte"))
    with pytest.raises(ModelBuildError, match="o_proj also get LoRA adapters"):
        check_modules_to_save(model, make_spec(modules_to_save="o_proj"))
    check_modules_to_save(model, make_spec(modules_to_save="o_proj", targets="q_proj,v_proj"))  # not adapted: fine


def test_an_8bit_base_swaps_the_decoders_linear_layers_only(tiny_llama):
    pytest.importorskip("bitsandbytes")
    spec = make_spec(method="lora-8bit", rank=4, checkpointing="off")
    model = prepare_for_method(_meta(tiny_llama), spec)
    base = model.get_base_model()
    kinds = {type(m.base_layer).__name__ for m in base.model.layers[0].modules() if hasattr(m, "base_layer")}
    assert kinds == {"Linear8bitLt"} and type(base.lm_head).__name__ == "Linear"
    weight = base.model.layers[0].mlp.down_proj.base_layer.weight
    assert weight.dtype == torch.int8 and weight.SCB.shape == (tiny_llama["hidden_size"],) and not weight.requires_grad
    assert type(base.model.layers[0].mlp.down_proj).__name__ == "Linear8bitLt"  # PEFT's 8-bit LoRA layer
