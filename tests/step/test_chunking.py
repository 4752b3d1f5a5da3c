"""The planner's shortcut through chunked loops changes nothing it reports."""

from __future__ import annotations

import pytest
import torch

from memfit.planner.exact import allocator
from memfit.planner.exact.simulate import simulate
from memfit.spec import make_spec
from memfit.step import chunking
from memfit.step.chunking import chunk_starts


def test_real_tensors_run_every_chunk_fake_ones_the_representative_ones():
    from torch._subclasses.fake_tensor import FakeTensorMode

    real = torch.empty(10, 2)
    assert chunk_starts(10, 2, real) == [0, 2, 4, 6, 8]
    assert chunk_starts(10, 2) == [0, 2, 4, 6, 8]
    with FakeTensorMode():
        fake = torch.empty(10, 2)
    assert chunk_starts(10, 2, fake) == [0, 2, 8]
    assert chunk_starts(6, 2, fake) == [0, 2, 4]  # three chunks or fewer: all of them


@pytest.mark.parametrize("knobs", [dict(method="lora", checkpointing="offload"), dict(method="full", checkpointing="on", precision="fp32")],
                         ids=["lora-offload", "full"])
def test_shortcut_plans_the_same_peak_and_reserved_memory(tiny_llama, monkeypatch, knobs):
    # 9,000 tokens: five tiled chunks of 2,048 (the last partial) and nine loss chunks of 1,024.
    spec = make_spec(seq_len=9000, tiling="on", **knobs)
    short = simulate(tiny_llama, spec).tracker
    monkeypatch.setattr(chunking, "SHORTCUT_FAKE_CHUNKS", False)
    every = simulate(tiny_llama, spec).tracker
    assert len(short.events) < len(every.events)  # the shortcut did skip work
    assert short.peak.allocated_bytes == every.peak.allocated_bytes
    assert short.peak.categories == every.peak.categories
    assert short.peak.phase == every.peak.phase
    assert short.phase_peaks == every.phase_peaks
    assert allocator.simulate(short.events).peak_reserved_bytes == allocator.simulate(every.events).peak_reserved_bytes


def test_without_the_planner_a_micro_batch_is_a_plain_call():
    phases = []

    class Observer:
        def on_phase(self, name):
            phases.append(name)

    def micro_batch(model, batch, totals, count, observer):
        observer.on_phase("forward")
        loss = model(batch["x"]).sum() / count
        loss.backward()
        return loss.detach(), totals

    model = torch.nn.Linear(2, 1)
    loss, totals = chunking.run_micro_batch(model, micro_batch, {"x": torch.ones(3, 2)}, None, 1, Observer())
    assert totals is None and not loss.requires_grad and model.weight.grad is not None and phases == ["forward"]
