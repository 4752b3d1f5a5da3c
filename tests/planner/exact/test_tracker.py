"""The tracker counts the same bytes on fake tensors as on real ones, and labels them right."""

from __future__ import annotations

import pytest
import torch

from memfit.planner.exact.simulate import simulate
from memfit.planner.exact.tracker import MemoryTracker, round_block_bytes
from memfit.spec import make_spec


def test_round_block_bytes():
    assert round_block_bytes(0) == 512
    assert round_block_bytes(1) == 512
    assert round_block_bytes(512) == 512
    assert round_block_bytes(513) == 1024


def test_counts_allocations_and_frees_of_real_tensors():
    tracker = MemoryTracker()
    with tracker:
        a = torch.empty(1000, dtype=torch.float32)  # 4000 B -> 4096
        b = torch.empty(10, dtype=torch.float32)  # 40 B -> 512
        assert tracker.live_device_bytes == 4096 + 512
        del a
        assert tracker.live_device_bytes == 512
        view = b[:5]  # a view shares storage: no new bytes
        assert tracker.live_device_bytes == 512
        del b, view
    result = tracker.result()
    assert result.peak.allocated_bytes == 4608
    assert [e[0] for e in result.events] == ["alloc", "alloc", "free", "free"]


def test_roles_follow_purpose():
    tracker = MemoryTracker()
    layer = torch.nn.Linear(64, 32)
    layer.bias.requires_grad_(False)
    with tracker:
        tracker.mark_model(layer)
        tracker.watch_gradients(layer)
        tracker.set_phase("forward")
        x = torch.randn(8, 64, requires_grad=True)
        y = torch.tanh(layer(x))  # tanh saves its output for backward
        tracker.set_phase("backward")
        y.sum().backward()
    by_role = {}
    for a in tracker.result().allocations:
        by_role.setdefault(a.category, 0)
        by_role[a.category] += a.nbytes
    assert by_role["weights"] == 512  # the frozen bias (32 x fp32 = 128 B)
    assert by_role["trainable"] == round_block_bytes(64 * 32 * 4)
    assert by_role["gradients"] == round_block_bytes(64 * 32 * 4)
    assert by_role["activations"] > 0


@pytest.mark.parametrize(
    "knobs",
    [
        dict(method="lora", checkpointing="off"),
        dict(method="lora", checkpointing="on", grad_accum=2),
        dict(method="full", checkpointing="off", precision="fp32"),
        dict(method="full", checkpointing="on", optimizer="sgd"),
        dict(method="qlora", checkpointing="on"),
    ],
    ids=lambda k: "-".join(str(v) for v in k.values()),
)
def test_fake_run_counts_the_same_bytes_as_a_real_run(tiny_llama, knobs):
    spec = make_spec(seq_len=64, batch_size=2, **knobs)
    fake = simulate(tiny_llama, spec, workspace_allocs=(1 << 20,), fake=True).tracker
    real = simulate(tiny_llama, spec, workspace_allocs=(1 << 20,), fake=False).tracker
    assert fake.peak.allocated_bytes == real.peak.allocated_bytes
    assert fake.peak.categories == real.peak.categories
    assert fake.peak.phase == real.peak.phase
    assert [(e[0], e[2]) for e in fake.events] == [(e[0], e[2]) for e in real.events]
