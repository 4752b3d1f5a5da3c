"""LoRA on 4-bit experts is PEFT's LoRA on the 16-bit experts: the same parameters under the same
names, the same outputs and gradients (the 16-bit experts holding the dequantized weights)."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("bitsandbytes")

from memfit.models.build import make_config
from memfit.models.experts import expert_modules
from memfit.models.experts_nf4 import dequantized, fill_random, nf4_expert_modules, quantize_experts_on_meta
from memfit.spec import make_spec
from memfit.step.prepare import attach_lora
from memfit.train.conformance import TINY_MODELS


def _adapted_pair(name: str):
    import transformers

    torch.manual_seed(0)
    dense = transformers.AutoModelForCausalLM.from_config(make_config(TINY_MODELS[name]), dtype=torch.float32)
    quantized = copy.deepcopy(dense)
    quantize_experts_on_meta(quantized, torch.float32)
    for original, module in zip(expert_modules(dense).values(), nf4_expert_modules(quantized)):
        fill_random(module, "cpu")
        for weight in module.expert_weights:
            getattr(original, weight.name).data.copy_(dequantized(module, weight.name))
    spec = make_spec(method="lora", targets=("experts", "q_proj"), rank=4)
    return attach_lora(dense, spec), attach_lora(quantized, spec)


# Llama 4's weights are [experts, in, out] without saying so: PEFT swaps their in and out, and the
# 4-bit experts apply the pair as PEFT does for them.
@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss", "llama4_text"])
def test_lora_on_four_bit_experts_is_peft_lora_on_the_dequantized_experts(name):
    dense, quantized = _adapted_pair(name)
    want = {k: v for k, v in dense.state_dict().items() if "lora_" in k}
    got = {k: v for k, v in quantized.state_dict().items() if "lora_" in k}
    assert want.keys() == got.keys() and all(want[k].shape == got[k].shape for k in want)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for key, value in want.items():
            value.copy_(torch.randn(value.shape, generator=generator) * 0.1)
            got[key].copy_(value)
    x = torch.randint(3, 500, (1, 12))
    out_dense, out_quantized = dense(input_ids=x).logits, quantized(input_ids=x).logits
    assert torch.allclose(out_quantized, out_dense, atol=1e-5)
    out_dense.sum().backward()
    out_quantized.sum().backward()
    grads = {n: p.grad for n, p in quantized.named_parameters() if p.grad is not None}
    for n, p in dense.named_parameters():
        if p.grad is not None:
            assert torch.allclose(grads[n], p.grad, atol=1e-5, rtol=1e-4), n


def test_a_four_bit_experts_adapter_is_merged_by_memfit_merge_not_in_place():
    _, quantized = _adapted_pair("mixtral")
    with pytest.raises(ValueError, match="memfit merge"):
        quantized.merge_and_unload()
