"""Replaying a chunk's memory (memfit.planner.shortcuts.regions) makes the same events as running it."""

from __future__ import annotations

import pytest
import torch
from replay_helpers import events_of as _events
from torch._subclasses.fake_tensor import FakeTensorMode

from memfit.planner.exact.simulate import simulate
from memfit.planner.exact.tracker import MemoryTracker
from memfit.planner.shortcuts import regions
from memfit.planner.shortcuts.regions import RegionReplay
from memfit.spec import make_spec
from memfit.step.chunking import replaying_regions, run_region


def _counting_replays(monkeypatch) -> list[int]:
    replays = []
    original = RegionReplay._replay

    def counted(self, template):
        replays.append(1)
        return original(self, template)

    monkeypatch.setattr(RegionReplay, "_replay", counted)
    return replays


@pytest.mark.parametrize("knobs", [
    dict(method="lora", checkpointing="offload"),
    dict(method="qlora", checkpointing="on"),
    dict(method="full", checkpointing="on", precision="fp32"),
    dict(method="lora", checkpointing="on", objective="dpo", batch_size=2),
    dict(method="lora", dora=True, checkpointing="off", grad_accum=3),
], ids=["lora-offload", "qlora", "full", "dpo-reference-without-adapters", "dora-accumulating"])
def test_a_simulation_with_replayed_regions_makes_the_events_of_one_that_runs_them(tiny_llama, monkeypatch, knobs):
    # 9,000 tokens: tiled chunks of 2,048, the last partial; every tiled MLP and norm runs its
    # chunks in forward, in recomputation and in backward, in three micro-batches.
    spec = make_spec(seq_len=9000, tiling="on", **knobs)
    replays = _counting_replays(monkeypatch)
    replayed = simulate(tiny_llama, spec)
    assert replays, "no region was replayed"
    monkeypatch.setattr(regions, "REPLAY_REGIONS", False)
    ran = simulate(tiny_llama, spec)
    assert _events(replayed.tracker) == _events(ran.tracker)
    assert replayed.tracker.peak == ran.tracker.peak
    assert replayed.tracker.phase_peaks == ran.tracker.phase_peaks
    assert replayed.tracker.outside_peaks == ran.tracker.outside_peaks
    assert replayed.chunk_loops == ran.chunk_loops


def _fake_run(fn, *shapes, probe=lambda: None):
    """Run ``fn`` as a region twice on fake tensors of ``shapes`` under a tracker: (events of the
    first run, events of the second, whether the second was replayed, the outputs)."""
    tracker = MemoryTracker()
    replay = RegionReplay(tracker, probe)
    owner = torch.nn.Linear(2, 2)
    with FakeTensorMode(), tracker, replaying_regions(replay):
        inputs = [torch.empty(s) for s in shapes]
        marks = []
        outputs = []
        for _ in range(2):
            marks.append(len(tracker.events))
            outputs.append(run_region(owner, "test", fn, *inputs))
        marks.append(len(tracker.events))
        result = tracker.result()
    events = _events(result)
    return events[marks[0]:marks[1]], events[marks[1]:marks[2]], replay.replayed == 1, outputs


def test_a_pure_region_is_replayed_with_the_same_events_and_outputs_of_the_same_layout():
    def region(x):
        wide = x.repeat(1, 4)  # a transient
        out = (wide * 2).sum(dim=1, keepdim=True).t().contiguous().t()  # a new, non-contiguous output
        return out, None

    first, second, replayed, outputs = _fake_run(region, (64, 8))
    assert replayed and second == first
    (a, none_a), (b, none_b) = outputs
    assert none_a is None and none_b is None
    assert (b.shape, b.stride(), b.dtype) == (a.shape, a.stride(), a.dtype)


@pytest.mark.parametrize("name", ["keeps a tensor", "returns a view of its input", "frees what it did not make"])
def test_a_region_with_effects_beyond_its_outputs_is_run_every_time(name):
    kept = []

    def keeps(x):
        kept.append(x * 2)
        return x + 1

    def view(x):
        return x[:2]

    held = {}

    def frees(x):
        held.pop("t", None)
        return x + 1

    fn = {"keeps a tensor": keeps, "returns a view of its input": view, "frees what it did not make": frees}[name]
    tracker = MemoryTracker()
    replay = RegionReplay(tracker)
    with FakeTensorMode(), tracker, replaying_regions(replay):
        x = torch.empty(8, 8)
        for _ in range(3):
            held["t"] = torch.empty(4)
            run_region(torch.nn.Linear(2, 2), "test", fn, x)
    assert replay.replayed == 0


def test_a_region_that_changes_what_the_probe_sees_is_run_every_time():
    seen = []
    _, _, replayed, _ = _fake_run(lambda x: (seen.append(1), x + 1)[1], (4, 4), probe=lambda: len(seen))
    assert not replayed


def test_the_key_tells_apart_modes_shapes_and_module_states():
    tracker = MemoryTracker()
    replay = RegionReplay(tracker)
    layer = torch.nn.Linear(4, 4)
    with FakeTensorMode():
        x = torch.empty(3, 4)
        y = torch.empty(5, 4)
    key = replay._key(layer, "test", (x,))
    assert replay._key(layer, "test", (x,)) == key
    assert replay._key(torch.nn.Linear(4, 4), "test", (x,)) == key  # an equal module: the same key
    assert replay._key(layer, "other", (x,)) != key
    assert replay._key(layer, "test", (y,)) != key
    with torch.no_grad():
        assert replay._key(layer, "test", (x,)) != key
    layer.eval()
    assert replay._key(layer, "test", (x,)) != key
    layer.train()
    layer.weight.requires_grad_(False)
    assert replay._key(layer, "test", (x,)) != key
    layer.weight.requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert replay._key(layer, "test", (x,)) != key
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert replay._key(layer, "test", (x,)) is None  # saved tensors would go through hooks
    assert replay._key(layer, "test", (x, object())) is None  # an argument it cannot compare


def test_without_the_planner_a_region_is_a_plain_call():
    assert run_region(None, "test", lambda a, b: a + b, torch.ones(2), torch.ones(2)).tolist() == [2.0, 2.0]
