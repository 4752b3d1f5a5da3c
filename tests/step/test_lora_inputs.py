"""LoRA layers keep their input in the compute dtype: same numbers as PEFT, no fp32 input copies."""

from __future__ import annotations

import copy

import torch

from memfit.spec import make_spec
from memfit.step.lora_inputs import keep_lora_inputs_low_precision
from memfit.step.prepare import attach_lora

HIDDEN = 64


def _model(seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=HIDDEN,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=256,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model = attach_lora(model, make_spec(method="lora", rank=8))
    with torch.no_grad():  # lora_B starts at zero; make it count in the gradients of lora_A
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return model


def _grads(model, ids) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def test_outputs_and_gradients_equal_peft():
    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    peft_model = _model()
    ours = copy.deepcopy(peft_model)
    assert keep_lora_inputs_low_precision(ours) == 2 * 7  # every projection of both layers
    loss_a, grads_a = _grads(peft_model, ids)
    loss_b, grads_b = _grads(ours, ids)
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name in grads_a:
        assert grads_b[name].dtype == torch.float32  # adapters stay fp32
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-6, atol=1e-7, msg=name)


def _saved_fp32_input_copies(model, ids) -> int:
    """fp32 tensors of the hidden width that autograd saves during forward."""
    count = 0

    def pack(t):
        nonlocal count
        if t.dtype == torch.float32 and t.dim() >= 2 and t.shape[-1] == HIDDEN and t.numel() >= ids.numel() * HIDDEN:
            count += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids)
    return count


def test_no_fp32_copy_of_the_input_is_saved():
    ids = torch.randint(0, 128, (1, 64))
    peft_model = _model()
    before = _saved_fp32_input_copies(peft_model, ids)
    keep_lora_inputs_low_precision(peft_model)
    after = _saved_fp32_input_copies(peft_model, ids)
    assert before >= 2 * 4  # PEFT: q, k, v and o (and the MLP's) inputs, per layer, in fp32
    # What remains are the RMSNorms' own fp32 upcasts, not the LoRA layers'.
    assert after <= before - 2 * 4


def test_idempotent_and_names_unchanged():
    model = _model()
    keys = list(model.state_dict())
    assert keep_lora_inputs_low_precision(model) == keep_lora_inputs_low_precision(model)
    assert list(model.state_dict()) == keys
    assert keep_lora_inputs_low_precision(torch.nn.Linear(4, 4)) == 0


def test_under_autocast_the_adapters_compute_as_autocast_runs_them():
    # Mixed precision (bf16-mixed): autocast runs every linear in bf16 from the input as it comes,
    # so the adapters keep no fp32 copy of it, and compute what PEFT's layers compute under autocast
    # with their input cast turned off.
    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    plain = _model()
    for module in plain.modules():
        if hasattr(module, "cast_input_dtype_enabled"):
            module.cast_input_dtype_enabled = False
    ours = copy.deepcopy(plain)
    keep_lora_inputs_low_precision(ours)
    results = []
    for model in (plain, ours):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
            copies = _saved_fp32_input_copies(model, ids)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}))
        assert copies <= _saved_fp32_input_copies(_model(), ids) - 2 * 4  # no LoRA input saved in fp32
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.equal(loss_a, loss_b)
    for name, grad in grads_a.items():
        assert grads_b[name].dtype == torch.float32
        torch.testing.assert_close(grads_b[name], grad, rtol=0, atol=0, msg=name)
