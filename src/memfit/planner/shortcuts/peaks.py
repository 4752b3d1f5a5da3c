"""The full depth's highest moment, from the steps simulated at its cuts.

A further sample (the base with one more layer of a kind, or one more period:
:mod:`memfit.planner.shortcuts.depths`) is the base's step with that layer's events inserted: in a
phase where the layer works one block of events, at one point of the phase, the same point for
every kind (the extra layer sits in the middle of the base). The full depth is then the base with
each kind's block inserted as many times as the full model holds more layers of that kind (the depth
plan's weights). Live bytes, and each category, at any moment of it follow from the samples:

- before the blocks: the samples' at that moment, extrapolated (:meth:`DepthPlan.combine`);
- in the j-th copy of a kind's block: the bytes at the point of insertion, extrapolated, plus what
  the blocks before it add, plus ``j - 1`` times what one copy of this block adds, plus the block's
  own course to that moment (read in the sample that holds one copy);
- after the blocks: the samples' at that moment, extrapolated.

Copies of a block differ only by what each adds, so a moment of a block is highest in its first copy
or in its last: every moment of the base and of both copies of every block is a candidate, and the
highest is the full depth's, with its categories. A phase whose samples are not one insertion apart
(the optimizer's multi-tensor ops run one op over every layer's parameters, then the next) is
weighed at its head and tail, the events all samples share at its start and at its end, and at its
top where that lies between them as the same operation in every sample (foreach AdamW's
temporaries, made for every parameter before any is freed).

On one GPU the moments are those just after an allocation, as the tracker takes its peaks; for one
rank of several (``reshape``) every moment, weighed by that rank's bytes, as a whole simulation's
are (:func:`reshaped_peak`).
"""

from __future__ import annotations

from collections.abc import Callable
from fractions import Fraction

from memfit.planner.shortcuts.depths import DepthPlan
from memfit.planner.shortcuts.memo import MEMO

#: Maps single-GPU categories at a moment of a phase to one rank's categories.
Reshape = Callable[[dict[str, int], str], dict[str, int]]
#: A moment of the full depth: the samples' readings it adds up, (sample, event, coefficient).
Moment = tuple[tuple[int, int, int | Fraction], ...]


def highest_moment(depths: DepthPlan, results: list, reshape: Reshape | None = None):
    """The phase and categories of the full depth's highest moment, each phase's highest (live
    bytes, or one rank's bytes with ``reshape``), and the phases weighed at every moment (not at
    their head and tail only); None when the samples share no phase."""
    coefficients = [1 - sum(depths.weights, Fraction(0)), *depths.weights]
    if all(c.denominator == 1 for c in coefficients):
        # Whole weights (the usual depth plan): plain integers, much cheaper to add up than fractions.
        coefficients = [int(c) for c in coefficients]
    best: tuple[int, str, dict[str, int]] | None = None
    phases: dict[str, int] = {}
    partly: set[str] = set()  # phases with a stretch weighed at its head and tail only
    for segments in zip(*(r.segments() for r in results)):
        phase = segments[-1].phase
        moments = _inserted(depths, results, segments, coefficients)
        if not moments:
            partly.add(phase)
            moments = _head_and_tail(results, segments, coefficients)
        found = _highest(results, moments, phase, reshape)
        if found is None:
            continue
        value, categories = found
        phases[phase] = max(phases.get(phase, 0), value)
        if best is None or value > best[0]:
            best = (value, phase, categories)
    return None if best is None else (best[1], best[2], phases, set(phases) - partly)


