"""Predicted versus measured: synthetic attributions, and a real tiny LoRA run against its plan
(checkpointing on as planned, then switched off by a wrapper)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from watch_helpers import (  # noqa: E402
    GiB,
    MiB,
    checkpointing_off,
    start_record,
    step_records,
    tiny_plan,
)

from memfit.watch.compare import (  # noqa: E402
    compare_categories,
    compare_peaks,
    comparison_lines,
    detect_above_plan,
    measured_categories,
)
from memfit.watch.thresholds import Thresholds  # noqa: E402
from memfit.watch.timeline import Timeline  # noqa: E402


def attributed(categories, expected=("cpu",), devices=None, plan=None) -> Timeline:
    return Timeline(
        start=start_record(expected, plan=plan),
        steps=step_records(5, devices=devices),
        attribution={
            "kind": "attribution",
            "first_step": 1,
            "categories": categories,
            "peak_allocated_bytes": sum(categories.values()),
        },
    )


def test_rows_pair_plan_and_measured_categories():
    plan = tiny_plan()
    rows = {r.name: r for r in compare_categories(plan, attributed({"weights": GiB, "activations": 30 * MiB}))}
    assert rows["weights"].predicted_bytes == GiB and rows["weights"].ratio == 1.0
    assert rows["activations"].ratio == pytest.approx(1.5)
    assert rows["allocator"].measured_bytes is None  # not measurable on CPU
    assert list(rows) == [
        "weights",
        "trainable",
        "gradients",
        "optimizer",
        "activations",
        "temporaries",
        "allocator",
        "runtime",
    ]


def test_cuda_readings_give_allocator_reserve_and_context():
    def devices(s):
        return {
            "cuda:0": {
                "allocated_bytes": GiB,
                "reserved_bytes": 3 * GiB,
                "peak_allocated_bytes": 2 * GiB,
                "peak_reserved_bytes": 3 * GiB,
                "process_bytes": 3 * GiB + 500 * MiB,
            }
        }

    measured = measured_categories(attributed({"weights": GiB}, expected=("cuda:0",), devices=devices))
    assert measured["allocator"] == GiB and measured["runtime"] == 500 * MiB


def test_peaks_are_compared_on_the_run_device_only():
    devices = lambda s: {"cuda:0": {"peak_allocated_bytes": s * GiB, "peak_reserved_bytes": 5 * GiB}}  # noqa: E731
    rows = compare_peaks(tiny_plan(allocated=4 * GiB), attributed({}, expected=("cuda:0",), devices=devices))
    assert [(r.name, r.predicted_bytes, r.measured_bytes) for r in rows] == [
        ("peak allocated", 4 * GiB, 5 * GiB),
        ("peak reserved", 4 * GiB + 100 * MiB, 5 * GiB),
        ("device total", 4 * GiB + 600 * MiB, None),
    ]  # NVML did not report this process
    assert compare_peaks(tiny_plan(), attributed({})) == []  # a CPU run
    assert compare_peaks(None, attributed({}, expected=("cuda:0",), devices=devices)) == []


def test_activations_far_above_plan_name_checkpointing():
    plan = tiny_plan(activations=20 * MiB)
    [finding] = detect_above_plan(attributed({"activations": 400 * MiB}), plan)
    assert finding.code == "activations_above_plan" and finding.severity == "error"
    assert "20.0x" in finding.message and "checkpointing on" in finding.message
    assert detect_above_plan(attributed({"activations": 25 * MiB}), plan) == []
    assert detect_above_plan(attributed({"activations": 400 * MiB}), None) == []
    # Above the ratio but by less than the absolute floor: not worth an error.
    assert detect_above_plan(attributed({"activations": 40 * MiB}), tiny_plan(activations=1 * MiB)) == []


def test_peak_above_plan_from_device_counters():
    plan = tiny_plan(allocated=2 * GiB)
    devices = lambda s: {"cuda:0": {"allocated_bytes": GiB, "peak_allocated_bytes": 3 * GiB}}  # noqa: E731
    [finding] = detect_above_plan(attributed({}, expected=("cuda:0",), devices=devices), plan)
    assert finding.code == "peak_above_plan" and "1.50x" in finding.message
    assert "max_memory_allocated on cuda:0" in finding.message


# ---------------------------------------------------------------------------- real runs


TINY_LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}
KNOBS = dict(method="lora", rank=4, precision="fp32", batch_size=2, seq_len=32, checkpointing="on")
# The tiny model's whole activations are under a MiB: no absolute floor for these checks.
NO_FLOOR = Thresholds(activations_min_excess_bytes=0, peak_min_excess_bytes=0)


@pytest.fixture(scope="module")
def plan_json():
    from memfit.planner.api import plan

    return plan(TINY_LLAMA, **KNOBS).to_dict()


def lora_setup(wrap: bool):
    from transformers import AutoModelForCausalLM

    from memfit.models.build import make_config
    from memfit.spec import make_spec
    from memfit.step.optim import build_optimizer
    from memfit.step.prepare import prepare_given_model

    torch.manual_seed(0)
    spec = make_spec(**KNOBS)
    model = AutoModelForCausalLM.from_config(make_config(TINY_LLAMA), attn_implementation="sdpa")
    # Prepared as memfit's trainer prepares a given model (adapters, the lean step, placement).
    model = prepare_given_model(model, spec)
    if wrap:
        model = checkpointing_off(model)
    model.train()
    optimizer = build_optimizer(model.parameters(), "adamw")
    rows = torch.randint(0, 256, (2, 32)).tolist()
    return model, optimizer, [{"input_ids": r, "labels": r} for r in rows]


def run_measured(tmp_path, model, optimizer, plan, examples):
    from memfit.models.build import make_config
    from memfit.spec import make_spec
    from memfit.step.builder import build_step
    from memfit.watch.recorder import MemoryRecorder
    from memfit.watch.timeline import load_timeline

    # The step the plan planned: its batch layout, loss and clipping.
    step_fn = build_step(make_spec(**KNOBS), make_config(TINY_LLAMA))
    with MemoryRecorder(tmp_path, expected_device="cpu", plan=plan, devices=[], thresholds=NO_FLOOR) as recorder:
        recorder.inspect(model, KNOBS)
        recorder.attribute(model, optimizer, steps=2)
        for step in range(2):
            batch = step_fn.collate(examples, 0)
            step_fn(model, [batch], optimizer, observer=recorder.observer)
            del batch
            live = recorder.end_step(step + 1)
        timeline = load_timeline(tmp_path / "memory.jsonl")
        assert recorder.comparison() == compare_categories(plan, timeline)
    return timeline, live


def test_real_lora_run_measures_what_the_plan_predicts(tmp_path, plan_json):
    model, optimizer, batch = lora_setup(wrap=False)
    timeline, live = run_measured(tmp_path, model, optimizer, plan_json, batch)
    assert live == [] and timeline.findings == []
    rows = {r.name: r for r in compare_categories(plan_json, timeline)}
    # Same step, same model, real tensors instead of fake ones: the tracked categories agree.
    for name in ("weights", "trainable", "gradients", "optimizer", "activations"):
        assert rows[name].measured_bytes == pytest.approx(rows[name].predicted_bytes, rel=0.1), name
    lines = comparison_lines(list(rows.values()))
    assert lines[0].split() == ["category", "plan", "measured", "ratio"]
    assert any(line.startswith("runtime") and "not measured" in line for line in lines)


def test_wrapper_switching_checkpointing_off_is_caught_live_and_by_the_plan(tmp_path, plan_json):
    model, optimizer, batch = lora_setup(wrap=True)
    timeline, live = run_measured(tmp_path, model, optimizer, plan_json, batch)
    codes = {f.code for f in timeline.findings}
    assert {"wrapped_model", "checkpointing_inactive", "activations_above_plan"} <= codes
    [above] = [f for f in live if f.code == "activations_above_plan"]
    assert above.data["ratio"] > 5
