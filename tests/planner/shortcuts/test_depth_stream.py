"""The full depth's allocation events made from two samples are the events of the full depth, up
to which storage is which: a toy step (each layer hands its output to the next, saves activations
for its backward, leaves a gradient for the optimizer's multi-tensor ops; the head's gradient is
made in the last layer's backward) written down at 2, 3 and 10 layers, compared event by event.
The real steps are compared through the plans in test_shortcuts.py."""

from __future__ import annotations

from fractions import Fraction

import pytest

from memfit.planner.exact import allocator
from memfit.planner.exact.tracker import Allocation, Snapshot, TrackerResult
from memfit.planner.shortcuts.depth_stream import NotInserted, full_depth_stream
from memfit.planner.shortcuts.depths import DepthPlan

MiB = 1 << 20
ONE_MORE = DepthPlan(samples=((0, 1), (0, 1, 2)), weights=(Fraction(8),))  # 2 and 3 layers for 10


class _Toy:
    """Writes down a step's device events as the tracker does."""

    def __init__(self) -> None:
        self.allocations: list[Allocation] = []
        self.events: list[tuple[str, int, int]] = []
        self.marks: list[tuple[str, int]] = []
        self.phase = "setup"
        self.peak_from_event = -1

    def alloc(self, nbytes: int, op: str) -> Allocation:
        a = Allocation(
            alloc_id=len(self.allocations), nbytes=nbytes, phase=self.phase, alloc_event=len(self.events), op=op
        )
        self.allocations.append(a)
        self.events.append(("alloc", a.alloc_id, nbytes))
        return a

    def free(self, a: Allocation) -> None:
        a.free_event = len(self.events)
        self.events.append(("free", a.alloc_id, 0))

    def set_phase(self, phase: str) -> None:
        self.marks.append((phase, len(self.events) - 1))
        self.phase = phase

    def result(self) -> TrackerResult:
        return TrackerResult(
            allocations=self.allocations,
            events=self.events,
            peak=Snapshot(-1, "setup", 0, {}),
            outside_peaks={},
            phase_marks=self.marks,
            peak_from_event=self.peak_from_event,
        )


def _step(layers: int, frees_in_reverse: bool = False, empty_phase: bool = False) -> TrackerResult:
    """The toy step of ``layers`` layers: setup, forward, backward, optimizer (``empty_phase``: with
    a phase between backward and optimizer that allocates and frees nothing)."""
    toy = _Toy()
    toy.alloc(5 * MiB, "embedding")  # the head
    params = []
    for _ in range(layers):
        staged = toy.alloc(4 * MiB, "to")  # a weight passes through a temporary on its way (quantizing)
        params.append(toy.alloc(3 * MiB, "empty"))
        toy.free(staged)
    toy.peak_from_event = len(toy.events) - 1  # the step's peak counts from here (the tracker's reset_peak)
    toy.alloc(MiB, "collate")  # the batch, made before the step
    toy.set_phase("forward")
    hidden, saved = toy.alloc(2 * MiB, "embedding"), []
    for _ in params:
        act = toy.alloc(4 * MiB, "mul")
        tmp = toy.alloc(1536 * 1024, "mm")
        out = toy.alloc(2 * MiB, "add")
        toy.free(tmp)
        saved.append((hidden, act))  # the layer's input and activation, kept for its backward
        hidden = out
    logits = toy.alloc(7 * MiB, "mm")
    toy.set_phase("backward")
    grad = toy.alloc(2 * MiB, "mm")
    toy.free(logits)
    sums, grads = [], []
    for index, (layer_input, act) in enumerate(reversed(saved)):
        work = toy.alloc(6 * MiB, "mm")
        # A layer's backward makes the gradient of a norm: the head's in the first, then the norm of
        # the layer before it in time (autograd finishes it there), as a model's do.
        sums.append(toy.alloc(512 * 1024, "sum"))
        grads.append(toy.alloc(3 * MiB, "mm"))
        new_grad = toy.alloc(2 * MiB, "mm")
        toy.free(work), toy.free(act), toy.free(grad)
        if index < len(saved) - 1:  # (the first layer's input, the embedding output, goes last)
            toy.free(layer_input)
        grad = new_grad
    toy.free(saved[0][0]), toy.free(hidden)
    if empty_phase:
        toy.set_phase("zero_grad")
    toy.set_phase("optimizer")
    grads.reverse()
    norms = [toy.alloc(512, "norm") for _ in grads]  # one op over every layer, then the next
    for n in reversed(norms) if frees_in_reverse else norms:  # a run of frees, in either order
        toy.free(n)
    scaled = [toy.alloc(3 * MiB, "mul") for _ in grads]
    for s in scaled:
        toy.free(s)
    # Gradients freed in the parameters' order: each layer's, with its norm's; the head's last.
    norm_grads = [toy.alloc(512 * 1024, "sum"), *sums[1:][::-1]]  # (the first layer's norm is made here)
    for g, n in zip(grads, norm_grads):
        toy.free(g), toy.free(n)
    toy.free(sums[0]), toy.free(grad)
    toy.set_phase("idle")
    return toy.result()


