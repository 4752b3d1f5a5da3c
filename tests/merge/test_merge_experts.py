"""Merging LoRA on mixture-of-experts weights gives PEFT's merge_and_unload bit for bit: fused expert
weights (each expert its own pair) written back expert by expert where the checkpoint stores them
apart, routers and linear layers adapted through their weights, in every expert layout."""

from __future__ import annotations

import warnings

import pytest
from merge_helpers import assert_same_tensors, peft_merge, torch, transformers

from memfit.merge import merge
from memfit.models.build import make_config
from memfit.spec import make_spec
from memfit.step.prepare import attach_lora
from memfit.train.conformance import TINY_MODELS


def _base(folder, name: str, dtype):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(make_config(TINY_MODELS[name]), dtype=dtype)
    model.save_pretrained(folder, max_shard_size="40KB")
    return folder


def _adapter(base, folder, dtype, **knobs):
    """An adapter made as memfit makes it (its targets, PEFT's layout), every LoRA value random."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=dtype)
        adapted = attach_lora(model, make_spec(method="lora", rank=4, **knobs))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    adapted.save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    "name, targets",
    [
        ("qwen3_moe", ("all-linear",)),  # experts apart in the checkpoint; a dense layer adapted through its weight
        ("mixtral", ("experts", "gate", "q_proj")),  # experts and router under their old names (w1, w3, w2)
        ("gpt_oss", ("experts", "router")),  # experts whole, [experts, in, out], biases beside them
        ("llama4_text", ("all-linear", "router")),  # [experts, in, out] without the flag; a router that is an nn.Linear
        ("deepseek_v2", ("experts", "down_proj")),  # shared experts and a dense layer
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_lora_on_experts_merges_as_peft_merges_it(tmp_path, name, targets, dtype):
    base = _base(tmp_path / "base", name, dtype)
    adapter = _adapter(base, tmp_path / "adapter", dtype, targets=targets)
    result = merge(base, adapter, tmp_path / "ours", progress=False)
    assert result.merged_tensor_count > 0
    assert_same_tensors(tmp_path / "ours", peft_merge(base, adapter, tmp_path / "peft", dtype))


def test_an_adapter_plain_peft_made_on_experts_merges_as_peft_merges_it(tmp_path):
    # PEFT's own all-linear on Qwen3-MoE: its transformers-5 conversion targets the router and the
    # experts by bare weight names (gate.weight, gate_up_proj at rank 2r, down_proj).
    from merge_helpers import save_adapter

    base = _base(tmp_path / "base", "qwen3_moe", torch.bfloat16)
    adapter = save_adapter(base, tmp_path / "adapter", torch.bfloat16, r=4, lora_alpha=8, target_modules="all-linear")
    merge(base, adapter, tmp_path / "ours", progress=False)
    assert_same_tensors(tmp_path / "ours", peft_merge(base, adapter, tmp_path / "peft", torch.bfloat16))


def test_an_expert_adapter_for_other_experts_is_refused_with_the_weight(tmp_path):
    from memfit.merge import MergeError

    base = _base(tmp_path / "base", "mixtral", torch.bfloat16)
    adapter = _adapter(base, tmp_path / "adapter", torch.bfloat16, targets=("experts",))
    config = dict(TINY_MODELS["mixtral"], num_local_experts=2)
    other = tmp_path / "other"
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(make_config(config), dtype=torch.bfloat16).save_pretrained(other)
    with pytest.raises(MergeError, match=r"experts\.(down_proj|gate_up_proj)"):
        merge(other, adapter, tmp_path / "ours", progress=False)
