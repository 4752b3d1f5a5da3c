"""DoRA, rsLoRA, modules trained whole and an 8-bit base: trained by memfit, loaded by PEFT unchanged."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from trainer_helpers import save_tiny_pretrained, tiny_config  # noqa: E402

from memfit.train.config import ConfigError  # noqa: E402
from memfit.train.recipe import train  # noqa: E402

OPTIONS = {
    "dora": (dict(dora=True), True),
    "rslora": (dict(rslora=True, alpha=16), True),
    "embed+head untied": (dict(modules_to_save=["embed_tokens", "lm_head"]), False),
    "head of a tied model": (dict(modules_to_save=["lm_head"]), True),
    "dora + embed of a tied model": (dict(dora=True, modules_to_save=["embed_tokens"], precision="bf16"), True),
    "8-bit base": (dict(method="lora-8bit"), True),
}


def _reload_with_peft(base_dir, adapter_dir, method: str, dtype):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    extra = {"quantization_config": BitsAndBytesConfig(load_in_8bit=True)} if method == "lora-8bit" else {}
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=dtype, device_map="cpu", **extra)
    return PeftModel.from_pretrained(base, str(adapter_dir)).eval()


@pytest.mark.parametrize("name", OPTIONS)
def test_the_adapter_loads_in_peft_and_gives_the_trained_models_logits(tmp_path, name):
    settings, tie = OPTIONS[name]
    if settings.get("method") == "lora-8bit":
        pytest.importorskip("bitsandbytes")
    base_dir = save_tiny_pretrained(tmp_path / "base", tie=tie)
    config = tiny_config(
        tmp_path / "run", model=str(base_dir), init="pretrained", model_overrides={}, max_steps=4, lr=1e-2, **settings
    )
    result = train(config, progress=False)
    assert result.setup["trainable_params"] == result.setup["expected_trainable_params"]
    saved = json.loads((result.output_dir / "adapter_config.json").read_text())
    assert saved["use_dora"] is bool(settings.get("dora")) and saved["use_rslora"] is bool(settings.get("rslora"))
    dtype = torch.bfloat16 if config.precision == "bf16" else torch.float32
    reloaded = _reload_with_peft(base_dir, result.output_dir, config.method, dtype)
    trained = result.model.eval()
    ids = torch.randint(0, 512, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = trained(input_ids=ids).logits
        got = reloaded(input_ids=ids).logits
    assert torch.equal(expected, got), (expected - got).abs().max()
    # what trained is what PEFT saved, nothing more or less
    from safetensors.torch import load_file

    keys = set(load_file(str(result.output_dir / "adapter_model.safetensors")))
    if settings.get("dora"):
        assert any(k.endswith("lora_magnitude_vector") for k in keys)
    for module in settings.get("modules_to_save", []):
        assert any(k.endswith(f"{module}.weight") for k in keys)


def test_a_tied_model_trains_one_copy_for_its_embeddings_and_head(tmp_path):
    base_dir = save_tiny_pretrained(tmp_path / "base", tie=True)
    config = tiny_config(
        tmp_path / "run",
        model=str(base_dir),
        init="pretrained",
        model_overrides={},
        max_steps=2,
        modules_to_save=["lm_head"],
    )
    result = train(config, progress=False)
    base = result.model.get_base_model()
    embeddings, head = base.get_input_embeddings(), base.get_output_embeddings()
    assert embeddings.modules_to_save["default"].weight is head.modules_to_save["default"].weight
    assert embeddings.modules_to_save["default"].weight.requires_grad
    vocab, hidden = head.modules_to_save["default"].weight.shape
    lora = result.setup["trainable_params"] - vocab * hidden
    assert 0 < lora < vocab * hidden  # one copy, not two
    saved = json.loads((result.output_dir / "adapter_config.json").read_text())
    assert saved["ensure_weight_tying"] is True


def test_an_untied_model_trains_a_copy_of_each_module(tmp_path):
    base_dir = save_tiny_pretrained(tmp_path / "base", tie=False)
    config = tiny_config(
        tmp_path / "run",
        model=str(base_dir),
        init="pretrained",
        model_overrides={},
        max_steps=2,
        modules_to_save=["embed_tokens", "lm_head"],
    )
    result = train(config, progress=False)
    base = result.model.get_base_model()
    embeddings, head = base.get_input_embeddings(), base.get_output_embeddings()
    assert embeddings.modules_to_save["default"].weight is not head.modules_to_save["default"].weight
    saved = json.loads((result.output_dir / "adapter_config.json").read_text())
    assert saved["ensure_weight_tying"] is False


@pytest.mark.parametrize(
    "settings, says",
    [
        (
            dict(modules_to_save=["embed"]),
            "modules_to_save: embed match no module of this model (its embeddings and head: embed_tokens, lm_head)",
        ),
        (dict(modules_to_save=["down_proj"]), "modules_to_save: down_proj also get LoRA adapters (targets)"),
    ],
)
def test_modules_to_save_that_the_model_cannot_take_are_refused_before_loading(tmp_path, settings, says):
    config = tiny_config(tmp_path / "run", max_steps=1, **settings)
    with pytest.raises(ConfigError) as caught:
        train(config, progress=False)
    assert says in str(caught.value)
    assert not (tmp_path / "run" / "adapter").exists()


def test_adapter_options_on_several_gpus_are_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError) as caught:
        tiny_config(tmp_path / "run", gpus=2, shard="fsdp", dora=True, modules_to_save=["lm_head"], device="auto")
    assert "dora: true, modules_to_save with gpus: 2: memfit train runs these on one process; set gpus: 1" in str(
        caught.value
    )


def test_lora_8bit_on_the_cpu_says_it_is_slow_there(tmp_path):
    pytest.importorskip("bitsandbytes")
    from rich.console import Console

    console = Console(stderr=True, record=True, width=200)
    result = train(
        tiny_config(tmp_path / "run", method="lora-8bit", max_steps=3, lr=1e-2), progress=False, console=console
    )
    said = console.export_text()
    assert said.count("method: lora-8bit on the CPU runs bitsandbytes' CPU path for 8-bit layers") == 1
    assert "MatMul8bitLt: inputs will be cast" not in said
    assert all(loss == loss for _, loss in result.losses)
    layer = result.model.get_base_model().model.layers[0].self_attn.q_proj.base_layer
    assert type(layer).__name__ == "Linear8bitLt" and layer.weight.dtype == torch.int8


def test_a_trained_dora_adapter_with_a_tied_head_merges_as_peft_merges_it(tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "merge"))
    from merge_helpers import assert_same_tensors, peft_merge

    from memfit.merge import merge

    base_dir = save_tiny_pretrained(tmp_path / "base", tie=True, max_shard_size="40KB")
    config = tiny_config(
        tmp_path / "run",
        model=str(base_dir),
        init="pretrained",
        model_overrides={},
        max_steps=3,
        lr=1e-2,
        dora=True,
        modules_to_save=["lm_head"],
    )
    result = train(config, progress=False)
    merged = merge(base_dir, result.output_dir, tmp_path / "merged", progress=False)
    assert merged.shard_count > 1 and not merged.untied_embeddings
    assert_same_tensors(tmp_path / "merged", peft_merge(base_dir, result.output_dir, tmp_path / "peft", torch.float32))


def test_dora_and_a_tied_copy_resume_exactly(tmp_path):
    base_dir = save_tiny_pretrained(tmp_path / "base", tie=True)
    settings = dict(
        model=str(base_dir),
        init="pretrained",
        model_overrides={},
        lr=1e-2,
        dora=True,
        modules_to_save=["lm_head"],
        save_every=2,
    )
    straight = train(tiny_config(tmp_path / "straight", max_steps=4, **settings), progress=False)
    train(tiny_config(tmp_path / "resumed", max_steps=2, **settings), progress=False)
    resumed = train(tiny_config(tmp_path / "resumed", max_steps=4, **settings), resume=True, progress=False)
    assert [loss for _, loss in resumed.losses][-2:] == [loss for _, loss in straight.losses][-2:]
    for (name, a), (_, b) in zip(straight.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(a, b), name
