"""4-bit experts: each expert stored as bitsandbytes stores a 4-bit linear layer, computed as the
16-bit experts with the dequantized weights compute, counted unpacked."""

from __future__ import annotations

import copy

import pytest
import torch

bnbf = pytest.importorskip("bitsandbytes.functional")

from memfit.models.build import count_parameters, make_config  # noqa: E402
from memfit.models.experts import expert_modules  # noqa: E402
from memfit.models.experts_nf4 import (  # noqa: E402
    dequantized,
    fill_random,
    nf4_expert_modules,
    quantize_expert,
    quantize_experts_on_meta,
)
from memfit.models.quantize import NF4_BLOCKSIZE  # noqa: E402
from memfit.train.conformance import TINY_MODELS  # noqa: E402


def _pair(name: str, dtype=torch.float32):
    """A tiny model and its copy with 4-bit experts, the 16-bit experts set to the 4-bit ones' values."""
    import transformers

    torch.manual_seed(0)
    dense = transformers.AutoModelForCausalLM.from_config(make_config(TINY_MODELS[name]), dtype=dtype)
    quantized = copy.deepcopy(dense)
    assert quantize_experts_on_meta(quantized, dtype) == len(expert_modules(dense)) > 0
    for module in nf4_expert_modules(quantized):
        fill_random(module, "cpu")
    for original, module in zip(expert_modules(dense).values(), nf4_expert_modules(quantized)):
        for weight in module.expert_weights:
            getattr(original, weight.name).data.copy_(dequantized(module, weight.name))
    return dense, quantized


def test_an_expert_is_stored_as_bitsandbytes_quantizes_a_weight():
    _, model = _pair("mixtral")
    module = nf4_expert_modules(model)[0]
    dense = torch.randn(128, 64)
    quantize_expert(module, "gate_up_proj", 2, dense)
    packed, state = bnbf.quantize_4bit(dense, blocksize=NF4_BLOCKSIZE, compress_statistics=True, quant_type="nf4")
    assert torch.equal(module.gate_up_proj[2], packed.view(-1))
    assert torch.equal(module.gate_up_proj_absmax[2], state.absmax)
    assert torch.equal(dequantized(module, "gate_up_proj")[2], bnbf.dequantize_4bit(packed, state))


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss", "llama4_text"])
def test_four_bit_experts_compute_what_the_dequantized_experts_compute(name):
    dense, quantized = _pair(name)
    x = torch.randint(3, 500, (1, 12))
    want, got = dense(input_ids=x).logits, quantized(input_ids=x).logits
    assert torch.allclose(got, want, atol=1e-5)
    embeddings = [m.get_input_embeddings().weight for m in (dense, quantized)]
    for e in embeddings:
        e.requires_grad_(True)
    want.sum().backward()
    got.sum().backward()
    assert torch.allclose(embeddings[1].grad, embeddings[0].grad, atol=1e-5, rtol=1e-4)


def test_four_bit_experts_count_their_unpacked_elements():
    dense, quantized = _pair("gpt_oss")
    assert count_parameters(quantized)[0] == count_parameters(dense)[0]
    packed = sum(p.numel() for p in quantized.parameters())
    assert packed < count_parameters(quantized)[0]
