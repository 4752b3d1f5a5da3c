"""Preference plans: the same step under fake tensors as on real ones, the reference named and counted."""

from __future__ import annotations

import pytest

from memfit.planner.api import plan
from memfit.planner.exact.simulate import simulate
from memfit.spec import make_spec


@pytest.mark.parametrize(
    "knobs",
    [
        {"objective": "dpo", "method": "lora", "padding_free": "off"},
        {"objective": "dpo", "method": "full"},
        {"objective": "orpo", "method": "lora"},
        {"objective": "simpo", "method": "full", "padding_free": "off"},
    ],
    ids=["dpo lora padded", "dpo full frozen copy", "orpo lora", "simpo full padded"],
)
def test_fake_and_real_runs_count_the_same_bytes(tiny_llama, knobs):
    spec = make_spec(seq_len=24, batch_size=2, precision="fp32", **knobs)
    fake, real = simulate(tiny_llama, spec), simulate(tiny_llama, spec, fake=False)
    assert fake.tracker.peak.allocated_bytes == real.tracker.peak.allocated_bytes
    assert fake.tracker.peak.categories == real.tracker.peak.categories
    assert fake.tracker.phase_peaks == real.tracker.phase_peaks
    assert ("reference" in fake.tracker.phase_peaks) == (spec.reference in ("disabled-adapters", "frozen-copy"))


def test_full_dpo_plans_a_frozen_copy_and_precompute_reference_plans_none(tiny_llama):
    copy = simulate(tiny_llama, make_spec(objective="dpo", method="full", precision="fp32", seq_len=16)).tracker.peak
    none = simulate(
        tiny_llama, make_spec(objective="dpo", method="full", precision="fp32", seq_len=16, precompute_reference=True)
    ).tracker.peak
    sft = simulate(tiny_llama, make_spec(method="full", precision="fp32", seq_len=16)).tracker.peak
    # The copy is every parameter once more (the weights of full fine-tuning are its trainable ones).
    assert copy.categories["weights"] - none.categories["weights"] == pytest.approx(
        copy.categories["trainable"], rel=0.01
    )
    assert none.categories["weights"] == sft.categories["weights"]


def test_the_plan_names_the_reference(tiny_llama):
    lora = plan(tiny_llama, objective="dpo", method="lora", seq_len=16, precision="fp32")
    assert lora.details["objective"] == "dpo" and "adapters disabled" in lora.details["reference"]
    assert "reference" in lora.details["phase_peaks_allocated_bytes"]
    full = plan(tiny_llama, objective="dpo", method="full", seq_len=16, precision="fp32")
    assert "frozen copy" in full.details["reference"]
    assert "no reference" in plan(tiny_llama, objective="simpo", seq_len=16, precision="fp32").details["reference"]
    hf = plan(tiny_llama, objective="dpo", method="lora", seq_len=16, precision="fp32", recipe="hf")
    assert "after the policy's forward" in hf.details["reference"]
    # The plain stack's whole logits, and the reference pass on top of the policy's activations, cost more.
    assert hf.allocated_bytes > lora.allocated_bytes
    assert "objective" not in plan(tiny_llama, seq_len=16, precision="fp32").details


def test_the_reference_pass_keeps_nothing_and_no_whole_fp32_logits_exist(tiny_llama):
    config = dict(tiny_llama, vocab_size=4096)
    # 4 sequences of 1,024 tokens: the chunked log-probs work through them 1,024 tokens at a time.
    spec = make_spec(objective="dpo", method="lora", precision="fp32", seq_len=1024, batch_size=2, padding_free="off")
    result = simulate(config, spec).tracker
    # What the reference pass leaves behind is its [2 x pairs] log-probs, not activations.
    for segment in (s for s in result.segments() if s.phase == "reference"):
        assert segment.end_bytes - segment.start_bytes <= 1024
    whole_logits = 2 * spec.batch_size * spec.seq_len * config["vocab_size"] * 4
    assert max(a.nbytes for a in result.allocations) <= whole_logits / 4  # one chunk at a time
    hf = simulate(config, spec.model_copy(update={"recipe": "hf"})).tracker
    assert max(a.nbytes for a in hf.allocations) >= whole_logits  # the plain step's fp32 logits