def _inserted(depths: DepthPlan, results: list, segments, coefficients: list[Fraction]) -> list[Moment] | None:
    """Every moment of a phase of the full depth, where each further sample is the base with one
    block of events inserted at one point (None where they are not)."""
    if any(w.denominator != 1 or w < 1 for w in depths.weights):
        return None
    sigs = [_signatures(r, seg.start_event + 1, seg.end_event + 1) for r, seg in zip(results, segments)]
    found = _insertion(sigs)
    if found is None:
        # A phase may end in a run of frees that every layer adds to (the LLM.int8 layers' inputs, which
        # bitsandbytes keeps outside non-reentrant checkpointing, all freed with the graph): a second
        # insertion, but of frees only. Its moments are never the highest (a free lowers the live bytes
        # and every category), so the phase is weighed up to its last allocation.
        found = _insertion([sig[: _last_alloc(sig) + 1] for sig in sigs])
    if found is None:
        return None
    cut, length, blocks = found
    starts = [seg.start_event + 1 for seg in segments]
    # Just before the blocks (the event before the phase's first, where the blocks come first).
    before = [start + cut - 1 for start in starts]
    moments: list[Moment] = [tuple((s, starts[s] + t, c) for s, c in enumerate(coefficients)) for t in range(cut)]
    insertion = tuple((s, before[s], c) for s, c in enumerate(coefficients))
    added: tuple = ()  # what the blocks so far add
    for k, (extra, copies) in enumerate(zip(blocks, depths.weights), start=1):
        one = ((k, before[k] + extra, 1), (k, before[k], -1))  # what one copy adds
        for copy in sorted({1, int(copies)}):
            repeats = tuple((s, e, c * (copy - 1)) for s, e, c in one)
            for offset in range(extra):
                # (The reading of the event that makes the moment last: it says whether it is an allocation.)
                course = ((k, before[k], -1), (k, before[k] + 1 + offset, 1))
                moments.append(insertion + added + repeats + course)
        added += tuple((s, e, c * int(copies)) for s, e, c in one)
    moments += [
        tuple((s, starts[s] + t + ([0] + blocks)[s], c) for s, c in enumerate(coefficients)) for t in range(cut, length)
    ]
    return moments


def _insertion(sigs: list[list]) -> tuple[int, int, list[int]] | None:
    """Where each further sample's block goes in the base's events (``sigs[0]``), the base's length and
    each block's length, where every sample is the base with one block inserted at one point (None
    where not)."""
    base, length = sigs[0], len(sigs[0])
    cut_low, cut_high, blocks = 0, length, []
    for other in sigs[1:]:
        if len(other) < length:
            return None
        cut_low = max(cut_low, length - common_prefix(base[::-1], other[::-1]))
        cut_high = min(cut_high, common_prefix(base, other))
        blocks.append(len(other) - length)
    return None if cut_low > cut_high else (cut_low, length, blocks)


def _last_alloc(sig: list) -> int:
    """The index of the last allocation in ``sig`` (-1 where there is none)."""
    return next((i for i in range(len(sig) - 1, -1, -1) if sig[i][0] == "alloc"), -1)


def _head_and_tail(results: list, segments, coefficients: list[Fraction]) -> list[Moment]:
    """The moments of a phase that every sample shares at its start and at its end, extrapolated."""
    sigs = [_signatures(r, seg.start_event + 1, seg.end_event + 1) for r, seg in zip(results, segments)]
    head = min(common_prefix(sigs[0], other) for other in sigs)
    tail = min(common_prefix(sigs[0][::-1], other[::-1]) for other in sigs)
    firsts = [seg.start_event + 1 for seg in segments]
    lasts = [seg.end_event + 1 - tail for seg in segments]
    return (
        [tuple((s, firsts[s] + t, c) for s, c in enumerate(coefficients)) for t in range(head)]
        + [tuple((s, lasts[s] + t, c) for s, c in enumerate(coefficients)) for t in range(tail)]
        + _apex(results, firsts, sigs, head, tail, coefficients)
    )


def _apex(
    results: list, firsts: list[int], sigs: list[list], head: int, tail: int, coefficients: list[Fraction]
) -> list[Moment]:
    """The phase's highest event, extrapolated, where it lies between the shared head and tail in
    every sample and is the same operation in each (else nothing).

    Such a phase rises through every layer and falls again: PyTorch's foreach AdamW makes a
    temporary of each parameter, one after the other, before it frees any. A further layer adds
    events to the rise and to the fall, so the top, after the last temporary is made, is the same
    operation at every depth, and its memory grows with each kind's number like any moment."""
    tops = []
    for result, first, sig in zip(results, firsts, sigs):
        live = result.live_bytes()[first : first + len(sig)]
        top = max(range(len(live)), key=live.__getitem__) if live else -1
        if not head <= top < len(sig) - tail:
            return []
        tops.append(top)
    if len({sig[top] for sig, top in zip(sigs, tops)}) != 1:
        return []
    return [tuple((s, firsts[s] + tops[s], c) for s, c in enumerate(coefficients))]


