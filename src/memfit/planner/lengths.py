"""The step at any sequence length, learnt from three simulated lengths (the longest-sequence search).

Past a few chunks of every chunked loop (:mod:`memfit.step.chunking`), the simulated step does the
same operations at every sequence length, in the same order, on storages with the same roles:
only their sizes change. How each storage's size follows the length can be read from three
simulations, at lengths ``a``, ``b`` and ``c`` (``b - a`` a multiple of every loop's chunk, ``c``
not): it is

- constant;
- its shape's, each dimension being constant, ``k x length + e``, or what is left of a chunked
  loop's rows in its last chunk (the loops a fake run went through are recorded with it);
- or, for a flat buffer whose size comes from a formula (a kernel's workspace), affine in the length.

Each is checked against all three simulations; a storage that none of them explains, or a change of
structure, means no model (None), and the search plans every length it asks about. From a model,
the allocations and frees at another length are written out and replayed through the
caching-allocator model, giving that length's allocated and reserved bytes exactly as a simulation
would, in a fraction of its time (tests compare the two over a sweep of lengths). Only device
memory is modelled: host and paged peaks stay those of length ``a``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable

from memfit.planner import allocator
from memfit.planner.tracker import Allocation, Snapshot, TrackerResult, round_block_bytes

#: A storage's requested bytes as a function of the sequence length.
SizeRule = Callable[[int], int]


@dataclass(frozen=True)
class LengthModel:
    """One depth's simulated step as a function of the sequence length (see the module docstring)."""

    sample: Any  # the SampledStep at the first length, whose structure every length shares
    rules: tuple[SizeRule, ...]  # by allocation id: requested bytes at a length
    min_seq_len: int  # the model holds from the first length on (fewer chunks change the structure)

    def sample_at(self, seq_len: int):
        """The SampledStep a simulation at ``seq_len`` makes, for device memory (host peaks: the first length's)."""
        if seq_len < self.min_seq_len:
            raise ValueError(f"seq_len {seq_len} is below the lengths this model was learnt from ({self.min_seq_len})")
        base = self.sample.result
        allocations = []
        for a, rule in zip(base.allocations, self.rules):
            requested = rule(seq_len)
            # (Made directly: dataclasses.replace costs more than the rest of a prediction.)
            allocations.append(Allocation(a.alloc_id, round_block_bytes(requested), a.phase, a.alloc_event, a.free_event, a.role,
                                          a.place, a.op, requested, a.shape))
        events = [(kind, alloc_id, allocations[alloc_id].nbytes if kind == "alloc" else 0) for kind, alloc_id, _ in base.events]
        result = TrackerResult(allocations=allocations, events=events, peak=base.peak, outside_peaks=dict(base.outside_peaks),
                               phase_marks=list(base.phase_marks), peak_from_event=base.peak_from_event)
        result.peak, phase_peaks = _peaks(result)
        replay = allocator.simulate(events)
        return dataclasses.replace(self.sample, result=result, allocated_bytes=result.peak.allocated_bytes,
                                   reserved_bytes=replay.peak_reserved_bytes, categories=dict(result.peak.categories),
                                   phase=result.peak.phase, phase_peaks=phase_peaks)


def learn(samples: dict[int, Any]) -> LengthModel | None:
    """A :class:`LengthModel` from SampledSteps at three lengths ``{a: ..., b: ..., c: ...}`` (ascending
    keys not required), or None where the structure differs or a storage's size is not explained."""
    if len(samples) != 3:
        return None
    (len_a, a), (len_b, b), (len_c, c) = sorted(samples.items(), key=lambda item: _order(item[0], samples))
    if not (_same_structure(a.result, b.result) and _same_structure(a.result, c.result)):
        return None
    if dict(a.result.outside_peaks).get("paged", 0) != dict(c.result.outside_peaks).get("paged", 0):
        return None  # paged states that follow the length are not modelled
    loops = _loops(a.chunk_loops, len_a, [(b.chunk_loops, len_b), (c.chunk_loops, len_c)])
    if loops is None:
        return None
    lengths = (len_a, len_b, len_c)
    rules = []
    for alloc_a, alloc_b, alloc_c in zip(a.result.allocations, b.result.allocations, c.result.allocations):
        rule = _size_rule(lengths, (alloc_a, alloc_b, alloc_c), loops)
        if rule is None:
            return None
        rules.append(rule)
    return LengthModel(sample=a, rules=tuple(rules), min_seq_len=min(lengths))


def third_length(first: int, step: int) -> int:
    """The length to simulate beside ``first`` and ``first`` plus whole chunks: an odd number of
    ``step`` tokens past ``first``, so that every loop's last chunk (chunks are multiples of 256
    tokens) is a different size than at ``first``."""
    return first + 13 * step


def _order(length: int, samples: dict[int, Any]) -> int:
    # a: the shortest; b: the longest (b - a whole chunks); c: between or beyond, the odd one.
    keys = sorted(samples)
    return {keys[0]: 0, keys[-1]: 1}.get(length, 2)


