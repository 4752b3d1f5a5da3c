"""Tiny random models and adapters for the merge tests, and PEFT's own merge as the reference."""

from __future__ import annotations

import glob
import json
import os
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


def llama_config(**overrides):
    kwargs = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=128,
    )
    kwargs.update(overrides)
    return transformers.LlamaConfig(**kwargs)


def qwen2_config(**overrides):
    kwargs = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    return transformers.Qwen2Config(**kwargs)


def gpt2_config(**overrides):
    kwargs = dict(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=128)
    kwargs.update(overrides)
    return transformers.GPT2Config(**kwargs)


def save_base(config, folder: Path, dtype, max_shard_size="60KB", seed=0) -> Path:
    """A random model saved in several shards, with a copy of a tokenizer-like file set."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype)
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    (folder / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 128}))
    (folder / "chat_template.jinja").write_text("{{ messages }}")
    return folder


def save_adapter(base: Path, folder: Path, dtype, seed=1, **lora_kwargs) -> Path:
    """Attach LoRA with PEFT, give every LoRA / saved tensor random non-zero values, save it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=dtype)
        peft_model = peft.get_peft_model(model, peft.LoraConfig(**lora_kwargs))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_magnitude_vector" in name:
                # DoRA's magnitudes start as the row norms; trained ones move away from them
                param.mul_(1 + torch.randn(param.shape, generator=gen) * 0.1)
            elif "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
            elif "modules_to_save" in name:
                param.add_(torch.randn(param.shape, generator=gen).to(param.dtype) * 0.1)
    peft_model.save_pretrained(folder)
    return folder


def peft_merge(base: Path, adapter: Path, folder: Path, dtype) -> Path:
    """The reference: PeftModel.from_pretrained + merge_and_unload + save_pretrained."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=dtype)
        merged = peft.PeftModel.from_pretrained(model, adapter).merge_and_unload()
        merged.save_pretrained(folder)
    return folder


def load_tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    tensors = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        tensors.update(load_file(path))
    return tensors


def assert_same_tensors(ours: Path, reference: Path, cast=None) -> None:
    got, want = load_tensors(ours), load_tensors(reference)
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        expected = tensor.to(cast) if cast is not None and tensor.is_floating_point() else tensor
        assert got[name].dtype == expected.dtype, name
        assert torch.equal(got[name], expected), f"{name} differs"