def _same_up_to_keys(made: list, whole: list) -> bool:
    """Whether two event lists allocate the same sizes in the same order and free the same
    storages (each storage of one matched with the one the other made at the same event)."""
    if len(made) != len(whole):
        return False
    pairs: dict[int, int] = {}
    for (kind, key, nbytes), (whole_kind, whole_key, whole_nbytes) in zip(made, whole):
        if kind != whole_kind or nbytes != whole_nbytes:
            return False
        if kind == "alloc":
            pairs[key] = whole_key
        elif pairs.pop(key, None) != whole_key:
            return False
    return True


def test_the_stream_is_the_full_depths_events():
    stream = full_depth_stream(ONE_MORE, [_step(2), _step(3)])
    made = list(stream.events())
    whole = _step(10)
    assert _same_up_to_keys(made, whole.events)
    assert allocator.simulate(made).peak_reserved_bytes == allocator.simulate(whole.events).peak_reserved_bytes
    live, highest, marks = 0, {}, dict((end + 1, phase) for phase, end in whole.phase_marks)
    phase = "setup"
    for index, (kind, alloc_id, nbytes) in enumerate(whole.events):
        phase = marks.get(index, phase)
        live += nbytes if kind == "alloc" else -whole.allocations[alloc_id].nbytes
        if kind == "alloc" and index > whole.peak_from_event:  # as the tracker counts, after its reset
            highest[phase] = max(highest.get(phase, 0), live)
    reserved, phase_peaks = stream.replay()
    assert reserved == allocator.simulate(whole.events).peak_reserved_bytes
    assert phase_peaks == highest


def test_a_phase_with_no_events_is_replayed_as_one():
    stream = full_depth_stream(ONE_MORE, [_step(2, empty_phase=True), _step(3, empty_phase=True)])
    whole = _step(10, empty_phase=True)
    reserved, phase_peaks = stream.replay()
    assert reserved == allocator.simulate(whole.events).peak_reserved_bytes
    assert "zero_grad" not in phase_peaks
    assert phase_peaks == full_depth_stream(ONE_MORE, [_step(2), _step(3)]).replay()[1]


def test_the_same_events_made_from_other_samples_are_replayed_once(monkeypatch):
    # A search's exact prediction of a length and its plan of it make the same full depth from
    # samples of their own: the second is handed the first's replay.
    from memfit.planner.shortcuts.memo import MEMO

    MEMO.streams.clear()
    replays = []
    simulate = allocator.simulate
    monkeypatch.setattr(allocator, "simulate", lambda *a, **k: replays.append(1) or simulate(*a, **k))
    first = full_depth_stream(ONE_MORE, [_step(2), _step(3)]).replay()
    second = full_depth_stream(ONE_MORE, [_step(2), _step(3)]).replay()
    other = full_depth_stream(DepthPlan(samples=ONE_MORE.samples, weights=(Fraction(9),)), [_step(2), _step(3)])
    assert second == first and len(replays) == 1
    assert other.replay()[0] == allocator.simulate(_step(11).events).peak_reserved_bytes and len(replays) == 3


def test_a_run_of_frees_in_another_order_in_one_sample():
    made = list(full_depth_stream(ONE_MORE, [_step(2), _step(3, frees_in_reverse=True)]).events())
    assert allocator.simulate(made).peak_reserved_bytes == allocator.simulate(_step(10).events).peak_reserved_bytes


def test_a_sample_that_is_not_the_base_with_blocks_inserted():
    other = _step(3)
    last_free = dict(other.phase_marks)["idle"]
    del other.events[last_free]  # the optimizer's last free left out: not the base's with blocks inserted
    other.phase_marks = [(phase, end - (end >= last_free)) for phase, end in other.phase_marks]
    with pytest.raises(NotInserted):
        full_depth_stream(ONE_MORE, [_step(2), other])
