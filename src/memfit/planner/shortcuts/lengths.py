"""The step at any sequence length, learnt from two simulated lengths (the longest-sequence search).

Past a few chunks of every chunked loop (which the replay runs the first two and the last of:
:mod:`memfit.planner.shortcuts.replay`), the simulated step does the
same operations at every sequence length, in the same order, on storages with the same roles:
only their sizes change. How each storage's size follows the length is read from simulations at
two lengths whose every loop ends on a different partial chunk (:func:`second_length`): it is

- constant;
- its shape's, each dimension being constant, ``k x length + e``, or what is left of a chunked
  loop's rows in its last chunk (the loops a fake run went through are recorded with it), which
  also covers a product of two such dimensions (a ``[seq, seq]`` mask);
- or, for a flat buffer whose size comes from a formula (a kernel's workspace), affine in the length.

A change of structure between the two means no model (None). From a model, the allocations and
frees at another length are written out, giving that length's allocated bytes as a simulation
would, in a fraction of its time (and its reserved bytes, replayed through the caching-allocator
model when a plan asks for them rather than for the full depth's); a
simulation at a third length checks the model storage by storage (:meth:`LengthModel.explains`),
and tests compare predicted and simulated plans over a sweep of lengths. The model holds from the
shorter length up to where a loop of three chunks or fewer would gain one (the structure changes
there). Only device memory is modelled: host and paged peaks stay those of the shorter length.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Any

from memfit.planner.exact.allocator import round_size
from memfit.planner.shortcuts.memo import config_key

if TYPE_CHECKING:
    from memfit.planner.exact.tracker import Snapshot, TrackerResult

#: A storage's requested bytes as a function of the sequence length.
SizeRule = Callable[[int], int]


@dataclass(frozen=True)
class LengthModel:
    """One depth's simulated step as a function of the sequence length (see the module docstring)."""

    sample: Any  # the SampledStep at the shorter length, whose structure every length shares
    rules: tuple[SizeRule, ...]  # by allocation id: requested bytes at a length
    min_seq_len: int  # the shorter length learnt from
    max_seq_len: int  # the longest length with the same structure (a short loop gains a chunk past it)
    varying: tuple[int, ...]  # allocations whose size follows the length (the others' rules are constants)

    def holds_at(self, seq_len: int) -> bool:
        return self.min_seq_len <= seq_len <= self.max_seq_len

    def explains(self, sample, seq_len: int) -> bool:
        """Whether ``sample``, simulated at ``seq_len``, is this model's prediction, storage by storage."""
        return (
            self.holds_at(seq_len)
            and _same_structure(self.sample.result, sample.result)
            and all(rule(seq_len) == a.requested_bytes for rule, a in zip(self.rules, sample.result.allocations))
        )

    def sample_at(self, seq_len: int):
        """The SampledStep a simulation at ``seq_len`` makes, for device memory (host peaks: the shorter length's)."""
        if not self.holds_at(seq_len):
            raise ValueError(
                f"seq_len {seq_len} is outside the lengths this model holds for "
                f"({self.min_seq_len} to {self.max_seq_len})"
            )
        from memfit.planner.exact.tracker import Allocation, TrackerResult

        base = self.sample.result
        # A storage whose size does not follow the length is the sample's own, and so is its event.
        allocations, events = list(base.allocations), list(base.events)
        for index in self.varying:
            a, requested = allocations[index], self.rules[index](seq_len)
            # (Made directly: dataclasses.replace costs more than the rest of a prediction.)
            a = allocations[index] = Allocation(
                a.alloc_id,
                round_size(requested),
                a.phase,
                a.alloc_event,
                a.free_event,
                a.role,
                a.place,
                a.op,
                requested,
                a.shape,
            )
            if a.place == "device":  # (storages outside the device allocator have no events)
                events[a.alloc_event] = ("alloc", a.alloc_id, a.nbytes)
        result = TrackerResult(
            allocations=allocations,
            events=events,
            peak=base.peak,
            outside_peaks=dict(base.outside_peaks),
            phase_marks=list(base.phase_marks),
            peak_from_event=base.peak_from_event,
        )
        result.peak, phase_peaks = _peaks(result)
        return dataclasses.replace(
            self.sample,
            result=result,
            allocated_bytes=result.peak.allocated_bytes,
            categories=dict(result.peak.categories),
            phase=result.peak.phase,
            phase_peaks=phase_peaks,
        )