def _highest(results: list, moments: list[Moment], phase: str, reshape: Reshape | None):
    """The highest of ``moments`` (its value and categories): by live bytes just after an
    allocation on one GPU, by one rank's bytes after ``reshape`` at any moment; None if none counts."""
    if reshape is None:
        lives = [r.live_bytes() for r in results]
        # A moment counts where the event that makes it is an allocation (the last reading's sample
        # and event: the sample holding the block, or the base).
        counted = [m for m in moments if results[m[-1][0]].events[m[-1][1]][0] == "alloc"]
        if not counted:
            return None
        top = max(counted, key=lambda m: sum(float(c) * lives[s][e] for s, e, c in m))
        return round(sum(c * lives[s][e] for s, e, c in top)), _categories_at(results, top)
    series = [category_series(r) for r in results]

    def rank_bytes(moment: Moment) -> float:
        mixed = {name: 0.0 for name in series[0][0]} if series[0] else {}
        for s, e, c in moment:
            for name, value in series[s][e].items():
                mixed[name] += float(c) * value
        return sum(reshape({k: max(v, 0.0) for k, v in mixed.items()}, phase).values())

    if not moments:
        return None
    top = max(moments, key=rank_bytes)
    categories = reshape(_categories_at(results, top), phase)
    return sum(categories.values()), categories


def _categories_at(results: list, moment: Moment) -> dict[str, int]:
    """The categories at ``moment``, each extrapolated (and never below 0)."""
    totals: dict[str, int | Fraction] = {}
    for s, e, c in moment:
        for name, value in results[s].categories_at(e).items():
            totals[name] = totals.get(name, 0) + c * value
    return {name: max(round(value), 0) for name, value in totals.items()}


def reshaped_peak(result, reshape: Reshape, remember: bool = True) -> tuple[str, dict[str, int], dict[str, int]]:
    """The highest moment of a whole simulation after ``reshape``: phase, categories, per-phase peaks."""
    tops = phase_tops(result, reshape, remember)
    if not tops:
        return result.peak.phase, reshape(dict(result.peak.categories), result.peak.phase), {}
    # The first moment at the highest (tops keep each phase's first).
    phase = max(tops, key=lambda p: (tops[p][0], -tops[p][1]))
    return phase, reshape(dict(tops[phase][2]), phase), {p: top[0] for p, top in tops.items()}


def phase_tops(result, reshape: Reshape, remember: bool = True) -> dict[str, tuple[int, int, dict[str, int]]]:
    """Each phase's highest moment after ``reshape``: (one rank's bytes, the event, the single-GPU
    categories there), the first such moment of the phase."""
    series = category_series(result, remember)
    tops: dict[str, tuple[int, int, dict[str, int]]] = {}
    for seg in result.segments():
        for event in range(seg.start_event + 1, seg.end_event + 1):
            total = sum(reshape(series[event], seg.phase).values())
            if seg.phase not in tops or total > tops[seg.phase][0]:
                tops[seg.phase] = (total, event, series[event])
    return tops


def category_series(result, remember: bool = True) -> list[dict[str, int]]:
    """Live device bytes by category just after each event (``categories_at`` for every event, in
    one pass), kept in the memo by result when ``remember``."""
    cached = MEMO.series.get(id(result)) if remember else None
    if cached is not None and cached[0] is result:
        return cached[1]
    from memfit.planner.categories import TRACKED_CATEGORIES

    info = {a.alloc_id: (a.category, a.nbytes) for a in result.allocations if a.place == "device"}
    live = dict.fromkeys(TRACKED_CATEGORIES, 0)
    series = []
    for kind, alloc_id, _ in result.events:
        category, nbytes = info[alloc_id]
        live[category] += nbytes if kind == "alloc" else -nbytes
        series.append(dict(live))
    if remember:
        MEMO.keep("series", id(result), (result, series))
    return series


def _signatures(result, first: int, stop: int) -> list[tuple[str, int, str]]:
    """(event kind, bytes, op) of events ``first`` to ``stop - 1``: what an event does, without ids."""
    allocations = result.allocations
    if not all(allocations[i].alloc_id == i for i in (0, len(allocations) - 1) if allocations):
        allocations = {a.alloc_id: a for a in allocations}  # not listed by id (the tracker lists them so)
    out = []
    for kind, alloc_id, _ in result.events[first:stop]:
        a = allocations[alloc_id]
        out.append((kind, a.nbytes, a.op))
    return out


def common_prefix(a: list, b: list) -> int:
    """How many items ``a`` and ``b`` share at their start."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
