"""Detectors on synthetic timelines (fire when they should, quiet when they should not) and
inspect_model on real tiny models."""

from __future__ import annotations

import random

import pytest
from watch_helpers import GiB, MiB, checkpointing_off, start_record, step_records

from memfit.watch.detectors import (
    Point,
    detect_all,
    detect_fragmentation,
    detect_leak,
    detect_other_processes,
    detect_stray_device,
    steps_until_full,
    theil_sen_slope,
)
from memfit.watch.timeline import Timeline


def timeline(n, *, expected=("cpu",), total_steps=None, capacity=None, **kwargs) -> Timeline:
    return Timeline(start=start_record(expected, total_steps, capacity=capacity), steps=step_records(n, **kwargs))


# ---------------------------------------------------------------------------- slopes


def test_theil_sen_ignores_outliers():
    rng = random.Random(0)
    points = [Point(s, 1000 * s + rng.randint(-50, 50)) for s in range(100)]
    for s in (10, 40, 70):  # a few wild readings (an evaluation, a checkpoint save)
        points[s] = Point(s, 10**9)
    assert theil_sen_slope(points) == pytest.approx(1000, rel=0.02)
    assert theil_sen_slope([Point(1, 5)]) == 0.0
    assert steps_until_full(100, 10) == 10 and steps_until_full(100, 0) is None


# ---------------------------------------------------------------------------- leak


def test_host_leak_reports_rate_and_the_step_memory_runs_out():
    tl = timeline(100, rss=lambda s: 400 * MiB + 3 * MiB * s, available=6 * GiB)
    [finding] = detect_leak(tl)
    assert finding.code == "leak" and finding.data["device"] == "host"
    assert finding.data["mib_per_step"] == pytest.approx(3.0)
    # 6 GiB free at step 100, 3 MiB per step: full 2048 steps later.
    assert finding.data["full_at_step"] == 100 + 2048
    assert "3.00 MiB per step" in finding.message and "step 2,148" in finding.message
    assert finding.severity == "error"  # no run length known, full within the horizon


def test_leak_is_an_error_only_when_memory_fills_before_the_run_ends():
    rss = lambda s: 400 * MiB + 3 * MiB * s  # noqa: E731
    assert detect_leak(timeline(100, rss=rss, total_steps=1000))[0].severity == "warning"
    assert detect_leak(timeline(100, rss=rss, total_steps=5000))[0].severity == "error"


def test_no_leak_on_flat_noisy_memory_or_a_single_jump():
    rng = random.Random(1)
    noisy = timeline(300, rss=lambda s: 400 * MiB + rng.randint(-8 * MiB, 8 * MiB))
    jump = timeline(300, rss=lambda s: 400 * MiB + (200 * MiB if s > 150 else 0))
    warmup_only = timeline(300, rss=lambda s: 400 * MiB + 50 * MiB * min(s, 8))
    assert detect_leak(noisy) == [] and detect_leak(jump) == [] and detect_leak(warmup_only) == []


def test_no_leak_with_too_few_steps():
    assert detect_leak(timeline(30, rss=lambda s: 400 * MiB + 3 * MiB * s)) == []


def test_device_leak_uses_allocated_bytes_and_device_capacity():
    def devices(s):
        return {
            "cuda:0": {
                "allocated_bytes": 10 * GiB + 512 * 1024 * s,
                "reserved_bytes": 12 * GiB,
                "nvml_used_bytes": 13 * GiB,
            }
        }

    tl = timeline(200, expected=("cuda:0",), devices=devices, capacity={"cuda:0": 80 * GiB})
    [finding] = detect_leak(tl)
    assert finding.data["device"] == "cuda:0"
    assert finding.data["bytes_per_step"] == pytest.approx(512 * 1024)
    assert finding.data["full_at_step"] == 200 + 67 * 2048  # 67 GiB free at 0.5 MiB per step
    steady = timeline(
        200,
        expected=("cuda:0",),
        capacity={"cuda:0": 80 * GiB},
        devices=lambda s: {"cuda:0": {"allocated_bytes": 10 * GiB, "reserved_bytes": 12 * GiB}},
    )
    assert detect_leak(steady) == []


# ---------------------------------------------------------------------------- devices


def test_stray_tensors_on_another_device_are_an_error():
    def devices(s):
        return {
            "cuda:0": {"allocated_bytes": 300 * MiB if s >= 5 else 0, "process_bytes": 800 * MiB},
            "cuda:1": {"allocated_bytes": 20 * GiB, "process_bytes": 21 * GiB},
        }

    [finding] = detect_stray_device(timeline(20, expected=("cuda:1",), devices=devices))
    assert finding.severity == "error" and finding.data["device"] == "cuda:0" and finding.step == 5
    assert "run is on cuda:1" in finding.message and "set_device('cuda:1')" in finding.fix


