"""Replaying a micro-batch's memory (memfit.planner.shortcuts.micro_batches) makes the same events as running it."""

from __future__ import annotations

import itertools

import pytest
import torch
from replay_helpers import events_of as _events
from torch._subclasses.fake_tensor import FakeTensorMode

from memfit.planner.exact.simulate import simulate
from memfit.planner.exact.tracker import MemoryTracker
from memfit.planner.shortcuts import micro_batches
from memfit.planner.shortcuts.micro_batches import MicroBatchReplay
from memfit.spec import make_spec
from memfit.step.chunking import replaying_micro_batches, run_micro_batch


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
    (dict(method="lora", checkpointing="offload", seq_len=9000, tiling="on"), 2),
    (dict(method="qlora", checkpointing="on"), 2),
    (dict(method="full", checkpointing="on", precision="fp32"), 2),
    (dict(method="full", checkpointing="off", tie_word_embeddings=True), 2),  # one parameter, two gradients
    (dict(method="lora", checkpointing="on", objective="dpo", batch_size=2), 1),  # the second adds metrics up
    (dict(method="lora", dora=True, checkpointing="off"), 2),
    (dict(method="lora", recipe="hf", packing=True, batch_size=2), 2),
    (dict(method="lora", grad_accum=1), 1),
    (dict(method="full", checkpointing="on", step_in_backward=True, grad_accum=1), 0),  # it makes optimizer states
    (dict(method="lora", precision="fp16"), 0),  # the loss scaler's first scaling makes its scale
], ids=["lora-offload-tiled", "qlora", "full", "full-tied", "dpo", "dora", "hf-packed", "one-micro-batch",
        "step-in-backward", "fp16"])
def test_a_simulation_with_replayed_micro_batches_makes_the_events_of_one_that_runs_them(tiny_llama, monkeypatch, knobs, replays):
    # The workspaces CUDA allocates at the first forward and backward come in the first step only;
    # the last step's second micro-batch accumulates into the gradients its first left.
    config = dict(tiny_llama, tie_word_embeddings=knobs.pop("tie_word_embeddings", False))
    spec = make_spec(**{"seq_len": 512, "grad_accum": 4, **knobs})
    counted = _counting_micro_batches(monkeypatch)
    replayed = simulate(config, spec, workspace_allocs=(1 << 20, 1 << 21))
    assert len(counted) == replays
    monkeypatch.setattr(micro_batches, "REPLAY_MICRO_BATCHES", False)
    ran = simulate(config, spec, workspace_allocs=(1 << 20, 1 << 21))
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


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def _run_micro_batches(fn, times=2, *, zero_grads=True, probe=lambda: None, model=_mlp):
    """Run ``fn`` as ``times`` micro-batches (gradients dropped between them, or accumulated) under
    a tracker: (the events of each, the runner, the observer, the gradients' layouts after each)."""
    tracker = MemoryTracker()
    replay = MicroBatchReplay(tracker, probe)
    with FakeTensorMode(), tracker, replaying_micro_batches(replay):
        module = model()
        observer = _Observer(tracker, pending=4096)
        batch = {"x": torch.empty(32, 8)}
        marks, grads = [], []
        for _ in range(times):
            marks.append(len(tracker.events))
            run_micro_batch(module, fn, batch, None, 2, observer)
            grads.append([(tuple(p.grad.shape), p.grad.stride(), p.grad.dtype) for p in module.parameters()])
            if zero_grads:
                module.zero_grad(set_to_none=True)
        marks.append(len(tracker.events))
        result = tracker.result()
    events = _events(result)
    return [events[a:b] for a, b in itertools.pairwise(marks)], replay, observer, grads


def test_a_first_micro_batch_is_replayed_with_its_events_phases_and_gradients():
    (first, second), replay, observer, grads = _run_micro_batches(_micro_batch)
    assert replay.replayed == 1
    # The observer's workspace is its own: allocated in the first micro-batch only, as it would be.
    assert first[0][5] == "runtime" and second == first[1:]
    assert observer.phases == ["forward", "backward"] * 2
    assert grads[1] == grads[0]


def test_an_accumulating_micro_batch_is_the_first_with_each_gradient_freed_once_added(monkeypatch):
    replayed, replay, _, grads = _run_micro_batches(_micro_batch, 3, zero_grads=False)
    assert replay.replayed == 2
    monkeypatch.setattr(micro_batches, "REPLAY_MICRO_BATCHES", False)
    ran, _, _, ran_grads = _run_micro_batches(_micro_batch, 3, zero_grads=False)
    assert replayed == ran and grads == ran_grads
    # Four gradients (two weights, two biases): kept by the first, freed by the others.
    frees = [len([e for e in events if e[0] == "free"]) for events in ran]
    assert frees[1] == frees[2] == frees[0] + 4


class _Shared(torch.nn.Module):
    """Two parameters handed one gradient tensor (an addition's backward passes it on to both):
    autograd keeps it as one's ``.grad`` and copies it for the other."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.empty(8))
        self.b = torch.nn.Parameter(torch.empty(8))

    def forward(self, x):
        return x * (self.a + self.b)


def test_gradients_autograd_copied_are_not_accumulated_by_replay(monkeypatch):
    replayed, replay, _, _ = _run_micro_batches(_micro_batch, 3, zero_grads=False, model=_Shared)
    assert replay.replayed == 0  # the first is recorded; the others find its gradients copies
    monkeypatch.setattr(micro_batches, "REPLAY_MICRO_BATCHES", False)
    ran, _, _, _ = _run_micro_batches(_micro_batch, 3, zero_grads=False, model=_Shared)
    assert replayed == ran


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
