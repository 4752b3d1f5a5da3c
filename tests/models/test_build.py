"""Building and materialising models for the planner keeps what the trainer's model has."""

from __future__ import annotations

from memfit.models.build import DTYPES, build_meta_model, make_config, materialize
from memfit.planner.exact.simulate import simulate
from memfit.planner.exact.tracker import round_block_bytes
from memfit.spec import make_spec
from memfit.step.prepare import prepare_for_method


def test_materialize_keeps_tied_embeddings_tied(tiny_llama):
    spec = make_spec(method="full", seq_len=32)
    model = prepare_for_method(
        build_meta_model(make_config(dict(tiny_llama, tie_word_embeddings=True)), DTYPES["bf16"]), spec
    )
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
    materialize(model, "cpu")
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight


def test_plan_counts_a_tied_head_once(tiny_llama):
    tied_config = dict(tiny_llama, tie_word_embeddings=True)
    spec = make_spec(method="full", precision="bf16", seq_len=32)
    model = prepare_for_method(build_meta_model(make_config(tied_config), DTYPES["bf16"]), spec)
    unique = sum(round_block_bytes(2 * p.numel()) for p in model.parameters())  # parameters() lists a tied one once
    result = simulate(tied_config, spec).tracker
    marks = [index for name, index in result.phase_marks if name == "optimizer"]
    at_step = result.categories_at(marks[-1])
    assert at_step["trainable"] == unique
    assert at_step["gradients"] == unique


def _fresh_buffers(config: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("cpu"):
        return dict(AutoModelForCausalLM.from_config(make_config(config)).named_buffers())


def test_random_materialize_computes_buffers_as_the_model_does(tiny_llama):
    # to_empty leaves buffers holding whatever memory held before; rotary frequencies and Gemma's
    # embedding scale must be computed, or a test's numbers depend on the tests that ran before it.
    import torch

    gemma = dict(
        model_type="gemma3_text",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=128,
    )
    llama3_rope = dict(
        tiny_llama,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    )
    for config in (llama3_rope, gemma):
        garbage = torch.full((1 << 16,), float("nan"))  # freed memory the next allocations may reuse
        del garbage
        model = materialize(build_meta_model(make_config(config), DTYPES["fp32"]), "cpu", random_values=True)
        expected = _fresh_buffers(config)
        buffers = dict(model.named_buffers())
        assert buffers.keys() == expected.keys() and buffers
        for name, value in buffers.items():
            assert torch.equal(value, expected[name]), name