def test_a_stray_context_alone_is_a_warning_and_nothing_is_judged_without_expected_devices():
    def devices(s):
        return {
            "cuda:0": {"allocated_bytes": 0, "process_bytes": 500 * MiB},
            "cuda:1": {"allocated_bytes": 20 * GiB, "process_bytes": 21 * GiB},
        }

    [finding] = detect_stray_device(timeline(5, expected=("cuda:1",), devices=devices))
    assert finding.severity == "warning" and "CUDA context" in finding.message
    assert detect_stray_device(timeline(5, expected=(), devices=devices)) == []
    assert detect_stray_device(timeline(5, expected=("cuda:0", "cuda:1"), devices=devices)) == []


def test_cpu_run_with_tensors_on_a_gpu():
    devices = lambda s: {"cuda:0": {"allocated_bytes": 512}}  # noqa: E731
    [finding] = detect_stray_device(timeline(3, expected=("cpu",), devices=devices))
    assert finding.severity == "warning" and finding.data["max_allocated_bytes"] == 512


def test_other_processes_on_the_run_device():
    def devices(s):
        return {"cuda:0": {"allocated_bytes": GiB, "other_processes_bytes": 3 * GiB if s == 4 else 0}}

    [finding] = detect_other_processes(timeline(6, expected=("cuda:0",), devices=devices))
    assert finding.step == 4 and finding.data["other_processes_bytes"] == 3 * GiB
    quiet = lambda s: {"cuda:0": {"allocated_bytes": GiB, "other_processes_bytes": 100 * MiB}}  # noqa: E731
    assert detect_other_processes(timeline(6, expected=("cuda:0",), devices=quiet)) == []


# ---------------------------------------------------------------------------- fragmentation


def fragmented(first_bad: int, last_bad: int):
    def devices(s):
        reserved = 30 * GiB if first_bad <= s <= last_bad else 21 * GiB
        return {"cuda:0": {"allocated_bytes": 8 * GiB, "reserved_bytes": reserved, "peak_allocated_bytes": 20 * GiB}}

    return devices


def test_fragmentation_needs_a_long_stretch():
    [finding] = detect_fragmentation(timeline(100, expected=("cuda:0",), devices=fragmented(30, 69)))
    assert finding.data["steps"] == 40 and finding.data["max_excess_bytes"] == 10 * GiB
    assert "expandable_segments" in finding.fix
    assert detect_fragmentation(timeline(100, expected=("cuda:0",), devices=fragmented(30, 40))) == []
    # Reserved a little above the peak (the normal cache) is not fragmentation.
    assert detect_fragmentation(timeline(100, expected=("cuda:0",), devices=fragmented(200, 200))) == []


def test_detect_all_runs_every_detector_most_severe_first():
    devices = lambda s: {"cuda:0": {"allocated_bytes": 100 * MiB}, "cuda:1": {"allocated_bytes": GiB}}  # noqa: E731
    tl = timeline(100, expected=("cuda:1",), devices=devices, rss=lambda s: 400 * MiB + 3 * MiB * s, total_steps=10_000)
    codes = [(f.severity, f.code) for f in detect_all(tl)]
    assert codes == [("error", "stray_device"), ("error", "leak")]  # same severity: earlier step first


# ---------------------------------------------------------------------------- the live model


@pytest.fixture
def lora_spec():
    from memfit.spec import make_spec

    return make_spec(method="lora", rank=4, precision="fp32", checkpointing="on")


def lora_model(config, spec):
    from transformers import AutoModelForCausalLM

    from memfit.step.prepare import attach_lora, enable_checkpointing

    model = attach_lora(AutoModelForCausalLM.from_config(config, attn_implementation="sdpa"), spec)
    enable_checkpointing(model)
    model.train()
    return model


def test_a_clean_lora_model_has_no_findings(tiny_llama_config, lora_spec):
    from memfit.watch.detectors import inspect_model

    assert inspect_model(lora_model(tiny_llama_config, lora_spec), lora_spec) == []


def test_wrapper_that_switches_checkpointing_off(tiny_llama_config, lora_spec):

    from memfit.watch.detectors import inspect_model

    found = {f.code: f for f in inspect_model(checkpointing_off(lora_model(tiny_llama_config, lora_spec)), lora_spec)}
    assert set(found) == {"wrapped_model", "checkpointing_inactive"}
    assert found["checkpointing_inactive"].severity == "error"
    assert "off in 2 of 2 decoder layers" in found["checkpointing_inactive"].message
    assert "CheckpointingOff wrapped around a PeftModel" in found["wrapped_model"].message


def test_eval_mode_makes_checkpointing_inactive(tiny_llama_config, lora_spec):
    from memfit.watch.detectors import inspect_model

    model = lora_model(tiny_llama_config, lora_spec).eval()
    [finding] = inspect_model(model, lora_spec)
    assert finding.code == "checkpointing_inactive" and "eval mode" in finding.message