def learn(samples: dict[int, Any]) -> LengthModel | None:
    """A :class:`LengthModel` from SampledSteps at two (or more) lengths, ``{length: sample}``: the
    rules are read from the two shortest and checked against every one; None where the structure
    differs or a storage's size is not explained."""
    if len(samples) < 2:
        return None
    ordered = sorted(samples.items())
    (len_a, a), (len_b, b) = ordered[:2]
    if not all(_same_structure(a.result, other.result) for _, other in ordered[1:]):
        return None
    if any(
        dict(a.result.outside_peaks).get("paged", 0) != dict(o.result.outside_peaks).get("paged", 0)
        for _, o in ordered[1:]
    ):
        return None  # paged states that follow the length are not modelled
    loops = _loops(a.chunk_loops, len_a, [(o.chunk_loops, n) for n, o in ordered[1:]])
    if loops is None:
        return None
    rules = []
    for alloc_a, alloc_b in zip(a.result.allocations, b.result.allocations):
        rule = _size_rule((len_a, len_b), (alloc_a, alloc_b), loops)
        if rule is None:
            return None
        rules.append(rule)
    varying = tuple(
        i
        for i, (x, y) in enumerate(zip(a.result.allocations, b.result.allocations))
        if x.requested_bytes != y.requested_bytes
    )
    model = LengthModel(
        sample=a,
        rules=tuple(rules),
        min_seq_len=len_a,
        max_seq_len=_longest_same_structure(loops, len_a),
        varying=varying,
    )
    # The two shortest are the rules' own (each rule is checked against their sizes as it is made,
    # their structures above); the model must hold at both, and explain any other.
    if not model.holds_at(len_b) or not all(model.explains(sample, length) for length, sample in ordered[2:]):
        return None
    return model


def second_length(first: int, step: int) -> int:
    """The length to simulate beside ``first`` (both multiples of ``step`` tokens): thirteen steps
    past it, so that every loop's last chunk (chunks are multiples of 256 tokens, twice a step of
    128) is a different size than at ``first``, and a chunk dimension cannot pass for the length."""
    return first + 13 * step


