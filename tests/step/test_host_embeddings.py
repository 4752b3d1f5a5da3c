"""Frozen, untied input embeddings in host memory: same numbers, the plan moves them off the device."""

from __future__ import annotations

import copy

import torch

from memfit.planner.exact.simulate import simulate
from memfit.spec import make_spec
from memfit.step.host_embeddings import keep_input_embeddings_on_host
from memfit.step.prepare import attach_lora


def _lora_model(tie: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
    )
    model = attach_lora(LlamaForCausalLM(config), make_spec(method="lora", rank=4))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return model


def test_untied_frozen_table_moves_and_numbers_stay():
    plain = _lora_model(tie=False)
    moved = copy.deepcopy(plain)
    table = moved.get_base_model().get_input_embeddings().weight
    keys = list(moved.state_dict())
    assert keep_input_embeddings_on_host(moved.get_base_model())
    assert keep_input_embeddings_on_host(moved.get_base_model())  # idempotent
    after = moved.get_base_model().get_input_embeddings().weight
    assert after is table and after.data.untyped_storage().data_ptr() != 0  # same Parameter, new host storage
    assert list(moved.state_dict()) == keys
    ids = torch.randint(0, 128, (2, 24))
    grads = []
    for model in (plain, moved):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=0, atol=0, msg=name)


def test_tied_or_trainable_tables_stay_where_they_are():
    tied = _lora_model(tie=True)
    assert not keep_input_embeddings_on_host(tied.get_base_model())
    full = _lora_model(tie=False).get_base_model()
    full.get_input_embeddings().weight.requires_grad_(True)
    assert not keep_input_embeddings_on_host(full)


def test_plan_counts_the_table_as_host_memory(tiny_llama):
    config = dict(tiny_llama, vocab_size=32768)  # a table large enough to see: 32768 x 64 x 2 B = 4 MiB
    table_bytes = 32768 * 64 * 2
    untied = simulate(config, make_spec(method="lora", seq_len=64)).tracker
    tied = simulate(dict(config, tie_word_embeddings=True), make_spec(method="lora", seq_len=64)).tracker
    assert untied.outside_peaks.get("host", 0) >= table_bytes
    assert tied.outside_peaks.get("host", 0) == 0
    # Full fine-tuning trains the table: it stays on the device.
    full = simulate(config, make_spec(method="full", seq_len=64)).tracker
    assert full.outside_peaks.get("host", 0) == 0