def test_frozen_weight_with_requires_grad(tiny_llama_config, lora_spec):
    from memfit.watch.detectors import inspect_model

    model = lora_model(tiny_llama_config, lora_spec)
    weight = model.get_base_model().model.layers[0].mlp.down_proj.base_layer.weight
    weight.requires_grad_(True)
    [finding] = inspect_model(model)  # method inferred from the PeftModel
    assert finding.code == "frozen_trainable" and finding.severity == "error"
    assert finding.data["parameters"] == weight.numel() and "down_proj" in finding.data["first"]


def test_frozen_weights_holding_gradients_and_a_wrong_trainable_count(tiny_llama_config):
    import torch
    from transformers import AutoModelForCausalLM

    from memfit.watch.detectors import inspect_model

    model = AutoModelForCausalLM.from_config(tiny_llama_config)
    norm = model.model.norm.weight
    norm.requires_grad_(False)
    norm.grad = torch.ones_like(norm)
    found = {f.code: f for f in inspect_model(model, {"method": "full", "checkpointing": "off"})}
    assert set(found) == {"frozen_gradients", "trainable_count"}
    assert found["trainable_count"].data["expected"] - found["trainable_count"].data["trainable"] == norm.numel()


def test_bad_spec_type_is_refused(tiny_llama_config):
    from transformers import AutoModelForCausalLM

    from memfit.watch.detectors import inspect_model

    with pytest.raises(TypeError, match="spec must be"):
        inspect_model(AutoModelForCausalLM.from_config(tiny_llama_config), "lora")


def test_without_a_spec_checkpointing_is_expected_where_the_model_enabled_it(tiny_llama_config, lora_spec):
    from memfit.watch.detectors import inspect_model

    model = lora_model(tiny_llama_config, lora_spec)  # a PeftModel: the method is inferred too
    assert inspect_model(model) == []
    for layer in model.get_base_model().model.layers:
        layer.gradient_checkpointing = False  # the flag the layers check, switched off behind the model's back
    [finding] = inspect_model(model)
    assert finding.code == "checkpointing_inactive"


def test_host_leak_seen_in_the_heap_while_rss_stays_flat():
    # Freed-but-resident pages are reused first: RSS shows nothing until they run out.
    tl = timeline(100, rss=lambda s: 900 * MiB)
    for record in tl.steps:
        record["heap_bytes"] = 200 * MiB + 3 * MiB * record["step"]
    [finding] = detect_leak(tl)
    assert finding.data["measure"] == "heap_bytes" and "malloc heap in use" in finding.message
    assert finding.data["mib_per_step"] == pytest.approx(3.0)
    # When both show it, one finding (from the heap, the exact one).
    for record in tl.steps:
        record["rss_bytes"] = 900 * MiB + 3 * MiB * record["step"]
    assert [f.data["measure"] for f in detect_leak(tl)] == ["heap_bytes"]


# ---------------------------------------------------------------------------- grpo's completions


def _grpo_timeline(lengths, peaks):
    records = step_records(
        len(lengths), devices=lambda s: {"cuda:0": {"allocated_bytes": 2 * GiB, "peak_allocated_bytes": peaks[s - 1]}}
    )
    for record, length in zip(records, lengths):
        record["extra"] = {"loss": 0.1, "longest_sequence": length}
    return Timeline(start=start_record(("cuda:0",), None), steps=records)


def test_a_peak_that_rises_with_longer_completions_is_said_not_to_be_a_leak():
    from memfit.watch.detectors import detect_longer_completions

    lengths = [100, 120, 300, 250, 500, 480, 900, 900]
    peaks = [5 * GiB, 5 * GiB, 5 * GiB, 5 * GiB, 6 * GiB, 6 * GiB, 7 * GiB, 7 * GiB]
    found = detect_longer_completions(_grpo_timeline(lengths, peaks))
    assert [f.code for f in found] == ["longer_completions"] and found[0].severity == "info"
    assert "not a leak" in found[0].message and found[0].data["to_tokens"] == 900 and found[0].data["rises"] == 2
    assert "longer_completions" in [f.code for f in detect_all(_grpo_timeline(lengths, peaks))]


def test_a_rise_without_a_longer_completion_is_not_explained_away():
    from memfit.watch.detectors import detect_longer_completions

    lengths = [100, 120, 300, 300, 500, 480, 480, 480]
    peaks = [5 * GiB] * 5 + [6 * GiB, 7 * GiB, 7 * GiB]  # rises at steps 6 and 7, with no longer sequence
    assert detect_longer_completions(_grpo_timeline(lengths, peaks)) == []
    assert detect_longer_completions(timeline(10)) == []  # no grpo lengths: nothing to say
