"""The recorder on a real CPU training loop (memfit's train_step on a tiny llama): an injected leak
is found at its true rate, a clean run raises nothing, the first steps are attributed by category."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from memfit.step.losses import causal_lm_loss  # noqa: E402
from memfit.step.train_step import train_step  # noqa: E402
from memfit.watch.recorder import MemoryRecorder  # noqa: E402
from memfit.watch.timeline import load_timeline  # noqa: E402

LEAK_BYTES_PER_STEP = 3 * 2**20


def tiny_run(config, seed=0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, config.vocab_size, (2, 32))
    return model, optimizer, {"input_ids": ids, "labels": ids.clone()}


def train(recorder, model, optimizer, batch, steps, leak_bytes=0):
    kept, live = [], []
    for step in range(steps):
        if step == 0:
            recorder.attribute(model, optimizer)
        loss, _ = train_step(model, [batch], optimizer, loss_fn=causal_lm_loss, observer=recorder.observer)
        if leak_bytes:
            # The bug being caught: something keeps a few MiB alive every step (filled, so the pages
            # are really resident).
            kept.append(torch.empty(leak_bytes, dtype=torch.uint8).fill_(1))
        live += recorder.end_step(step + 1, {"loss": loss})
    return live + recorder.close()


def test_injected_leak_is_found_at_its_rate(tmp_path, tiny_llama_config):
    model, optimizer, batch = tiny_run(tiny_llama_config)
    recorder = MemoryRecorder(tmp_path, expected_device="cpu", total_steps=100)
    findings = train(recorder, model, optimizer, batch, 100, leak_bytes=LEAK_BYTES_PER_STEP)
    leaks = [f for f in findings if f.code == "leak"]
    assert len(leaks) == 1, findings
    rate = leaks[0].data["bytes_per_step"]
    assert rate == pytest.approx(LEAK_BYTES_PER_STEP, rel=0.2)
    assert leaks[0].data["device"] == "host" and leaks[0].data["full_at_step"] > 100
    assert leaks[0].data["measure"] in ("heap_bytes", "rss_bytes")
    # Found while the run was going, well before its end.
    timeline = load_timeline(tmp_path / "memory.jsonl")
    assert [f.code for f in timeline.findings] == ["leak"]


def test_clean_run_of_200_steps_raises_nothing(tmp_path, tiny_llama_config):
    model, optimizer, batch = tiny_run(tiny_llama_config)
    recorder = MemoryRecorder(tmp_path, expected_device="cpu", total_steps=200)
    assert train(recorder, model, optimizer, batch, 200) == []
    timeline = load_timeline(tmp_path / "memory.jsonl")
    assert len(timeline.steps) == 200 and timeline.end["status"] == "completed"
    assert timeline.findings == []


def test_records_are_on_disk_as_soon_as_a_step_ends(tmp_path, tiny_llama_config):
    model, optimizer, batch = tiny_run(tiny_llama_config)
    recorder = MemoryRecorder(tmp_path, expected_device="cpu", devices=[])
    train_step(model, [batch], optimizer, loss_fn=causal_lm_loss, observer=recorder.observer)
    recorder.end_step(1, {"loss": 1.5, "note": "x", "tensor": torch.tensor(2.0), "skipped": object()})
    # Not closed: a crash here would keep this much.
    lines = [json.loads(line) for line in (tmp_path / "memory.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in lines] == ["start", "step"]
    step = lines[1]
    assert step["extra"] == {"loss": 1.5, "note": "x", "tensor": 2.0}
    assert [p["phase"] for p in step["phases"]] == ["forward", "backward", "optimizer", "idle"]
    assert all(p["rss_bytes"] > 0 for p in step["phases"]) and step["devices"] == {}
    # The process's high-water mark, which sees what happened between two readings.
    assert step["peak_rss_bytes"] >= max(p["rss_bytes"] for p in step["phases"]) - 2**20
    assert lines[0]["peak_rss_bytes"] <= step["peak_rss_bytes"]
    recorder.close()
    with pytest.raises(RuntimeError, match="closed"):
        recorder.end_step(2)


def test_first_steps_are_attributed_by_category(tmp_path, tiny_llama_config):
    model, optimizer, batch = tiny_run(tiny_llama_config)
    with MemoryRecorder(tmp_path, expected_device="cpu") as recorder:
        recorder.attribute(model, optimizer, steps=2)
        for step in range(3):
            train_step(model, [batch], optimizer, loss_fn=causal_lm_loss, observer=recorder.observer)
            recorder.end_step(step + 1)
    timeline = load_timeline(tmp_path / "memory.jsonl")
    attribution = timeline.attribution
    params = sum(p.numel() * 4 for p in model.parameters())
    assert attribution["first_step"] == 1 and attribution["steps"] == 2
    # Every parameter trains (full fine-tuning, fp32): 512-byte blocks round each one up a little.
    assert params <= attribution["categories"]["trainable"] < params * 1.05
    assert attribution["categories"]["optimizer"] >= 2 * params  # AdamW: two states per parameter
    assert attribution["categories"]["activations"] > 0
    assert sum(attribution["categories"].values()) == attribution["peak_allocated_bytes"]
    assert "tracked_live_bytes" in timeline.steps[0] and "tracked_live_bytes" not in timeline.steps[2]


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(ValueError, match="check_every"):
        MemoryRecorder(tmp_path, check_every=0)
    with pytest.raises(ValueError, match="devices: 'tpu:0'"):
        MemoryRecorder(tmp_path, devices=["tpu:0"])
    with pytest.raises(TypeError, match="plan: expected a MemoryPlan"):
        MemoryRecorder(tmp_path, devices=[], plan="big")