def _same_structure(x: TrackerResult, y: TrackerResult) -> bool:
    """The same allocations and frees in the same order, by the same ops, with the same roles."""
    if len(x.events) != len(y.events) or len(x.allocations) != len(y.allocations):
        return False
    if x.phase_marks != y.phase_marks or x.peak_from_event != y.peak_from_event:
        return False
    if any(e[:2] != f[:2] for e, f in zip(x.events, y.events)):
        return False
    # (Frees are compared as events: ``free_event`` is also set later, when the model is torn down.)
    return all((p.op, p.role, p.place, p.phase, p.alloc_event, len(p.shape)) == (q.op, q.role, q.place, q.phase, q.alloc_event, len(q.shape))
               for p, q in zip(x.allocations, y.allocations))


def _loops(first: frozenset, length: int, others: list[tuple[frozenset, int]]) -> list[tuple[int, int]] | None:
    """The chunked loops as (rows at length 0, chunk): their rows grow one for one with the length."""
    loops = sorted({(rows - length, chunk) for rows, chunk in first})
    for recorded, other_length in others:
        if sorted({(rows - other_length, chunk) for rows, chunk in recorded}) != loops:
            return None
    return loops


def _last_chunk(rows: int, chunk: int) -> int:
    return (rows - 1) % chunk + 1


def _dimension_rule(lengths: tuple[int, int, int], values: tuple[int, int, int], loops) -> Callable[[int], int] | None:
    """How one dimension follows the length, checked at the three lengths; None if unexplained."""
    if values[0] == values[1] == values[2]:
        return lambda n, v=values[0]: v
    (la, lb, lc), (va, vb, vc) = lengths, values
    slope, rest = divmod(vb - va, lb - la)
    if not rest and slope > 0 and vc == va + slope * (lc - la):
        return lambda n, k=slope, e=va - slope * la: k * n + e
    for offset, chunk in loops:
        if all(v == _last_chunk(length + offset, chunk) for length, v in zip(lengths, values)):
            return lambda n, o=offset, k=chunk: _last_chunk(n + o, k)
    return None


def _size_rule(lengths: tuple[int, int, int], allocs, loops) -> SizeRule | None:
    """How one storage's requested bytes follow the length (module docstring), checked at the three lengths."""
    sizes = tuple(a.requested_bytes for a in allocs)
    if sizes[0] == sizes[1] == sizes[2]:
        return lambda n, s=sizes[0]: s
    shaped = _shape_rule(lengths, allocs, loops)
    if shaped is not None:
        return shaped
    (la, lb, lc), (sa, sb, sc) = lengths, sizes
    slope = Fraction(sb - sa, lb - la)
    if sa + slope * (lc - la) == sc:
        return lambda n: int(-(-(sa + slope * (n - la)) // 1))  # whole bytes, rounded up
    return None


def _shape_rule(lengths: tuple[int, int, int], allocs, loops) -> SizeRule | None:
    """Requested bytes that scale with the storage's shape, each dimension following its own rule."""
    dims = []
    for position in range(len(allocs[0].shape)):
        values = tuple(a.shape[position] for a in allocs)
        rule = _dimension_rule(lengths, values, loops)
        if rule is None:
            return None
        dims.append((rule, values[0]))
    size_a = allocs[0].requested_bytes
    numel_a = 1
    for _, value in dims:
        numel_a *= value
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
    counted as :class:`~memfit.planner.tracker.MemoryTracker` counts them as it runs."""
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
    """A sampler for :func:`memfit.planner.extrapolate.estimate_step` that predicts the step at each
    depth from a :class:`LengthModel`, learnt on first use from simulations at ``lengths``.

    Raises :class:`Unpredictable` where no model can be learnt, or for a length below them.
    """

    def __init__(self, lengths: tuple[int, int, int]) -> None:
        self.lengths = tuple(lengths)
        self.models: dict[Any, LengthModel | None] = {}

    def __call__(self, config: dict[str, Any], spec, depth: int | None, workspace_allocs: tuple[int, ...], arch: str | None):
        from memfit.planner.extrapolate import sample_step

        # One sampler serves one configuration; the key keeps a model from answering for another.
        key = (depth, spec.model_copy(update={"seq_len": 1}).model_dump_json(), tuple(workspace_allocs), arch,
               json.dumps(config, sort_keys=True, default=str))
        if key not in self.models:
            samples = {n: sample_step(config, spec.model_copy(update={"seq_len": n}), depth, workspace_allocs, arch)
                       for n in self.lengths}
            self.models[key] = learn(samples)
        model = self.models[key]
        if model is None or spec.seq_len < model.min_seq_len:
            raise Unpredictable(f"the step at {spec.seq_len} tokens does not follow the lengths {self.lengths}")
        return model.sample_at(spec.seq_len)
