"""Replaying a chunk's memory (memfit.planner.regions) makes the same events as running it."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from memfit.planner import regions
from memfit.planner.regions import MicroBatchReplay, RegionReplay
from memfit.planner.simulate import simulate
from memfit.planner.tracker import MemoryTracker
from memfit.spec import make_spec
from memfit.step.chunking import replaying_micro_batches, replaying_regions, run_micro_batch, run_region


def _events(result) -> list[tuple]:
    """Every device event with what the tracker knows of its storage, without ids."""
    allocations = result.allocations
    return [(kind, allocations[i].nbytes, allocations[i].requested_bytes, allocations[i].op, allocations[i].shape,
             allocations[i].role, allocations[i].phase) for kind, i, _ in result.events]


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
    first, second, replayed, _ = _fake_run(lambda x: (seen.append(1), x + 1)[1], (4, 4), probe=lambda: len(seen))
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


# ----------------------------------------------------------------- micro-batches


def _counting_micro_batches(monkeypatch) -> list[int]:
    replays = []
    original = MicroBatchReplay._replay

    def counted(self, *args):
        replays.append(1)
        return original(self, *args)

    monkeypatch.setattr(MicroBatchReplay, "_replay", counted)
    return replays


def _frees_in_any_order(events: list[tuple]) -> list[tuple]:
    """``events`` with each run of frees that follow each other sorted: PyTorch empties some caches
    (autocast's casts) in the order of their addresses, which is not the same from one run to the
    next, and the allocator is in the same state after a run of frees whatever their order."""
    out, run = [], []
    for event in events + [("end",)]:
        if event[0] == "free":
            run.append(event)
            continue
        out.extend(sorted(run, key=repr))
        run = []
        out.append(event)
    return out[:-1]


def _same_simulation(replayed, ran) -> None:
    assert _frees_in_any_order(_events(replayed.tracker)) == _frees_in_any_order(_events(ran.tracker))
    assert [(a.place, a.nbytes, a.role, a.phase) for a in replayed.tracker.allocations if a.place != "device"] == \
        [(a.place, a.nbytes, a.role, a.phase) for a in ran.tracker.allocations if a.place != "device"]
    assert replayed.tracker.peak == ran.tracker.peak
    assert replayed.tracker.phase_peaks == ran.tracker.phase_peaks
    assert replayed.tracker.phase_marks == ran.tracker.phase_marks
    assert replayed.tracker.outside_peaks == ran.tracker.outside_peaks
    assert replayed.attention_kernels == ran.attention_kernels
    assert replayed.chunk_loops == ran.chunk_loops


@pytest.mark.parametrize("knobs, replays", [
    (dict(method="lora", checkpointing="offload", seq_len=9000, tiling="on"), 1),
    (dict(method="qlora", checkpointing="on"), 1),
    (dict(method="full", checkpointing="on", precision="fp32"), 1),
    (dict(method="lora", checkpointing="on", objective="dpo", batch_size=2), 1),
    (dict(method="lora", dora=True, checkpointing="off", grad_accum=3), 1),
    (dict(method="lora", recipe="hf", packing=True, batch_size=2), 1),
    (dict(method="full", checkpointing="on", step_in_backward=True), 0),  # it makes optimizer states
    (dict(method="lora", precision="fp16"), 0),  # the loss scaler's first scaling makes its scale
], ids=["lora-offload-tiled", "qlora", "full", "dpo", "dora-accumulating", "hf-packed", "step-in-backward", "fp16"])
def test_a_simulation_with_a_replayed_micro_batch_makes_the_events_of_one_that_runs_it(tiny_llama, monkeypatch, knobs, replays):
    # The workspaces CUDA allocates at the first forward and backward come in the first step only.
    spec = make_spec(**{"seq_len": 512, **knobs})
    counted = _counting_micro_batches(monkeypatch)
    replayed = simulate(tiny_llama, spec, workspace_allocs=(1 << 20, 1 << 21))
    assert len(counted) == replays
    monkeypatch.setattr(regions, "REPLAY_MICRO_BATCHES", False)
    ran = simulate(tiny_llama, spec, workspace_allocs=(1 << 20, 1 << 21))
    _same_simulation(replayed, ran)


class _Observer:
    def __init__(self, tracker, pending=0):
        self.tracker, self.phases, self.pending, self.workspaces = tracker, [], pending, []

    def on_phase(self, name):
        self.tracker.set_phase(name)
        self.phases.append(name)
        if name == "forward" and self.pending:
            self.workspaces.append(self.tracker.allocate_runtime(self.pending))
            self.pending = 0


def _micro_batch(model, batch, totals, count, observer):
    observer.on_phase("forward")
    loss = model(batch["x"]).square().mean() / count
    observer.on_phase("backward")
    loss.backward()
    return loss.detach(), totals


def _run_micro_batches(fn, times=2, *, zero_grads=True, probe=lambda: None):
    """Run ``fn`` as ``times`` first micro-batches (gradients dropped between them) under a tracker:
    (the events of each, the runner, the observer, the model)."""
    tracker = MemoryTracker()
    replay = MicroBatchReplay(tracker, probe)
    with FakeTensorMode(), tracker, replaying_micro_batches(replay):
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        observer = _Observer(tracker, pending=4096)
        batch = {"x": torch.empty(32, 8)}
        marks, grads = [], []
        for _ in range(times):
            marks.append(len(tracker.events))
            run_micro_batch(model, fn, batch, None, 2, observer)
            grads.append([(tuple(p.grad.shape), p.grad.stride(), p.grad.dtype) for p in model.parameters()])
            if zero_grads:
                model.zero_grad(set_to_none=True)
        marks.append(len(tracker.events))
        result = tracker.result()
    events = _events(result)
    return [events[a:b] for a, b in zip(marks, marks[1:])], replay, observer, grads


def test_a_first_micro_batch_is_replayed_with_its_events_phases_and_gradients():
    (first, second), replay, observer, grads = _run_micro_batches(_micro_batch)
    assert replay.replayed == 1
    # The observer's workspace is its own: allocated in the first micro-batch only, as it would be.
    assert first[0][5] == "runtime" and second == first[1:]
    assert observer.phases == ["forward", "backward"] * 2
    assert grads[1] == grads[0]


def test_a_micro_batch_with_gradients_held_is_run_every_time():
    _, replay, _, _ = _run_micro_batches(_micro_batch, 3, zero_grads=False)
    assert replay.replayed == 0


@pytest.mark.parametrize("name", ["keeps a tensor", "frees what it did not make"])
def test_a_micro_batch_with_effects_beyond_its_outputs_and_gradients_is_run_every_time(name):
    kept, held = [], {"t": None}

    def keeps(model, batch, totals, count, observer):
        kept.append(batch["x"] * 2)
        return _micro_batch(model, batch, totals, count, observer)

    def frees(model, batch, totals, count, observer):
        held["t"] = None
        out = _micro_batch(model, batch, totals, count, observer)
        return out

    fn = {"keeps a tensor": keeps, "frees what it did not make": frees}[name]
    tracker = MemoryTracker()
    replay = MicroBatchReplay(tracker)
    with FakeTensorMode(), tracker, replaying_micro_batches(replay):
        model = torch.nn.Linear(8, 1)
        batch = {"x": torch.empty(32, 8)}
        for _ in range(3):
            held["t"] = torch.empty(64)
            run_micro_batch(model, fn, batch, None, 1, _Observer(tracker))
            model.zero_grad(set_to_none=True)
    assert replay.replayed == 0


@pytest.mark.parametrize("forgotten", [False, True])
def test_a_micro_batch_is_replayed_only_where_what_it_adds_to_the_probe_is_there(forgotten):
    # What a micro-batch notes outside memory (the attention kernels it meets) it notes once: it is
    # replayed where that is noted already, and run again where it is not.
    seen = set()

    def notes(model, batch, totals, count, observer):
        seen.add("flash")
        return _micro_batch(model, batch, totals, count, observer)

    tracker = MemoryTracker()
    replay = MicroBatchReplay(tracker, lambda: frozenset(seen))
    with FakeTensorMode(), tracker, replaying_micro_batches(replay):
        model = torch.nn.Linear(8, 1)
        batch = {"x": torch.empty(32, 8)}
        for _ in range(2):
            run_micro_batch(model, notes, batch, None, 1, _Observer(tracker))
            model.zero_grad(set_to_none=True)
            if forgotten:
                seen.clear()
    assert replay.replayed == (0 if forgotten else 1)
    assert seen == (set() if forgotten else {"flash"})


def test_without_the_planner_a_micro_batch_is_a_plain_call():
    model = torch.nn.Linear(2, 1)
    observer = _Observer(MemoryTracker())
    loss, totals = run_micro_batch(model, _micro_batch, {"x": torch.ones(3, 2)}, None, 1, observer)
    assert totals is None and loss.requires_grad is False and model.weight.grad is not None
