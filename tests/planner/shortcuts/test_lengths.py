"""The step at any sequence length from three simulated ones: equal to simulating it, byte for byte,
and the longest-sequence search that uses it gives the answer the search without it gives."""

from __future__ import annotations

import pytest

import memfit
from memfit.planner.api import predicted_plan
from memfit.planner.inputs import resolve
from memfit.planner.search import longest, plans
from memfit.planner.search.driver import fit
from memfit.planner.search.request import FitRequest
from memfit.planner.shortcuts.lengths import LengthSampler, Unpredictable

LONG = dict(checkpointing="offload", tiling="on", batch_size=1, grad_accum=4)
LEARNT_FROM = (8192, 9856)  # the search's: 64 steps of 128 tokens, and 64 + 13


def _compare(model: str, budget: str, lengths: list[int], **knobs) -> None:
    target = resolve(model, budget=budget, **knobs).target
    sampler = LengthSampler(LEARNT_FROM)
    for seq_len in lengths:
        simulated = memfit.plan(model, budget=budget, seq_len=seq_len, cache=False, **knobs)
        predicted = predicted_plan(model, sampler, target=target, seq_len=seq_len, **knobs)
        assert predicted.details["predicted"]
        assert (predicted.device_total_bytes, predicted.allocated_bytes, predicted.reserved_bytes) == (
            simulated.device_total_bytes,
            simulated.allocated_bytes,
            simulated.reserved_bytes,
        ), seq_len
        assert (predicted.phase, predicted.categories, predicted.fits) == (
            simulated.phase,
            simulated.categories,
            simulated.fits,
        )
        assert predicted.details["phase_peaks_allocated_bytes"] == simulated.details["phase_peaks_allocated_bytes"]


@pytest.mark.parametrize("method, lengths", [("lora", [9984, 65536 + 640]), ("full", [31360])])
def test_a_predicted_plan_is_the_simulated_plan_at_lengths_it_was_not_learnt_from(method, lengths):
    # Lengths off every chunk boundary (tiles of 2048 tokens, loss chunks of 1024), between and far
    # beyond the two it learnt from.
    _compare("llama-3.2-1b", "8GiB", lengths, method=method, **LONG)


def test_a_predicted_4bit_plan_is_the_simulated_plan():
    pytest.importorskip("bitsandbytes")
    _compare("llama-3.2-1b", "8GiB", [20608], method="qlora", **LONG)


def test_a_predicted_plan_of_one_rank_is_the_simulated_plan():
    _compare("llama-3.2-1b", "8GiB", [24704], method="lora", gpus=2, shard="fsdp", **LONG)


def test_a_steering_prediction_differs_from_the_exact_one_in_the_allocators_overhead_alone(tmp_path, monkeypatch):
    # With the plan cache on: a steering prediction is kept apart from the exact one of the same
    # length (neither is handed out for the other).
    monkeypatch.setenv("MEMFIT_CACHE", str(tmp_path))
    monkeypatch.setenv("MEMFIT_PLAN_CACHE", "1")
    knobs = dict(method="lora", seq_len=24704, **LONG)
    target = resolve("llama-3.2-1b", budget="8GiB", **knobs).target
    sampler = LengthSampler(LEARNT_FROM)
    exact = predicted_plan("llama-3.2-1b", sampler, target=target, **knobs)
    steering = predicted_plan("llama-3.2-1b", sampler.steering(), target=target, **knobs)
    again = predicted_plan("llama-3.2-1b", sampler, target=target, **knobs)
    assert steering.allocated_bytes == exact.allocated_bytes
    assert {k: v for k, v in steering.categories.items() if k != "allocator"} == {
        k: v for k, v in exact.categories.items() if k != "allocator"
    }
    assert steering.reserved_bytes != exact.reserved_bytes  # the samples' overhead, not the full depth's
    assert again.reserved_bytes == exact.reserved_bytes


def test_lengths_whose_step_differs_in_structure_are_not_predicted():
    # Below four tiles the tiled loops run every chunk: the structure changes with the length.
    sampler = LengthSampler((2048, 3712))
    target = resolve("llama-3.2-1b", budget="8GiB", method="lora", **LONG).target
    with pytest.raises(Unpredictable):
        predicted_plan("llama-3.2-1b", sampler, target=target, seq_len=6144, method="lora", **LONG)


def test_below_the_lengths_learnt_from_nothing_is_predicted():
    sampler = LengthSampler(LEARNT_FROM)
    target = resolve("llama-3.2-1b", budget="8GiB", method="lora", **LONG).target
    with pytest.raises(Unpredictable):
        predicted_plan("llama-3.2-1b", sampler, target=target, seq_len=4096, method="lora", **LONG)


def test_the_longest_sequence_is_the_same_with_and_without_predictions(monkeypatch):
    request = FitRequest("llama-3.2-1b", budget="8GiB", batch_size=1, methods=("lora",), workers=1)
    with_model = fit(request)
    monkeypatch.setattr(longest, "_predicted_boundary", lambda *args, **kwargs: None)
    without = fit(request)
    assert with_model.max_seq_len == without.max_seq_len
    assert with_model.max_seq_len["lora"] > 16384  # found past the lengths the model was learnt from
    assert with_model.max_seq_len_specs == without.max_seq_len_specs
    assert with_model.plans_made < without.plans_made


def test_the_boundary_is_interpolated_between_the_first_plans_and_the_limit(monkeypatch):
    # Llama-3.1-8B LoRA on 24 GiB: the line through the two plans learnt from points below the
    # boundary; stepping out from there took fifteen predictions, from both ends it takes seven,
    # which only steer (no full-depth replay); the rough boundary they find is the exact one, which
    # then takes two exact predictions (the longest length and the next).
    asked = []
    predict = plans.SearchPlanner.predict

    def counted(self, sampler, **knobs):
        asked.append((knobs["seq_len"], sampler.steers_only))
        return predict(self, sampler, **knobs)

    monkeypatch.setattr(plans.SearchPlanner, "predict", counted)
    found = fit(FitRequest("llama-3.1-8b", gpu="rtx-4090", batch_size=1, methods=("lora",), workers=1))
    assert found.max_seq_len["lora"] == 58880  # benchmarks/results/fit_answers.json
    assert asked[0] == (131072, True)  # the limit first
    steering = [length for length, steers in asked if steers]
    assert len(steering) <= 7, asked
    assert [length for length, steers in asked if not steers] == [58880, 59008], asked
