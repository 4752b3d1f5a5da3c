"""Replaying a unit's memory (memfit.planner.shortcuts.replay): a chunk's work or a micro-batch
replayed makes the events running it makes; work that has effects beyond them runs every time.

Whole simulations with and without replay are compared in test_shortcuts.py."""

from __future__ import annotations

import itertools

import pytest
import torch
from replay_helpers import events_of as _events
from torch._subclasses.fake_tensor import FakeTensorMode

from memfit.planner.exact.tracker import MemoryTracker
from memfit.planner.shortcuts.replay import Replay, unit_key
from memfit.step import seam
from memfit.step.seam import Unit, run_micro_batch, run_region


def _runner(tracker: MemoryTracker, probe=frozenset) -> Replay:
    return Replay().bind(tracker, probe)


def _fake_run(fn, *shapes, probe=frozenset):
    """Run ``fn`` as a region twice on fake tensors of ``shapes`` under a tracker: (events of the
    first run, events of the second, whether the second was replayed, the outputs)."""
    tracker = MemoryTracker()
    replay = _runner(tracker, probe)
    owner = torch.nn.Linear(2, 2)
    with FakeTensorMode(), tracker, seam.running(replay):
        inputs = [torch.empty(s) for s in shapes]
        marks = []
        outputs = []
        for _ in range(2):
            marks.append(len(tracker.events))
            outputs.append(run_region(owner, "test", fn, *inputs))
        marks.append(len(tracker.events))
        result = tracker.result()
    events = _events(result)
    return events[marks[0] : marks[1]], events[marks[1] : marks[2]], replay.replayed == 1, outputs


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
    replay = _runner(tracker)
    with FakeTensorMode(), tracker, seam.running(replay):
        x = torch.empty(8, 8)
        for _ in range(3):
            held["t"] = torch.empty(4)
            run_region(torch.nn.Linear(2, 2), "test", fn, x)
    assert replay.replayed == 0


def test_a_region_is_replayed_only_where_what_it_notes_is_noted():
    seen = set()
    first, second, replayed, _ = _fake_run(lambda x: (seen.add("kernel"), x + 1)[1], (4, 4), probe=lambda: seen)
    assert replayed and second == first  # what it noted the first time is noted: replayed


def test_a_region_that_notes_what_is_forgotten_runs_again():
    seen = set()

    def notes(x):
        seen.add("kernel")
        return x + 1

    tracker = MemoryTracker()
    replay = _runner(tracker, lambda: seen)
    with FakeTensorMode(), tracker, seam.running(replay):
        x = torch.empty(4, 4)
        run_region(torch.nn.Linear(2, 2), "test", notes, x)
        seen.clear()  # (a new simulation sharing the templates: nothing noted yet)
        run_region(torch.nn.Linear(2, 2), "test", notes, x)
    assert replay.replayed == 0 and seen == {"kernel"}


def _unit(owner, what, *inputs, gradients=False):
    return Unit(owner, what, lambda observer: None, inputs, None, gradients)


def test_the_key_tells_apart_modes_shapes_module_states_and_declared_attributes():
    tracker = MemoryTracker()
    layer = torch.nn.Linear(4, 4)
    with FakeTensorMode():
        x = torch.empty(3, 4)
        y = torch.empty(5, 4)
    key = unit_key(_unit(layer, "test", x), tracker)
    assert unit_key(_unit(layer, "test", x), tracker) == key
    assert unit_key(_unit(torch.nn.Linear(4, 4), "test", x), tracker) == key  # an equal module: the same key
    assert unit_key(_unit(layer, "other", x), tracker) != key
    assert unit_key(_unit(layer, "test", y), tracker) != key
    assert unit_key(_unit(layer, "test", x, 2), tracker) != unit_key(_unit(layer, "test", x, 3), tracker)
    with torch.no_grad():
        assert unit_key(_unit(layer, "test", x), tracker) != key
    layer.eval()
    assert unit_key(_unit(layer, "test", x), tracker) != key
    layer.train()
    layer.weight.requires_grad_(False)
    assert unit_key(_unit(layer, "test", x), tracker) != key
    layer.weight.requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert unit_key(_unit(layer, "test", x), tracker) != key
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert unit_key(_unit(layer, "test", x), tracker) is None  # saved tensors would go through hooks
    assert unit_key(_unit(layer, "test", x, object()), tracker) is None  # an input it cannot compare
    # A private attribute is bookkeeping unless declared as deciding memory (the tiled MLP's chunk size).
    layer.__dict__["_bookkeeping"] = 1
    assert unit_key(_unit(layer, "test", x), tracker) == key
    from memfit.step.tiling import TILE_TOKENS

    assert TILE_TOKENS in seam.memory_attributes()
    layer.__dict__[TILE_TOKENS] = 1024
    tiled = unit_key(_unit(layer, "test", x), tracker)
    layer.__dict__[TILE_TOKENS] = 2048
    assert tiled != key and unit_key(_unit(layer, "test", x), tracker) != tiled