def _longest_same_structure(loops: list[tuple[int, int]], length: int) -> int:
    """The longest length at which every loop runs the chunks it runs at ``length`` (or, past
    :data:`SHORTCUT_CHUNKS`, any number of them): the structure is the same up to there."""
    from memfit.planner.shortcuts.replay import (
        SHORTCUT_CHUNKS,  # (imports torch: a prediction from the cache needs none)
    )

    longest = 1 << 62
    for offset, chunk in loops:
        chunks = -(-(length + offset) // chunk)
        if chunks <= SHORTCUT_CHUNKS:
            longest = min(longest, chunks * chunk - offset)
    return longest


def _same_structure(x: TrackerResult, y: TrackerResult) -> bool:
    """The same allocations and frees in the same order, by the same ops, with the same roles."""
    if len(x.events) != len(y.events) or len(x.allocations) != len(y.allocations):
        return False
    if x.phase_marks != y.phase_marks or x.peak_from_event != y.peak_from_event:
        return False
    if any(e[:2] != f[:2] for e, f in zip(x.events, y.events)):
        return False
    # (Frees are compared as events: ``free_event`` is also set later, when the model is torn down.)
    return all(
        (p.op, p.role, p.place, p.phase, p.alloc_event, len(p.shape))
        == (q.op, q.role, q.place, q.phase, q.alloc_event, len(q.shape))
        for p, q in zip(x.allocations, y.allocations)
    )


def _loops(first: frozenset, length: int, others: list[tuple[frozenset, int]]) -> list[tuple[int, int]] | None:
    """The chunked loops as (rows at length 0, chunk): their rows grow one for one with the length."""
    loops = sorted({(rows - length, chunk) for rows, chunk in first})
    for recorded, other_length in others:
        if sorted({(rows - other_length, chunk) for rows, chunk in recorded}) != loops:
            return None
    return loops


def _last_chunk(rows: int, chunk: int) -> int:
    return (rows - 1) % chunk + 1


def _dimension_rule(lengths: tuple[int, int], values: tuple[int, int], loops) -> Callable[[int], int] | None:
    """How one dimension follows the length, from its values at two lengths; None if unexplained."""
    (la, lb), (va, vb) = lengths, values
    if va == vb:
        return lambda n, v=va: v
    for offset, chunk in loops:
        if va == _last_chunk(la + offset, chunk) and vb == _last_chunk(lb + offset, chunk):
            return lambda n, o=offset, k=chunk: _last_chunk(n + o, k)
    slope, rest = divmod(vb - va, lb - la)
    if not rest and slope > 0:
        return lambda n, k=slope, e=va - slope * la: k * n + e
    return None


def _size_rule(lengths: tuple[int, int], allocs, loops) -> SizeRule | None:
    """How one storage's requested bytes follow the length (module docstring), from two lengths."""
    (la, lb), (sa, sb) = lengths, tuple(a.requested_bytes for a in allocs)
    if sa == sb:
        return lambda n: sa
    shaped = _shape_rule(lengths, allocs, loops)
    if shaped is not None:
        return shaped
    slope = Fraction(sb - sa, lb - la)
    return lambda n: int(-(-(sa + slope * (n - la)) // 1))  # whole bytes, rounded up


def _shape_rule(lengths: tuple[int, int], allocs, loops) -> SizeRule | None:
    """Requested bytes that scale with the storage's shape, each dimension following its own rule."""
    dims = []
    for position in range(len(allocs[0].shape)):
        rule = _dimension_rule(lengths, (allocs[0].shape[position], allocs[1].shape[position]), loops)
        if rule is None:
            return None
        dims.append((rule, allocs[0].shape[position]))
    numel_a = 1
    for _, value in dims:
        numel_a *= value
    size_a = allocs[0].requested_bytes
    if numel_a == 0 or size_a % numel_a:
        return None
    per_element = size_a // numel_a

    def rule(n: int) -> int:
        numel = 1
        for dim, _ in dims:
            numel *= dim(n)
        return per_element * numel

    if any(rule(length) != a.requested_bytes for length, a in zip(lengths, allocs)):
        return None
    return rule


def _peaks(result: TrackerResult) -> tuple[Snapshot, dict[str, int]]:
    """The tracker's peak (the highest moment after ``peak_from_event``) and each phase's highest,
    counted as :class:`~memfit.planner.exact.tracker.MemoryTracker` counts them as it runs."""
    from memfit.planner.exact.tracker import Snapshot

    live = result.live_bytes()
    start = result.peak_from_event
    index, top = start, live[start] if start >= 0 else 0
    phases: dict[str, int] = {}
    for event in range(start + 1, len(live)):
        kind, alloc_id, _ = result.events[event]
        if kind != "alloc":
            continue
        phase = result.allocations[alloc_id].phase
        if live[event] > top:
            index, top = event, live[event]
        if live[event] > phases.get(phase, 0):
            phases[phase] = live[event]
    phase_of_peak = result.allocations[result.events[index][1]].phase if index >= 0 else "setup"
    return Snapshot(index, phase_of_peak, top, result.categories_at(index)), phases


class Unpredictable(Exception):
    """The step's sizes at these lengths do not follow a :class:`LengthModel`: simulate instead."""


class LengthSampler:
    """A sampler for :func:`memfit.planner.shortcuts.extrapolate.estimate_step` that predicts the step at each
    depth from a :class:`LengthModel`, learnt on first use from simulations at ``lengths``.

    Raises :class:`Unpredictable` where no model can be learnt, or for a length it does not hold at.
    """

    #: Whether the plans made with this sampler only steer a search (:meth:`steering`).
    steers_only = False

    def __init__(self, lengths: tuple[int, ...]) -> None:
        self.lengths = tuple(lengths)
        self.models: dict[Any, LengthModel | None] = {}
        self._inputs: dict[Any, tuple] = {}  # what each model was learnt for: (config, spec, depth, workspaces, arch)

    def steering(self) -> LengthSampler:
        """This sampler (its models shared), for plans that only steer a search towards the lengths
        to predict exactly: their reserved bytes are not the full depth's replay (the costly part of a
        prediction) but the samples' largest allocator overhead over the full depth's allocated bytes."""
        steering = copy.copy(self)
        steering.steers_only = True
        return steering

    def __call__(
        self,
        config: dict[str, Any],
        spec,
        depth: tuple[int, ...] | None,
        workspace_allocs: tuple[int, ...],
        arch: str | None,
    ):
        from memfit.planner.shortcuts.extrapolate import sample_step

        if spec.seq_len < min(self.lengths):
            raise Unpredictable(f"{spec.seq_len} tokens is below the lengths {self.lengths} the step is learnt from")
        # One sampler serves one configuration; the key keeps a model from answering for another.
        key = (
            depth,
            spec.model_copy(update={"seq_len": 1}).model_dump_json(),
            tuple(workspace_allocs),
            arch,
            config_key(config),
        )
        if key not in self.models:
            samples = {
                n: sample_step(config, spec.model_copy(update={"seq_len": n}), depth, workspace_allocs, arch)
                for n in self.lengths
            }
            self.models[key] = learn(samples)
            self._inputs[key] = (config, spec, depth, tuple(workspace_allocs), arch)
        model = self.models[key]
        if model is None or not model.holds_at(spec.seq_len):
            raise Unpredictable(f"the step at {spec.seq_len} tokens does not follow the lengths {self.lengths}")
        return model.sample_at(spec.seq_len)

    def explains(self, seq_len: int) -> bool | None:
        """Whether the simulations made at ``seq_len`` (in this process) are the models' predictions,
        storage by storage; None when there is nothing to compare (the predictions, or the plan at
        ``seq_len``, came from the plan cache)."""
        from memfit.planner.shortcuts.extrapolate import cached_sample

        if not self.models:
            return None  # every prediction came from the plan cache: nothing was learnt here
        if any(model is None for model in self.models.values()):
            return False
        for key, model in self.models.items():
            config, spec, depth, workspace_allocs, arch = self._inputs[key]
            sample = cached_sample(config, spec.model_copy(update={"seq_len": seq_len}), depth, workspace_allocs, arch)
            if sample is None:
                return None
            if not model.explains(sample, seq_len):
                return False
        return True
