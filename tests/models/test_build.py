"""Building and materialising models for the planner keeps what the trainer's model has."""

from __future__ import annotations

from memfit.models.build import DTYPES, build_meta_model, make_config, materialize
from memfit.planner.simulate import simulate
from memfit.planner.tracker import round_block_bytes
from memfit.spec import make_spec
from memfit.step.prepare import prepare_for_method


def test_materialize_keeps_tied_embeddings_tied(tiny_llama):
    spec = make_spec(method="full", seq_len=32)
    model = prepare_for_method(build_meta_model(make_config(dict(tiny_llama, tie_word_embeddings=True)), DTYPES["bf16"]), spec)
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