def test_only_work_on_fake_tensors_goes_to_the_runner():
    tracker = MemoryTracker()
    replay = _runner(tracker)
    with seam.running(replay):
        assert run_region(None, "test", lambda a, b: a + b, torch.ones(2), torch.ones(2)).tolist() == [2.0, 2.0]
        assert seam.chunks_to_run(10, 2, torch.empty(10, 2)) == [0, 2, 4, 6, 8]
    assert replay.replayed == 0 and replay.loops == set()


def test_the_runner_runs_the_first_two_chunks_and_the_last_and_records_the_loop():
    tracker = MemoryTracker()
    replay = _runner(tracker)
    with FakeTensorMode():
        fake = torch.empty(10, 2)
    with seam.running(replay):
        assert seam.chunks_to_run(10, 2, fake) == [0, 2, 8]
        assert seam.chunks_to_run(6, 2, fake) == [0, 2, 4]  # three chunks or fewer: all of them
    assert replay.loops == {(10, 2), (6, 2)}
    assert seam.chunks_to_run(10, 2, fake) == [0, 2, 4, 6, 8]  # no runner: every chunk


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


def _run_micro_batches(fn, times=2, *, zero_grads=True, probe=frozenset, model=_mlp, replaying=True):
    """Run ``fn`` as ``times`` micro-batches (gradients dropped between them, or accumulated) under
    a tracker: (the events of each, the runner, the observer, the gradients' layouts after each)."""
    tracker = MemoryTracker()
    replay = Replay().bind(tracker, probe, micro_batches=replaying)
    with FakeTensorMode(), tracker, seam.running(replay):
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


def test_an_accumulating_micro_batch_is_the_first_with_each_gradient_freed_once_added():
    replayed, replay, _, grads = _run_micro_batches(_micro_batch, 3, zero_grads=False)
    assert replay.replayed == 2
    ran, every, _, ran_grads = _run_micro_batches(_micro_batch, 3, zero_grads=False, replaying=False)
    assert every.replayed == 0
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


def test_gradients_autograd_copied_are_not_accumulated_by_replay():
    replayed, replay, _, _ = _run_micro_batches(_micro_batch, 3, zero_grads=False, model=_Shared)
    assert replay.replayed == 0  # the first is recorded; the others find its gradients copies
    ran, _, _, _ = _run_micro_batches(_micro_batch, 3, zero_grads=False, model=_Shared, replaying=False)
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
    replay = _runner(tracker)
    with FakeTensorMode(), tracker, seam.running(replay):
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
    replay = _runner(tracker, lambda: frozenset(seen))
    with FakeTensorMode(), tracker, seam.running(replay):
        model = torch.nn.Linear(8, 1)
        batch = {"x": torch.empty(32, 8)}
        for _ in range(2):
            run_micro_batch(model, notes, batch, None, 1, _Observer(tracker))
            model.zero_grad(set_to_none=True)
            if forgotten:
                seen.clear()
    assert replay.replayed == (0 if forgotten else 1)
    assert seen == (set() if forgotten else {"flash"})


def test_a_region_inside_a_recorded_micro_batch_is_in_its_journal():
    # The micro-batch's tiled layer records a region inside the micro-batch's own recording: the
    # micro-batch replayed makes every event running it makes, its region's included.
    def tiled(model, batch, totals, count, observer):
        observer.on_phase("forward")
        h = run_region(model, "test", lambda x: (x * 2).relu(), batch["x"])
        loss = model(h).square().mean() / count
        observer.on_phase("backward")
        loss.backward()
        return loss.detach(), totals

    (first, second), replay, _, _ = _run_micro_batches(tiled, model=lambda: torch.nn.Linear(8, 1))
    assert replay.replayed == 1 and second == first[1:]
